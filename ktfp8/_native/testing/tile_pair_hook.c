/* Test hook: one pair of micro-kernel jobs of a variant, native or emulated (same activations, K and
 * format; their own weights, scales and outputs), run through tile_matmul2 or as two tile_matmul
 * calls, so that the test suite can check the two give the same bits (tests/test_tile_pair.py):
 * a paired kernel must sum each output exactly as its one-tile path.  Baseline code: it only
 * calls through the variant's table.  The caller checks that this CPU runs the variant. */
#include <stdlib.h>
#include <string.h>

#include "ktfp8/dispatch.h"

enum { GUARD = 64, GUARD_BYTE = 0xA5 }; /* bytes, at least, checked behind the scratch */

/* w, scale, c: the two jobs' buffers; *_bytes their sizes, checked against what the jobs read and
 * write.  Returns 0; -1: a shape / buffer the jobs do not fit; -2: the kernel
 * wrote past tile_scratch_bytes(k); -3: out of memory. */
int ktfp8_testing_tile_pair(const ktfp8_variant *variant, int paired, int format, int64_t k, int64_t block_k,
                            int64_t n_kblocks, const void *const w[2], const size_t w_bytes[2],
                            const float *const scale[2], const size_t scale_bytes[2], const void *a,
                            size_t a_bytes, int64_t a_stride, int64_t m, float *const c[2],
                            const size_t c_bytes[2]) {
    const ktfp8_moe_kernel *kern = variant->moe;
    if (k <= 0 || k % KTFP8_K_ALIGN || m <= 0 || a_stride < k) return -1;
    if (format == KTFP8_FMT_FP8_BLOCK && (block_k <= 0 || block_k % 2 || n_kblocks <= 0 ||
                                          (n_kblocks - 1) * block_k >= k))
        return -1;
    if (format != KTFP8_FMT_FP8_BLOCK && format != KTFP8_FMT_FP8_CHANNEL && format != KTFP8_FMT_BF16) return -1;
    const size_t nb = (size_t)kern->layout.rows_per_tile, esz = kern->act_dtype == KTFP8_F32 ? 4 : 2;
    const size_t need_w = (size_t)k * nb * (format == KTFP8_FMT_BF16 ? 2 : 1);
    const size_t need_s = sizeof(float) * nb * (format == KTFP8_FMT_FP8_BLOCK ? (size_t)n_kblocks : 1);
    /* the rows a kernel may read: past row_pad of them, up to a whole tile (layout.row_pad) */
    const int64_t row_pad = kern->layout.row_pad > 1 ? kern->layout.row_pad : 1;
    const int64_t rows = m > row_pad ? (m + row_pad - 1) / row_pad * row_pad : m;
    if (a_bytes < esz * (size_t)((rows - 1) * a_stride + k)) return -1;
    for (int t = 0; t < 2; t++)
        if (w_bytes[t] < need_w || scale_bytes[t] < need_s || c_bytes[t] < sizeof(float) * nb * (size_t)m) return -1;

    /* as much again behind the declared scratch, filled with GUARD_BYTE: a kernel that needs up to
     * twice what it declares (one tile declared, two converted) is reported, not a heap overrun */
    const size_t scratch_bytes = kern->tile_scratch_bytes ? kern->tile_scratch_bytes(k) : 0;
    const size_t alloc = (2 * scratch_bytes + GUARD + 63) / 64 * 64;
    unsigned char *scratch = aligned_alloc(64, alloc);
    if (!scratch) return -3;
    memset(scratch + scratch_bytes, GUARD_BYTE, alloc - scratch_bytes);
    ktfp8_tile_job job[2];
    for (int t = 0; t < 2; t++) {
        memset(&job[t], 0, sizeof(job[t]));
        job[t].w = w[t];
        job[t].scale = scale[t];
        job[t].format = format;
        job[t].k = k;
        job[t].block_k = block_k;
        job[t].n_kblocks = n_kblocks;
        job[t].a = a;
        job[t].a_stride = a_stride;
        job[t].act_dtype = kern->act_dtype;
        job[t].m = m;
        job[t].c = c[t];
        job[t].c_stride = (int64_t)nb;
        job[t].scratch = scratch;
    }
    if (paired && kern->tile_matmul2) {
        kern->tile_matmul2(&job[0], &job[1]);
    } else {
        kern->tile_matmul(&job[0]);
        kern->tile_matmul(&job[1]);
    }
    if (kern->release) kern->release();
    int rc = 0;
    for (size_t i = scratch_bytes; i < alloc; i++) rc |= scratch[i] != GUARD_BYTE;
    free(scratch);
    return rc ? -2 : 0;
}
