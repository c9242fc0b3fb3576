"""HIGGS/EDEN rounding on the CPU as one C loop (compiled with the decode loops, ``kernels/decode/cpu_native.py``).

AQUA-KV's default quantizer rounds every pair of rotated values to the nearest point of a 2-D grid of 16-256 points
(``mmkv/methods/aquakv_quant.py``, ``nearest_points``). In torch that is a ``[pairs, points]`` score matrix written
and read back per chunk: at a 2k-token prompt on SmolLM2, 12 M pairs and about a third of AQUA-KV's quantization
time on a 2-core CPU (issue 34). The loop keeps the grid in registers/L1 and takes 64 pairs at a time as four
16-lane vectors, so nothing but the pairs and one byte per pair touches memory.

The torch code stays the reference (and the path for other devices and dtypes); the loop picks the point of the
largest ``2 p.g - |g|^2`` as it does, the first on exact ties. The two compute that score with different rounding,
so a pair within an ulp of two points' bisector may be given the other one, at the same distance to within
rounding: the tests compare chosen distances, not indices. A pair with a NaN gets point 0 (torch's argmax would
name the NaN's column); the quantizer never feeds one (a zero group norm is divided as 1).
"""

from __future__ import annotations

import torch

SOURCE = r"""
#include <math.h>
#include <stdint.h>

/* GCC/clang vector extensions: 16 lanes whatever the target (split into narrower registers where needed). Written
   per lane in plain C the compiler vectorized the loop poorly (8 ns a pair at 16 points, 111 at 256, on Zen 4):
   explicit lanes and four independent blocks of 16 pairs keep the FMA and blend chains busy (2 and 19 ns). */
typedef float mmkv_v16f __attribute__((vector_size(64)));
typedef int32_t mmkv_v16i __attribute__((vector_size(64)));
#define MMKV_NEAREST_BLOCKS 4

void mmkv_nearest2(const float *restrict pairs, const float *restrict grid, uint8_t *restrict out,
                   float *restrict xy, int64_t n, int64_t npts) {
    float gx[256], gy[256], gn[256];
    for (int64_t k = 0; k < npts; k++) {
        gx[k] = 2.0f * grid[2 * k];
        gy[k] = 2.0f * grid[2 * k + 1];
        gn[k] = grid[2 * k] * grid[2 * k] + grid[2 * k + 1] * grid[2 * k + 1];
    }
    const int64_t step = 16 * MMKV_NEAREST_BLOCKS;
    for (int64_t i = 0; i < n; i += step) {
        mmkv_v16f x[MMKV_NEAREST_BLOCKS], y[MMKV_NEAREST_BLOCKS], best[MMKV_NEAREST_BLOCKS];
        mmkv_v16i idx[MMKV_NEAREST_BLOCKS];
        for (int b = 0; b < MMKV_NEAREST_BLOCKS; b++) {
            for (int j = 0; j < 16; j++) {
                const int64_t r = i + 16 * b + j < n ? i + 16 * b + j : i;  /* a short tail repeats pair i */
                x[b][j] = pairs[2 * r];
                y[b][j] = pairs[2 * r + 1];
            }
            best[b] = (mmkv_v16f){} - INFINITY;
            idx[b] = (mmkv_v16i){};
        }
        for (int64_t k = 0; k < npts; k++) {
            const mmkv_v16i kk = (mmkv_v16i){} + (int32_t)k;
            for (int b = 0; b < MMKV_NEAREST_BLOCKS; b++) {
                const mmkv_v16f s = x[b] * gx[k] + y[b] * gy[k] - gn[k];
                const mmkv_v16i better = s > best[b];  /* strict: the first point wins a tie; a NaN keeps 0 */
                best[b] = (mmkv_v16f)(((mmkv_v16i)s & better) | ((mmkv_v16i)best[b] & ~better));
                idx[b] = (kk & better) | (idx[b] & ~better);
            }
        }
        const int64_t m = n - i < step ? n - i : step;
        for (int64_t j = 0; j < m; j++) {
            const int32_t c = idx[j / 16][j % 16];
            out[i + j] = (uint8_t)c;
            if (xy) {  /* the chosen points themselves: the caller's reconstruction, without a gather by index */
                xy[2 * (i + j)] = grid[2 * c];
                xy[2 * (i + j) + 1] = grid[2 * c + 1];
            }
        }
    }
}
"""


def nearest2(lib, pairs: torch.Tensor, grid: torch.Tensor, points: bool = False):
    """Index (uint8) of the ``grid [P, 2]`` point nearest each row of ``pairs [N, 2]`` through ``lib`` (the
    compiled library), or None where the loop does not apply (not fp32 CPU tensors, more than 256 points).
    ``points=True``: ``(index, the chosen points [N, 2])``."""
    if (lib is None or pairs.device.type != "cpu" or grid.device.type != "cpu" or pairs.dtype != torch.float32
            or grid.dtype != torch.float32 or grid.shape[0] > 256 or pairs.dim() != 2 or pairs.shape[1] != 2):
        return None
    pairs, grid = pairs.contiguous(), grid.contiguous()
    out = torch.empty(pairs.shape[0], dtype=torch.uint8)
    xy = torch.empty(pairs.shape[0], 2) if points else None
    lib.mmkv_nearest2(pairs.data_ptr(), grid.data_ptr(), out.data_ptr(), xy.data_ptr() if points else None,
                      pairs.shape[0], grid.shape[0])
    return (out, xy) if points else out
