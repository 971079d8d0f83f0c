/* The read probe's split of a buffer: the calling OpenMP thread's share of its 128-byte steps, read
 * as `streams` runs side by side (run steps each, the same offset of every run in turn), then the
 * share's last steps that do not fill a run. */
#ifndef KTFP8_PROBE_SHARE_H
#define KTFP8_PROBE_SHARE_H

#include <omp.h>
#include <stddef.h>

typedef struct {
    size_t first, last; /* the thread's steps [first, last) */
    size_t run;         /* steps per stream: run s covers [first + s run, first + (s + 1) run) */
} ktfp8_probe_share;

static inline ktfp8_probe_share ktfp8_probe_share_of(size_t bytes, int streams) {
    const size_t steps = bytes / 128, t = (size_t)omp_get_thread_num(), n = (size_t)omp_get_num_threads();
    ktfp8_probe_share share = {steps * t / n, steps * (t + 1) / n, 0};
    share.run = (share.last - share.first) / (size_t)streams;
    return share;
}

/* Step i of stream s: its run read from a start rotated by s x SKEW steps (wrapping to the run's
 * start), so that side by side the streams are at different offsets within a page. */
#define KTFP8_PROBE_SKEW_STEPS 37 /* 4.6 KiB: an odd count of steps, off every power-of-two stride */
static inline size_t ktfp8_probe_stream_step(const ktfp8_probe_share *share, int s, size_t i) {
    size_t j = i + (size_t)s * KTFP8_PROBE_SKEW_STEPS % (share->run ? share->run : 1);
    if (j >= share->run) j -= share->run;
    return share->first + (size_t)s * share->run + j;
}

#endif
