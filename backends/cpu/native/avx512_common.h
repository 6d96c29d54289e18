/* What the hand-written AVX-512 kernels share (rms_norm.c, rms_norm_gated.c): 16-lane loads of
 * bf16/fp16 widened to fp32, and the exact roundings of fp32 to bf16/fp16 (c10's round to nearest
 * even, NaN as a quiet NaN), in fp32 or packed for storing. */

#ifndef CUSTOMOP_AVX512_COMMON_H
#define CUSTOMOP_AVX512_COMMON_H

#include <immintrin.h>
#include <stdint.h>

#include "native_common.h"

#define ALL ((__mmask16)0xffff)
#define RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* the first min(left, 16) lanes */
INLINE __mmask16 lanes(int64_t left) { return left >= 16 ? ALL : (__mmask16)((1u << left) - 1); }

/* 16 lanes of bf16/fp16 (those in `m`; the others 0) widened to fp32. */
INLINE __m512 load16(const uint16_t *p, __mmask16 m, int dt) {
    __m256i v = m == ALL ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(m, p);
    if (dt == FP16)
        return _mm512_cvtph_ps(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* bf16 round to nearest even on the fp32 bits, as c10::BFloat16 does, the result left in fp32. */
INLINE __m512 bf16_round_in_fp32(__m512 v) {
    __m512i b = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb);
    return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xffff0000u)));
}

/* y rounded to the dtype, in fp32 (exact). */
INLINE __m512 round_in_fp32(__m512 y, int dt) {
    if (dt == FP16)
        return _mm512_cvtph_ps(_mm512_cvtps_ph(y, RNE));
    return bf16_round_in_fp32(y);
}

/* 16 lanes rounded to the dtype for storing, exact for every value (the slow path for bf16). */
INLINE __m256i pack16_exact(__m512 v, int dt) {
    if (dt == FP16)
        return _mm512_cvtps_ph(v, RNE);
    __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(bf16_round_in_fp32(v)), 16);
    __m256i r = _mm512_cvtepi32_epi16(bits);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); /* NaN: a quiet NaN, as c10 gives */
    return _mm256_mask_mov_epi16(r, nan, _mm256_set1_epi16(0x7fc0));
}

/* 32 lanes (lo, then hi) rounded to the dtype for storing by the hardware; bf16 adds the lanes it
 * may round wrongly (fp32 subnormals) to *suspect. */
INLINE __m512i pack32(__m512 lo, __m512 hi, int dt, __mmask16 *suspect) {
    if (dt == FP16)
        return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtps_ph(lo, RNE)), _mm512_cvtps_ph(hi, RNE), 1);
#ifdef __AVX512BF16__
    __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    /* a flushed lane comes out as +-0: only vectors with a zero result are tested (one instruction
     * for 32 lanes; 3-8% faster than testing every vector) */
    if (__builtin_expect(_mm512_testn_epi16_mask(packed, _mm512_set1_epi16(0x7fff)) != 0, 0))
        *suspect |= _mm512_fpclass_ps_mask(lo, 0x20) | _mm512_fpclass_ps_mask(hi, 0x20); /* 0x20: subnormal */
    return packed;
#else
    (void)suspect; /* not reached: no bf16 entry point without AVX512_BF16 */
    return _mm512_inserti64x4(_mm512_castsi256_si512(pack16_exact(lo, dt)), pack16_exact(hi, dt), 1);
#endif
}

#endif
