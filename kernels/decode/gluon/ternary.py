"""Ternary (1.5-bit) values for the Gluon SKVQ kernel (``skvq.py``): the A operand ``V^T [D, 16 tokens]`` built from
bytes that hold five base-3 digits each (``layouts.pack_ternary``), with no table and no storage change.

The V operand gives each lane row ``g`` of the MMA fragment ``D / 8`` channel slots (logical channel ``m = 8 s + g``
for slot ``s``) of tokens ``2t, 2t+1, 2t+8, 2t+9``. A byte's five digits do not divide those slots evenly
(``D / 8`` = 16 or 8), so a lane row takes ``NFULL`` whole bytes (3 at D = 128, 1 at D = 64) and fills the remaining
``4 - NFULL`` slots with single digits of the leftover channels ("specials"); it loads 4 bytes per token either way.

* whole bytes: the MMA is linear in the codes, so a slot need not hold a digit. Slot ``5j + i`` holds the quotient
  ``q_i = x // 3**i`` of byte ``x``, and after the loop digit ``i`` is ``Q_i - 3 Q_{i+1}`` (``Q`` = the slot's
  accumulated column, ``Q_5 = 0``): one register gather of the accumulator, once per program.
  Quotients come as a chain of one ``fma.f16x2`` each: ``t = 1024 + q`` -> ``fma(t, r, K)`` rounds to exactly
  ``1024 + q // 3`` (``r = 0x3553``, ``K = 0x6156``, checked for every q < 256 in ``tests/test_skvq_gluon.py``),
  and ``t & 0x03FF03FF`` is the quotient as an exact fp16 subnormal ``q * 2**-24`` (tensor cores take subnormals
  exactly; the ``2**24`` returns with the recombination). ``q_0 = x`` is the loaded pair itself. Per two tokens and
  byte: one ``lop3``/``or`` for ``t``, four ``fma`` and four ``and`` for ten codes.
* specials: digit ``k`` of byte ``x`` is ``((x * M) & 0xFFFF) * 3 >> 16`` with ``M = ceil(2**16 / 3**(k+1))`` (a
  fixed-point fraction of ``x / 3**(k+1)``, exact for x < 243), also as a subnormal; ``M`` depends on the lane row
  only and is built once per program.

Loads: ``t_index`` gives every byte its own address and mask (any row alignment, any capacity). At D = 128 with a
capacity that is a multiple of 16, ``t_operand_lanes`` reads the same bytes with one inline-asm block per lane and
step: 16 ``ld.global.nc.u8`` at immediate offsets from two addresses (whole bytes, special byte), packed straight
into the two-token words the quotient chain takes, which removes the per-byte integer work (ncu, together with the
whole-wave splits: 128 -> 108 M executed instructions at B16 n32768 with FP8 scales).
"""

from __future__ import annotations

from .operands import HAVE_GLUON

TERN_R, TERN_K = 0x3553, 0x6156  # fp16 0.332763671875 and 683.0: fma(1024 + q, R, K) == 1024 + q // 3 exactly
TERN_M = tuple(-(-(1 << 16) // 3 ** (k + 1)) for k in range(5))  # digit k of x: ((x * M_k) & 0xFFFF) * 3 >> 16


def tern_row(D: int) -> int:
    """Bytes per token of a ternary row (``pack_ternary``)."""
    return -(-D // 5)


def tern_rows_ok(t, D: int) -> bool:
    """Ternary token rows of ``ceil(D / 5)`` bytes, contiguous (any base and row alignment: they are read by byte)."""
    return t is not None and t.dim() == 4 and t.shape[3] == tern_row(D) and t.stride(3) == 1 \
        and t.stride(2) == tern_row(D)


def tern_layouts(W: int) -> dict:
    """VTL: ternary bytes [W, 16 tokens, 8 (lane row g), 4 (byte slot)]: lane (g, t) holds its 4 byte slots of
    tokens 2t, 2t+1, 2t+8, 2t+9 (the V operand's fragment rows, ``t_operand``)."""
    if not HAVE_GLUON:
        return {}
    wb = [[1 << i, 0, 0, 0] for i in range(W.bit_length() - 1)]
    VTL = gl.DistributedLinearLayout([[0, 0, 0, 1], [0, 0, 0, 2], [0, 1, 0, 0], [0, 8, 0, 0]],
                                     [[0, 2, 0, 0], [0, 4, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]], wb, [],
                                     [W, 16, 8, 4])
    PL = gl.DistributedLinearLayout([], [[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
                                    [[1 << i, 0, 0] for i in range(W.bit_length() - 1)], [], [W, 8, 4])
    return dict(VTL=VTL, PL=PL)


if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.constexpr_function
    def _chain_asm():
        r2, k2 = TERN_R | (TERN_R << 16), TERN_K | (TERN_K << 16)
        body = "".join(f"fma.rn.f16x2 t, t, r, k; and.b32 ${i}, t, 0x03FF03FF; " for i in range(4))
        return f"{{ .reg .b32 t, r, k; mov.b32 r, {r2:#x}; mov.b32 k, {k2:#x}; mov.b32 t, $4; {body}}}"

    @gluon.constexpr_function
    def _load_asm():
        """16 byte loads of one lane at immediate offsets from its two addresses ($8: its whole bytes of token 2t,
        $9: its special byte of token 2t): per register pair (tokens 2t, 2t+1 | 2t+8, 2t+9) and byte slot j, the
        word ``byte(even token) | byte(odd token) << 16``. D = 128 rows (26 bytes)."""
        row = -(-128 // 5)
        toks = (0, row, 8 * row, 9 * row)
        body = []
        for hh in range(2):
            for j in range(4):
                base, o, r = ("$8", j, 4 * hh + j) if j < 3 else ("$9", 0, 4 * hh + j)
                body.append(f"ld.global.nc.u8 a{r}, [{base}+{toks[2 * hh] + o}]; "
                            f"ld.global.nc.u8 b{r}, [{base}+{toks[2 * hh + 1] + o}]; mov.b32 ${r}, {{a{r}, b{r}}};")
        regs = ", ".join(f"a{i}, b{i}" for i in range(8))
        return "{ .reg .b16 " + regs + "; " + " ".join(body) + " }"

    @gluon.constexpr_function
    def _mul(k):
        return TERN_M[k]

    @gluon.jit
    def _pair(X):
        """int32 words holding two 16-bit integers -> fp16 [..., 2], the same bits (subnormals ``n * 2**-24``)."""
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [gl.join(X, X)], dtype=gl.float16,
                                         is_pure=True, pack=2)

    @gluon.jit
    def _quotients(X):
        """Two bytes in 16-bit halves -> the five quotients ``x // 3**i`` of both, fp16 subnormal pairs."""
        T = X | 0x64006400
        q1, q2, q3, q4 = gl.inline_asm_elementwise(_chain_asm(), "=r,=r,=r,=r,r,r", [gl.join(T, T)],
                                                   dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                                                   is_pure=True, pack=2)
        return (_pair(X), q1, q2, q3, q4)

    @gluon.jit
    def _unstack4(x):
        """[W, 2, 4, 8, 4] -> its four [W, 2, 4, 8] slices along the last axis, in order."""
        a, b = gl.split(gl.reshape(x, [x.shape[0], 2, 4, 8, 2, 2]))  # low index bit
        a0, a2 = gl.split(a)
        a1, a3 = gl.split(b)
        return a0, a1, a2, a3

    @gluon.jit
    def _tokens(x):
        """[W, 16 tokens, 8 rows, 4 bytes] -> per byte slot, the words of tokens 2t (low) and 2t+1 (high half):
        four int32 [W, 2 (hh), 4 (t), 8 (g)] tensors."""
        W: gl.constexpr = x.shape[0]
        y = gl.permute(gl.reshape(x, [W, 2, 4, 2, 8, 4]), [0, 1, 2, 4, 5, 3])
        x0, x1 = gl.split(y)
        return x0, x1

    @gluon.jit
    def _stack16(ys):
        """A tuple of 8 or 16 equal tensors -> one with 3 or 4 new trailing axes, low index bit first."""
        a = gl.join(gl.join(gl.join(ys[0], ys[1]), gl.join(ys[2], ys[3])),
                    gl.join(gl.join(ys[4], ys[5]), gl.join(ys[6], ys[7])))
        if len(ys) == 16:
            b = gl.join(gl.join(gl.join(ys[8], ys[9]), gl.join(ys[10], ys[11])),
                        gl.join(gl.join(ys[12], ys[13]), gl.join(ys[14], ys[15])))
            a = gl.join(a, b)
        return a

    @gluon.jit
    def _special(y0, y1, M):
        d0 = (((y0 * M) & 0xFFFF) * 3) >> 16
        d1 = (((y1 * M) & 0xFFFF) * 3) >> 16
        return _pair(d0 | (d1 << 16))

    @gluon.jit
    def t_consts(g, j, D: gl.constexpr):
        """Byte offset within the token row and special multiplier ``M`` of lane row ``g``, byte slot ``j``."""
        NF: gl.constexpr = 3 if D == 128 else 1
        c = 40 * NF + (4 - NF) * g + (j - NF)  # the special's stored channel
        k = c % 5
        m = gl.where(k == 0, _mul(0), gl.where(k == 1, _mul(1), gl.where(k == 2, _mul(2),
                                                                        gl.where(k == 3, _mul(3), _mul(4)))))
        return gl.where(j < NF, NF * g + j, c // 5), m

    @gluon.jit
    def t_operand(xv, mconst, D: gl.constexpr, DA: gl.constexpr):
        """Ternary bytes [W, 16 tokens, 8 (g), 4 (byte slot)] (``t_consts`` order) -> A operand ``V^T`` [W, D, 16]
        with logical channel ``m = 8 s + g`` (``t_phys``); quotient slots still need ``t_digits``."""
        W: gl.constexpr = xv.shape[0]
        x0, x1 = _tokens(xv.to(gl.int32))
        a = _unstack4(x0)
        b = _unstack4(x1)
        mm = _unstack4(mconst)
        if D == 128:
            s = (_quotients(a[0] | (b[0] << 16)) + _quotients(a[1] | (b[1] << 16))
                 + _quotients(a[2] | (b[2] << 16)) + (_special(a[3], b[3], mm[3]),))
            r = gl.permute(_stack16(s), [0, 8, 7, 6, 5, 3, 1, 2, 4])  # [W, s bits high first, g, hh, t, a]
        else:
            s = _quotients(a[0] | (b[0] << 16)) + (_special(a[1], b[1], mm[1]), _special(a[2], b[2], mm[2]),
                                                   _special(a[3], b[3], mm[3]))
            r = gl.permute(_stack16(s), [0, 7, 6, 5, 3, 1, 2, 4])
        return gl.convert_layout(gl.reshape(r, [W, D, 16]), DA)

    @gluon.jit
    def t_lanes(PL: gl.constexpr, W: gl.constexpr, TW: gl.constexpr):
        """Per lane (g, t) of each warp ([W, 8, 4] in ``PL``): byte offsets of its whole bytes and of its special byte
        in token 2t's row (from the first warp's first token of a step), the special's multiplier ``M`` (D = 128), and
        the warp's first token from that one (``w * TW``)."""
        w = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, PL))), 1), 2)
        g = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, PL))), 0), 2)
        t = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, PL))), 0), 1)
        row = (w * TW + 2 * t) * 26
        off, m = t_consts(g, 3, 128)
        return row + 3 * g, row + off, m + row * 0, w * TW + row * 0

    @gluon.jit
    def t_operand_lanes(pw, ps, M, DA: gl.constexpr):
        """``t_operand`` for D = 128 with its bytes loaded by ``_load_asm`` from per-lane addresses ``pw``/``ps``
        (int64 [W, 8, 4], ``t_lanes``): no per-byte address, mask or index arithmetic."""
        W: gl.constexpr = pw.shape[0]
        ws = gl.inline_asm_elementwise(_load_asm(), "=r,=r,=r,=r,=r,=r,=r,=r,l,l", [pw, ps],
                                       dtype=(gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32,
                                              gl.int32), is_pure=False, pack=1)
        a0 = gl.permute(gl.join(ws[0], ws[4]), [0, 3, 2, 1])  # [W, 2 (hh), 4 (t), 8 (g)]
        a1 = gl.permute(gl.join(ws[1], ws[5]), [0, 3, 2, 1])
        a2 = gl.permute(gl.join(ws[2], ws[6]), [0, 3, 2, 1])
        a3 = gl.permute(gl.join(ws[3], ws[7]), [0, 3, 2, 1])
        mm = gl.permute(gl.join(M, M), [0, 3, 2, 1])
        s = (_quotients(a0) + _quotients(a1) + _quotients(a2) + (_special(a3 & 0xFF, a3 >> 16, mm),))
        r = gl.permute(_stack16(s), [0, 8, 7, 6, 5, 3, 1, 2, 4])
        return gl.convert_layout(gl.reshape(r, [W, 128, 16]), DA)

    @gluon.jit
    def t_index(VTL: gl.constexpr, W: gl.constexpr, TW: gl.constexpr, D: gl.constexpr):
        """For the byte loads [W, 16 tokens, 8 (g), 4 (byte slot)] in ``VTL``: each element's token (from the warp's
        first token of a step) and byte offset in its token row, and the specials' multipliers in the per-slot
        layout ``t_operand`` splits the loaded bytes into."""
        L3: gl.constexpr = gl.SliceLayout(3, VTL)
        w = gl.expand_dims(gl.expand_dims(gl.expand_dims(
            gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3))), 1), 2), 3)
        tk = gl.expand_dims(gl.expand_dims(gl.expand_dims(
            gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3))), 0), 2), 3)
        g = gl.expand_dims(gl.expand_dims(gl.expand_dims(
            gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3))), 0), 1), 3)
        j = gl.expand_dims(gl.expand_dims(gl.expand_dims(
            gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, VTL)))), 0), 1), 2)
        off, m = t_consts(g, j, D)
        zero = w * 0 + tk * 0
        m0, m1 = _tokens(m + zero)
        return w * TW + tk, off + zero, m0

    @gluon.jit
    def t_phys(m, D: gl.constexpr):
        """Stored channel of logical V channel ``m``."""
        NF: gl.constexpr = 3 if D == 128 else 1
        s = m // 8
        g = m % 8
        return gl.where(s < 5 * NF, 5 * NF * g + s, 40 * NF + (4 - NF) * g + (s - 5 * NF))

    @gluon.jit
    def t_digits(o, D: gl.constexpr):
        """Accumulated quotient columns [D (logical m), NC] -> digit columns: ``Q_i - 3 Q_{i+1}`` (slot m + 8 holds
        ``Q_{i+1}``; one register gather, once per program), times the subnormal codes' ``2**24``."""
        NF: gl.constexpr = 3 if D == 128 else 1
        L: gl.constexpr = o.type.layout
        m = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(1, L)), 1)
        n = gl.expand_dims(gl.arange(0, o.shape[1], layout=gl.SliceLayout(0, L)), 0)
        nxt = gl.gather(o, gl.minimum(m + 8, D - 1) + n * 0, 0)
        s = m // 8
        return gl.where((s < 5 * NF) & (s % 5 < 4), o - 3.0 * nxt, o) * 16777216.0
