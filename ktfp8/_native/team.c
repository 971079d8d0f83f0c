/* Team sizes that survive fork() (see include/ktfp8/team.h). */
#include "ktfp8/team.h"

#include <pthread.h>

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
