"""Compiling the Gluon kernels for sm_90 in a fresh interpreter, for the tests that count what their loops issue
(``test_kernel_sass.py``, ``test_text_gluon.py``, ``test_skvq_gluon.py``). A fresh process: an earlier test module
may have imported triton with TRITON_INTERPRET=1, which turns every ``@jit`` function into an interpreted one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def compiled_reports(tmp, calls: str, timeout: int = 600) -> list:
    """Runs ``calls`` (a list expression over ``eval.bench.sass``'s ``report``, ``text_report``, ``skvq_report`` and
    ``append_report``, with ``tmp`` bound to a scratch folder) in a fresh interpreter; skips the test where Triton has
    no Gluon."""
    code = ("import json, sys; from eval.bench.sass import append_report, report, skvq_report, text_report\n"
            "from kernels.decode.gluon import HAVE_GLUON\n"
            "if not HAVE_GLUON: print('null'); sys.exit()\n"
            f"tmp = {str(tmp)!r}\nprint(json.dumps({calls}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if out is None:
        pytest.skip("this Triton has no Gluon")
    return out


def loop_count(r: dict) -> int:
    """Instructions of a report's hot loop: the sum of its opcode counts (the upper-case keys)."""
    return sum(v for k, v in r.items() if k.isupper())
