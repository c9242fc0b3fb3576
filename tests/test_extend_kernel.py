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
