"""Gluon (explicit-layout Triton) kernels for channel-wise segments (CalibQuant K and V), NVIDIA sm_80+.

Two launches per segment and layer (the merge of all segments' partials is ``decode_attention``'s):

1. **range pass** (``MODE=1``), grid ``(n_cal, H, B)``: reads q, K scale/zero and the K codes of its token range;
   writes ``cal[b, h*G + g, split] = (min, max)`` of the uncalibrated logits (log2 units) of its valid tokens.
   It asks L2 to keep K (``evict_last``) for the main pass.
2. **main pass** (``MODE=0``), grid ``(splits, H, B)``: reduces the ``cal`` row of each head to gamma = min,
   delta = max, folds CalibQuant's pre-softmax map ``g(x) = r*x + (1-r)*gamma - tau1`` (Sec. 2.3) into ``q*s``
   (post-scaling, Sec. 2.2: K is never dequantized) and takes ``M = max g`` as the softmax reference of every
   split and warp: no running max, no rescaling of the accumulator, and the partials of all warps add up without
   exponentials. Reads the K and V codes of its range once; writes the partial ``(sum_t p_t v_t, M, sum_t p_t)``
   at its global split index. Without calibration ``r = 1`` and ``M = delta`` (the range pass runs either way).

Or one **fused** launch (``MODE=2``, 1-bit codes on the int8 K side; ``decode_attention`` picks it where every
program of the grid is resident at once and its logits fit in shared memory): each program runs the range pass's
loop over its split, keeping the raw K logits of every step in shared memory (``ITM`` iterations), writes its
(min, max) to ``cal``, requests its first V codes, then waits at a barrier of the splits of its (row, KV head)
(one int32 counter per pair in ``sync``: a release add, acquire polls; a second add counts programs out and the
last one resets the counter, so the buffer stays zero between launches), reduces ``cal`` as the main pass does and
runs the main pass's loop over V with the logits from shared memory. K is read once; reads q, scales, K and V codes,
``cal`` (written by the other programs of the pair); writes ``cal`` and the partial. On sm_90 (``CL > 0``) the
splits of a pair are instead the ``CL`` CTAs of one thread block cluster and meet at the hardware cluster barrier
(``CL == 1``: one program per pair, no cluster launched, which reduces its own range: no ``cal``); with ``FIN`` the
cluster then merges every partial of its rows (its own and those of the layer's segments launched before it) into
the layer's output, channels split over its CTAs (``_finish``), or, one program and one partial, writes the output
directly.

How the codes become tensor-core operands (per warp and iteration: 8 byte rows of K and V, 16 for 8-bit codes):

* One ``and`` per register (2 codes): the code byte sits in the low byte of an fp16 half, so masking plane ``i``
  leaves ``c * 2**(bits*i - 24)``, an exact fp16 subnormal (tensor cores multiply subnormals exactly; fp32
  accumulation keeps the tiny products). No integer-to-float conversion, no offset to correct.
* K side: ``logits^T[16 rows, head] = mma(codes[rows, channel], (q*s)^T[channel, head])``; rows 0-7 are plane
  2j and rows 8-15 plane 2j+1 of the 8 byte rows (step j), so each row's plane scale ``2**(24 - bits*i)`` is a
  per-register constant of the one FFMA that also adds ``q.z``, the calibration and ``-M``.
* V side: ``out^T[channel, head] += mma(codes^T[channel, 16 rows], p'^T[16 rows, head])``. The B operand is the K
  side's accumulator transposed per 8x8 block (one ``movmatrix`` per register), and ``p' = p * 2**(15 - bits*i)``
  (through the exponent: one FFMA + one ex2 per logit) cancels the plane's scale, so all planes add into one
  accumulator that ends as ``2**-9 * sum p c``.
* Query heads are the MMA's N = 8 (G <= 8).
* ``I8`` (1-bit codes, G <= 4; ``decode_attention`` decides): the K side runs on int8 tensor cores
  (``mma.m16n8k32``). One ``and`` per register of 4 codes (byte values 0 or ``2**i``, the top plane read as -128);
  ``q*s`` is 16-bit fixed point per head whose high and low signed bytes fill columns 2h and 2h + 1, so N = 8 holds
  4 heads without padding and ``high * 256 + low`` is lane-local (layout ``S4``: [W, 16, 4] per-head logits). The
  fixed point's per-head scale (times the calibration ratio) multiplies the row scale; p returns to the fp16 V side
  at the even columns. Exact int32 sums; the fixed point is finer than fp16 ``q*s`` (eval/query_precision.py).
* Channels are relabelled (a fixed permutation, applied to q/K-scales on the K side and to the output/V-scales on
  the V side) so that each lane loads 16-byte vectors and every fragment is a pure register relabelling of them
  (``convert_layout(..., assert_trivial=True)`` proves it at compile time). Codes travel as int32 words: a loop
  that carries uint8 tensors makes LLVM keep one byte per register and repack them (~200 extra ``prmt``).
* The next iteration's words are loaded before this one's are used (two iterations ahead in the range pass),
  inside a branch: without it ptxas sinks the loads to the end of the loop body and every iteration waits. Or,
  with ``ST > 0`` stages (2-8 bit codes in long programs, ``default_stages``), each lane copies its words with
  ``cp.async`` into a swizzled shared-memory ring ``ST - 1`` iterations ahead and reads back its own bytes.
* On sm_90 (``PDL``) the range pass lets the main pass launch at once (``griddepcontrol.launch_dependents``); the
  main pass loads q, the scales and its first codes, then waits (``griddepcontrol.wait``) before it reads ``cal``,
  and lets the merge launch when its loop ends (so does the fused kernel). A fused kernel with ``FIN`` may itself
  be launched as a dependent of the layer's previous segment kernel (``dependent``; that kernel lets it start
  at once): all of its work overlaps that kernel, and it waits only before ``_finish`` reads the partials.
* The epilogue sums the warps' accumulators in registers after one layout conversion (``RL``: each lane holds
  every warp's value of its elements) and writes the partial by physical channel in 16-byte vectors.

Requirements (checked by the caller): one scale block covers the capacity, G <= 8, D in {64, 128}, code rows
contiguous (row stride D). Measured speed and the analysis of what limits it: docs/KERNELS.md, docs/BENCHMARKS.md.
"""

from __future__ import annotations

import math

try:  # Gluon ships with Triton >= 3.4; the CPU interpreter cannot run it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    HAVE_GLUON = hasattr(gluon, "constexpr_function")
    # the block barrier: Triton 3.6 (the GPU image) names it thread_barrier, 3.9 barrier
    _block_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # cp.async into shared memory: Triton 3.6 (the GPU image) names it async_copy_global_to_shared, 3.9 async_load
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
except Exception:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

__all__ = ["HAVE_GLUON", "build_layouts", "default_stages", "fused_shared_bytes", "kernel_consts", "launch_channel",
           "programs_by_registers", "resident_programs", "rows_per_warp"]

# p' = p * 2**(P_EXP - bits*i) stays <= 2**15 (fp16 max 65504: room for calibrated logits a little above the range
# pass's maximum) and is a normal fp16 for p >= 2**-22 on every plane; the V accumulator ends as 2**(P_EXP-24) sum.
P_EXP = 15


def default_stages(bits: int, iterations: int = 1 << 30) -> int:
    """Shared-memory ring depth for programs of ``iterations`` loop iterations (H100 sweep, docs/BENCHMARKS.md):
    1-bit codes are bound by the unpacking, and the ring's barriers cost more than it hides; wider codes move more
    bytes per token and gain, except in short programs (small batch), where filling the ring does not pay."""
    return 0 if bits == 1 or iterations < 8 else 4


def rows_per_warp(bits: int) -> int:
    """Byte rows a warp takes per iteration: 8 (two planes of them fill the MMA's 16 rows), 16 for 8-bit codes."""
    return 16 if bits == 8 else 8


if HAVE_GLUON:
    _V_SCALE = gl.constexpr(float(2.0 ** (24 - P_EXP)))

    @gluon.constexpr_function
    def _rw(bits):  # rows_per_warp (a constexpr function may not call a plain one)
        return 16 if bits == 8 else 8

    @gluon.constexpr_function
    def _per_lane(n, W):  # elements per lane of an [n] vector over W warps (replicated where n < 32 W)
        return max(1, n // (32 * W))

    @gluon.constexpr_function
    def _plane_of(bits, j, hh):  # plane of accumulator rows 8*hh + g at step j
        return 0 if bits == 8 else 2 * j + hh

    @gluon.constexpr_function
    def _k_scale(bits, plane, i8=False):
        # fp16 operands: plane i holds c * 2**(bits*i - 24); int8 operands (i8): a byte reads as c * 2**(bits*i),
        # the 1-bit top plane as -128
        if i8:
            return float(-(2.0 ** -7)) if bits * plane == 7 else float(2.0 ** -(bits * plane))
        return float(2.0 ** (24 - bits * plane))

    @gluon.constexpr_function
    def _p_shift(bits, plane):  # log2 of p'/p
        return float(P_EXP - bits * plane)

    @gluon.constexpr_function
    def _l_scale(bits, plane):
        return float(2.0 ** (bits * plane - P_EXP))

    @gluon.constexpr_function
    def _plane_and(bits, i):
        m = (((1 << bits) - 1) << (bits * i)) * 0x10001
        return f"and.b32 $0, $2, {m:#x}; and.b32 $1, $6, {m:#x};"

    @gluon.constexpr_function
    def _plane_and8(bits, i):
        return f"and.b32 $0, $1, {(((1 << bits) - 1) << (bits * i)) * 0x01010101:#x};"

    @gluon.constexpr_function
    def _l2_only(on):  # load past L1 (".cg") where other programs of the launch wrote the data
        return ".cg" if on else ""

    @gluon.constexpr_function
    def _k_evict(mode):  # the range pass asks L2 to keep K for the main pass, which reads it for the last time
        return "evict_last" if mode == 1 else "evict_first"

    @gluon.jit
    def _gdc(x, OP: gl.constexpr):
        """``griddepcontrol`` (programmatic dependent launch, sm_90): ``wait`` blocks until the previous kernel in
        the stream has finished and its writes are visible; ``launch_dependents`` lets the next kernel's programs
        start. Returns ``x`` (a scalar) so that what must follow the wait can depend on it."""
        return gl.inline_asm_elementwise(f"griddepcontrol.{OP}; mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _prmt(x, y, SEL: gl.constexpr):
        return gl.inline_asm_elementwise(SEL, "=r,r,r", [x, y], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _quad(x):
        """int32 words [W, R, N] -> [W, R, 4N], each word repeated for its 4 code bytes (as consecutive registers of
        one thread: the same register, no instruction), the shape the fp16 results of ``_plane`` take."""
        W: gl.constexpr = x.shape[0]
        R: gl.constexpr = x.shape[1]
        N: gl.constexpr = x.shape[2]
        j = gl.join(x, x)
        return gl.reshape(gl.join(j, j), [W, R, 4 * N])

    @gluon.jit
    def _plane(lo, hi, BITS: gl.constexpr, I: gl.constexpr):
        """Words (``_quad``-ed) -> fp16 pairs (lo & mask_i, hi & mask_i): code byte j of a word goes to slot
        (0, 2, 1, 3)[j] when ``hi = lo >> 8``."""
        return gl.inline_asm_elementwise(_plane_and(BITS, I), "=r,=r,r,r,r,r,r,r,r,r", [lo, hi], dtype=gl.float16,
                                         is_pure=True, pack=4)

    @gluon.jit
    def _plane8(xq, BITS: gl.constexpr, I: gl.constexpr):
        """Words (``_quad``-ed) -> int8, code byte e of word w at position 4w + e, masked to plane I (1-bit codes:
        byte values 0 or 2**I, read as signed: 2**7 is -128, which ``_k_scale`` undoes)."""
        return gl.inline_asm_elementwise(_plane_and8(BITS, I), "=r,r,r,r,r", [xq], dtype=gl.int8, is_pure=True,
                                         pack=4)

    @gluon.jit
    def _rows16(a, b):
        """Two [W, 8, X] tensors -> [W, 16, X] (``b`` as rows 8..15), a register relabelling."""
        W: gl.constexpr = a.shape[0]
        X: gl.constexpr = a.shape[2]
        return gl.reshape(gl.permute(gl.join(a, b), [0, 3, 1, 2]), [W, 16, X])

    @gluon.jit
    def _k_operand(xk, xk8, BITS: gl.constexpr, J: gl.constexpr, DA: gl.constexpr):
        """K codes (``xk``, ``xk8``: ``_quad``-ed words and words >> 8) -> A operand [W, 16, D (k)] of step J: rows
        8*hh + g are byte row g, plane 2J + hh (8-bit codes: byte row v).

        After ``_plane``, position p = CPQ*t + 4*ks + 2*hi + e of a byte row holds channel CPQ*t + 4*ks + 2*e + hi;
        its logical k is 16*ks + 8*hi + 2*t + e (``phi`` in the kernel)."""
        W: gl.constexpr = xk.shape[0]
        D: gl.constexpr = xk.shape[2]
        if BITS == 8:
            h = _plane(xk, xk8, BITS, 0)
        else:
            h = _rows16(_plane(xk, xk8, BITS, 2 * J), _plane(xk, xk8, BITS, 2 * J + 1))
        h6 = gl.permute(gl.reshape(h, [W, 16, 4, D // 16, 2, 2]), [0, 1, 3, 4, 2, 5])
        return gl.convert_layout(gl.reshape(h6, [W, 16, D]), DA, assert_trivial=True)

    @gluon.jit
    def _k_operand8(xq, BITS: gl.constexpr, J: gl.constexpr, DA8: gl.constexpr):
        """K codes (``_quad``-ed words) -> int8 A operand [W, 16, D (k)] of step J for ``mma.m16n8k32``; rows as in
        ``_k_operand``. Position P = C*t + 4*w + e (C = D/4 channels per lane) holds channel P; its logical k is
        32*(w // 2) + 16*(w % 2) + 4*t + e (``phi8`` in the kernel)."""
        W: gl.constexpr = xq.shape[0]
        D: gl.constexpr = xq.shape[2]
        h = _rows16(_plane8(xq, BITS, 2 * J), _plane8(xq, BITS, 2 * J + 1))
        h6 = gl.permute(gl.reshape(h, [W, 16, 4, D // 32, 2, 4]), [0, 1, 3, 4, 2, 5])
        return gl.convert_layout(gl.reshape(h6, [W, 16, D]), DA8, assert_trivial=True)

    @gluon.jit
    def _cols8(x4, fill: gl.constexpr, MMA: gl.constexpr):
        """[W, 16, 4] per-head values (int8 path) -> [W, 16, 8] in the accumulator layout, head h at column 2h and
        ``fill`` at the odd columns (a register relabelling)."""
        W: gl.constexpr = x4.shape[0]
        R: gl.constexpr = x4.shape[1]
        f = gl.full(x4.shape, fill, x4.dtype, layout=x4.type.layout)
        return gl.convert_layout(gl.reshape(gl.join(x4, f), [W, R, 8]), MMA, assert_trivial=True)

    @gluon.jit
    def _per_head(v8, S4: gl.constexpr):
        """[W, 8] per column (int8 path: column n belongs to head n // 2) -> [W, 1, 4] per head in ``S4``."""
        W: gl.constexpr = v8.shape[0]
        v8 = gl.convert_layout(v8, gl.BlockedLayout([1, 8], [32, 1], [W, 1], [1, 0]))
        ev, _ = gl.split(gl.reshape(v8, [W, 4, 2]))
        return gl.expand_dims(gl.convert_layout(ev, gl.SliceLayout(1, S4)), 1)

    @gluon.jit
    def _head_consts(qp, sq_h, ksp, kzp, qk_scale, G: gl.constexpr, D: gl.constexpr, W: gl.constexpr, SDK: gl.constexpr,
                     S4: gl.constexpr):
        """The fused K loop's per-head constants (the fixed-point scale ``max|q*s| / 32512`` and ``q.z``) as [W, 1, 4]
        in ``S4``, computed from q and the K scale/zero read again in a layout whose head axis sits where ``S4`` has
        it (lane bits 0-1), so the reductions over channels stay in the warp and no layout conversion follows (two
        ``_per_head`` conversions took 7 block barriers). ``qp`` points at the KV head's first q row (rows ``sq_h``
        apart), ``ksp``/``kzp`` at the scale/zero rows. Same products and maxima as the ``QL`` path, so the scale is
        bit-identical to the one the fixed-point q was made with."""
        PH: gl.constexpr = gl.BlockedLayout([1, D // 8, 1], [1, 8, 4], [W, 1, 1], [2, 1, 0])
        k3 = gl.expand_dims(gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, PH))), 0), 2)
        h3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, PH))), 0), 1)
        w3 = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, PH))), 1), 2)
        qv = gl.load(qp + h3 * sq_h + k3 + w3 * 0, mask=(h3 < G) & (k3 >= 0) & (w3 >= 0), other=0.0).to(gl.float32)
        ksv = gl.load(ksp + k3 * SDK).to(gl.float32)
        kzv = gl.load(kzp + k3 * SDK).to(gl.float32)
        qz = gl.sum(qv * kzv, axis=1) * qk_scale  # [W, 4]
        sc = gl.max(gl.abs(qv * ksv * qk_scale), axis=1) / 32512.0
        sc = gl.where(sc > 0, sc, 1.0)
        HS: gl.constexpr = gl.SliceLayout(1, S4)
        return (gl.expand_dims(gl.convert_layout(sc, HS, assert_trivial=True), 1),
                gl.expand_dims(gl.convert_layout(qz, HS, assert_trivial=True), 1))

    @gluon.jit
    def _v_pairs(ua, sa, ub, sb, BITS: gl.constexpr, I: gl.constexpr):
        """Row pairs [W, RP, D] -> [W, RP, D, 2 (s)]: position p = 4a + 2jh + je of half s holds (row 2rp + je,
        channel 4a + 2s + jh), plane I."""
        return gl.join(_plane(ua, sa, BITS, I), _plane(ub, sb, BITS, I))

    @gluon.jit
    def _v_operand(ua, sa, ub, sb, BITS: gl.constexpr, J: gl.constexpr, DA: gl.constexpr):
        """V codes -> A operand V^T [W, D (m), 16 (kappa)] of step J; kappa = 8*h + row (plane 2J + h), 8-bit: row.

        With a = CPR/4*g + a2 the logical m is g + 8*jh + 16*(2*a2 + s) (``psi`` in the kernel)."""
        W: gl.constexpr = ua.shape[0]
        D: gl.constexpr = ua.shape[2]
        if BITS == 8:
            j = _v_pairs(ua, sa, ub, sb, BITS, 0)  # [W, 8 (rp), D, 2]
            j = gl.reshape(j, [W, 8, 8, D // 32, 2, 2, 2])  # [W, rp, g, a2, jh, je, s]
            j = gl.permute(j, [0, 3, 6, 4, 2, 1, 5])  # [W, a2, s, jh, g, rp, je]
        else:
            j = gl.join(_v_pairs(ua, sa, ub, sb, BITS, 2 * J), _v_pairs(ua, sa, ub, sb, BITS, 2 * J + 1))
            j = gl.reshape(j, [W, 4, 8, D // 32, 2, 2, 2, 2])  # [W, rp, g, a2, jh, je, s, h]
            j = gl.permute(j, [0, 3, 6, 4, 2, 7, 1, 5])  # [W, a2, s, jh, g, h, rp, je]
        return gl.convert_layout(gl.reshape(j, [W, D, 16]), DA, assert_trivial=True)

    @gluon.jit
    def _p_operand(p16, DB: gl.constexpr):
        """fp16 [W, 16 (row), 8 (head)] in the accumulator layout -> B operand p^T [W, 16 (row), 8 (head)].

        ``movmatrix.trans`` moves (row 8hh + a, head b) of each 8x8 block to the lane that held (row 8hh + b,
        head a); relabelling the result's indices accordingly gives exactly the B-operand fragment."""
        W: gl.constexpr = p16.shape[0]
        t = gl.inline_asm_elementwise("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r", [p16],
                                      dtype=gl.float16, is_pure=True, pack=2)
        t = gl.permute(gl.reshape(t, [W, 2, 8, 8]), [0, 1, 3, 2])
        return gl.convert_layout(gl.reshape(t, [W, 16, 8]), DB, assert_trivial=True)

    @gluon.jit
    def _rows_cols(L3: gl.constexpr, W: gl.constexpr, R: gl.constexpr, C: gl.constexpr):
        """[W, R, 1] warp-major row index and [1, 1, C] column index tensors in layout ``L3``."""
        w = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        r = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        c = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        rows = gl.expand_dims(gl.expand_dims(w, 1), 2) * R + gl.expand_dims(gl.expand_dims(r, 0), 2)
        return rows, gl.expand_dims(gl.expand_dims(c, 0), 1)

    @gluon.jit
    def _row_consts(BITS: gl.constexpr, J: gl.constexpr, LA: gl.constexpr, I8: gl.constexpr = False):
        """Per logit row (plane of rows 8*hh + g at step J): K scale, log2(p'/p), p/p' as [1, 16, 1] in layout
        ``LA`` (the accumulator's, or ``S4`` on the int8 path)."""
        v = gl.expand_dims(gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, LA))), 0), 2)
        first = v < 8
        ksc = gl.where(first, _k_scale(BITS, _plane_of(BITS, J, 0), I8), _k_scale(BITS, _plane_of(BITS, J, 1), I8))
        psh = gl.where(first, _p_shift(BITS, _plane_of(BITS, J, 0)), _p_shift(BITS, _plane_of(BITS, J, 1)))
        lsc = gl.where(first, _l_scale(BITS, _plane_of(BITS, J, 0)), _l_scale(BITS, _plane_of(BITS, J, 1)))
        return ksc, psh, lsc

    @gluon.jit
    def _load(kbase, vbase, r0, xrow, xcol, yrow, ycol, rows_cap, MODE: gl.constexpr, D: gl.constexpr,
              Y0L: gl.constexpr, FUSED: gl.constexpr = False):
        """Code words (4 bytes) of one iteration (rows r0 + warp tiles); rows past the capacity read as 0. The range
        pass asks L2 to keep K for the main pass, which reads K and V for the last time. The fused kernel's V phase
        (``MODE 0`` with ``FUSED``) reads V only."""
        if MODE == 0 and FUSED:
            xk = (xrow + xcol) * 0  # unused: a zero tensor in K's layout
        else:
            xk = gl.load(kbase + (r0 + xrow) * (D // 4) + xcol, mask=(r0 + xrow < rows_cap) & (xcol >= 0), other=0,
                         eviction_policy=_k_evict(MODE))
        if MODE == 1:
            xv = gl.zeros([xrow.shape[0], xrow.shape[1], D // 4], gl.int32, layout=Y0L)
        else:
            xv = gl.load(vbase + (r0 + yrow) * (D // 4) + ycol, mask=(r0 + yrow < rows_cap) & (ycol >= 0), other=0,
                         eviction_policy="evict_first")
        return xk, xv

    @gluon.jit
    def _tile(xk, xv, rbase, L, a_q, c0, l_acc, acc, lo, hi,
              MODE: gl.constexpr, MASKED: gl.constexpr, BITS: gl.constexpr,
              YL: gl.constexpr, MMA: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr,
              I8: gl.constexpr, S4: gl.constexpr, DA8: gl.constexpr, sml=0, slot=0, FUSED: gl.constexpr = False):
        """One iteration over every warp's byte rows. MODE 0 adds to (l_acc, acc); MODE 1 to (lo, hi).

        ``I8``: the K side on int8 tensor cores; ``a_q`` holds q*s as 16-bit fixed point, high and low bytes in
        columns 2h and 2h + 1, ``c0`` = (per-head scale of the fixed point, offset) as [W, 1, 4] in ``S4``.
        ``FUSED`` (int8 only): MODE 1 also keeps the raw logits of step j in slot ``slot`` of the shared-memory
        buffer ``sml[j]``, and MODE 0 takes them from there instead of reading K."""
        PER: gl.constexpr = 8 // BITS
        NJ: gl.constexpr = 1 if BITS == 8 else PER // 2
        RW: gl.constexpr = _rw(BITS)
        W: gl.constexpr = xk.shape[0]
        D: gl.constexpr = 4 * xk.shape[2]
        LA: gl.constexpr = S4 if I8 else MMA  # layout of the logits
        xk4 = _quad(xk)
        if I8:
            kq, c0 = c0
            zk = gl.zeros([W, 16, 8], gl.int32, layout=MMA)
        else:
            xk8 = _quad(xk >> 8)
            zk = gl.zeros([W, 16, 8], gl.float32, layout=MMA)
        if MASKED:  # first token of accumulator row v = 8*hh + g (add the step's 2*J)
            aw = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, LA))), 1), 2)
            av = gl.expand_dims(gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, LA))), 0), 2)
            if BITS == 8:
                tok0 = rbase + aw * RW + av
            else:
                tok0 = (rbase + aw * RW + av % 8) * PER + av // 8
        ps = ()
        for j in gl.static_range(NJ):  # K side: logits of 16 (row, plane) pairs per warp, then p'
            ksc, psh, lsc = _row_consts(BITS, j, LA, I8)
            if FUSED and MODE == 0:
                s = sml[j].index(slot).load(S4)
                ksc = ksc * kq
            elif I8:  # x = (high * 256 + low) * scale: the two bytes of each head sit in one lane's registers
                ci = mma_v2(_k_operand8(xk4, BITS, j, DA8), a_q, zk)
                chi, clo = gl.split(gl.reshape(ci, [W, 16, 4, 2]))
                s = gl.convert_layout(chi * 256 + clo, S4, assert_trivial=True).to(gl.float32)
                ksc = ksc * kq
                if FUSED:
                    sml[j].index(slot).store(s)
            else:
                s = mma_v2(_k_operand(xk4, xk8, BITS, j, DA), a_q, zk)
            if MODE == 1:
                x = s * ksc + c0
                if MASKED:
                    ok = (tok0 + 2 * j) < L
                    lo = gl.minimum(lo, gl.where(ok, x, float("inf")))
                    hi = gl.maximum(hi, gl.where(ok, x, float("-inf")))
                else:
                    lo = gl.minimum(lo, x)
                    hi = gl.maximum(hi, x)
            else:
                p = gl.exp2(s * ksc + (c0 + psh))
                if MASKED:
                    p = gl.where((tok0 + 2 * j) < L, p, 0.0)
                l_acc = l_acc + p * lsc
                if I8:
                    ps = ps + (_p_operand(_cols8(p.to(gl.float16), 0.0, MMA), DB),)
                else:
                    ps = ps + (_p_operand(p.to(gl.float16), DB),)
        if MODE == 0:  # V side, after the K codes are dead: fewer registers live at once
            xv = gl.convert_layout(xv, YL)  # register renumbering only (the rows' parity becomes register 0)
            x0, x1 = gl.split(gl.permute(gl.reshape(xv, [W, RW // 2, 2, D // 4]), [0, 1, 3, 2]))
            ua = _prmt(x0, x1, "prmt.b32 $0, $1, $2, 0x5410;")  # bytes 0, 1 of both rows
            ub = _prmt(x0, x1, "prmt.b32 $0, $1, $2, 0x7632;")  # bytes 2, 3
            sa = _quad(ua >> 8)
            sb = _quad(ub >> 8)
            ua = _quad(ua)
            ub = _quad(ub)
            for j in gl.static_range(NJ):
                acc = mma_v2(_v_operand(ua, sa, ub, sb, BITS, j, DA), ps[j], acc)
        return l_acc, acc, lo, hi

    @gluon.jit
    def _issue(smk, smv, it, codes, MODE: gl.constexpr, D: gl.constexpr, ST: gl.constexpr):
        """Asynchronous copies (``cp.async``, 16 bytes per lane and instruction) of iteration ``it``'s code words into
        ring stage ``it % ST``; one commit group per iteration, also for iterations past the program's last (masked:
        no memory traffic) so that ``wait_group`` counts stay uniform."""
        kbase, vbase, row0, xrow, xcol, yrow, ycol, rows_cap, n_it = codes
        ROWS: gl.constexpr = xrow.shape[0] * xrow.shape[1]
        r0 = row0 + it * ROWS
        live = it < n_it
        st = it % ST
        _cp_async(smk.index(st), kbase + (r0 + xrow) * (D // 4) + xcol,
                  mask=(r0 + xrow < rows_cap) & (xcol >= 0) & live, eviction_policy=_k_evict(MODE))
        if MODE == 0:
            _cp_async(smv.index(st), vbase + (r0 + yrow) * (D // 4) + ycol,
                      mask=(r0 + yrow < rows_cap) & (ycol >= 0) & live,
                      eviction_policy="evict_first")
        async_copy.commit_group()

    @gluon.jit
    def _iterations(it0, it1, codes, L, a_q, c0, xk, xv, xk2, xv2, l_acc, acc, lo, hi, smk, smv,
                    MODE: gl.constexpr, MASKED: gl.constexpr, PF: gl.constexpr, ST: gl.constexpr,
                    BITS: gl.constexpr, D: gl.constexpr, XL: gl.constexpr,
                    Y0L: gl.constexpr, YL: gl.constexpr, MMA: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr,
                    I8: gl.constexpr, S4: gl.constexpr, DA8: gl.constexpr, sml=0, FUSED: gl.constexpr = False):
        """Iterations [it0, it1) of a program.

        ``ST > 0``: the codes arrive through a shared-memory ring of ``ST`` stages, ``ST - 1`` iterations ahead
        (each lane reads back exactly the bytes its own copies wrote, so no barrier would be needed; Triton's
        shared-memory hazard pass still inserts two block barriers per iteration).
        ``ST == 0``: register prefetch; the codes of iteration it + PF (``xk``/``xv`` hold it's, ``xk2``/``xv2``
        it + 1's when PF = 2) are requested before iteration it's are used; the branch keeps ptxas from sinking
        those loads to the end of the loop body (it does, to shorten their registers' lives, and then every
        iteration waits for memory)."""
        kbase, vbase, row0, xrow, xcol, yrow, ycol, rows_cap, n_it = codes
        ROWS: gl.constexpr = xrow.shape[0] * xrow.shape[1]
        for it in range(it0, it1):
            if ST > 0:
                async_copy.wait_group(ST - 2)
                xk = smk.index(it % ST).load(XL)
                if MODE == 0:
                    xv = smv.index(it % ST).load(Y0L)
                _issue(smk, smv, it + ST - 1, codes, MODE, D, ST)
                l_acc, acc, lo, hi = _tile(xk, xv, row0 + it * ROWS, L, a_q, c0, l_acc, acc, lo, hi,
                                           MODE, MASKED, BITS, YL, MMA, DA, DB, I8, S4, DA8)
            else:
                if it + PF < n_it:
                    nk, nv = _load(kbase, vbase, row0 + (it + PF) * ROWS, xrow, xcol, yrow, ycol, rows_cap, MODE, D,
                                   Y0L, FUSED)
                else:
                    nk, nv = xk, xv
                l_acc, acc, lo, hi = _tile(xk, xv, row0 + it * ROWS, L, a_q, c0, l_acc, acc, lo, hi,
                                           MODE, MASKED, BITS, YL, MMA, DA, DB, I8, S4, DA8, sml, it, FUSED)
                if PF == 2:
                    xk, xv = xk2, xv2
                    xk2, xv2 = nk, nv
                else:
                    xk, xv = nk, nv
        return xk, xv, xk2, xv2, l_acc, acc, lo, hi

    @gluon.jit
    def _reference(cal_ptr, n_cal, row0, g2, qz, tau1, tau2, G: gl.constexpr, CALIB: gl.constexpr,
                   L2_ONLY: gl.constexpr):
        """Reduce the ``cal`` rows ``row0 + g2`` (every split's (min, max)) to gamma, delta; returns the calibration
        ratio ``r`` (1 without ``CALIB``), the softmax reference ``M = max g`` and ``q.z*r + (1-r)*gamma - tau1 - M``
        per column (-1e30 for padding heads and empty rows: p = 0). ``L2_ONLY``: the rows were written by other
        programs of this launch, so they are read past L1 (which is not coherent)."""
        W: gl.constexpr = g2.shape[0]
        NCH: gl.constexpr = 32  # splits per load: one round trip for up to 32 splits
        CL: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 8, 4], [W, 1, 1], [2, 1, 0])
        g3 = gl.expand_dims(gl.convert_layout(g2, gl.SliceLayout(2, CL)), 2)
        s3 = gl.expand_dims(gl.expand_dims(gl.arange(0, NCH, layout=gl.SliceLayout(0, gl.SliceLayout(1, CL))), 0), 1)
        gmin = gl.full([W, 8], float("inf"), gl.float32, layout=gl.SliceLayout(2, CL))
        gmax = gl.full([W, 8], float("-inf"), gl.float32, layout=gl.SliceLayout(2, CL))
        for s0 in range(0, n_cal, NCH):
            cbase = cal_ptr + ((row0 + g3) * n_cal + s0 + s3) * 2
            ok = (g3 < G) & (s0 + s3 < n_cal)
            lo = gl.load(cbase, mask=ok, other=float("inf"), cache_modifier=_l2_only(L2_ONLY))
            hi = gl.load(cbase + 1, mask=ok, other=float("-inf"), cache_modifier=_l2_only(L2_ONLY))
            gmin = gl.minimum(gmin, gl.min(lo, axis=2))
            gmax = gl.maximum(gmax, gl.max(hi, axis=2))
        gmin = gl.convert_layout(gmin, g2.type.layout)
        gmax = gl.convert_layout(gmax, g2.type.layout)
        return _calibrated(gmin, gmax, g2, qz, tau1, tau2, G, CALIB)

    @gluon.jit
    def _minmax(a_lo, a_hi, b_lo, b_hi):  # combine of one reduction that yields min and max together
        return gl.minimum(a_lo, b_lo), gl.maximum(a_hi, b_hi)

    @gluon.jit
    def _own_calibrated(lo, hi, kq, qzh, tau1, tau2, G: gl.constexpr, CALIB: gl.constexpr):
        """A one-program pair's calibration, per head in the int8 path's ``S4``: (min, max) of ``lo``/``hi`` ([W, 16,
        4]) over rows and warps in one reduction (one shared-memory round), then ``_calibrated``'s rule per head on
        [1, 1, 4] operands that broadcast against the K loop's per-head constants ``kq`` (fixed-point scale) and
        ``qzh`` (q.z), so no layout conversion follows. Returns the V loop's ``(kq * r, q.z*r + shift - M)`` and
        ``M`` per head ([4])."""
        hmin, hmax = gl.reduce((lo, hi), 1, _minmax)
        hmin, hmax = gl.reduce((hmin, hmax), 0, _minmax)  # [4], the same in every warp
        hd = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=hmin.type.layout), 0), 1)  # [1, 1, 4] in S4
        ratio, m_ref, c0 = _calibrated(gl.expand_dims(gl.expand_dims(hmin, 0), 1),
                                       gl.expand_dims(gl.expand_dims(hmax, 0), 1), hd, qzh, tau1, tau2, G, CALIB)
        if CALIB:
            kq = kq * ratio
        return (kq, c0), gl.reshape(m_ref, [4])

    @gluon.jit
    def _calibrated(gmin, gmax, g2, qz, tau1, tau2, G: gl.constexpr, CALIB: gl.constexpr):
        """``_reference``'s result from the pair's gamma = ``gmin``, delta = ``gmax`` per column (``g2``: its head; or
        per head, ``_own_calibrated``)."""
        m_ref = gmax
        ratio = gl.full(g2.shape, 1.0, gl.float32, layout=g2.type.layout)
        if CALIB:
            big = gmax - gmin
            ok = big > 0
            width = gl.where(ok, big, 1.0)
            ratio = gl.where(ok, (width + tau1 - tau2) / width, 1.0)
            shift = gl.where(ok, (1.0 - ratio) * gl.where(ok, gmin, 0.0) - tau1, 0.0)
            m_ref = gl.where(ok, gl.maximum(gmin - tau1, gmax - tau2), gmax)
            qz = qz * ratio + shift
        live = (g2 < G) & (m_ref > float("-inf"))
        m_ref = gl.where(live, m_ref, 0.0)
        return ratio, m_ref, gl.where(live, qz - m_ref, -1.0e30)

    @gluon.jit
    def _store_range(ptr, row, lo, hi, hv, I8: gl.constexpr, MMA: gl.constexpr):
        """Write (min, max) over the warps and rows of ``lo``/``hi`` per column to ``ptr + 2 * row``."""
        HL: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, MMA))
        if I8:
            lo = _cols8(lo, float("inf"), MMA)
            hi = _cols8(hi, float("-inf"), MMA)
        gl.store(ptr + row * 2, gl.convert_layout(gl.min(gl.min(lo, axis=1), axis=0), HL), mask=hv)
        gl.store(ptr + row * 2 + 1, gl.convert_layout(gl.max(gl.max(hi, axis=1), axis=0), HL), mask=hv)

    @gluon.jit
    def _arrive(counter):
        """First half of the barrier of the programs that share ``counter`` (the splits of one sequence and KV head):
        the program's stores so far become visible to the others (block barrier, then a release add by one thread;
        its fence also waits for that thread's loads in flight, so the caller issues prefetches after it)."""
        _block_barrier()
        return gl.atomic_add(counter, 1, sem="release", scope="gpu") + 1

    @gluon.jit
    def _wait(counter, seen, n):
        """Second half: poll until all ``n`` programs have arrived (acquire). Needs the ``n`` programs to run at
        once: ``decode_attention`` launches the fused kernel only as one wave, and programs start in grid order, so
        the splits of the lowest unfinished pair are always resident."""
        while seen < n:
            seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        _block_barrier()

    @gluon.jit
    def _depart(counter, n):
        """Count this program out (after its wait); the last of the ``n`` sets the counter back to 0 for the next
        launch, so the buffer needs no clearing between launches (the counter is at n..2n-1 here: no program still
        waits for it)."""
        old = gl.atomic_add(counter, 1, sem="relaxed", scope="gpu")
        gl.atomic_add(counter, -2 * n, mask=old == 2 * n - 1, sem="relaxed", scope="gpu")

    @gluon.jit
    def _cluster(x, OP: gl.constexpr):
        """``barrier.cluster.arrive.release`` / ``barrier.cluster.wait.acquire`` (sm_90 thread block clusters): every
        thread of every CTA of the cluster arrives; a wait returns once all have, with their earlier writes visible.
        Returns ``x`` (a scalar) so that what must follow can depend on it."""
        return gl.inline_asm_elementwise(f"barrier.cluster.{OP}.aligned; mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _finish(po_ptr, ml_ptr, fo_ptr, lse_ptr, so_b, so_h, b, h, r, HQ, S_total,
                G: gl.constexpr, D: gl.constexpr, CL: gl.constexpr, W: gl.constexpr, FIN: gl.constexpr):
        """CTA ``r`` of a (row, KV head)'s cluster, after every CTA wrote its partial (and the layer's other segments'
        kernels, launched before this one, theirs): merges all ``S_total`` partials of channels [r*D/CL,
        (r+1)*D/CL) as the merge kernel does (log-sum-exp, ``CL`` partials per round) and writes ``fo`` (and, CTA 0
        with ``FIN == 2``, the natural-log ``lse``)."""
        DC: gl.constexpr = D // CL
        FL: gl.constexpr = gl.BlockedLayout([CL, 1, 1], [1, 4, 8], [1, 1, W], [2, 1, 0])
        s3 = gl.expand_dims(gl.expand_dims(gl.arange(0, CL, layout=gl.SliceLayout(1, gl.SliceLayout(2, FL))), 1), 2)
        g3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, FL))), 0), 2)
        c3 = gl.expand_dims(gl.expand_dims(gl.arange(0, DC, layout=gl.SliceLayout(0, gl.SliceLayout(1, FL))), 0), 1)
        OL: gl.constexpr = gl.SliceLayout(0, FL)
        m_run = gl.full([8, 1], -1.0e30, gl.float32, layout=OL)
        l_run = gl.zeros([8, 1], gl.float32, layout=OL)
        acc = gl.zeros([8, DC], gl.float32, layout=OL)
        for s0 in range(0, S_total, CL):
            row = (b * HQ + h * G + g3) * S_total + s0 + s3  # [CL, 8, 1]
            ok = (g3 < G) & (s0 + s3 < S_total)
            ms = gl.load(ml_ptr + row * 2, mask=ok, other=-1.0e30, cache_modifier=".cg")
            ls = gl.load(ml_ptr + row * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
            o = gl.load(po_ptr + row * D + r * DC + c3, mask=ok & (c3 >= 0), other=0.0, cache_modifier=".cg")
            m_new = gl.maximum(m_run, gl.max(ms, axis=0))
            w = gl.exp2(ms - gl.expand_dims(m_new, 0))
            alpha = gl.exp2(m_run - m_new)
            acc = acc * alpha + gl.sum(w * o, axis=0)
            l_run = l_run * alpha + gl.sum(w * ls, axis=0)
            m_run = m_new
        live = l_run > 0
        res = gl.where(live, acc / gl.where(live, l_run, 1.0), 0.0)  # [8, DC]
        g2 = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(1, OL)), 1)
        c2 = gl.expand_dims(gl.arange(0, DC, layout=gl.SliceLayout(0, OL)), 0)
        gl.store(fo_ptr + b * so_b + (h * G + g2) * so_h + r * DC + c2, res.to(fo_ptr.dtype.element_ty),
                 mask=(g2 < G) & (c2 >= 0))
        if FIN == 2:
            lse = gl.where(live, (m_run + gl.log2(gl.where(live, l_run, 1.0))) * 0.6931471805599453, float("-inf"))
            gl.store(lse_ptr + b * HQ + h * G + g2, lse, mask=(g2 < G) & (r == 0))

    @gluon.jit
    def _channel_kernel(
        q_ptr, sq_b, sq_h,
        kc_ptr, vc_ptr, sc_b, sc_h,
        ks_ptr, kz_ptr, sk_b, sk_h,
        vs_ptr, vz_ptr, sv_b, sv_h,
        lens_ptr, T, rows_cap,
        cal_ptr, n_cal, tau1, tau2,
        out_ptr, ml_ptr, HQ, S_total, s_off,
        it_per_prog, qk_scale, sync_ptr, fo_ptr, so_b, so_h, lse_ptr,
        G: gl.constexpr, D: gl.constexpr, BITS: gl.constexpr, W: gl.constexpr,
        SDK: gl.constexpr, SDV: gl.constexpr, CALIB: gl.constexpr, MODE: gl.constexpr, PF: gl.constexpr,
        ST: gl.constexpr, PDL: gl.constexpr, RING: gl.constexpr,
        XL: gl.constexpr, Y0L: gl.constexpr, YL: gl.constexpr, MMA: gl.constexpr, QL: gl.constexpr,
        DA: gl.constexpr, DB: gl.constexpr, I8: gl.constexpr, S4: gl.constexpr, DA8: gl.constexpr,
        DB8: gl.constexpr, ITM: gl.constexpr, SML: gl.constexpr, CL: gl.constexpr, FIN: gl.constexpr,
    ):
        PER: gl.constexpr = 8 // BITS
        FUSED: gl.constexpr = MODE == 2
        NJ: gl.constexpr = 1 if BITS == 8 else 4 // BITS
        PA: gl.constexpr = 1 if FUSED else MODE  # the mode of the (first) pass over K
        RW: gl.constexpr = _rw(BITS)
        ROWS: gl.constexpr = W * RW
        CPQ: gl.constexpr = D // 4
        if PDL and MODE == 1:  # the main pass may start its programs (they wait before reading this pass's output)
            _gdc(T, "launch_dependents")
        sp = gl.program_id(0)
        h = gl.program_id(1)
        b = gl.program_id(2)
        L = gl.minimum(gl.load(lens_ptr + b), T)
        rows_l = (L + PER - 1) // PER
        row0 = sp * it_per_prog * ROWS
        n_it = gl.minimum(it_per_prog, (gl.maximum(rows_l - row0, 0) + ROWS - 1) // ROWS)
        n_full = gl.minimum(n_it, gl.maximum(L // PER - row0, 0) // ROWS)

        # the first codes are in flight while the constants are prepared
        xrow, xcol = _rows_cols(XL, W, RW, D // 4)
        yrow, ycol = _rows_cols(Y0L, W, RW, D // 4)
        kbase = kc_ptr + b * sc_b + h * sc_h
        vbase = vc_ptr + b * sc_b + h * sc_h
        codes = (kbase, vbase, row0, xrow, xcol, yrow, ycol, rows_cap, n_it)
        if ST > 0:
            smk = gl.allocate_shared_memory(gl.int32, [ST, W, RW, D // 4], RING)
            if MODE == 0:
                smv = gl.allocate_shared_memory(gl.int32, [ST, W, RW, D // 4], RING)
            else:
                smv = smk
            for i in gl.static_range(ST - 1):
                _issue(smk, smv, i, codes, MODE, D, ST)
            xk = gl.zeros([W, RW, D // 4], gl.int32, layout=XL)
            xv = gl.zeros([W, RW, D // 4], gl.int32, layout=Y0L)
        else:
            smk = 0
            smv = 0
            # fused programs of up to 4 warps request their first codes inside a branch, before the prologue (ptxas
            # would sink them below it): B=64 n=8192 80.6 -> 79.7 us. Larger programs were faster with the loads after
            # the prologue (B=16 n=8192, 16 warps: 21.6 vs 22.2 us; B=8, 8 warps: 15.7 vs 15.9), and so were the
            # two-pass kernels (B=16 n=32768: 91.6 vs 93.8 us, B=1 n=32768: 18.5 vs 19.5 in the table).
            if FUSED and W <= 4:
                if n_it > 0:
                    xk, xv = _load(kbase, vbase, row0, xrow, xcol, yrow, ycol, rows_cap, PA, D, Y0L)
                else:
                    xk = gl.zeros([W, RW, D // 4], gl.int32, layout=XL)
                    xv = gl.zeros([W, RW, D // 4], gl.int32, layout=Y0L)
            else:
                xk, xv = _load(kbase, vbase, row0, xrow, xcol, yrow, ycol, rows_cap, PA, D, Y0L)

        # the epilogue sums the warps' accumulators in RL (each lane holds all warps' values of its elements and
        # D/32 consecutive channels of 8/W columns: register-local sums, 16-byte stores); V scale/zero are loaded now
        if W <= 8:
            RL: gl.constexpr = gl.BlockedLayout([W, D // 32, 8 // W], [1, 32, 1], [1, 1, W], [1, 2, 0])
        else:  # 16 warps: eight hold the columns, the rest split the channels
            RL: gl.constexpr = gl.BlockedLayout([W, D * 8 // (32 * W), 1], [1, 32, 1], [1, W // 8, 8], [1, 2, 0])
        CHL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(0, RL))
        if MODE != 1:
            ch = gl.arange(0, D, layout=CHL)
            vsc = gl.load(vs_ptr + b * sv_b + h * sv_h + ch * SDV).to(gl.float32)
            vzc = gl.load(vz_ptr + b * sv_b + h * sv_h + ch * SDV).to(gl.float32)

        # ---- q*s as the K-side B operand [W, D (k), 8 (column)]; phi: the physical channel of logical k ----------
        # (int8 path: column n holds head n // 2, its high byte at even n and its low byte at odd n)
        qw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, QL)))
        qk_ = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, QL)))
        qn = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, QL)))
        if I8:
            phi = CPQ * ((qk_ // 4) % 4) + 8 * (qk_ // 32) + 4 * ((qk_ // 16) % 2) + qk_ % 4
            qh = qn // 2
        else:
            phi = CPQ * ((qk_ // 2) % 4) + 4 * (qk_ // 16) + 2 * (qk_ % 2) + (qk_ // 8) % 2
            qh = qn
        k3 = gl.expand_dims(gl.expand_dims(phi, 0), 2)
        n3 = gl.expand_dims(gl.expand_dims(qh, 0), 1)
        w3 = gl.expand_dims(gl.expand_dims(qw, 1), 2)
        qmask = (n3 < G) & (k3 >= 0) & (w3 >= 0)
        qv = gl.load(q_ptr + b * sq_b + (h * G + n3) * sq_h + k3 + w3 * 0, mask=qmask, other=0.0).to(gl.float32)
        ksv = gl.load(ks_ptr + b * sk_b + h * sk_h + k3 * SDK).to(gl.float32)
        kzv = gl.load(kz_ptr + b * sk_b + h * sk_h + k3 * SDK).to(gl.float32)
        qz = gl.sum(qv * kzv, axis=1) * qk_scale  # [W, 8]
        qsf = qv * ksv * qk_scale
        qw2 = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(1, QL)))
        g2 = gl.expand_dims(qh, 0) + gl.expand_dims(qw2, 1) * 0  # [W, 8] head index
        if MODE == 0:
            if PDL:  # launched before the range pass ended: only its min/max are read after this point
                n_cal = _gdc(n_cal, "wait")
            ratio, m_ref, c0 = _reference(cal_ptr, n_cal, b * HQ + h * G, g2, qz, tau1, tau2, G, CALIB, False)
            if CALIB and not I8:  # the int8 path applies ratio to its per-head scale instead
                qsf = qsf * gl.expand_dims(ratio, 1)
        else:
            c0 = qz
        if I8:  # q*s per head as 16-bit fixed point (|q16| <= 127 * 256), split into a high and a low signed byte
            sc = gl.max(gl.abs(qsf), axis=1) / 32512.0  # [W, 8]
            sc = gl.where(sc > 0, sc, 1.0)
            q16 = gl.floor(qsf / gl.expand_dims(sc, 1) + 0.5).to(gl.int32)
            qhi = (q16 + 128) >> 8
            qb = gl.where((gl.expand_dims(gl.expand_dims(qn, 0), 1) % 2) == 0, qhi, q16 - qhi * 256)
            a_q = gl.convert_layout(qb.to(gl.int8), DB8)
            if MODE == 0 and CALIB:
                c0 = (_per_head(sc * ratio, S4), _per_head(c0, S4))
            elif FUSED and CL == 1:  # 16 warps, B=16 n=8192: 21.6 -> 21.1 us; slower in 2-8 warp clusters (+0.1-0.6)
                c0 = _head_consts(q_ptr + b * sq_b + h * G * sq_h, sq_h, ks_ptr + b * sk_b + h * sk_h,
                                  kz_ptr + b * sk_b + h * sk_h, qk_scale, G, D, W, SDK, S4)
            else:
                c0 = (_per_head(sc, S4), _per_head(c0, S4))
            LA: gl.constexpr = S4
            NC: gl.constexpr = 4
        else:
            a_q = gl.convert_layout(qsf.to(gl.float16), DB)
            c0 = gl.expand_dims(gl.convert_layout(c0, gl.SliceLayout(1, MMA)), 1)  # [W, 1, 8]
            LA: gl.constexpr = MMA
            NC: gl.constexpr = 8

        l_acc = gl.zeros([W, 16, NC], gl.float32, layout=LA)
        acc = gl.zeros([W, D, 8], gl.float32, layout=MMA)
        lo = gl.full([W, 16, NC], float("inf"), gl.float32, layout=LA)
        hi = gl.full([W, 16, NC], float("-inf"), gl.float32, layout=LA)
        if PF == 2 and ST == 0:
            xk2, xv2 = _load(kbase, vbase, row0 + ROWS, xrow, xcol, yrow, ycol, rows_cap, PA, D, Y0L)
        else:
            xk2, xv2 = xk, xv
        HL: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, MMA))
        hn = gl.arange(0, 8, layout=HL)  # column; its head and whether it is the head's column:
        if I8:
            hd = hn // 2
            hv = (hn % 2 == 0) & (hd < G)
        else:
            hd = hn
            hv = hn < G
        if FUSED:  # the raw logits of every step stay in shared memory until V is read; one buffer per step j, so
            # that Triton's shared-memory hazard pass puts one block barrier per iteration, not one per store
            sml = ()
            for _ in gl.static_range(NJ):
                sml = sml + (gl.allocate_shared_memory(gl.float32, [ITM, W, 16, NC], SML),)
        else:
            sml = 0
        xk, xv, xk2, xv2, l_acc, acc, lo, hi = _iterations(0, n_full, codes, L, a_q, c0, xk, xv, xk2, xv2, l_acc, acc,
                                                           lo, hi, smk, smv, PA, False, PF, ST, BITS, D, XL, Y0L, YL,
                                                           MMA, DA, DB, I8, S4, DA8, sml, FUSED)
        xk, xv, xk2, xv2, l_acc, acc, lo, hi = _iterations(n_full, n_it, codes, L, a_q, c0, xk, xv, xk2, xv2, l_acc,
                                                           acc, lo, hi, smk, smv, PA, True, PF, ST, BITS, D, XL, Y0L,
                                                           YL, MMA, DA, DB, I8, S4, DA8, sml, FUSED)
        if FUSED:
            # (min, max) of this split, then wait for every split of the (sequence, KV head): the V codes of the first
            # iterations are requested meanwhile
            if CL != 1:  # one program per pair reduces its own range instead (no cal)
                _store_range(cal_ptr, (b * HQ + h * G + hd) * n_cal + sp, lo, hi, hv, I8, MMA)
                if CL > 1:  # the splits of the pair are the CTAs of one cluster: the hardware barrier
                    n_cal = _cluster(n_cal, "arrive.release")
                else:
                    pair = sync_ptr + b * gl.num_programs(1) + h
                    seen = _arrive(pair)
            xk, xv = _load(kbase, vbase, row0, xrow, xcol, yrow, ycol, rows_cap, 0, D, Y0L, True)
            xk2, xv2 = _load(kbase, vbase, row0 + ROWS, xrow, xcol, yrow, ycol, rows_cap, 0, D, Y0L, True)
            if CL == 1:
                c0, m4 = _own_calibrated(lo, hi, c0[0], c0[1], tau1, tau2, G, CALIB)
            else:
                if CL > 1:
                    n_cal = _cluster(n_cal, "wait.acquire")
                else:
                    _wait(pair, seen, n_cal)
                ratio, m_ref, c0 = _reference(cal_ptr, n_cal, b * HQ + h * G, g2, qz, tau1, tau2, G, CALIB, True)
                if CL == 0:
                    _depart(pair, n_cal)
                if CALIB:
                    sc = sc * ratio
                c0 = (_per_head(sc, S4), _per_head(c0, S4))
            xk, xv, xk2, xv2, l_acc, acc, lo, hi = _iterations(0, n_full, codes, L, a_q, c0, xk, xv, xk2, xv2, l_acc,
                                                               acc, lo, hi, smk, smv, 0, False, PF, ST, BITS, D, XL,
                                                               Y0L, YL, MMA, DA, DB, I8, S4, DA8, sml, True)
            xk, xv, xk2, xv2, l_acc, acc, lo, hi = _iterations(n_full, n_it, codes, L, a_q, c0, xk, xv, xk2, xv2,
                                                               l_acc, acc, lo, hi, smk, smv, 0, True, PF, ST, BITS, D,
                                                               XL, Y0L, YL, MMA, DA, DB, I8, S4, DA8, sml, True)

        if PDL and MODE != 1 and FIN == 0:  # the merge may start its programs (they wait for this pass to end)
            _gdc(T, "launch_dependents")
        # ---- epilogue: sum the W warps, write the partial ---------------------------------------------------------
        if MODE == 1:
            _store_range(ml_ptr, (b * HQ + h * G + hd) * S_total + s_off + sp, lo, hi, hv, I8, MMA)
        else:
            row_ml = (b * HQ + h * G + hd) * S_total + s_off + sp
            if I8:
                l_acc = _cols8(l_acc, 0.0, MMA)
            l_h = gl.convert_layout(gl.sum(gl.sum(l_acc, axis=1), axis=0), HL)  # [8]
            # logical m = 16 b + 8 c + a holds physical channel 16 a + 2 b + c (D = 128; ``psi``): reorder to
            # physical channels on the way into RL
            accp = gl.permute(gl.reshape(acc, [W, D // 16, 2, 8, 8]), [0, 3, 1, 2, 4])
            acc_s = gl.sum(gl.convert_layout(gl.reshape(accp, [W, D, 8]), RL), axis=0)  # [D (physical), 8]
            OL: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, RL))
            hn2 = gl.arange(0, 8, layout=OL)
            if I8:
                go = gl.expand_dims(hn2 // 2, 0)
                gv = gl.expand_dims((hn2 % 2 == 0) & (hn2 // 2 < G), 0)
            else:
                go = gl.expand_dims(hn2, 0)
                gv = gl.expand_dims(hn2 < G, 0)
            o = acc_s * gl.expand_dims(vsc * _V_SCALE, 1) + gl.expand_dims(gl.convert_layout(l_h, OL), 0) * \
                gl.expand_dims(vzc, 1)
            c2 = gl.expand_dims(ch, 1)
            if FUSED and CL == 1:  # column n holds head n // 2
                m_h = gl.convert_layout(gl.reshape(gl.join(m4, m4), [8]), HL)
            else:
                m_h = gl.convert_layout(gl.max(m_ref, axis=0), HL)
            if FIN > 0 and CL == 1 and S_total == 1:  # the layer's only partial: it is the output
                l_o = gl.expand_dims(gl.convert_layout(l_h, OL), 0)
                live = l_o > 0
                res = gl.where(live, o / gl.where(live, l_o, 1.0), 0.0)
                gl.store(fo_ptr + b * so_b + (h * G + go) * so_h + c2, res.to(fo_ptr.dtype.element_ty),
                         mask=gv & (c2 >= 0))
                if FIN == 2:
                    lse = gl.where(l_h > 0, (m_h + gl.log2(gl.where(l_h > 0, l_h, 1.0))) * 0.6931471805599453,
                                   float("-inf"))
                    gl.store(lse_ptr + b * HQ + h * G + hd, lse, mask=hv)
            else:
                gl.store(out_ptr + ((b * HQ + h * G + go) * S_total + s_off + sp) * D + c2, o, mask=gv & (c2 >= 0))
                gl.store(ml_ptr + row_ml * 2, gl.where(l_h > 0, m_h, -1.0e30), mask=hv)
                gl.store(ml_ptr + row_ml * 2 + 1, l_h, mask=hv)
                if FIN > 0:  # the layer's last kernel: the cluster merges every partial of its rows into the output
                    r = sp
                    if PDL:  # launched while the layer's previous segment kernel runs: its partials are read next
                        r = _gdc(r, "wait")
                    r = _cluster(_cluster(r, "arrive.release"), "wait.acquire")
                    _finish(out_ptr, ml_ptr, fo_ptr, lse_ptr, so_b, so_h, b, h, r, HQ, S_total, G, D, CL, W, FIN)


_LAYOUTS: dict = {}
_CONSTS: dict = {}
_LAUNCHER: list = []
_RESIDENT: dict = {}  # (device, D, bits, W, stages, mode, int8 K, itm) -> programs per SM, from the compiled kernel


def resident_programs(dev_index: int, D: int, bits: int, W: int, stages: int, mode: int,
                      i8: bool = False, itm: int = 0) -> int | None:
    """Programs of this variant one multiprocessor holds at once (registers, shared memory, warps), known once the
    variant has been compiled on this device; ``None`` before."""
    return _RESIDENT.get((dev_index, D, bits, W, stages, mode, i8, itm))


def programs_by_registers(dev_index: int, D: int, bits: int, W: int, stages: int, mode: int,
                          i8: bool = False) -> int | None:
    """Programs per SM that registers and warp slots allow for this variant (any ``itm``), once one is compiled."""
    return _RESIDENT.get((dev_index, D, bits, W, stages, mode, i8, "regs"))


def fused_shared_bytes(itm: int, W: int, bits: int = 1) -> int:
    """Shared memory the fused kernel keeps logits in: ``itm`` iterations of NJ steps, [W, 16, 4] fp32 each."""
    return itm * (4 // bits) * W * 16 * 4 * 4


def _record_resident(kernel, key, W: int) -> None:
    import torch

    try:
        props = torch.cuda.get_device_properties(key[0])
        regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
        smem_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
        warps_sm = getattr(props, "max_threads_per_multi_processor", 2048) // 32
        regs_warp = -(-kernel.n_regs * 32 // 256) * 256  # allocated per warp in units of 256
        # a warp's registers come from the quarter register file of its SM sub-partition (ncu's "block limit
        # registers": 134 registers give 3 warps per quarter, 6 two-warp programs per SM, not 65536 // 8704 = 7)
        by_regs = (regs_sm // 4 // max(1, regs_warp)) * 4 // W
        by_smem = smem_sm // (kernel.metadata.shared + 1024)  # the driver reserves 1 KB per block
        _RESIDENT[key] = max(1, min(by_regs, by_smem, warps_sm // W, 32))
        _RESIDENT[key[:-1] + ("regs",)] = max(1, min(by_regs, warps_sm // W, 32))
    except Exception:  # an unexpected Triton/torch version: the caller keeps its programs-per-SM heuristic
        _RESIDENT[key] = None


def _launcher():
    if not _LAUNCHER:
        from ._launch import Launcher

        _LAUNCHER.append(Launcher(_channel_kernel))
    return _LAUNCHER[0]


def build_layouts(W: int, D: int, bits: int):
    """(XL, Y0L, YL, MMA, QL, DA, DB) for ``W`` warps, head_dim ``D`` and ``rw`` = 8 byte rows per warp (16 for
    8-bit codes).

    The code layouts are over 4-byte words [W, rw, D/4]:
    XL: K codes: lane (g, t) holds row g (and g+8) and channels [t*D/4, (t+1)*D/4) (16-byte vectors).
    Y0L: V codes, as loaded: lane (g, t) holds rows 2t, 2t+1 (and +8) and channels [g*D/8, (g+1)*D/8).
    YL: Y0L with the row parity as register 0 (so that the two rows of a pair split apart).
    """
    rw = rows_per_warp(bits)
    key = (W, D, rw)
    if key not in _LAYOUTS:
        wb = [[1 << i, 0, 0] for i in range(int(math.log2(W)))]
        cpq, cpr = D // 16, D // 32  # words per lane and row: K, V
        r8 = [[0, 8, 0]] if rw == 16 else []
        kreg = [[0, 0, 1 << i] for i in range(int(math.log2(cpq)))] + r8
        klane = [[0, 0, cpq], [0, 0, 2 * cpq], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
        creg = [[0, 0, 1 << i] for i in range(int(math.log2(cpr)))]
        vlane = [[0, 2, 0], [0, 4, 0], [0, 0, cpr], [0, 0, 2 * cpr], [0, 0, 4 * cpr]]
        XL = gl.DistributedLinearLayout(kreg, klane, wb, [], [W, rw, D // 4])
        Y0L = gl.DistributedLinearLayout(creg + [[0, 1, 0]] + r8, vlane, wb, [], [W, rw, D // 4])
        YL = gl.DistributedLinearLayout([[0, 1, 0]] + creg + r8, vlane, wb, [], [W, rw, D // 4])
        MMA = gl.NVMMADistributedLayout([2, 0], [W, 1, 1], [1, 16, 8])
        QL = gl.BlockedLayout([1, D // 16, 1], [1, 4, 8], [W, 1, 1], [1, 2, 0])
        DA = gl.DotOperandLayout(0, MMA, 2)
        DB = gl.DotOperandLayout(1, MMA, 2)
        _LAYOUTS[key] = (XL, Y0L, YL, MMA, QL, DA, DB)
    return _LAYOUTS[key]


def ring_layout(D: int):
    """Shared layout of a ``[stages, W, rw, D/4]`` word ring: 16-byte chunks XOR-swizzled by the row, so that the
    16-byte loads of the K and V register layouts (``build_layouts``) hit distinct banks within each 8-lane phase.
    (A ``SharedLinearLayout`` would say this directly; Triton 3.6 cannot index a stage of one.)"""
    return gl.SwizzledSharedLayout(4, 1, 8 if D == 128 else 4, [2, 1, 0])


def int8_layouts(W: int):
    """(S4, DA8, DB8) of the int8 K path: S4 holds [W, 16, 4] per-head logits as the int32 accumulator of
    ``mma.m16n8k32`` leaves them once each head's two byte columns are combined (lane (g, t): rows g and g + 8,
    head t); DA8/DB8 are the int8 operand layouts."""
    wb = [[1 << i, 0, 0] for i in range(int(math.log2(W)))]
    S4 = gl.DistributedLinearLayout([[0, 8, 0]], [[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]], wb, [],
                                    [W, 16, 4])
    MMA = build_layouts(W, 64, 1)[3]  # the accumulator layout depends on W only
    return S4, gl.DotOperandLayout(0, MMA, 4), gl.DotOperandLayout(1, MMA, 4)


def kernel_consts(G: int, D: int, bits: int, W: int, sdk: int, sdv: int, calib: bool, mode: int,
                  stages: int = 0, pdl: bool = False, i8: bool = False, itm: int = 0, cl: int = 0,
                  fin: int = 0) -> dict:
    """The constexpr arguments of ``_channel_kernel`` for one variant (cached; ``eval/kernel_sass.py`` compiles
    exactly what ``launch_channel`` launches). ``itm``: iterations per program the fused kernel (``mode=2``) keeps
    logits for in shared memory; ``cl``: its splits of a (row, KV head) are one thread block cluster of ``cl`` CTAs
    (sm_90; 1: one program per pair, no cluster; 0: the atomic-counter barrier); ``fin`` (with ``cl``): the cluster
    also merges the layer's partials into the output (1), and the log-sum-exp (2)."""
    ckey = (G, D, bits, W, sdk, sdv, calib, mode, stages, pdl, i8, itm, cl, fin)
    consts = _CONSTS.get(ckey)
    if consts is None:
        if i8 and (bits != 1 or G > 4):  # wider codes' top planes do not fit a signed byte; N = 8 holds 4 heads
            raise ValueError(f"the int8 K side needs 1-bit codes and G <= 4, got bits={bits}, G={G}")
        if mode == 2 and (not i8 or stages or itm < 1):
            raise ValueError(f"the fused kernel needs the int8 K side, no ring and itm >= 1, got i8={i8}, "
                             f"stages={stages}, itm={itm}")
        if (cl or fin) and (mode != 2 or cl not in (1, 2, 4, 8, 16) or D % cl or fin not in (0, 1, 2)):
            raise ValueError(f"clusters need the fused kernel, 1-16 CTAs (a power of two dividing D), got mode={mode}, "
                             f"cl={cl}, fin={fin}")
        XL, Y0L, YL, MMA, QL, DA, DB = build_layouts(W, D, bits)
        S4, DA8, DB8 = int8_layouts(W)
        consts = _CONSTS[ckey] = dict(G=G, D=D, BITS=bits, W=W, SDK=sdk, SDV=sdv, CALIB=calib, MODE=mode,
                                      PF=1 if mode == 0 else 2, ST=stages, PDL=pdl,
                                      RING=ring_layout(D),
                                      XL=XL, Y0L=Y0L, YL=YL, MMA=MMA, QL=QL, DA=DA, DB=DB,
                                      I8=i8, S4=S4, DA8=DA8, DB8=DB8, ITM=itm,
                                      SML=gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]), CL=cl, FIN=fin)
    return consts


def launch_channel(grid, q, seg_t, lens, T, rows_cap, cal, n_cal, tau1, tau2, out, ml, HQ, S_total, s_off,
                   it_per_prog, qk_scale, *, G, D, bits, W, sdk, sdv, calib, mode, maxnreg=None, stages=0, pdl=False,
                   i8=False, sync=None, itm=0, cl=0, final=None, lse=None, dependent=False):
    """Thin launcher; ``seg_t`` = (kw, vw, ks, kz, vs, vz) already validated by the caller, the codes as int32 views
    (4 code bytes per word, row stride D // 4). ``mode=1`` writes ``(min, max)`` rows into ``ml`` (the ``cal``
    buffer of the main pass). ``mode=2`` (fused) writes them into ``cal`` (``n_cal`` = ``grid[0]``) and needs
    ``sync``: int32 counters, one per (sequence, KV head), zero before the launch (and so after it); or ``cl``
    (``grid[0]``, a cluster per (sequence, KV head)), which needs no ``sync``. ``final`` (with ``cl``): the layer's
    output [B, HQ, D], written by the clusters from their partials (and ``lse`` [B, HQ] if given); then no merge
    is needed. ``dependent`` (with ``final`` and ``pdl``): launch as a programmatic dependent of the previous kernel
    on the stream, which must be the layer's other segment kernel that triggers at its start (``_segment_kernel``
    with ``TRIG``); everything before ``_finish`` then runs beside it. The previous kernel must not be a dependent
    itself: what this kernel reads before its wait (q, ``lens``, codes, scales) was written before that one
    started."""
    kw, vw, ks, kz, vs, vz = seg_t
    fin = 0 if final is None else 2 if lse is not None else 1
    if dependent and not (pdl and mode == 2 and fin):
        raise ValueError("dependent launches need the fused kernel with pdl and final")
    ckey = (G, D, bits, W, sdk, sdv, calib, mode, stages, pdl, i8, itm, cl, fin)
    args = (q, q.stride(0), q.stride(1),
            kw, vw, kw.stride(0), kw.stride(1),
            ks, kz, ks.stride(0), ks.stride(1),
            vs, vz, vs.stride(0), vs.stride(1),
            lens, T, rows_cap,
            cal, n_cal, tau1, tau2,
            out, ml, HQ, S_total, s_off,
            it_per_prog, qk_scale, lens if sync is None else sync,
            out if final is None else final, 0 if final is None else final.stride(0),
            0 if final is None else final.stride(1), ml if lse is None else lse)
    kernel = _launcher()(grid, args, kernel_consts(*ckey), ckey, num_warps=W, num_stages=1,
                         **({"maxnreg": maxnreg} if maxnreg else {}),
                         **({"launch_pdl": True} if pdl and (mode == 0 or dependent) else {}),
                         **({"cluster": cl} if cl else {}))
    rkey = (q.device.index, D, bits, W, stages, mode, i8, itm)
    if rkey not in _RESIDENT and not maxnreg and hasattr(kernel, "n_regs"):
        _record_resident(kernel, rkey, W)
