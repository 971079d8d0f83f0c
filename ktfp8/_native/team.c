/* Team sizes that survive fork(), and the OpenMP runtime's thread affinity (see include/ktfp8/team.h). */
#include "ktfp8/team.h"

#include <omp.h> /* KMP_VERSION_MAJOR */
#include <pthread.h>
#include <stdlib.h>

static pthread_once_t fork_handler_once = PTHREAD_ONCE_INIT;
static volatile int forked_after_teams; /* set in a child only, before it runs anything else */

static void mark_child(void) { forked_after_teams = 1; }

/* Registered on the first request for a real team, so that a fork before any team (when libgomp
 * has no pool to lose) leaves the child free to use every thread. */
static void register_fork_handler(void) { pthread_atfork(NULL, NULL, mark_child); }

int ktfp8_team_size(int requested) {
    if (requested <= 1 || forked_after_teams) return 1;
    pthread_once(&fork_handler_once, register_fork_handler);
    return requested;
}

int ktfp8_forked_after_teams(void) { return forked_after_teams; }

#ifdef KMP_VERSION_MAJOR
/* A child forked after the runtime ran starts it again, from the environment, and libomp 19 then
 * fails an assertion (kmp_affinity.cpp: __kmp_avail_proc == ...get_num_hw_threads()) when that says
 * KMP_AFFINITY=disabled: tests/test_concurrency.py's forked worker, in a clang build.  The child
 * gets the environment it would have had without ktfp8 (and runs its teams on one thread). */
static void forget_kmp_affinity(void) { unsetenv("KMP_AFFINITY"); }
#endif

void ktfp8_openmp_defaults(void) {
#ifdef KMP_VERSION_MAJOR /* LLVM's or Intel's runtime (GCC's omp.h does not define it) */
    /* The environment, not kmp_set_defaults: that one, called after the runtime has started (another
     * library ran a team first), prints "OMP: Warning #225: KMP_AFFINITY must be set prior to first
     * parallel region"; the runtime reads the environment once, when it starts. */
    if (!getenv("KMP_AFFINITY") && !getenv("OMP_PROC_BIND") && !getenv("OMP_PLACES")) {
        setenv("KMP_AFFINITY", "disabled", 0);
        pthread_atfork(NULL, NULL, forget_kmp_affinity);
    }
#endif
}
