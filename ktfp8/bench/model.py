"""python -m ktfp8.bench.model: tokens per second of a whole transformers MoE model, ktfp8 FP8 experts
beside transformers' own BF16 experts, in one run on the same model.

The model is Qwen3-30B-A3B at its real widths (hidden 2048, 128 experts, top-8, moe_intermediate 768,
32 query / 4 key-value heads of 128) with its first --layers of 48 layers and a reduced vocabulary,
random BF16 weights made here.  Sides, in this order (ktfp8 last: quantizing releases the BF16 experts):
transformers "eager" and "grouped_mm" (and "batched_mm" for decode: for a prefill it gathers one weight
copy per token and expert), then ktfp8 FP8 per-channel.  Each side: greedy generation of
--decode-tokens after a --prompt-tokens prompt (prefill tokens/s = prompt / time of the first
forward; decode tokens/s = tokens after the first / their time), best of --repeats after a warm-up.
The time spent inside the experts modules is clocked in the same forwards (forward hooks), so each
side's experts are timed alone too, and what the rest of the model takes bounds what any experts
implementation could gain."""
import argparse
import importlib.util
import json
import os
import resource
import sys
import time

from .. import backends
from ..cpu import checked_stdout, stdout_failed
from ..generate import _positive, _threads  # the same --threads / --layers checks as the generate CLI
from .__main__ import _bad_env_backend, _cannot_write_into, _write_atomically

PHASES = ("prefill", "decode")
SIDES = ("eager", "grouped_mm", "batched_mm", "ktfp8")
BATCHED_MM_MAX_TOKENS = 8       # batched_mm gathers [tokens x top-k, 2I, H] weights: 25 GB at 512 tokens
MODEL_LAYERS = 48               # Qwen3-30B-A3B's decoder layers
MAX_POSITIONS = 4096            # the max_position_embeddings of qwen3_30b_a3b_config
# BF16 bytes of one decoder layer: 128 experts (gate, up, down 2048 x 768) and attention (q and o 2048 x
# 4096, k and v 2048 x 512)
LAYER_BYTES = 2 * (128 * 3 * 2048 * 768 + 2 * 2048 * 4096 + 2 * 2048 * 512)


def qwen3_30b_a3b_config(layers, vocab_size):
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=layers, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, max_position_embeddings=MAX_POSITIONS,
                          rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)


def build_model(layers=6, vocab_size=8192, seed=0):
    """The random BF16 Qwen3-MoE model (eval mode); weights N(0, 0.02) like transformers' init."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)    # parameters are made in BF16: no float32 copy of 7 GB
    try:
        model = Qwen3MoeForCausalLM(qwen3_30b_a3b_config(layers, vocab_size)).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.02)
    return model


class ExpertsClock:
    """Wall time inside the given experts modules (one per layer), by phase: forward hooks around each.
    Of a greedy generation's calls, the first forward's (one call per module) are the prefill, the
    rest decode steps.  Only sound for one forward at a time."""

    def __init__(self, modules):
        self._modules = len(modules)
        self._calls, self._entered = [], None
        self._hooks = [hook for m in modules for hook in (m.register_forward_pre_hook(self._enter),
                                                          m.register_forward_hook(self._leave))]

    def _enter(self, module, args):
        self._entered = time.perf_counter()

    def _leave(self, module, args, output):
        self._calls.append(time.perf_counter() - self._entered)

    def seconds(self):
        return {"prefill": sum(self._calls[:self._modules]), "decode": sum(self._calls[self._modules:])}

    def reset(self):
        self._calls = []

    def remove(self):
        for hook in self._hooks:
            hook.remove()


def measure(model, prompt_ids, new_tokens, repeats, phases=PHASES):
    """{phase: best tokens/s, phase + "_experts_ms": the experts' milliseconds a prefill or a decode token
    in that best repeat} of greedy generation (ktfp8.generate.greedy), after a short warm-up."""
    from ..generate import greedy

    greedy(model, prompt_ids[:8], 2)
    clock = ExpertsClock([layer.mlp.experts for layer in model.model.layers])
    best = {}
    try:
        for _ in range(repeats):
            clock.reset()
            if "prefill" in phases:
                _, prefill, decode = greedy(model, prompt_ids, new_tokens if "decode" in phases else 1)
            else:       # decode alone: a short prompt
                _, prefill, decode = greedy(model, prompt_ids[:BATCHED_MM_MAX_TOKENS], new_tokens)
            seconds, forwards = clock.seconds(), {"prefill": 1, "decode": new_tokens - 1}
            for phase, value in (("prefill", prefill), ("decode", decode)):
                if phase in phases and value is not None and value > best.get(phase, 0.0):
                    best[phase] = value
                    best[phase + "_experts_ms"] = 1e3 * seconds[phase] / forwards[phase]
    finally:
        clock.remove()
    return best


def rss_gb():
    """(current, peak) resident set of this process in GB."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    current = int(fields["VmRSS"].split()[0]) * 1024
    return current / 1e9, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def run(layers=6, threads=2, prompt_tokens=512, decode_tokens=16, repeats=2, vocab_size=8192, sides=SIDES,
        log=sys.stderr):
    """Rows {side, backend, prefill, decode, skipped} measured in this process, and the RSS figures."""
    import torch

    import ktfp8
    import ktfp8.hf

    torch.set_num_threads(threads)
    start = time.perf_counter()
    model = build_model(layers, vocab_size)
    print(f"built the model in {time.perf_counter() - start:.0f} s; RSS {rss_gb()[0]:.1f} GB", file=log)
    prompt = torch.randint(0, vocab_size, (prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    rows, memory = [], {}
    for side in sides:
        row = {"side": side, "backend": None, "skipped": None}
        if side == "ktfp8":
            memory["bf16"] = rss_gb()
            start = time.perf_counter()
            ktfp8.hf.prepare(model, "ktfp8", threads=threads)
            print(f"quantized the experts in {time.perf_counter() - start:.0f} s", file=log)
            row["backend"] = ktfp8.hf.op.layer_of(model.model.layers[0].mlp.experts._ktfp8_handle).moe.backend
        else:
            model.set_experts_implementation(side)
        phases = PHASES
        if side == "batched_mm":
            phases = ("decode",)
            row["skipped"] = f"prefill: gathers one weight copy per token and expert ({prompt_tokens * 8} copies)"
        row.update(measure(model, prompt, decode_tokens, repeats, phases))
        print(f"{side}: " + ", ".join(f"{p} {_fmt(row.get(p))} tokens/s" for p in phases), file=log)
        rows.append(row)
    memory["ktfp8"] = rss_gb()
    return rows, memory


def _fmt(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}"


def _phase_ms(row, phase, prompt_tokens):
    """Milliseconds a prefill (prompt_tokens tokens) or a decode token took in a side's run."""
    return 1e3 * (prompt_tokens if phase == "prefill" else 1) / row[phase]


def rest_ms(row, phase, prompt_tokens):
    """Milliseconds a prefill or a decode token took outside the experts in a side's run."""
    if not row.get(phase) or row.get(phase + "_experts_ms") is None:
        return None
    return _phase_ms(row, phase, prompt_tokens) - row[phase + "_experts_ms"]


def _ratio(a, b):
    return a / b if a and b else None


def table(rows, layers, threads, prompt_tokens, vocab_size):
    """Markdown lines: tokens/s per side, its experts' milliseconds, and ktfp8's ratio to each transformers
    side, whole model and experts alone."""
    from .. import cpu
    ours = next((r for r in rows if r["side"] == "ktfp8"), None)
    lines = [f"Qwen3-30B-A3B widths, first {layers} of 48 layers, vocab {vocab_size}, {threads} threads, "
             f"{cpu.describe(cpu.report())}; prefill {prompt_tokens} tokens",
             "", "| experts | prefill tokens/s | decode tokens/s | experts ms a prefill | experts ms a decode "
             "token | ktfp8 prefill x | ktfp8 decode x | ktfp8 experts alone, prefill x | decode x |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = (f"ktfp8 FP8 per-channel ({r['backend']})" if r["side"] == "ktfp8"
                else f"transformers {r['side']} (BF16)")
        peer = ours is not None and r is not ours
        whole = {p: _ratio(ours.get(p), r.get(p)) if peer else None for p in PHASES}
        alone = {p: _ratio(r.get(p + "_experts_ms"), ours.get(p + "_experts_ms")) if peer and r.get(p) else None
                 for p in PHASES}
        ms = {p: r.get(p + "_experts_ms") if r.get(p) else None for p in PHASES}
        lines.append(f"| {name} | {_fmt(r.get('prefill'))} | {_fmt(r.get('decode'))} | {_fmt(ms['prefill'])} | "
                     f"{_fmt(ms['decode'])} | {_fmt(whole['prefill'])} | {_fmt(whole['decode'])} | "
                     f"{_fmt(alone['prefill'])} | {_fmt(alone['decode'])} |")
    return lines


def goals(rows, prompt_tokens):
    """The goal lines: ktfp8 vs the fastest transformers BF16 side of each phase, the experts alone, and the
    most any experts implementation could reach (no time in the experts at all: the peer's time over
    what the rest of the model took in ktfp8's run)."""
    ours = next((r for r in rows if r["side"] == "ktfp8"), None)
    out = []
    for phase, target in (("decode", 1.8), ("prefill", 2.0)):
        peers = [r for r in rows if r["side"] != "ktfp8" and r.get(phase)]
        if ours is None or not ours.get(phase) or not peers:
            continue
        best = max(peers, key=lambda r: r[phase])
        ratio = ours[phase] / best[phase]
        line = (f"{'reached' if ratio >= target else 'NOT reached'}: {phase} {ratio:.2f}x the fastest "
                f"transformers BF16 experts ({best['side']}), goal >= {target}x")
        theirs, mine = best.get(phase + "_experts_ms"), ours.get(phase + "_experts_ms")
        alone, rest = _ratio(theirs, mine), rest_ms(ours, phase, prompt_tokens)
        per = "a prefill" if phase == "prefill" else "a decode token"
        if alone:
            line += f"; the experts alone {alone:.2f}x ({mine:.2f} against {theirs:.2f} ms {per})"
        if rest and rest > 0:
            line += (f"; the rest of the model took {rest:.2f} ms {per}, so no experts implementation could "
                     f"reach more than {_phase_ms(best, phase, prompt_tokens) / rest:.2f}x")
        out.append(line)
    return out


def _sides(text):
    sides = text.split(",")
    unknown = [s for s in sides if s not in SIDES]
    if unknown or not sides:
        raise argparse.ArgumentTypeError(f"unknown side(s) {unknown}; choose from {','.join(SIDES)}")
    return [s for s in SIDES if s in sides]          # ktfp8 last: it releases the BF16 experts


def peak_bytes(layers, vocab_size):
    """About the most memory a run holds: the BF16 model, embeddings and lm_head, and one layer's
    experts more while ktfp8 quantizes them (README: 7.98 GB, peak 9.19 GB for 6 layers)."""
    return (layers + 1) * LAYER_BYTES + 2 * vocab_size * 2048 * 2


def _check(p, args):
    """What would fail only after the model was built (minutes): argparse's error (exit 2) now."""
    if args.layers > MODEL_LAYERS:
        p.error(f"--layers: Qwen3-30B-A3B has {MODEL_LAYERS} layers, got {args.layers}")
    if args.prompt_tokens + args.decode_tokens > MAX_POSITIONS:
        p.error(f"--prompt-tokens + --decode-tokens must be at most {MAX_POSITIONS} (the model's "
                f"max_position_embeddings), got {args.prompt_tokens + args.decode_tokens}")
    why = "ktfp8" in args.sides and _bad_env_backend()    # found after the model was built, in a traceback
    if why:
        p.error(why)
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        p.error(f"needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed")
    from .sides import available_memory
    need, free = peak_bytes(args.layers, args.vocab), available_memory()
    if need > free:
        p.error(f"--layers {args.layers} --vocab {args.vocab}: the model needs about {need / 1e9:.1f} GB, more than the "
                f"{free / 1e9:.1f} GB of memory available now")
    if args.json == "":           # else taken for "no --json": minutes of measurements, and no file
        p.error("--json: an empty path; name the file to write")
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json):
            p.error(f"--json: {args.json!r} is a folder; name the file to write")
        if not os.path.isdir(folder):
            what = "is not a folder" if os.path.exists(folder) else "does not exist"
            p.error(f"--json: {folder!r} {what}")
        why = _cannot_write_into(folder)
        if why:
            p.error(f"--json: cannot write into {folder!r}: {why}")


def main(argv=None):
    prog = "python -m ktfp8.bench.model"
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=_positive, default=6,
                   help=f"first N of the {MODEL_LAYERS} layers (default 6: ~8 GB of BF16 model, ~9 GB at the peak)")
    p.add_argument("--threads", type=_threads, default=backends.usable_cores(),
                   help="threads (default: all this process may use)")
    p.add_argument("--prompt-tokens", type=_positive, default=512)
    p.add_argument("--decode-tokens", type=_positive, default=16,
                   help="new tokens per generation; decode tokens/s counts those after the first (1: prefill "
                        "only, no decode figure)")
    p.add_argument("--repeats", type=_positive, default=2, help="measurements per side; the best counts")
    p.add_argument("--vocab", type=_positive, default=8192)
    p.add_argument("--sides", type=_sides, default=list(SIDES), help=f"comma-separated from {','.join(SIDES)}")
    p.add_argument("--json", metavar="PATH", help="also write the rows and RSS figures as JSON")
    args = p.parse_args(argv)
    _check(p, args)
    try:
        rows, memory = run(args.layers, args.threads, args.prompt_tokens, args.decode_tokens, args.repeats,
                           args.vocab, args.sides)
        if args.json:    # before the table: a reader of stdout that leaves (| head) does not cost it
            data = json.dumps({"rows": rows, "rss_gb": memory, "args": vars(args)}, indent=1)
            _write_atomically(args.json, lambda f: f.write(data.encode()))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    try:
        out = checked_stdout()          # a closed stdout: print() would drop the table without a word
        print("\n".join(table(rows, args.layers, args.threads, args.prompt_tokens, args.vocab)), file=out)
        print("\n".join(goals(rows, args.prompt_tokens)), file=out)
        for when, (current, peak) in memory.items():
            print(f"RSS with {'BF16' if when == 'bf16' else 'FP8 (ktfp8)'} experts: {current:.2f} GB "
                  f"(peak so far {peak:.2f} GB)", file=out)
        out.flush()
    except OSError as err:
        return stdout_failed(prog, err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
