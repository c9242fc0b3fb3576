"""C source of the one-row decode attention (``cpu_row.py``), compiled with the other CPU loops (``cpu_native.py``).

Each function attends the G query heads of every KV head over one segment's tokens with an online softmax and
merges its result into the caller's running state (``m`` the max scaled logit, ``l`` the sum of exponentials,
``acc`` the unnormalized output, per query head, channel order) by log-sum-exp; ``fin`` turns the state into the
output (``acc / l``) and the log-sum-exp (``m + log l``) in place. Dots over the head dimension keep 16 partial
sums added as a tree, so the compiler vectorizes them without reassociating a float reduction (no
``-ffast-math``).
"""

SOURCE = r"""
#include <math.h>

#define CHUNK 64  /* tokens whose logits are held at once */

static inline float row_dot(const float *restrict a, const float *restrict b, int64_t d) {
    float s[16] = {0};
    for (int64_t j = 0; j < d; j += 16)
        for (int u = 0; u < 16; u++)
            s[u] += a[j + u] * b[j + u];
    /* a tree, not a chain: without -ffast-math the compiler keeps a written order, and 16 dependent adds cost
       more than the 64 products */
    for (int u = 0; u < 8; u++) s[u] += s[u + 8];
    for (int u = 0; u < 4; u++) s[u] += s[u + 4];
    for (int u = 0; u < 2; u++) s[u] += s[u + 2];
    return s[0] + s[1];
}

#if defined(__F16C__)
#include <immintrin.h>
static inline float half_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float half_float(uint16_t h) {  /* IEEE fp16 bits -> float, subnormals and inf/nan included */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3FFu;
    union { uint32_t u; float f; } x;
    if (e == 31u) x.u = sign | 0x7F800000u | (m << 13);
    else if (e) x.u = sign | ((e + 112u) << 23) | (m << 13);
    else { x.f = (float)m * 5.9604644775390625e-08f; x.u |= sign; }
    return x.f;
}
#endif

/* exp(x) for x <= 0 in plain float arithmetic the compiler vectorizes (libm's expf is a call per element):
   x = n ln2 + r, |r| <= ln2/2 (ln2 split in two for an exact n ln2), exp(r) by its Taylor polynomial to degree 7
   (relative error < 2e-7), 2^n through the exponent bits. Below -87 the result is flushed to 0, far under the
   largest term of the sum it joins. */
static inline float exp_neg(float x) {
    x = x < -87.f ? -87.f : x;
    const float big = 12582912.f;  /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    float n = (x * 1.44269504088896341f + big) - big;
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187e-06f;
    float p = 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { uint32_t u; float f; } e;
    e.u = (uint32_t)((int32_t)n + 127) << 23;
    return x <= -87.f ? 0.f : p * e.f;
}

static inline float scale_at(const void *p, int64_t i, int64_t half) {
    return half ? half_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void axpy(float *restrict a, const float *restrict x, float p, int64_t d) {
    for (int64_t j = 0; j < d; j++) a[j] += p * x[j];
}

/* n codes at bit `sh` of bytes b -> floats code * s + z */
static inline void codes_f(const uint8_t *restrict b, float *restrict o, int sh, uint8_t mask, float s, float z,
                           int64_t n) {
    for (int64_t j = 0; j < n; j++) o[j] = (float)((b[j] >> sh) & mask) * s + z;
}

/* n codes at bit `sh` of bytes b -> floats code * s[j] + z[j] */
static inline void codes_fv(const uint8_t *restrict b, float *restrict o, int sh, uint8_t mask,
                            const float *restrict s, const float *restrict z, int64_t n) {
    for (int64_t j = 0; j < n; j++) o[j] = (float)((b[j] >> sh) & mask) * s[j] + z[j];
}

/* A key block's start (keys channel-wise, post-scaled): its scale and zero into s, z; each of the G query rows qx
   times the scale into qs, its dot with the zero into qz (both scaled by `scale`). */
static inline __attribute__((always_inline)) void key_block(
        const float *restrict qx, const void *ks, const void *kz, int64_t at, int64_t half, int64_t d, int64_t G,
        float scale, float *restrict s, float *restrict z, float *restrict qs, float *restrict qz) {
    for (int64_t j = 0; j < d; j++) { s[j] = scale_at(ks, at + j, half); z[j] = scale_at(kz, at + j, half); }
    for (int64_t g = 0; g < G; g++) {
        const float *qg = qx + g * d;
        for (int64_t j = 0; j < d; j++) qs[g * d + j] = qg[j] * s[j] * scale;
        qz[g] = row_dot(qg, z, d) * scale;
    }
}

/* One token's key logits for the G query rows: its codes (bit `sh` of the bytes cr) against the post-scaled queries,
   written at out[g * stride]. */
static inline __attribute__((always_inline)) void key_logits(
        const uint8_t *cr, int sh, uint8_t mask, float *restrict row, const float *restrict qs,
        const float *restrict qz, int64_t d, int64_t G, float *out, int64_t stride) {
    codes_f(cr, row, sh, mask, 1.f, 0.f, d);
    for (int64_t g = 0; g < G; g++) out[g * stride] = row_dot(qs + g * d, row, d) + qz[g];
}

/* the chunk's logits lg[g][0..n) -> probabilities against the updated max; returns the correction of the old acc */
static inline void softmax_chunk(float *restrict lg, int64_t n, float *m, float *l, float *restrict acc, int64_t d) {
    float mx = *m;
    for (int64_t t = 0; t < n; t++) mx = lg[t] > mx ? lg[t] : mx;
    float corr = expf(*m - mx), sum = 0.f;  /* exp(-inf) = 0 the first time */
    for (int64_t t = 0; t < n; t++) lg[t] = exp_neg(lg[t] - mx);
    for (int64_t t = 0; t < n; t++) sum += lg[t];
    if (corr != 1.f) for (int64_t j = 0; j < d; j++) acc[j] *= corr;
    *l = *l * corr + sum;
    *m = mx;
}

/* the segment's state (sm, sl, sacc; channel order) into the running one (m, l, acc) */
static void merge_state(float *m, float *l, float *acc, const float *sm, const float *sl, const float *sacc,
                        int64_t hq, int64_t d, int64_t init) {
    for (int64_t i = 0; i < hq; i++) {
        if (init) {
            m[i] = sm[i]; l[i] = sl[i];
            for (int64_t j = 0; j < d; j++) acc[i * d + j] = sacc[i * d + j];
            continue;
        }
        float mx = m[i] > sm[i] ? m[i] : sm[i];
        if (mx == -INFINITY) continue;
        float a = expf(m[i] - mx), b = expf(sm[i] - mx);
        for (int64_t j = 0; j < d; j++) acc[i * d + j] = acc[i * d + j] * a + sacc[i * d + j] * b;
        l[i] = l[i] * a + sl[i] * b;
        m[i] = mx;
    }
}

static void finish(float *m, float *l, float *acc, int64_t hq, int64_t d) {
    for (int64_t i = 0; i < hq; i++) {
        float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
        for (int64_t j = 0; j < d; j++) acc[i * d + j] *= inv;
        m[i] = l[i] > 0.f ? m[i] + logf(l[i]) : -INFINITY;
    }
}

/* a += sum_t p[t] rows[t]: the token loop inside, so the accumulator stays in registers (an update per token
   through memory waits on the previous store: a third of the time of the first version) */
static inline void weigh_rows(float *restrict a, const float *restrict p, const float *restrict rows, int64_t c,
                              int64_t d) {
    for (int64_t t = 0; t < c; t++)
        for (int64_t j = 0; j < d; j++) a[j] += p[t] * rows[t * d + j];
}

/* Dense rows (sinks, window, an fp16 store read as fp32), tokens [lo, n). work: at least hq * (2 + d) +
   CHUNK * (G + d) + 3 * d + G * (d + 1) floats (the KIVI function's need; see cpu_row.py) */
static inline __attribute__((always_inline)) void row_dense(
        const float *q, const float *k, const float *v, float *m, float *l, float *acc, float *work,
        int64_t hq, int64_t h, const int64_t d, int64_t lo, int64_t n, int64_t k_h, int64_t v_h, int64_t init,
        int64_t fin, float scale) {
    const int64_t G = hq / h;
    float *sm = work, *sl = sm + hq, *sacc = sl + hq, *lg = sacc + hq * d, *qs = lg + CHUNK * G;
    for (int64_t i = 0; i < hq; i++) { sm[i] = -INFINITY; sl[i] = 0.f; }
    for (int64_t i = 0; i < hq * d; i++) sacc[i] = 0.f;
    for (int64_t x = 0; x < h; x++) {
        const float *kh = k + x * k_h, *vh = v + x * v_h;
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < d; j++) qs[g * d + j] = q[(x * G + g) * d + j] * scale;
        for (int64_t t0 = lo; t0 < n; t0 += CHUNK) {
            const int64_t c = n - t0 < CHUNK ? n - t0 : CHUNK;
            for (int64_t g = 0; g < G; g++) {
                const int64_t qi = x * G + g;
                float *lgg = lg + g * CHUNK;
                for (int64_t t = 0; t < c; t++) lgg[t] = row_dot(qs + g * d, kh + (t0 + t) * d, d);
                softmax_chunk(lgg, c, sm + qi, sl + qi, sacc + qi * d, d);
                weigh_rows(sacc + qi * d, lgg, vh + t0 * d, c, d);
            }
        }
    }
    merge_state(m, l, acc, sm, sl, sacc, hq, d, init);
    if (fin) finish(m, l, acc, hq, d);
}

/* KIVI/XQuant layout (kernels/layouts.py KiviSeg), tokens [lo, n) (lo on a key block's start): keys
   channel-wise, codes packed along tokens (byte [t/per][j] holds token t's code of channel j at bit kbits*(t%per)),
   scale and zero per block of kblock tokens and channel; values token-wise, codes packed along channels (byte j
   holds channels j*per+i, i < per), scale and zero per token and group of `group` channels (group a multiple of
   per). Keys are post-scaled: the block's scale goes into the query once (q*s), its zero into one dot (q.z) a
   block. A chunk's values are dequantized once, in lane order (position i*dv + j holds channel j*per + i), and
   shared by the G heads; the lane-ordered output goes back to channel order when the segment merges. half: bit 0
   keys' scale/zero are fp16, bit 1 the values' (else fp32). */
static inline __attribute__((always_inline)) void row_kivi(
        const float *q, const uint8_t *kc, const void *ks, const void *kz, const uint8_t *vc,
        const void *vs, const void *vz, float *m, float *l, float *acc, float *work,
        int64_t hq, int64_t h, const int64_t d, int64_t lo, int64_t n, int64_t kbits, int64_t kblock,
        const int64_t vbits,
        int64_t group, int64_t kc_h, int64_t ks_h, int64_t vc_h, int64_t vs_h, int64_t half,
        int64_t init, int64_t fin, float scale) {
    const int64_t G = hq / h, kper = 8 / kbits, vper = 8 / vbits, dv = d / vper, gb = group / vper;
    const int64_t ng = d / group, kh = half & 1, vh = (half >> 1) & 1;
    const uint8_t kmask = (uint8_t)((1u << kbits) - 1u), vmask = (uint8_t)((1u << vbits) - 1u);
    float *sm = work, *sl = sm + hq, *sacc = sl + hq, *lg = sacc + hq * d, *qs = lg + CHUNK * G;
    float *qz = qs + G * d, *row = qz + G, *s = row + d, *z = s + d, *vbuf = z + d;
    for (int64_t i = 0; i < hq; i++) { sm[i] = -INFINITY; sl[i] = 0.f; }
    for (int64_t i = 0; i < hq * d; i++) sacc[i] = 0.f;
    const int64_t chunk = kblock < CHUNK ? kblock : CHUNK;  /* a chunk never spans two key blocks */
    for (int64_t x = 0; x < h; x++) {
        const uint8_t *kcx = kc + x * kc_h, *vcx = vc + x * vc_h;
        for (int64_t t0 = lo; t0 < n; t0 += chunk) {
            const int64_t c = n - t0 < chunk ? n - t0 : chunk;
            if (t0 % kblock == 0)
                key_block(q + x * G * d, ks, kz, x * ks_h + (t0 / kblock) * d, kh, d, G, scale, s, z, qs, qz);
            for (int64_t t = 0; t < c; t++) {
                const int64_t tt = t0 + t;
                key_logits(kcx + (tt / kper) * d, (int)(kbits * (tt % kper)), kmask, row, qs, qz, d, G, lg + t, CHUNK);
            }
            for (int64_t t = 0; t < c; t++) {
                const int64_t tt = t0 + t, at = x * vs_h + tt * ng;
                const uint8_t *cr = vcx + tt * dv;
                float *o = vbuf + t * d;
                for (int64_t gi = 0; gi < ng; gi++) {  /* each byte's scale and zero, so a code position is one run */
                    const float sv = scale_at(vs, at + gi, vh), zv = scale_at(vz, at + gi, vh);
                    for (int64_t j = gi * gb; j < (gi + 1) * gb; j++) { s[j] = sv; z[j] = zv; }
                }
                for (int64_t i = 0; i < vper; i++) codes_fv(cr, o + i * dv, (int)(vbits * i), vmask, s, z, dv);
            }
            for (int64_t g = 0; g < G; g++) {
                const int64_t qi = x * G + g;
                softmax_chunk(lg + g * CHUNK, c, sm + qi, sl + qi, sacc + qi * d, d);
                weigh_rows(sacc + qi * d, lg + g * CHUNK, vbuf, c, d);
            }
        }
    }
    for (int64_t i = 0; i < hq; i++) {  /* lane order -> channel order */
        float *a = sacc + i * d;
        for (int64_t j = 0; j < d; j++) row[j] = a[j];
        for (int64_t ii = 0; ii < vper; ii++)
            for (int64_t j = 0; j < dv; j++) a[j * vper + ii] = row[ii * dv + j];
    }
    merge_state(m, l, acc, sm, sl, sacc, hq, d, init);
    if (fin) finish(m, l, acc, hq, d);
}

/* head_dim (and the value bits: a code position's run of bytes) compile-time constants in the common cases: the
   loops over them unroll and need no remainder (a run of 16 bytes left to the scalar remainder took a third of the
   time) */
void mmkv_row_dense(const float *q, const float *k, const float *v, float *m, float *l, float *acc, float *work,
                    int64_t hq, int64_t h, int64_t d, int64_t lo, int64_t n, int64_t k_h, int64_t v_h, int64_t init,
                    int64_t fin, float scale) {
#define DENSE_D(D) if (d == D) { \
        row_dense(q, k, v, m, l, acc, work, hq, h, D, lo, n, k_h, v_h, init, fin, scale); return; }
    DENSE_D(64) DENSE_D(128)
#undef DENSE_D
    row_dense(q, k, v, m, l, acc, work, hq, h, d, lo, n, k_h, v_h, init, fin, scale);
}

void mmkv_row_kivi(const float *q, const uint8_t *kc, const void *ks, const void *kz, const uint8_t *vc,
                   const void *vs, const void *vz, float *m, float *l, float *acc, float *work,
                   int64_t hq, int64_t h, int64_t d, int64_t lo, int64_t n, int64_t kbits, int64_t kblock,
                   int64_t vbits,
                   int64_t group, int64_t kc_h, int64_t ks_h, int64_t vc_h, int64_t vs_h, int64_t half,
                   int64_t init, int64_t fin, float scale) {
#define KIVI_D(D, VB) if (d == D && vbits == VB) { row_kivi(q, kc, ks, kz, vc, vs, vz, m, l, acc, work, hq, h, D, \
        lo, n, kbits, kblock, VB, group, kc_h, ks_h, vc_h, vs_h, half, init, fin, scale); return; }
    KIVI_D(64, 1) KIVI_D(64, 2) KIVI_D(64, 4) KIVI_D(128, 1) KIVI_D(128, 2) KIVI_D(128, 4)
#undef KIVI_D
    row_kivi(q, kc, ks, kz, vc, vs, vz, m, l, acc, work, hq, h, d, lo, n, kbits, kblock, vbits, group, kc_h, ks_h,
             vc_h, vs_h, half, init, fin, scale);
}

/* a second thread's state (m2, l2, acc2) into the first's */
void mmkv_row_merge(float *m, float *l, float *acc, const float *m2, const float *l2, const float *acc2, int64_t hq,
                    int64_t d, int64_t fin) {
    merge_state(m, l, acc, m2, l2, acc2, hq, d, 0);
    if (fin) finish(m, l, acc, hq, d);
}

/* SKVQ (kernels/layouts.py SkvqSeg), tokens [lo, n): a chunk's token rows are dequantized by the block path's
   loop (mmkv_dq_skvq, cpu_planes_c.py) into position order, keys and values each, into the work buffer; the
   query arrives gathered into the keys' position order per head (cpu_row.py), and each head's output is put back
   in natural channel order through vnat [H, D] (the natural channel of each value position). Scales and zeros
   fp32 [.., tokens, groups] from token 0; masks as mmkv_dq_skvq takes them, per head. */
void mmkv_row_skvq(const float *qp, const uint8_t *kl, const uint8_t *kh, const float *ks, const float *kz,
                   const float *km, const uint8_t *vl, const uint8_t *vh, const float *vs, const float *vz,
                   const float *vm, const int64_t *vnat, float *m, float *l, float *acc, float *work,
                   int64_t hq, int64_t h, int64_t d, int64_t lo, int64_t n, int64_t kkind, int64_t vkind,
                   int64_t kng, int64_t vng, int64_t kl_h, int64_t kl_row, int64_t kh_h, int64_t kh_row,
                   int64_t ks_h, int64_t ks_row, int64_t vl_h, int64_t vl_row, int64_t vh_h, int64_t vh_row,
                   int64_t vs_h, int64_t vs_row, int64_t init, int64_t fin, float scale) {
    const int64_t G = hq / h;
    float *sm = work, *sl = sm + hq, *sacc = sl + hq, *lg = sacc + hq * d, *kbuf = lg + CHUNK * G;
    float *vbuf = kbuf + CHUNK * d, *row = vbuf + CHUNK * d;
    for (int64_t i = 0; i < hq; i++) { sm[i] = -INFINITY; sl[i] = 0.f; }
    for (int64_t i = 0; i < hq * d; i++) sacc[i] = 0.f;
    for (int64_t x = 0; x < h; x++) {
        for (int64_t t0 = lo; t0 < n; t0 += CHUNK) {
            const int64_t c = n - t0 < CHUNK ? n - t0 : CHUNK, sk = t0 * ks_row, sv = t0 * vs_row;
            const uint8_t *k0 = kl + x * kl_h + t0 * kl_row, *v0 = vl + x * vl_h + t0 * vl_row;
            mmkv_dq_skvq(k0, kh ? kh + x * kh_h + t0 * kh_row : k0, ks + x * ks_h + sk, kz + x * ks_h + sk,
                         km + x * kng * d, kbuf, 1, 1, c, d, kkind, kng, 0, kl_row, 0, kh_row, 0, ks_row, 0);
            mmkv_dq_skvq(v0, vh ? vh + x * vh_h + t0 * vh_row : v0, vs + x * vs_h + sv, vz + x * vs_h + sv,
                         vm + x * vng * d, vbuf, 1, 1, c, d, vkind, vng, 0, vl_row, 0, vh_row, 0, vs_row, 0);
            for (int64_t g = 0; g < G; g++) {
                const int64_t qi = x * G + g;
                float *lgg = lg + g * CHUNK;
                for (int64_t t = 0; t < c; t++) lgg[t] = row_dot(qp + qi * d, kbuf + t * d, d) * scale;
                softmax_chunk(lgg, c, sm + qi, sl + qi, sacc + qi * d, d);
                weigh_rows(sacc + qi * d, lgg, vbuf, c, d);
            }
        }
        for (int64_t g = 0; g < G; g++) {  /* value positions -> natural channels */
            float *a = sacc + (x * G + g) * d;
            for (int64_t p = 0; p < d; p++) row[vnat[x * d + p]] = a[p];
            for (int64_t p = 0; p < d; p++) a[p] = row[p];
        }
    }
    merge_state(m, l, acc, sm, sl, sacc, hq, d, init);
    if (fin) finish(m, l, acc, hq, d);
}

/* CalibQuant's channel-wise layout (kernels/layouts.py ChannelSeg): keys and values channel-wise, codes packed along
   tokens as KIVI's keys, scale and zero per block of `block` tokens and channel. With `calib` a query's logits over
   the whole segment are mapped [gamma, delta] -> [gamma - tau1, ...] first (reference.calibrate_logits, slope
   floored at min_ratio), so every logit of the segment is held (lgbuf: G * n floats) before the softmax. Values
   are post-scaled per block: sum_t p_t (c_td s_bd + z_bd) = s_bd sum_t p_t c_td + z_bd sum_t p_t. */
void mmkv_row_channel(const float *q, const uint8_t *kc, const void *ks, const void *kz, const uint8_t *vc,
                      const void *vs, const void *vz, float *m, float *l, float *acc, float *work, float *lgbuf,
                      int64_t hq, int64_t h, int64_t d, int64_t n, int64_t bits, int64_t block, int64_t kc_h,
                      int64_t ks_h, int64_t vc_h, int64_t vs_h, int64_t half, int64_t calib, int64_t init,
                      int64_t fin, float tau1, float tau2, float min_ratio, float scale) {
    const int64_t G = hq / h, per = 8 / bits, hf = half & 1;
    const uint8_t mask = (uint8_t)((1u << bits) - 1u);
    float *sm = work, *sl = sm + hq, *sacc = sl + hq, *qs = sacc + hq * d, *qz = qs + G * d, *row = qz + G;
    float *s = row + d, *z = s + d, *cs = z + d;  /* cs: G rows of sum_t p_t c_td for the current block */
    for (int64_t i = 0; i < hq * d; i++) sacc[i] = 0.f;
    for (int64_t x = 0; x < h; x++) {
        const uint8_t *kcx = kc + x * kc_h, *vcx = vc + x * vc_h;
        for (int64_t t = 0; t < n; t++) {  /* every logit of the segment */
            if (t % block == 0)
                key_block(q + x * G * d, ks, kz, x * ks_h + (t / block) * d, hf, d, G, scale, s, z, qs, qz);
            key_logits(kcx + (t / per) * d, (int)(bits * (t % per)), mask, row, qs, qz, d, G, lgbuf + t, n);
        }
        for (int64_t g = 0; g < G; g++) {
            float *lg = lgbuf + g * n, lo = lg[0], hi = lg[0];
            for (int64_t t = 1; t < n; t++) { lo = lg[t] < lo ? lg[t] : lo; hi = lg[t] > hi ? lg[t] : hi; }
            const float width = hi - lo;
            if (calib && width > 0.f) {  /* as reference.calibrate_logits */
                float ratio = (width + tau1 - tau2) / width;
                ratio = ratio < min_ratio ? min_ratio : ratio;
                const float shift = lo - tau1;
                for (int64_t t = 0; t < n; t++) lg[t] = ratio * (lg[t] - lo) + shift;
                hi = ratio * width + shift;
            }
            float sum = 0.f;
            for (int64_t t = 0; t < n; t++) lg[t] = exp_neg(lg[t] - hi);
            for (int64_t t = 0; t < n; t++) sum += lg[t];
            sm[x * G + g] = hi;
            sl[x * G + g] = sum;
        }
        for (int64_t b0 = 0; b0 < n; b0 += block) {  /* values, one scale block at a time */
            const int64_t b1 = b0 + block < n ? b0 + block : n, at = x * vs_h + (b0 / block) * d;
            for (int64_t i = 0; i < G * d; i++) cs[i] = 0.f;
            float ps[8] = {0};  /* sum_t p_t per head of the block (G <= 8: cpu_row.py checks) */
            for (int64_t t = b0; t < b1; t++) {
                codes_f(vcx + (t / per) * d, row, (int)(bits * (t % per)), mask, 1.f, 0.f, d);
                for (int64_t g = 0; g < G; g++) { axpy(cs + g * d, row, lgbuf[g * n + t], d); ps[g] += lgbuf[g * n + t]; }
            }
            for (int64_t j = 0; j < d; j++) { s[j] = scale_at(vs, at + j, hf); z[j] = scale_at(vz, at + j, hf); }
            for (int64_t g = 0; g < G; g++) {
                float *a = sacc + (x * G + g) * d;
                for (int64_t j = 0; j < d; j++) a[j] += s[j] * cs[g * d + j] + z[j] * ps[g];
            }
        }
    }
    merge_state(m, l, acc, sm, sl, sacc, hq, d, init);
    if (fin) finish(m, l, acc, hq, d);
}
"""
