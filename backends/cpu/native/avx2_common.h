/* What the hand-written AVX2 kernels share (rms_norm_avx2.c, rms_norm_gated_avx2.c): 8-lane loads of
 * bf16/fp16 widened to fp32, the exact roundings of fp32 to bf16/fp16 (c10's round to nearest even,
 * NaN as a quiet NaN), and a row's last n % 8 lanes through a zero-padded stack buffer (AVX2 has no
 * masked 16-bit loads or stores). */

#ifndef CUSTOMOP_AVX2_COMMON_H
#define CUSTOMOP_AVX2_COMMON_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "native_common.h"

#define RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* 8 bf16/fp16 values widened to fp32 */
INLINE __m256 load8(const uint16_t *p, int dt) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    if (dt == FP16)
        return _mm256_cvtph_ps(v);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* the first `left` (< 8) values, the other lanes 0 */
INLINE __m256 load_tail(const uint16_t *p, int64_t left, int dt) {
    uint16_t buf[8] = {0};
    memcpy(buf, p, left * sizeof(uint16_t));
    return load8(buf, dt);
}

/* bf16 round to nearest even on the fp32 bits, as c10::BFloat16 does, the result left in fp32 */
INLINE __m256 bf16_round_in_fp32(__m256 v) {
    __m256i b = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb);
    return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0xffff0000u)));
}

/* 8 lanes rounded to the dtype for storing, exact for every value (NaN: a quiet NaN, as c10 gives) */
INLINE __m128i pack8(__m256 v, int dt) {
    if (dt == FP16)
        return _mm256_cvtps_ph(v, RNE);
    __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(bf16_round_in_fp32(v)), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc0), nan);
    /* 32-bit lanes holding 16-bit values: the unsigned pack keeps them and their order */
    return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
}

INLINE void store8(uint16_t *p, __m128i v) { _mm_storeu_si128((__m128i *)p, v); }

INLINE void store_tail(uint16_t *p, __m128i v, int64_t left) {
    uint16_t buf[8];
    _mm_storeu_si128((__m128i *)buf, v);
    memcpy(p, buf, left * sizeof(uint16_t));
}

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
