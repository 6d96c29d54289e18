/* RMSNorm (and the fused residual add) for bf16/fp16 rows on AVX-512 CPUs, rounding exactly as
 * customop.math.layernorm.rms_norm / fused_add_rms_norm and the Gemma forms (gemma_rms_norm /
 * gemma_fused_add_rms_norm: the weight applied as 1 + w in fp32, no rounding before it) do
 * (issue 18).
 *
 * Why a hand-written kernel: the spec rounds the normalised fp32 value to the weight dtype before
 * the weight multiply (HF Llama's y.to(w.dtype) * w), and torch 2.13's at::vec has no hardware
 * fp32 -> bf16 conversion, so Inductor's code rounds with integer emulation (or Veltkamp's split,
 * backends/cpu/exact_rounding.py) and ran at 0.74-0.90x of a plain torch.compile at 2048 rows.
 *
 * Per row, as the spec does it:
 *   h = fp32(x) [+ fp32(residual)]          (the fused add: residual_out = h rounded to the dtype)
 *   inv = 1 / sqrt(sum(h * h) / n + eps)    (squares rounded before the sum: no FMA)
 *   out = round(round(h * inv) * fp32(w))    (Gemma, or an fp32 weight: round(h * inv * wf),
 *                                             wf = 1 + w or w in fp32)
 * The product of two bf16 (or fp16) values is exact in fp32, so the last rounding is the one the
 * spec's multiply in the weight dtype makes. The sum runs in another order than ATen's or
 * Inductor's (64 or 32 fp32 partial sums), so the variance may differ from theirs in its last bit,
 * as theirs differ from each other; everything after it is bitwise the spec.
 *
 * Roundings. fp16: vcvtps2ph both times (exact, subnormals included). bf16, the intermediate one:
 * round to nearest even on the fp32 bits (add 0x7fff plus the kept lowest bit, clear the low half),
 * five integer operations that are exact for every non-NaN value and cheaper than the hardware
 * conversion and its widening back; the stored ones (out, residual_out): vcvtne2ps2bf16, 32 lanes
 * an instruction, which flushes fp32 subnormals to zero where the spec rounds them: a row where
 * any lane to store is an fp32 subnormal (tested where a vector's result has a zero, collected in
 * a mask) is stored again by the integer rounding.
 *
 * Compile with -ffp-contract=off (the squares and the sum must stay two roundings) and -fopenmp;
 * built and loaded by loader.py. No torch headers: raw pointers, strides in elements. */

#include <math.h>
#include <stdlib.h>

#include "avx512_common.h"

/* y as the weight multiply takes it */
INLINE __m512 rounded_y(__m512 y, int dt, int round_y) { return round_y ? round_in_fp32(y, dt) : y; }

INLINE __m512 load_h(const uint16_t *x, const uint16_t *r, int64_t i, __mmask16 m, int dt) {
    __m512 h = load16(x + i, m, dt);
    if (r)
        h = _mm512_add_ps(h, load16(r + i, m, dt));
    return h;
}

INLINE __m512 squares(__m512 acc, __m512 h) { return _mm512_add_ps(acc, _mm512_mul_ps(h, h)); }

/* out[i] for lanes [from, n), 16 at a time, exactly: the tail, or a row stored again. */
INLINE void store_out_exact(int dt, int round_y, const uint16_t *x, const float *h32, const float *wf, uint16_t *out,
                            int64_t from, int64_t n, __m512 inv) {
    for (int64_t i = from; i < n; i += 16) {
        __mmask16 m = lanes(n - i);
        __m512 h = h32 ? _mm512_maskz_loadu_ps(m, h32 + i) : load16(x + i, m, dt);
        __m512 o = _mm512_mul_ps(rounded_y(_mm512_mul_ps(h, inv), dt, round_y), _mm512_maskz_loadu_ps(m, wf + i));
        _mm256_mask_storeu_epi16(out + i, m, pack16_exact(o, dt));
    }
}

/* One row. r NULL: no residual. wf: the weight in fp32 (Gemma's: 1 + w); h32: n floats of scratch
 * (fused add). round_y: y rounded to the dtype before the weight multiply (HF Llama's weight in x's
 * dtype), else not (Gemma, an fp32 weight). */
INLINE void normalise_row(int dt, int round_y, const uint16_t *x, const uint16_t *r, const float *wf, uint16_t *out,
                          uint16_t *r_out, float *h32, int64_t n, float eps) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    __mmask16 suspect = 0;
    int64_t i = 0;
    if (r) { /* pass 1: h (kept in fp32 for pass 2), residual_out, the squares */
        for (; i + 32 <= n; i += 32) {
            __m512 a = load_h(x, r, i, ALL, dt), b = load_h(x, r, i + 16, ALL, dt);
            _mm512_storeu_ps(h32 + i, a);
            _mm512_storeu_ps(h32 + i + 16, b);
            _mm512_storeu_si512(r_out + i, pack32(a, b, dt, &suspect));
            acc0 = squares(acc0, a);
            acc1 = squares(acc1, b);
        }
        int64_t tail = i;
        for (int64_t j = suspect ? 0 : tail; j < n; j += 16) {
            __mmask16 m = lanes(n - j);
            __m512 h = load_h(x, r, j, m, dt);
            if (j >= tail) {
                _mm512_mask_storeu_ps(h32 + j, m, h);
                acc2 = squares(acc2, h);
            }
            _mm256_mask_storeu_epi16(r_out + j, m, pack16_exact(h, dt));
        }
    } else { /* pass 1: the squares */
        for (; i + 64 <= n; i += 64) {
            acc0 = squares(acc0, load16(x + i, ALL, dt));
            acc1 = squares(acc1, load16(x + i + 16, ALL, dt));
            acc2 = squares(acc2, load16(x + i + 32, ALL, dt));
            acc3 = squares(acc3, load16(x + i + 48, ALL, dt));
        }
        for (; i < n; i += 16)
            acc0 = squares(acc0, load16(x + i, lanes(n - i), dt));
    }
    __m512 sum = _mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_add_ps(acc2, acc3));
    /* the spec: sum / n (ATen's mean divides), + eps in fp32, rsqrt as 1 / sqrt */
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sum) / (float)n + eps));
    /* pass 2: out (h from the scratch, or x again: the row is in L1/L2) */
    const float *h32_in = r ? h32 : 0;
    suspect = 0;
    for (i = 0; i + 32 <= n; i += 32) {
        __m512 ha = h32_in ? _mm512_loadu_ps(h32_in + i) : load16(x + i, ALL, dt);
        __m512 hb = h32_in ? _mm512_loadu_ps(h32_in + i + 16) : load16(x + i + 16, ALL, dt);
        __m512 a = _mm512_mul_ps(rounded_y(_mm512_mul_ps(ha, inv), dt, round_y), _mm512_loadu_ps(wf + i));
        __m512 b = _mm512_mul_ps(rounded_y(_mm512_mul_ps(hb, inv), dt, round_y), _mm512_loadu_ps(wf + i + 16));
        _mm512_storeu_si512(out + i, pack32(a, b, dt, &suspect));
    }
    store_out_exact(dt, round_y, x, h32_in, wf, out, suspect ? 0 : i, n, inv);
}

/* the weight in fp32 (Gemma's: 1 + w), n floats (rms_norm_rows.h) */
INLINE float *widened_weight(int dt, const void *w, int w32, int plus_one, int64_t n) {
    float *wf = malloc(n * sizeof(float));
    if (!wf)
        return 0;
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = lanes(n - i);
        __m512 v = w32 ? _mm512_maskz_loadu_ps(m, (const float *)w + i) : load16((const uint16_t *)w + i, m, dt);
        /* Gemma's 1 + w, in fp32 as the spec adds it */
        _mm512_mask_storeu_ps(wf + i, m, plus_one ? _mm512_add_ps(_mm512_set1_ps(1.0f), v) : v);
    }
    return wf;
}

#define ROW_FLOATS(n) (n)
/* the bf16 entry exists only where the build enabled AVX512_BF16 (pack32's conversion) */
#ifdef __AVX512BF16__
#define BF16_ENTRY 1
#else
#define BF16_ENTRY 0
#endif
#include "rms_norm_rows.h"
