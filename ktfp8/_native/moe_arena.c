/* Per-thread reusable buffers (see include/ktfp8/arena.h).  POSIX thread-specific data rather than
 * _Thread_local so that a thread's buffers are freed when it exits (Python threads and OpenMP pools
 * come and go). */
#include "ktfp8/arena.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

typedef struct arena {
    void *buf[KTFP8_ARENA_SLOTS];
    size_t cap[KTFP8_ARENA_SLOTS];
    size_t asked[KTFP8_ARENA_SLOTS];  /* bytes of this call's ktfp8_arena_get */
    int big_before[KTFP8_ARENA_SLOTS]; /* the call before asked for more than KTFP8_ARENA_KEEP_BYTES */
} arena;

static pthread_key_t arena_key;
static pthread_once_t arena_once = PTHREAD_ONCE_INIT;
static int arena_key_ok;

/* A buffer is pages mapped for it alone, not malloc's memory: glibc serves a size it has seen freed
 * from its own heaps (its mmap threshold rises to the largest chunk freed, up to 32 MiB), which are per
 * thread and never shrink, so threads that came and went left their buffers' memory resident (a
 * helper's audit: 80 rounds of 4 Python threads each making one T = 512 call on the benchmark layer,
 * RSS 362 -> 659 MiB after every thread had exited).  Pages are 64-byte aligned, as callers need. */
static void *map_buffer(size_t bytes) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void unmap_buffer(void *p, size_t bytes) {
    if (p) munmap(p, bytes);
}

static void arena_free(void *p) {
    arena *a = p;
    for (int s = 0; s < KTFP8_ARENA_SLOTS; s++) unmap_buffer(a->buf[s], a->cap[s]);
    free(a);
}

static void arena_key_create(void) { arena_key_ok = pthread_key_create(&arena_key, arena_free) == 0; }

static arena *this_thread_arena(void) {
    pthread_once(&arena_once, arena_key_create);
    if (!arena_key_ok) return NULL;
    arena *a = pthread_getspecific(arena_key);
    if (!a) {
        a = calloc(1, sizeof(*a));
        if (a && pthread_setspecific(arena_key, a)) {
            free(a);
            a = NULL;
        }
    }
    return a;
}

void *ktfp8_arena_get(enum ktfp8_arena_slot slot, size_t bytes) {
    arena *a = this_thread_arena();
    if (!a) return NULL;
    a->asked[slot] = bytes;
    if (bytes > a->cap[slot]) {
        if (bytes > SIZE_MAX / 2) return NULL; /* no such memory: keeps the sums below from wrapping */
        /* grow geometrically so a slowly rising T does not reallocate on every call, but not past the
         * limit for a request within it: ktfp8_arena_trim would free that buffer after the call, and
         * calls alternating between 44 and 46 MiB would each get a fresh one */
        size_t cap = a->cap[slot] * 3 / 2 > bytes ? a->cap[slot] * 3 / 2 : bytes;
        if (bytes <= KTFP8_ARENA_KEEP_BYTES && cap > KTFP8_ARENA_KEEP_BYTES) cap = KTFP8_ARENA_KEEP_BYTES;
        cap = (cap + 63) & ~(size_t)63;
        unmap_buffer(a->buf[slot], a->cap[slot]);
        a->buf[slot] = map_buffer(cap);
        a->cap[slot] = a->buf[slot] ? cap : 0;
        if (!a->buf[slot]) return NULL;
    }
    return a->buf[slot];
}

void ktfp8_arena_trim(enum ktfp8_arena_slot slot) {
    if (!arena_key_ok) return; /* no ktfp8_arena_get succeeded on any thread: nothing to free */
    arena *a = pthread_getspecific(arena_key);
    if (!a) return;
    const int big = a->asked[slot] > KTFP8_ARENA_KEEP_BYTES, keep = big && a->big_before[slot];
    a->big_before[slot] = big;
    if (a->cap[slot] <= KTFP8_ARENA_KEEP_BYTES || keep) return;
    unmap_buffer(a->buf[slot], a->cap[slot]);
    a->buf[slot] = NULL;
    a->cap[slot] = 0;
}
