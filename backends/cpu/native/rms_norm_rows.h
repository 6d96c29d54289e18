/* What every build of the RMSNorm kernel shares (rms_norm.c for AVX-512, rms_norm_avx2.c): the
 * rows split over OpenMP threads, and the ctypes entry points. A build includes this file at its
 * end, having defined
 *   widened_weight(dt, w, w32, plus_one, n)   the weight in fp32 (Gemma's: 1 + w), malloc'ed,
 *                                             ROW_FLOATS(n) long; NULL when out of memory
 *   normalise_row(dt, round_y, x, r, wf, out, r_out, h32, n, eps)   one row
 *   ROW_FLOATS(n)   the floats of a row's fp32 rows (the widened weight, the fused add's scratch)
 *   BF16_ENTRY      1 where the build has a bf16 entry point */

#ifndef CUSTOMOP_RMS_NORM_ROWS_H
#define CUSTOMOP_RMS_NORM_ROWS_H

#include <stdlib.h>

#include "native_common.h"

/* rows of n elements; x_stride / r_stride: elements between rows of x / residual (r NULL: no
 * residual, r_out unused). out and r_out are contiguous [rows, n]. Returns 0, or -1 when out of
 * memory (the outputs then incomplete: the caller runs another path). */
INLINE int run(int dt, int round_y, const uint16_t *x, int64_t x_stride, const uint16_t *r, int64_t r_stride,
               const void *w, int w32, int plus_one, uint16_t *out, uint16_t *r_out, int64_t rows, int64_t n, float eps,
               int threads) {
    float *wf = widened_weight(dt, w, w32, plus_one, n); /* once a call, not once a row */
    if (!wf)
        return -1;
    /* a thread per 32K elements at most (ATen's grain): below ~8x4096 a second thread's start
     * and join cost more than it saves (measured 2.2 vs 4.2 us at 2x4096, 6.2 vs 6.3 at 8x4096) */
    threads = threads_for(threads, rows, rows * n, 32768);
    int failed = 0;
#pragma omp parallel num_threads(threads > 1 ? threads : 1) if (threads > 1) reduction(| : failed)
    {
        float *h32 = r ? malloc(ROW_FLOATS(n) * sizeof(float)) : 0; /* per thread: stays in L1/L2 */
        if (r && !h32)
            failed = 1;
#pragma omp for schedule(static)
        for (int64_t j = 0; j < rows; j++)
            if (!r || h32)
                normalise_row(dt, round_y, x + j * x_stride, r ? r + j * r_stride : 0, wf, out + j * n,
                              r ? r_out + j * n : 0, h32, n, eps);
        free(h32);
    }
    free(wf);
    return failed ? -1 : 0;
}

/* The entry points (ctypes), one per dtype. w32: the weight is fp32 (else x's dtype); plus_one:
 * Gemma's form, the weight applied as 1 + w in fp32. y is rounded to the dtype before the weight
 * multiply exactly when the spec multiplies in x's dtype (a weight of x's dtype, not Gemma): the
 * row loop is compiled for both cases. */
#define ENTRY(name, dt)                                                                                    \
    int name(const uint16_t *x, int64_t x_stride, const uint16_t *r, int64_t r_stride, const void *w,     \
             int w32, int plus_one, uint16_t *out, uint16_t *r_out, int64_t rows, int64_t n, float eps,   \
             int threads) {                                                                               \
        if (w32 || plus_one)                                                                              \
            return run(dt, 0, x, x_stride, r, r_stride, w, w32, plus_one, out, r_out, rows, n, eps, threads); \
        return run(dt, 1, x, x_stride, r, r_stride, w, 0, 0, out, r_out, rows, n, eps, threads);         \
    }

#if BF16_ENTRY
ENTRY(customop_rms_norm_bf16, BF16)
#endif
ENTRY(customop_rms_norm_fp16, FP16)

#endif
