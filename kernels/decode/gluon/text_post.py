"""The post-scaled value side of the Gluon text kernel (``text.py``, values in tile order): the raw codes as MMA
operands, the tensors split by value group and joined back, every group's scale as a ``p^T`` multiplier and the
zeros as an A operand; and ``_steps``, an iteration's per-token values cut into its MMA steps (both value orders).
All of it register relabelling except the plane mask and the loads; ``text.py``'s docstring gives the operand
mapping, docs/KERNELS.md the layout."""

from __future__ import annotations

from .operands import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.constexpr_function
    def _and_plane(bits, i):  # plane i's bits of both 16-bit halves: an fp16 subnormal c * 2**(bits*i - 24) each
        m = ((1 << bits) - 1) << (bits * i)
        return f"and.b32 $0, $1, {m | (m << 16):#x};"

    @gluon.jit
    def _codes(P2, BITS: gl.constexpr, I: gl.constexpr):
        """Word pairs ``P2`` (as in ``_deq``) -> fp16 [..., 2]: plane I's codes of both tokens, unscaled, as exact
        subnormals ``c * 2**(bits*I - 24)`` (the post-scaled value side; the epilogue undoes the power of two)."""
        return gl.inline_asm_elementwise(_and_plane(BITS, I), "=r,r,r", [P2], dtype=gl.float16, is_pure=True, pack=2)

    @gluon.jit
    def _halves(x, L: gl.constexpr):
        """[W, M, C] -> rows [0, M/2) and [M/2, M): a register relabelling (row bits above 16 are registers)."""
        W: gl.constexpr = x.shape[0]
        M: gl.constexpr = x.shape[1]
        C: gl.constexpr = x.shape[2]
        lo, hi = gl.split(gl.permute(gl.reshape(x, [W, 2, M // 2, C]), [0, 2, 3, 1]))
        return gl.convert_layout(lo, L, assert_trivial=True), gl.convert_layout(hi, L, assert_trivial=True)

    @gluon.jit
    def _unhalves(lo, hi, L: gl.constexpr):
        W: gl.constexpr = lo.shape[0]
        M: gl.constexpr = lo.shape[1]
        C: gl.constexpr = lo.shape[2]
        t = gl.permute(gl.join(lo, hi), [0, 3, 1, 2])
        return gl.convert_layout(gl.reshape(t, [W, 2 * M, C]), L, assert_trivial=True)

    @gluon.jit
    def _groups(x, NG: gl.constexpr, L: gl.constexpr):
        """[W, D, C] -> NG tensors [W, D/NG, C], channel group g = rows [g D/NG, (g+1) D/NG)."""
        if NG == 1:
            out = (x,)
        elif NG == 2:
            out = _halves(x, L)
        elif NG == 4:
            a, b = _halves(x, L)
            out = _halves(a, L) + _halves(b, L)
        else:
            a, b = _halves(x, L)
            a0, a1 = _halves(a, L)
            b0, b1 = _halves(b, L)
            out = _halves(a0, L) + _halves(a1, L) + _halves(b0, L) + _halves(b1, L)
        return out

    @gluon.jit
    def _ungroups(t, NG: gl.constexpr, L: gl.constexpr):
        """Inverse of ``_groups``."""
        if NG == 1:
            out = t[0]
        elif NG == 2:
            out = _unhalves(t[0], t[1], L)
        elif NG == 4:
            out = _unhalves(_unhalves(t[0], t[1], L), _unhalves(t[2], t[3], L), L)
        else:
            out = _unhalves(_unhalves(_unhalves(t[0], t[1], L), _unhalves(t[2], t[3], L), L),
                            _unhalves(_unhalves(t[4], t[5], L), _unhalves(t[6], t[7], L), L), L)
        return out

    @gluon.jit
    def _unstack(x, NG: gl.constexpr, VL: gl.constexpr):
        """[W, TW, 8, NG] (the group axis in the fastest registers) -> NG tensors [W, TW, 8] in ``VL``."""
        W: gl.constexpr = x.shape[0]
        T: gl.constexpr = x.shape[1]
        if NG == 1:
            out = (gl.reshape(x, [W, T, 8]),)
        elif NG == 2:
            out = gl.split(x)
        elif NG == 4:
            l0, l1 = gl.split(gl.reshape(x, [W, T, 8, 2, 2]))  # g = 2 hi + lo
            g0, g2 = gl.split(l0)
            g1, g3 = gl.split(l1)
            out = (g0, g1, g2, g3)
        else:
            c0, c1 = gl.split(gl.reshape(x, [W, T, 8, 2, 2, 2]))  # g = 4 a + 2 b + c
            c0b0, c0b1 = gl.split(c0)
            c1b0, c1b1 = gl.split(c1)
            g0, g4 = gl.split(c0b0)
            g2, g6 = gl.split(c0b1)
            g1, g5 = gl.split(c1b0)
            g3, g7 = gl.split(c1b1)
            out = (g0, g1, g2, g3, g4, g5, g6, g7)
        res = ()
        for g in gl.static_range(NG):
            res = res + (gl.convert_layout(out[g], VL, assert_trivial=True),)
        return res

    @gluon.jit
    def _steps(x, NJ: gl.constexpr):
        """[W, TW, 8] per-token values (token (2 tl + a) PER + 2 j + hh) -> one [W, tl, hh, gl, a] tensor per step j."""
        W: gl.constexpr = x.shape[0]
        t = gl.permute(gl.reshape(x, [W, 4, 2, NJ, 2, 8]), [0, 1, 4, 5, 2, 3])  # [W, tl, hh, gl, a, j]
        if NJ == 2:
            out = gl.split(t)
        else:
            t0, t1 = gl.split(gl.reshape(t, [W, 4, 2, 8, 2, 2, 2]))  # j = 2 j1 + j0: split j0, then j1
            a0, a2 = gl.split(t0)
            a1, a3 = gl.split(t1)
            out = (a0, a1, a2, a3)
        return out

    @gluon.jit
    def _b_tokens(x, DB: gl.constexpr):
        """Per-token values [W, tl, hh, gl, a] of one step (token ``kappa = 8 hh + 2 tl + a`` of the step) -> [W, 16
        (kappa), 8] in the B operand layout, the same in every column: the scale that multiplies p^T."""
        W: gl.constexpr = x.shape[0]
        x0, x1 = gl.split(x)
        t = gl.permute(gl.join(x0, x1), [0, 2, 1, 4, 3])  # [W, hh, tl, a, gl]
        return gl.convert_layout(gl.reshape(t, [W, 16, 8]), DB, assert_trivial=True)

    @gluon.jit
    def _z_operand(x, DA: gl.constexpr):
        """Per-token zeros [W, tl, hh, gl, a] of one step, lane row gl holding group gl -> A operand [W, 16 (row: group
        gl, rows 8-15 zero), 16 (kappa)]: one MMA with p^T gives ``sum_t p_t z_tg`` in row g."""
        W: gl.constexpr = x.shape[0]
        x0, x1 = gl.split(x)  # [W, tl, hh, gl]: tokens a = 0, 1
        zero = gl.full(x0.shape, 0.0, x0.dtype, layout=x0.type.layout)
        t = gl.join(gl.join(x0, zero), gl.join(x1, zero))  # [W, tl, hh, gl, row bit 3, a]: registers (a, row 8, hh)
        t = gl.permute(t, [0, 4, 3, 2, 1, 5])  # [W, row 8, gl, hh, tl, a]
        return gl.convert_layout(gl.reshape(t, [W, 16, 16]), DA, assert_trivial=True)

    @gluon.jit
    def _post_scales(vptr, stok, sng, vtok, vg, t0, T, NG: gl.constexpr, FULL: gl.constexpr = False):
        """The post-scaled value side's per-token constants of one iteration: every group's scale of the lane's tokens
        (``[W, TW, 8, NG]``, NG consecutive fp16 per token: one vector load) and, in lane row gl, group gl's zero.
        ``FULL``: every token is valid (only the lane rows past NG stay masked)."""
        if FULL:
            sv = gl.load(vptr[1] + (t0 + stok) * NG + sng)
            zv = gl.load(vptr[2] + (t0 + vtok) * NG + vg, mask=(vtok >= 0) & (vg < NG), other=0.0)
        else:
            sv = gl.load(vptr[1] + (t0 + stok) * NG + sng, mask=(t0 + stok < T) & (sng >= 0), other=0.0)
            zv = gl.load(vptr[2] + (t0 + vtok) * NG + vg, mask=(t0 + vtok < T) & (vg < NG), other=0.0)
        return sv, zv
