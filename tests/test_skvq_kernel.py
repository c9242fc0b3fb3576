"""SKVQ decode kernel (kernels/decode/skvq.py) vs the torch reference (kernels/reference.py; layout in kernels/layouts.py).

Runs under Triton's interpreter on CPU, compiled on CUDA; the switch works as in tests/test_kernels.py (set before
triton is imported, else this file re-runs itself in a subprocess). Inputs are random and never zero, sizes odd
(3 KV heads x 3 query heads, 63 / 577 tokens, rows of different lengths, one row of length 0 in a segment),
outputs pre-filled with NaN. Threshold: relative error (L2 over the whole output) < 2e-3 against the fp32
reference, as for the other kernels (operands are fp16 on tensor cores, accumulation fp32).
"""

from __future__ import annotations

from functools import partial

import torch
from triton_switch import CUDA, fixtures, switch_on

IN_PROCESS, _WE_SET_INTERPRET = switch_on()  # before triton and the kernels are imported

import pytest  # noqa: E402

import kernels  # noqa: E402
from kernels import testing  # noqa: E402
from kernels.reference import attention_over_segments  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


_in_process_only, _restore_env, test_interpreter_subprocess = fixtures(__file__, IN_PROCESS, _WE_SET_INTERPRET)


# segment builders (kernels/testing.py): drawn on the CPU from ``g``, moved to DEV
skvq_seg = partial(testing.skvq_seg, device=DEV)
dense_seg = partial(testing.dense_seg, device=DEV)
kivi_seg = partial(testing.kivi_seg, device=DEV)  # 2 bits, block and group 32


def check(q, segs, tol=2e-3):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    res, lse = kernels.decode_attention(q, segs, return_lse=True, out=out)
    ref, ref_lse = attention_over_segments(q.float().unsqueeze(2), segs)
    ref, ref_lse = ref.squeeze(2), ref_lse.squeeze(2)
    assert not torch.isnan(res).any(), "unwritten or NaN output"
    err = ((res.float() - ref).norm() / ref.norm()).item()
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert torch.allclose(lse[fin], ref_lse[fin], rtol=1e-3, atol=1e-2)
    return err


CASES = [  # (D, k_bits, v_bits, groups per head, fixed sizes, permuted, fp8, tokens)
    (64, 2, 2.0, 2, False, True, False, 63),
    (64, 2, 1.5, 1, True, False, False, 63),
    (64, 3, 1.5, 4, False, True, True, 63),
    (128, 1, 3.0, 4, True, True, False, 63),
    (128, 4, 1.5, 2, False, True, False, 577),
    (64, 8, 1.0, 2, True, True, True, 577),
    (128, 2, 8.0, 1, True, False, True, 63),
    (64, 2, 4.0, 2, False, False, False, 63),
]


@pytest.mark.parametrize("D,kb,vb,ng,fixed,perm,fp8,T", CASES,
                         ids=[f"D{c[0]}-K{c[1]}V{c[2]:g}-ng{c[3]}-{'fix' if c[4] else 'var'}-"
                              f"{'perm' if c[5] else 'nat'}-{'fp8' if c[6] else 'fp16'}-T{c[7]}" for c in CASES])
def test_skvq_segment_matches_reference(D, kb, vb, ng, fixed, perm, fp8, T):
    g = torch.Generator().manual_seed(D + kb * 10 + int(vb * 100) + ng + T)
    B, H, G = 3, 3, 3
    segs = [skvq_seg(B, H, T, D, [T, T // 2 + 1, 0], kb, vb, ng, fixed, perm, fp8, g=g),
            dense_seg(B, H, 9, D, [9, 4, 2], g=g)]
    q = torch.randn(B, H * G, D, generator=g).to(DEV, torch.float16)
    check(q, segs)


def test_mixed_with_dense_and_kivi_segments_in_one_call():
    """Sinks (dense) + KIVI text + SKVQ text + window (dense): one plan, one merge."""
    g = torch.Generator().manual_seed(123)
    B, H, G, D = 2, 3, 3, 64
    segs = [dense_seg(B, H, 5, D, [5, 3], g=g),
            kivi_seg(B, H, 40, D, [40, 0], g=g),
            skvq_seg(B, H, 100, D, [77, 100], 2, 1.5, 2, False, True, True, g=g),
            dense_seg(B, H, 17, D, [17, 9], g=g)]
    q = torch.randn(B, H * G, D, generator=g).to(DEV, torch.float16)
    check(q, segs)


def test_gqa_groups_and_fp32_query():
    g = torch.Generator().manual_seed(9)
    B, H, D = 2, 1, 64
    segs = [skvq_seg(B, H, 50, D, [50, 21], 2, 2.0, 2, False, True, False, g=g)]
    q = torch.randn(B, 8 * H, D, generator=g).to(DEV, torch.float32)
    check(q, segs)
