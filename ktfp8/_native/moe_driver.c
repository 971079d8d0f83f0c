/* The MoE forward, shared by every variant.  Only tile_matmul is ISA code.
 *
 * Experts first: the (token, slot) pairs are counting-sorted by expert, so each active expert's
 * weights stream from memory once per call whatever T is.  One parallel region, two phases:
 *   1. items (expert, intermediate tile): the expert's token rows gathered into the thread's buffer
 *      in the activation dtype, zero padded to K, where its items start on that thread
 *      (gather_expert); gate and up tiles over all of the expert's tokens, then h = act(g) * u in
 *      FP32, rounded once to the activation dtype for the down projection;
 *   2. items (hidden tile, or two adjacent ones when the kernel has tile_matmul2), handed out in
 *      groups of adjacent items (of one token block's tokens: a long call's phase 2 runs in token
 *      blocks, phase2_block_tokens): for every active expert in id order, for every item of the
 *      group,
 *      z = h @ down_tile^T, and y[token] += weight * z, accumulated in FP32 in a contiguous
 *      [block's tokens][group x DW x NB] block of the thread (y's own rows are H floats apart: one
 *      page per token) and written to y once.  Two tiles per item give the kernel two weight streams over
 *      the same h rows (AMX: 2 A x 2 B -> 4 C tiles, as for gate and up); a group makes each
 *      expert's read one contiguous run of tiles and reuses its h rows from cache (group_size).
 *      Each group owns its tokens x columns of y and visits the experts of each in id order, so no
 *      atomics are needed and the result does not depend on the thread count or the schedule.
 * Kernels whose FP8 conversion leaves the weights times a power of two (layout.act_exp) get x and h
 * times its inverse: phase 1 scales the rows as it gathers them, and a pass after phase 1 scales h,
 * each by 2^act_exp unless the call's largest finite value would then overflow (activation_exp).
 * Each job names the tile its thread runs next (w_next), so that the kernel's software prefetch runs
 * on from one tile into the next as one stream (prefetch_ahead.h).
 * Buffers come from per-thread arenas (arena.h): no allocation and no zeroing in the hot path;
 * only the K padding of the gathered rows and of h is written with zeros, as the kernels read it,
 * and for a kernel that reads whole tiles of rows (layout.row_pad) the rows after an expert's that
 * hold nothing yet (gather_expert) and those after the last pair's row of h, where an expert has
 * more than a tile of pairs. */
#include <float.h>
#include <math.h>

#include "ktfp8/arena.h"
#include "ktfp8/cpu_features.h"
#include "ktfp8/fp8.h"
#include "ktfp8/fpenv.h"
#include "ktfp8/moe.h"
#include "ktfp8/moe_epilogue.h"
#include "ktfp8/team.h"

#define ALIGN64(x) (((x) + 63) & ~(size_t)63)
#define INLINE static inline __attribute__((always_inline))

/* Runs per thread of phase 1 (phase 2 takes half as many, below): the items are handed out in runs
 * (dynamic schedule, chunk items / (this x threads)).  Consecutive items are adjacent tiles of one
 * expert (phase 1) or adjacent column tiles (phase 2), so a run reads each expert's weights as one
 * stream that the hardware prefetcher follows across tile boundaries; single items alternated
 * between threads, restarting it at every tile.  Runs this short still balance prefill's uneven
 * experts and a thread that shares its core.  Measured on Zen 3 (benchmark layer, weights from
 * DRAM, 2 threads, the old and new schedule alternated in one process; HEAD_LINES below was in the
 * source but, as it turned out later, not in the machine code), time
 * against single items: T = 1 0.94x (0.80x in a slow minute of the VM's memory), T = 64 0.98x,
 * T = 512 0.98x; T = 1 with another process spinning on one of the two cores 0.67x.  Runs of
 * items / 2 .. items / 64 were within the noise of each other.
 * One thread has nothing to balance, so it takes phase 1 as one run and each phase-2 token block as
 * one group (as far as its accumulator fits, group_size): its weight stream then starts cold once a
 * phase, not at every run's start (COLD_HEAD_BYTES).  Measured on the Zen 4 VM (tools/ab_builds.py,
 * benchmark layer, 1 thread, new / old, and in brackets old / new with the builds' places swapped):
 * T = 1 0.999x and 0.995x (150 rounds; 1.016x, 1.007x), T = 4 0.993x (1.016x), T = 64 0.991x
 * (1.007x), T = 512 0.999x. */
#define RUNS_PER_THREAD 8
/* Phase 2 takes its runs of items as groups, experts outer, items inner.  Items inner (one item at a
 * time, every expert for it) read each expert's down weights as a tile here and a tile there, and
 * all of h once per item; experts outer read each expert's tiles of the group as one stream and its
 * h rows once per group.  The price is the thread's y accumulator, T x group x DW x NB floats, which
 * stays within half the L2 (group_acc_bytes), so long prefills fall back to single items.
 * Measured on Zen 3 (L2 512 KiB; benchmark layer, 2 threads, weights from DRAM, group 8 against
 * single items in one process): T = 1 0.92-0.95x the time (1 thread 0.96x), T = 8 0.96x, T = 64
 * 0.99x, T = 512 0.86x; 16 and 32 items no better than 8 at T = 1.
 * A group is a run of PHASE2_RUNS_PER_THREAD per thread, half as many runs as phase 1 takes: every
 * group visits every active expert for the same columns, so its runs cost the same and fewer of them
 * still balance, where phase 1's items cost what their expert's token count says.  At T = 512 that
 * halves how often all of h (6 MiB on the benchmark layer, past L2) is read again.  Measured on the
 * Intel Xeon VM with AMX (L2 2 MiB: an accumulator of up to 1 MiB; 2 down tiles per item), these
 * rules against 8 runs per thread and 256 KiB (tools/ab_builds.py, benchmark layer, 2 threads, FP8
 * per-channel unless said): T = 512 0.93x-1.01x in six runs (median 0.95x; 1 thread 0.93x and
 * 0.95x), T = 256 0.92x-1.02x (three runs), T = 128 0.97x-1.07x (three), T = 64 0.99x-1.01x, T = 16
 * 0.97x, T = 1 0.97x-1.00x; T = 512 on BF16 weights 0.99x, block-wise 1.01x.  A quarter as many runs
 * as phase 1 (16 items, 16 down tiles a group at T = 512): 1.02x the time of half as many. */
#define PHASE2_RUNS_PER_THREAD 4
/* Most token blocks phase 2 cuts a call into (phase2_block_tokens). */
#define PHASE2_MAX_BLOCKS 32
/* Lines of a job's weights requested into L1 before the kernel runs it, with its scales (read after
 * the K loop).  Mostly lines the previous tile's prefetch already brought (w_next), so cheap; they
 * matter where a stream starts (COLD_HEAD_BYTES below).  Until 2026-12-06 GCC compiled these out
 * (prefetch_tile says why), so the figures measured for them before then, 32 lines no better than
 * 8 among them, timed nothing.  Since: tools/ab_builds.py on the Zen 4 VM, with them against without
 * (both with the cold heads), and in brackets without against with, the builds' places swapped:
 * T = 1 on 1 thread 0.991x and 1.000x (150 rounds; 1.015x, 1.004x), on 2 threads 0.991x (1.001x),
 * T = 4 0.999x (1.004x), T = 64 0.997x (1.017x), T = 512 1.012x (1.034x). */
#define HEAD_LINES 8
/* Bytes of each half of a tile asked for into L2 where a thread's weight stream starts cold: a run's
 * first item in phase 1, a group's first in phase 2 (within a run or group, w_next carries the stream
 * on).  The kernels prefetch a fixed distance ahead of what they read, so a stream's first distance
 * would otherwise come on demand and through the few L1 prefetches, and avx512_bf16 (amx's few-token
 * path too) reads a tile's K halves as two streams (decode_halves); a kernel that reads a tile as one
 * stream finds its second half's head in L2 when it gets there.  Measured on the Zen 4 VM (rdtsc
 * around each kernel call, benchmark layer, T = 1, 1 thread, the heads' requests inside the timed
 * span; HEAD_LINES not yet in the machine code): an expert's first phase-1 tile pair took 3680-3770
 * TSC ticks (1.4 us) more than the tile pairs after it without them, 2090-2250 with (five runs; a
 * sixth 3280); heads of 2 KiB 2500-3530, 8 KiB 2220-2320, 16 KiB 2480-2590.  A phase-2 group's first
 * item: 2780-2890 more without, 1760-2240 with.  tools/ab_builds.py new / old, and in brackets old /
 * new with the builds' places swapped (an A/A read 0.975x-1.004x): T = 1 on 1 thread 0.994x, 0.994x
 * (150 rounds; 1.015x, 1.007x), on 2 threads 0.999x, 0.996x (1.003x, 1.009x; the bus the limit
 * there); T = 4 0.998x on 1 and 2 threads (1.007x, 1.006x); T = 64 1.004x (1.023x); T = 512 0.992x
 * (0.989x). */
#define COLD_HEAD_BYTES 4096

/* Pairs grouped by expert, and the buffers of one call, carved from the caller's arena. */
typedef struct call_buffers {
    int64_t *offset;       /* [E + 1]: pairs of expert e are offset[e] .. offset[e + 1] - 1 */
    int64_t *active;       /* [n_active] expert ids with at least one pair, ascending */
    int64_t *fill;         /* [E] counting-sort cursor */
    int64_t *pair_token;   /* [n_pairs] */
    float *pair_weight;    /* [n_pairs] */
    void *h;               /* [n_pairs][h_stride] act(gate) * up, activation dtype, K padded to Ip */
    int64_t *block_start;  /* [n_blocks + 1][n_active]: first pair of active expert a whose token is in
                            * phase-2 token block tb or later (block_starts) */
    int64_t x_stride, h_stride; /* elements: of a gathered token row (gather_expert) and of h */
    int64_t n_pairs, n_active, max_m;
    int64_t block_tokens, n_blocks; /* phase 2's token blocks (phase2_block_tokens) */
} call_buffers;

/* What phase 2's token blocks are chosen by (phase2_block_tokens). */
typedef struct phase2_shape {
    int64_t items, item_cols; /* phase-2 items of one token block, y columns per item */
    double expert_bytes;      /* one expert's packed down weights and scales */
    double h_row_bytes;       /* one pair's row of h */
} phase2_shape;

/* Pairs with an expert (ids >= 0), or EINVAL on an id >= E. */
static int64_t routed_pairs(const ktfp8_moe_call *c) {
    const int64_t E = c->shape->experts, n = c->tokens * c->top_k;
    int64_t routed = 0;
    for (int64_t i = 0; i < n; i++) {
        if (c->topk_ids[i] >= E) return KTFP8_EINVAL;
        routed += c->topk_ids[i] >= 0;
    }
    return routed;
}

/* Router weight i of the call, as a float (a bfloat16 one widened exactly). */
static float topk_weight(const ktfp8_moe_call *c, int64_t i) {
    if (c->weights_dtype == KTFP8_BF16) return ktfp8_bf16_to_f32(((const uint16_t *)c->topk_weights)[i]);
    return ((const float *)c->topk_weights)[i];
}

/* Counting sort of the (token, slot) pairs by expert, stable in (token, slot) order. */
static void group_pairs(const ktfp8_moe_call *c, call_buffers *b) {
    const int64_t E = c->shape->experts, n = c->tokens * c->top_k;
    memset(b->offset, 0, sizeof(int64_t) * (size_t)(E + 1));
    for (int64_t i = 0; i < n; i++)
        if (c->topk_ids[i] >= 0) b->offset[c->topk_ids[i] + 1]++;
    b->n_active = b->max_m = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t m = b->offset[e + 1];
        if (m > 0) b->active[b->n_active++] = e;
        if (m > b->max_m) b->max_m = m;
        b->offset[e + 1] += b->offset[e];
    }
    memcpy(b->fill, b->offset, sizeof(int64_t) * (size_t)E);
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = c->topk_ids[i];
        if (id < 0) continue;
        const int64_t at = b->fill[id]++;
        b->pair_token[at] = i / c->top_k;
        b->pair_weight[at] = topk_weight(c, i);
    }
}

/* block_start for every active expert: its pairs are in token order (group_pairs is stable), so each
 * token block's pairs of an expert are one run of them. */
static void block_starts(call_buffers *b) {
    for (int64_t a = 0; a < b->n_active; a++) {
        const int64_t e = b->active[a], end = b->offset[e + 1];
        int64_t q = b->offset[e];
        for (int64_t tb = 0; tb <= b->n_blocks; tb++) {
            while (q < end && b->pair_token[q] < tb * b->block_tokens) q++;
            b->block_start[tb * b->n_active + a] = tb == b->n_blocks ? end : q;
        }
    }
}

/* Carves every per-call buffer out of one arena allocation, groups the pairs and finds where each
 * phase-2 token block of block_tokens tokens starts in each expert's pairs.  h has room for
 * row_pad - 1 rows after the last pair's: a kernel that reads row_pad rows at a time
 * (layout.row_pad) may read that far past an expert's rows of more than row_pad pairs.  They are
 * zeroed only where some expert has that many: at decode (no expert past 16 pairs) zeroing them
 * took 0.3-1.0 % of an amx call on the benchmark layer (15 rows of h and of the gathered x rows,
 * then a call buffer too: 86 KB). */
static int prepare_call(const ktfp8_moe_call *c, int64_t Hp, int64_t Ip, size_t esz, int64_t row_pad,
                        int64_t block_tokens, call_buffers *b) {
    const int64_t E = c->shape->experts;
    const int64_t routed = routed_pairs(c);
    if (routed < 0) return (int)routed;
    const size_t n = (size_t)routed, pad = (size_t)(row_pad > 1 ? row_pad - 1 : 0);
    b->x_stride = ktfp8_row_stride(Hp, esz);
    b->h_stride = ktfp8_row_stride(Ip, esz);
    b->block_tokens = block_tokens;
    b->n_blocks = (c->tokens + block_tokens - 1) / block_tokens;
    const size_t sizes[] = {
        sizeof(int64_t) * (size_t)(E + 1), sizeof(int64_t) * (size_t)E, sizeof(int64_t) * (size_t)E,
        sizeof(int64_t) * n, sizeof(float) * n, esz * (n + pad) * (size_t)b->h_stride,
        sizeof(int64_t) * (size_t)(b->n_blocks + 1) * (size_t)E};
    enum { N_BUFS = sizeof(sizes) / sizeof(sizes[0]) };
    size_t total = 0;
    for (int i = 0; i < N_BUFS; i++) total += ALIGN64(sizes[i]);
    char *all = ktfp8_arena_get(KTFP8_ARENA_CALL, total);
    if (!all) return KTFP8_ENOMEM;
    void *at[N_BUFS];
    for (int i = 0; i < N_BUFS; i++) {
        at[i] = all;
        all += ALIGN64(sizes[i]);
    }
    b->offset = at[0];
    b->active = at[1];
    b->fill = at[2];
    b->pair_token = at[3];
    b->pair_weight = at[4];
    b->h = at[5];
    b->block_start = at[6];
    b->n_pairs = routed;
    group_pairs(c, b);
    block_starts(b);
    if (b->max_m > row_pad) memset((char *)b->h + esz * n * (size_t)b->h_stride, 0, esz * pad * (size_t)b->h_stride);
    return 0;
}

/* Index of expert e's tile `tile` among projection p's packed tiles. */
static size_t tile_at(const ktfp8_packed_proj *p, int64_t e, int64_t tile) { return (size_t)(e * p->n_tiles + tile); }

/* The packed weights of expert e's tile `tile` of projection p. */
static const void *tile_w(const ktfp8_packed_proj *p, int64_t e, int64_t tile) {
    return p->w + tile_at(p, e, tile) * p->tile_w_bytes;
}

/* The micro-kernel job for tile `tile` of expert e's projection p over m activation rows, a_stride
 * elements apart, starting at a; FP32 results into c[m][NB]. */
static ktfp8_tile_job tile_job(const ktfp8_moe_kernel *kern, const ktfp8_moe_shape *s, const ktfp8_packed_proj *p,
                               int64_t e, int64_t tile, const void *a, int64_t a_stride, int act, int64_t m,
                               float *c, void *scratch, int rescale_exp) {
    const size_t at = tile_at(p, e, tile);
    ktfp8_tile_job job = {0};
    job.w = tile_w(p, e, tile);
    job.scale = p->scale + at * p->tile_scale_floats;
    job.format = s->format;
    job.k = p->k_pad;
    job.block_k = s->block_k;
    job.n_kblocks = p->n_kblocks;
    job.a = a;
    job.a_stride = a_stride;
    job.act_dtype = act;
    job.m = m;
    job.c = c;
    job.c_stride = kern->layout.rows_per_tile;
    job.scratch = scratch;
    job.rescale_exp = rescale_exp;
    return job;
}

/* The prefetch helpers are always inlined: GCC finds a function that only prefetches "looping pure"
 * (__builtin_prefetch has no effect it models) and, its result unused, deletes every call to it.
 * So it did with prefetch_tile from its start (0 prefetch instructions in the driver's object) until
 * 2026-12-06; tests/test_driver_prefetch.py counts them in the compiled driver. */

/* Asks for the first HEAD_LINES lines of expert e's tile `tile` of projection p, and all of its scales. */
INLINE void prefetch_tile(const ktfp8_packed_proj *p, int64_t e, int64_t tile) {
    const char *w = tile_w(p, e, tile);
    for (int line = 0; line < HEAD_LINES; line++) __builtin_prefetch(w + 64 * line, 0, 3);
    const float *scale = p->scale + tile_at(p, e, tile) * p->tile_scale_floats;
    for (size_t f = 0; f < p->tile_scale_floats; f += 16) __builtin_prefetch(scale + f, 0, 3); /* 16 floats a line */
}

/* The first COLD_HEAD_BYTES of each half of the n tiles at w (tile_bytes each) into L2, every
 * stream's first lines first. */
INLINE void prefetch_cold_heads(const char *const *w, int n, size_t tile_bytes) {
    const size_t half = tile_bytes / 2, head = half < COLD_HEAD_BYTES ? half : COLD_HEAD_BYTES;
    for (size_t b = 0; b < head; b += 64)
        for (int t = 0; t < n; t++) {
            __builtin_prefetch(w[t] + b, 0, 2); /* locality 2: prefetcht1 */
            __builtin_prefetch(w[t] + half + b, 0, 2);
        }
}

/* Items per run when `items` are cut into runs_per_thread runs a thread; one thread takes them as
 * one run (RUNS_PER_THREAD says why). */
static int64_t run_length(int64_t items, int threads, int runs_per_thread) {
    const int64_t run = threads == 1 ? items : items / ((int64_t)runs_per_thread * threads);
    return run > 1 ? run : 1;
}

/* Phase 1's runs: `run` items each, but the last threads x run items (with more than one thread) in
 * runs TAIL_SPLIT times shorter.  Why: an expert's items cost what its token count says, so at T = 64
 * (about 8 tokens an expert, 4 experts a run on the benchmark layer) one run may take a fifth more or
 * less than another, and the thread that takes the last long run leaves the others waiting at the
 * barrier.  Short runs at the end only: each run restarts the weight stream (w_next stops at its end).
 * Measured on the Zen 4 VM (avx512_bf16, benchmark layer, 2 threads): `perf record` of T = 64 calls,
 * libgomp's share of the samples 3.2-3.3 % -> 1.7-1.9 %; tools/ab_builds.py new / old T = 64 0.982x,
 * 0.991x, 0.992x, T = 512 0.979x, 0.985x, T = 16 0.999x, T = 1 1.004x.  A split of 8: T = 64
 * 0.991x and 1.000x, T = 512 0.998x, T = 1 1.010x. */
#define TAIL_SPLIT 4
typedef struct phase1_runs {
    int64_t items, run, bulk_runs, tail_run, count;
} phase1_runs;

static phase1_runs phase1_runs_of(int64_t items, int threads) {
    phase1_runs r = {.items = items, .run = run_length(items, threads, RUNS_PER_THREAD)};
    const int64_t tail = threads > 1 ? (int64_t)threads * r.run : 0, short_run = r.run / TAIL_SPLIT;
    r.bulk_runs = items > tail ? (items - tail) / r.run : 0;
    r.tail_run = threads == 1 ? r.run : short_run > 1 ? short_run : 1;
    r.count = r.bulk_runs + (items - r.bulk_runs * r.run + r.tail_run - 1) / r.tail_run;
    return r;
}

/* First item of run i. */
static int64_t run_start(const phase1_runs *r, int64_t i) {
    return i <= r->bulk_runs ? i * r->run : r->bulk_runs * r->run + (i - r->bulk_runs) * r->tail_run;
}

/* One past the last item of run i (the last run ends at the last item). */
static int64_t run_end(const phase1_runs *r, int64_t i) {
    const int64_t next = run_start(r, i + 1);
    return next < r->items ? next : r->items;
}

/* Bytes of y accumulator a phase-2 group may take: half the L2, 256 KiB where CPUID does not say. */
static int64_t group_acc_bytes(void) {
    const unsigned l2_kib = ktfp8_cpu_get()->l2_kib;
    return l2_kib ? (int64_t)l2_kib * 1024 / 2 : 256 * 1024;
}

/* The accumulator bytes phase2_block_tokens' model gives a group: half a 1 MiB L2 whatever this
 * CPU's, as the blocks set the sums' rounding (below) and must come out the same on every machine,
 * and on every core of a hybrid CPU whose cores report L2s of different sizes. */
#define PHASE2_MODEL_ACC_BYTES (512 * 1024)

/* Phase-2 items of a group that acc_bytes of y accumulator hold for `tokens` (at least 1). */
static int64_t group_fit(int64_t acc_bytes, int64_t tokens, int64_t item_cols) {
    const int64_t fit = acc_bytes / ((int64_t)sizeof(float) * (tokens > 0 ? tokens : 1) * item_cols);
    return fit > 1 ? fit : 1;
}

/* Phase-2 items per group: a run of the items of all `blocks` token blocks (run_length), at most one
 * block's `items`, as far as group_acc_bytes() of y accumulator holds for `tokens`. */
static int64_t group_size(int64_t items, int64_t blocks, int threads, int64_t tokens, int64_t item_cols) {
    int64_t run = run_length(items * blocks, threads, PHASE2_RUNS_PER_THREAD);
    const int64_t fit = group_fit(group_acc_bytes(), tokens, item_cols);
    run = run < items ? run : items;
    return fit < run ? fit : run;
}

/* Tokens per phase-2 token block (T: one block): T cut evenly into the count of blocks, 1 to
 * PHASE2_MAX_BLOCKS, for which phase 2 moves the fewest bytes by this model: the down weights of the
 * experts T tokens can reach (all of the layer's, or T x top_k) once a block, and the h rows of all
 * T x top_k pairs once for each group of their block, a group as many items as
 * PHASE2_MODEL_ACC_BYTES of accumulator hold for a block's tokens.  One block unless that saves a
 * tenth.
 * Why blocks: a group's y accumulator holds all of its tokens, so a long call's groups shrink (to one
 * item at T = 4096 on the benchmark layer), and each group reads all of h again (52 MB at T = 4096,
 * past this VM's L3, 64 times a call); a block's groups are 8 items again, and its h rows (6.5 MB)
 * are read by the threads working on it together.  The price is the down weights once a block: the
 * model weighs it (DeepSeek-V3's layer at T = 4096: 3.8 GB of down weights against 136 MB of h).
 * Measured on the Zen 4 VM (tools/ab_builds.py, FP8 per-channel, 2 threads), new / old time, the
 * benchmark layer (blocks of 512 tokens): T = 4096 0.888x-0.897x (1 thread 0.888x), 2048 0.952x-0.961x
 * (block-wise 0.950x, BF16 weights 0.986x, avx2 0.959x), 1024 0.999x (one block by the model; blocks
 * of 512 took 0.984x), 512 1.002x-1.005x, 64 0.996x, 1 1.003x (one block); a DeepSeek-V3-shaped layer
 * of 32 experts: T = 2048 0.975x, 1024 0.919x.
 * A block's pairs of an expert are the rows of one kernel call, whose passes, and so the sums'
 * rounding, follow from its row count.  So the model reads T and the layer's shape only: not the
 * thread count, not this CPU's L2, not the routing (what a call's ids route where, or skip), nor
 * which experts a shard holds (the layer's expert count, c->layer_experts), so that a token whose
 * experts all live in one shard gets the same bits from it as from the whole layer.  It leaves out
 * the caches too. */
static int64_t phase2_block_tokens(const ktfp8_moe_call *c, const phase2_shape *p) {
    const int64_t T = c->tokens > 0 ? c->tokens : 1, pairs = T * c->top_k;
    const int64_t experts = c->layer_experts > 0 ? c->layer_experts : c->shape->experts;
    const double weights = p->expert_bytes * (double)(experts < pairs ? experts : pairs);
    const double h = p->h_row_bytes * (double)pairs;
    double one = 0.0, best = 0.0;
    int64_t best_tokens = T;
    /* a group of every item already fits (decode, short prefills): one block */
    const int all_fit = group_fit(PHASE2_MODEL_ACC_BYTES, T, p->item_cols) >= p->items;
    for (int64_t n = 1; !all_fit && n <= PHASE2_MAX_BLOCKS && n <= T; n++) {
        const int64_t tokens = (T + n - 1) / n, blocks = (T + tokens - 1) / tokens;
        int64_t group = group_fit(PHASE2_MODEL_ACC_BYTES, tokens, p->item_cols);
        group = group < p->items ? group : p->items;
        const double bytes = weights * (double)blocks + h * (double)((p->items + group - 1) / group);
        if (n == 1) one = best = bytes;
        if (bytes < best) {
            best = bytes;
            best_tokens = tokens;
        }
    }
    return best > 0.9 * one ? T : best_tokens;
}

/* The magnitude of the FP32 number with these bits, as an int32 that orders like magnitudes do; 0
 * for Inf and NaN, which go through any power-of-two scaling unchanged, so only the finite values
 * bound it.  (Integers, so that the max loops below vectorize.) */
static inline int32_t finite_magnitude(uint32_t bits) {
    const int32_t m = (int32_t)(bits & 0x7FFFFFFFu);
    return m < 0x7F800000 ? m : 0;
}

/* The largest finite |value| of n F32 or BF16 values (0 if none). */
static float finite_amax(const void *v, int dtype, int64_t n) {
    int32_t amax = 0;
    if (dtype == KTFP8_F32) {
        for (int64_t i = 0; i < n; i++) {
            uint32_t bits;
            memcpy(&bits, (const float *)v + i, sizeof bits);
            const int32_t m = finite_magnitude(bits);
            amax = m > amax ? m : amax;
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            const int32_t m = finite_magnitude((uint32_t)((const uint16_t *)v)[i] << 16);
            amax = m > amax ? m : amax;
        }
    }
    float f;
    memcpy(&f, &amax, sizeof f);
    return f;
}

/* The power of two a call's activations are multiplied by for a kernel that wants 2^act_exp (0:
 * none), given their largest finite |value|: act_exp, or less where amax * 2^act_exp would reach
 * 2^126, so that no scaled activation, and no product or K sum of the kernel, overflows where the
 * unscaled ones do not.  The job's rescale_exp = act_exp - this puts the difference back. */
static int activation_exp(int act_exp, float amax) {
    int e;
    frexpf(amax, &e); /* amax < 2^e */
    return act_exp == 0 || amax == 0.0f || e <= 126 - act_exp ? act_exp : 126 - e;
}

/* Multiplies n FP32 values by 2^e (exact: e leaves them finite, see activation_exp). */
static void scale_row(float *v, int64_t n, int e) {
    const float f = ldexpf(1.0f, e);
    for (int64_t i = 0; i < n; i++) v[i] *= f;
}

/* Token t's row of x (F32 or BF16). */
static const void *x_row(const ktfp8_moe_call *c, int64_t t) {
    return (const char *)c->x + (c->x_dtype == KTFP8_F32 ? 4 : 2) * (size_t)(t * c->shape->hidden);
}

/* Pair p's token row of x into `row` (activation dtype) times 2^x_exp, zeros to Hp. */
static void gather_row(const ktfp8_moe_call *c, const call_buffers *b, int64_t p, char *row, int act, size_t esz,
                       int64_t Hp, int x_exp) {
    const int64_t H = c->shape->hidden;
    const void *src = x_row(c, b->pair_token[p]);
    if (c->x_dtype == act)
        memcpy(row, src, esz * (size_t)H);
    else if (act == KTFP8_F32)
        ktfp8_load_row((float *)row, src, c->x_dtype, H);
    else /* FP32 x, BF16 activations */
        ktfp8_store_row(row, act, (const float *)src, H);
    if (x_exp) scale_row((float *)row, H, x_exp); /* act_exp kernels read FP32 */
    memset(row + esz * (size_t)H, 0, esz * (size_t)(Hp - H));
}

/* Phase 1's activations for the m pairs from p0 on (one expert's): their token rows gathered into this
 * thread's xg[][x_stride] (gather_row), and rows m .. round_up(m, row_pad) - 1 readable and finite
 * for a kernel that reads whole tiles of rows (abi.h, layout.row_pad): rows an earlier expert of this
 * call left there, or zeros where none did (*ready: rows of xg this call has written).
 * Why per expert and thread, not all pairs' rows into one buffer before phase 1: that buffer (16 MiB
 * at T = 512 on the benchmark layer) went out to L3 as it was written and came back for each expert's
 * first tile, where this copy stays in the thread's L2 for all of the expert's tiles. */
static void gather_expert(const ktfp8_moe_call *c, const call_buffers *b, int64_t p0, int64_t m, char *xg,
                          int64_t *ready, int64_t row_pad, int act, size_t esz, int64_t Hp, int x_exp) {
    const size_t row_bytes = esz * (size_t)b->x_stride;
    for (int64_t i = 0; i < m; i++) gather_row(c, b, p0 + i, xg + row_bytes * (size_t)i, act, esz, Hp, x_exp);
    const int64_t readable = m > row_pad ? (m + row_pad - 1) / row_pad * row_pad : m;
    const int64_t from = m > *ready ? m : *ready;
    if (readable > from) memset(xg + row_bytes * (size_t)from, 0, row_bytes * (size_t)(readable - from));
    *ready = readable > *ready ? readable : *ready;
}

/* Phase 2 prologue / epilogue: the block of y that one item owns, tokens [t0, t1) x columns [n0, n0 +
 * cols), to and from its FP32 accumulator acc[t1 - t0][acc_stride]. */
static void y_columns_load(const ktfp8_moe_call *c, int64_t t0, int64_t t1, int64_t n0, int64_t cols, float *acc,
                           int64_t acc_stride) {
    const int64_t H = c->shape->hidden;
    for (int64_t t = t0; t < t1; t++) {
        float *row = acc + (t - t0) * acc_stride;
        if (!c->accumulate)
            memset(row, 0, sizeof(float) * (size_t)cols);
        else if (c->x_dtype == KTFP8_F32)
            memcpy(row, (const float *)c->y + t * H + n0, sizeof(float) * (size_t)cols);
        else /* BF16 y: widened into the FP32 accumulator */
            ktfp8_load_row(row, (const uint16_t *)c->y + t * H + n0, c->x_dtype, cols);
    }
}

static void y_columns_store(const ktfp8_moe_call *c, int64_t t0, int64_t t1, int64_t n0, int64_t cols,
                            const float *acc, int64_t acc_stride) {
    const int64_t H = c->shape->hidden;
    const size_t ysz = c->x_dtype == KTFP8_F32 ? 4 : 2;
    for (int64_t t = t0; t < t1; t++)
        ktfp8_store_row((char *)c->y + ysz * (size_t)(t * H + n0), c->x_dtype, acc + (t - t0) * acc_stride, cols);
}

/* The first of n active experts from index a on with pairs in a token block, whose pairs of active
 * expert i are start[i] .. end[i] - 1 (n if none). */
static int64_t next_in_block(const int64_t *start, const int64_t *end, int64_t n, int64_t a) {
    while (a < n && start[a] == end[a]) a++;
    return a;
}

int ktfp8_moe_forward(const ktfp8_variant *v, const ktfp8_moe_call *c) {
    const ktfp8_moe_kernel *kern = v->moe;
    const ktfp8_moe_shape *s = c->shape;
    const ktfp8_layout *l = &kern->layout;
    const int nb = l->rows_per_tile, act = c->act_dtype;
    const size_t esz = act == KTFP8_BF16 ? 2 : 4;
    const int64_t H = s->hidden, I = s->inter;
    const int threads = ktfp8_team_size(c->threads); /* also sizes the work split */
    /* layout.act_exp applies to FP8 weights and FP32 activations */
    const int act_exp = s->format != KTFP8_FMT_BF16 && act == KTFP8_F32 ? l->act_exp : 0;

    ktfp8_packed_proj proj[3];
    ktfp8_packed_views(s, l, c->packed, proj);
    const int64_t Hp = proj[KTFP8_GATE].k_pad, Ip = proj[KTFP8_DOWN].k_pad;

    const int dw = kern->tile_matmul2 ? 2 : 1; /* down tiles per phase-2 item */
    const int64_t dcols = dw * nb;              /* y columns per phase-2 item: row stride of yacc and zbuf */
    const ktfp8_packed_proj *down = &proj[KTFP8_DOWN];
    const int64_t tiles2 = down->n_tiles, items2 = (tiles2 + dw - 1) / dw;
    const phase2_shape p2 = {
        .items = items2, .item_cols = dcols,
        .expert_bytes = (double)tiles2 * (double)(down->tile_w_bytes + sizeof(float) * down->tile_scale_floats),
        .h_row_bytes = (double)(esz * (size_t)ktfp8_row_stride(Ip, esz))};
    call_buffers b;
    int rc = prepare_call(c, Hp, Ip, esz, kern->layout.row_pad, phase2_block_tokens(c, &p2), &b);
    if (rc) return rc;

    const size_t scratch_bytes = kern->tile_scratch_bytes ? kern->tile_scratch_bytes(Hp > Ip ? Hp : Ip) : 0;
    const size_t gu_bytes = ALIGN64(sizeof(float) * (size_t)(b.max_m * nb));
    const int64_t group = group_size(items2, b.n_blocks, threads, b.block_tokens, dcols);
    const int64_t groups2 = (items2 + group - 1) / group;
    const int64_t gcols = group * dcols; /* y columns per phase-2 group: row stride of yacc */
    const size_t yacc_bytes = ALIGN64(sizeof(float) * (size_t)(b.block_tokens * gcols));
    const int64_t row_pad = l->row_pad > 1 ? l->row_pad : 1;
    /* phase 1's gathered rows (gather_expert): an expert's, and a whole tile of rows past them */
    const size_t xg_bytes = ALIGN64(esz * (size_t)((b.max_m + row_pad - 1) * b.x_stride));
    int failed = 0;
    float x_amax = 0.0f, h_amax = 0.0f; /* largest finite |x| and |h|, where act_exp scales them */
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const unsigned csr = ktfp8_fpenv_ieee();
        /* this thread's gate / up results [max_m][NB] (together the down results [max_m][DW * NB]),
         * its y accumulator [block_tokens][group * DW * NB], its gathered rows and the kernel's scratch */
        char *tbuf = ktfp8_arena_get(KTFP8_ARENA_TILE, 2 * gu_bytes + yacc_bytes + xg_bytes + ALIGN64(scratch_bytes));
        float *gbuf = (float *)tbuf, *ubuf = (float *)(tbuf + gu_bytes), *yacc = (float *)(tbuf + 2 * gu_bytes);
        char *xg = tbuf + 2 * gu_bytes + yacc_bytes;
        void *scratch = scratch_bytes && tbuf ? xg + xg_bytes : NULL;
        const int ok = tbuf != NULL;
        failed |= !ok;

        if (act_exp) {
#pragma omp for schedule(static) reduction(max : x_amax)
            for (int64_t t = 0; t < c->tokens; t++) {
                const float row_amax = finite_amax(x_row(c, t), c->x_dtype, H);
                x_amax = row_amax > x_amax ? row_amax : x_amax;
            }
        }
        const int x_exp = activation_exp(act_exp, x_amax);
        if (Ip > I) { /* the K padding of h, which phase 1 never writes */
#pragma omp for schedule(static)
            for (int64_t p = 0; p < b.n_pairs; p++)
                memset((char *)b.h + esz * (size_t)(p * b.h_stride + I), 0, esz * (size_t)(Ip - I));
        }

        /* phase 1: h = act(x @ gate^T) * (x @ up^T), per (expert, intermediate tile), in runs
         * (phase1_runs: the dynamic schedule's chunks, spelled out so that an item knows its successor) */
        const int64_t tiles1 = proj[KTFP8_GATE].n_tiles, items1 = b.n_active * tiles1;
        const phase1_runs runs1 = phase1_runs_of(items1, threads);
        int64_t gathered = -1, xg_ready = 0; /* the expert whose rows xg holds; xg's rows written */
#pragma omp for schedule(dynamic, 1) reduction(max : h_amax)
        for (int64_t r = 0; r < runs1.count; r++) {
            const int64_t start = run_start(&runs1, r), end = run_end(&runs1, r);
            for (int64_t it = start; ok && it < end; it++) {
                const int64_t e = b.active[it / tiles1], tile = it % tiles1;
                const int64_t p0 = b.offset[e], m = b.offset[e + 1] - p0;
                if (e != gathered) gather_expert(c, &b, p0, m, xg, &xg_ready, row_pad, act, esz, Hp, x_exp);
                gathered = e;
                const int rescale = act_exp - x_exp;
                ktfp8_tile_job gate = tile_job(kern, s, &proj[KTFP8_GATE], e, tile, xg, b.x_stride, act, m, gbuf,
                                               scratch, rescale);
                ktfp8_tile_job up = tile_job(kern, s, &proj[KTFP8_UP], e, tile, xg, b.x_stride, act, m, ubuf,
                                             scratch, rescale);
                /* the weight streams go on with the run's next item: gate, up, gate, ... one tile at a
                 * time, or gate and up side by side with tile_matmul2 */
                const int64_t e_next = it + 1 < end ? b.active[(it + 1) / tiles1] : -1, tile_next = (it + 1) % tiles1;
                const void *gate_next = e_next >= 0 ? tile_w(&proj[KTFP8_GATE], e_next, tile_next) : NULL;
                gate.w_next = kern->tile_matmul2 ? gate_next : up.w;
                up.w_next = kern->tile_matmul2 && e_next >= 0 ? tile_w(&proj[KTFP8_UP], e_next, tile_next) : gate_next;
                prefetch_tile(&proj[KTFP8_GATE], e, tile);
                prefetch_tile(&proj[KTFP8_UP], e, tile);
                if (it == start) {
                    const char *heads[2] = {(const char *)gate.w, (const char *)up.w};
                    prefetch_cold_heads(heads, 2, proj[KTFP8_GATE].tile_w_bytes);
                }
                if (kern->tile_matmul2) {
                    kern->tile_matmul2(&gate, &up);
                } else {
                    kern->tile_matmul(&gate);
                    kern->tile_matmul(&up);
                }
                const int64_t n0 = tile * nb, rows = I - n0 < nb ? I - n0 : nb;
                char *h = (char *)b.h + esz * (size_t)(p0 * b.h_stride + n0);
                kern->epilogue->glu_store(gbuf, ubuf, m, nb, rows, h, b.h_stride, act, c->activation,
                                          c->swiglu_limit);
                for (int64_t i = 0; act_exp && i < m; i++) {
                    const float row_amax = finite_amax((const float *)h + i * b.h_stride, KTFP8_F32, rows);
                    h_amax = row_amax > h_amax ? row_amax : h_amax;
                }
            }
        }
        const int h_exp = activation_exp(act_exp, h_amax);
        if (h_exp) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < b.n_pairs; p++) scale_row((float *)b.h + p * b.h_stride, I, h_exp);
        }

        /* phase 2: y[token, columns] += weight * (h @ down_tiles^T), experts in id order; an item is a
         * group of a token block, the blocks outer, so that the threads share a block's h rows */
        float *zbuf = gbuf; /* [max_m][dcols]: gbuf and ubuf are adjacent */
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < b.n_blocks * groups2; w++) {
            if (!ok) continue;
            const int64_t tb = w / groups2, g = w % groups2;
            const int64_t t0 = tb * b.block_tokens;
            const int64_t t1 = t0 + b.block_tokens < c->tokens ? t0 + b.block_tokens : c->tokens;
            const int64_t *start = b.block_start + tb * b.n_active, *end = start + b.n_active;
            const int64_t it0 = g * group, it1 = it0 + group < items2 ? it0 + group : items2;
            const int64_t g0 = it0 * dcols, gc = H - g0 < (it1 - it0) * dcols ? H - g0 : (it1 - it0) * dcols;
            y_columns_load(c, t0, t1, g0, gc, yacc, gcols);
            for (int64_t a = next_in_block(start, end, b.n_active, 0), first = a; a < b.n_active;) {
                const int64_t e = b.active[a], p0 = start[a], m = end[a] - p0;
                const int64_t a_next = next_in_block(start, end, b.n_active, a + 1);
                const void *hrows = (const char *)b.h + esz * (size_t)(p0 * b.h_stride);
                for (int64_t it = it0; it < it1; it++) {
                    const int64_t tile = it * dw, n0 = tile * nb, cols = H - n0 < dcols ? H - n0 : dcols;
                    const int pair = dw == 2 && tile + 1 < tiles2;
                    ktfp8_tile_job jobs[2]; /* down tile `tile`, and tile + 1 when paired */
                    for (int d = 0; d <= pair; d++) {
                        jobs[d] = tile_job(kern, s, &proj[KTFP8_DOWN], e, tile + d, hrows, b.h_stride, act, m,
                                           zbuf + d * nb, scratch, act_exp - h_exp);
                        jobs[d].c_stride = dcols;
                        /* this stream goes on with the group's next tile, or the next expert's first */
                        const int64_t next = it + 1 < it1 ? (it + 1) * dw + d : it0 * dw + d;
                        const int64_t e_next = it + 1 < it1 ? e : a_next < b.n_active ? b.active[a_next] : -1;
                        jobs[d].w_next = e_next >= 0 && next < tiles2 ? tile_w(&proj[KTFP8_DOWN], e_next, next) : NULL;
                        if (it > it0) continue; /* the group's later tiles follow in the same stream */
                        if (a == first) prefetch_tile(&proj[KTFP8_DOWN], e, tile + d);
                        if (a_next < b.n_active) /* the next expert's first tile: a short read, far from this one */
                            prefetch_tile(&proj[KTFP8_DOWN], b.active[a_next], tile + d);
                    }
                    if (a == first && it == it0) {
                        const char *heads[2] = {(const char *)jobs[0].w, (const char *)jobs[pair].w};
                        prefetch_cold_heads(heads, 1 + pair, proj[KTFP8_DOWN].tile_w_bytes);
                    }
                    if (pair)
                        kern->tile_matmul2(&jobs[0], &jobs[1]);
                    else
                        kern->tile_matmul(&jobs[0]);
                    kern->epilogue->scatter_add(yacc + (it - it0) * dcols, gcols, b.pair_token + p0, t0,
                                                b.pair_weight + p0, zbuf, dcols, m, cols);
                }
                a = a_next;
            }
            y_columns_store(c, t0, t1, g0, gc, yacc, gcols);
        }
        if (kern->release) kern->release(); /* after this thread's last kernel call */
        ktfp8_arena_trim(KTFP8_ARENA_TILE);
        ktfp8_fpenv_restore(csr);
    }
    ktfp8_arena_trim(KTFP8_ARENA_CALL);
    return failed ? KTFP8_ENOMEM : 0;
}
