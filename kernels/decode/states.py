"""The softmax state of split-K decode attention, in log2 units (``exp2``): a program's running ``(m, l, acc)``
over the tiles of logits it walks (``online_step``), and the log-sum-exp merge of the partial states of every
split (``merge_step``, looped by ``merge_partials`` for ``_merge_kernel`` here and AlignedKV's statistics pass).
Every Triton decode kernel uses these helpers; Triton inlines them, so the compiled code is the one written out
in place (``eval/bench/triton_ptx.py`` compares the SASS before and after such a move)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_rows(G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, TRIG: tl.constexpr = False):
    """A split-K program of grid ``(splits, H, B)``: ``(split, KV head, row, offs_g [GP], offs_d [D], gmask,
    query heads hq [GP])``; its G query heads are padded to GP (a power of two, ``gmask`` marks the real ones).
    ``TRIG`` (sm_90): the kernel launched as this one's programmatic dependent may start at once; issued first
    thing, before any other work of the program."""
    sp = tl.program_id(0)
    if TRIG:
        sp = tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.b32 $0, $1;", "=r,r", [sp],
                                       dtype=tl.int32, is_pure=False, pack=1)
    h = tl.program_id(1)
    # 64-bit: b times a batch stride passes 2**31 elements in caches of 2**31+ elements (an fp16 cache of B = 64
    # rows of 131072 tokens x 8 heads x 128 ended in an illegal address); h * stride and the in-row offsets fit
    b = tl.program_id(2).to(tl.int64)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    gmask = offs_g < G
    hq = h * G + offs_g
    return sp, h, b, offs_g, offs_d, gmask, hq


@triton.jit
def online_step(m_i, l_i, s):
    """One tile of logits ``s [GP, TT]`` (log2 units, masked to -inf) into the running max ``m_i`` and sum ``l_i``
    ``[GP]``. Returns ``(m_new, l_new, p, alpha)``: the caller rescales its accumulator by ``alpha`` and adds
    ``p @ V`` (how V is read differs per layout, so that part stays with the kernel)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, p, alpha


@triton.jit
def merge_step(m_run, l_run, acc, ml_ptr, o_ptr, idx, mask, offs_d, D: tl.constexpr, HAS_O: tl.constexpr):
    """Fold the partial states ``idx [BS]`` (``(m, l)`` pairs at ``ml_ptr``, outputs ``[D]`` rows at ``o_ptr``;
    ``mask``: which exist) into the merged one, each rescaled by ``exp2`` of its distance to the larger max.
    ``HAS_O=False``: only ``(m, l)``; ``o_ptr`` is not read and ``acc`` comes back as it was."""
    ms = tl.load(ml_ptr + idx * 2, mask=mask, other=-1.0e30)
    ls = tl.load(ml_ptr + idx * 2 + 1, mask=mask, other=0.0)
    m_new = tl.maximum(m_run, tl.max(ms, 0))
    w = tl.exp2(ms - m_new)
    alpha = tl.exp2(m_run - m_new)
    if HAS_O:
        tile = tl.load(o_ptr + idx[:, None] * D + offs_d[None, :], mask=mask[:, None], other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * tile, 0)
    l_run = l_run * alpha + tl.sum(w * ls, 0)
    return m_new, l_run, acc


@triton.jit
def merge_partials(ml_ptr, o_ptr, row, S, offs_d, D: tl.constexpr, BS: tl.constexpr, HAS_O: tl.constexpr):
    """The S partial states of ``row`` (at ``row * S + s``), merged BS at a time: ``(m, l, acc)``, acc over the
    channels ``offs_d`` (rows of the partial outputs are D apart), not yet normalized. m and l start as scalars reduced from BS-wide tensors, the type ``merge_step`` gives back."""
    m_run = tl.max(tl.full([BS], -1.0e30, tl.float32), 0)
    l_run = tl.sum(tl.zeros([BS], tl.float32), 0)
    acc = tl.zeros(offs_d.shape, tl.float32)  # the channels offs_d names (all D, or a chunk of them)
    for s0 in range(0, S, BS):
        offs_s = s0 + tl.arange(0, BS)
        m_run, l_run, acc = merge_step(m_run, l_run, acc, ml_ptr, o_ptr, row * S + offs_s, offs_s < S, offs_d, D,
                                       HAS_O)
    return m_run, l_run, acc


@triton.jit
def _merge_kernel(po_ptr, pml_ptr, out_ptr, lse_ptr, S, so_b, so_h, sl_b,
                  D: tl.constexpr, BS: tl.constexpr, HAS_LSE: tl.constexpr, PDL: tl.constexpr, DC: tl.constexpr):
    """Log-sum-exp merge of the S partials of row (b, hq), channels [c DC, (c+1) DC) for grid ``(Hq, B, D / DC)``
    -> out (and lse, from the first chunk). ``PDL``: launched as a programmatic dependent of the last segment
    kernel; waits for it (``griddepcontrol.wait``) before reading any partial. ``merge_shape`` picks BS and DC."""
    if PDL:
        S = tl.inline_asm_elementwise("griddepcontrol.wait; mov.b32 $0, $1;", "=r,r", [S], dtype=tl.int32,
                                      is_pure=False, pack=1)
    hq = tl.program_id(0)
    b = tl.program_id(1)
    c = tl.program_id(2)
    HQ = tl.num_programs(0)
    row = b * HQ + hq
    offs_d = c * DC + tl.arange(0, DC)
    m_run, l_run, acc = merge_partials(pml_ptr, po_ptr, row, S, offs_d, D, BS, True)
    ok = l_run > 0
    o = tl.where(ok, acc / tl.where(ok, l_run, 1.0), 0.0)
    tl.store(out_ptr + b * so_b + hq * so_h + offs_d, o.to(out_ptr.dtype.element_ty))
    if HAS_LSE:
        lse = tl.where(ok, (m_run + tl.log2(tl.where(ok, l_run, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + b * sl_b + hq, lse, mask=c == 0)


def merge_shape(S: int, D: int, wide: bool = True) -> tuple[int, int]:
    """(BS, DC) of ``_merge_kernel``: partials per round and channels per program. ``wide``: every partial in one
    round up to 128 (the loop's rounds are serial round trips to L2: batch 1 has ~70 splits per row), the
    channels cut into chunks so that a round stays at 4096 values (32 per thread of 4 warps); else 16 per round
    over all D channels (the merge before, ``MMKV_MERGE_WIDE=0``)."""
    if not wide:
        return 16, D
    bs = min(128, 1 << max(0, (S - 1).bit_length()))
    return bs, max(16, min(D, 4096 // bs))
