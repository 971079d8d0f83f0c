/* FP8 codec driver: the array, row and block walks shared by every codec variant (fp8_codec.h). */
#include "ktfp8/fp8_codec.h"
#include "ktfp8/fp8.h"
#include "ktfp8/fpenv.h"
#include "ktfp8/team.h"

#include <float.h>

/* Encode / decode split flat arrays into runs of this many values: big enough that a run costs
 * far more than handing it to a thread, small enough to balance two to a few dozen threads.
 * Work is handed out dynamically, a run (or ~RUN values of rows) at a time, so a thread whose core
 * is busy with another process does not hold the others up; results never depend on the schedule. */
#define RUN 65536

/* tasks per dynamic chunk when one task covers `per_task` values */
static int chunk_of(int64_t per_task) { return per_task >= RUN ? 1 : (int)(RUN / per_task); }

static size_t elem_size(int dtype) { return dtype == KTFP8_F32 ? 4 : 2; }

static const void *at(const void *base, int dtype, int64_t i) {
    return (const char *)base + (size_t)i * elem_size(dtype);
}

float ktfp8_scale_from_amax(float amax) {
    if (!(amax > 0.0f)) return 1.0f;
    float scale = amax / KTFP8_E4M3_MAX;
    return scale > 0.0f ? scale : FLT_TRUE_MIN;
}

void ktfp8_encode(const ktfp8_codec_ops *ops, const void *src, int dtype, int64_t n, uint8_t *codes,
                  int threads) {
    const int64_t runs = (n + RUN - 1) / RUN;
#pragma omp parallel num_threads(ktfp8_team_size(threads)) if (threads > 1 && runs > 1)
    {
        const unsigned csr = ktfp8_fpenv_ieee();
#pragma omp for schedule(dynamic)
        for (int64_t r = 0; r < runs; r++) {
            const int64_t i = r * RUN, len = n - i < RUN ? n - i : RUN;
            ops->quantize(at(src, dtype, i), dtype, (size_t)len, 1.0f, codes + i);
        }
        ktfp8_fpenv_restore(csr);
    }
}

void ktfp8_decode(const ktfp8_codec_ops *ops, const uint8_t *codes, int64_t n, void *dst, int dtype,
                  int threads) {
    const int64_t runs = (n + RUN - 1) / RUN;
#pragma omp parallel num_threads(ktfp8_team_size(threads)) if (threads > 1 && runs > 1)
    {
        const unsigned csr = ktfp8_fpenv_ieee();
#pragma omp for schedule(dynamic)
        for (int64_t r = 0; r < runs; r++) {
            const int64_t i = r * RUN, len = n - i < RUN ? n - i : RUN;
            ops->dequantize(codes + i, (size_t)len, 1.0f, (void *)at(dst, dtype, i), dtype);
        }
        ktfp8_fpenv_restore(csr);
    }
}

/* One task is one block row (bn rows of one matrix): for each block of it, the amax pass and the
 * quantize pass run back to back, so the block is still in cache for the second pass (for
 * per-channel, bn = 1, that is one row). */
void ktfp8_quantize_blocks(const ktfp8_codec_ops *ops, const void *src, int dtype, int64_t mats,
                           int64_t rows, int64_t cols, int64_t bn, int64_t bk, uint8_t *codes,
                           float *scale, int threads) {
    const int64_t n_rb = (rows + bn - 1) / bn, n_cb = (cols + bk - 1) / bk, tasks = mats * n_rb;
    const int chunk = chunk_of(bn * cols);
#pragma omp parallel num_threads(ktfp8_team_size(threads)) if (threads > 1 && tasks > 1)
    {
        const unsigned csr = ktfp8_fpenv_ieee();
#pragma omp for schedule(dynamic, chunk)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t m = t / n_rb, r0 = (t % n_rb) * bn, r1 = r0 + bn < rows ? r0 + bn : rows;
            for (int64_t cb = 0; cb < n_cb; cb++) {
                const int64_t c0 = cb * bk, len = cols - c0 < bk ? cols - c0 : bk;
                float amax = 0.0f;
                for (int64_t r = r0; r < r1; r++) {
                    float a = ops->amax(at(src, dtype, (m * rows + r) * cols + c0), dtype, (size_t)len);
                    if (a > amax) amax = a;
                }
                const float s = ktfp8_scale_from_amax(amax);
                scale[t * n_cb + cb] = s;
                for (int64_t r = r0; r < r1; r++) {
                    const int64_t i = (m * rows + r) * cols + c0;
                    ops->quantize(at(src, dtype, i), dtype, (size_t)len, s, codes + i);
                }
            }
        }
        ktfp8_fpenv_restore(csr);
    }
}

void ktfp8_dequantize_blocks(const ktfp8_codec_ops *ops, const uint8_t *codes, int64_t mats,
                             int64_t rows, int64_t cols, int64_t bn, int64_t bk, const float *scale,
                             void *dst, int dtype, int threads) {
    const int64_t n_rb = (rows + bn - 1) / bn, n_cb = (cols + bk - 1) / bk, tasks = mats * n_rb;
    const int chunk = chunk_of(bn * cols);
#pragma omp parallel num_threads(ktfp8_team_size(threads)) if (threads > 1 && tasks > 1)
    {
        const unsigned csr = ktfp8_fpenv_ieee();
#pragma omp for schedule(dynamic, chunk)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t m = t / n_rb, r0 = (t % n_rb) * bn, r1 = r0 + bn < rows ? r0 + bn : rows;
            for (int64_t r = r0; r < r1; r++)
                for (int64_t cb = 0; cb < n_cb; cb++) {
                    const int64_t c0 = cb * bk, len = cols - c0 < bk ? cols - c0 : bk;
                    const int64_t i = (m * rows + r) * cols + c0;
                    ops->dequantize(codes + i, (size_t)len, scale[t * n_cb + cb], (void *)at(dst, dtype, i), dtype);
                }
        }
        ktfp8_fpenv_restore(csr);
    }
}
