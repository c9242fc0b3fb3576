"""C source of the CPU decode path's loops for SKVQ's code planes and AlignedKV's bit planes, compiled with the
loops of ``cpu_native.py`` into one shared object (that module builds it; ``cpu_planes.py`` calls it).

SKVQ: token-wise groups packed along channels, written in *position order*: position ``p`` of a token row holds
the stored channel ``skvq_positions(bits, D)[p]`` (``cpu_planes.py``), chosen so that for every code position
``i`` of a byte the bytes ``j`` of the row land at consecutive positions: every store is contiguous and gcc
vectorizes the loop, where channel order would interleave stores. The caller folds that order (and the head's
channel permutation) into the query and un-permutes the output once. Scale and zero per position come from
per-head 0/1 group masks (see ``skvq_row``), never from a gather per value.

AlignedKV: the three planes of a block (high byte, two mantissa nibbles, channel-major: one channel's tokens
contiguous) joined into fp16 words, cut to the bits the block's level reads (the rest filled with 100..., as
``layouts.join_planes``) and widened exactly to fp32, one channel row of a block at a time into a local array
that the G query heads of the KV head then use at once: ``q . K`` accumulates each row into the logits, ``p . V``
reduces each row against the probabilities. Nothing of K or V is written to memory.
"""

SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* A token row of SKVQ codes in position order. ``mask`` (``groups > 1``): per head, ``groups`` rows of d floats,
   1.0 where position p is in group k. A token's scale and zero per position are then ``groups`` multiply-adds of
   whole rows (vectorized; a gather per value, or a walk over runs of one group, measured 2-12x slower than one
   group's scalars); with one group they are two scalars. head_dim is a constant in the common cases (unrolled,
   vectorized). */
static inline __attribute__((always_inline)) void skvq_row(
        const uint8_t *restrict lo, const uint8_t *restrict hi, const float *restrict scale,
        const float *restrict zero, const float *restrict mask, float *restrict out, int64_t bh, int64_t nh,
        int64_t n, const int64_t d, const int kind, const int64_t ng,
        int64_t l_bh, int64_t l_row, int64_t h_bh, int64_t h_row, int64_t s_bh, int64_t s_row, int64_t o_bh) {
    float sx[256], zx[256];
    for (int64_t x = 0; x < bh; x++)
        for (int64_t t = 0; t < n; t++) {
            const uint8_t *c = lo + x * l_bh + t * l_row;
            const float *s = scale + x * s_bh + t * s_row, *z = zero + x * s_bh + t * s_row;
            float *o = out + x * o_bh + t * d;
            const float s0 = s[0], z0 = z[0];
            if (ng > 1) {
                const float *m = mask + (x % nh) * ng * d;
                for (int64_t p = 0; p < d; p++) {
                    sx[p] = 0.0f;
                    zx[p] = 0.0f;
                }
                for (int64_t k = 0; k < ng; k++)
                    for (int64_t p = 0; p < d; p++) {
                        sx[p] += s[k] * m[k * d + p];
                        zx[p] += z[k] * m[k * d + p];
                    }
            }
#define SX(p) (ng > 1 ? sx[p] : s0)
#define ZX(p) (ng > 1 ? zx[p] : z0)
            if (kind == 15) {
                /* base-3 digits in fp32: x / 3 is never within 1e-5 of an integer unless it is one, so floor is
                   exact (integer division by 3 on bytes vectorized poorly: 0.8 vs 0.1 ms a block of 8192) */
                const int64_t full = d / 5, c0 = (d + 4) / 5, c1 = (d + 3) / 5, c2 = (d + 2) / 5, c3 = (d + 1) / 5;
                const int64_t p1 = c0, p2 = p1 + c1, p3 = p2 + c2, p4 = p3 + c3;
                for (int64_t j = 0; j < full; j++) {
                    const float v0 = (float)c[j];
                    const float v1 = __builtin_floorf(v0 * (1.0f / 3.0f)), v2 = __builtin_floorf(v1 * (1.0f / 3.0f));
                    const float v3 = __builtin_floorf(v2 * (1.0f / 3.0f)), v4 = __builtin_floorf(v3 * (1.0f / 3.0f));
                    o[j] = (v0 - 3.0f * v1) * SX(j) + ZX(j);
                    o[p1 + j] = (v1 - 3.0f * v2) * SX(p1 + j) + ZX(p1 + j);
                    o[p2 + j] = (v2 - 3.0f * v3) * SX(p2 + j) + ZX(p2 + j);
                    o[p3 + j] = (v3 - 3.0f * v4) * SX(p3 + j) + ZX(p3 + j);
                    o[p4 + j] = v4 * SX(p4 + j) + ZX(p4 + j);
                }
                if (full < c0) {  /* the last byte holds d % 5 channels */
                    const int64_t j = full, pos[4] = {j, p1 + j, p2 + j, p3 + j};
                    int v = c[j];
                    for (int64_t i = 0; i < d % 5; i++, v /= 3)
                        o[pos[i]] = (float)(v % 3) * SX(pos[i]) + ZX(pos[i]);
                }
            } else if (kind == 3) {
                const uint8_t *c1 = hi + x * h_bh + t * h_row;
                for (int i = 0; i < 8; i++)
                    for (int64_t j = 0; j < d / 8; j++) {
                        const int64_t p = i * (d / 8) + j;
                        o[p] = (float)(((c[2 * j + (i >> 2)] >> (2 * (i & 3))) & 3) | (((c1[j] >> i) & 1) << 2))
                               * SX(p) + ZX(p);
                    }
            } else {
                const int per = 8 / kind, msk = (1 << kind) - 1;
                for (int i = 0; i < per; i++)
                    for (int64_t j = 0; j < d / per; j++) {
                        const int64_t p = i * (d / per) + j;
                        o[p] = (float)((c[j] >> (kind * i)) & msk) * SX(p) + ZX(p);
                    }
            }
#undef SX
#undef ZX
        }
}

/* mask: see skvq_row (unused with one group); d at most 256 */
void mmkv_dq_skvq(const uint8_t *lo, const uint8_t *hi, const float *scale, const float *zero, const float *mask,
                  float *out, int64_t bh, int64_t nh, int64_t n, int64_t d, int64_t kind, int64_t ng,
                  int64_t l_bh, int64_t l_row, int64_t h_bh, int64_t h_row, int64_t s_bh, int64_t s_row,
                  int64_t o_bh) {
#define ROW(D, K, ONE) if (d == D && kind == K && (ng == 1) == ONE) { skvq_row(lo, hi, scale, zero, mask, out, bh, nh, \
        n, D, K, ONE ? 1 : ng, l_bh, l_row, h_bh, h_row, s_bh, s_row, o_bh); return; }
#define ROW_D(D, ONE) ROW(D, 1, ONE) ROW(D, 2, ONE) ROW(D, 3, ONE) ROW(D, 4, ONE) ROW(D, 8, ONE) ROW(D, 15, ONE)
    ROW_D(64, 1) ROW_D(64, 0) ROW_D(128, 1) ROW_D(128, 0)
#undef ROW_D
#undef ROW
#define KIND(K) if (kind == K) { skvq_row(lo, hi, scale, zero, mask, out, bh, nh, n, d, K, ng, l_bh, l_row, h_bh, \
        h_row, s_bh, s_row, o_bh); return; }
    KIND(1) KIND(2) KIND(3) KIND(4) KIND(8) KIND(15)
#undef KIND
}

/* fp16 bits -> fp32, exact for normal and subnormal numbers (AlignedKV stores finite values only): the 15 low bits
   shifted into an fp32's exponent and mantissa are the value times 2**-112, one multiply scales it back. */
static inline __attribute__((always_inline)) float half_bits(uint32_t w) {
    uint32_t m = (w & 0x7FFFu) << 13;
    float f;
    memcpy(&f, &m, 4);
    f *= 0x1p112f;
    uint32_t r;
    memcpy(&r, &f, 4);
    r |= (w & 0x8000u) << 16;
    memcpy(&f, &r, 4);
    return f;
}

/* one channel of one block: the fp16 words cut to the level's bits, as fp32, the even tokens first, then the odd
   ones (each nibble byte holds a pair: both halves are then stored contiguously; in token order the interleaved
   stores cost 25% more of a pass). The logits and probabilities of a block are in that order too. */
static inline __attribute__((always_inline)) void aligned_row(
        const uint8_t *restrict h, const uint8_t *restrict m, const uint8_t *restrict l, int lv,
        float *restrict o, const int64_t blk) {
    const uint32_t keep = lv == 8 ? 0xFF00u : (lv == 12 ? 0xFFF0u : 0xFFFFu);
    const uint32_t fill = lv == 8 ? 0x80u : (lv == 12 ? 0x8u : 0u);
    for (int64_t i = 0; i < blk / 2; i++) {
        const uint32_t mm = m[i], ll = l[i];
        const uint32_t w0 = ((uint32_t)h[2 * i] << 8) | ((mm & 15u) << 4) | (ll & 15u);
        const uint32_t w1 = ((uint32_t)h[2 * i + 1] << 8) | ((mm >> 4) << 4) | (ll >> 4);
        o[i] = half_bits((w0 & keep) | fill);
        o[blk / 2 + i] = half_bits((w1 & keep) | fill);
    }
}

/* x[g, b * blk + t] += sum_c q[g, c] * K[b, c, t] for every block, K read at levels[b, c] (x zeroed by the caller):
   each channel row is made once, in registers/L1, and used by the G query heads of its KV head */
static inline __attribute__((always_inline)) void aligned_qk_blk(
        const uint8_t *restrict hi, const uint8_t *restrict mid, const uint8_t *restrict low,
        const uint8_t *restrict levels, const float *restrict q, float *restrict x, int64_t bh, int64_t nb,
        int64_t d, const int64_t blk, int64_t g_n, int64_t p_bh, int64_t n_bh, int64_t l_bh, int64_t t_all) {
    float kk[256];
    for (int64_t r = 0; r < bh; r++)
        for (int64_t b = 0; b < nb; b++)
            for (int64_t c = 0; c < d; c++) {
                const int64_t bc = b * d + c;
                aligned_row(hi + r * p_bh + bc * blk, mid + r * n_bh + bc * (blk / 2), low + r * n_bh + bc * (blk / 2),
                            levels[r * l_bh + bc], kk, blk);
                for (int64_t g = 0; g < g_n; g++) {
                    const float qg = q[(r * g_n + g) * d + c];
                    float *restrict xo = x + (r * g_n + g) * t_all + b * blk;
                    for (int64_t t = 0; t < blk; t++)
                        xo[t] += qg * kk[t];
                }
            }
}

/* out[g, c] += sum_t p[g, t] * V[b, c, t] over every block, V read at levels[b, c]. Each (g, c) sums in 16 lanes
   kept across blocks in ``acc`` (g_n * d * 16 floats, in L1) and reduced once at the end: the sum vectorizes
   without reassociation and without a horizontal reduction per block */
static inline __attribute__((always_inline)) void aligned_pv_blk(
        const uint8_t *restrict hi, const uint8_t *restrict mid, const uint8_t *restrict low,
        const uint8_t *restrict levels, const float *restrict p, float *restrict out, float *restrict acc,
        int64_t bh, int64_t nb, int64_t d, const int64_t blk, int64_t g_n, int64_t p_bh, int64_t n_bh, int64_t l_bh,
        int64_t t_all) {
    float vv[256];
    for (int64_t r = 0; r < bh; r++) {
        memset(acc, 0, sizeof(float) * g_n * d * 16);
        for (int64_t b = 0; b < nb; b++)
            for (int64_t c = 0; c < d; c++) {
                const int64_t bc = b * d + c;
                aligned_row(hi + r * p_bh + bc * blk, mid + r * n_bh + bc * (blk / 2), low + r * n_bh + bc * (blk / 2),
                            levels[r * l_bh + bc], vv, blk);
                for (int64_t g = 0; g < g_n; g++) {
                    const float *restrict pp = p + (r * g_n + g) * t_all + b * blk;
                    float *restrict a = acc + (g * d + c) * 16;
                    for (int64_t t = 0; t < blk; t += 16)
                        for (int k = 0; k < 16; k++)
                            a[k] += pp[t + k] * vv[t + k];
                }
            }
        for (int64_t gc = 0; gc < g_n * d; gc++) {
            float s = 0.0f;
            for (int k = 0; k < 16; k++)
                s += acc[gc * 16 + k];
            out[r * g_n * d + gc] += s;
        }
    }
}

/* floor(log2|x|) of an fp32 from its exponent field (0 gives -127), as reference.exponent_of */
static inline int exp_of(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    return (int)((b >> 23) & 0xFFu) - 127;
}

static inline int level_of_gap(int gap) { return gap < 4 ? 16 : (gap < 8 ? 12 : 8); }

/* AlignedKV's Rule 1 (reference.key_levels, then the widest of the G heads, floored at min_bits):
   q [bh, G, d] fp32, colmax [bh, nb, d] (c_bh between rows) -> levels [bh, nb, d] */
void mmkv_aligned_klevels(const float *q, const uint8_t *colmax, uint8_t *levels, int64_t bh, int64_t nb, int64_t d,
                          int64_t g_n, int64_t c_bh, int64_t min_bits) {
    int eq[16 * 256];
    for (int64_t r = 0; r < bh; r++) {
        for (int64_t i = 0; i < g_n * d; i++)
            eq[i] = exp_of(q[r * g_n * d + i]);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *cm = colmax + r * c_bh + b * d;
            uint8_t *lv = levels + (r * nb + b) * d;
            for (int64_t c = 0; c < d; c++)
                lv[c] = (uint8_t)min_bits;
            for (int64_t g = 0; g < g_n; g++) {
                int top = -1000000;
                for (int64_t c = 0; c < d; c++) {
                    const int add = eq[g * d + c] + (cm[c] > 1 ? cm[c] : 1) - 15 + 1;
                    top = add > top ? add : top;
                }
                for (int64_t c = 0; c < d; c++) {
                    const int l = level_of_gap(top - (eq[g * d + c] + (cm[c] > 1 ? cm[c] : 1) - 15 + 1));
                    lv[c] = l > lv[c] ? (uint8_t)l : lv[c];
                }
            }
        }
    }
}

/* AlignedKV's Rule 2 (reference.output_estimate, value_levels_paper / value_levels, the widest of the G heads,
   floored at min_bits): x [bh, G, nb * blk] log2-unit logits (-inf where invalid; even tokens of a block first,
   as aligned_row), lse2 [bh, G], the V high-byte
   plane [bh, nb, d, blk] (h_bh between rows), v_colmax [bh, nb, d] (c_bh) -> levels [bh, nb, d]. The estimate
   takes each block's top token (the first of equal ones, as torch's max) and its V at 8 bits; ``paper``: sign
   dropped and the authors' binade thresholds, else the conservative rule. est: G * d floats of scratch. */
void mmkv_aligned_vlevels(const float *x, const float *lse2, const uint8_t *vhi, const uint8_t *colmax,
                          uint8_t *levels, float *est, float *logp, int64_t bh, int64_t nb, int64_t d, int64_t blk,
                          int64_t g_n, int64_t h_bh, int64_t c_bh, int64_t paper, int64_t min_bits) {
    const int64_t t_all = nb * blk;
    for (int64_t r = 0; r < bh; r++) {
        for (int64_t i = 0; i < g_n * d; i++)
            est[i] = 0.0f;
        for (int64_t g = 0; g < g_n; g++) {
            const float l2 = lse2[r * g_n + g];
            for (int64_t b = 0; b < nb; b++) {
                const float *xb = x + (r * g_n + g) * t_all + b * blk;
                float top = xb[0];
                int64_t arg = 0;
                for (int64_t i = 1; i < blk; i++) {  /* position i holds token 2i, or 2(i - blk/2) + 1 */
                    const int64_t tok = i < blk / 2 ? 2 * i : 2 * (i - blk / 2) + 1;
                    if (xb[i] > top || (xb[i] == top && tok < arg)) {
                        top = xb[i];
                        arg = tok;
                    }
                }
                float w = __builtin_exp2f(top - l2);
                if (w != w)
                    w = 0.0f;
                float lp = top - l2;
                logp[g * nb + b] = (lp != lp || lp == -__builtin_inff()) ? -1e9f : lp;
                const uint8_t *hb = vhi + r * h_bh + b * d * blk + arg;
                for (int64_t c = 0; c < d; c++) {
                    uint32_t cand = hb[c * blk];
                    if (paper)
                        cand &= 0x7Fu;
                    uint32_t bits = (cand << 8) | 0x80u;
                    est[g * d + c] += w * half_bits(bits);
                }
            }
        }
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *cm = colmax + r * c_bh + b * d;
            uint8_t *lv = levels + (r * nb + b) * d;
            for (int64_t c = 0; c < d; c++) {
                int best = (int)min_bits;
                const int e = (cm[c] > 1 ? cm[c] : 1) - 15;
                for (int64_t g = 0; g < g_n; g++) {
                    const float lp = logp[g * nb + b];
                    int l;
                    if (paper) {
                        const float gap = (float)(exp_of(est[g * d + c]) - 1 - e) - lp;
                        l = gap < 1.0f ? 16 : (gap < 2.0f ? 12 : 8);
                    } else {
                        const int add = (int)__builtin_floorf(lp) + e + 1;
                        l = level_of_gap(exp_of(est[g * d + c]) - add);
                    }
                    best = l > best ? l : best;
                }
                lv[c] = (uint8_t)best;
            }
        }
    }
}

/* planes [bh, nb, d, blk] (nibble planes [bh, nb, d, blk/2], the same (batch, head) stride n_bh), levels
   [bh, nb, d] uint8; q, out [bh, G, d] and x, p [bh, G, t_all] dense fp32; acc: G * d * 16 floats of scratch;
   blk a multiple of 16, at most 256 */
void mmkv_aligned_qk(const uint8_t *hi, const uint8_t *mid, const uint8_t *low, const uint8_t *levels,
                     const float *q, float *x, int64_t bh, int64_t nb, int64_t d, int64_t blk, int64_t g_n,
                     int64_t p_bh, int64_t n_bh, int64_t l_bh, int64_t t_all) {
#define QK(B) if (blk == B) { aligned_qk_blk(hi, mid, low, levels, q, x, bh, nb, d, B, g_n, p_bh, n_bh, l_bh, t_all); \
        return; }
    QK(32) QK(64) QK(128)
#undef QK
    aligned_qk_blk(hi, mid, low, levels, q, x, bh, nb, d, blk, g_n, p_bh, n_bh, l_bh, t_all);
}

void mmkv_aligned_pv(const uint8_t *hi, const uint8_t *mid, const uint8_t *low, const uint8_t *levels,
                     const float *p, float *out, float *acc, int64_t bh, int64_t nb, int64_t d, int64_t blk,
                     int64_t g_n, int64_t p_bh, int64_t n_bh, int64_t l_bh, int64_t t_all) {
#define PV(B) if (blk == B) { \
        aligned_pv_blk(hi, mid, low, levels, p, out, acc, bh, nb, d, B, g_n, p_bh, n_bh, l_bh, t_all); return; }
    PV(32) PV(64) PV(128)
#undef PV
    aligned_pv_blk(hi, mid, low, levels, p, out, acc, bh, nb, d, blk, g_n, p_bh, n_bh, l_bh, t_all);
}
"""
