"""Offline calibration for the methods that need it (``needs_artifact``): ``mmkv-calibrate METHOD --model NAME``.

Each method's calibration lives in ``mmkv/calibrate/<method>.py`` with a ``main(argv)``; artifacts are written
by ``artifacts.Artifact.save`` (safetensors + JSON) to ``artifacts.default_dir(model, method)`` unless ``--out``
says otherwise, and read back by the method when a cache is built for that model.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

from ..methods.artifacts import META, TENSORS, Artifact, calibrate_command, default_dir, load

COMMANDS = {name: f"mmkv.calibrate.{name}" for name in ("skvq", "aquakv", "calibquant")
            if importlib.util.find_spec(f"mmkv.calibrate.{name}") is not None}


def artifact_status(method: str, model: str) -> tuple[bool, str]:
    """(whether the default artifact of ``method`` for ``model`` exists, the command that makes it): the app shows
    the command when a chosen method lacks its artifact."""
    folder = default_dir(model, method)
    return (folder / META).is_file() and (folder / TENSORS).is_file(), calibrate_command(method, model)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: mmkv-calibrate {{{','.join(COMMANDS)}}} --model NAME [options]\n\n{__doc__}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0


__all__ = ["Artifact", "COMMANDS", "artifact_status", "calibrate_command", "default_dir", "load", "main"]
