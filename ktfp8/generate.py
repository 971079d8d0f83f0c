"""python -m ktfp8.generate: greedy generation with a transformers MoE model whose experts ktfp8 runs.

A folder written by `python -m ktfp8.convert` (its config.json has a quantization_config) loads with
ktfp8.hf.from_pretrained, experts memory-mapped from the FP8 shards; any other (BF16) folder loads
with transformers and its experts are quantized to FP8 per-channel on load.  Prints the generated text
(the token ids when the folder has no tokenizer) and the prefill and decode speeds; with --json, one
JSON object on stdout: {"ids", "text", "prefill_tokens_per_s", "decode_tokens_per_s"} (and "interrupted").
Under `torchrun --nproc-per-node N` each rank holds 1/N of every layer's experts (expert parallel over
torch.distributed, gloo, one all-reduce per MoE block); the tokens are those of one process and only
rank 0 prints.
Ctrl-C prints the tokens generated so far, then exits.
Exit status: 0 done, 1 the folder cannot be loaded, 2 bad arguments, 130 interrupted."""
import argparse
import errno
import json
import os
import re
import sys
import time
from pathlib import Path

from .cpu import StdoutFailed, checked_stdout, stdout_failed

PROG = "python -m ktfp8.generate"       # how it is run: usage errors and the others start with it alike
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
PROGRESS_EVERY_S = 0.5


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during greedy(): `ids`, the tokens generated before it."""

    def __init__(self, ids):
        super().__init__()
        self.ids = ids


class _Failure(Exception):
    """A message for the user and the exit status that goes with it."""

    def __init__(self, message, status):
        super().__init__(message)
        self.status = status


def _token_ids(text):
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative token ids, got {text!r}")
    return ids


def _positive(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _threads(text):
    """A positive count that OpenMP and torch can start (torch.set_num_threads(100000) crashes)."""
    from .config import check_threads
    try:
        return check_threads("the thread count", _positive(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model folder (BF16, or FP8 from ktfp8.convert)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer in the folder)")
    prompt.add_argument("--prompt-ids", type=_token_ids, help="prompt as token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=_positive, default=32, help="tokens to generate (default 32)")
    p.add_argument("--threads", type=_threads, default=None,
                   help="threads for torch and the ktfp8 kernels (default: torch's own count, and for ktfp8 "
                        "$KTFP8_NUM_THREADS, else $OMP_NUM_THREADS, else all cores this process may use)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of text")
    return p.parse_args(argv)


def _is_ktfp8_fp8(folder):
    """True for a folder whose config.json says its weights are quantized (as ktfp8.convert writes it)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise _Failure(f"{folder}: cannot read config.json ({e})", 1) from None
    return bool(isinstance(config, dict) and config.get("quantization_config"))


def _holds_fp8_weights(folder):
    """True for a folder whose safetensors headers hold F8_E4M3 tensors, whatever config.json says:
    without a quantization_config, transformers would read the codes as values and drop the scales."""
    from .loader import INDEX_NAME, Checkpoint
    from .safetensors_io import SafetensorsError
    try:
        checkpoint = Checkpoint(folder)
    except SafetensorsError as e:
        if (folder / INDEX_NAME).is_file() or any(folder.glob("*.safetensors")):
            raise _cannot_load(folder, e) from None    # a broken shard: ours names it, transformers' does not
        return False                # no safetensors (e.g. .bin): transformers' path says what it lacks
    with checkpoint:
        return any(checkpoint.info(name).dtype == "F8_E4M3" for name in checkpoint.names())


def _config_errors():
    """The exceptions transformers' strict config classes raise for a config.json field of the wrong type
    (huggingface_hub's, which are no ValueError), where this version has them."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def _cannot_load(folder, error):
    text = str(error)
    if text.startswith(f"{folder}: "):       # from_pretrained's own errors name the folder first too
        text = text[len(f"{folder}: "):]
    return _Failure(f"{folder}: cannot load the model: {text}", 1)


def load_tokenizer(folder, needed):
    """The folder's tokenizer, or None where it holds no tokenizer file.  One that fails to load is an
    error when `needed` (a text prompt), else a warning: the run goes on and prints token ids."""
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(folder)
    # transformers' tokenizer loaders fail with whatever their parsers raise (JSONDecodeError, an
    # AttributeError on a tokenizer_config.json that is no object, ...): any of them is the tokenizer's
    except Exception as e:  # noqa: BLE001
        message = f"{folder}: cannot load the tokenizer: {type(e).__name__}: {e}"
        if needed:
            raise _Failure(message, 1) from None
        print(f"{PROG}: warning: {message}; printing token ids", file=sys.stderr)
        return None


def _unreadable_bin(error):
    """The name of the file torch.load was reading when it raised `error` (its frame's argument: transformers
    does not say which shard), or None for an error from elsewhere, or one that is not the file's content
    (an I/O error other than EINVAL, which a zip cut short gives)."""
    import torch
    if isinstance(error, MemoryError) or (isinstance(error, OSError) and error.errno != errno.EINVAL):
        return None
    tb = error.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_locals.get("f") if tb.tb_frame.f_code is torch.load.__code__ else None
        if isinstance(path, (str, os.PathLike)):
            return Path(path).name
        tb = tb.tb_next
    return None


def _bin_refusal(bad_bin, error):
    """Why torch.load refused `bad_bin`, in one line.  Its own message advises weights_only=False
    ("arbitrary code execution"): wrong for a damaged file, and for a valid one holding other objects than
    tensors (which its "Unsupported global" names) a risk ktfp8 does not take for the user."""
    other = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    if other:
        return (f"{bad_bin} holds a {other[1]} beside its tensors, which torch.load(weights_only=True) does not "
                f"unpickle; save the weights as tensors only, or as safetensors")
    return (f"{bad_bin} is not a valid PyTorch checkpoint (torch.load, which transformers reads .bin weights with, "
            f"raised {type(error).__name__})")


def load(folder, threads):
    """The model of `folder`, experts run by ktfp8 (its tokenizer: load_tokenizer)."""
    import torch
    from transformers import AutoConfig

    import ktfp8.hf
    from ktfp8.hf.checkpoint import check_loading_info, text_model_class

    if _is_ktfp8_fp8(folder) or _holds_fp8_weights(folder):
        model = ktfp8.hf.from_pretrained(folder, threads=threads, dtype=torch.bfloat16)
    else:
        auto_class = text_model_class(AutoConfig.from_pretrained(folder))   # else transformers lists 200 classes
        try:
            model, info = auto_class.from_pretrained(folder, dtype=torch.bfloat16, experts_implementation="ktfp8",
                                                     output_loading_info=True, ignore_mismatched_sizes=True)
        # torch.load fails on a damaged .bin with whatever its readers meet (UnpicklingError, EOFError,
        # KeyError, OSError, RuntimeError): any of them is the file's
        except Exception as e:  # noqa: BLE001
            bad_bin = _unreadable_bin(e)
            if bad_bin is not None:
                raise _Failure(f"{folder}: cannot load the model: {_bin_refusal(bad_bin, e)}", 1) from None
            if isinstance(e, RuntimeError):     # its weight conversion failed (e.g. an expert tensor is missing)
                raise _cannot_load(folder, e) from None
            raise
        check_loading_info(folder, model, info)
        ktfp8.hf.prepare(model, threads=threads)
    return model


class Progress:
    """A decode progress line on stderr, rewritten in place on a terminal, throttled."""

    def __init__(self, total, stream=sys.stderr):
        self.total, self.stream, self.last = total, stream, time.perf_counter()
        self.tty, self.shown = stream.isatty(), False

    def update(self, done, tokens_per_s):
        now = time.perf_counter()
        if now - self.last < (PROGRESS_EVERY_S if self.tty else 10 * PROGRESS_EVERY_S):
            return
        self.last, self.shown = now, True
        end = "\r" if self.tty else "\n"
        self.stream.write(f"decode: {done}/{self.total} tokens, {tokens_per_s:.2f} tokens/s{end}")
        self.stream.flush()

    def close(self):
        if self.shown and self.tty:
            self.stream.write("\n")


def greedy(model, prompt_ids, max_new_tokens, eos_ids=(), progress=None):
    """(new ids, prefill tokens/s, decode tokens/s or None): argmax decoding with the KV cache.  Ctrl-C
    raises Interrupted (a KeyboardInterrupt) holding the ids generated before it."""
    import torch

    new = []
    try:
        with torch.inference_mode():
            ids = torch.tensor([prompt_ids])
            start = time.perf_counter()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            prefill_s = time.perf_counter() - start
            start = time.perf_counter()
            while True:
                token = int(out.logits[0, -1].argmax())
                new.append(token)
                if len(new) == max_new_tokens or token in eos_ids:
                    break
                out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
                if progress is not None:
                    progress.update(len(new), len(new) / (time.perf_counter() - start))
            decode_s = time.perf_counter() - start
    except KeyboardInterrupt:
        raise Interrupted(new) from None
    decoded = len(new) - 1              # the first new token comes out of the prefill
    return new, len(prompt_ids) / prefill_s, (decoded / decode_s if decoded else None)


def _eos_ids(model):
    eos = getattr(model.generation_config, "eos_token_id", None)
    return set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])


def _start_ranks():
    """Under torchrun with several ranks: torch.distributed (gloo, every collective bounded in time),
    each rank pinned to its NUMA node where the machine has several.  Returns (rank, world size)."""
    world_size = os.environ.get("WORLD_SIZE", "").strip() or "1"
    if not world_size.isascii() or not world_size.isdigit():
        raise _Failure(f"cannot start the ranks: WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer", 1)
    if int(world_size) <= 1:
        return 0, 1
    from .distributed import init_process_group
    try:
        return init_process_group()
    except (ValueError, RuntimeError) as e:   # a bad variable, no torchrun, a peer that never joined
        raise _Failure(f"cannot start the ranks: {e}", 1) from None


def run(args):
    if not args.model:
        raise _Failure("--model: an empty path", 2)
    folder = Path(args.model)
    if not folder.is_dir():
        raise _Failure(f"{folder}: no such model folder", 1)
    rank, world_size = _start_ranks()
    try:
        _generate(args, folder, rank == 0)
    finally:
        if world_size > 1:
            from .distributed import destroy_process_group
            destroy_process_group()


def _config_vocab_size(folder):
    """The vocabulary size of the folder's config (a multimodal model's: its text model's), read before the
    model loads; None where transformers cannot read the config, which load() then fails on with its own
    message (the same AutoConfig call, after the FP8 folder checks)."""
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, TypeError, *_config_errors()):
        return None
    return config.get_text_config().vocab_size


def _prompt_ids(args, folder, tokenizer, vocab_size):
    """The prompt's token ids (--prompt-ids, or --prompt through the folder's tokenizer), all of them
    inside the vocabulary (where vocab_size is known)."""
    if args.prompt is None:
        ids, origin = args.prompt_ids, "--prompt-ids: token id"
    elif tokenizer is None:
        raise _Failure(f"{folder} has no tokenizer: give the prompt as --prompt-ids", 2)
    else:
        ids, origin = tokenizer(args.prompt)["input_ids"], "--prompt: the tokenizer's token id"
        if not ids:
            raise _Failure("--prompt: the prompt has no tokens", 2)
    if vocab_size is not None and max(ids) >= vocab_size:
        raise _Failure(f"{origin} {max(ids)} is outside the vocabulary (size {vocab_size})", 2)
    return ids


def _generate(args, folder, prints):
    try:
        import ktfp8.hf  # noqa: F401  (torch and transformers: the core package installs without them)
    except ImportError as e:
        raise _Failure(str(e), 1) from None
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    from .distributed import ExpertParallelError
    # the prompt is refused before the model loads, which takes minutes for a large one
    tokenizer = load_tokenizer(folder, needed=args.prompt is not None)
    prompt_ids = _prompt_ids(args, folder, tokenizer, _config_vocab_size(folder))
    try:
        model = load(folder, args.threads)
    except ExpertParallelError as e:               # another rank died or stalled: its message says which
        raise _Failure(str(e), 1) from None
    except (OSError, ValueError, TypeError, *_config_errors()) as e:
        raise _cannot_load(folder, e) from None
    if prints:
        _warn_past_positions(model, len(prompt_ids) + args.max_new_tokens)
    progress = Progress(args.max_new_tokens) if prints and not args.json else None
    try:
        ids, prefill_tps, decode_tps = greedy(model, prompt_ids, args.max_new_tokens, _eos_ids(model), progress)
    except ExpertParallelError as e:
        raise _Failure(str(e), 1) from None
    except Interrupted as e:                       # print what there is, then exit 130 (main)
        if progress is not None:
            progress.close()
        if prints:
            _print_result(args, e.ids, tokenizer, len(prompt_ids), None)
        raise
    if progress is not None:
        progress.close()
    if prints:
        _print_result(args, ids, tokenizer, len(prompt_ids), (prefill_tps, decode_tps))


def _warn_past_positions(model, positions):
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if isinstance(limit, int) and positions > limit:
        print(f"{PROG}: warning: the prompt and --max-new-tokens take up to {positions} positions, past "
              f"the model's max_position_embeddings ({limit}); tokens beyond it are outside what it was trained "
              f"for", file=sys.stderr)


def _print_result(args, ids, tokenizer, prompt_tokens, speeds):
    """The generated ids (text where the folder has a tokenizer) and, unless interrupted (speeds None),
    the prefill and decode speeds; with --json one object, speeds null and "interrupted": true if so."""
    text = tokenizer.decode(ids) if tokenizer is not None else None
    prefill_tps, decode_tps = speeds or (None, None)
    try:
        out = checked_stdout()
        if args.json:
            result = {"ids": ids, "text": text, "prefill_tokens_per_s": prefill_tps,
                      "decode_tokens_per_s": decode_tps, **({} if speeds else {"interrupted": True})}
            print(json.dumps(result), file=out)
        else:
            print(text if text is not None else " ".join(map(str, ids)), file=out)
            if speeds:
                decode = f"{decode_tps:.2f} tokens/s" if decode_tps is not None else "-"
                print(f"prefill: {prompt_tokens} tokens, {prefill_tps:.2f} tokens/s; "
                      f"decode: {len(ids) - 1} tokens, {decode}", file=out)
        out.flush()
    except OSError as e:                           # a reader that left (| head), a full disk, a closed stdout
        raise StdoutFailed(e) from None


def main(argv=None):
    args = parse_args(argv)             # argparse exits with status 2 on bad arguments
    try:
        run(args)
    except _Failure as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.status
    except StdoutFailed as e:
        return stdout_failed(PROG, e.args[0])
    except KeyboardInterrupt as e:
        done = f" after {len(e.ids)} new tokens" if isinstance(e, Interrupted) else ""
        print(f"{PROG}: interrupted{done}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
