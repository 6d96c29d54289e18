/* RMSNorm (and the fused residual add, and the Gemma forms) for bf16/fp16 rows on x86-64 CPUs with
 * AVX2 and F16C but no AVX-512 (AMD before Zen 4, Intel's client parts): the math, roundings and
 * entry points of rms_norm.c, 8 lanes a vector. loader.py builds this file instead of the AVX-512
 * ones on such a CPU (the 2-core AMD EPYC CI machines among them).
 *
 * Per row, as the spec does it (customop.math.layernorm):
 *   h = fp32(x) [+ fp32(residual)]          (the fused add: residual_out = h rounded to the dtype)
 *   inv = 1 / sqrt(sum(h * h) / n + eps)    (squares rounded before the sum: no FMA)
 *   out = round(round(h * inv) * fp32(w))    (Gemma, or an fp32 weight: round(h * inv * wf))
 *
 * Where it differs from the AVX-512 kernel, and why:
 *  - bf16 is always rounded by the integer form (round to nearest even on the fp32 bits: add 0x7fff
 *    plus the kept lowest bit, keep the high half). AVX2 has no fp32 -> bf16 conversion; the integer
 *    form is exact for every value, fp32 subnormals included, so nothing is stored twice.
 *  - A row's last n % 8 lanes go through a zero-padded stack buffer: AVX2 has no masked 16-bit loads
 *    or stores. The fp32 rows (the widened weight, the fused add's h) are padded to 8 instead.
 *  - 32 partial sums instead of 64: the variance may differ from the other kernel's, ATen's and
 *    Inductor's in its last bit, as theirs differ from each other; everything after it is bitwise
 *    the spec.
 *
 * Compile with -mavx2 -mf16c -ffp-contract=off -fopenmp; built and loaded by loader.py. No torch
 * headers: raw pointers, strides in elements. */

#include <math.h>
#include <stdlib.h>

#include "avx2_common.h"

/* y as the weight multiply takes it: rounded to the dtype (exact, in fp32), or not */
INLINE __m256 rounded_y(__m256 y, int dt, int round_y) {
    if (!round_y)
        return y;
    return dt == FP16 ? _mm256_cvtph_ps(_mm256_cvtps_ph(y, RNE)) : bf16_round_in_fp32(y);
}

INLINE __m256 squares(__m256 acc, __m256 h) { return _mm256_add_ps(acc, _mm256_mul_ps(h, h)); }

/* h of the fused add at lane i (8 lanes), stored in the scratch and rounded into r_out */
INLINE __m256 add_store(int dt, const uint16_t *x, const uint16_t *r, uint16_t *r_out, float *h32, int64_t i) {
    __m256 h = _mm256_add_ps(load8(x + i, dt), load8(r + i, dt));
    _mm256_storeu_ps(h32 + i, h);
    store8(r_out + i, pack8(h, dt));
    return h;
}

/* out for 8 lanes from h */
INLINE __m128i out8(__m256 h, __m256 inv, const float *wf, int64_t i, int dt, int round_y) {
    return pack8(_mm256_mul_ps(rounded_y(_mm256_mul_ps(h, inv), dt, round_y), _mm256_loadu_ps(wf + i)), dt);
}

/* One row. r NULL: no residual. wf: the weight in fp32 (Gemma's: 1 + w), padded with zeros to a
 * multiple of 8; h32: as many floats of scratch (fused add). round_y: y rounded to the dtype before
 * the weight multiply (a weight of x's dtype, not Gemma). */
INLINE void normalise_row(int dt, int round_y, const uint16_t *x, const uint16_t *r, const float *wf, uint16_t *out,
                          uint16_t *r_out, float *h32, int64_t n, float eps) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    const int64_t body = n & ~(int64_t)7, left = n - body;
    int64_t i = 0;
    if (r) { /* pass 1: h (kept in fp32 for pass 2), residual_out, the squares */
        for (; i + 16 <= body; i += 16) {
            acc0 = squares(acc0, add_store(dt, x, r, r_out, h32, i));
            acc1 = squares(acc1, add_store(dt, x, r, r_out, h32, i + 8));
        }
        if (i < body)
            acc2 = squares(acc2, add_store(dt, x, r, r_out, h32, i));
        if (left) {
            __m256 h = _mm256_add_ps(load_tail(x + body, left, dt), load_tail(r + body, left, dt));
            _mm256_storeu_ps(h32 + body, h); /* the padding's lanes hold 0 + 0 */
            store_tail(r_out + body, pack8(h, dt), left);
            acc3 = squares(acc3, h);
        }
    } else { /* pass 1: the squares */
        for (; i + 32 <= body; i += 32) {
            acc0 = squares(acc0, load8(x + i, dt));
            acc1 = squares(acc1, load8(x + i + 8, dt));
            acc2 = squares(acc2, load8(x + i + 16, dt));
            acc3 = squares(acc3, load8(x + i + 24, dt));
        }
        for (; i < body; i += 8)
            acc0 = squares(acc0, load8(x + i, dt));
        if (left)
            acc1 = squares(acc1, load_tail(x + body, left, dt));
    }
    float sum = hsum(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
    /* the spec: sum / n (ATen's mean divides), + eps in fp32, rsqrt as 1 / sqrt */
    __m256 inv = _mm256_set1_ps(1.0f / sqrtf(sum / (float)n + eps));
    /* pass 2: out (h from the scratch, or x again: the row is in L1/L2) */
    for (i = 0; i + 16 <= body; i += 16) {
        __m256 ha = r ? _mm256_loadu_ps(h32 + i) : load8(x + i, dt);
        __m256 hb = r ? _mm256_loadu_ps(h32 + i + 8) : load8(x + i + 8, dt);
        store8(out + i, out8(ha, inv, wf, i, dt, round_y));
        store8(out + i + 8, out8(hb, inv, wf, i + 8, dt, round_y));
    }
    if (i < body)
        store8(out + i, out8(r ? _mm256_loadu_ps(h32 + i) : load8(x + i, dt), inv, wf, i, dt, round_y));
    if (left) {
        __m256 h = r ? _mm256_loadu_ps(h32 + body) : load_tail(x + body, left, dt);
        store_tail(out + body, out8(h, inv, wf, body, dt, round_y), left);
    }
}

/* the weight in fp32 (Gemma's: 1 + w), padded with zeros to ROW_FLOATS(n) (rms_norm_rows.h) */
#define ROW_FLOATS(n) (((n) + 7) & ~(int64_t)7)

INLINE float *widened_weight(int dt, const void *w, int w32, int plus_one, int64_t n) {
    const int64_t padded = ROW_FLOATS(n), body = n & ~(int64_t)7;
    float *wf = malloc(padded * sizeof(float));
    if (!wf)
        return 0;
    for (int64_t i = 0; i < padded; i += 8) {
        __m256 v;
        if (w32) {
            float buf[8] = {0};
            memcpy(buf, (const float *)w + i, (i < body ? 8 : n - i) * sizeof(float));
            v = _mm256_loadu_ps(buf);
        } else {
            v = i < body ? load8((const uint16_t *)w + i, dt) : load_tail((const uint16_t *)w + i, n - i, dt);
        }
        /* Gemma's 1 + w, in fp32 as the spec adds it (the padding's lanes multiply zeros only) */
        _mm256_storeu_ps(wf + i, plus_one ? _mm256_add_ps(_mm256_set1_ps(1.0f), v) : v);
    }
    return wf;
}

#define BF16_ENTRY 1 /* the integer rounding needs no CPU feature */
#include "rms_norm_rows.h"
