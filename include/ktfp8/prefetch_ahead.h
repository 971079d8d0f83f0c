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
 * against prefetching straight on past the tile's end): T = 1 0.993x / 0.961x on 2 threads (two
 * runs), 0.965x / 0.974x on 1 thread; T = 64 1.005x, T = 512 1.001x.
 * Addresses are computed as integers: a prefetch never faults, but C pointer arithmetic may not
 * leave its object. */
#ifndef KTFP8_PREFETCH_AHEAD_H
#define KTFP8_PREFETCH_AHEAD_H

#include <stdint.h>

typedef struct ktfp8_prefetch_ahead {
    uintptr_t within; /* + offset: `distance` bytes ahead of tile byte offset, inside the tile */
    uintptr_t beyond; /* + (offset - cut): the same, continued into the next tile */
    int64_t cut;      /* the first offset whose prefetch lies beyond the tile */
} ktfp8_prefetch_ahead;

/* For the tile of tile_bytes at w, followed by the one at w_next (NULL: not known). */
static inline ktfp8_prefetch_ahead ktfp8_prefetch_ahead_of(const void *w, const void *w_next, int64_t tile_bytes,
                                                            int64_t distance) {
    ktfp8_prefetch_ahead p;
    p.within = (uintptr_t)w + (uintptr_t)distance;
    p.beyond = (uintptr_t)(w_next ? w_next : w);
    p.cut = tile_bytes - distance;
    return p;
}

/* The address to prefetch while reading tile byte `offset`. */
static inline const char *ktfp8_prefetch_at(const ktfp8_prefetch_ahead *p, int64_t offset) {
    return (const char *)(offset < p->cut ? p->within + (uintptr_t)offset : p->beyond + (uintptr_t)(offset - p->cut));
}

#endif
