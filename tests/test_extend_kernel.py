"""The quantized extend path (``kernels/decode/extend.py``): several new query tokens over stored segments through
the decode kernels (query tokens folded into query rows per KV head), against the torch reference's
``attention_over_segments`` (which dequantizes everything in fp32). Runs under Triton's interpreter on CPU (see
``triton_switch.py``) and compiled on CUDA. Inputs random and never zero; odd token counts (chunks of a different
size last), ragged rows, a row with no stored token in a segment, CalibQuant calibration per query row.
"""

from __future__ import annotations

from functools import partial

import torch
from triton_switch import CUDA, fixtures, switch_on

IN_PROCESS, _WE_SET_INTERPRET = switch_on()  # before triton and the kernels are imported

import pytest  # noqa: E402

from kernels import testing  # noqa: E402
from kernels.decode.extend import extend_kernel_ok, history_attention  # noqa: E402
from kernels.reference import attention_over_segments  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
_in_process_only, _restore_env, test_interpreter_subprocess = fixtures(__file__, IN_PROCESS, _WE_SET_INTERPRET)

dense_seg = partial(testing.dense_seg, device=DEV)
channel_seg = partial(testing.channel_seg, device=DEV)
kivi_seg = partial(testing.kivi_seg, device=DEV)


def _check(q, segs, rows, tol=2e-3):
    out, lse = history_attention(q, segs, rows=rows)
    ref, ref_lse = attention_over_segments(q.float(), segs)
    live = torch.isfinite(ref_lse)
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    assert not torch.isnan(out).any()
    err = ((out - ref)[live].norm() / ref[live].norm()).item()
    assert err < tol, err  # fp16 operands with fp32 accumulation, as the decode kernels
    assert torch.allclose(lse[live], ref_lse[live], atol=2e-3, rtol=1e-4)
    assert (lse[~live] == float("-inf")).all() and (out[~live] == 0).all()
    return err


@pytest.mark.parametrize("tq,rows", [(5, 64), (23, 8), (1, 64), (23, 128)])
def test_extend_over_kivi_channel_and_dense_matches_reference(tq, rows):
    g = torch.Generator().manual_seed(tq * 7 + rows)
    B, H, G, D = 2, 3, 3, 64
    segs = [dense_seg(B, H, 5, D, [5, 2], g=g),
            kivi_seg(B, H, 96, D, [96, 33], 2, 2, 32, 32, g=g),
            channel_seg(B, H, 131, D, 1, [131, 0], (1.0, 2.0), g=g),
            dense_seg(B, H, 17, D, [17, 9], g=g)]
    q = torch.randn(B, H * G, tq, D, generator=g).to(DEV, torch.float16)
    _check(q, segs, rows)


def test_extend_calibration_is_per_query_row():
    # calibration maps each query row's own logit range; folding tokens into rows must keep them apart
    g = torch.Generator().manual_seed(3)
    B, H, G, D = 1, 1, 2, 64
    segs = [channel_seg(B, H, 200, D, 2, [200], (0.5, 3.0), g=g)]
    q = torch.randn(B, H * G, 7, D, generator=g)
    q[:, :, 3] *= 8  # one token with a much wider logit range than the others
    _check(q.to(DEV, torch.float16), segs, rows=4)


def test_extend_kernel_ok_names_the_layouts_read_exactly():
    g = torch.Generator().manual_seed(0)
    assert extend_kernel_ok([dense_seg(1, 1, 4, 64, g=g), None, kivi_seg(1, 1, 32, 64, g=g)])
    # SKVQ and AlignedKV keep the reference read (AlignedKV's decode read is approximate by design)
    assert not extend_kernel_ok([dense_seg(1, 1, 4, 64, g=g), testing.skvq_seg(1, 1, 32, 64, g=g)])
    assert not extend_kernel_ok([object()])


def test_extend_with_no_history_is_empty():
    q = torch.randn(1, 2, 3, 64).to(DEV, torch.float16)
    out, lse = history_attention(q, [None])
    assert (out == 0).all() and (lse == float("-inf")).all()


# --- the wide case: flash-style tile kernel (kernels/decode/extend_tile.py) ---------------------------------------
# Independent reference here: fp64 softmax over explicitly masked logits (not reference.py's merge of segments).

def _softmax_ref(q, k, v, lens, causal=False):
    """``q [B, Hq, Tq, D]`` over ``k, v [B, H, T, D]`` (first ``lens[b]`` tokens; ``causal``: token t sees 0..t)
    in fp64 -> (out, lse)."""
    B, HQ, TQ, _ = q.shape
    G = HQ // k.shape[1]
    kk = k.double().repeat_interleave(G, 1)
    vv = v.double().repeat_interleave(G, 1)
    x = torch.einsum("bhqd,bhtd->bhqt", q.double(), kk) / q.shape[-1] ** 0.5
    t = torch.arange(k.shape[2])
    keep = t[None, :] < lens.cpu()[:, None].long()  # [B, T]
    keep = keep[:, None, None, :].expand(B, 1, TQ, -1)
    if causal:
        keep = keep & (t[None, :] <= torch.arange(TQ)[:, None])[None, None]
    x = x.masked_fill(~keep.to(x.device), float("-inf"))
    lse = torch.logsumexp(x, -1)
    out = torch.nan_to_num(torch.softmax(x, -1), nan=0.0) @ vv
    return out, lse


def _nan_empty(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("G,D,TQ,bm,splits,causal", [(1, 64, 37, 32, 3, False), (3, 128, 11, 64, 1, False),
                                                     (8, 64, 37, 32, 2, True), (2, 128, 29, None, None, True)])
def test_tile_kernel_matches_fp64_softmax(G, D, TQ, bm, splits, causal, monkeypatch):
    from kernels.decode import extend_tile as et

    monkeypatch.setattr(et, "_empty", _nan_empty)  # every element of the split buffers must be written
    g = torch.Generator().manual_seed(G * 100 + TQ)
    B, H = 3, 2
    T = TQ if causal else 203
    lens = [T, T, T] if causal else [203, 77, 0]
    seg = dense_seg(B, H, T, D, lens, g=g)
    q = torch.randn(B, H * G, TQ, D, generator=g).to(DEV, torch.float16)
    o, l2 = et.tile_attention(q, seg, D ** -0.5, bm=bm, tt=16, splits=splits, causal=causal)
    if splits and splits > 1:
        assert o.shape[0] > 1  # the token axis really was split (the plan may merge a short last split)
    out, lse = et.merge_splits([(o, l2)])
    ref, ref_lse = _softmax_ref(q, seg.k, seg.v, seg.lens, causal)
    live = torch.isfinite(ref_lse)
    assert not torch.isnan(out).any()
    err = ((out.double() - ref)[live].norm() / ref[live].norm()).item()
    assert err < 2e-3, err  # fp16 operands, fp32 accumulation
    assert torch.allclose(lse[live].double(), ref_lse[live], atol=2e-3)
    assert (lse[~live] == float("-inf")).all() and (out[~live] == 0).all()


@pytest.mark.parametrize("kb,vb,group,scratch", [(2, 2, 32, None), (1, 1, 64, 1), (4, 2, 16, 3 * 2 * 96 * 64 * 2),
                                                 (2, 1, 32, 2 * 96 * 64 * 2)])
def test_kivi_scratch_groups_match_reference(kb, vb, group, scratch, monkeypatch):
    # scratch sizes: one group for everything, one (row, head) pair a group, 3 pairs (part of a row's heads), 1 pair
    from kernels.decode import extend_tile as et

    monkeypatch.setattr(et, "_empty", _nan_empty)
    g = torch.Generator().manual_seed(kb * 10 + vb)
    B, H, G, D = 2, 4, 2, 64
    seg = kivi_seg(B, H, 77, D, [77, 30], kb, vb, 32, group, g=g)
    q = torch.randn(B, H * G, 7, D, generator=g).to(DEV, torch.float16)
    out, lse = et.merge_splits([et.kivi_attention(q, seg, D ** -0.5, scratch_bytes=scratch, tt=32)])
    ref, ref_lse = attention_over_segments(q.float(), [seg])
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < 2e-3, err
    assert torch.allclose(lse, ref_lse, atol=2e-3)


@pytest.mark.parametrize("dtype,tile", [(torch.float16, True), (torch.float32, True), (torch.float16, False)])
def test_extend_attention_history_and_new_tokens(dtype, tile):
    from kernels.decode.extend import extend_attention

    g = torch.Generator().manual_seed(5)
    B, H, G, D, TQ = 2, 2, 3, 64, 13
    segs = [dense_seg(B, H, 5, D, [5, 2], dtype=dtype, g=g),
            kivi_seg(B, H, 100, D, [100, 33], 2, 1, 32, 32, g=g),
            channel_seg(B, H, 70, D, 1, [70, 0], (1.0, 2.0), g=g)]
    q = torch.randn(B, H * G, TQ, D, generator=g).to(DEV, dtype)
    kn, vn = (torch.randn(B, H, TQ, D, generator=g).to(DEV, dtype) for _ in range(2))
    out = extend_attention(q, segs, kn, vn, D ** -0.5, tile=tile)
    oh, lh = attention_over_segments(q.float(), segs, D ** -0.5)
    full = torch.full((B,), TQ, dtype=torch.int32)
    on, ln = _softmax_ref(q, kn, vn, full, causal=True)
    w = torch.softmax(torch.stack([lh.double(), ln]), 0)
    ref = w[0, ..., None] * oh.double() + w[1, ..., None] * on
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-4 if dtype == torch.float32 and tile else 2e-3), err


@pytest.mark.parametrize("tile", [True, False])
def test_values_in_tile_order_read_like_the_reference(tile):
    """KIVI values packed in tile order (what the methods flush on CUDA at head_dim 128, ``KiviSeg.v_order``): the
    extend path's dequantizer (``tile``) and the folded decode kernels read them as the reference does."""
    g = torch.Generator().manual_seed(11)
    seg = kivi_seg(2, 2, 70, 128, [70, 33], 2, 1, 32, 32, g=g, order="tiles")
    q = torch.randn(2, 8, 3, 128, generator=g).to(DEV)
    out, lse = history_attention(q, [seg], rows=64, tile=tile)
    ref, ref_lse = attention_over_segments(q.float(), [seg])
    assert ((out - ref).norm() / ref.norm()).item() < 2e-3
    assert torch.allclose(lse, ref_lse, atol=2e-3, rtol=1e-4)
