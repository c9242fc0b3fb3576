"""Fitted CalibQuant tau (``mmkv-calibrate calibquant``, issue 32, item 4): the fit's objective on a case worked by
hand. How a spec names the artifact: tests/test_method_params.py."""

from __future__ import annotations

import torch

from mmkv.calibrate.calibquant import PAIRS, fit, window_mse


def two_level_keys(n: int, g: torch.Generator) -> torch.Tensor:
    """Each channel takes only its min or its max, so 1-bit channel-wise quantization stores the keys exactly."""
    lo, hi = torch.randn(16, generator=g), torch.randn(16, generator=g) + 3
    pick = torch.randint(0, 2, (n, 16), generator=g).bool()
    return torch.where(pick, hi, lo)


def test_exact_keys_fit_a_map_that_leaves_the_softmax_alone():
    """Quantized logits = exact logits here (up to the fp16 scales: MSE ~1e-10), so every pair with tau1 == tau2
    (slope 1, a shift) leaves the softmax as it is and every other pair rescales the logits (MSE ~1e-5 and up): the
    fit must pick one with tau1 == tau2. Unclipped (clip="off"): the authors' 1-bit clip would move the two levels."""
    g = torch.Generator().manual_seed(0)
    k = two_level_keys(40, g)[None, None]
    v = torch.randn(1, 1, 40, 16, generator=g)
    q = torch.randn(1, 1, 5, 16, generator=g)
    mse = window_mse(q, k, v, bits=1, clip="off")
    for (t1, t2), m in zip(PAIRS, mse.tolist(), strict=True):
        assert (m < 1e-9) if t1 == t2 else (m > 1e-5), (t1, t2, m)
    seq = torch.cat([torch.randn(8, 1, 16, generator=g), k[0, 0, :, None], torch.randn(8, 1, 16, generator=g)])
    qs = torch.randn(56, 1, 16, generator=g)  # rows 48..55 are the queries; any query sees exact logits here
    res = fit([qs], [seq], [torch.randn(56, 1, 16, generator=g)], seq_len=56, bits=1, prefix=8, span=40, q_stride=1,
              clip="off")
    assert res["model_tau"][0] == res["model_tau"][1] and res["mse_model"] < 1e-9 < 1e-5 < res["mse_default"]
