"""SKVQ decode kernel (kernels/decode/skvq.py) vs the torch reference (kernels/reference.py; layout in kernels/layouts.py).

Runs under Triton's interpreter on CPU, compiled on CUDA; the switch works as in tests/test_kernels.py (set before
triton is imported, else this file re-runs itself in a subprocess). Inputs are random and never zero, sizes odd
(3 KV heads x 3 query heads, 63 / 577 tokens, rows of different lengths, one row of length 0 in a segment),
outputs pre-filled with NaN. Threshold: relative error (L2 over the whole output) < 2e-3 against the fp32
reference, as for the other kernels (operands are fp16 on tensor cores, accumulation fp32).
"""

from __future__ import annotations

import torch
from triton_switch import CUDA, fixtures, switch_on

IN_PROCESS, _WE_SET_INTERPRET = switch_on()  # before triton and the kernels are imported

import pytest  # noqa: E402

import kernels  # noqa: E402
from kernels.layouts import DenseSeg, KiviSeg, SkvqSeg, pack, pack_planes, pack_ternary  # noqa: E402
from kernels.reference import attention_over_segments  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


_in_process_only, _restore_env, test_interpreter_subprocess = fixtures(__file__, IN_PROCESS, _WE_SET_INTERPRET)


def lens_t(vals):
    return torch.tensor(vals, dtype=torch.int32, device=DEV)


def random_groups(h, d, ng, g):
    """Monotone group ids with random sizes (>= 1 channel each) per head."""
    out = []
    for _ in range(h):
        cuts = torch.randperm(d - 1, generator=g)[: ng - 1].sort().values + 1
        sizes = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([d])]))
        out.append(torch.repeat_interleave(torch.arange(ng), sizes))
    return torch.stack(out).to(torch.uint8)


def skvq_seg(B, H, T, D, lens, k_bits=2, v_bits=2.0, ng=2, fixed=False, perm=True, fp8=False, g=None):
    def side(bits):
        levels = 2 if bits == 1.5 else (1 << int(bits)) - 1
        codes = torch.randint(0, levels + 1, (B, H, T, D), generator=g, dtype=torch.uint8)
        scale = (torch.rand(B, H, T, ng, generator=g) * 0.4 + 0.05) * 3 / levels  # ranges alike across bits
        zero = torch.randn(B, H, T, ng, generator=g)
        if fp8:
            scale, zero = scale.to(torch.float8_e4m3fn), zero.to(torch.float8_e4m3fn)
        else:
            scale, zero = scale.half(), zero.half()
        if bits == 1.5:
            lo, hi = pack_ternary(codes), None
        else:
            planes = pack_planes(codes, int(bits), dim=3)
            lo, hi = planes[0], (planes[1] if len(planes) > 1 else None)
        p = torch.stack([torch.randperm(D, generator=g) for _ in range(H)]).to(torch.uint8) if perm else None
        size = D // ng if fixed else 0
        gid = (torch.arange(D) // (D // ng)).to(torch.uint8).expand(H, D).contiguous() if fixed \
            else random_groups(H, D, ng, g)
        mv = lambda t: None if t is None else t.to(DEV)  # noqa: E731
        return mv(lo), mv(hi), scale.to(DEV), zero.to(DEV), mv(p), gid.to(DEV), size

    kl, kh, ks, kz, kp, kg, kf = side(k_bits)
    vl, vh, vs, vz, vp, vg, vf = side(v_bits)
    return SkvqSeg(kl, kh, ks, kz, vl, vh, vs, vz, k_bits, float(v_bits), kp, kg, kf, vp, vg, vf, lens_t(lens))


def dense_seg(B, H, T, D, lens, g):
    return DenseSeg(torch.randn(B, H, T, D, generator=g).to(DEV, torch.float16),
                    torch.randn(B, H, T, D, generator=g).to(DEV, torch.float16), lens_t(lens))


def kivi_seg(B, H, T, D, lens, g):
    cap = -(-T // 32) * 32
    kc = torch.randint(0, 4, (B, H, cap, D), generator=g)
    vc = torch.randint(0, 4, (B, H, cap, D), generator=g)
    return KiviSeg(pack(kc, 2, 2).to(DEV), (torch.rand(B, H, cap // 32, D, generator=g) * 0.3 + 0.05).half().to(DEV),
                   torch.randn(B, H, cap // 32, D, generator=g).half().to(DEV), pack(vc, 2, 3).to(DEV),
                   (torch.rand(B, H, cap, D // 32, generator=g) * 0.3 + 0.05).half().to(DEV),
                   torch.randn(B, H, cap, D // 32, generator=g).half().to(DEV), 2, 2, 32, 32, lens_t(lens))


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
