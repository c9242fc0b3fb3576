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
    interpreted = not CUDA and os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted:
        patch_helpers_once()
    return CUDA or interpreted, we_set


class _Kept:
    """The scope a helper call gets when its launch's patch already covers it: nothing of its own to undo."""

    def restore(self) -> None:
        pass


def patch_helpers_once() -> bool:
    """Let ``@triton.jit`` helpers called inside an interpreted kernel use the launch's patch of ``triton.language``.

    Triton's interpreter patches the language module when a launch starts and restores it when the grid ends; every
    call of a helper from inside the kernel patches it again (``InterpretedFunction.__call__`` -> ``_patch_lang``: an
    ``inspect.getmembers`` walk over ``tl``, ``tl.tensor`` and ``tl.math``, ~3 ms), setting the attributes the launch
    already set (Triton's own ``tl.sum``, ``tl.max``, ``tl.zeros`` are such helpers). That was a third of the
    interpreter files' time (cProfile of the extend tests: 7,074 walks, 22 of 66 s). Here a helper whose language
    modules were patched since the launch started skips the walk; anything else (no launch running, a module not yet
    patched, interpreter internals of another Triton) goes Triton's own way.
    The kernels execute the same operations either way. -> whether the shortcut is installed."""
    from triton.runtime import interpreter as it

    own = getattr(it, "_patch_lang", None)
    if own is None or getattr(own, "_mmkv_kept", False) or not hasattr(it, "tl"):
        return False
    tl = it.tl
    patched = None  # the language modules patched since the running launch started (one launch at a time)

    def langs(fn) -> set:
        return {v for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_lang(fn):
        nonlocal patched
        if patched is not None:
            need = langs(fn)
            if need <= patched:
                return _Kept()
            patched |= need  # patched from here on: Triton never restores a helper's own patch
            return own(fn)
        scope = own(fn)
        patched = langs(fn)
        restore = scope.restore

        def restore_and_leave():
            nonlocal patched
            patched = None
            restore()

        scope.restore = restore_and_leave
        return scope

    patch_lang._mmkv_kept = True
    it._patch_lang = patch_lang
    return True


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
