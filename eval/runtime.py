"""What every task shares at run time: one lazily loaded model + engine, greedy generation into a record, and
the environment facts that config.json records (versions, device, date, git commit)."""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Runtime:
    """Loads the model on first use only, so a run whose samples are all done never pays for a model load."""

    def __init__(self, model: str, opts: dict, loader=None):
        self.model_name = model
        self.opts = opts
        self._loader = loader
        self._lm = self._engine = None
        self.cache: dict = {}  # per-run memo for tasks (tokenized wikitext, ...)

    @property
    def lm(self):
        if self._lm is None:
            if self._loader is not None:
                self._lm, self._engine = self._loader(self.model_name)
            else:
                import mmkv

                self._lm = mmkv.load_model(self.model_name, **load_options(self.opts))
                self._engine = mmkv.Engine(self._lm)
        return self._lm

    @property
    def engine(self):
        self.lm  # noqa: B018 - loads both
        return self._engine

    @property
    def loaded(self) -> bool:
        return self._lm is not None

    @property
    def tokenizer(self):
        proc = self.lm.processor
        return getattr(proc, "tokenizer", proc)


def load_options(opts: dict) -> dict:
    """``load_model`` arguments from the run options: this process's device under a data-parallel launch, or a
    device map (several GPUs for one model)."""
    kw = {}
    if opts.get("device_map"):
        kw["device_map"] = opts["device_map"]
        if opts.get("max_memory"):
            kw["max_memory"] = opts["max_memory"]
    elif opts.get("device"):
        kw["device"] = opts["device"]
    return kw


def compact_stats(stats: dict) -> dict:
    """The engine's stats minus the per-step timeline (too long to keep per sample)."""
    return {k: v for k, v in stats.items() if k != "timeline"}


def generate(rt: Runtime, inputs, spec: str, max_new_tokens: int, **kw) -> dict:
    out = rt.engine.generate(inputs, spec=spec, max_new_tokens=max_new_tokens, do_sample=False, **kw)
    return {"prediction": out.text[0].strip(), "tokens": [int(t) for t in out.tokens[0].tolist()],
            "stats": compact_stats(out.stats)}


def mean_kv_mib(records: list[dict]) -> float | None:
    """Mean exact cache bytes held per sample (all modalities), in MiB."""
    sizes = [sum(r["stats"]["cache_bytes"].values()) for r in records
             if isinstance(r.get("stats", {}).get("cache_bytes"), dict)]
    return sum(sizes) / len(sizes) / 2**20 if sizes else None


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        if pkg == "mmkv":  # a source checkout that was not pip-installed
            import mmkv

            return getattr(mmkv, "__version__", None)
        return None


def _git_commit() -> str | None:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    import torch

    if torch.cuda.is_available():
        device = f"cuda: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    else:
        device = f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return {
        "versions": {p: _version(p) for p in ("mmkv", "torch", "transformers", "pycocoevalcap", "triton")},
        "python": platform.python_version(),
        "device": device,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
    }
