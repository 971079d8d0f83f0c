"""`python -m ktfp8.cpu`: what this CPU, this OS and this build can run, and one verdict line."""
import argparse
import errno
import json
import os
import sys

from . import backends, cpu_quota, numa
from ._native._ext import CPU_IDENTITY

# The level whose absence the verdict explains: the native FP8 path (AVX-512-BF16 + VBMI).
NATIVE_FP8_LEVEL = "avx512bf16"


def _missing(f, needs):
    """What of `needs` this CPU lacks; the OS register state only once the CPU has everything."""
    missing = [name for name in needs if not name.startswith("os_") and not f[name]]
    return missing or [f"OS support for {name[3:].upper()} state (XCR0)" for name in needs if not f[name]]


def report():
    """Everything the text and JSON reports show, as one dict."""
    f = backends.cpu_features()
    usable = backends.available_backends()
    needs, _ = backends.isa_levels()[NATIVE_FP8_LEVEL]
    missing = _missing(f, needs)
    fallback = (f"FP8 MoE will run on the '{usable[0]}' fallback (correct, slower than the "
                "AVX-512-BF16 path).")
    if not missing and any(b in usable for b in ("amx", "avx512_bf16")):
        verdict = "✅ Your CPU supports full AVX512 (F/BF16/VBMI) – FP8 MoE will work!"
    elif not missing:  # the CPU runs the level, so its variants were left out of this build
        verdict = f"⚠️ Your CPU supports full AVX512 (F/BF16/VBMI), but {backends.NATIVE_LEFT_OUT} – {fallback}"
    else:
        verdict = f"⚠️ Your CPU lacks {', '.join(missing)} – {fallback}"
    selected = _selected()
    if selected.startswith("none: "):
        verdict += f" But MoE() refuses ${backends.ENV_BACKEND} now: {selected[len('none: '):]}."
    elif selected != usable[0]:
        verdict += f" ${backends.ENV_BACKEND} forces '{selected}' instead."
    features = [name for name in f if name not in CPU_IDENTITY]
    return {
        "cpu": f["brand"] or f["vendor"],
        "vendor": f["vendor"],
        "family": f["family"], "model": f["model"], "stepping": f["stepping"],
        "flags": {name: bool(f[name]) for name in features if not name.startswith("os_")},
        "os_support": {f"{name[3:]}_state": bool(f[name]) for name in features if name.startswith("os_")},
        "compiled_variants": backends.compiled_variants(),
        "usable_backends": usable,
        "selected_backend": selected,
        "verdict": verdict,
        "numa_nodes": numa.report(),
        "threads": {"default": backends.usable_cores(), "affinity": len(numa.affinity_cpus()),
                    "affinity_cores": backends.affinity_cores(),
                    "cgroup_cpu_quota": cpu_quota.cpu_quota(), "selected": _threads_selected()},
    }


def describe(r):
    """'brand (vendor, family F, model M, stepping S)' of a report(): the brand string alone does not
    name the microarchitecture under a hypervisor (an AMD EPYC VM says 'AMD EPYC' on Zen 1 and Zen 3)."""
    return f"{r['cpu']} ({r['vendor']}, family {r['family']}, model {r['model']}, stepping {r['stepping']})"


def _or_refusal(choose):
    """choose(None), what MoE() takes now without the argument, or "none: why" where MoE() would
    refuse what the environment says."""
    try:
        return choose(None)
    except ValueError as err:
        return f"none: {err}"


def _selected():
    """The backend MoE() picks now: $KTFP8_BACKEND when set, else the best usable one."""
    return _or_refusal(backends.resolve_backend)


def _threads_selected():
    """The thread count MoE() takes now without threads=: $KTFP8_NUM_THREADS or $OMP_NUM_THREADS
    where set, else one per core."""
    return _or_refusal(backends.requested_threads)


def _threads_line(t):
    quota = t["cgroup_cpu_quota"]
    limit = f"cgroup CPU quota {quota:g}" if quota is not None else "no cgroup CPU quota"
    line = (f"Threads without threads=, ${backends.ENV_THREADS} or ${backends.ENV_OMP_THREADS}: {t['default']} "
            f"(one per core: {t['affinity_cores']} cores hold the {t['affinity']} CPUs in this process's "
            f"affinity mask; {limit})")
    selected = t["selected"]
    if isinstance(selected, str):
        return line + f"; MoE() refuses this environment's count: {selected[len('none: '):]}"
    return line if selected == t["default"] else line + f"; this environment sets {selected}"


def _mark(ok):
    return "✅" if ok else "❌"


# the report's non-ASCII characters, for a stdout that cannot encode them (an ASCII locale or pipe)
_ASCII = {"✅": "yes", "❌": "no ", "⚠️": "!!", "–": "-"}


def _encodable(text, out):
    try:
        text.encode(getattr(out, "encoding", None) or "utf-8")
        return True
    except (UnicodeEncodeError, LookupError):
        return False


def print_report(r, out=None):
    lines = [f"CPU: {describe(r)}", "Instruction sets (CPUID):"]
    lines += [f"  {_mark(ok)} {name}" for name, ok in r["flags"].items()]
    lines += ["OS support (XCR0):"]
    lines += [f"  {_mark(ok)} {name}" for name, ok in r["os_support"].items()]
    lines += [f"Compiled variants: {', '.join(r['compiled_variants'])}",
              f"Usable backends (best first): {', '.join(r['usable_backends'])}",
              f"Selected backend: {r['selected_backend']}",
              numa.format_report(r["numa_nodes"]), _threads_line(r["threads"]), r["verdict"]]
    text = "\n".join(lines) + "\n"
    out = out or checked_stdout()
    if not _encodable(text, out):
        for mark, word in _ASCII.items():
            text = text.replace(mark, word)
        text = text.encode("ascii", "replace").decode("ascii")
    out.write(text)


def checked_stdout():
    """sys.stdout, or OSError(EBADF) where the process was started with it closed (`>&-`: None)."""
    if sys.stdout is None:
        raise OSError(errno.EBADF, "it is closed")
    return sys.stdout


class StdoutFailed(Exception):
    """A command-line tool's write to stdout raised the OSError args[0]: raised from deep in a run, its
    main returns stdout_failed(prog, args[0])."""


def stdout_failed(prog, err):
    """The exit status (1) of a command-line tool whose write to stdout raised `err`.  A reader that
    left (`| head -1`: EPIPE) ends the tool quietly, as SIGPIPE ends a C program; any other failure
    (a closed stdout, a full disk) is one line on stderr.  Stdout then points at /dev/null, so that
    Python's flush at exit does not fail again with a traceback."""
    if not isinstance(err, BrokenPipeError):
        print(f"{prog}: error: cannot write to standard output: {err.strerror or err}", file=sys.stderr)
    if sys.stdout is not None:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, sys.stdout.fileno())
            finally:
                os.close(devnull)
        except (OSError, ValueError):
            pass
    return 1


def main(argv=None):
    prog = "python -m ktfp8.cpu"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    r = report()
    try:
        if args.json:
            text = json.dumps(r, indent=2, ensure_ascii=False)
            out = checked_stdout()
            out.write((text if _encodable(text, out) else json.dumps(r, indent=2)) + "\n")
        else:
            print_report(r)
        checked_stdout().flush()
    except OSError as err:
        return stdout_failed(prog, err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
