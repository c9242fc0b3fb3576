"""CalibQuant's calibration never inverts or flattens a query's order (issue 32, item 4): the slope of the map
[gamma, delta] -> [gamma - tau1, delta - tau2] is floored at 1/4 (kernels/reference.py, CALIB_MIN_RATIO), in the
torch reference and in the Triton kernel (under the interpreter on CPU). Expected values are worked by hand; the
reference's map alone: tests/test_reference_math.py.

The segment: 1-bit channel-wise keys and values, D = 64, three valid tokens. Keys use channels 0 and 1 (scale w/2,
zero 0) with codes (0,0), (1,0), (1,1), so q = (1, 1, 0, ...) at sm_scale 1 gives logits 0, w/2, w. Token t's
value has a 1 in channel t only (scale 1, zero 0), so out[:3] is the attention distribution itself.
"""

from __future__ import annotations

import math

import torch
from triton_switch import CUDA, fixtures, switch_on

IN_PROCESS, _WE_SET_INTERPRET = switch_on()  # before triton and the kernels are imported

import pytest  # noqa: E402

import kernels  # noqa: E402
from kernels.layouts import ChannelSeg, pack  # noqa: E402
from kernels.reference import CALIB_MIN_RATIO, attention_over_segments  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
D = 64
_in_process_only, _restore_env, test_interpreter_subprocess = fixtures(__file__, IN_PROCESS, _WE_SET_INTERPRET)


def softmax(xs):
    e = [math.exp(x) for x in xs]
    return [x / sum(e) for x in e]


# w -> calibrated logits at tau = (0, 3): the paper's slope (w - 3) / w, floored at 1/4 (threshold w = 4)
CASES = {
    2.0: [0.0, 0.25, 0.5],   # below: the paper's slope -1/2 would give [0, -0.5, -1], the order reversed
    3.09: [0.0, 0.38625, 0.7725],  # just above the paper's zero (slope 0.03, flat): floored to 1/4
    4.0: [0.0, 0.5, 1.0],    # at the threshold: the paper's slope is 1/4 itself
    6.0: [0.0, 1.5, 3.0],    # above: the paper's map, slope 1/2, untouched
}


def segment(w: float) -> ChannelSeg:
    k = torch.zeros(1, 1, 8, D, dtype=torch.uint8)
    k[0, 0, 1, 0] = k[0, 0, 2, 0] = k[0, 0, 2, 1] = 1
    v = torch.zeros(1, 1, 8, D, dtype=torch.uint8)
    for t in range(3):
        v[0, 0, t, t] = 1
    ks = torch.zeros(1, 1, 1, D)
    ks[..., :2] = w / 2
    half = dict(device=DEV, dtype=torch.float16)
    return ChannelSeg(pack(k, 1, 2).to(DEV), ks.to(**half), torch.zeros(1, 1, 1, D, **half), pack(v, 1, 2).to(DEV),
                      torch.ones(1, 1, 1, D, **half), torch.zeros(1, 1, 1, D, **half), 1, 8,
                      torch.tensor([3], dtype=torch.int32, device=DEV), (0.0, 3.0))


def query():
    q = torch.zeros(1, 1, D, device=DEV, dtype=torch.float16)
    q[0, 0, :2] = 1
    return q


def test_floor_is_one_quarter():
    assert CALIB_MIN_RATIO == 0.25


@pytest.mark.parametrize("w", sorted(CASES))
def test_reference_attention_keeps_the_order(w):
    out, _ = attention_over_segments(query().float().cpu().unsqueeze(2), [_cpu(segment(w))], sm_scale=1.0)
    p = out[0, 0, 0, :3].tolist()
    assert p == pytest.approx(softmax(CASES[w]), abs=1e-4) and p[0] < p[1] < p[2]


@pytest.mark.parametrize("w", sorted(CASES))
def test_triton_kernel_keeps_the_order(w):
    out = kernels.decode_attention(query(), [segment(w)], sm_scale=1.0, gluon=False)
    p = out[0, 0, :3].float().tolist()
    assert p == pytest.approx(softmax(CASES[w]), abs=2e-3) and p[0] < p[1] < p[2]


def _cpu(seg: ChannelSeg) -> ChannelSeg:
    return ChannelSeg(*(t.cpu() if torch.is_tensor(t) else t for t in
                        (seg.k_codes, seg.k_scale, seg.k_zero, seg.v_codes, seg.v_scale, seg.v_zero, seg.bits,
                         seg.block, seg.lens, seg.calib)))


@pytest.mark.skipif(not CUDA, reason="the Gluon kernels run on CUDA only")
@pytest.mark.parametrize("w", sorted(CASES))
def test_gluon_kernel_keeps_the_order(w):
    """The same hand values through the Gluon channel kernels (the fused 1-bit launch reduces the range itself)."""
    from kernels.decode.plan import _GLUON_BROKEN

    out = kernels.decode_attention(query(), [segment(w)], sm_scale=1.0, gluon=True)
    p = out[0, 0, :3].float().tolist()
    assert not _GLUON_BROKEN  # a failed Gluon build falls back to the Triton kernel, which this must not test
    assert p == pytest.approx(softmax(CASES[w]), abs=2e-3) and p[0] < p[1] < p[2]
