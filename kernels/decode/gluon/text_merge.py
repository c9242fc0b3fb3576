"""The Gluon text kernel's own split-K merge (``text.py``, ``FIN > 0``): no merge launch after it.

Every program writes its partial ``(acc, m, l)`` as before, then counts itself in on an int32 counter of its
(row, KV head) in global memory (block barrier, then one ``acq_rel`` add by one thread: its partial is released
to, and the earlier arrivals' partials acquired by, whoever comes last). The last program to arrive merges.

With few splits (up to two merge rounds of ``merge_width`` partials) that is one level: the last of the pair's
programs merges every partial of its rows, those the layer's other segments' kernels wrote before this launch
included (stream order), into the output (and the log-sum-exp). With more (batch 1: ~70 splits per pair), one
program reading them all would take a round trip to L2 per ``merge_width`` partials, so the splits arrive in
groups of ``SG``: the last of a group merges the group into the partial slot of its first split and counts itself
in on the pair's counter; the last group merges the group slots and the other segments' partials.

Each counter is set back to 0 by the program that found itself last, after every arrival it waits for: the
buffer (one zeroed per GPU and stream, ``dispatch._fin_counters``) needs no clearing between launches or graph
replays. Partials are read past L1 (``.cg``): other programs of this launch wrote them."""

from __future__ import annotations

from .operands import HAVE_GLUON


def merge_width(G: int, W: int) -> int:
    """Partials the merge reads per round (``NS``): 32 query rows of partial output per round, at least one per
    warp (G <= 8 query heads per KV head, padded to a power of two)."""
    gp = 1 << max(0, (G - 1).bit_length())
    return max(W, 32 // gp)


def merge_group(nsplit: int, G: int, W: int) -> int:
    """Splits per first-level group (``SG``): all of them (one level) up to two rounds of ``merge_width``, else
    one round's worth."""
    ns = merge_width(G, W)
    return nsplit if nsplit <= 2 * ns else ns


if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from .operands import _block_barrier

    @gluon.constexpr_function
    def _gp(G):
        return 1 << max(0, (G - 1).bit_length())

    @gluon.jit
    def _merge_rows(po_ptr, pml_ptr, rowb, S_total, s_off, nsplit, first, cnt, stride, outside,
                    G: gl.constexpr, D: gl.constexpr, W: gl.constexpr, NS: gl.constexpr):
        """Log-sum-exp merge of partials of the rows ``rowb + g`` (g < G): ``cnt`` of this launch's, at splits
        ``first + i * stride``, and, with ``outside`` = 1, every split of the other segments (below ``s_off`` or
        from ``s_off + nsplit`` on). ``NS`` per round, their loads independent of each other. Returns ``(m, l,
        acc)``: ``[GP, 1]``, ``[GP, 1]`` and ``[GP, D]`` (acc relative to m, not normalized)."""
        GP: gl.constexpr = _gp(G)
        LD: gl.constexpr = D // 4  # lanes along the channels: 16-byte vectors
        FL: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32 // LD, LD], [W, 1, 1], [2, 1, 0])
        s3 = gl.expand_dims(gl.expand_dims(gl.arange(0, NS, layout=gl.SliceLayout(1, gl.SliceLayout(2, FL))), 1), 2)
        g3 = gl.expand_dims(gl.expand_dims(gl.arange(0, GP, layout=gl.SliceLayout(0, gl.SliceLayout(2, FL))), 0), 2)
        c3 = gl.expand_dims(gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, FL))), 0), 1)
        OL: gl.constexpr = gl.SliceLayout(0, FL)
        m_run = gl.full([GP, 1], -1.0e30, gl.float32, layout=OL)
        l_run = gl.zeros([GP, 1], gl.float32, layout=OL)
        acc = gl.zeros([GP, D], gl.float32, layout=OL)
        pre = s_off * outside  # other segments' splits before this launch's
        nv = cnt + outside * (S_total - nsplit)
        for v0 in range(0, nv, NS):
            v = v0 + s3
            sidx = gl.where(v < pre, v, gl.where(v < pre + cnt, first + (v - pre) * stride, v - cnt + nsplit))
            ok = (g3 < G) & (v < nv)
            row = (rowb + g3) * S_total + sidx
            ms = gl.load(pml_ptr + row * 2, mask=ok, other=-1.0e30, cache_modifier=".cg")
            ls = gl.load(pml_ptr + row * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
            o = gl.load(po_ptr + row * D + c3, mask=ok & (c3 >= 0), other=0.0, cache_modifier=".cg")
            m_new = gl.maximum(m_run, gl.max(ms, axis=0))
            w = gl.exp2(ms - gl.expand_dims(m_new, 0))
            alpha = gl.exp2(m_run - m_new)
            acc = acc * alpha + gl.sum(w * o, axis=0)
            l_run = l_run * alpha + gl.sum(w * ls, axis=0)
            m_run = m_new
        return m_run, l_run, acc

    @gluon.jit
    def _gd(acc):
        """Row (query head) and column (channel) indices of a merged ``[GP, D]`` tensor, in its layout."""
        OL: gl.constexpr = acc.type.layout
        g2 = gl.expand_dims(gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, OL)), 1)
        c2 = gl.expand_dims(gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, OL)), 0)
        return g2, c2

    @gluon.jit
    def _text_finish(po_ptr, pml_ptr, cnt_ptr, cstride, fo_ptr, lse_ptr, so_b, so_h, b, h, sp, HQ, S_total, s_off,
                     SG, G: gl.constexpr, D: gl.constexpr, W: gl.constexpr, NS: gl.constexpr, FIN: gl.constexpr,
                     LV: gl.constexpr):
        """After the program wrote its partial: arrive, and merge if last (module docstring). ``cnt_ptr``:
        ``cstride`` counters per (row, KV head), the pair's own at 0 and group g's at 1 + g. ``LV``: 1, one level
        (``SG`` = the splits); 2, groups of ``SG`` first (a separate variant: the second level's code costs the
        capped 1-bit-key variant 4-6 registers, enough to spill in its loop)."""
        nsplit = gl.num_programs(0)
        rowb = b * HQ + h * G
        base = cnt_ptr + (b * gl.num_programs(1) + h) * cstride
        ngrp = (nsplit + SG - 1) // SG
        _block_barrier()  # every thread's partial stores before the releasing add
        go = sp * 0 + 1  # does this program count in on the pair's counter?
        if LV == 2:
            grp = sp // SG
            gsize = gl.minimum(SG, nsplit - grp * SG)
            old = gl.atomic_add(base + 1 + grp, 1, sem="acq_rel", scope="gpu")
            go = (old == gsize - 1).to(gl.int32)
            if old == gsize - 1:
                gl.store(base + 1 + grp, 0)
                slot = s_off + grp * SG
                m, l, acc = _merge_rows(po_ptr, pml_ptr, rowb, S_total, s_off, nsplit, slot, gsize, 1, 0, G, D, W,
                                        NS)
                g2, c2 = _gd(acc)
                row = (rowb + g2) * S_total + slot
                gl.store(po_ptr + row * D + c2, acc, mask=(g2 < G) & (c2 >= 0))
                gl.store(pml_ptr + row * 2, m, mask=g2 < G)
                gl.store(pml_ptr + row * 2 + 1, l, mask=g2 < G)
                _block_barrier()
        if go != 0:
            ntop = gl.where(ngrp > 1, ngrp, nsplit)
            old = gl.atomic_add(base, 1, sem="acq_rel", scope="gpu")
            if old == ntop - 1:
                gl.store(base, 0)
                m, l, acc = _merge_rows(po_ptr, pml_ptr, rowb, S_total, s_off, nsplit, s_off, ntop,
                                        gl.where(ngrp > 1, SG, 1), 1, G, D, W, NS)
                g2, c2 = _gd(acc)
                live = l > 0
                res = gl.where(live, acc / gl.where(live, l, 1.0), 0.0)
                gl.store(fo_ptr + b * so_b + (h * G + g2) * so_h + c2, res.to(fo_ptr.dtype.element_ty),
                         mask=(g2 < G) & (c2 >= 0))
                if FIN == 2:
                    lse = gl.where(live, (m + gl.log2(gl.where(live, l, 1.0))) * 0.6931471805599453, float("-inf"))
                    gl.store(lse_ptr + rowb + g2, lse, mask=g2 < G)
