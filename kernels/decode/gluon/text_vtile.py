"""The value side's A operand ``V^T`` of one MMA step of the Gluon text kernel (``text.py``, whose docstring gives
the operand mapping): natural order dequantized in registers (``prmt`` pairs a byte of two tokens, one ``lop3``
per plane puts its codes into an fp16 mantissa, one ``sub`` and one ``fma`` give ``c*s + z``), or the raw codes for
the post-scaled path (``text_post._codes``)."""

from __future__ import annotations

from .operands import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from .operands import _prmt
    from .text_post import _codes

    @gluon.constexpr_function
    def _sel(b):  # prmt selector: byte b of the first word -> byte 0 (and 1), byte b of the second -> byte 2 (and 3)
        return f"prmt.b32 $0, $1, $2, {b | (b << 4) | ((4 + b) << 8) | ((4 + b) << 12):#x};"

    @gluon.constexpr_function
    def _dq(bits, i):
        m = ((1 << bits) - 1) << (bits * i)
        magic = (10 - bits * i + 15) << 10  # fp16 2**(10 - bits*i), ulp 2**-(bits*i): mantissa bit bits*i reads as 1
        m2 = m | (m << 16)
        g2 = magic | (magic << 16)
        return (f"{{ .reg .b32 t, g; mov.b32 g, {g2:#x}; lop3.b32 t, $1, {m2:#x}, g, 0xea; sub.rn.f16x2 t, t, g; "
                f"fma.rn.f16x2 $0, t, $3, $4; }}")

    @gluon.jit
    def _deq(P2, S, Z, BITS: gl.constexpr, I: gl.constexpr):
        """Word pairs ``P2`` (int32 [..., 2], both the same word: byte b of two tokens in bytes 0 and 2) -> fp16
        [..., 2] ``c*s + z`` of plane I for both tokens (``S``, ``Z``: fp16 [..., 2], the two tokens' scale and zero).
        All in ``PL``, whose register 0 is the pair axis: inline asm packs consecutive registers, not a tensor axis."""
        return gl.inline_asm_elementwise(_dq(BITS, I), "=r,r,r,r,r", [P2, S, Z], dtype=gl.float16,
                                         is_pure=True, pack=2)

    @gluon.jit
    def _vq(P, S, Z, BITS: gl.constexpr, I: gl.constexpr, POST: gl.constexpr):
        if POST:
            r = _codes(P, BITS, I)
        else:
            r = _deq(P, S, Z, BITS, I)
        return r

    @gluon.jit
    def _j4(a, b, c, d):
        return gl.join(gl.join(a, b), gl.join(c, d))  # [..., 2 (a/b, c/d), 2 (ab, cd)]

    @gluon.jit
    def _v_tile(x0, x1, S, Z, BITS: gl.constexpr, D: gl.constexpr, DA: gl.constexpr, PL: gl.constexpr,
                POST: gl.constexpr = False):
        """A operand ``V^T [W, D (m), 16 (kappa)]`` of one step from words ``x0``/``x1`` [W, tl, hh, gl] of the
        tokens 8 tl + 2 j + hh (+ 4 for x1) and their scale/zero ``S``/``Z`` [W, tl, hh, gl, 2]. Lane row gl holds
        the D/8 channels ``(D/8) gl + c``: byte ``c // NPL``, plane ``c % NPL`` of its word; logical channel
        ``m = 16 (c // 2) + 8 (c % 2) + gl``. ``POST``: the raw codes (``_codes``), ``S`` and ``Z`` unused."""
        W: gl.constexpr = x0.shape[0]
        NB: gl.constexpr = D * BITS // 64  # bytes per lane row and token
        if not POST:
            S = gl.convert_layout(S, PL, assert_trivial=True)
            Z = gl.convert_layout(Z, PL, assert_trivial=True)
        q = ()
        for b in gl.static_range(NB):
            p1 = _prmt(x0, x1, _sel(b))
            P = gl.convert_layout(gl.join(p1, p1), PL, assert_trivial=True)
            t = _j4(_vq(P, S, Z, BITS, 0, POST), _vq(P, S, Z, BITS, 1, POST), _vq(P, S, Z, BITS, 2, POST),
                    _vq(P, S, Z, BITS, 3, POST))
            if BITS == 1:  # planes 4-7
                t = gl.join(t, _j4(_vq(P, S, Z, BITS, 4, POST), _vq(P, S, Z, BITS, 5, POST),
                                   _vq(P, S, Z, BITS, 6, POST), _vq(P, S, Z, BITS, 7, POST)))
            q = q + (t,)
        if NB == 4:
            t = _j4(q[0], q[1], q[2], q[3])
        elif NB == 2:
            t = gl.join(q[0], q[1])
        else:
            t = q[0]
        # [W, tl, hh, gl, a, bits of c low first] -> [W, bits of c high first, gl, hh, tl, a]
        if D == 128:
            t = gl.permute(t, [0, 8, 7, 6, 5, 3, 2, 1, 4])
        else:
            t = gl.permute(t, [0, 7, 6, 5, 3, 2, 1, 4])
        return gl.convert_layout(gl.reshape(t, [W, D, 16]), DA, assert_trivial=True)
