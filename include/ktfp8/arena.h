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
    KTFP8_ARENA_CALL = 0, /* the caller's per-call buffers (grouping, h) */
    KTFP8_ARENA_TILE = 1, /* a worker's buffers (gathered x rows, gate / up / down results, y accumulator,
                           * kernel scratch) */
    KTFP8_ARENA_SLOTS = 2
};

/* A buffer of at least `bytes` bytes for this thread's slot, or NULL when out of memory.  Valid
 * until this thread's next ktfp8_arena_get / ktfp8_arena_trim of the same slot. */
void *ktfp8_arena_get(enum ktfp8_arena_slot slot, size_t bytes);

/* Called at the end of each call that took the slot.  Frees this thread's slot if it holds more
 * than KTFP8_ARENA_KEEP_BYTES, unless this call and the one before it both asked for more: a one-off
 * huge call does not pin its memory for the life of the thread, while a run of them (a long prompt
 * prefilled in chunks, one call per layer and chunk) keeps its buffer from the second call on, until
 * a call asks for less.  A fresh buffer costs its page faults and the kernel's zeroing: measured on
 * the Zen 4 VM (tools/ab_builds.py, benchmark layer, FP8 per-channel, 2 threads, 8 rounds), against
 * freeing every such call: T = 2048 (about 90 MB) 0.92x the time, T = 4096 0.95x, T = 1024 (under
 * the limit: the same code) 1.00x. */
#define KTFP8_ARENA_KEEP_BYTES ((size_t)64 << 20)
void ktfp8_arena_trim(enum ktfp8_arena_slot slot);

#endif
