"""Turns a run's rows into what a user reads: the results table (each side at its best thread count),
ktfp8's speed-up over every peer, time-per-token scaling over T and threads, and the issue's goals."""

PC = "fp8_per_channel"


def best_threads(rows):
    """One row per (layer, side, format, T): the thread count that ran it fastest."""
    best = {}
    for r in rows:
        key = (r["layer"], r["side"], r["format"], r["tokens"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    return list(best.values())


def _ktfp8_best(rows, layer, fmt, tokens):
    """The fastest ktfp8 row (any backend, best threads) for this layer, format and T, or None."""
    mine = [r for r in rows if r["kind"] == "ktfp8" and r["layer"] == layer and r["format"] == fmt
            and r["tokens"] == tokens]
    return min(mine, key=lambda r: r["ms"]) if mine else None


def speedups(rows):
    """For every peer row (best threads): how many times faster ktfp8 runs the same call, on the
    peer's own weight format (fp32 peers dequantize the per-channel FP8 weights) and on FP8 per-channel."""
    best = best_threads(rows)
    out = []
    for r in best:
        if r["kind"] != "peer":
            continue
        same_fmt = PC if r["format"] == "fp32" else r["format"]
        same = _ktfp8_best(best, r["layer"], same_fmt, r["tokens"])
        pc = _ktfp8_best(best, r["layer"], PC, r["tokens"])
        out.append(dict(layer=r["layer"], peer=r["side"], format=r["format"], tokens=r["tokens"],
                        same_format=r["ms"] / same["ms"] if same else None,
                        fp8_per_channel=r["ms"] / pc["ms"] if pc else None))
    return out


def _x(v):
    return f"{v:6.2f}x" if v is not None else "     - "


def results_table(rows, limits):
    """Text table of the best-thread rows, layer by layer, with ktfp8's speed-ups on peer rows."""
    ups = {(s["layer"], s["peer"], s["format"], s["tokens"]): s for s in speedups(rows)}
    lines = []
    for layer in _ordered(r["layer"] for r in rows):
        lines.append(f"{layer}")
        lines.append(f"{'side':28s} {'format':15s} {'T':>5s} {'thr':>3s} {'ms':>9s} {'GB/s':>6s} {'of-bw':>5s} "
                     f"{'TFLOP/s':>7s} {'of-peak':>7s} {'err':>7s}  ktfp8 speed-up: same fmt / fp8-pc")
        for r in sorted((r for r in best_threads(rows) if r["layer"] == layer), key=_row_order):
            s = ups.get((layer, r["side"], r["format"], r["tokens"]))
            tail = f"  {_x(s['same_format'])} / {_x(s['fp8_per_channel'])}" if s else ""
            lines.append(f"{r['side']:28s} {r['format']:15s} {r['tokens']:5d} {r['threads']:3d} {r['ms']:9.2f} "
                         f"{r['gbs']:6.1f} {r['bw_fraction']:5.0%} {r['tflops']:7.3f} {r['peak_fraction']:7.0%} "
                         f"{r['rel_err']:7.1e}{tail}")
        lines.append("")
    lines += limits_lines(limits)
    return "\n".join(lines)


def limits_lines(limits):
    return [f"measured limits, {n} thread(s): read {lim['read_gbs']:.1f} GB/s, FP32 FMA {lim['fma_gflops']:.0f} GFLOP/s"
            + (f", vdpbf16ps {lim['dpbf16_gflops']:.0f} GFLOP/s" if lim.get("dpbf16_gflops") else "")
            for n, lim in sorted(limits.items(), key=lambda kv: int(kv[0]))]


def scaling_table(rows):
    """Microseconds per token for every side, format and thread count, T across: where decode
    (time per token falling as T grows, weights shared) turns into compute-bound prefill (flat)."""
    tokens = sorted({r["tokens"] for r in rows})
    lines = []
    for layer in _ordered(r["layer"] for r in rows):
        lines.append(f"{layer}: microseconds per token")
        lines.append(f"{'side':28s} {'format':15s} {'thr':>3s} " + " ".join(f"{'T=' + str(t):>9s}" for t in tokens))
        cells = {}
        for r in rows:
            if r["layer"] == layer:
                cells[(r["side"], r["format"], r["threads"])] = cells.get((r["side"], r["format"], r["threads"]), {})
                cells[(r["side"], r["format"], r["threads"])][r["tokens"]] = r["ms"] * 1e3 / r["tokens"]
        for (side, fmt, thr), by_t in sorted(cells.items(), key=lambda kv: (_side_order(kv[0][0]), kv[0][1], kv[0][2])):
            lines.append(f"{side:28s} {fmt:15s} {thr:3d} " +
                         " ".join(f"{by_t[t]:9.1f}" if t in by_t else f"{'-':>9s}" for t in tokens))
        lines.append("")
    return "\n".join(lines)


def goals(rows, limits, layer):
    """The issue's targets on the benchmark layer, each at the best thread count of each side."""
    best = [r for r in best_threads(rows) if r["layer"] == layer]

    def ours(T, fmt=PC):
        return _ktfp8_best(best, layer, fmt, T)

    def peer(T, prefix, fmt=None):
        found = [r for r in best if r["kind"] == "peer" and r["side"].startswith(prefix) and r["tokens"] == T
                 and (fmt is None or r["format"] == fmt)]
        return min(found, key=lambda r: r["ms"]) if found else None

    def kt_fp8(T):  # the per-channel class where kt-kernel has it, else its fastest FP8 class here
        return peer(T, "kt-kernel", PC) or peer(T, "kt-kernel", "fp8_block")

    out = []

    def ratio_goal(text, target, a, b, peer_name):
        if a is None or b is None:
            missing = "ktfp8 FP8 per-channel" if a is None else peer_name
            out.append(dict(goal=text, target=target, measured=None, reached=None, note=f"no {missing} row at this T"))
            return
        v = b["ms"] / a["ms"]
        out.append(dict(goal=text, target=target, measured=v, reached=v >= target,
                        note=f"{a['side']} {a['ms']:.2f} ms ({a['threads']} thr) vs {b['side']} [{b['format']}] "
                             f"{b['ms']:.2f} ms ({b['threads']} thr)"))

    ratio_goal("decode T=1: ktfp8 FP8 per-channel faster than kt-kernel FP8", 1.6, ours(1), kt_fp8(1), "kt-kernel FP8")
    d = ours(1)
    if d is not None:
        v = d["gbs"] / max(lim["read_gbs"] for lim in limits.values())
        out.append(dict(goal="decode T=1: fraction of measured read bandwidth", target=0.85, measured=v,
                        reached=v >= 0.85, note=f"{d['gbs']:.1f} GB/s with {d['threads']} thread(s)"))
    ratio_goal("prefill T=512: ktfp8 FP8 per-channel faster than kt-kernel FP8", 1.3,
               ours(512), kt_fp8(512), "kt-kernel FP8")
    ratio_goal("prefill T=512: ktfp8 FP8 per-channel faster than PyTorch BF16", 3.0,
               ours(512), peer(512, "torch bf16"), "PyTorch BF16")
    ratio_goal("decode T=1: ktfp8 FP8 per-channel faster than PyTorch BF16", 2.0,
               ours(1), peer(1, "torch bf16"), "PyTorch BF16")
    return out


def goals_lines(goal_rows):
    lines = ["goals (benchmark layer, best thread count of each side):"]
    for g in goal_rows:
        verdict = "not measured" if g["reached"] is None else "reached" if g["reached"] else "NOT reached"
        as_fraction = g["target"] < 1  # bandwidth goals are fractions, the others speed-ups
        figure = "" if g["measured"] is None else f"{g['measured']:.0%}" if as_fraction else f"{g['measured']:.2f}x"
        target = f"{g['target']:.0%}" if as_fraction else f"{g['target']}x"
        lines.append(f"  {verdict:12s} {g['goal']} (target {target}): {figure}  {g['note']}")
    return "\n".join(lines)


def _ordered(items):
    return list(dict.fromkeys(items))


def _side_order(side):
    return (0 if side.startswith("ktfp8") else 1, side)


def _row_order(r):
    return (r["tokens"], _side_order(r["side"]), r["format"])
