"""The CPU decode path's dequantization as two C loops, compiled on first use with the machine's C compiler.

In eager PyTorch a block of codes becomes fp32 through five to seven whole-block operations (shifts, masks, a cast,
a multiply, an add), each a pass over memory with its own dispatch; on a 2-core CPU that made a quantized decode step
at 8k tokens 1.5x slower than fp16's (docs/BENCHMARKS.md, issue 34). Each loop here reads a code byte once and
writes its fp32 values once, and the compiler vectorizes the inner loop (``-O3 -march=native``).

Nothing is downloaded and nothing links against torch: the source below is compiled into a shared object under
``cache_dir()/native`` (named by a hash of the source, the compiler and the CPU's flags, so a cache shared between
machines never loads code built for another CPU) and called through ``ctypes`` with raw pointers. Without a
compiler, or with ``MMKV_CPU_NATIVE=0``, :func:`library` returns None and the caller keeps its torch code, which the
tests compare against these loops.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from ..ops.nearest_c import SOURCE as NEAREST_SOURCE
from ..switches import cache_dir, switch
from .cpu_planes_c import SOURCE as PLANES_SOURCE
from .cpu_row_c import SOURCE as ROW_SOURCE

SOURCE = r"""
#include <stdint.h>

/* Codes packed along tokens (keys; channel-wise values): byte [row, j] holds tokens row*per+i, i < per, of
   channel j. Token t of (batch*head) x: code (c[t/per][j] >> bits*(t%per)) & mask, scale and zero of its block. */
static inline __attribute__((always_inline)) void tokens_d(
        const uint8_t *restrict codes, const float *restrict scale, const float *restrict zero, float *restrict out,
        int64_t bh, int64_t n, const int64_t d, int64_t bits, int64_t block,
        int64_t c_bh, int64_t c_row, int64_t s_bh, int64_t s_row, int64_t o_bh) {
    const int64_t per = 8 / bits;
    const uint8_t mask = (uint8_t)((1u << bits) - 1u);
    for (int64_t x = 0; x < bh; x++) {
        for (int64_t t = 0; t < n; t++) {
            const uint8_t *c = codes + x * c_bh + (t / per) * c_row;
            const float *s = scale + x * s_bh + (t / block) * s_row;
            const float *z = zero + x * s_bh + (t / block) * s_row;
            float *o = out + x * o_bh + t * d;
            const int sh = (int)(bits * (t % per));
            for (int64_t j = 0; j < d; j++)
                o[j] = (float)((c[j] >> sh) & mask) * s[j] + z[j];
        }
    }
}

/* head_dim a constant in the common cases, as for the groups below */
void mmkv_dq_tokens(const uint8_t *codes, const float *scale, const float *zero, float *out,
                    int64_t bh, int64_t n, int64_t d, int64_t bits, int64_t block,
                    int64_t c_bh, int64_t c_row, int64_t s_bh, int64_t s_row, int64_t o_bh) {
#define TOKENS(D) if (d == D) { \
        tokens_d(codes, scale, zero, out, bh, n, D, bits, block, c_bh, c_row, s_bh, s_row, o_bh); return; }
    TOKENS(64) TOKENS(128)
#undef TOKENS
    tokens_d(codes, scale, zero, out, bh, n, d, bits, block, c_bh, c_row, s_bh, s_row, o_bh);
}

/* Token-wise groups packed along channels (KIVI values): byte j of a token row holds channels j*per+i. Written in
   lane order, position i*dv + j for channel j*per + i, so every store is contiguous; the caller puts the attention
   output back in channel order. A group is gb = group/per whole bytes. The inner loop runs over one group's bytes
   with its scale and zero in registers; row bytes dv and gb are constants in the common cases so the loops are
   unrolled and vectorized (run-time values measured 3-5x slower). */
static inline __attribute__((always_inline)) void groups_gb(
        const uint8_t *restrict codes, const float *restrict scale, const float *restrict zero, float *restrict out,
        int64_t bh, int64_t n, const int64_t dv, int64_t bits, const int64_t gb,
        int64_t c_bh, int64_t c_row, int64_t s_bh, int64_t s_row, int64_t o_bh) {
    const int64_t per = 8 / bits, ng = dv / gb;
    const uint8_t mask = (uint8_t)((1u << bits) - 1u);
    for (int64_t x = 0; x < bh; x++) {
        for (int64_t t = 0; t < n; t++) {
            const uint8_t *c = codes + x * c_bh + t * c_row;
            const float *s = scale + x * s_bh + t * s_row;
            const float *z = zero + x * s_bh + t * s_row;
            float *o = out + x * o_bh + t * dv * per;
            for (int64_t i = 0; i < per; i++) {
                const int sh = (int)(bits * i);
                float *oi = o + i * dv;
                for (int64_t g = 0; g < ng; g++) {
                    const float sg = s[g], zg = z[g];
                    for (int64_t k = 0; k < gb; k++)
                        oi[g * gb + k] = (float)((c[g * gb + k] >> sh) & mask) * sg + zg;
                }
            }
        }
    }
}

void mmkv_dq_groups(const uint8_t *codes, const float *scale, const float *zero, float *out,
                    int64_t bh, int64_t n, int64_t dv, int64_t bits, int64_t group,
                    int64_t c_bh, int64_t c_row, int64_t s_bh, int64_t s_row, int64_t o_bh) {
    const int64_t gb = group / (8 / bits);
#define GROUPS(DV, GB) if (dv == DV && gb == GB) { \
        groups_gb(codes, scale, zero, out, bh, n, DV, bits, GB, c_bh, c_row, s_bh, s_row, o_bh); return; }
    GROUPS(8, 2) GROUPS(8, 4) GROUPS(8, 8)
    GROUPS(16, 2) GROUPS(16, 4) GROUPS(16, 8) GROUPS(16, 16)
    GROUPS(32, 4) GROUPS(32, 8) GROUPS(32, 16) GROUPS(32, 32)
    GROUPS(64, 8) GROUPS(64, 16) GROUPS(64, 32) GROUPS(64, 64)
    groups_gb(codes, scale, zero, out, bh, n, dv, bits, gb, c_bh, c_row, s_bh, s_row, o_bh);
#undef GROUPS
}
""" + PLANES_SOURCE + ROW_SOURCE + NEAREST_SOURCE

_LOCK = threading.Lock()
_LIB: list = []  # [] not tried yet; [None] unavailable; [lib] loaded


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE, version, _cpu_flags()]).encode()).hexdigest()[:16]
    out = cache_dir() / "native" / f"mmkv_cpu_dequant_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "dequant.c"
        src.write_text(SOURCE)
        so = Path(tmp) / out.name
        subprocess.run([cc, "-O3", "-march=native", "-shared", "-fPIC", "-o", str(so), str(src), "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(so, out)  # atomic: a second process sees the whole file or none
    return out


def library():
    """The compiled loops (a ``ctypes.CDLL``), or None where they cannot be built or are switched off."""
    if switch("MMKV_CPU_NATIVE") == "0":
        return None
    if _LIB:
        return _LIB[0]
    with _LOCK:
        if not _LIB:
            lib = None
            cc = _compiler()
            if cc is not None:
                try:
                    lib = ctypes.CDLL(str(_build(cc)))
                    for fn, ptrs, ints in ((lib.mmkv_dq_tokens, 4, 10), (lib.mmkv_dq_groups, 4, 10),
                                           (lib.mmkv_dq_skvq, 6, 13), (lib.mmkv_aligned_qk, 6, 9),
                                           (lib.mmkv_aligned_pv, 7, 9), (lib.mmkv_aligned_klevels, 3, 6),
                                           (lib.mmkv_aligned_vlevels, 7, 9)):
                        fn.restype = None
                        fn.argtypes = [ctypes.c_void_p] * ptrs + [ctypes.c_int64] * ints
                    for fn, ptrs, ints in ((lib.mmkv_row_dense, 7, 9), (lib.mmkv_row_kivi, 11, 16)):
                        fn.restype = None
                        fn.argtypes = [ctypes.c_void_p] * ptrs + [ctypes.c_int64] * ints + [ctypes.c_float]
                    lib.mmkv_row_skvq.restype = None
                    lib.mmkv_row_skvq.argtypes = [ctypes.c_void_p] * 16 + [ctypes.c_int64] * 23 + [ctypes.c_float]
                    lib.mmkv_row_channel.restype = None
                    lib.mmkv_row_channel.argtypes = ([ctypes.c_void_p] * 12 + [ctypes.c_int64] * 14
                                                     + [ctypes.c_float] * 4)
                    lib.mmkv_row_merge.restype = None
                    lib.mmkv_row_merge.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3
                    lib.mmkv_nearest2.restype = None
                    lib.mmkv_nearest2.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2
                except (OSError, subprocess.SubprocessError) as e:
                    warnings.warn(f"mmkv: the CPU dequantization loops could not be built with {cc} ({e}); the "
                                  "CPU decode path uses torch operations instead (slower)", stacklevel=2)
                    lib = None
            _LIB.append(lib)
    return _LIB[0]


def _check(codes, scale, zero, out, d: int) -> None:
    """The loops walk (batch, head) rows at one stride and token rows densely: anything else would be read wrong."""
    h = codes.shape[1]
    if not (codes.dtype == torch.uint8 and scale.dtype == zero.dtype == out.dtype == torch.float32
            and all(t.stride(-1) == 1 and t.stride(0) == h * t.stride(1) for t in (codes, scale, zero, out))
            and scale.stride() == zero.stride() and out.stride(-2) == d
            and scale.device.type == codes.device.type == out.device.type == "cpu"):
        raise ValueError("cpu_native: codes, scales or output not in the layout the loops read")


def dequant_tokens(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, block: int,
                   n: int, out: torch.Tensor) -> torch.Tensor:
    """Codes packed along tokens, ``codes [B, H, R, D]`` (rows from the first token of the read; the channel axis
    contiguous), ``scale``/``zero [B, H, NB, D]`` fp32 from the first block -> ``out[:, :, :n]`` fp32 (``out``:
    ``[B, H, >= n, D]``, token rows dense). One thread: a second one measured no faster (the loop is bound by
    writing its output)."""
    b, h, _, d = codes.shape
    _check(codes, scale, zero, out, d)
    library().mmkv_dq_tokens(codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), out.data_ptr(), b * h, n, d, bits,
                             block, codes.stride(1), codes.stride(2), scale.stride(1), scale.stride(2), out.stride(1))
    return out[:, :, :n]


def dequant_groups(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int,
                   out: torch.Tensor) -> torch.Tensor:
    """Token-wise groups packed along channels, ``codes [B, H, n, DV]`` (channel axis contiguous), ``scale``/``zero
    [B, H, n, NG]`` fp32 -> ``out [B, H, n, DV * PER]`` fp32 (token rows dense; the (batch, head) stride may be
    larger) in lane order (:func:`lane_order`)."""
    b, h, n, dv = codes.shape
    if group % (8 // bits):
        raise ValueError(f"cpu_native: a group of {group} channels at {bits} bits is not whole bytes")
    _check(codes, scale, zero, out, dv * (8 // bits))
    library().mmkv_dq_groups(codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), out.data_ptr(), b * h, n, dv, bits,
                             group, codes.stride(1), codes.stride(2), scale.stride(1), scale.stride(2), out.stride(1))
    return out


def lane_order(bits: int, d: int) -> torch.Tensor:
    """The channel at each position of :func:`dequant_groups`' output: position ``i * DV + j`` holds code ``i`` of
    byte ``j``, channel ``j * PER + i``."""
    per = 8 // bits
    pos = torch.arange(d, device="cpu")  # a host table, cached by callers: never on torch's default device
    return (pos % (d // per)) * per + pos // (d // per)
