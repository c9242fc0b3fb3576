"""C source of the CPU decode path's loops for SKVQ's code planes and AlignedKV's bit planes, compiled with the
loops of ``cpu_native.py`` into one shared object (that module builds it; ``cpu_planes.py`` calls it).

SKVQ: token-wise groups packed along channels, written in *position order*: position ``p`` of a token row holds
the stored channel ``skvq_positions(bits, D)[p]`` (``cpu_planes.py``), chosen so that for every code position
``i`` of a byte the bytes ``j`` of the row land at consecutive positions: every store is contiguous and gcc
vectorizes the loop, where channel order would interleave stores. The caller folds that order (and the head's
channel permutation) into the query and un-permutes the output once. Scale and zero of position ``p`` are those
of group ``gpos[h][p]``; with one group per head (SKVQ's g64/g128 at head_dim 64) a token's pair is a scalar.

AlignedKV: the three planes of a block (high byte, two mantissa nibbles, channel-major: one channel's tokens
contiguous) joined into fp16 words, cut to the bits the block's level reads (the rest filled with 100..., as
``layouts.join_planes``) and widened exactly to fp32, one channel row of a block at a time into a local array
that the G query heads of the KV head then use at once: ``q . K`` accumulates each row into the logits, ``p . V``
reduces each row against the probabilities. Nothing of K or V is written to memory.
"""

SOURCE = r"""
#include <stdint.h>
#include <string.h>

static inline __attribute__((always_inline)) float skvq_s(const float *s, const int32_t *g, int64_t p,
                                                          const int one) {
    return one ? s[0] : s[g[p]];
}

/* kind: 1, 2, 4, 8 (one plane), 3 (2-bit low plane + 1-bit high plane), 15 (ternary, 5 base-3 digits a byte) */
static inline __attribute__((always_inline)) void skvq_d(
        const uint8_t *restrict lo, const uint8_t *restrict hi, const float *restrict scale,
        const float *restrict zero, const int32_t *restrict gpos, float *restrict out,
        int64_t bh, int64_t nh, int64_t n, const int64_t d, const int kind, const int one,
        int64_t l_bh, int64_t l_row, int64_t h_bh, int64_t h_row, int64_t s_bh, int64_t s_row, int64_t o_bh) {
    for (int64_t x = 0; x < bh; x++) {
        const int32_t *g = gpos + (x % nh) * d;
        for (int64_t t = 0; t < n; t++) {
            const uint8_t *c = lo + x * l_bh + t * l_row;
            const float *s = scale + x * s_bh + t * s_row;
            const float *z = zero + x * s_bh + t * s_row;
            float *o = out + x * o_bh + t * d;
            if (kind == 3) {
                const uint8_t *c1 = hi + x * h_bh + t * h_row;
                const int64_t dv = d / 8;
                for (int i = 0; i < 8; i++)
                    for (int64_t j = 0; j < dv; j++) {
                        const int64_t p = i * dv + j;
                        const int code = ((c[2 * j + (i >> 2)] >> (2 * (i & 3))) & 3) | (((c1[j] >> i) & 1) << 2);
                        o[p] = (float)code * skvq_s(s, g, p, one) + skvq_s(z, g, p, one);
                    }
            } else if (kind == 15) {
                int64_t off = 0;
                static const int div[5] = {1, 3, 9, 27, 81};
                for (int i = 0; i < 5; i++) {
                    const int64_t cnt = (d - i + 4) / 5;
                    for (int64_t j = 0; j < cnt; j++) {
                        const int64_t p = off + j;
                        o[p] = (float)((c[j] / div[i]) % 3) * skvq_s(s, g, p, one) + skvq_s(z, g, p, one);
                    }
                    off += cnt;
                }
            } else {
                const int per = 8 / kind;
                const int64_t dv = d / per;
                const int mask = (1 << kind) - 1;
                for (int i = 0; i < per; i++)
                    for (int64_t j = 0; j < dv; j++) {
                        const int64_t p = i * dv + j;
                        o[p] = (float)((c[j] >> (kind * i)) & mask) * skvq_s(s, g, p, one) + skvq_s(z, g, p, one);
                    }
            }
        }
    }
}

void mmkv_dq_skvq(const uint8_t *lo, const uint8_t *hi, const float *scale, const float *zero, const int32_t *gpos,
                  float *out, int64_t bh, int64_t nh, int64_t n, int64_t d, int64_t kind, int64_t ng,
                  int64_t l_bh, int64_t l_row, int64_t h_bh, int64_t h_row, int64_t s_bh, int64_t s_row,
                  int64_t o_bh) {
#define SKVQ(D, K, ONE) if (d == D && kind == K && (ng == 1) == ONE) { \
        skvq_d(lo, hi, scale, zero, gpos, out, bh, nh, n, D, K, ONE, l_bh, l_row, h_bh, h_row, s_bh, s_row, o_bh); \
        return; }
#define SKVQ_KINDS(D, ONE) SKVQ(D, 1, ONE) SKVQ(D, 2, ONE) SKVQ(D, 3, ONE) SKVQ(D, 4, ONE) SKVQ(D, 8, ONE) \
        SKVQ(D, 15, ONE)
    SKVQ_KINDS(64, 1) SKVQ_KINDS(64, 0) SKVQ_KINDS(128, 1) SKVQ_KINDS(128, 0)
#undef SKVQ_KINDS
#undef SKVQ
    skvq_d(lo, hi, scale, zero, gpos, out, bh, nh, n, d, (int)kind, 0, l_bh, l_row, h_bh, h_row, s_bh, s_row, o_bh);
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

/* one channel of one block: the fp16 words cut to the level's bits, as fp32 */
static inline __attribute__((always_inline)) void aligned_row(
        const uint8_t *restrict h, const uint8_t *restrict m, const uint8_t *restrict l, int lv,
        float *restrict o, const int64_t blk) {
    const uint32_t keep = lv == 8 ? 0xFF00u : (lv == 12 ? 0xFFF0u : 0xFFFFu);
    const uint32_t fill = lv == 8 ? 0x80u : (lv == 12 ? 0x8u : 0u);
    for (int64_t i = 0; i < blk / 2; i++) {
        const uint32_t mm = m[i], ll = l[i];
        const uint32_t w0 = ((uint32_t)h[2 * i] << 8) | ((mm & 15u) << 4) | (ll & 15u);
        const uint32_t w1 = ((uint32_t)h[2 * i + 1] << 8) | ((mm >> 4) << 4) | (ll >> 4);
        o[2 * i] = half_bits((w0 & keep) | fill);
        o[2 * i + 1] = half_bits((w1 & keep) | fill);
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
