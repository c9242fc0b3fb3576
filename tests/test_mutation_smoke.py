"""CI's fast smoke of `make mutate`: mutmut with the repository's [tool.mutmut] config, narrowed to a few functions of
mmkv/methods/quant.py and the one test file written for them, must kill at least THRESHOLD of its mutants.

What it guards: the mutation setup itself (config keys, copying the packages into mutants/, imports resolving to the
mutated copy, test selection by trampoline hits). A broken setup shows up as no mutants, everything "no tests", or
everything surviving, and fails here. The full run (hour-scale on 2 cores) is `make mutate`; docs/TESTING.md.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import mutation_score
import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULE = "mmkv/methods/quant.py"
TESTS = "tests/test_quant_rules.py"
FUNCTIONS = ["mmkv.methods.quant.x_minmax_codes__mutmut_*", "mmkv.methods.quant.x_pad_tokens__mutmut_*",
             "mmkv.methods.quant.x_token_valid__mutmut_*"]
THRESHOLD = 0.9   # measured: docs/TESTING.md (CI smoke)
MIN_MUTANTS = 20

pytest.importorskip("mutmut")


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(v)


def test_mutmut_kills_the_mutants_of_a_small_module(tmp_path):
    cfg = dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"])
    assert MODULE in cfg["only_mutate"] or any(Path(MODULE).match(p) for p in cfg["only_mutate"])
    cfg["only_mutate"] = [MODULE]
    cfg["pytest_add_cli_args_test_selection"] = [TESTS]
    (tmp_path / "pyproject.toml").write_text(
        "[tool.mutmut]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in cfg.items()))
    for name in cfg["source_paths"]:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "tests").mkdir()
    for name in ("conftest.py", Path(TESTS).name):
        shutil.copy(ROOT / "tests" / name, tmp_path / "tests" / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MUTANT_UNDER_TEST", "TRITON_INTERPRET")}
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", "2", *FUNCTIONS],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = (res.stdout[-3000:] + res.stderr[-3000:]).replace("\r", "\n")
    assert res.returncode == 0, out
    counts = mutation_score.counts(tmp_path, only=[MODULE])[MODULE]
    checked = counts["killed"] + counts["timeout"] + counts["survived"] + counts["no tests"]
    assert checked >= MIN_MUTANTS, (counts, out)
    assert mutation_score.score(counts) >= THRESHOLD, (counts, out)
