"""The GPU tests' check of one decode call against the torch reference (``kernels.reference.decode_reference``) over
rows of which some may be empty (``tests/test_skvq_gluon.py``, ``tests/test_skvq_warps.py``)."""

from __future__ import annotations

import torch


def assert_matches_reference(q, segs, lens, label=None) -> None:
    """``decode_attention`` into a NaN-filled output: no NaN left, relative L2 error < 2e-3 and the log-sum-exp within
    2e-3 over the rows with tokens, exact zeros for the empty rows; ``label`` goes into the error's message."""
    import kernels
    from kernels.reference import decode_reference

    ref, ref_lse = decode_reference(q, segs)
    got, lse = kernels.decode_attention(q, segs, out=torch.full_like(q, float("nan")), return_lse=True)
    live = torch.tensor(lens, device=q.device) > 0
    assert not torch.isnan(got).any()
    err = (got.float() - ref.float())[live].norm() / ref.float()[live].norm()
    assert err < 2e-3, (label, err.item())
    assert torch.allclose(lse[live], ref_lse.float()[live], atol=2e-3, rtol=1e-4)
    assert (got[~live] == 0).all()
