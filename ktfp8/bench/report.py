"""Turns a run's rows into what a user reads: the results table (each side at its best thread count,
with its fraction of the roofline), ktfp8's speed-up over every peer, time-per-token scaling over T
and threads, and the goals."""

import statistics

from .. import roofline
from . import layers as L
from .backend_choice import OUT_OF_CONTENTION
from .interleaved import best_ms, round_best

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


def results_table(rows, limits, default=None, l3_mib=None):
    """Text table of the best-thread rows, layer by layer, with ktfp8's speed-ups on peer rows; the
    default backend's rows are marked *.  l3_mib: this machine's L3, to flag walks short of DRAM."""
    ups = {(s["layer"], s["peer"], s["format"], s["tokens"]): s for s in speedups(rows)}
    lines = []
    for layer in _ordered(r["layer"] for r in rows):
        lines.append(f"{layer}")
        lines.append(f"{'side':30s} {'format':15s} {'T':>5s} {'thr':>3s} {'ms':>9s} {'GB/s':>6s} {'of-bw':>5s} "
                     f"{'TFLOP/s':>7s} {'unit':>6s} {'of-peak':>7s} {'floor':>8s} {'of-roof':>7s} {'err':>7s}"
                     f"  ktfp8 speed-up: same fmt / fp8-pc")
        for r in sorted((r for r in best_threads(rows) if r["layer"] == layer), key=_row_order):
            s = ups.get((layer, r["side"], r["format"], r["tokens"]))
            tail = f"  {_x(s['same_format'])} / {_x(s['fp8_per_channel'])}" if s else ""
            name = r["side"] + (" *" if default and r["side"] == f"ktfp8 {default}" else "")
            floor = max(r["memory_floor_ms"], r["compute_floor_ms"])
            lines.append(f"{name:30s} {r['format']:15s} {r['tokens']:5d} {r['threads']:3d} {r['ms']:9.2f} "
                         f"{r['gbs']:6.1f} {r['bw_fraction']:5.0%} {r['tflops']:7.3f} {r['compute_unit']:>6s} "
                         f"{r['peak_fraction']:7.0%} {floor:8.2f} {r['roofline_fraction']:7.0%} "
                         f"{r['rel_err']:7.1e}{tail}")
        lines.append("")
    if default:
        lines.append(f"* the default backend (what MoE() picks with no backend=): {default}")
    lines.append("of-peak: TFLOP/s / the measured peak of the side's unit (peers: the fastest unit here, NumPy's "
                 "FP32 FMA); floor: max(active bytes / read bandwidth, FLOPs / that peak) in ms at the row's thread count; "
                 "of-roof: floor / ms")
    lines += walk_lines(rows, l3_mib) + limits_lines(limits)
    return "\n".join(lines)


def walk_lines(rows, l3_mib=None):
    """How many distinct copies of the layer each side walked, once per (layer, format, side), each
    walk short of WALK_L3_MULTIPLE x the L3 flagged: its GB/s and fractions count cache reads as DRAM's."""
    seen = {}
    for r in rows:
        if r.get("walk_bytes"):
            seen.setdefault((r["layer"], r["side"], r["format"]), (r["copies"], r["walk_bytes"]))
    walks = sorted({(layer, fmt, copies, nbytes) for (layer, _, fmt), (copies, nbytes) in seen.items()})
    return [f"weights walked in turn: {layer} [{fmt}]: {copies} distinct cop{'y' if copies == 1 else 'ies'} of the "
            f"layer, {nbytes / 1e6:.0f} MB"
            + ("" if L.walk_reaches_dram(nbytes, l3_mib) else
               f", under {L.WALK_L3_MULTIPLE}x the {l3_mib:.0f} MiB L3: read partly from cache, its GB/s and "
               f"fractions overstated")
            for layer, fmt, copies, nbytes in walks]


def limits_lines(limits):
    lines = []
    for n, lim in sorted(limits.items(), key=lambda kv: int(kv[0])):
        units = ", ".join(f"{roofline.UNIT_NAMES[u]} {lim[f]:.0f} GFLOP/s" for u, f in roofline.UNIT_FIELDS.items()
                          if lim.get(f))
        lines.append(f"measured limits, {n} thread(s): read {lim['read_gbs']:.1f} GB/s"
                     + (f", {units}" if units else ""))
    return lines


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


def machine_floor_ms(row, limits):
    """(memory, compute) floor in ms of a row against the machine's best figures over every thread
    count measured (the bus with all threads, the peak of the row's unit)."""
    best = {"read_gbs": max(lim["read_gbs"] for lim in limits.values())}
    for field in roofline.UNIT_FIELDS.values():
        best[field] = max((lim.get(field) or 0.0) for lim in limits.values()) or None
    memory_s, compute_s = roofline.floor_seconds(best, row["active_bytes"], row["flops"], row["compute_unit"])
    return memory_s * 1e3, compute_s * 1e3


def goals(rows, limits, layer, default, interleaved=None, choice=None, peers=None):
    """The goals of issue 11 on the benchmark layer for the default backend `default`, FP8
    per-channel, each side at its best thread count unless a goal names the thread count.  The
    decode goals come from `interleaved` (interleaved.run's result) and the default-choice goal from
    `choice` (backend_choice.run's), not from the rows; the comparisons with the peers from `peers`
    (peer_rounds.run's) where it measured the peer, else from the rows."""
    mine = f"ktfp8 {default}"
    layer_rows = [r for r in rows if r["layer"] == layer]
    best = best_threads(layer_rows)
    has_amx = any(lim.get("amx_gflops") for lim in limits.values())
    out = []

    def find(side, T, fmt=PC):
        found = [r for r in best if r["side"] == side and r["tokens"] == T and r["format"] == fmt]
        return min(found, key=lambda r: r["ms"]) if found else None

    def peer(T, prefix, fmt):
        found = [r for r in best if r["kind"] == "peer" and r["side"].startswith(prefix) and r["tokens"] == T
                 and r["format"] == fmt]
        return min(found, key=lambda r: r["ms"]) if found else None

    def add(goal, kind, target, measured, note):
        out.append(_goal(goal, kind, target, measured, note))

    def against_peer(goal, target, T, label, wanted, missing):
        """From the interleaved peer step where it timed the peer (peer_goal), else the table's rows;
        `missing`: why, where this run timed the peer at other T but not at T."""
        if not peer_goal(peers, add, goal, target, T, label, wanted, default):
            faster(goal, target, find(mine, T), peer(T, wanted, "bf16"), why_not_timed(T, label, wanted, missing))

    def why_not_timed(T, label, wanted, missing):
        if not any(r["tokens"] == T for r in layer_rows):
            return f"T={T} is not in this run's --tokens"
        if not any(r["kind"] == "peer" and r["side"].startswith(label) for r in layer_rows):
            return f"{wanted} not timed in this run (--no-peers, or not installed: see skipped)"
        return missing

    def faster(goal, target, ours, theirs, missing):
        if ours is None or theirs is None:
            add(goal, "speedup", target, None, missing if theirs is None else f"no {mine} [{PC}] row at this T")
            return
        add(goal, "speedup", target, theirs["ms"] / ours["ms"],
            f"{ours['side']} [{ours['format']}] {ours['ms']:.2f} ms ({ours['threads']} thr) vs {theirs['side']} "
            f"[{theirs['format']}] {theirs['ms']:.2f} ms ({theirs['threads']} thr)")

    # 1. decode at the bus, on 1 thread and on all, and the format ratios: interleaved (see interleaved.py)
    out += decode_goals(interleaved, limits, mine)
    # 2. every expert active: near the memory floor (interleaved with the probes where the step ran at T=64)
    r = find(mine, 64)
    roof = roofline_goal_figures(interleaved, 64)
    goal = "T=64: time over the memory floor (active bytes / " + ("read bandwidth)" if roof else
                                                                   "best read bandwidth)")
    if roof:
        # a VM's bus can read twice as fast one minute as the next: where the compute floor alone is
        # past 1.5x the memory floor, no kernel meets the goal, and the note says so
        out_of_reach = roof["compute_ms"] > 1.5 * roof["memory_ms"]
        add(goal, "at_most", 1.5, roof["figures"]["over_memory_floor"],
            f"{roof['how']}; {roof['ms']:.2f} ms vs floor {roof['memory_ms']:.2f} ms, compute floor "
            f"{roof['compute_ms']:.2f} ms on the {roof['unit_name']} peak (medians over rounds)" +
            (f"; the compute floor alone is {roof['compute_ms'] / roof['memory_ms']:.2f}x the memory floor: "
             f"out of reach for any kernel here" if out_of_reach else ""))
    else:
        floor = machine_floor_ms(r, limits)[0] if r else None
        add(goal, "at_most", 1.5, r["ms"] / floor if r else None,
            f"{r['ms']:.2f} ms vs floor {floor:.2f} ms" if r else "not timed")
    against_peer("T=64: faster than PyTorch BF16", 2.5, 64, "torch bf16", "torch bf16",
                 "PyTorch BF16 not timed at T=64 (see skipped)")
    # 3. prefill near the roofline
    r = find(mine, 512)
    roof = roofline_goal_figures(interleaved, 512)
    unit = r["compute_unit"] if r else roofline.backend_unit(default)
    if has_amx:  # the peak of the default's unit: AMX unless $KTFP8_BACKEND forces another backend
        peak_name = "AMX" if unit == "amx" else roofline.UNIT_NAMES[unit]
        goal = f"T=512: fraction of the roofline (max(bytes / bandwidth, FLOPs / {peak_name} peak))"
        if roof:
            # both floors and the probes they come from: which one bounds can change from minute to
            # minute (the Emerald Rapids VM's tiles ran at half speed for minutes at a time)
            add(goal, "fraction", 0.5, roof["figures"]["roofline_fraction"],
                f"{roof['how']}; {roof['ms']:.2f} ms vs floor {roof['floor_ms']:.2f} ms: memory floor "
                f"{roof['memory_ms']:.2f} ms at {roof['read_gbs']:.1f} GB/s, compute floor {roof['compute_ms']:.2f} "
                f"ms at the {roof['unit_name']} peak of {roof['peak_gflops']:.0f} GFLOP/s (medians over rounds)")
        else:
            floor = max(machine_floor_ms(r, limits)) if r else None
            add(goal, "fraction", 0.5, floor / r["ms"] if r else None,
                f"{r['ms']:.2f} ms vs floor {floor:.2f} ms" if r else "not timed")
    else:  # no AMX here: the goal is the peak of the unit the backend computes on
        goal = f"T=512 (no AMX here): fraction of the measured {roofline.UNIT_NAMES[unit]} peak"
        if roof:
            add(goal, "fraction", 0.6, roof["figures"]["peak_fraction"],
                f"{roof['how']}; {roof['gflops']:.0f} of {roof['peak_gflops']:.0f} GFLOP/s (medians over rounds)")
        else:
            peak = max(roofline.peak_gflops(lim, unit) for lim in limits.values())
            add(goal, "fraction", 0.6, r["flops"] / (r["ms"] / 1e3) / 1e9 / peak if r else None,
                f"{r['tflops'] * 1e3:.0f} of {peak:.0f} GFLOP/s" if r else "not timed")
    other = peer(512, "kt-kernel", "bf16")
    against_peer("T=512: faster than kt-kernel AMX BF16", 3.0, 512, "kt-kernel", "kt-kernel AMXBF16_MOE",
                 "kt-kernel AMXBF16_MOE unavailable here" + (f" (its build here runs {other['side']}: "
                                                              f"{other['ms'] / r['ms']:.2f}x)" if other and r else ""))
    against_peer("T=512: faster than PyTorch BF16", 3.0, 512, "torch bf16", "torch bf16",
                 "PyTorch BF16 not timed at T=512 (see skipped)")
    # 4. the default choice is the best backend at every T: interleaved (see backend_choice.py)
    out.append(choice_goal(choice))
    return out


def peer_goal(peers, add, goal, target, tokens, label, wanted, default):
    """One comparison with a peer from the interleaved peer step (peer_rounds.run's result): added
    with add() and True where the step measured `label` at T=`tokens`; False (nothing added) where
    it did not, and the rows decide.  wanted: the side name the goal asks for (kt-kernel's build may
    run another class on this CPU: then the goal is not measured, and the note gives that ratio)."""
    fig = ((peers or {}).get("figures") or {}).get(str(tokens), {}).get(label)
    if fig is None:
        return False
    t = str(tokens)
    sides = " / ".join(f"ktfp8 {default} [{PC}]" if s == "ktfp8" else f"{peers['names'][s]} [bf16]"
                       for s in peers["rounds"][0][t]["order"])
    fixed = "".join(f"; {peers['names'][s]} on a worker pool of its own at each count"
                    for s in peers["fixed_threads"] if s in peers["rounds"][0][t]["order"])
    q1, q3 = fig["spread"]
    how = (f"interleaved: {peers['n_rounds'][t]} rounds alternating {sides}, each at its fastest of "
           f"{'/'.join(map(str, peers['threads']))} thread(s) in the round{fixed}; median of per-round ratios "
           f"(middle half {q1:.2f}x-{q3:.2f}x)")
    name = peers["names"][label]
    if not name.startswith(wanted):
        add(goal, "speedup", target, None, f"{wanted} unavailable here (its build here runs {name}: "
                                           f"{fig['ratio']:.2f}x; {how})")
        return True
    counts = [",".join(map(str, fig[k])) for k in ("ours_threads", "peer_threads")]
    add(goal, "speedup", target, fig["ratio"],
        f"{how}; ktfp8 {default} {fig['ours_ms']:.2f} ms ({counts[0]} thr) vs {name} {fig['peer_ms']:.2f} ms "
        f"({counts[1]} thr) (medians over rounds; the thread counts each was fastest at)")
    return True


def choice_goal(choice):
    """Goal 4 from the interleaved backend step (backend_choice.run's result, None when it did not run)."""
    goal = "default choice: its time over the fastest other ktfp8 backend's, worst T"
    if choice is None or choice.get("skipped"):
        return _goal(goal, "at_most", 1.0, None, choice["skipped"] if choice else "the backend step did not run")
    worst = choice["figures"]["worst"]
    sat_out = {}  # backend: the T it sat out
    for t, why in choice.get("left_out", {}).items():
        for b in why:
            sat_out.setdefault(b, []).append(t)
    left = "".join(f"; {b} sat T={','.join(ts)} out ({OUT_OF_CONTENTION:g}x the default's time or more in the "
                   f"table, or not timed there)" for b, ts in sat_out.items())
    if worst is None:
        return _goal(goal, "at_most", 1.0, None, f"no other backend in contention at any T{left}")
    rounds = ",".join(f"{t} ({choice['n_rounds'][str(t)]} rounds)" for t in choice["tokens"])
    return _goal(goal, "at_most", 1.0, worst["ratio"],
                 f"interleaved: rounds alternating {', '.join(choice['backends'])} at "
                 f"T={rounds}, median of per-round ratios; worst T={worst['tokens']}"
                 f" (middle half of its rounds {worst['spread'][0]:.2f}x-{worst['spread'][1]:.2f}x): "
                 f"{choice['default']} {worst['default_ms']:.2f} ms vs {worst['backend']} {worst['backend_ms']:.2f} ms "
                 f"(medians over rounds, best thread count){left}")


def _goal(goal, kind, target, measured, note):
    reached = None if measured is None else measured <= target if kind == "at_most" else measured >= target
    return dict(goal=goal, kind=kind, target=target, measured=measured, reached=reached, note=note)


def roofline_goal_figures(interleaved, tokens):
    """Goals 2 and 3's figures at T=`tokens` from the interleaved step, with the medians over rounds
    that the notes quote (each round at its fastest thread count and best probes), or None where the
    step did not measure that T."""
    entry = (interleaved or {}).get("roofline", {}).get(str(tokens))
    if not entry:
        return None
    rounds = entry["rounds"]
    best = [round_best(rec) for rec in rounds]
    ms, read, peak = (statistics.median(b[i] for b in best) for i in range(3))
    memory_ms = entry["active_bytes"] / (read * 1e9) * 1e3
    compute_ms = entry["flops"] / (peak * 1e9) * 1e3 if peak else 0.0
    unit_name = roofline.UNIT_NAMES[entry["unit"]]
    return dict(figures=interleaved["figures"]["roofline"][str(tokens)], ms=ms, memory_ms=memory_ms,
                compute_ms=compute_ms, floor_ms=max(memory_ms, compute_ms), unit_name=unit_name, read_gbs=read,
                gflops=entry["flops"] / (ms / 1e3) / 1e9, peak_gflops=peak,
                how=(f"interleaved: {len(rounds)} rounds alternating read probe / {unit_name} "
                     f"peak probe / {entry['calls']} T={tokens} calls, median of per-round ratios"))


def decode_goals(interleaved, limits, mine):
    """Goal 1 from the interleaved decode step (interleaved.run's result, None when it did not run):
    per thread count of `limits`, FP8 per-channel's fraction of the read bandwidth; then FP8
    per-channel against BF16 weights and against block-wise FP8."""
    skipped = "the interleaved decode step did not run" if interleaved is None else (
        interleaved.get("skipped") or interleaved.get("decode_skipped"))
    if skipped:
        fig, how = {}, ""
    else:
        fig, rounds = interleaved["figures"], interleaved["rounds"]
        how = (f"interleaved: {len(rounds)} rounds alternating read probe / {' / '.join(interleaved['formats'])} "
               f"({interleaved['calls']} calls each), median of per-round ratios")

    def median_over_rounds(fmt=None, n=None):
        """Median over rounds of fmt's ms at n threads (None: at its fastest), or, without fmt, of the
        read probe's GB/s at n."""
        def one(rec):
            if fmt is None:
                return rec[n]["read_gbs"]
            return rec[n]["ms"][fmt] if n else best_ms(rec, fmt)
        return statistics.median(one(rec) for rec in rounds)

    out = []
    for n in sorted(limits, key=int):
        measured = fig.get("bw_fraction", {}).get(n)
        note = skipped or f"{n} thread(s) not in the interleaved step" if measured is None else (
            f"{how}; {PC} {median_over_rounds(PC, n):.2f} ms, probe "
            f"{median_over_rounds(n=n):.1f} GB/s (medians over rounds)")
        out.append(_goal(f"decode T=1, {n} thread(s): {mine} FP8 per-channel, fraction of the measured read "
                         f"bandwidth", "fraction", 0.85, measured, note))
    for name, key, fmt, target in (("FP8 per-channel faster than BF16 weights", "fp8_vs_bf16", "bf16", 1.8),
                                   ("per-channel not slower than block-wise", "pc_vs_block", "fp8_block", 1.0)):
        measured = fig.get(key)
        note = skipped or f"{fmt} is not in the plan (--formats)" if measured is None else (
            f"{how}; {PC} {median_over_rounds(PC):.2f} ms vs {fmt} {median_over_rounds(fmt):.2f} ms "
            f"(medians over rounds, best thread count)")
        out.append(_goal(f"decode T=1: {name} (default backend)", "speedup", target, measured, note))
    return out


def goals_lines(goal_rows):
    lines = ["goals (benchmark layer, each side at its best thread count unless stated; an interleaved line "
             "sets each round against that round's own probes, a line from the table against this run's best "
             "measured limits):"]
    for g in goal_rows:
        verdict = "not measured" if g["reached"] is None else "reached" if g["reached"] else "NOT reached"
        as_fraction = g["kind"] == "fraction"
        sign = "<=" if g["kind"] == "at_most" else ">="
        figure = "" if g["measured"] is None else _figure(g["measured"], g["target"], as_fraction)
        target = f"{g['target']:.0%}" if as_fraction else f"{g['target']}x"
        lines.append(f"  {verdict:12s} {g['goal']} (target {sign} {target}): {figure}  {g['note']}")
    return "\n".join(lines)


def _figure(measured, target, as_fraction):
    """measured as a percentage or a ratio, with as many more digits as it takes not to print the target
    itself (a default 1.002x the time of the best backend is not reached, and should not read 1.00x; nor
    84.96 % of the bus 85.0 %)."""
    scale, digits = (100, 0) if as_fraction else (1, 2)
    while digits < 6 and measured != target and round(measured * scale, digits) == round(target * scale, digits):
        digits += 1
    return f"{measured:.{digits}%}" if as_fraction else f"{measured:.{digits}f}x"


def _ordered(items):
    return list(dict.fromkeys(items))


def _side_order(side):
    return (0 if side.startswith("ktfp8") else 1, side)


def _row_order(r):
    return (r["tokens"], _side_order(r["side"]), r["format"])
