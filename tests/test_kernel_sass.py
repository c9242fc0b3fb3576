"""The Gluon channel kernels compile for the H100 (sm_90) on this CPU-only machine, and their hot loops issue what
docs/KERNELS.md counts: one ``and`` per two codes and one fp16 MMA per 256 codes on each fp16 side, one ``and`` per
four codes and one int8 MMA per 512 codes on an int8 K side (1-bit codes, up to 4 query heads), no local memory;
the codes arrive by ``cp.async`` where the shared-memory ring is on and by plain loads where it is off; the range
pass lets the main pass start early and the main pass waits for it, then lets the merge start
(``griddepcontrol``). Gluon kernels cannot run under the Triton interpreter, so this is what CI can check of them;
their numbers are tested on the GPU (tests/test_kernels.py -k gpu).

Compiled in a subprocess: an earlier test module may have imported triton with TRITON_INTERPRET=1, which turns
every ``@jit`` function into an interpreted one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent

# (bits, head_dim, 0 main / 1 range, query heads per KV head): 1-bit with G <= 4 takes the int8 K side
CASES = [(1, 128, 0, 4), (1, 128, 1, 4), (1, 64, 0, 8), (1, 64, 1, 8), (2, 64, 0, 4), (8, 64, 0, 4), (8, 128, 1, 4)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sass")
    code = ("import json, sys; from eval.kernel_sass import report; from kernels._gluon_channel import HAVE_GLUON\n"
            "if not HAVE_GLUON: print('null'); sys.exit()\n"
            f"print(json.dumps([report(b, d, g, m, 2, 90, {str(tmp)!r}) for b, d, m, g in {CASES!r}]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if out is None:
        pytest.skip("this Triton has no Gluon")
    return dict(zip(CASES, out, strict=True))


@pytest.mark.parametrize("case", CASES, ids=[f"{b}bit-D{d}-{'range' if m else 'main'}-G{g}" for b, d, m, g in CASES])
def test_hot_loop_and_and_mma_counts(reports, case):
    bits, D, mode, G = case
    r = reports[case]
    tokens = r["tokens_per_warp_iteration"]
    assert r["int8_k"] == (bits == 1 and G <= 4), r
    assert r["local"] == 0, f"local memory (spills): {r}"
    side_codes = tokens * D  # token-channel codes of one side (K or V) per warp iteration
    k_and = side_codes // 32 // (4 if r["int8_k"] else 2)  # per lane
    v_and = 0 if mode else side_codes // 32 // 2  # the range pass reads K only
    if r["int8_k"]:  # m16n8k32 int8: 16 rows x 32 codes per MMA; the V side stays m16n8k16 fp16
        assert r["imma"] == side_codes // 512 and r["hmma"] == (0 if mode else side_codes // 256), r
    else:  # m16n8k16: 16 rows x 16 codes per MMA and side
        assert r["imma"] == 0 and r["hmma"] == (1 if mode else 2) * side_codes // 256, r
    assert k_and + v_and <= r["lop3"] <= k_and + v_and + 2, r
    assert r["reg"] <= 168, r  # at least 12 warps of 2-warp programs per SM
    if r["stages"]:
        assert r["ldgsts"] > 0 and r["ldg"] == 0, r
    else:
        assert r["ldg"] > 0 and r["ldgsts"] == 0, r
    assert r["griddepcontrol"] == (1 if mode else 2), r  # range: launch_dependents; main: wait, launch_dependents
