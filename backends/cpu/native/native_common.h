/* What every hand-written CPU kernel shares, whatever its instruction set (avx512_common.h for
 * rms_norm.c and rms_norm_gated.c, rms_norm_avx2.c): the dtype codes and the threads a call uses. */

#ifndef CUSTOMOP_NATIVE_COMMON_H
#define CUSTOMOP_NATIVE_COMMON_H

#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))

enum { BF16 = 0, FP16 = 1, FP32 = 2 }; /* fp32: rms_norm_gated.c only (nothing to round) */

/* The threads a call of `rows` rows and `elems` elements uses: at most `threads`, one per `grain`
 * elements (a second thread's start and join cost more than it saves below that) and one per row. */
INLINE int threads_for(int threads, int64_t rows, int64_t elems, int64_t grain) {
    int64_t most = elems / grain;
    if (threads > most)
        threads = most > 1 ? (int)most : 1;
    if (threads > rows)
        threads = (int)rows;
    return threads;
}

#endif
