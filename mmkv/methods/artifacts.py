"""Calibration artifacts: tensors in safetensors, everything else in JSON, tied to the model they were made for.

A folder per (model, method)::

    <dir>/tensors.safetensors   the method's tensors (permutations, group bounds, clip ratios, predictors, ...)
    <dir>/meta.json             method, model name, layer/head shape, calibration data, parameters, date

Default location: ``$MMKV_CACHE_DIR/calib/<model>/<method>`` (``~/.cache/mmkv`` when unset), which is where
``mmkv-calibrate`` writes and where a method looks when its spec names no ``artifact=``. Nothing here unpickles.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..paths import cache_dir

TENSORS, META = "tensors.safetensors", "meta.json"


def default_dir(model_name: str, method: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "--", model_name.strip("/"))
    return cache_dir() / "calib" / safe / method


def calibrate_command(method: str, model_name: str) -> str:
    """The command that makes the missing artifact (shown by errors and by the app)."""
    return f"mmkv-calibrate {method} --model {model_name}"


def shape_of(adapter) -> dict:
    return {"num_layers": adapter.num_layers, "num_kv_heads": adapter.num_kv_heads, "head_dim": adapter.head_dim}


@dataclass
class Artifact:
    method: str
    model: str
    shape: dict
    tensors: dict[str, torch.Tensor]
    meta: dict = field(default_factory=dict)  # data used, parameters, anything JSON-serializable

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.tensors.items()}, str(folder / TENSORS))
        doc = {"method": self.method, "model": self.model, "shape": self.shape,
               "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), **self.meta}
        (folder / META).write_text(json.dumps(doc, indent=1, default=str))
        return folder


def load(folder: str | Path | None, method: str, adapter) -> Artifact:
    """Read the artifact of ``method`` for the model of ``adapter`` (``folder=None``: the default location).

    Raises ``FileNotFoundError`` naming the command that makes it, and ``ValueError`` when it was made for a
    different method, model or layer/head shape.
    """
    folder = Path(folder).expanduser() if folder else default_dir(adapter.name, method)
    if not (folder / META).is_file() or not (folder / TENSORS).is_file():
        raise FileNotFoundError(f"{method}: no calibration artifact for model {adapter.name!r} in {folder}; "
                                f"make one with: {calibrate_command(method, adapter.name)}")
    doc = json.loads((folder / META).read_text())
    if doc.get("method") != method:
        raise ValueError(f"{folder} holds a {doc.get('method')!r} artifact, not {method!r}")
    want = shape_of(adapter)
    if doc.get("model") != adapter.name or doc.get("shape") != want:
        raise ValueError(f"{method}: the artifact in {folder} was made for model {doc.get('model')!r} "
                         f"{doc.get('shape')}, not for {adapter.name!r} {want}; "
                         f"make one with: {calibrate_command(method, adapter.name)}")
    meta = {k: v for k, v in doc.items() if k not in ("method", "model", "shape")}
    return Artifact(method, doc["model"], doc["shape"], load_file(str(folder / TENSORS)), meta)
