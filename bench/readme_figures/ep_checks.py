"""The README's expert-parallel figures: what each call's input check costs and how soon a lost rank
becomes an error.
- The check hashes (CRC-32) every 64th column of x, topk_ids and topk_weights: timed at T = 512,
  hidden 7168, top-8 (DeepSeek-V3's width), against hashing all of x; medians of --rounds.
- A lost rank: tests/dist_worker.py's `fail` scenario on 2 ranks (loopback, 3 s timeout), as
  tests/test_distributed.py runs it: the last rank SIGKILLs itself ("kill") or never calls again
  ("stall"); the seconds rank 0 waited before its ExpertParallelError, --launches times each.

    python bench/readme_figures/ep_checks.py [--rounds 200] [--launches 3]"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]    # a source checkout built in place; the tests' ranks
import numpy as np  # noqa: E402

import dist_worker  # noqa: E402
from dist_launch import run_ranks  # noqa: E402
from ktfp8.distributed import _crc32, _InputCheck  # noqa: E402


def median_ms(fn, rounds):
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def input_check(rounds):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 7168), dtype=np.float32)
    ids = rng.integers(0, 256, (512, 8), dtype=np.int64)
    weights = rng.random((512, 8), dtype=np.float32)
    stride = _InputCheck.X_STRIDE
    checked = median_ms(lambda: [_crc32(a) for a in (x[:, ::stride], ids, weights)], rounds)
    whole = median_ms(lambda: _crc32(x), rounds)
    print(f"input check at T = 512, hidden 7168: {checked:.3f} ms (x[:, ::{stride}], topk_ids, topk_weights); "
          f"all of x {whole:.2f} ms")


def lost_rank(how, launches):
    waits = []
    for _ in range(launches):
        with tempfile.TemporaryDirectory() as out:
            run_ranks(dist_worker.main, (how, out), 2, 90, out)
            report = json.loads((Path(out) / "rank0.json").read_text())
        assert report["error"] is not None, "the call succeeded without the lost rank"
        waits.append(report["seconds"])
    print(f"lost rank ({how}, timeout {dist_worker.FAIL_TIMEOUT_S} s): rank 0 raised after "
          + ", ".join(f"{s:.2f}" for s in waits) + " s")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=200, help="timed calls of the input check (default 200)")
    p.add_argument("--launches", type=int, default=3, help="2-rank launches per way of losing one (default 3)")
    args = p.parse_args(argv)
    input_check(args.rounds)
    for how in ("kill", "stall"):
        lost_rank(how, args.launches)


if __name__ == "__main__":
    main()
