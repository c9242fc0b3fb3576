"""Every ``python -m ...`` and console command (``mmkv-eval``, ``mmkv-bench``, ``mmkv-calibrate``, ``mmkv-app``)
written in docs/*.md, README.md and eval/README.md still exists: each answers ``--help`` with exit status 0.

The commands run in one subprocess (the imports dominate; one interpreter shares them), with the repository first
on the path so that the checkout, not an installed copy, answers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "eval" / "README.md"]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
SKIP = {"pytest", "pip", "venv", "http.server"}  # tools, not this project's commands

RUNNER = r'''
import contextlib, importlib, io, json, runpy, sys, warnings
warnings.simplefilter("ignore")
bad = []
for kind, target, args in json.loads(sys.argv[1]):
    sys.argv = [target, *args, "--help"]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
                code = 0
            else:
                mod, fn = target.split(":")
                code = getattr(importlib.import_module(mod), fn)([*args, "--help"])
    except SystemExit as e:
        code = e.code
    except Exception as e:  # an import error or a crash: the documented command is broken
        code = repr(e)
    if code not in (0, None):
        bad.append([kind, target, args, str(code)])
print(json.dumps(bad))
'''


def documented() -> set[tuple[str, str, tuple[str, ...]]]:
    """(kind, module or entry point, leading subcommand words) of every command written in the docs."""
    found = set()
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in re.finditer(r"python3? -m ([A-Za-z_][\w.]*)((?: [a-z][\w-]*)?)", text):
            mod, sub = m.group(1), m.group(2).split()
            if mod.split(".")[0] in SKIP or not (ROOT / mod.split(".")[0]).exists():
                continue
            # a bare word after a package dispatcher (eval.bench budget) is its subcommand
            found.add(("module", mod, tuple(sub) if mod == "eval.bench" else ()))
        for m in re.finditer(r"\b(mmkv-(?:eval|bench|calibrate|app))\b((?: [a-z][\w-]*)?)", text):
            name, sub = m.group(1), m.group(2).split()
            found.add(("entry", SCRIPTS[name], tuple(sub) if name in ("mmkv-bench", "mmkv-calibrate") else ()))
    return found


def test_the_docs_name_commands():
    kinds = {k for k, _, _ in documented()}
    assert kinds == {"module", "entry"}, kinds


def test_every_documented_command_parses_help():
    cmds = sorted(documented())
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", RUNNER, json.dumps([[k, t, list(a)] for k, t, a in cmds])],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    bad = json.loads(res.stdout.strip().splitlines()[-1])
    assert not bad, f"documented commands that do not answer --help: {bad}"
