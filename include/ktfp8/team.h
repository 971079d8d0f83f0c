/* OpenMP team sizes that survive fork().
 *
 * libgomp keeps its pool threads across parallel regions, and fork() copies only the calling
 * thread: a child forked after the parent ran a team of two or more threads waits forever for the
 * parent's pool the first time it starts a team of two or more (multiprocessing's default "fork"
 * start method does exactly this).  As PyTorch does, such a child runs every team on one thread;
 * its results are the same, since every kernel is deterministic across thread counts. */
#ifndef KTFP8_TEAM_H
#define KTFP8_TEAM_H

/* The thread count to pass to num_threads(): `requested` (at least 1), or 1 in a child forked
 * after this process (or an ancestor) asked for a team of two or more threads. */
int ktfp8_team_size(int requested);

/* 1 when ktfp8_team_size caps teams at one thread in this process, else 0. */
int ktfp8_forked_after_teams(void);

#endif
