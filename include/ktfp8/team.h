/* OpenMP team sizes that survive fork(), and thread affinity left to the caller.
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

/* Called once, when the extension loads.  GCC's libgomp leaves each thread's CPU mask alone unless
 * OMP_PROC_BIND / OMP_PLACES / GOMP_CPU_AFFINITY ask, so a thread pinned to one NUMA node's CPUs
 * (ktfp8.numa.pin, NumaMoE's teams) runs its team there.  LLVM's libomp (a clang build; Intel's
 * runtime shares its code) instead binds a thread that starts its first team to the whole mask the
 * process had when the runtime started, undoing the pinning (tests/test_numa.py failed so in a
 * clang-19 build).  With none of KMP_AFFINITY, OMP_PROC_BIND, OMP_PLACES set, this sets
 * KMP_AFFINITY=disabled in the environment (threads keep the mask they have), as libgomp behaves; a
 * user's setting wins, and a runtime another library started before ktfp8 loaded keeps its own.
 * No effect with libgomp. */
void ktfp8_openmp_defaults(void);

#endif
