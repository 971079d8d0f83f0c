/* Two builds of a micro-kernel's tile_matmul2 in one process, no MoE driver around them:
 * kernel_ab.sh says how to run it.  Each round times a batch of calls of each build, the first
 * one alternating; it prints each build's median time per tile pair and the median of the per-round
 * ratios new / old.  hot: one tile pair, calls after calls (codes in L1/L2: the loops' own speed);
 * dram: a walk over 4x the L3, at least 256 MiB, of tile pairs (in huge pages, as the package's
 * experts), each call's w_next the next pair, as the driver sets it.  Per-channel scales, or
 * block-wise ones with --block-k.
 * Before timing each m it checks that the two builds agree on one call (exit status 1 if not): a
 * faster build with wrong sums is no A/B.  --timing-only leaves the check out, for taking a piece
 * out of a kernel to see what it costs (docs/tuning-notes.md, "What a 49..80-token tile pair spends
 * its time on"). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "ktfp8/abi.h"
#include "ktfp8/cpu_features.h"
#include "ktfp8/moe.h"

void kernel_old(const ktfp8_tile_job *, const ktfp8_tile_job *);
void kernel_new(const ktfp8_tile_job *, const ktfp8_tile_job *);
const ktfp8_moe_kernel *kernel_old_table(void);
const ktfp8_moe_kernel *kernel_new_table(void);

#define ROUNDS 15
#define NB 16 /* rows per tile */
#define MAX_M 128 /* tokens per call at most (T = 512 on the benchmark layer gives experts 50-80) */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int by_value(const void *x, const void *y) {
    const double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

static double median(double *v, int n) {
    qsort(v, n, sizeof(double), by_value);
    return v[n / 2];
}

/* What a build's calls kept for the next one (amx: its tile configuration), let go before the other
 * build runs, as the driver lets go after a forward's last call (kernel.release). */
static void release(const ktfp8_moe_kernel *table) {
    if (table->release) table->release();
}

/* Both builds on the same tile pair, into outputs of their own: whether every output of new lies within
 * AGREE_TOL of the largest |old| output (the builds may sum K in different orders, so not bit for bit;
 * with K up to a few thousand FP32 terms the rounding differences stay below 1e-5 of it). */
#define AGREE_TOL 1e-4
static int builds_agree(void (*const build[2])(const ktfp8_tile_job *, const ktfp8_tile_job *),
                        const ktfp8_moe_kernel *const table[2], ktfp8_tile_job j0, ktfp8_tile_job j1, float *out[2][2],
                        int m) {
    for (int b = 0; b < 2; b++) {
        j0.c = out[b][0];
        j1.c = out[b][1];
        build[b](&j0, &j1);
        release(table[b]);
    }
    double biggest = 0, worst = 0;
    for (int w = 0; w < 2; w++)
        for (int i = 0; i < m * NB; i++) {
            const double old_v = out[0][w][i], diff = fabs((double)out[1][w][i] - old_v);
            if (fabs(old_v) > biggest) biggest = fabs(old_v);
            if (isnan(diff)) worst = INFINITY; /* a NaN in either build never agrees */
            else if (diff > worst) worst = diff;
        }
    if (worst <= AGREE_TOL * biggest) return 1;
    fprintf(stderr, "kernel_ab: m = %d: the builds disagree (max |new - old| %g, max |old| %g)\n", m, worst, biggest);
    return 0;
}

/* bytes rounded up to a whole number of `align` (a power of two), from an address aligned so; exits
 * when memory runs out. */
static void *alloc_aligned(size_t align, size_t bytes) {
    void *p = aligned_alloc(align, (bytes + align - 1) & ~(align - 1));
    if (!p) {
        fprintf(stderr, "kernel_ab: out of memory\n");
        exit(1);
    }
    return p;
}

static void *alloc64(size_t bytes) { return alloc_aligned(64, bytes); }

/* The weights' buffer, in transparent huge pages where Linux gives them to a program that asks, as
 * the package's packed experts are (ktfp8/pages.py): advised before the first touch. */
#define HUGE_PAGE_BYTES ((size_t)2 << 20)
static void *alloc_stream(size_t bytes) {
    const size_t whole = (bytes + HUGE_PAGE_BYTES - 1) & ~(HUGE_PAGE_BYTES - 1);
    void *p = alloc_aligned(HUGE_PAGE_BYTES, whole);
#ifdef MADV_HUGEPAGE
    madvise(p, whole, MADV_HUGEPAGE); /* refused where THP is off: then 4 KiB pages, as the package gets */
#endif
    return p;
}

/* The dram walk for an L3 of l3 bytes: WALK_L3_MULTIPLE x it, as python -m ktfp8.bench walks its
 * layers, and at least WALK_MIN_BYTES.  256 MiB alone lay within the Emerald Rapids VM's 300 MiB L3:
 * there K = 2048, m = 64 took 5.5-6.8 us a tile pair (the L3 being shared, it varied), against 7.1 us
 * over 1.5 GiB. */
#define WALK_MIN_BYTES ((size_t)256 << 20)
#define WALK_L3_MULTIPLE 4
static size_t walk_bytes(long l3) {
    const size_t walk = l3 > 0 ? WALK_L3_MULTIPLE * (size_t)l3 : 0;
    return walk > WALK_MIN_BYTES ? walk : WALK_MIN_BYTES;
}

/* Random FP8 codes of both signs, finite (bit 3 clear: never the NaN codes 0x7F / 0xFF): xorshift64,
 * eight codes a step, as rand() a byte took seconds for a walk of a gigabyte.  (The codes were rand()
 * & 0x77 before, all positive.) */
static void random_codes(uint8_t *w, size_t n) {
    uint64_t x = 0x9E3779B97F4A7C15u;
    for (size_t i = 0; i < n; i += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        const uint64_t codes = x & 0xF7F7F7F7F7F7F7F7u;
        memcpy(w + i, &codes, n - i < 8 ? n - i : 8);
    }
}

int main(int argc, char **argv) {
    /* --block-k N: block-wise scales, a K block of N per scale (per-channel otherwise);
     * --timing-only: no agreement check, for a copy with a piece taken out to time what it costs */
    const char *program = argv[0];
    int64_t block_k = 0;
    int block_k_ok = 1, timing_only = 0;
    for (;;) {
        if (argc > 2 && !strcmp(argv[1], "--block-k")) {
            block_k = atoll(argv[2]);
            block_k_ok = block_k > 0 && block_k % 2 == 0;
            argv += 2;
            argc -= 2;
        } else if (argc > 1 && !strcmp(argv[1], "--timing-only")) {
            timing_only = 1;
            argv += 1;
            argc -= 1;
        } else {
            break;
        }
    }
    if (argc < 4 || (strcmp(argv[1], "hot") && strcmp(argv[1], "dram")) || atoll(argv[2]) <= 0 || atoll(argv[2]) % 4 ||
        !block_k_ok) {
        fprintf(stderr, "usage: %s [--block-k N] [--timing-only] hot|dram K m [m ...]   (K a positive multiple of 4, "
                        "N a positive even number, 1 <= m <= %d)\n", program, MAX_M);
        return 2;
    }
    if (timing_only) printf("timing only: the two builds' results are not compared\n");
    /* Linux's per-process permission for AMX tile data; refused on a CPU or kernel without AMX,
     * where only the register kernel can run anyway */
    ktfp8_amx_permission();
    const int dram = argv[1][0] == 'd';
    const int64_t k = atoll(argv[2]), tile = k * NB; /* FP8 code bytes of one tile */
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE); /* glibc, from CPUID; 0 or -1 where unknown */
    const size_t walk = walk_bytes(l3), pairs = dram ? walk / (2 * tile) : 1;
    if (dram) printf("dram: a walk of %zu MiB (L3 %ld KiB)\n", walk >> 20, l3 >> 10);
    uint8_t *w = alloc_stream(pairs * 2 * tile);
    random_codes(w, pairs * 2 * tile);
    const int64_t n_kblocks = block_k ? (k + block_k - 1) / block_k : 1;
    float *scale = alloc64(n_kblocks * NB * sizeof(float)), *c0 = alloc64(MAX_M * NB * sizeof(float)),
          *c1 = alloc64(MAX_M * NB * sizeof(float));
    for (int i = 0; i < n_kblocks * NB; i++) scale[i] = 0.5f + (float)(rand() % 64) / 32; /* a lost scale shows */
    /* the activations as the kernels read them: both builds must agree on what that is */
    const ktfp8_moe_kernel *table[2] = {kernel_old_table(), kernel_new_table()};
    if (table[0]->act_dtype != table[1]->act_dtype || table[0]->layout.act_exp != table[1]->layout.act_exp) {
        fprintf(stderr, "kernel_ab: the builds read different activations (act_dtype %d / %d, act_exp %d / %d)\n",
                table[0]->act_dtype, table[1]->act_dtype, table[0]->layout.act_exp, table[1]->layout.act_exp);
        return 2;
    }
    const int f32 = table[0]->act_dtype == KTFP8_F32;
    const size_t act_bytes = f32 ? sizeof(float) : sizeof(uint16_t);
    /* activation rows as the driver lays them out: an odd number of lines apart (ktfp8_row_stride) */
    const int64_t line = 64 / (int64_t)act_bytes, a_stride = ktfp8_row_stride((k + line - 1) / line * line, act_bytes);
    void *a = alloc64(MAX_M * a_stride * act_bytes);
    for (int64_t i = 0; i < MAX_M * a_stride; i++) { /* both signs, 0.5 to 4: a wrong row shows */
        const uint16_t bf16 = (uint16_t)(0x3f00 + (rand() & 0x17f) + ((rand() & 1) << 15));
        if (f32) { /* the same values as fp32, times 2^act_exp as the driver hands them over */
            const uint32_t bits = (uint32_t)bf16 << 16;
            float v;
            memcpy(&v, &bits, sizeof v);
            ((float *)a)[i] = ldexpf(v, table[0]->layout.act_exp);
        } else {
            ((uint16_t *)a)[i] = bf16;
        }
    }
    float *agree_out[2][2];
    for (int b = 0; b < 2; b++)
        for (int w = 0; w < 2; w++) agree_out[b][w] = alloc64(MAX_M * NB * sizeof(float));
    size_t scratch_bytes = 64; /* what either build asks for (tile_matmul2's scratch is the first job's) */
    for (int b = 0; b < 2; b++)
        if (table[b]->tile_scratch_bytes && table[b]->tile_scratch_bytes(k) > scratch_bytes)
            scratch_bytes = table[b]->tile_scratch_bytes(k);
    void *scratch = alloc64(scratch_bytes);
    void (*const build[2])(const ktfp8_tile_job *, const ktfp8_tile_job *) = {kernel_old, kernel_new};
    for (int arg = 3; arg < argc; arg++) {
        const int m = atoi(argv[arg]);
        if (m < 1 || m > MAX_M) {
            fprintf(stderr, "kernel_ab: m must lie in 1..%d, not %s\n", MAX_M, argv[arg]);
            return 2;
        }
        ktfp8_tile_job j0;
        memset(&j0, 0, sizeof j0);
        j0.format = block_k ? KTFP8_FMT_FP8_BLOCK : KTFP8_FMT_FP8_CHANNEL;
        j0.k = k;
        j0.block_k = block_k;
        j0.n_kblocks = n_kblocks;
        j0.a = a;
        j0.a_stride = a_stride;
        j0.act_dtype = table[0]->act_dtype;
        j0.m = m;
        j0.c_stride = NB;
        j0.scratch = scratch;
        j0.scale = scale;
        ktfp8_tile_job j1 = j0;
        j0.c = c0;
        j1.c = c1;
        j0.w = w;
        j1.w = w + tile;
        if (!timing_only && !builds_agree(build, table, j0, j1, agree_out, m)) return 1;
        const size_t calls = dram ? pairs : 4000 / m + 100;
        double seconds[2][ROUNDS], ratio[ROUNDS];
        size_t pos = 0;
        for (int r = 0; r < ROUNDS; r++) {
            for (int s = 0; s < 2; s++) {
                const int b = (s + r) & 1;
                const double t0 = now();
                for (size_t i = 0; i < calls; i++, pos++) {
                    const size_t p = pos % pairs, next = (pos + 1) % pairs;
                    j0.w = w + 2 * tile * p;
                    j1.w = w + 2 * tile * p + tile;
                    j0.w_next = w + 2 * tile * next;
                    j1.w_next = w + 2 * tile * next + tile;
                    build[b](&j0, &j1);
                }
                release(table[b]);
                seconds[b][r] = (now() - t0) / calls;
            }
            ratio[r] = seconds[1][r] / seconds[0][r];
        }
        const double old_s = median(seconds[0], ROUNDS), new_s = median(seconds[1], ROUNDS), flop = 4.0 * m * tile;
        printf("%s%s K=%ld m=%2d: old %7.3f us  new %7.3f us per tile pair (%5.0f / %5.0f GFLOP/s)  new/old %.3f\n",
               argv[1], block_k ? " block-wise" : "", (long)k, m, old_s * 1e6, new_s * 1e6, flop / old_s / 1e9, flop / new_s / 1e9,
               median(ratio, ROUNDS));
    }
    return 0;
}
