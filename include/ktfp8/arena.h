/* Per-thread scratch buffers reused from call to call, so the MoE hot path neither allocates nor
 * page-faults: a decode call would otherwise pay a malloc + memset for every buffer on every
 * thread, a prefill call the page faults of tens of MB of fresh mmap'ed memory (measured on the
 * AMX Xeon: ~2 % of a T = 512 call in memset / page faults alone).
 *
 * Each thread (the Python caller and every OpenMP worker) owns KTFP8_ARENA_SLOTS buffers, grown
 * on demand, 64-byte aligned, never shrunk except by ktfp8_arena_trim, and freed when the thread
 * exits.  Contents are NOT zeroed: callers write what they read. */
#ifndef KTFP8_ARENA_H
#define KTFP8_ARENA_H

#include <stddef.h>

enum ktfp8_arena_slot {
    KTFP8_ARENA_CALL = 0, /* the caller's per-call buffers (grouping, gathered x, h, y accumulator) */
    KTFP8_ARENA_TILE = 1, /* a worker's per-tile buffers (gate / up / down results, kernel scratch) */
    KTFP8_ARENA_SLOTS = 2
};

/* A buffer of at least `bytes` bytes for this thread's slot, or NULL when out of memory.  Valid
 * until this thread's next ktfp8_arena_get / ktfp8_arena_trim of the same slot. */
void *ktfp8_arena_get(enum ktfp8_arena_slot slot, size_t bytes);

/* Frees this thread's slot if it holds more than KTFP8_ARENA_KEEP_BYTES: a one-off huge call does
 * not pin its memory for the life of the thread (at that size the call's own work dwarfs a fresh
 * allocation). */
#define KTFP8_ARENA_KEEP_BYTES ((size_t)64 << 20)
void ktfp8_arena_trim(enum ktfp8_arena_slot slot);

#endif
