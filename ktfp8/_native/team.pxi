# Team sizes after fork (team.h): a child forked after ktfp8 ran a thread team runs on one thread;
# and the OpenMP runtime's default thread affinity.

cdef extern from "ktfp8/team.h":
    int ktfp8_forked_after_teams()
    void ktfp8_openmp_defaults()

ktfp8_openmp_defaults()  # before the first team: LLVM's runtime keeps pinned threads pinned (team.h)


def forked_after_teams():
    """True when this process is a child forked after ktfp8 ran a team of two or more OpenMP
    threads, so that every team here runs on one thread."""
    return bool(ktfp8_forked_after_teams())
