"""The Gluon toolchain probe (``HAVE_GLUON``), sizing rules, constexpr helpers and the conversion of packed bit
planes into MMA operands, shared by the channel kernel's pieces (``kernel.py`` explains the kernel)."""

from __future__ import annotations

try:  # Gluon ships with Triton >= 3.4; the CPU interpreter cannot run it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    HAVE_GLUON = hasattr(gluon, "constexpr_function")
    # the block barrier: Triton 3.6 (the GPU image) names it thread_barrier, 3.9 barrier
    _block_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # cp.async into shared memory: Triton 3.6 (the GPU image) names it async_copy_global_to_shared, 3.9 async_load
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
except Exception:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

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
