"""Starts N ranks on loopback as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1,
a free MASTER_PORT), one process each, under a hard wall-clock limit: past it every rank is killed and
the test fails instead of hanging.

The ranks are forked from a multiprocessing forkserver that imported torch once: a fresh interpreter
per rank would spend seconds of this 2-core machine importing torch every time.  The server never
runs a kernel, so no OpenMP or torch thread pool is forked."""
import multiprocessing
import os
import socket
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PRELOAD = ["torch", "torch.distributed", "transformers", "ktfp8.distributed", "dist_worker"]


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank, world, port):
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")


def _rank_main(env, log_path, target, args):
    with open(log_path, "w") as log:       # the server's stdio belongs to whichever test started it
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    os.environ.clear()                      # the launching test's environment, not the server's
    os.environ.update(env)
    target(*args)


def run_ranks(target, args, world, limit_s, log_dir, env=None):
    """Runs target(*args) as ranks 0..world-1 (target: a module-level function), each rank's output in
    log_dir/rank{r}.log, `env` added to its environment; returns [(exit code, output)] per rank."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    port = free_port()
    logs = [os.path.join(log_dir, f"rank{r}.log") for r in range(world)]
    envs = [{**os.environ, **rank_env(r, world, port), **(env or {})} for r in range(world)]
    procs = [ctx.Process(target=_rank_main, args=(envs[r], logs[r], target, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    outputs = [open(log).read() if os.path.exists(log) else "" for log in logs]
    if hung:
        pytest.fail(f"ranks {hung} still running after {limit_s} s (a hang):\n" +
                    "\n".join(f"--- rank {r}:\n{out[-2000:]}" for r, out in enumerate(outputs)))
    return [(p.exitcode, out) for p, out in zip(procs, outputs)]
