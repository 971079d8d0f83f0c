/* The read probe's split of a buffer: the calling OpenMP thread's share of its 128-byte steps, read
 * as `streams` runs side by side (run steps each, step i of every run in turn), then the share's last
 * steps that do not fill a run. */
#ifndef KTFP8_PROBE_SHARE_H
#define KTFP8_PROBE_SHARE_H

#include <omp.h>
#include <stddef.h>

#include "ktfp8/probe.h"

/* Each run is read from a start rotated by s x SKEW steps (wrapping to the run's start), so that side
 * by side the streams sit at different offsets within a page: 4.6 KiB, an odd count of steps, off
 * every power-of-two stride. */
#define KTFP8_PROBE_SKEW_STEPS 37

typedef struct {
    size_t first, last;                      /* the thread's steps [first, last) */
    size_t run;                              /* steps per stream: run s covers [first + s run, first + (s + 1) run) */
    size_t rotation[KTFP8_PROBE_MAX_STREAMS]; /* where run s starts reading, within the run: set once, since
                                                 a division per step capped the probe at about its speed */
} ktfp8_probe_share;

/* streams: 1 .. KTFP8_PROBE_MAX_STREAMS (the caller checks). */
static inline void ktfp8_probe_share_of(ktfp8_probe_share *share, size_t bytes, int streams) {
    const size_t steps = bytes / 128, t = (size_t)omp_get_thread_num(), n = (size_t)omp_get_num_threads();
    share->first = steps * t / n;
    share->last = steps * (t + 1) / n;
    share->run = (share->last - share->first) / (size_t)streams;
    for (int s = 0; s < streams; s++)
        share->rotation[s] = share->run ? (size_t)s * KTFP8_PROBE_SKEW_STEPS % share->run : 0;
}

/* Step i (< run) of stream s. */
static inline size_t ktfp8_probe_stream_step(const ktfp8_probe_share *share, int s, size_t i) {
    size_t j = i + share->rotation[s];
    if (j >= share->run) j -= share->run;
    return share->first + (size_t)s * share->run + j;
}

#endif
