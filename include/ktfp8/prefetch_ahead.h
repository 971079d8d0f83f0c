/* Where a micro-kernel's software prefetch reads ahead of its weight stream.
 *
 * The kernels prefetch a fixed distance ahead of the byte they read.  Near a tile's end that address
 * lies past the tile, in the next tile of the same expert and projection, which is not what the
 * thread reads next after a gate tile (its up tile follows), after an expert's last tile of a
 * phase-2 group (the next expert's tile follows), or at the end of a run of items (another thread
 * may read it).  The driver names the tile that does follow (ktfp8_tile_job.w_next), and the last
 * `distance` bytes of prefetch go to its head.  With none named they go to the tile's own head,
 * lines already read and still cached, so no bandwidth goes to lines this thread will not read.
 * Measured on Zen 3 (avx2, benchmark layer, weights from DRAM, alternated in one process, time
 * against prefetching straight on past the tile's end): T = 1 0.993x / 0.961x / 0.995x / 0.977x on 2
 * threads (four runs), 0.965x / 0.974x / 0.990x on 1 thread; T = 64 1.005x, T = 512 1.001x.
 * The prefetch address changes base once, at the tile byte `cut` where it leaves the tile, so the
 * kernels run their K loop in two runs with a loop-invariant base each (ktfp8_prefetch_run): a
 * choice per prefetch cost avx512_bf16's decode loop 8.1 -> 10.3 cycles per iteration in
 * llvm-mca-16 -mcpu=sapphirerapids (GPR pressure: a spill and two cmov per iteration).
 * Addresses are integers: a prefetch never faults, but C pointer arithmetic may not leave its
 * object. */
#ifndef KTFP8_PREFETCH_AHEAD_H
#define KTFP8_PREFETCH_AHEAD_H

#include <stdint.h>

/* Software prefetch distance of an FP8 code stream on the AVX-512 units (avx512, avx512_bf16, amx;
 * avx2 has its own, measured on Zen 3).  Measured on the AMX Xeon with a stand-alone FP8 GEMV through
 * the VBMI table of e4m3_bf16_vbmi.h (2 threads, from DRAM): no prefetch 11.3 GB/s, 1 KiB ahead 13.8,
 * 2 KiB 16.8, 4 KiB 18.4 (read bandwidth 23.4): the hardware prefetchers alone leave the bus half
 * idle.  It was 2 KiB while each thread took single tiles, since what ran past a tile's end (12 KiB
 * for a K = 768 down tile) was then some other thread's; now the prefetch runs on from a tile's end
 * into the tile this thread reads next.  4 KiB in the MoE is not yet timed on AMX hardware.
 * avx512_bf16's decode loop prefetches this far into L2 only, and 1 KiB ahead into L1
 * (ktfp8_prefetch_two below); avx512 and amx prefetch their FP8 codes into L2 and L1 at distances of
 * their own (moe_avx512.c; moe_amx.c, weight_prefetch), and amx its BF16 weights this far into L1. */
#define KTFP8_AVX512_PREFETCH_BYTES 4096
/* The amx kernel's FP8 code stream: into L2 this far ahead, into L1 this far (moe_amx.c,
 * weight_prefetch, says why). */
#define KTFP8_AMX_PREFETCH_L2_BYTES 16384
#define KTFP8_AMX_PREFETCH_L1_BYTES 1024

typedef struct ktfp8_prefetch_ahead {
    uintptr_t within; /* + offset: what to prefetch while reading tile byte offset < cut */
    uintptr_t beyond; /* + offset: the same for offset >= cut, in the next tile (wraps as unsigned) */
    int64_t cut;      /* tile bytes - distance */
} ktfp8_prefetch_ahead;

/* For the tile of tile_bytes at w, followed by the one at w_next (NULL: not known), prefetching
 * `distance` bytes ahead. */
static inline ktfp8_prefetch_ahead ktfp8_prefetch_ahead_of(const void *w, const void *w_next, int64_t tile_bytes,
                                                            int64_t distance) {
    ktfp8_prefetch_ahead p;
    p.cut = tile_bytes - distance;
    p.within = (uintptr_t)w + (uintptr_t)distance;
    p.beyond = (uintptr_t)(w_next ? w_next : w) - (uintptr_t)p.cut;
    return p;
}

/* The base that reads from tile byte `offset` on add their byte offset to, to get what to prefetch;
 * valid for the bytes before *until (the cut, or the end of any K range). */
static inline uintptr_t ktfp8_prefetch_run(const ktfp8_prefetch_ahead *p, int64_t offset, int64_t *until) {
    if (offset < p->cut) {
        *until = p->cut;
        return p->within;
    }
    *until = INT64_MAX;
    return p->beyond;
}

/* Where a run ends for a loop `for (; i + group <= bound; i += group)` over units of unit_bytes,
 * byte 0 of unit i being byte i * unit_bytes of the range `until` counts in: its iterations are those
 * that start before `until` (ktfp8_prefetch_run) and end by unit `end`. */
static inline int64_t ktfp8_prefetch_bound(int64_t until, int64_t unit_bytes, int64_t group, int64_t end) {
    const int64_t first_beyond = (until - 1) / unit_bytes + 1; /* ceil(until / unit_bytes); until > 0 */
    return first_beyond + group - 1 < end ? first_beyond + group - 1 : end;
}

/* One stream prefetched at two distances: `far` into L2 (prefetcht1), `near` into L1 (prefetcht0),
 * each running on into the next tile as above.  Why two (the avx512_bf16 decode loop, Zen 4 VM):
 * a prefetcht0 holds one of the core's L1 miss buffers until its line arrives from DRAM, so a few
 * dozen lines in flight cap one core at about the 15 GB/s that loop streamed with prefetcht0 4 KiB
 * ahead (half the read probe's 27-30); prefetcht1 waits in L2's larger miss queue, and the near
 * prefetcht0 then finds the line in L2. */
typedef struct ktfp8_prefetch_two {
    ktfp8_prefetch_ahead far, near;
} ktfp8_prefetch_two;

static inline ktfp8_prefetch_two ktfp8_prefetch_two_of(const void *w, const void *w_next, int64_t tile_bytes,
                                                        int64_t far, int64_t near) {
    ktfp8_prefetch_two p;
    p.far = ktfp8_prefetch_ahead_of(w, w_next, tile_bytes, far);
    p.near = ktfp8_prefetch_ahead_of(w, w_next, tile_bytes, near);
    return p;
}

/* Both bases for reads from tile byte `offset` (ktfp8_prefetch_run), valid before *until: the
 * K loop runs in up to three runs, each cut changing one base. */
static inline void ktfp8_prefetch_two_run(const ktfp8_prefetch_two *p, int64_t offset, uintptr_t *far_base,
                                          uintptr_t *near_base, int64_t *until) {
    int64_t until_near;
    *far_base = ktfp8_prefetch_run(&p->far, offset, until);
    *near_base = ktfp8_prefetch_run(&p->near, offset, &until_near);
    if (until_near < *until) *until = until_near;
}

/* Stream byte `offset` of a run (ktfp8_prefetch_two_run's bases): the far line into L2, the near one
 * into L1 (prefetcht1, prefetcht0).  Always inlined: GCC deletes the calls to a function that only
 * prefetches once it has not inlined it (moe_driver.c, before prefetch_tile, says why). */
static inline __attribute__((always_inline)) void ktfp8_prefetch_two_line(uintptr_t far_base, uintptr_t near_base,
                                                                          int64_t offset) {
    __builtin_prefetch((const void *)(far_base + (uintptr_t)offset), 0, 2);
    __builtin_prefetch((const void *)(near_base + (uintptr_t)offset), 0, 3);
}

#endif
