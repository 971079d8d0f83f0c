"""python -m ktfp8.bench [--quick]: ktfp8 beside kt-kernel, PyTorch and NumPy on this machine.

Prints the results table (fractions of the measured roofline), ktfp8's speed-ups, scaling tables and
the goals, and writes bench-results.json, bench-results.txt and bench-results.png into --out (default:
this folder).  Every side walks distinct copies of the layer totalling at least 4x the L3 cache, as a
model's forward walks its layers, so weights come from DRAM.  The goals that set a measurement against
another or against a limit (decode at T=1, T=64 against the memory floor, T=512 against the compute
peak, the default backend against the others, ktfp8 against the peers at T=64 and T=512) come from
interleaved steps after the table (interleaved.py, backend_choice.py, peer_rounds.py), not from its
rows (the peer comparisons fall back to the rows where that step could not time the peer)."""
import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import sys
import tempfile

from .. import __version__, backends, cpu, cpu_quota, numa
from ..config import MAX_SIZE, check_threads
from . import layers as L
from . import backend_choice, interleaved, peer_rounds, report
from .run import Plan, Runner
from .sides import available_memory

PROG = "python -m ktfp8.bench"

# --quick times the backends other than the default in FP8 per-channel only, the format the default
# choice is judged in (backend_choice.py): on the Intel Xeon VM with AMX (4 backends) their BF16 and
# block-wise rows took about 90 s (5 min 53 s without the plot before, 4 min 17 s with it after).
QUICK = dict(tokens=[1, 4, 16, 64, 512], layers=["bench"], case_seconds=2.0, max_call_seconds=10.0,
             read_buffer_bytes=1 << 28, other_backend_formats=("fp8_per_channel",))
FULL = dict(tokens=[1, 4, 16, 64, 512, 2048], layers=["bench", "deepseek-v3"], case_seconds=20.0,
            max_call_seconds=30.0, read_buffer_bytes=1 << 30, other_backend_formats=L.FORMATS)


def _int_list(text):
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _layer(spec):
    if spec == "bench":
        return L.BENCH_LAYER
    if spec == "deepseek-v3":
        return L.deepseek_v3_slice()
    try:
        E, k, H, I = (int(v) for v in spec.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layer takes 'bench', 'deepseek-v3' or 'E,top_k,hidden,intermediate', "
                                         f"got {spec!r}") from None
    if min(E, k, H, I) <= 0 or k > E or max(E, H, I) > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"--layer {spec!r}: sizes must be positive and at most {MAX_SIZE}, and "
                                         f"top_k <= E")
    return L.Layer(f"E={E} top-{k} H={H} I={I}", E, k, H, I)


def parse_args(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="benchmark layer only, T up to 512, short cases, the backends other than the default in "
                        "fp8_per_channel only unless --formats is given (minutes)")
    p.add_argument("--layer", action="append", type=_layer, dest="layers",
                   help="'bench' (E=64 top-8 H=2048 I=768), 'deepseek-v3' (a slice that fits a quarter of RAM) "
                        "or E,top_k,hidden,intermediate; repeatable")
    p.add_argument("--tokens", type=_int_list, help="token counts T, e.g. 1,4,16,64,512,2048")
    p.add_argument("--threads", type=_int_list,
                   help=f"thread counts (default 1, one per core and, on an SMT machine but for --quick, one "
                        f"per CPU: {','.join(map(str, default_thread_counts(quick=False)))})")
    p.add_argument("--formats", type=lambda s: s.split(","), help=f"subset of {','.join(L.FORMATS)}")
    p.add_argument("--backends", type=lambda s: s.split(","),
                   help="ktfp8 backends (default: every usable one but the scalar 'reference')")
    p.add_argument("--no-peers", action="store_true", help="time ktfp8 only")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    p.add_argument("--all-backends", action="store_true",
                   help="plot every ktfp8 backend timed (default: the default backend and the peers)")
    p.add_argument("--out", default=".", help="folder for bench-results.{json,txt,png} (default: here)")
    args = p.parse_args(argv)
    for f in args.formats or []:
        if f not in L.FORMATS:
            p.error(f"--formats: unknown format {f!r}; choose from {', '.join(L.FORMATS)}")
    usable = backends.available_backends()
    for b in args.backends or []:
        if b not in usable:
            p.error(f"--backends: {b!r} is not usable here; usable: {', '.join(usable)}")
    why = _bad_threads(args.threads) or _bad_env_backend()   # both ended a started run in a traceback
    if why:
        p.error(why)
    for name in ("formats", "backends", "layers"):  # a repeat would be timed twice, its rows doubled
        if getattr(args, name):
            setattr(args, name, list(dict.fromkeys(getattr(args, name))))
    why = _does_not_fit(args)
    if why:
        p.error(why)
    if not os.path.isdir(args.out):
        p.error(f"--out: {args.out!r} is not a folder")
    why = _cannot_write_into(args.out)     # say so now, not after a run of minutes
    if why:
        p.error(f"--out: cannot write into {args.out!r}: {why}")
    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:  # say so now, not after the run
        p.error("the plot needs matplotlib, which is not installed: pip install matplotlib, or pass --no-plot")
    return args


def _bad_threads(threads):
    """Why a --threads count is more than a call may ask for (config.max_threads()), or None: the limits
    measurement refused it only after the run had started."""
    try:
        for n in threads or []:
            check_threads("--threads", n)
    except ValueError as err:
        return str(err)
    return None


def _bad_env_backend():
    """Why $KTFP8_BACKEND names no backend this machine runs (ktfp8.backends' own words), or None.  The
    default backend is the one the table stars and the goals judge, with or without --backends, and each
    step asks for it: a bad name used to end the run in a traceback, after the limits were measured."""
    try:
        backends.variant()
    except (TypeError, ValueError) as err:
        return str(err)
    return None


def _does_not_fit(args):
    """Why a layer's weights or a call's activations cannot fit in the memory free now (a sentence), or
    None: found here, not after the limits were measured, as a MemoryError traceback."""
    preset = QUICK if args.quick else FULL
    layers = args.layers or [_layer(s) for s in preset["layers"]]
    formats = args.formats or L.FORMATS
    free = available_memory()
    for layer in layers:
        # as drawn and as packed: both are held while a MoE packs.  The drawn bytes alone are checked first:
        # the packer refuses to size a layer past 2**59 weights, far past any memory.
        drawn = {f: layer.experts * layer.weights_per_expert * L.BYTES_PER_WEIGHT[f] for f in formats}
        weights, held = max(drawn.values()), "as drawn"
        if weights <= free:
            weights, held = max(drawn[f] + layer.packed_bytes(f) for f in formats), "as drawn and as packed"
        if weights > free:
            return (f"--layer: the weights of {layer.name!r} take {weights / 1e9:.1f} GB ({held}), more than the "
                    f"{free / 1e9:.1f} GB of memory available now")
        T = max(args.tokens or preset["tokens"])
        draw = T * layer.hidden * 8   # a call's activations are drawn in float64
        if draw > free:
            return (f"--tokens: the activations of a call of T={T} on {layer.name!r} take {draw / 1e9:.1f} GB, "
                    f"more than the {free / 1e9:.1f} GB of memory available now")
    return None


def default_thread_counts(quick):
    """1, the default count (one thread per core) and, where SMT gives the cores more CPUs, one thread
    per CPU, so that the default is timed beside the count it leaves out (each within the CPU quota);
    --quick keeps to its ~5 minutes with the first two."""
    counts = {1, backends.usable_cores()}
    if not quick:
        counts.add(cpu_quota.within_quota(len(numa.affinity_cpus())))
    return sorted(counts)


def make_plan(args):
    preset = QUICK if args.quick else FULL
    formats = tuple(args.formats or L.FORMATS)
    return Plan(layers=args.layers or [_layer(s) for s in preset["layers"]],
                tokens=sorted(set(args.tokens or preset["tokens"])),
                threads=sorted(set(args.threads or default_thread_counts(args.quick))),
                formats=formats,
                backends=args.backends or _default_backends(),
                other_backend_formats=formats if args.formats else preset["other_backend_formats"],
                peers=not args.no_peers, case_seconds=preset["case_seconds"],
                max_call_seconds=preset["max_call_seconds"],
                read_buffer_bytes=preset["read_buffer_bytes"])


def _default_backends():
    """Every usable backend but the scalar reference (the oracle, never a contender) unless it is the
    default one, and the default one even where it is not among them: an emulated variant that
    $KTFP8_BACKEND names is the backend the table stars and the goals judge."""
    default = backends.resolve_backend(None)
    usable = [b for b in backends.available_backends() if b != "reference" or b == default]
    return usable if default in usable else [default] + usable


def cores_and_cpus(cores, cpus):
    """'8 cores' or, on an SMT machine, '8 cores (16 CPUs)': this process's, for a report's header."""
    return f"{cores} cores" + (f" ({cpus} CPUs)" if cpus != cores else "")


def _machine():
    info = cpu.report()
    return dict(cpu=cpu.describe(info), cores=backends.affinity_cores(), cpus=len(numa.affinity_cpus()),
                ram_gb=round(L.ram_bytes() / 2**30, 1), l3_mib=round((L.l3_bytes() or 0) / 2**20, 1),
                flags=[k for k, v in info["flags"].items() if v], usable_backends=info["usable_backends"],
                python=platform.python_version(), platform=platform.platform())


def _cannot_write_into(folder):
    """Why no file can be created in `folder` (the error's words), or None.  Creating one is the test:
    root ignores modes."""
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".bench-"):
            return None
    except OSError as err:
        return err.strerror


def _write_atomically(path, write):
    """write(file) fills a temporary file in the same folder, which then replaces `path`: a crash
    never leaves a half-written result."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".bench-")
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a results file is as readable as any other
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class _ResultsNotWritten(Exception):
    """A results file could not be written at the end of the run (the table was printed)."""


def _say(*parts):
    try:
        print(*parts, file=cpu.checked_stdout(), flush=True)    # print() to a closed stdout says nothing
    except OSError as err:
        raise cpu.StdoutFailed(err) from None


def main(argv=None):
    args = parse_args(argv)
    written = []
    try:
        _run(args, written)
    except KeyboardInterrupt:
        done = f"wrote only {', '.join(written)}" if written else "wrote nothing"
        print(f"{PROG}: interrupted; {done} into {args.out}", file=sys.stderr)
        return 130
    except cpu.StdoutFailed as failed:
        return cpu.stdout_failed(PROG, failed.args[0])
    except _ResultsNotWritten as failed:
        done = f"; wrote only {', '.join(written)}" if written else ""
        print(f"{PROG}: error: {failed}{done}", file=sys.stderr)
        return 1
    return 0


def _run(args, written):
    """The benchmark of parse_args' `args`; the names of the result files go into `written` as each
    is complete."""
    plan = make_plan(args)
    runner = Runner(plan, log=_say).run()
    limits = {str(n): dataclasses.asdict(r) for n, r in runner.limits.items()}
    rows = runner.results
    goal_layer = L.BENCH_LAYER.name if any(r["layer"] == L.BENCH_LAYER.name for r in rows) else None
    default = backends.resolve_backend(None)
    side_by_side = interleaved.run(plan, L.BENCH_LAYER, default, log=_say)
    choice = backend_choice.run(plan, L.BENCH_LAYER, default, rows, log=_say)
    against_peers = peer_rounds.run(plan, L.BENCH_LAYER, default, log=_say)
    goal_rows = report.goals(rows, limits, goal_layer, default, side_by_side, choice, against_peers) if goal_layer else []
    results = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        ktfp8=__version__, machine=_machine(), versions=runner.versions, limits=limits, default_backend=default,
        layers=[dataclasses.asdict(layer) for layer in plan.layers],
        plan=dict(tokens=plan.tokens, threads=plan.threads, formats=list(plan.formats), backends=plan.backends,
                  other_backend_formats=list(plan.other_backend_formats), peers=plan.peers, quick=args.quick,
                  walk_bytes=plan.walk_bytes,
                  walk_memory_bytes=plan.walk_memory_bytes, all_backends=args.all_backends),
        timing=("median wall time of one call (routing freshly drawn per call, calls walking the side's "
                "copies of the layer in turn, one warm-up call first); kt-kernel: submit + sync of one "
                "forward_task, its worker pool (shared by its copies) built per thread count"),
        results=rows, skipped=runner.skipped, speedups=report.speedups(rows), interleaved=side_by_side,
        backend_choice=choice, peer_rounds=against_peers,
        goals=goal_rows)
    machine = results["machine"]
    header = (f"{machine['cpu']}: {cores_and_cpus(machine['cores'], machine['cpus'])}, L3 {machine['l3_mib']:.0f} "
              f"MiB, {machine['ram_gb']} GiB; ktfp8 {__version__}, {results['date']}")
    goals_text = (report.goals_lines(goal_rows) if goal_layer else
                  f"goals: not judged, since they are set on the benchmark layer ({L.BENCH_LAYER.name}), which "
                  f"this run's --layer leaves out")
    text = "\n\n".join(part for part in (
        header, report.results_table(rows, limits, default, machine['l3_mib']), report.scaling_table(rows),
        goals_text,
        "skipped:\n" + "\n".join(f"  {s['side']} [{s['format']}] on {s['layer']}: {s['reason']}"
                                 for s in runner.skipped) if runner.skipped else "") if part)
    # the files first: a reader of stdout that leaves during the table (| head) does not cost them
    try:
        for name, content in (("bench-results.json", json.dumps(results, indent=1)), ("bench-results.txt", text)):
            _write_atomically(os.path.join(args.out, name), lambda f: f.write((content + "\n").encode()))
            written.append(name)
        if not args.no_plot:
            from . import plot
            _write_atomically(os.path.join(args.out, "bench-results.png"),
                              lambda f: plot.save(results, f, all_backends=args.all_backends))
            written.append("bench-results.png")
    except OSError as err:        # the folder changed during the run: the table still reaches stdout
        _say("\n" + text)
        raise _ResultsNotWritten(f"cannot write into {args.out}: {err}") from None
    _say("\n" + text)
    _say(f"wrote {', '.join(os.path.join(args.out, w) for w in written)}")


if __name__ == "__main__":
    sys.exit(main())
