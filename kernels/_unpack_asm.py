"""PTX for turning packed code bytes into fp16 tensor-core operands without integer->float conversions.

One inline-asm call takes 4 code bytes (``pack=4``: consecutive register elements) and returns, for every code
plane ``i`` of the byte (``per = 8 // bits`` planes), 4 fp16 values ``1 + c_i * 2**(pos_i - 10)``, where
``c_i = (byte >> i * bits) & (2**bits - 1)``: the code is OR-ed into the mantissa of 1.0 (``magic`` =
0x3C003C00, passed in a register so that one ``lop3`` does ``(x & mask) | magic``). The value is exact in fp16;
kernels undo the affine map algebraically (``c = (h - 1) * 2**(10 - pos)``) on the fp32 accumulators, never per
element. Cost per 4 bytes: 2 ``prmt`` (bytes -> low byte of each fp16 half), 2-4 ``shl`` (shared by all planes)
and 2 ``lop3`` per plane, i.e. ~0.6 instructions per 1-bit code.
"""

from __future__ import annotations


def plane_pos(bits: int, i: int) -> tuple[int, int]:
    """(left shift of the spread byte, bit position of the code's LSB inside each fp16 half) for plane ``i``."""
    lowb = i * bits
    if bits == 8:
        return 2, 2
    if lowb < 4:
        return 6, lowb + 6
    return 2, lowb + 2


def make_asm(bits: int) -> tuple[str, str]:
    per = 8 // bits
    nout = 2 * per
    xi, mi = nout, nout + 1
    lines = ["{", ".reg .b32 a, b, a6, a2, b6, b2;",
             f"prmt.b32 a, ${xi}, 0, 0x4140;", f"prmt.b32 b, ${xi}, 0, 0x4342;"]
    for s in sorted({plane_pos(bits, i)[0] for i in range(per)}):
        lines.append(f"shl.b32 a{s}, a, {s}; shl.b32 b{s}, b, {s};")
    for i in range(per):
        s, pos = plane_pos(bits, i)
        mask = (((1 << bits) - 1) << pos) * 0x10001
        lines.append(f"lop3.b32 ${2 * i}, a{s}, {mask:#x}, ${mi}, 0xEA; "
                     f"lop3.b32 ${2 * i + 1}, b{s}, {mask:#x}, ${mi}, 0xEA;")
    lines.append("}")
    # outputs: 2 regs per plane; inputs: the 4 packed bytes, then the int32 magic (4 regs with pack=4)
    return " ".join(lines), ",".join(["=r"] * nout + ["r"] * 5)


MAGIC = 0x3C003C00
