"""The softmax state of split-K decode attention: the online update of ``(m, l, acc)`` over a tile of logits, and
the log-sum-exp merge of the partials of every split (``_merge_kernel``). All in log2 units (``exp2``)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _merge_kernel(po_ptr, pml_ptr, out_ptr, lse_ptr, S, so_b, so_h, sl_b,
                  D: tl.constexpr, BS: tl.constexpr, HAS_LSE: tl.constexpr, PDL: tl.constexpr):
    """Log-sum-exp merge of the S partials of row (b, hq) -> out (and lse). ``PDL``: launched as a programmatic
    dependent of the last segment kernel; waits for it (``griddepcontrol.wait``) before reading any partial."""
    if PDL:
        S = tl.inline_asm_elementwise("griddepcontrol.wait; mov.b32 $0, $1;", "=r,r", [S], dtype=tl.int32,
                                      is_pure=False, pack=1)
    hq = tl.program_id(0)
    b = tl.program_id(1)
    HQ = tl.num_programs(0)
    row = b * HQ + hq
    offs_d = tl.arange(0, D)
    m_run = tl.max(tl.full([BS], -1.0e30, tl.float32), 0)
    l_run = tl.sum(tl.zeros([BS], tl.float32), 0)
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, S, BS):
        offs_s = s0 + tl.arange(0, BS)
        sm = offs_s < S
        ms = tl.load(pml_ptr + (row * S + offs_s) * 2, mask=sm, other=-1.0e30)
        ls = tl.load(pml_ptr + (row * S + offs_s) * 2 + 1, mask=sm, other=0.0)
        m_new = tl.maximum(m_run, tl.max(ms, 0))
        w = tl.exp2(ms - m_new)
        alpha = tl.exp2(m_run - m_new)
        tile = tl.load(po_ptr + (row * S + offs_s)[:, None] * D + offs_d[None, :], mask=sm[:, None], other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * tile, 0)
        l_run = l_run * alpha + tl.sum(w * ls, 0)
        m_run = m_new
    ok = l_run > 0
    o = tl.where(ok, acc / tl.where(ok, l_run, 1.0), 0.0)
    tl.store(out_ptr + b * so_b + hq * so_h + offs_d, o.to(out_ptr.dtype.element_ty))
    if HAS_LSE:
        lse = tl.where(ok, (m_run + tl.log2(tl.where(ok, l_run, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + b * sl_b + hq, lse)
