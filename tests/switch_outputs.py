"""One GPU check several kernel test files share: a switch's two values give the same bits."""

from __future__ import annotations

import torch

import kernels


def bit_equal_by_switch(q, segs, monkeypatch, name: str, tps_name: str | None = None) -> dict:
    """``decode_attention``'s (output, log-sum-exp) over ``segs`` with the switch ``name`` at 1 and at 0, outputs
    pre-filled with NaN: at the plan's splits and, where ``tps_name`` is given, again at 3 tiles a split (some
    iterations full, some not, in most splits); each pair must be equal bit for bit.
    -> ``{(tps or None, "1" / "0"): (out, lse)}``."""
    outs = {}
    for tps in (None, "3") if tps_name else (None,):
        if tps:
            monkeypatch.setenv(tps_name, tps)
        for value in ("1", "0"):
            monkeypatch.setenv(name, value)
            outs[tps, value] = kernels.decode_attention(q, segs, out=torch.full_like(q, float("nan")), return_lse=True)
        assert torch.equal(outs[tps, "1"][0], outs[tps, "0"][0]) and torch.equal(outs[tps, "1"][1], outs[tps, "0"][1])
    return outs
