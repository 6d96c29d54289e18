/* The grouped gated RMSNorm (customop.math.layernorm.rms_norm_gated, and fused_rms_norm_gated: the
 * gate after the norm as y * z * sigmoid(z), an optional weight) for bf16/fp16/fp32 rows on x86-64
 * CPUs with AVX2 and F16C but no AVX-512: the math, roundings and entry points of rms_norm_gated.c,
 * 8 lanes a vector. loader.py builds it with rms_norm_avx2.c on such a CPU.
 *
 * Per row, as the specs do it (all in fp32, one rounding at the end; rms_norm_gated.c says why a
 * hand-written kernel):
 *   a = the gate's factor (rms_norm_gated_rows.h: silu, sigmoid, or the swish product's sigmoid)
 *   g = fp32(x) * a       (the gate before the norm), else g = fp32(x)
 *   per group of `group` lanes: inv = 1 / sqrt(sum(g * g) / group + eps)
 *   out = round(g * inv * fp32(w) [* z] [* a])   (the gate after the weight)
 * exp is the caller's function pointer: torch's own Sleef_expf8_u10, the one ATen's AVX2 silu and
 * sigmoid and Inductor's AVX2 code call, so the gate is bitwise theirs on this CPU.
 *
 * Where it differs from the AVX-512 kernel, and why: bf16 is rounded by the integer form (exact for
 * every value: nothing is stored twice); a group's last size % 8 lanes go through zero-padded stack
 * buffers (no masked 16-bit loads or stores), so the scratch is padded to a multiple of 8; the
 * variance's sum runs in four 8-lane partial sums, another order whose last bit may differ, as
 * ATen's and Inductor's differ from each other; everything after it is bitwise the spec.
 *
 * Compile with -mavx2 -mf16c -ffp-contract=off -fopenmp; built and loaded by loader.py. No torch
 * headers: raw pointers, strides in elements. */

#include <math.h>
#include <stdlib.h>

#include "avx2_common.h"

/* exp of 8 fp32 lanes (torch's Sleef_expf8_u10) */
typedef __m256 (*exp_fn)(__m256);
#define SCRATCH_FLOATS(group) (((group) + 7) & ~(int64_t)7)
#define BF16_ENTRY 1 /* the integer rounding needs no CPU feature */
#include "rms_norm_gated_rows.h"

/* the lanes [i, i + min(left, 8)) of x's dtype widened to fp32, the others 0 */
INLINE __m256 load_lanes(const void *p, int64_t i, int64_t left, int dt) {
    if (dt == FP32) {
        if (left >= 8)
            return _mm256_loadu_ps((const float *)p + i);
        float buf[8] = {0};
        memcpy(buf, (const float *)p + i, left * sizeof(float));
        return _mm256_loadu_ps(buf);
    }
    return left >= 8 ? load8((const uint16_t *)p + i, dt) : load_tail((const uint16_t *)p + i, left, dt);
}

/* y rounded to the dtype and stored at lanes [i, i + min(left, 8)) */
INLINE void store_lanes(int dt, __m256 y, void *out, int64_t i, int64_t left) {
    if (dt == FP32) {
        if (left >= 8) {
            _mm256_storeu_ps((float *)out + i, y);
        } else {
            float buf[8];
            _mm256_storeu_ps(buf, y);
            memcpy((float *)out + i, buf, left * sizeof(float));
        }
        return;
    }
    if (left >= 8)
        store8((uint16_t *)out + i, pack8(y, dt));
    else
        store_tail((uint16_t *)out + i, pack8(y, dt), left);
}

/* the gate's factor as ATen's vectorised kernels compute it, from e = exp(-z): silu z / (1 + e),
 * else (sigmoid, and the swish product's second factor) 1 / (1 + e) */
INLINE __m256 activation(__m256 z, __m256 e, int act) {
    return _mm256_div_ps(act == SILU ? z : _mm256_set1_ps(1.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f)));
}

/* scratch[i] = exp(-z) for `size` lanes from lane `start` (padding: exp(-0)). A loop of its own: nothing is
 * live across the calls (every vector register is the callee's to clobber), and the divisions
 * after it pipeline instead of waiting on each call (measured: the loop that called the exp and
 * divided in turn spent 40% of its time waiting on the division). */
INLINE void exps(int dt, exp_fn vexp, const void *z, float *scratch, int64_t start, int64_t size) {
    for (int64_t i = 0; i < size; i += 8) {
        __m256 minus_z = _mm256_xor_ps(load_lanes(z, start + i, size - i, dt), _mm256_set1_ps(-0.0f));
        _mm256_storeu_ps(scratch + i, vexp(minus_z));
    }
}

/* The output lanes [i, i + 8) of a group: g * inv * w, times the gate where it comes last (the
 * swish product: times z, then the sigmoid). g: the scratch (the gate before the norm) or x; the
 * gate's factor from e = exp(-z), computed here (z read once). */
INLINE __m256 group_output(int dt, int mode, int act, const void *x, const void *z, const float *scratch,
                           const float *wf, int64_t start, int64_t i, int64_t left, __m256 inv, __m256 e) {
    __m256 g = mode == GATE_BEFORE_NORM ? _mm256_loadu_ps(scratch + i) : load_lanes(x, start + i, left, dt);
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(g, inv), load_lanes(wf, start + i, left, FP32));
    if (mode != GATE_AFTER_NORM)
        return y;
    __m256 zv = load_lanes(z, start + i, left, dt);
    if (act == SWISH_PRODUCT)
        y = _mm256_mul_ps(y, zv);
    return _mm256_mul_ps(y, activation(zv, e, act));
}

INLINE __m256 squares(__m256 acc, __m256 g) { return _mm256_add_ps(acc, _mm256_mul_ps(g, g)); }

/* g at the lanes [i, i + min(left, 8)) of a group: x, or with the gate before the norm x * act(z)
 * from the scratch's exps, stored over them for the output pass */
INLINE __m256 pass1_lanes(int dt, int mode, int act, const void *x, const void *z, float *scratch, int64_t start,
                          int64_t i, int64_t left) {
    __m256 g = load_lanes(x, start + i, left, dt);
    if (mode != GATE_BEFORE_NORM)
        return g;
    g = _mm256_mul_ps(g, activation(load_lanes(z, start + i, left, dt), _mm256_loadu_ps(scratch + i), act));
    _mm256_storeu_ps(scratch + i, g);
    return g;
}

/* One group of `size` lanes from lane `start` of a row; scratch: SCRATCH_FLOATS(size) floats.
 * Two passes over the group, each vector register-light: the sum of squares, then the output.
 * The gate before the norm computes g = x * act(z) in the first into the scratch; after the norm
 * the gate is computed in the second, a chunk's exps at a time, so z is read once and x twice
 * (as Inductor's code reads them). */
INLINE void gated_group(int dt, int mode, int act, exp_fn vexp, const void *x, const void *z, const float *wf,
                        void *out, float *scratch, int64_t start, int64_t size, float eps) {
    /* pass 1: g = x [* act(z)] (kept in the scratch), its squares summed (rounded before the sum:
     * no FMA) in four partial sums, so that the adds are not one chain; padding lanes: x, z 0 */
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    if (mode == GATE_BEFORE_NORM)
        exps(dt, vexp, z, scratch, start, size);
    int64_t i = 0;
    for (; i + 32 <= size; i += 32) {
        acc0 = squares(acc0, pass1_lanes(dt, mode, act, x, z, scratch, start, i, 8));
        acc1 = squares(acc1, pass1_lanes(dt, mode, act, x, z, scratch, start, i + 8, 8));
        acc2 = squares(acc2, pass1_lanes(dt, mode, act, x, z, scratch, start, i + 16, 8));
        acc3 = squares(acc3, pass1_lanes(dt, mode, act, x, z, scratch, start, i + 24, 8));
    }
    for (; i < size; i += 8)
        acc0 = squares(acc0, pass1_lanes(dt, mode, act, x, z, scratch, start, i, size - i));
    /* the spec: the mean divides the sum; + eps in fp32; rsqrt as 1 / sqrt */
    __m256 sum = _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3));
    __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(sum) / (float)size + eps));
    /* pass 2: the output, rounded once */
    const int64_t step = mode == GATE_AFTER_NORM ? GATE_CHUNK : size; /* one chunk without exps */
    for (int64_t c = 0; c < size; c += step) {
        int64_t chunk = size - c < step ? size - c : step;
        if (mode == GATE_AFTER_NORM)
            exps(dt, vexp, z, scratch, start + c, chunk);
        for (int64_t i = 0; i < chunk; i += 8) {
            __m256 e = mode == GATE_AFTER_NORM ? _mm256_loadu_ps(scratch + i) : _mm256_setzero_ps();
            const float *g = mode == GATE_BEFORE_NORM ? scratch + c : scratch;
            store_lanes(dt, group_output(dt, mode, act, x, z, g, wf, start + c, i, chunk - i, inv, e), out,
                        start + c + i, chunk - i);
        }
    }
}

INLINE float *gated_weight(int dt, const void *w, int w32, int64_t n) {
    float *wf = malloc(n * sizeof(float));
    if (!wf)
        return 0;
    for (int64_t i = 0; i < n; i += 8) {
        __m256 v = w ? load_lanes(w, i, n - i, w32 ? FP32 : dt) : _mm256_set1_ps(1.0f);
        store_lanes(FP32, v, wf, i, n - i);
    }
    return wf;
}
