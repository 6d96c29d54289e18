/* What every build of the gated RMSNorm kernel shares (rms_norm_gated.c for AVX-512,
 * rms_norm_gated_avx2.c): where the gate goes and what it computes, the rows split over OpenMP
 * threads, and the ctypes entry points. A build defines, before including this file,
 *   exp_fn            torch's Sleef exp of one vector (a typedef)
 *   SCRATCH_FLOATS(g) the floats of a thread's scratch for groups of g lanes
 *   BF16_ENTRY        1 where the build has a bf16 entry point
 * and, anywhere in the file, gated_weight and gated_group, declared below (inlined into each entry
 * point). */

#ifndef CUSTOMOP_RMS_NORM_GATED_ROWS_H
#define CUSTOMOP_RMS_NORM_GATED_ROWS_H

#include <stdlib.h>

#include "native_common.h"

/* where the gate applies: none (no z), to x before the norm, or to the output after the weight */
enum { NO_GATE = 0, GATE_BEFORE_NORM = 1, GATE_AFTER_NORM = 2 };

/* what the gate computes, as the specs' ATen calls do (e = exp(-z)):
 *   SILU           z / (1 + e)                  (F.silu; RMSNormGated)
 *   SIGMOID        1 / (1 + e)                  (torch.sigmoid)
 *   SWISH_PRODUCT  y * z, then * (1 / (1 + e))  (FusedRMSNormGated's y * g * sigmoid(g): two
 *                                               roundings, after the norm only) */
enum { SILU = 0, SIGMOID = 1, SWISH_PRODUCT = 2 };

/* the lanes of an output chunk when the gate comes after the norm: the chunk's exps are computed
 * into the scratch first (in L1), then its outputs */
#define GATE_CHUNK 256

/* the weight in fp32, malloc'ed (ones where w is NULL: times 1.0 is exact); NULL when out of memory */
INLINE float *gated_weight(int dt, const void *w, int w32, int64_t n);

/* one group of `size` lanes from lane `start` of a row; scratch: SCRATCH_FLOATS(size) floats */
INLINE void gated_group(int dt, int mode, int act, exp_fn vexp, const void *x, const void *z, const float *wf,
                        void *out, float *scratch, int64_t start, int64_t size, float eps);

/* a row's groups with the gate's place and form compiled in, so that the loops do not carry them
 * (measured on AVX2, whose 16 vector registers left the generic loop re-testing them and
 * reloading its constants from the stack every vector) */
INLINE void groups(int dt, int mode, int act, exp_fn vexp, const void *x, const void *z, const float *wf, void *out,
                   float *scratch, int64_t n, int64_t group, float eps) {
    for (int64_t start = 0; start < n; start += group)
        gated_group(dt, mode, act, vexp, x, z, wf, out, scratch, start, group, eps);
}

INLINE void gated_row(int dt, int mode, int act, exp_fn vexp, const void *x, const void *z, const float *wf, void *out,
                      float *scratch, int64_t n, int64_t group, float eps) {
#define GROUPS(mode_, act_) groups(dt, mode_, act_, vexp, x, z, wf, out, scratch, n, group, eps)
    if (mode == NO_GATE)
        GROUPS(NO_GATE, SILU);
    else if (mode == GATE_BEFORE_NORM)
        act == SILU ? GROUPS(GATE_BEFORE_NORM, SILU) : GROUPS(GATE_BEFORE_NORM, SIGMOID);
    else if (act == SILU)
        GROUPS(GATE_AFTER_NORM, SILU);
    else
        act == SIGMOID ? GROUPS(GATE_AFTER_NORM, SIGMOID) : GROUPS(GATE_AFTER_NORM, SWISH_PRODUCT);
#undef GROUPS
}

/* rows of n lanes; x_stride / z_stride: elements between rows of x / z (z NULL: no gate). w: n
 * weights of x's dtype, or fp32 (w32), or NULL (no weight). out: contiguous [rows, n]. Returns 0,
 * or -1 when out of memory (the output then incomplete: the caller runs another path). */
INLINE int run(int dt, const void *x, int64_t x_stride, const void *z, int64_t z_stride, const void *w, int w32,
               void *out, int64_t rows, int64_t n, int64_t group, float eps, int norm_before_gate, int act,
               exp_fn vexp, int threads) {
    float *wf = gated_weight(dt, w, w32, n); /* widened once a call, not once a row */
    if (!wf)
        return -1;
    int mode = !z ? NO_GATE : norm_before_gate ? GATE_AFTER_NORM : GATE_BEFORE_NORM;
    int64_t size = dt == FP32 ? 4 : 2;
    /* a thread per 16K elements at most: the exp makes a row ~3x RMSNorm's work, so a second
     * thread pays from about half RMSNorm's 32K */
    threads = threads_for(threads, rows, rows * n, 16384);
    int failed = 0;
#pragma omp parallel num_threads(threads > 1 ? threads : 1) if (threads > 1) reduction(| : failed)
    {
        float *scratch = malloc(SCRATCH_FLOATS(group) * sizeof(float)); /* per thread: one group, in L1 */
        if (!scratch)
            failed = 1;
#pragma omp for schedule(static)
        for (int64_t j = 0; j < rows; j++)
            if (scratch)
                gated_row(dt, mode, act, vexp, (const char *)x + j * x_stride * size,
                          z ? (const char *)z + j * z_stride * size : 0, wf, (char *)out + j * n * size, scratch, n,
                          group, eps);
        free(scratch);
    }
    free(wf);
    return failed ? -1 : 0;
}

/* The entry points (ctypes), one per dtype; act: SILU, SIGMOID or SWISH_PRODUCT (the last with
 * norm_before_gate only). The row loop is compiled per dtype. */
#define ENTRY(name, dt)                                                                                       \
    int name(const void *x, int64_t x_stride, const void *z, int64_t z_stride, const void *w, int w32, void *out, \
             int64_t rows, int64_t n, int64_t group, float eps, int norm_before_gate, int act, exp_fn vexp,     \
             int threads) {                                                                                  \
        return run(dt, x, x_stride, z, z_stride, w, w32, out, rows, n, group, eps, norm_before_gate, act, vexp, \
                   threads);                                                                                 \
    }

#if BF16_ENTRY
ENTRY(customop_rms_norm_gated_bf16, BF16)
#endif
ENTRY(customop_rms_norm_gated_fp16, FP16)
ENTRY(customop_rms_norm_gated_fp32, FP32)

#endif
