"""Two builds of ktfp8 timed side by side in one process: how the "new / old" figures of
docs/tuning-notes.md are measured.

    python tools/ab_builds.py OLD NEW [--tokens 512] [--threads 2] [--rounds 12] [--format bf16]

OLD and NEW are source trees with ktfp8 built in place (`python setup.py build_ext --inplace`), e.g.
a `git worktree` of the old commit beside this one.  Each tree's `ktfp8` package, compiled modules
included, is copied into a temporary folder under a name of its own and imported from there (the
package imports itself relatively), so both builds live in this process at once.  Each walks its own
copies of the same random layer, weights from DRAM as `python -m ktfp8.bench` walks them; every round
times a few calls of each build, the two in turn, the first one alternating.  It prints each build's
median time per call and the median of the per-round ratios new / old: the drift of a shared machine
over minutes cancels in a round's ratio.

Give the same tree twice (A/A) to see the noise.  Code placement alone moved the figures by up to
about 6 % on the Zen 3 VM, 10 % at T = 1 before functions started on 64-byte lines
(docs/tuning-notes.md): a smaller difference between two builds is not yet a property of either.
"""
import argparse
import importlib
import math
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from ktfp8.generate import _positive  # the command lines' positive-integer check

CALLS = {1: 8, 4: 6, 16: 4, 64: 3}  # timed calls per round and build, by T (else 2)


def built_package(tree):
    """tree/ktfp8, checked to hold a compiled _ext module."""
    pkg = Path(tree) / "ktfp8"
    if not (pkg / "__init__.py").is_file():
        raise SystemExit(f"ab_builds: {tree} holds no ktfp8 package (expected {pkg}/__init__.py)")
    if not list((pkg / "_native").glob("_ext*.so")):
        raise SystemExit(f"ab_builds: {pkg} is not built: run `python setup.py build_ext --inplace` in {tree}")
    return pkg


def import_copy(pkg, name, folder):
    """pkg copied to folder/name (the test-only module and its sources left out) and imported as name."""
    shutil.copytree(pkg, Path(folder) / name, ignore=shutil.ignore_patterns("__pycache__", "_testing*", "testing"))
    parts = ("bench.run", "bench.layers", "bench.__main__", "_native._ext")
    return {part: importlib.import_module(f"{name}.{part}") for part in parts}


def layer_of(spec, build):
    """The layer `spec` names, as `python -m ktfp8.bench --layer` reads it (in that build)."""
    try:
        return build["bench.__main__"]._layer(spec)
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"ab_builds: {e}") from None


def main(argv=None):
    p = argparse.ArgumentParser(prog="tools/ab_builds.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", help="source tree of the old build (ktfp8 built in place)")
    p.add_argument("new", help="source tree of the new build")
    p.add_argument("--tokens", type=_positive, default=512, help="T, tokens per call (default 512)")
    p.add_argument("--threads", type=_positive, default=2)
    p.add_argument("--rounds", type=_positive, default=12)
    p.add_argument("--format", default="fp8_per_channel", choices=("fp8_per_channel", "fp8_block", "bf16"))
    p.add_argument("--layer", default="bench",
                   help="as python -m ktfp8.bench --layer: 'bench' (the default) or 'E,top_k,hidden,intermediate'")
    args = p.parse_args(argv)
    packages = {"old": built_package(args.old), "new": built_package(args.new)}

    with tempfile.TemporaryDirectory(prefix="ktfp8-ab-") as folder:
        sys.path.insert(0, folder)
        builds = {side: import_copy(pkg, f"ktfp8_ab_{side}", folder) for side, pkg in packages.items()}
        assert builds["old"]["_native._ext"].__file__ != builds["new"]["_native._ext"].__file__
        calls = CALLS.get(args.tokens, 2)
        layers = {side: layer_of(args.layer, mods) for side, mods in builds.items()}
        # copies as python -m ktfp8.bench walks them (4x L3), each build in half the memory it gives a side
        memory = min(4 * 10**9, builds["old"]["bench.run"].available_memory() // 3) // 2
        walks, ms = {}, {"old": [], "new": []}
        try:
            for side, mods in builds.items():
                R, L = mods["bench.run"], mods["bench.layers"]
                walks[side] = R.build_walk(R._ktfp8_factory(None), layers[side],
                                           L.random_experts(layers[side], args.format), args.threads, args.tokens,
                                           L.WALK_L3_MULTIPLE * (L.l3_bytes() or 0), memory)
            for r in range(args.rounds):
                for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    R, L = builds[side]["bench.run"], builds[side]["bench.layers"]
                    walk, layer = walks[side], layers[side]
                    x = L.activations(layer, args.tokens, seed=r)
                    draws = L.routing_rounds(layer, args.tokens, calls + 1, seed=r * 7 + args.tokens,
                                             copies=len(walk.copies))
                    ms[side].append(statistics.median(R.time_calls(walk, x, draws, math.inf)) * 1e3)
        finally:
            for walk in walks.values():
                walk.close()
    ratio = statistics.median(new / old for old, new in zip(ms["old"], ms["new"]))
    print(f"T={args.tokens} threads={args.threads} {args.format} {args.rounds} rounds: "
          f"old {statistics.median(ms['old']):.3f} ms  new {statistics.median(ms['new']):.3f} ms  "
          f"new/old {ratio:.3f} (median of per-round ratios)")


if __name__ == "__main__":
    main()
