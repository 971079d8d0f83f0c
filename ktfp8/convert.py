"""python -m ktfp8.convert (console script ktfp8-convert): a Hugging Face safetensors checkpoint in BF16 /
FP16 / FP32, or block-wise FP8, to FP8 E4M3 with per-channel (or block-wise) scales.

    python -m ktfp8.convert --input-type bf16 --input-path IN --output-path OUT \\
        --quant-config '{"method": "FP8", "per_channel": true}' [--all-linear] [--verify]

Safety: the input is only read; the output is built in a hidden temporary folder next to OUT and
renamed into place at the very end (config.json is written last), so an interrupted run leaves no
folder that looks like a finished checkpoint; a non-empty OUT is replaced only with --overwrite, and
only if it is a model folder."""
import argparse
import concurrent.futures as cf
import contextlib
import glob
import json
import logging
import math
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path

from .config import check_threads
from .cpu import StdoutFailed, checked_stdout, stdout_failed
from .convert_args import parse_quant_config, parse_size
from .convert_items import INPUT_DTYPES, input_nbytes
from .convert_plan import build_plan, natural_key
from .convert_work import VERIFY_CHUNK_BYTES, ShardSet, chunks, run_chunk, sqnr_db, verify_chunk
from .loader import INDEX_NAME, Checkpoint
from .safetensors_io import SafetensorsError, SafetensorsFile, tensor_nbytes

log = logging.getLogger("ktfp8.convert")

PARTIAL_TAG = ".ktfp8-partial-"
REPLACED_TAG = ".ktfp8-replaced-"      # an old output moved aside by --overwrite, deleted after the swap
PARTIAL_MARKER = "KTFP8_CONVERSION_IN_PROGRESS"
# Files not copied: the input's weights (replaced by ours, or stale duplicates in other formats) and
# config.json (rewritten with a quantization_config).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".gguf", ".h5", ".msgpack", ".ckpt")
_SKIP_FILES = ("config.json", INDEX_NAME, "pytorch_model.bin.index.json")
_SKIP_DIRS = (".git", ".cache")
VERIFY_WORST = 10
DEFAULT_MIN_SQNR_DB = 20.0     # --verify's threshold: FP8 E4M3 of well-scaled weights reads about 31 dB


class ConvertError(Exception):
    """A refusal or failure explained to the user (exit status 1)."""


def _quant_config_arg(text):
    try:
        return parse_quant_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size_arg(text):
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _decibels_arg(text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):     # nan would fail every tensor, after the whole conversion
        raise argparse.ArgumentTypeError(f"must be a finite number of decibels, got {text!r}")
    return value


def _threads_arg(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    try:
        return check_threads("the thread count", value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser():
    p = argparse.ArgumentParser(
        prog="ktfp8-convert", description="Convert a Hugging Face safetensors checkpoint to FP8 E4M3 with "
        "per-channel (compressed-tensors) or block-wise (DeepSeek-V3 style) scales.")
    p.add_argument("--input-type", required=True, choices=sorted(INPUT_DTYPES),
                   help="dtype of the weights to quantize; fp8 = block-wise FP8 with weight_scale_inv")
    p.add_argument("--input-path", "--input-bf16-hf-path", dest="input_path", required=True,
                   help="input model folder (read only)")
    p.add_argument("--output-path", "--output-fp8-hf-path", dest="output_path", required=True,
                   help="output model folder (must not exist or be empty, unless --overwrite)")
    p.add_argument("--quant-config", type=_quant_config_arg, default=parse_quant_config('{"method":"FP8"}'),
                   help='JSON, e.g. \'{"method":"FP8","per_channel":true}\' (default) or '
                        '\'{"method":"FP8","per_channel":false,"group_size":128}\' for 128x128 blocks')
    p.add_argument("--all-linear", action="store_true",
                   help="quantize every Linear of the decoder layers, not only expert projections "
                        "(routers, embeddings, a vision or audio encoder's layers and lm_head stay as they are)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--threads", type=_threads_arg, default=None,
                   help="worker threads (default: $KTFP8_NUM_THREADS, else the first entry of "
                        "$OMP_NUM_THREADS, else all cores this process may use)")
    p.add_argument("--max-shard-size", type=_size_arg, default=parse_size("5GB"),
                   help="largest output shard, e.g. 5GB (default), 500MB, 2GiB")
    p.add_argument("--verify", action="store_true",
                   help="re-read the output, print each quantized tensor's SQNR (dB) and the worst ones, "
                        "check copied tensors byte for byte")
    p.add_argument("--verify-min-sqnr", type=_decibels_arg, default=None, metavar="DB",
                   help=f"verify (implies --verify) and fail, writing nothing, if a tensor's SQNR is below DB "
                        f"(default {DEFAULT_MIN_SQNR_DB:g})")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    # a threshold asks for the check: alone it was ignored, and the output written unchecked
    args.verify = args.verify or args.verify_min_sqnr is not None
    if args.verify_min_sqnr is None:
        args.verify_min_sqnr = DEFAULT_MIN_SQNR_DB
    _setup_logging()
    previous = {}
    if threading.current_thread() is threading.main_thread():   # clean up on kill -TERM too
        previous = {s: signal.signal(s, _SIGNALS.handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        convert(args)
        return 0
    except _InterruptedWhenPublished as e:
        log.error("interrupted after %s was written in full and put in place", args.output_path)
        return 128 + e.signum
    except KeyboardInterrupt as e:
        log.error("interrupted; nothing was written to %s", args.output_path)
        return 128 + getattr(e, "signum", signal.SIGINT)      # the shell's status for a signal
    except StdoutFailed as e:       # --verify's report, the one thing it prints there: nothing is published
        status = stdout_failed("ktfp8-convert", e.args[0])
        log.error("nothing was written to %s", args.output_path)
        return status
    except (ConvertError, SafetensorsError, ValueError, OSError) as e:
        log.error("error: %s", e)
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, unwound like Ctrl-C so that the same cleanup runs."""
    signum = signal.SIGTERM


class _InterruptedWhenPublished(KeyboardInterrupt):
    """A Ctrl-C or SIGTERM that arrived after the output folder was complete and in place."""

    def __init__(self, interrupt):
        self.signum = getattr(interrupt, "signum", signal.SIGINT)     # Ctrl-C, or _Terminated's
        super().__init__(self.signum)


def _interrupt(signum):
    return _Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


class _SignalGate:
    """main()'s handler of SIGINT and SIGTERM: raises KeyboardInterrupt or _Terminated in the main thread,
    unwound by the same cleanup, except while that thread waits for the workers.  An exception that a
    handler raises inside threading.Condition.wait can land after the wait has released the condition's
    lock and before it takes it again; the `with` around it then ends in "RuntimeError: release unlocked
    lock" instead (CPython issue 118433; seen in CI: kill -TERM left a traceback and status 1, not 143).
    A signal that comes during the wait is held and raised once the wait returns, which it does every
    POLL_S seconds."""

    POLL_S = 0.1

    def __init__(self):
        self.waiting = False
        self.held = None

    def handler(self, signum, frame):
        if self.waiting:
            self.held = signum
        else:
            raise _interrupt(signum)

    def wait(self, futures):
        """The futures of `futures` that are done, once one is; raises a signal held meanwhile."""
        self.waiting = True
        try:
            done = set()
            while not done and self.held is None:
                done, _ = cf.wait(futures, timeout=self.POLL_S, return_when=cf.FIRST_COMPLETED)
        finally:
            self.waiting = False
        if self.held is not None:
            signum, self.held = self.held, None
            raise _interrupt(signum)
        return done


_SIGNALS = _SignalGate()


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (it may be replaced after setup, e.g. by pytest)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def _setup_logging():
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("ktfp8-convert: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def convert(args):
    from .backends import default_threads
    src = Path(args.input_path)
    dst = _check_paths(src, Path(args.output_path), args.overwrite)
    threads = default_threads(args.threads)
    checkpoint = Checkpoint(src)
    plan = build_plan(checkpoint, args.input_type, args.quant_config, args.all_linear, args.max_shard_size)
    _check_writable(dst.parent, Path(args.output_path))
    other_files = _other_files(src, set(checkpoint.weight_map.values()))
    total_in = sum(input_nbytes(i, checkpoint) for i in plan.items)
    log.info("%s: %d tensors (%d FP8 weights out, %s), %.2f GB -> %d shard(s), %d threads",
             src, len(plan.items), len(plan.quantized) + _passthrough_count(plan),
             "per-channel" if args.quant_config.per_channel else f"block {list(args.quant_config.block)}",
             total_in / 1e9, len(plan.shards), threads)
    _warn_fused_split(checkpoint, plan)
    _remove_stale_partials(dst)
    tmp = dst.parent / f".{dst.name}{PARTIAL_TAG}{os.getpid()}"
    tmp.mkdir()
    (tmp / PARTIAL_MARKER).write_text("ktfp8.convert is writing this folder; it is incomplete.\n")
    try:
        started = time.monotonic()
        names = _write_shards(checkpoint, plan, args.quant_config, tmp, threads, total_in)
        elapsed = time.monotonic() - started
        if args.verify:
            _verify(checkpoint, plan, args.quant_config, tmp, names, threads, args.verify_min_sqnr)
        _copy_other_files(other_files, tmp)
        _write_index(plan, names, tmp)
        _write_config(checkpoint, plan, tmp)     # last: a folder without config.json is no checkpoint
        (tmp / PARTIAL_MARKER).unlink()
        _fsync_dir(tmp)
        _publish(tmp, dst, args.overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with _interrupts_after_publishing():
        _remove_stale_replaced(dst)
        out_bytes = sum(os.path.getsize(dst / f) for f in set(names.values()))
        log.info("wrote %s: %d shard(s), %.2f GB; read %.2f GB in %.1f s (%.0f MB/s of input)", dst,
                 len(plan.shards), out_bytes / 1e9, total_in / 1e9, elapsed, total_in / 1e6 / max(elapsed, 1e-9))


def _warn_fused_split(checkpoint, plan):
    """Fused experts (Mistral 4's, Qwen3-VL-MoE's) are written per expert, a layout that ktfp8 reads but
    not transformers' own model class of that type: its from_pretrained would find those experts
    missing and initialise them randomly, a model that runs and answers nonsense.  Say so up front."""
    stacks = sorted({i.src.rsplit(".", 1)[0] for i in plan.items if i.fused}, key=natural_key)
    if not stacks:
        return
    model_type = (checkpoint.hf_config() or {}).get("model_type") or "this model type"
    log.warning("warning: the fused experts of %d layer(s) (%s%s) are written per expert "
                "(...experts.<e>.gate_proj.weight, up_proj, down_proj): the output is for ktfp8 "
                "(ktfp8.hf.from_pretrained, FP8SafeTensorLoader); transformers' own from_pretrained of %s "
                "expects fused gate_up_proj / down_proj, would find those experts missing and initialise them "
                "randomly", len(stacks), stacks[0], ", ..." if len(stacks) > 1 else "", model_type)


def _passthrough_count(plan):
    return sum(1 for i in plan.items if i.action == "copy" and i.out_dtype == "F8_E4M3")


# -- folders ----------------------------------------------------------------------------------------
def _check_paths(src, dst, overwrite):
    """Checks the folders before any work; returns the output folder with symlinks resolved: the
    finished folder is renamed into the place a link points to (the link then shows it), since
    renaming over the link itself would swap out the link and not the folder."""
    if not src.is_dir():
        raise ConvertError(f"input folder {src} does not exist or is not a directory")
    s, d = _resolved(src, "input"), _resolved(dst, "output")
    if d == s or s in d.parents or d in s.parents:
        raise ConvertError(f"output {dst} must be outside the input {src} (and not contain it)")
    cwd = Path.cwd().resolve()
    if d == cwd or d in cwd.parents:
        # the output is replaced as a whole: this process and its shell would be left in a deleted folder
        raise ConvertError(f"output {dst} is (or contains) the current directory; run from outside it")
    if d.exists():
        if not d.is_dir():
            raise ConvertError(f"output {dst} exists and is not a directory")
        if os.path.ismount(d):     # a volume (docker -v): it cannot be removed or renamed, as _publish does
            raise ConvertError(f"output {dst} is a mount point: the output is written beside it and renamed "
                               f"into its place, which a mount point cannot take; give a folder inside it "
                               f"(e.g. {dst / src.name})")
        if any(d.iterdir()):
            if not overwrite:
                raise ConvertError(f"output folder {dst} is not empty; pass --overwrite to replace it")
            _check_replaceable(d, dst)
    return d


def _check_replaceable(folder, shown):
    """--overwrite deletes everything in the folder it replaces: only a model folder (config.json or
    safetensors at its top, as any earlier output has), not a folder of other files named by mistake."""
    if not ((folder / "config.json").exists() or any(folder.glob("*.safetensors"))):
        raise ConvertError(f"output folder {shown} holds no config.json or *.safetensors: it is no model "
                           f"folder, and --overwrite would delete everything in it; nothing replaced, remove "
                           f"it yourself or give another output path")


def _resolved(path, what):
    """path.resolve(), or ConvertError where its symlinks loop (Python 3.11-3.12 raise RuntimeError
    there, later versions OSError)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as e:
        raise ConvertError(f"{what} {path}: its symlinks cannot be followed ({e})") from None


def _check_writable(parent, dst):
    """Makes the folder the output goes into (as mkdir -p) and tries a folder in it, as the run's own
    temporary folder will be made there: a folder it cannot write into is refused by its name before
    any work, not by the temporary folder's name.  After the input's checks, so that a refused input
    leaves no new folders behind."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=f".{dst.name}.ktfp8-probe-", dir=parent))
    except OSError as e:
        raise ConvertError(f"cannot write the output {dst} into {parent}: {e.strerror or e}") from None


def _remove_stale_partials(dst):
    """Deletes temporary folders of earlier runs for the same output that were killed (their pid is gone),
    with or without the in-progress marker: a run killed between creating its folder and writing the
    marker, or between removing the marker and publishing, leaves one without it."""
    for path in dst.parent.glob(f".{glob.escape(dst.name)}{PARTIAL_TAG}*"):
        pid = path.name.rsplit("-", 1)[-1]
        if not (pid.isdigit() and path.is_dir()) or _alive(int(pid)):
            continue
        log.info("removing %s, left by an interrupted run", path)
        shutil.rmtree(path, ignore_errors=True)


def _remove_stale_replaced(dst):
    """Deletes old outputs that a killed --overwrite run had moved aside (now that dst is in place)."""
    for path in dst.parent.glob(f".{glob.escape(dst.name)}{REPLACED_TAG}*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            log.info("removing %s, a replaced output left by an interrupted run", path)
            _remove_output(path)


def _remove_output(folder):
    """Deletes an output folder config.json first, so that a deletion cut short (kill -9 in the
    middle of a large rmtree) never leaves a folder that looks like a finished checkpoint."""
    try:
        (folder / "config.json").unlink()
    except FileNotFoundError:
        pass
    _fsync_dir(folder)
    shutil.rmtree(folder, ignore_errors=True)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _publish(tmp, dst, overwrite):
    """Moves the finished folder into place; an existing (checked, --overwrite) one is swapped out first.
    A folder that another process filled since the check is replaced only with --overwrite.  An
    interrupt between the swap's two renames puts the old folder back; one after them is raised as
    _InterruptedWhenPublished (the output is complete and in place)."""
    old = None
    if dst.exists():
        if not any(dst.iterdir()):
            dst.rmdir()
        elif not overwrite:
            raise ConvertError(f"output folder {dst} was filled while converting (by another run?); "
                               "nothing replaced, pass --overwrite to replace it")
        else:
            _check_replaceable(dst, dst)
            old = dst.parent / f".{dst.name}{REPLACED_TAG}{os.getpid()}"
    try:
        if old is not None:
            os.rename(dst, old)
        os.rename(tmp, dst)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt) and not tmp.exists():   # the second rename had happened
            raise _InterruptedWhenPublished(e) from e
        if old is not None and old.exists() and not dst.exists():
            os.rename(old, dst)
        raise
    with _interrupts_after_publishing():
        _fsync_dir(dst.parent)
        if old is not None:
            _remove_output(old)     # (if cut short, a later run removes it: _remove_stale_replaced)


@contextlib.contextmanager
def _interrupts_after_publishing():
    """An interrupt in the block, which runs once the output is in place, as _InterruptedWhenPublished."""
    try:
        yield
    except KeyboardInterrupt as e:
        raise _InterruptedWhenPublished(e) from e


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- tensors ----------------------------------------------------------------------------------------
def _write_shards(checkpoint, plan, spec, tmp, threads, total_in):
    """Writes every shard; returns output tensor name -> shard file name."""
    shards = ShardSet(tmp, plan.shards, plan.specs, metadata={"format": "pt"})
    try:
        work = [c for item in plan.items for c in chunks(item, checkpoint, spec)]
        with Progress(total_in, "converting") as progress:
            _run_pool(threads, work, lambda c: run_chunk(c, checkpoint, shards, spec),
                      lambda c, _: progress.update(c.in_bytes))
        shards.finish()
    finally:
        shards.abort()
    return shards.file_of


def _run_pool(threads, work, fn, done):
    """Runs fn over `work` on `threads` threads with a bounded number in flight (bounded memory);
    calls done(item, result) in the calling thread; the first error cancels the rest."""
    pending, results = {}, iter(work)
    with cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ktfp8-convert") as pool:
        try:
            while True:
                while len(pending) < 2 * threads:
                    unit = next(results, None)
                    if unit is None:
                        break
                    pending[pool.submit(fn, unit)] = unit
                if not pending:
                    return
                finished = _SIGNALS.wait(pending)
                for future in finished:
                    done(pending.pop(future), future.result())
        except BaseException:
            for future in pending:
                future.cancel()
            raise


def _verify(checkpoint, plan, spec, tmp, names, threads, min_db):
    outputs = {}
    files = {f: SafetensorsFile(tmp / f) for f in set(names.values())}
    for n, f in names.items():
        outputs[n] = files[f]
    sums = {item.out: [0.0, 0.0] for item in plan.items}
    work = [c for item in plan.items for c in chunks(item, checkpoint, spec, chunk_bytes=VERIFY_CHUNK_BYTES)]
    total = sum(c.in_bytes for c in work)

    def add(chunk, energies):
        acc = sums[chunk.item.out]
        acc[0] += energies[0]
        acc[1] += energies[1]
        progress.update(chunk.in_bytes)

    with Progress(total, "verifying") as progress:
        _run_pool(threads, work, lambda c: verify_chunk(c, checkpoint, outputs, spec), add)
    for f in files.values():
        f.close()
    copied_bad = [i.out for i in plan.items if i.action == "copy" and sums[i.out][1] != 0]
    results = sorted(((sqnr_db(*sums[i.out]), i.out) for i in plan.quantized),
                     key=lambda r: (not math.isnan(r[0]), r[0]))
    try:        # a closed stdout (`>&-`) would lose the report without a word: print() to None
        out = checked_stdout()
        for db, name in sorted(results, key=lambda r: natural_key(r[1])):
            print(f"SQNR {db:7.2f} dB  {name}", file=out)
        print(f"worst {min(VERIFY_WORST, len(results))} of {len(results)} quantized tensors:", file=out)
        for db, name in results[:VERIFY_WORST]:
            print(f"  {db:7.2f} dB  {name}", file=out)
        print(f"copied tensors: {sum(1 for i in plan.items if i.action == 'copy')} checked, "
              f"{len(copied_bad)} differ", file=out)
        out.flush()
    except OSError as e:
        raise StdoutFailed(e) from None
    low = [name for db, name in results if not db >= min_db]
    if copied_bad or low:
        raise ConvertError(f"verification failed: {len(low)} tensor(s) below {min_db} dB SQNR "
                           f"{low[:3]}, {len(copied_bad)} copied tensor(s) differ {copied_bad[:3]}")


# -- other files -----------------------------------------------------------------------------------
def _other_files(src, weight_files):
    """[(path, relative path)] of the input's tokenizer, generation config, code, docs, ... that the
    output gets unchanged (symlinks are followed, as in a Hugging Face cache snapshot), each checked
    here, before any work: a dangling link (an interrupted download) or a device, FIFO or socket is a
    ConvertError naming it.  Skips the input's weights, which the output replaces, and weight files of
    other formats, which would be stale unquantized duplicates."""
    found = []
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        rel = Path(root).relative_to(src)
        for name in sorted(files):
            top = rel == Path(".")
            if top and (name in _SKIP_FILES or name in weight_files):
                continue
            if name.endswith(_WEIGHT_SUFFIXES):
                log.info("not copied (weights in another format, or not in the checkpoint): %s", rel / name)
                continue
            path = Path(root) / name
            try:
                regular = stat.S_ISREG(os.stat(path).st_mode)
            except FileNotFoundError:
                what = f"a symlink to {os.readlink(path)!r}, which" if path.is_symlink() else "gone: it"
                raise ConvertError(f"{path} is {what} does not exist (an interrupted download?); the output "
                                   f"would lack it") from None
            if not regular:
                raise ConvertError(f"{path} is not a regular file (a device, FIFO or socket); only regular files "
                                   f"are copied into the output: move it out of the input folder")
            found.append((path, rel / name))
    return found


def _copy_other_files(files, tmp):
    for path, rel in files:
        (tmp / rel.parent).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, tmp / rel)


def _write_index(plan, names, tmp):
    if len(plan.shards) == 1:
        return
    total = sum(tensor_nbytes(*plan.specs[n]) for n in names)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(names.items()))}
    (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _write_config(checkpoint, plan, tmp):
    config = checkpoint.hf_config()
    if config is None:
        log.info("the input has no config.json; writing one with only the quantization_config")
        config = {}
    config["quantization_config"] = plan.quantization_config
    path = tmp / "config.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    with open(path, "rb") as f:
        os.fsync(f.fileno())


# -- progress ---------------------------------------------------------------------------------------
class Progress:
    """tqdm bar on a terminal, else a log line every 10% (or 30 s)."""

    def __init__(self, total, what):
        self.total, self.what, self.done = total, what, 0
        self.started = self.last_log = time.monotonic()
        self.next_percent = 10
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=what)
            except ImportError:
                pass

    def update(self, nbytes):
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
            return
        now = time.monotonic()
        percent = 100 * self.done / self.total if self.total else 100
        quiet = now - self.started < 2 and percent < 100        # no chatter for quick runs
        if not quiet and (percent >= self.next_percent or now - self.last_log >= 30):
            rate = self.done / 1e6 / max(now - self.started, 1e-9)
            log.info("%s: %3.0f%% (%.2f of %.2f GB, %.0f MB/s)", self.what, percent, self.done / 1e9,
                     self.total / 1e9, rate)
            self.last_log = now
            while self.next_percent <= percent:
                self.next_percent += 10

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


if __name__ == "__main__":
    sys.exit(main())
