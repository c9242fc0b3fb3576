"""The Gluon KIVI/XQuant decode kernel (``kernels/decode/gluon/text.py``).

On CPU (CI): it compiles for the H100 (sm_90) and its hot loop issues what the design says per warp iteration of
32 tokens (2-bit keys, 2- or 1-bit values, head_dim 128): 40 fp16 MMAs (16 K side, 8 for the zero term, 16 V side), one ``fma`` per
two dequantized values (64), no shared memory, no barrier, no local memory. Gluon cannot run under the Triton
interpreter, so its numbers are tested on the GPU (``-m gpu``): against the torch reference on odd and ragged
lengths, GQA groups 1-8, K blocks of 32-128 tokens and V groups of 16-64 channels, output pre-filled with NaN.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("vbits", [2, 1])
def test_text_kernel_hot_loop_counts(tmp_path, vbits):
    code = ("import json, sys; from kernels.decode.gluon import HAVE_GLUON\n"
            "if not HAVE_GLUON: print('null'); sys.exit()\n"
            "from eval.bench.sass import text_report\n"
            f"print(json.dumps(text_report({str(tmp_path)!r}, vbits={vbits})))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    if r is None:
        pytest.skip("this Triton has no Gluon")
    assert r["local"] == 0, r
    assert r["loops"] == 1, r
    assert r["HMMA"] == 40, r
    assert r.get("HFMA2", 0) == 64, r  # one fma per pair of V values: 32 tokens x 128 channels / 32 lanes / 2
    for op in ("BAR", "STS", "LDS", "STL", "LDL"):
        assert r.get(op, 0) == 0, (op, r)


CASES = [  # B, H, G, capacity, lens, K block, V group, V bits
    (2, 2, 4, 777, [777, 500], 32, 32, 2), (2, 2, 8, 777, [40, 1], 32, 32, 2), (3, 1, 1, 1000, [1000, 999, 33], 64, 64, 2),
    (1, 3, 7, 300, [257], 128, 16, 2), (2, 8, 4, 4096, [4096, 3001], 32, 32, 2), (2, 1, 2, 96, [0, 95], 32, 32, 2),
    (2, 2, 4, 777, [777, 500], 32, 32, 1), (3, 1, 8, 1000, [1000, 3, 999], 64, 16, 1),
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}H{c[1]}G{c[2]}T{c[3]}k{c[5]}g{c[6]}v{c[7]}" for c in CASES])
def test_gpu_text_kernel_matches_reference(case, monkeypatch):
    import kernels
    from kernels import testing
    from kernels.decode.plan import plan_items
    from kernels.reference import decode_reference

    B, H, G, T, lens, blk, grp, vbits = case
    g = torch.Generator().manual_seed(T + G)
    seg = testing.kivi_seg(B, H, T, 128, lens, 2, vbits, blk, grp, g=g, device="cuda")
    q = torch.randn(B, H * G, 128, generator=g).to("cuda", torch.float16)
    items, _, _ = plan_items(q, [seg], B, H, G, 128, 132, None, 2, True, None, None, 64)
    assert items[0]["tgl"], "the Gluon text kernel should read this segment"
    ref, ref_lse = decode_reference(q, [seg])
    out = torch.full_like(q, float("nan"))
    got, lse = kernels.decode_attention(q, [seg], out=out, return_lse=True)
    live = torch.tensor(lens, device="cuda") > 0
    err = (got.float() - ref.float())[live].norm() / ref.float()[live].norm()
    assert err < 1e-3, err.item()  # fp16 operands (q*s, dequantized V, p) with fp32 accumulation, as the Triton kernel
    assert not torch.isnan(got).any()
    assert torch.allclose(lse[live], ref_lse.float()[live], atol=2e-3, rtol=1e-4)
    assert (got[~live] == 0).all()
    monkeypatch.setenv("MMKV_TEXT_GLUON", "0")  # the Triton kernel agrees too
    tri = kernels.decode_attention(q, [seg])
    assert ((tri.float() - got.float())[live].norm() / ref.float()[live].norm()) < 1e-3
