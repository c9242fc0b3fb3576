"""How kernel test files run their Triton kernels: compiled on CUDA, or on CPU under Triton's interpreter.

Triton reads ``TRITON_INTERPRET`` once, when ``triton`` is first imported (its ``@jit`` decorator captures the mode
then). A kernel test file therefore calls :func:`switch_on` before it imports triton or ``kernels``. Run alone
(``pytest tests/test_kernels.py``) the switch takes effect; in the full suite an earlier file has usually imported
triton already, so :func:`fixtures` skips every test of the file but one, which re-runs the whole file in a fresh
Python process with the switch on and reports that run's output when it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parent.parent


def switch_on() -> tuple[bool, bool]:
    """Set TRITON_INTERPRET=1 if that can still work. -> (kernels run in this process, this call set the switch)."""
    we_set = False
    if not CUDA and "triton" not in sys.modules and os.environ.get("TRITON_INTERPRET") is None:
        os.environ["TRITON_INTERPRET"] = "1"
        we_set = True
    return CUDA or os.environ.get("TRITON_INTERPRET") == "1", we_set


def fixtures(test_file: str, in_process: bool, we_set: bool, **child_env: str):
    """The two autouse fixtures and the subprocess test a kernel test file binds at module level:
    ``_in_process_only, _restore_env, test_interpreter_subprocess = fixtures(__file__, *switch_on())``."""

    @pytest.fixture(autouse=True)
    def _in_process_only(request, monkeypatch):
        if not in_process and request.node.originalname != "test_interpreter_subprocess":
            pytest.skip("triton was imported before TRITON_INTERPRET could be set: covered by test_interpreter_subprocess")
        if in_process and not CUDA:
            # another kernel file that set the switch may have dropped it when its own tests ended (_restore_env),
            # while triton stays in interpreter mode: the dispatch must still see it for this file's tests
            monkeypatch.setenv("TRITON_INTERPRET", "1")

    @pytest.fixture(scope="module", autouse=True)
    def _restore_env():
        """Later test files must keep the torch reference on CPU: drop the switch once this file is done."""
        yield
        if we_set:
            os.environ.pop("TRITON_INTERPRET", None)

    def test_interpreter_subprocess():
        if in_process:
            pytest.skip("kernels run in this process")
        env = dict(os.environ, TRITON_INTERPRET="1", **child_env)
        res = subprocess.run([sys.executable, "-m", "pytest", str(Path(test_file).resolve()), "-q", "-p",
                              "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]

    return _in_process_only, _restore_env, test_interpreter_subprocess
