"""Post-scaling pieces of the Gluon SKVQ kernel (``skvq.py``): scale/zero widening, the ``p * s`` B operand of the
value MMA and the per-head sum of the keys' group columns."""

from __future__ import annotations

from .operands import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def _widen(x, FP8: gl.constexpr):
        """Stored scale/zero -> fp32; FP8 arrives as raw E4M3 bytes (exact widening, as ``skvq._widen``)."""
        if FP8:
            raw = x.to(gl.int16)
            hb = ((raw & 0x7F) << 7) | ((raw & 0x80) << 8)
            r = hb.to(gl.float16, bitcast=True).to(gl.float32) * 256.0
        else:
            r = x.to(gl.float32)
        return r

    @gluon.jit
    def _p_cols(p16, NC: gl.constexpr, DB: gl.constexpr):
        """fp16 [W, 16 (token), NC (column)] in the accumulator layout -> B operand [W, 16 (token), NC]: each 8x8
        block moved by ``movmatrix.trans`` and its indices relabelled (``operands._p_operand`` for NC columns)."""
        W: gl.constexpr = p16.shape[0]
        t = gl.inline_asm_elementwise("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r", [p16],
                                      dtype=gl.float16, is_pure=True, pack=2)
        t = gl.permute(gl.reshape(t, [W, 2, 8, NC // 8, 8]), [0, 1, 4, 3, 2])
        return gl.convert_layout(gl.reshape(t, [W, 16, NC]), DB)

    @gluon.jit
    def _groups_summed(y, NGP: gl.constexpr, GP: gl.constexpr):
        """[W, 16, NC] per (token, column = group * GP + head) -> every column holds its head's sum over groups."""
        W: gl.constexpr = y.shape[0]
        NC: gl.constexpr = y.shape[2]
        if NGP > 1:
            y4 = gl.reshape(y, [W, 16, NGP, GP])
            s = gl.reshape(y4 * 0.0 + gl.expand_dims(gl.sum(y4, axis=2), 2), [W, 16, NC])
            y = gl.convert_layout(s, y.type.layout)
        return y
