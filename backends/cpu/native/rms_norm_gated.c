/* The grouped gated RMSNorm of Mamba-2 / gated delta-net (customop.math.layernorm.rms_norm_gated)
 * for bf16/fp16/fp32 rows on AVX-512 CPUs (issue 18).
 *
 * Why a hand-written kernel: Inductor's code for the spec (torch 2.13) makes three passes over
 * memory in three OpenMP loops, with the gated product x * act(z) kept in an fp32 buffer of the
 * whole input's size between them; torch.compile(forward_native) runs the same code, so the
 * compiled tier could only tie it. Here each group of a row is read once from memory (x and z),
 * its fp32 temporary (g, or the gate) kept in a per-thread scratch of one group that stays in L1,
 * and written once; a call of less than a thread's share opens no OpenMP region.
 *
 * Per row, as the spec does it (all in fp32, one rounding at the end):
 *   a = act(z) = silu: z / (1 + exp(-z)), sigmoid: 1 / (1 + exp(-z))   (no z: no gate)
 *   g = fp32(x) * a       (norm_before_gate false), else g = fp32(x)
 *   per group of `group` lanes: inv = 1 / sqrt(sum(g * g) / group + eps)
 *   out = round(g * inv * fp32(w) [* a]) (the gate after the weight: norm_before_gate true)
 * exp is the caller's function pointer: torch's own Sleef_expf16_u10, the one ATen's vectorised
 * silu and sigmoid and Inductor's code call, so the gate is bitwise theirs. The sums run in
 * another order than ATen's or Inductor's, so a group's variance may differ from theirs in its
 * last bit, as theirs differ from each other; everything after it is bitwise the spec.
 *
 * Compile with -ffp-contract=off (each product and sum a rounding of its own, as in the spec) and
 * -fopenmp; built and loaded by loader.py. No torch headers: raw pointers, strides in elements. */

#include <math.h>
#include <stdlib.h>

#include "avx512_common.h"

/* exp of 16 fp32 lanes (torch's Sleef_expf16_u10) */
typedef __m512 (*exp16_fn)(__m512);

/* where the gate applies: none (no z), to x before the norm, or to the output after the weight */
enum { NO_GATE = 0, GATE_BEFORE_NORM = 1, GATE_AFTER_NORM = 2 };

/* 16 lanes of x's dtype (those in `m`; the others 0) widened to fp32 */
INLINE __m512 load_any(const void *p, int64_t i, __mmask16 m, int dt) {
    if (dt == FP32)
        return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    return load16((const uint16_t *)p + i, m, dt);
}

/* act(z) as ATen's vectorised kernels compute it: silu z / (1 + exp(-z)), sigmoid 1 / (1 + exp(-z)) */
INLINE __m512 activation(__m512 z, int sigmoid, exp16_fn exp16) {
    __m512 minus_z = _mm512_xor_ps(z, _mm512_set1_ps(-0.0f));
    __m512 denominator = _mm512_add_ps(exp16(minus_z), _mm512_set1_ps(1.0f));
    return _mm512_div_ps(sigmoid ? _mm512_set1_ps(1.0f) : z, denominator);
}

/* 16 lanes of y rounded to the dtype and stored (those in `m`); bf16 adds the lanes the hardware
 * conversion may round wrongly (fp32 subnormals, which it flushes) to *suspect. */
INLINE void store16(int dt, __m512 y, void *out, int64_t i, __mmask16 m, __mmask16 *suspect) {
    if (dt == FP32) {
        _mm512_mask_storeu_ps((float *)out + i, m, y);
        return;
    }
    __m256i packed;
    if (dt == FP16) {
        packed = _mm512_cvtps_ph(y, RNE);
    } else {
#ifdef __AVX512BF16__
        packed = (__m256i)_mm512_cvtneps_pbh(y);
        /* a flushed lane comes out as +-0: only vectors with a zero result are tested */
        if (__builtin_expect(_mm256_testn_epi16_mask(packed, _mm256_set1_epi16(0x7fff)) != 0, 0))
            *suspect |= _mm512_fpclass_ps_mask(y, 0x20) & m; /* 0x20: subnormal */
#else
        packed = pack16_exact(y, dt); /* not reached: no bf16 entry point without AVX512_BF16 */
#endif
    }
    _mm256_mask_storeu_epi16((uint16_t *)out + i, m, packed);
}

/* The output lanes [i, i + 16) of a group: g * inv * w, times the gate where it comes last. The
 * scratch holds g (gate before the norm) or the gate (after it; g is x, read again). */
INLINE __m512 group_output(int dt, int mode, const void *x, const float *scratch, const float *wf, int64_t start,
                           int64_t i, __mmask16 m, __m512 inv) {
    __m512 g = mode == GATE_BEFORE_NORM ? _mm512_maskz_loadu_ps(m, scratch + i) : load_any(x, start + i, m, dt);
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(g, inv), _mm512_maskz_loadu_ps(m, wf + start + i));
    return mode == GATE_AFTER_NORM ? _mm512_mul_ps(y, _mm512_maskz_loadu_ps(m, scratch + i)) : y;
}

/* One group of `size` lanes from lane `start` of a row; scratch: `size` floats. */
INLINE void gated_group(int dt, int mode, int sigmoid, exp16_fn exp16, const void *x, const void *z, const float *wf,
                        void *out, float *scratch, int64_t start, int64_t size, float eps) {
    /* pass 1: g = x [* act(z)], its squares summed (rounded before the sum: no FMA), and the
     * scratch: g, or the gate where it comes after the norm */
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < size; i += 16) {
        __mmask16 m = lanes(size - i);
        __m512 g = load_any(x, start + i, m, dt);
        if (mode != NO_GATE) {
            __m512 a = activation(load_any(z, start + i, m, dt), sigmoid, exp16);
            if (mode == GATE_BEFORE_NORM)
                g = _mm512_mul_ps(g, a);
            _mm512_mask_storeu_ps(scratch + i, m, mode == GATE_BEFORE_NORM ? g : a);
        }
        acc = _mm512_add_ps(acc, _mm512_mul_ps(g, g));
    }
    /* the spec: the mean divides the sum; + eps in fp32; rsqrt as 1 / sqrt */
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)size + eps));
    /* pass 2: the output, rounded once; a group with a lane the hardware may have flushed is
     * stored again by the exact rounding */
    __mmask16 suspect = 0;
    for (int64_t i = 0; i < size; i += 16) {
        __mmask16 m = lanes(size - i);
        store16(dt, group_output(dt, mode, x, scratch, wf, start, i, m, inv), out, start + i, m, &suspect);
    }
    for (int64_t i = 0; suspect && i < size; i += 16) {
        __mmask16 m = lanes(size - i);
        __m256i exact = pack16_exact(group_output(dt, mode, x, scratch, wf, start, i, m, inv), dt);
        _mm256_mask_storeu_epi16((uint16_t *)out + start + i, m, exact);
    }
}

/* One row of n lanes in groups of `group`; scratch: `group` floats. */
INLINE void gated_row(int dt, int mode, int sigmoid, exp16_fn exp16, const void *x, const void *z, const float *wf,
                      void *out, float *scratch, int64_t n, int64_t group, float eps) {
    for (int64_t start = 0; start < n; start += group)
        gated_group(dt, mode, sigmoid, exp16, x, z, wf, out, scratch, start, group, eps);
}

/* The byte size of one element of x's dtype */
INLINE int64_t element_size(int dt) { return dt == FP32 ? 4 : 2; }

/* rows of n lanes; x_stride / z_stride: elements between rows of x / z (z NULL: no gate). w: n
 * weights of x's dtype, or fp32 (w32). out: contiguous [rows, n]. Returns 0, or -1 when out of
 * memory (the output then incomplete: the caller runs another path). */
INLINE int run(int dt, const void *x, int64_t x_stride, const void *z, int64_t z_stride, const void *w, int w32,
               void *out, int64_t rows, int64_t n, int64_t group, float eps, int norm_before_gate, int sigmoid,
               exp16_fn exp16, int threads) {
    float *wf = malloc(n * sizeof(float)); /* the weight widened once a call, not once a row */
    if (!wf)
        return -1;
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = lanes(n - i);
        _mm512_mask_storeu_ps(wf + i, m, load_any(w, i, m, w32 ? FP32 : dt));
    }
    int mode = !z ? NO_GATE : norm_before_gate ? GATE_AFTER_NORM : GATE_BEFORE_NORM;
    int64_t size = element_size(dt);
    /* a thread per 16K elements at most: the exp makes a row ~3x RMSNorm's work, so a second
     * thread pays from about half RMSNorm's 32K */
    threads = threads_for(threads, rows, rows * n, 16384);
    int failed = 0;
#pragma omp parallel num_threads(threads > 1 ? threads : 1) if (threads > 1) reduction(| : failed)
    {
        float *scratch = malloc(group * sizeof(float)); /* per thread: one group, in L1 */
        if (!scratch)
            failed = 1;
#pragma omp for schedule(static)
        for (int64_t j = 0; j < rows; j++)
            if (scratch)
                gated_row(dt, mode, sigmoid, exp16, (const char *)x + j * x_stride * size,
                          z ? (const char *)z + j * z_stride * size : 0, wf, (char *)out + j * n * size, scratch, n,
                          group, eps);
        free(scratch);
    }
    free(wf);
    return failed ? -1 : 0;
}

/* The entry points (ctypes), one per dtype; the bf16 one exists only where the build enabled
 * AVX512_BF16. The row loop is compiled per dtype. */
#define ENTRY(name, dt)                                                                                       \
    int name(const void *x, int64_t x_stride, const void *z, int64_t z_stride, const void *w, int w32, void *out, \
             int64_t rows, int64_t n, int64_t group, float eps, int norm_before_gate, int sigmoid, exp16_fn exp16, \
             int threads) {                                                                                  \
        return run(dt, x, x_stride, z, z_stride, w, w32, out, rows, n, group, eps, norm_before_gate, sigmoid,   \
                   exp16, threads);                                                                          \
    }

#ifdef __AVX512BF16__
ENTRY(customop_rms_norm_gated_bf16, BF16)
#endif
ENTRY(customop_rms_norm_gated_fp16, FP16)
ENTRY(customop_rms_norm_gated_fp32, FP32)
