"""Kernels vs their torch references (kernels/reference.py): pack/unpack and decode attention over mixed segments.

CPU: runs under Triton's interpreter. Triton chooses interpreter or compiler when a ``@triton.jit`` function is
*decorated*, its own standard library included, i.e. when ``triton`` is first imported: TRITON_INTERPRET=1 must
be set before that. So this module sets it at import when triton is not loaded yet (``pytest
tests/test_kernels.py``); when an earlier test module already imported triton (the full suite), every test here
is skipped but one, which re-runs this file in a fresh Python process with TRITON_INTERPRET=1 (and reports its
output on failure). GPU: the same file runs compiled, without TRITON_INTERPRET: ``python -m pytest
tests/test_kernels.py`` (the ``gpu`` tests then also run; they are skipped without CUDA).

Inputs are random and never zero; sizes are odd (3 KV heads x 3 query heads, spans of 1, 63, 577, 3328 tokens);
rows have different lengths and one segment has length 0 for a row; outputs are pre-filled with NaN.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from triton_switch import CUDA, fixtures, switch_on

IN_PROCESS, _WE_SET_INTERPRET = switch_on()  # before triton and the kernels are imported

import pytest  # noqa: E402

import kernels  # noqa: E402
from kernels import testing  # noqa: E402
from kernels.layouts import pack as ref_pack  # noqa: E402
from kernels.layouts import unpack as ref_unpack  # noqa: E402
from kernels.reference import attention_over_segments  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
gpu = pytest.mark.gpu


_in_process_only, _restore_env, test_interpreter_subprocess = fixtures(__file__, IN_PROCESS, _WE_SET_INTERPRET)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


# segment builders (kernels/testing.py): random, never zero, drawn on the CPU from ``g``, moved to DEV
dense_seg = partial(testing.dense_seg, device=DEV)
channel_seg = partial(testing.channel_seg, device=DEV)
kivi_seg = partial(testing.kivi_seg, device=DEV)


def check(q, segs, tol=2e-3, **kw):
    """Kernel into a NaN-filled ``out`` vs the fp32 reference; returns the relative error."""
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    res, lse = kernels.decode_attention(q, segs, return_lse=True, out=out, **kw)
    assert res.data_ptr() == out.data_ptr()
    ref, ref_lse = attention_over_segments(q.float().unsqueeze(2), segs)
    ref, ref_lse = ref.squeeze(2), ref_lse.squeeze(2)
    assert not torch.isnan(out).any(), "unwritten or NaN output"
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert torch.allclose(lse[fin], ref_lse[fin], rtol=1e-3, atol=1e-2)
    return err


# ---------------------------------------------------------------------------------------------------------------
# pack / unpack
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 4, 8], ids=lambda b: f"{b}bit")
@pytest.mark.parametrize("dim", [2, 3], ids=["tokens", "channels"])
def test_pack_roundtrip(bits, dim):
    g = torch.Generator().manual_seed(bits * 10 + dim)
    per = 8 // bits
    shape = [2, 3, 9 * per, 5] if dim == 2 else [2, 3, 7, 6 * per]
    codes = torch.randint(0, 2**bits, shape, generator=g).to(DEV)
    packed = kernels.pack(codes, bits, dim)
    assert torch.equal(packed.cpu(), ref_pack(codes.cpu(), bits, dim))
    assert torch.equal(kernels.unpack(packed, bits, dim).cpu(), ref_unpack(packed.cpu(), bits, dim))
    assert torch.equal(kernels.unpack(packed, bits, dim).cpu(), codes.cpu().to(torch.uint8))


# ---------------------------------------------------------------------------------------------------------------
# decode attention: a realistic mixed layer (sinks + visual + KIVI text + window)
# ---------------------------------------------------------------------------------------------------------------

LAYER_CASES = [
    # (head_dim, visual bits, calib, visual span)
    (64, 1, True, 63),
    (128, 1, False, 577),
    (64, 2, True, 577),
    (128, 2, False, 1),
    (64, 4, False, 63),
    (128, 4, True, 63),
    (64, 8, True, 1),
    (128, 8, False, 577),
]


@pytest.mark.parametrize("D,bits,calib,span", LAYER_CASES,
                         ids=[f"D{d}-{b}bit-{'calib' if c else 'nocalib'}-span{s}" for d, b, c, s in LAYER_CASES])
def test_mixed_layer(D, bits, calib, span):
    g = torch.Generator().manual_seed(D + bits * 7 + span)
    B, H, G = 2, 3, 3
    segs = [
        dense_seg(B, H, 4, D, [4, 3], g=g),                                   # sinks; row 1 one fewer
        channel_seg(B, H, span, D, bits, [span, max(1, span // 2)], (1.0, 2.0) if calib else None, g=g),
        kivi_seg(B, H, 40, D, [40, 0], g=g),                                  # text; row 1 has none
        dense_seg(B, H, 17, D, [17, 9], g=g),                                 # recent window
    ]
    q = torch.randn(B, H * G, D, generator=g).to(DEV, torch.float16)
    check(q, segs)


KIVI_CASES = [
    # (D, k_bits, v_bits, block, group, tokens, tile)
    (64, 2, 2, 32, 32, 300, 64),
    (64, 1, 1, 32, 32, 77, 128),
    (128, 2, 4, 16, 32, 45, 16),
    (64, 4, 2, 64, 16, 200, 32),
    (128, 8, 1, 32, 64, 129, 128),
    (64, 1, 2, 128, 32, 257, 64),
]


@pytest.mark.parametrize("D,kb,vb,block,group,n,tile", KIVI_CASES,
                         ids=[f"D{d}-k{k}v{v}-blk{b}-g{g}-n{n}-tile{t}" for d, k, v, b, g, n, t in KIVI_CASES])
def test_kivi_segment_tiles(D, kb, vb, block, group, n, tile):
    """KIVI/XQuant segments at every tile size the kernel allows, tiles spanning several key blocks or part of
    one, capacities that end inside a tile, with a window segment beside it."""
    g = torch.Generator().manual_seed(D + n + tile)
    B, H, G = 2, 3, 3
    segs = [kivi_seg(B, H, n, D, [n, max(0, n - 40)], k_bits=kb, v_bits=vb, block=block, group=group, g=g),
            dense_seg(B, H, 11, D, [11, 6], g=g)]
    q = torch.randn(B, H * G, D, generator=g).to(DEV, torch.float16)
    check(q, segs, text_tile=tile)


def test_long_visual_span():
    """3328 visual tokens (InternVL image), 1-bit + calibration: several splits merged."""
    g = torch.Generator().manual_seed(3328)
    B, H, G, D = 2, 3, 3, 64
    segs = [dense_seg(B, H, 4, D, [4, 4], g=g),
            channel_seg(B, H, 3328, D, 1, [3328, 3001], (1.0, 3.0), g=g)]
    q = torch.randn(B, H * G, D, generator=g).to(DEV, torch.float16)
    check(q, segs)


@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 1), (9, 3)], ids=["mha", "gqa8", "smollm2-9x3"])
def test_gqa_groups(hq, hk):
    g = torch.Generator().manual_seed(hq * 31 + hk)
    B, D = 2, 64
    segs = [channel_seg(B, hk, 63, D, 2, [63, 20], (0.0, 1.0), g=g), dense_seg(B, hk, 5, D, [5, 2], g=g)]
    q = torch.randn(B, hq, D, generator=g).to(DEV, torch.float16)
    check(q, segs)


def test_authors_clipped_calibquant_segment():
    """clip=authors saturates many codes at the range ends (V's range is cut to 0.3 of each end): the kernel reads
    the segment CalibQuant itself writes, not a random one, and must agree with the reference on it."""
    from mmkv.methods.calibquant import CalibQuant

    g = torch.Generator().manual_seed(31)
    B, H, G, D, n = 2, 3, 3, 64, 63
    k, v = (torch.randn(B, H, n, D, generator=g) for _ in range(2))
    seg = CalibQuant(bits=1, clip="authors").quantize(k, v, torch.tensor([n, 40]))
    seg = type(seg)(**{f: (t.to(DEV) if torch.is_tensor(t) else t) for f, t in seg.__dict__.items()})
    q = torch.randn(B, H * G, D, generator=g).to(DEV, torch.float16)
    check(q, [seg, dense_seg(B, H, 5, D, [5, 2], g=g)])


def test_blocks_and_global_values():
    """Channel scale blocks smaller than the span (video blocks; tiles straddle blocks) and stride-0 V ranges."""
    g = torch.Generator().manual_seed(5)
    B, H, G, D = 2, 3, 3, 64
    segs = [channel_seg(B, H, 150, D, 2, [150, 97], (1.0, 2.0), block=48, g=g),
            channel_seg(B, H, 40, D, 4, [33, 40], None, global_v=True, g=g, sdtype=torch.float32)]
    q = torch.randn(B, H * G, D, generator=g).to(DEV, torch.float16)
    check(q, segs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_query_dtypes(dtype):
    g = torch.Generator().manual_seed(11)
    B, H, G, D = 2, 3, 3, 64
    segs = [dense_seg(B, H, 9, D, [9, 4], dtype=dtype, g=g), channel_seg(B, H, 63, D, 1, [63, 62], (1.0, 2.0), g=g)]
    q = torch.randn(B, H * G, D, generator=g).to(DEV, dtype)
    check(q, segs, tol=8e-3 if dtype == torch.bfloat16 else 2e-3)


def test_rows_without_tokens():
    """A row with no valid token anywhere: out 0 and lse -inf (the reference's convention)."""
    g = torch.Generator().manual_seed(2)
    B, H, G, D = 2, 3, 3, 64
    segs = [dense_seg(B, H, 6, D, [6, 0], g=g), channel_seg(B, H, 63, D, 1, [40, 0], (1.0, 2.0), g=g)]
    q = torch.randn(B, H * G, D, generator=g).to(DEV, torch.float16)
    out, lse = kernels.decode_attention(q, segs, return_lse=True)
    assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))
    ref = attention_over_segments(q.float().unsqueeze(2), segs)[0].squeeze(2)
    assert rel_err(out[0], ref[0]) < 2e-3


def test_default_scale_and_return_shape():
    g = torch.Generator().manual_seed(3)
    B, H, G, D = 1, 3, 3, 64
    segs = [dense_seg(B, H, 20, D, [20], g=g)]
    q = torch.randn(B, H * G, D, generator=g).to(DEV, torch.float16)
    out = kernels.decode_attention(q, segs, 0.5)
    ref = attention_over_segments(q.float().unsqueeze(2), segs, 0.5)[0].squeeze(2)
    assert out.shape == q.shape and out.dtype == q.dtype and rel_err(out, ref) < 2e-3


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8], ids=lambda b: f"{b}bit")
def test_pack_planes_roundtrip(bits):
    """3-bit codes travel as a 2-bit plane (low bits) plus a 1-bit plane; other widths are one plane."""
    from kernels.layouts import pack_planes, plane_bits, unpack_planes

    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (2, 3, 40, 24), generator=g, dtype=torch.uint8)
    for dim in (2, 3):
        planes = pack_planes(codes, bits, dim)
        assert len(planes) == len(plane_bits(bits))
        assert torch.equal(unpack_planes(planes, bits, dim), codes)


def test_plugin_layout_merges_with_builtin_segments():
    """A segment type registered from outside (kernels.decode.registry.register_layout) joins the split-K plan
    and the shared merge; its partials follow the documented contract (log2-unit max, un-normalized acc)."""
    from dataclasses import dataclass

    from kernels import Layout, register_layout
    from kernels.decode import registry as da
    from kernels.reference import DEQUANTIZERS

    @dataclass
    class DoubledKeys:  # keys stored times two: the reference and the launch both undo it
        k2: torch.Tensor
        v: torch.Tensor
        lens: torch.Tensor

    def launch(ctx, it):
        seg = it["seg"]
        b, h, t, d = seg.k2.shape
        x = torch.einsum("bhgd,bhtd->bhgt", ctx.q.float().view(b, h, ctx.G, d), seg.k2.float() / 2) * ctx.qk_scale
        valid = torch.arange(t, device=x.device)[None, :] < it["lens"][:, None]
        x = x.masked_fill(~valid[:, None, None, :], float("-inf"))
        m = x.amax(-1).clamp(min=-1e30)
        p = torch.exp2(x - m[..., None])
        acc = torch.einsum("bhgt,bhtd->bhgd", p, seg.v.float())
        s = it["s_off"]
        ctx.part_o[:, :, s] = acc.reshape(b, h * ctx.G, d)
        ctx.part_ml[:, :, s, 0] = m.reshape(b, h * ctx.G)
        ctx.part_ml[:, :, s, 1] = p.sum(-1).reshape(b, h * ctx.G)
        ctx.part_o[:, :, s + 1 : s + it["nsplit"]] = 0
        ctx.part_ml[:, :, s + 1 : s + it["nsplit"], 0] = -1e30
        ctx.part_ml[:, :, s + 1 : s + it["nsplit"], 1] = 0

    register_layout(DoubledKeys, Layout(capacity=lambda s: s.k2.shape[2], kv_heads=lambda s: s.k2.shape[1],
                                        tile=lambda s, d: 16, tile_bytes=lambda s, tt, d: tt * d * 4,
                                        launch=launch))
    DEQUANTIZERS[DoubledKeys] = lambda s: (s.k2.float() / 2, s.v.float())
    try:
        g = torch.Generator().manual_seed(17)
        B, H, G, D = 2, 3, 3, 64
        plug = DoubledKeys(torch.randn(B, H, 45, D, generator=g).to(DEV, torch.float16),
                           torch.randn(B, H, 45, D, generator=g).to(DEV, torch.float16),
                           testing.lens_tensor([45, 20], B, DEV))
        segs = [dense_seg(B, H, 7, D, [7, 5], g=g), plug, channel_seg(B, H, 63, D, 2, [63, 30], (1.0, 2.0), g=g)]
        q = torch.randn(B, H * G, D, generator=g).to(DEV, torch.float16)
        check(q, segs)
    finally:
        da.LAYOUTS.pop(DoubledKeys, None)
        DEQUANTIZERS.pop(DoubledKeys, None)


# ---------------------------------------------------------------------------------------------------------------
# GPU only: the Gluon channel kernel at real sizes, and it against the generic Triton path
# ---------------------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def check_graph_replays(q, segs, replays: int) -> None:
    """``decode_attention`` captured in a CUDA graph (compiled and planned by one call before the capture) writes
    the reference's output into a NaN-filled ``out`` on every one of ``replays`` replays."""
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    kernels.decode_attention(q, segs, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.decode_attention(q, segs, out=out)
    ref = attention_over_segments(q.float().unsqueeze(2), segs)[0].squeeze(2)
    for _ in range(replays):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref) < 2e-3

GPU_CASES = [  # (head_dim, bits, group, calib): every bit-width and head_dim, GQA groups 1..8
    (128, 1, 4, True), (128, 2, 4, True), (128, 4, 8, False), (64, 8, 1, True), (64, 1, 3, False),
    (64, 2, 8, True),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("D,bits,G,calib", GPU_CASES,
                         ids=[f"D{d}-{b}bit-G{g}-{'calib' if c else 'nocalib'}" for d, b, g, c in GPU_CASES])
def test_gpu_channel_kernel(D, bits, G, calib):
    g = torch.Generator().manual_seed(D * 100 + bits * 10 + G)
    B, H = 3, 2
    # row 1 has no visual token when calibration is off (and no dense token either: out 0, lse -inf)
    segs = [channel_seg(B, H, 5000, D, bits, [5000, 4097 if calib else 0, 1], (1.0, 2.0) if calib else None, g=g),
            dense_seg(B, H, 33, D, [33, 0, 7], g=g)]
    q = torch.randn(B, H * G, D, generator=g).to(DEV, torch.float16)
    check(q, segs, gluon=True)
    check(q, segs, gluon=False)
    # a second call with the same shapes takes the cached launch path (no Triton binder): must agree as well
    q2 = torch.randn(B, H * G, D, generator=g).to(DEV, torch.float16)
    check(q2, segs, gluon=True)
    check(q2, segs, gluon=True, warps=8 if D == 64 else 2, maxnreg=128)  # other program shapes
    for stages in (0, 3):  # codes through registers / through a shared-memory ring, whatever the default picks
        check(q2, segs, gluon=True, channel_stages=stages)


INT8_CASES = [(128, 1, 4, True), (128, 1, 1, True), (64, 1, 3, False), (128, 1, 2, False)]


@gpu
@needs_cuda
@pytest.mark.parametrize("D,bits,G,calib", INT8_CASES,
                         ids=[f"D{d}-{b}bit-G{g}-{'calib' if c else 'nocalib'}" for d, b, g, c in INT8_CASES])
def test_gpu_int8_k_side(D, bits, G, calib, monkeypatch):
    """1-bit K on int8 tensor cores (q*s as 16-bit fixed point in two bytes) and on fp16 ones: both within the
    tolerance, and the int8 path not less precise (eval/studies/query_precision.py: two bytes resolve q*s more finely)."""
    g = torch.Generator().manual_seed(D + G)
    B, H = 3, 2
    segs = [channel_seg(B, H, 3001, D, bits, [3001, 2048, 17], (0.0, 3.0) if calib else None, g=g),
            dense_seg(B, H, 9, D, [9, 9, 0], g=g)]
    q = (3 * torch.randn(B, H * G, D, generator=g)).to(DEV, torch.float16)
    errs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("MMKV_INT8_K", flag)
        errs[flag] = check(q, segs, gluon=True)
    print(f"relative error int8 {errs['1']:.2e}, fp16 {errs['0']:.2e}")
    assert errs["1"] <= 1.25 * errs["0"] + 1e-6, errs


FUSED_CASES = [(128, 4, True, 3001), (128, 1, True, 577), (64, 3, False, 3001), (128, 2, False, 63)]


@gpu
@needs_cuda
@pytest.mark.parametrize("D,G,calib,n", FUSED_CASES,
                         ids=[f"D{d}-G{g}-{'calib' if c else 'nocalib'}-n{n}" for d, g, c, n in FUSED_CASES])
def test_gpu_fused_kernel(D, G, calib, n, monkeypatch):
    """The fused 1-bit kernel with the counter barrier (K, a barrier over each (row, KV head)'s splits, V; logits
    kept in shared memory) against the reference and against the two-pass kernels, over several calls (its barrier
    counters must be back at 0 after each launch, or the next launch would pass its barrier early) and inside a
    CUDA graph."""
    from kernels.decode import dispatch
    from kernels.decode import plan as da
    monkeypatch.setenv("MMKV_INT8_K", "1")  # small test grids: the int8 K side (and so fusing) forced
    monkeypatch.setenv("MMKV_CLUSTER", "0")  # the counter barrier (sm_90 would take clusters here)
    g = torch.Generator().manual_seed(D + G + n)
    B, H = 5, 3
    lens = [n, n // 2 + 1, 1, 0 if not calib else 7, n - 5]
    segs = [channel_seg(B, H, n, D, 1, lens, (0.0, 3.0) if calib else None, g=g),
            dense_seg(B, H, 9, D, [9, 9, 0, 9, 3], g=g)]
    it = dict(seg=segs[0], tiles=-(-n // 128))
    assert da._fused_plan(it, torch.device(DEV), B, H, D, G, 2, da._num_sms(torch.device(DEV)), 4096), "not fused"
    errs = {}
    for flag in ("1", "0", "1"):
        monkeypatch.setenv("MMKV_FUSED", flag)
        q = (3 * torch.randn(B, H * G, D, generator=g)).to(DEV, torch.float16)
        errs[flag] = check(q, segs, gluon=True)
        torch.cuda.synchronize()
        assert all(int(c.abs().sum()) == 0 for c in dispatch._SYNC.values()), "barrier counters not reset"
    print(f"relative error fused {errs['1']:.2e}, two-pass {errs['0']:.2e}")
    assert errs["1"] <= 1.25 * errs["0"] + 1e-6, errs
    check_graph_replays((3 * torch.randn(B, H * G, D, generator=g)).to(DEV, torch.float16), segs, 3)


FUSED_CASES = [  # (B, H, G, D, n, calib, extra dense segment, (warps, CTAs per cluster) planned on a 132-SM GPU)
    (16, 8, 4, 128, 8192, True, False, (16, 1)), (8, 8, 2, 128, 8192, True, True, (8, 2)),
    (16, 8, 4, 128, 3328, True, True, (8, 1)), (40, 4, 4, 128, 3001, True, True, (4, 2)),
    (70, 8, 3, 64, 577, False, False, (2, 2)), (139, 8, 4, 128, 3328, True, True, (2, 2)),
    (2, 16, 4, 64, 8192, True, True, (4, 8)),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("B,H,G,D,n,calib,dense,plan", FUSED_CASES, ids=lambda v: str(v))
def test_gpu_fused_shapes(B, H, G, D, n, calib, dense, plan, monkeypatch):
    """The fused 1-bit kernel at the warps and cluster sizes the planner picks by shape (8- and 16-warp programs, one
    per (row, KV head) or two per cluster; 2- and 4-warp programs in clusters of 2 and 8), against the reference and
    the two-pass kernels.
    Where the plan uses clusters, the layer's merge happens in the kernel (the dense segment's partials included;
    the kernel launches beside the dense segment's, ``MMKV_OVERLAP``, and must give the same bits as after it).
    Rows of 0 and 1 tokens; also replayed from a CUDA graph."""
    from kernels.decode import plan as da
    dev = torch.device(DEV)
    if da._capability(dev)[0] < 9:
        pytest.skip("the plans below are sm_90's (clusters)")
    g = torch.Generator().manual_seed(B + n)
    lens = [max(0, n - 37 * i) for i in range(B)]
    lens[1], lens[-1] = 1, 0 if not calib else 5
    segs = [channel_seg(B, H, n, D, 1, lens, (0.0, 3.0) if calib else None, g=g)]
    if dense:
        segs.append(dense_seg(B, H, 9, D, [9 - i % 9 for i in range(B)], g=g))
    it = dict(seg=segs[0], T=n, tt=128, tiles=-(-n // 128))
    got = da._plan_fused(it, dev, B, H, D, G, 2, da._num_sms(dev), None, True, lambda x: x["tt"] * D * 2 // 8)
    assert got, "not fused"
    if da._num_sms(dev) == 132:
        assert (it["w"], got[2]) == plan, (it["w"], got)
    errs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("MMKV_FUSED", flag)
        q = (3 * torch.randn(B, H * G, D, generator=g)).to(DEV, torch.float16)
        errs[flag] = check(q, segs, gluon=True)
    print(f"warps {it['w']}, cluster {got[2]}: relative error {errs['1']:.2e}, two-pass {errs['0']:.2e}")
    assert errs["1"] <= 1.25 * errs["0"] + 1e-6, errs
    monkeypatch.setenv("MMKV_FUSED", "1")
    if dense:  # the clusters' kernel starts beside the dense segment's and waits before it merges: same bits
        q = (3 * torch.randn(B, H * G, D, generator=g)).to(DEV, torch.float16)
        first = None
        for flag in ("0", "1", "1", "1"):  # an early read of the partials would show on some call
            monkeypatch.setenv("MMKV_OVERLAP", flag)
            got = kernels.decode_attention(q, segs, gluon=True, out=torch.full_like(q, float("nan")))
            first = got if first is None else first
            assert torch.equal(got, first), flag
    check_graph_replays((3 * torch.randn(B, H * G, D, generator=g)).to(DEV, torch.float16), segs, 2)


@gpu
@needs_cuda
@pytest.mark.parametrize("B,n", [(1, 3328), (16, 8192), (2, 32768), (64, 3328)], ids=lambda v: str(v))
def test_gpu_benchmark_shapes(B, n):
    """The benchmark's shapes (32 q heads, 8 KV heads, D=128): sinks + 1-bit visual + KIVI text + window."""
    g = torch.Generator().manual_seed(B + n)
    H, G, D = 8, 4, 128
    segs = [dense_seg(B, H, 4, D, [4] * B, g=g),
            channel_seg(B, H, n, D, 1, [n - i for i in range(B)], (1.0, 3.0), g=g),
            kivi_seg(B, H, 512, D, [512] * B, g=g),
            dense_seg(B, H, 128, D, [128 - i % 3 for i in range(B)], g=g)]
    q = torch.randn(B, H * G, D, generator=g).to(DEV, torch.float16)
    check(q, segs)


@gpu
@needs_cuda
def test_gpu_pack_large():
    codes = torch.randint(0, 2, (4, 8, 4096, 128), device=DEV)
    packed = kernels.pack(codes, 1, 2)
    assert torch.equal(packed, ref_pack(codes, 1, 2))
    assert torch.equal(kernels.unpack(packed, 1, 2), codes.to(torch.uint8))


@pytest.mark.parametrize("regs,warps,programs", [(134, 2, 6), (156, 2, 6), (128, 2, 8), (72, 2, 14), (127, 4, 4)])
def test_resident_programs_count_registers_per_sub_partition(monkeypatch, regs, warps, programs):
    """The split planner's one-wave size: registers come from one quarter of the SM's register file per warp, so
    134 registers x 2 warps fit 6 programs per H100 SM (what ncu reports), not 65536 // 8704 = 7."""
    from types import SimpleNamespace

    import kernels.decode.gluon.launch as gc

    props = SimpleNamespace(regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=228 * 1024,
                            max_threads_per_multi_processor=2048)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: props)
    monkeypatch.setattr(gc, "_RESIDENT", {})
    kernel = SimpleNamespace(n_regs=regs, metadata=SimpleNamespace(shared=1024))
    gc._record_resident(kernel, (0, 128, 1, warps, 0, 0, True, 0), warps)
    assert gc.resident_programs(0, 128, 1, warps, 0, 0, True) == programs
    assert gc.programs_by_registers(0, 128, 1, warps, 0, 0, True) == programs  # shared memory is not the limit here


@pytest.mark.parametrize("rows,N,dtype", [(7, 577, torch.float16), (3, 64, torch.float32), (2, 4096, torch.float16),
                                          (5, 577, torch.bfloat16)])
def test_rms_norm_kernel(rows, N, dtype):
    """kernels/ops/rmsnorm.py vs the transformers rule (reference.rms_norm) on a 3-d input with odd sizes, output
    pre-filled with NaN. The kernel sums squares in another order, so h = x * rsqrt(...) may round to the other
    neighbouring 16-bit value: relative error < 2e-3 (fp16, bf16), < 1e-5 (fp32). bf16 on the GPU only: Triton's
    CPU interpreter rounds fp32 -> bf16 toward zero (34 of 64 random values off by an ulp against torch's
    round-to-nearest-even, explicit rounding mode or not), the GPU rounds to nearest even."""
    if dtype == torch.bfloat16 and not CUDA:
        pytest.skip("the CPU interpreter truncates fp32 -> bf16")
    from kernels.ops.rmsnorm import rms_norm

    g = torch.Generator().manual_seed(rows + N)
    x = (3 * torch.randn(rows, 2, N, generator=g) + 0.5).to(DEV, dtype)
    w = (1 + 0.2 * torch.randn(N, generator=g)).to(DEV, dtype)
    out = torch.full_like(x, float("nan"))
    got = rms_norm(x, w, 1e-5, out=out)
    assert got is out and not torch.isnan(got).any()
    assert rel_err(got, kernels.reference.rms_norm(x, w, 1e-5)) < (1e-5 if dtype == torch.float32 else 2e-3)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:-1], 1e-5)


@pytest.mark.parametrize("B,T,HQ,HK,D,dtype,cos_rows", [(3, 5, 7, 3, 64, torch.float16, 3),
                                                        (2, 1, 32, 8, 128, torch.float16, 1),
                                                        (139, 1, 32, 8, 128, torch.float16, 139),
                                                        (4, 3, 9, 3, 64, torch.bfloat16, 4)])
def test_rotary_kernel(B, T, HQ, HK, D, dtype, cos_rows):
    """kernels/ops/rotary.py vs the transformers rule (reference.rotary) on odd head counts, q and k as the attention
    passes them (transposed views of [B, T, H, D]), outputs pre-filled with NaN: the kernel rounds where torch does,
    so the results are equal bit for bit (relative error 0). bf16 on the GPU only (the interpreter truncates
    fp32 -> bf16, see test_rms_norm_kernel)."""
    if dtype == torch.bfloat16 and not CUDA:
        pytest.skip("the CPU interpreter truncates fp32 -> bf16")
    from kernels.ops.rotary import rotary

    g = torch.Generator().manual_seed(B * T + HQ)
    q = (3 * torch.randn(B, T, HQ, D, generator=g)).to(DEV, dtype).transpose(1, 2)
    k = (3 * torch.randn(B, T, HK, D, generator=g)).to(DEV, dtype).transpose(1, 2)
    ang = torch.rand(cos_rows, T, D // 2, generator=g) * 3000  # positions of a long prompt
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(DEV, dtype), emb.sin().to(DEV, dtype)
    out = (torch.full_like(q, float("nan")), torch.full_like(k, float("nan")))
    got = rotary(q, k, cos, sin, out=out)
    want = kernels.reference.rotary(q, k, cos, sin)
    for a, b in zip(got, want, strict=True):
        assert not torch.isnan(a).any() and torch.equal(a, b)
    with pytest.raises(ValueError, match="unsupported"):
        rotary(q, k[:, :, :, :-2], cos, sin)


@pytest.mark.parametrize("H,T,D,lens,dtype", [(3, 11, 64, [0, 5, 10], torch.float16),
                                              (32, 7, 128, [6, 0], torch.float16),
                                              (5, 9, 80, [3, 8, 1, 4], torch.bfloat16)])
def test_append_token_kernel(H, T, D, lens, dtype):
    """kernels/ops/append.py vs ``reference.append_token``: k and v as the attention passes them (transposed views of
    [B, 1, H, D]) into segments pre-filled with NaN, ragged lengths (0 and the last slot), 32 KV heads (two chunks of
    the head loop), head_dim 80 (masked to its power of two): the slots written are the inputs exactly, every other
    stays NaN, and the lengths advance by one. v and its segment have other strides than k and its own (a half of a
    wider tensor), so each side must use its own. A copy: bf16 runs under the interpreter too."""
    from kernels.ops.append import append_token

    B = len(lens)
    g = torch.Generator().manual_seed(H * T + D)
    k = (3 * torch.randn(B, 1, H, D, generator=g)).to(DEV, dtype).transpose(1, 2)
    v = (3 * torch.randn(B, H, 1, 2 * D, generator=g)).to(DEV, dtype)[..., D:]
    kc = torch.full((B, H, T, D), float("nan"), device=DEV, dtype=dtype)
    vc = torch.full((B, H, T + 2, 2 * D), float("nan"), device=DEV, dtype=dtype)[:, :, 1 : T + 1, :D]
    n = torch.tensor(lens, dtype=torch.int32, device=DEV)
    want = [kc.clone(), vc.clone(), n.clone()]
    kernels.reference.append_token(*want[:2], k, v, want[2])
    append_token(kc, vc, k, v, n)
    for a, b in zip((kc, vc, n), want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert n.tolist() == [x + 1 for x in lens] and not torch.isnan(kc[torch.arange(B), :, torch.tensor(lens)]).any()
    with pytest.raises(ValueError, match="unsupported"):
        append_token(kc, vc, k, v, n.long())
    full = torch.full((B,), T, dtype=torch.int32, device=DEV)  # at capacity: nothing written past the segment
    before = (kc.clone(), vc.clone())
    append_token(kc, vc, k, v, full)
    assert torch.equal(kc.nan_to_num(), before[0].nan_to_num()) and torch.equal(vc.nan_to_num(), before[1].nan_to_num())
    assert full.tolist() == [T + 1] * B


def test_decode_append_takes_the_kernel(monkeypatch):
    """An MMKVCache layer's decode append (two rows of different lengths: not the one-row CPU copy) goes through
    ``append_token`` where Triton runs, and with ``MMKV_APPEND_KERNEL=0`` through the torch reference; both leave the
    same segment, device lengths (equal to the host's counters) and host counters, across a flush into KIVI-2
    blocks."""
    from kernels.ops import append as ap
    from mmkv.cache import MMKVCache
    from mmkv.spec import CacheSpec

    calls = []
    real = ap.append_token
    monkeypatch.setattr("mmkv.cache.layer.append_token", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(5)
    k0, v0 = (torch.randn(2, 3, 40, 64, generator=g).to(DEV, torch.float16) for _ in range(2))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0  # a left-padded shorter row: the rows' lengths differ
    steps = [(torch.randn(2, 3, 1, 64, generator=g).to(DEV, torch.float16),
              torch.randn(2, 3, 1, 64, generator=g).to(DEV, torch.float16)) for _ in range(30)]
    layers = []
    for flag in ("1", "0"):
        monkeypatch.setenv("MMKV_APPEND_KERNEL", flag)
        cache = MMKVCache(CacheSpec.parse("text=kivi:bits=2 window=16 sinks=4"), num_layers=1)
        cache.set_inputs(mask.to(DEV), torch.zeros(2, 40, dtype=torch.bool, device=DEV))
        cache.update(k0, v0, 0)
        cache.finalize()
        for k, v in steps:
            cache.update(k, v, 0)
        layers.append(cache.layers[0])
    assert len(calls) == len(steps)
    a, b = layers
    assert a.dense_len == b.dense_len and a.text_len == b.text_len and a.dense_len != [70, 63]  # it flushed
    assert a.dense.lens.tolist() == a.dense_len and a.dense_len[0] != a.dense_len[1]
    for x, y in ((a.dense.k, b.dense.k), (a.dense.v, b.dense.v), (a.dense.lens, b.dense.lens)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("rows,N,dtype", [(7, 577, torch.float16), (139, 14336, torch.float16),
                                          (3, 1000, torch.bfloat16)])
def test_silu_mul_kernel(rows, N, dtype):
    """kernels/ops/silu_mul.py vs the transformers rule (reference.silu_mul) on gate and up as the grouped gate|up GEMM
    leaves them (two strided halves of one output), output pre-filled with NaN. Compiled it follows torch's CUDA
    arithmetic: equal bit for bit; under the interpreter numpy's fp32 exp may be an ulp off torch's before rounding:
    relative error < 1e-3. bf16 on the GPU only (the interpreter truncates fp32 -> bf16)."""
    if dtype == torch.bfloat16 and not CUDA:
        pytest.skip("the CPU interpreter truncates fp32 -> bf16")
    from kernels.ops.silu_mul import silu_mul

    g = torch.Generator().manual_seed(rows + N)
    y = (4 * torch.randn(rows, 1, 2 * N, generator=g)).to(DEV, dtype)
    gate, up = y[..., :N], y[..., N:]
    out = torch.full_like(gate, float("nan"))
    got = silu_mul(gate, up, out=out)
    want = kernels.reference.silu_mul(gate, up)
    assert got is out and not torch.isnan(got).any()
    assert torch.equal(got, want) if CUDA else rel_err(got, want) < 1e-3
    with pytest.raises(ValueError, match="unsupported"):
        silu_mul(gate, up[..., :-1])


def test_silu_mul_rows_ride_the_unbounded_grid_axis(monkeypatch):
    """A batch of video prompts has more token rows than grid axis 1 holds (65535; 16 clips x 4608 tokens failed with
    "invalid argument" on the H100): rows must be grid axis 0. The launch is captured, not run (73728 interpreted
    programs would take minutes)."""
    from kernels.ops import silu_mul as sm

    seen = []
    monkeypatch.setattr(sm, "_SILU_MUL", lambda grid, *a, **k: seen.append(grid))
    gate = torch.randn(73728, 1, 3, generator=torch.Generator().manual_seed(0)).to(DEV, torch.float16)
    sm.silu_mul(gate, gate.clone())
    assert seen == [(73728, 1)]
    assert all(x <= 65535 for x in seen[0][1:])


@pytest.mark.parametrize("B,n,warps", [
    (16, 8192, 16), (64, 8192, 16), (139, 8192, 4), (8, 8192, 8), (4, 8192, 4),
    (16, 3328, 8), (64, 3328, 8), (128, 3328, 8), (40, 3328, 2), (139, 3328, 2), (278, 3328, 2), (1, 3328, 4),
    (16, 32768, 2), (32, 32768, 4), (64, 32768, 4)])
def test_fused_warps_follow_the_measured_sweep(B, n, warps):
    """Warps per fused program on a 132-SM GPU (8 KV heads) at the shapes of docs/results/h100_warps_sweep.txt: each
    is the fastest or within 0.5 us of it there (the rule trades the rest for simplicity); a change of the rule must
    come with a new sweep."""
    from kernels.decode import plan as da
    assert da._fused_warps(B * 8, n, 132) == warps


def test_cpu_fallback_without_interpreter(monkeypatch):
    """Without CUDA and without TRITON_INTERPRET the public API is the CPU path (``decode/cpu.py``), which agrees
    with the torch reference, cast to q.dtype."""
    if CUDA:
        pytest.skip("CPU-only behaviour")
    monkeypatch.delenv("TRITON_INTERPRET")
    g = torch.Generator().manual_seed(4)
    segs = [dense_seg(1, 2, 7, 64, [7], g=g)]
    q = torch.randn(1, 4, 64, generator=g).half()
    out = kernels.decode_attention(q, segs)
    ref = attention_over_segments(q.float().unsqueeze(2), segs)[0].squeeze(2)
    assert out.dtype == torch.float16 and rel_err(out, ref) < 1e-3
    assert math.isfinite(out.float().sum().item())


def test_interpreted_helpers_reuse_the_launchs_patch():
    """tests/triton_switch.py's shortcut: helpers (``tl.max``, ``tl.sum``) called inside an interpreted kernel skip
    re-patching triton.language; the kernel still computes the same, and the launch restores the module after."""
    if CUDA:
        pytest.skip("compiled on CUDA: no interpreter")
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    @triton.jit
    def row_softmax_sum(x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i * N + c, mask=c < N, other=float("-inf"))
        e = tl.exp(x - tl.max(x, 0))
        tl.store(out_ptr + i, tl.sum(e, 0) + tl.max(x, 0))

    assert getattr(interpreter._patch_lang, "_mmkv_kept", False)
    calls, walks = [], []
    own, walk = interpreter._patch_lang, interpreter._patch_builtin
    interpreter._patch_lang = lambda fn: calls.append(fn.__name__) or own(fn)
    interpreter._patch_builtin = lambda *a: walks.append(a[0]) or walk(*a)
    try:
        g = torch.Generator().manual_seed(5)
        x = torch.randn(7, 37, generator=g) * 3 + 1
        out = torch.full((7,), float("nan"))
        row_softmax_sum[(7,)](x, out, N=37, BLOCK=64)
    finally:
        interpreter._patch_lang, interpreter._patch_builtin = own, walk
    ref = (x - x.max(1).values[:, None]).exp().sum(1) + x.max(1).values
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    # every call reaches the shortcut (the launch, then each tl.max / tl.sum of 7 programs), and only the launch and
    # the first helper (tl.core, which the launch did not patch) walk the modules: 7 walks in Triton 3.9, 127 without
    assert calls[0] == "row_softmax_sum" and len(calls) == 1 + 7 * 3
    assert len(walks) <= 10, [getattr(w, "__name__", w) for w in walks]
    # ...and the module the launch patched is Triton's own again once the grid ends
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.exp)
