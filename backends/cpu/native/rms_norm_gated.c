/* The grouped gated RMSNorm of Mamba-2 / gated delta-net (customop.math.layernorm.rms_norm_gated)
 * and fused_rms_norm_gated (FusedRMSNormGated: whole rows, the gate after the norm as y * z *
 * sigmoid(z), an optional weight) for bf16/fp16/fp32 rows on AVX-512 CPUs (issue 18).
 *
 * Why a hand-written kernel: Inductor's code for the spec (torch 2.13) makes three passes over
 * memory in three OpenMP loops, with the gated product x * act(z) kept in an fp32 buffer of the
 * whole input's size between them; torch.compile(forward_native) runs the same code, so the
 * compiled tier could only tie it. Here a group of a row is read in two passes that stay in
 * L1/L2 (the sum of squares, the output), its fp32 temporary (g, or a chunk's exps) kept in a
 * per-thread scratch of one group, and written once; a call of less than a thread's share opens
 * no OpenMP region. The loop shape (rms_norm_gated_rows.h and docs/cpu.md say why) is the AVX2
 * build's.
 *
 * Per row, as the spec does it (all in fp32, one rounding at the end):
 *   a = the gate's factor (rms_norm_gated_rows.h: silu, sigmoid, or the swish product's sigmoid)
 *   g = fp32(x) * a       (norm_before_gate false), else g = fp32(x)
 *   per group of `group` lanes: inv = 1 / sqrt(sum(g * g) / group + eps)
 *   out = round(g * inv * fp32(w) [* z] [* a])   (the gate after the weight: norm_before_gate true)
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
typedef __m512 (*exp_fn)(__m512);
#define SCRATCH_FLOATS(group) (group)
/* the bf16 entry exists only where the build enabled AVX512_BF16 (store16's conversion) */
#ifdef __AVX512BF16__
#define BF16_ENTRY 1
#else
#define BF16_ENTRY 0
#endif
#include "rms_norm_gated_rows.h"

/* 16 lanes of x's dtype (those in `m`; the others 0) widened to fp32 */
INLINE __m512 load_any(const void *p, int64_t i, __mmask16 m, int dt) {
    if (dt == FP32)
        return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    return load16((const uint16_t *)p + i, m, dt);
}

/* the gate's factor as ATen's vectorised kernels compute it, from e = exp(-z): silu z / (1 + e),
 * else (sigmoid, and the swish product's second factor) 1 / (1 + e) */
INLINE __m512 activation(__m512 z, __m512 e, int act) {
    return _mm512_div_ps(act == SILU ? z : _mm512_set1_ps(1.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f)));
}

/* scratch[i] = exp(-z) for `size` lanes from lane `start`: a loop of its own, so that nothing is
 * live across the calls and the divisions after it pipeline (rms_norm_gated_avx2.c measured it) */
INLINE void exps(int dt, exp_fn vexp, const void *z, float *scratch, int64_t start, int64_t size) {
    for (int64_t i = 0; i < size; i += 16) {
        __mmask16 m = lanes(size - i);
        __m512 minus_z = _mm512_xor_ps(load_any(z, start + i, m, dt), _mm512_set1_ps(-0.0f));
        _mm512_mask_storeu_ps(scratch + i, m, vexp(minus_z));
    }
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
        (void)suspect;
        packed = pack16_exact(y, dt); /* not reached: no bf16 entry point without AVX512_BF16 */
#endif
    }
    _mm256_mask_storeu_epi16((uint16_t *)out + i, m, packed);
}

/* The output lanes [i, i + 16) of a group: g * inv * w, times the gate where it comes last (the
 * swish product: times z, then the sigmoid). g: the scratch (the gate before the norm) or x; the
 * gate's factor from e = exp(-z), computed here (z read once). */
INLINE __m512 group_output(int dt, int mode, int act, const void *x, const void *z, const float *scratch,
                           const float *wf, int64_t start, int64_t i, __mmask16 m, __m512 inv, __m512 e) {
    __m512 g = mode == GATE_BEFORE_NORM ? _mm512_maskz_loadu_ps(m, scratch + i) : load_any(x, start + i, m, dt);
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(g, inv), _mm512_maskz_loadu_ps(m, wf + start + i));
    if (mode != GATE_AFTER_NORM)
        return y;
    __m512 zv = load_any(z, start + i, m, dt);
    if (act == SWISH_PRODUCT)
        y = _mm512_mul_ps(y, zv);
    return _mm512_mul_ps(y, activation(zv, e, act));
}

/* The lanes [c, c + chunk) of a group's output, rounded once (the chunk's exps in the scratch
 * where the gate comes after the norm); a chunk with a lane the hardware may have flushed is
 * stored again by the exact rounding. */
INLINE void output_chunk(int dt, int mode, int act, const void *x, const void *z, const float *scratch,
                         const float *wf, void *out, int64_t start, int64_t c, int64_t chunk, __m512 inv) {
    const float *g = mode == GATE_BEFORE_NORM ? scratch + c : scratch;
    __mmask16 suspect = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int64_t i = 0; i < chunk; i += 16) {
            __mmask16 m = lanes(chunk - i);
            __m512 e = mode == GATE_AFTER_NORM ? _mm512_maskz_loadu_ps(m, scratch + i) : _mm512_setzero_ps();
            __m512 y = group_output(dt, mode, act, x, z, g, wf, start + c, i, m, inv, e);
            if (pass == 0)
                store16(dt, y, out, start + c + i, m, &suspect);
            else
                _mm256_mask_storeu_epi16((uint16_t *)out + start + c + i, m, pack16_exact(y, dt));
        }
        if (!suspect)
            return;
    }
}

INLINE __m512 squares(__m512 acc, __m512 g) { return _mm512_add_ps(acc, _mm512_mul_ps(g, g)); }

/* g at the lanes [i, i + 16) of a group (those in `m`): x, or with the gate before the norm
 * x * act(z) from the scratch's exps, stored over them for the output pass */
INLINE __m512 pass1_lanes(int dt, int mode, int act, const void *x, const void *z, float *scratch, int64_t start,
                          int64_t i, __mmask16 m) {
    __m512 g = load_any(x, start + i, m, dt);
    if (mode != GATE_BEFORE_NORM)
        return g;
    g = _mm512_mul_ps(g, activation(load_any(z, start + i, m, dt), _mm512_maskz_loadu_ps(m, scratch + i), act));
    _mm512_mask_storeu_ps(scratch + i, m, g);
    return g;
}

/* One group of `size` lanes from lane `start` of a row; scratch: `size` floats. Two passes, as in
 * rms_norm_gated_avx2.c: the sum of squares (the gate before the norm: g = x * act(z) into the
 * scratch), then the output (the gate after the norm: computed there, a chunk's exps at a time). */
INLINE void gated_group(int dt, int mode, int act, exp_fn vexp, const void *x, const void *z, const float *wf,
                        void *out, float *scratch, int64_t start, int64_t size, float eps) {
    /* pass 1: g = x [* act(z)], its squares summed (rounded before the sum: no FMA) in four partial
     * sums, so that the adds are not one chain */
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    if (mode == GATE_BEFORE_NORM)
        exps(dt, vexp, z, scratch, start, size);
    int64_t i = 0;
    for (; i + 64 <= size; i += 64) {
        acc0 = squares(acc0, pass1_lanes(dt, mode, act, x, z, scratch, start, i, ALL));
        acc1 = squares(acc1, pass1_lanes(dt, mode, act, x, z, scratch, start, i + 16, ALL));
        acc2 = squares(acc2, pass1_lanes(dt, mode, act, x, z, scratch, start, i + 32, ALL));
        acc3 = squares(acc3, pass1_lanes(dt, mode, act, x, z, scratch, start, i + 48, ALL));
    }
    for (; i < size; i += 16)
        acc0 = squares(acc0, pass1_lanes(dt, mode, act, x, z, scratch, start, i, lanes(size - i)));
    /* the spec: the mean divides the sum; + eps in fp32; rsqrt as 1 / sqrt */
    __m512 sum = _mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_add_ps(acc2, acc3));
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sum) / (float)size + eps));
    /* pass 2: the output */
    const int64_t step = mode == GATE_AFTER_NORM ? GATE_CHUNK : size; /* one chunk without exps */
    for (int64_t c = 0; c < size; c += step) {
        int64_t chunk = size - c < step ? size - c : step;
        if (mode == GATE_AFTER_NORM)
            exps(dt, vexp, z, scratch, start + c, chunk);
        output_chunk(dt, mode, act, x, z, scratch, wf, out, start, c, chunk, inv);
    }
}

INLINE float *gated_weight(int dt, const void *w, int w32, int64_t n) {
    float *wf = malloc(n * sizeof(float));
    if (!wf)
        return 0;
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = lanes(n - i);
        _mm512_mask_storeu_ps(wf + i, m, w ? load_any(w, i, m, w32 ? FP32 : dt) : _mm512_set1_ps(1.0f));
    }
    return wf;
}
