"""The benchmark plot (matplotlib, PNG), one row per layer, each side at its best thread count:
time per token against T (log-log) with the memory and compute floors drawn, and each side's
fraction of its roofline against T.  ktfp8 shows its default backend (every backend with
all_backends); peers are all shown."""
from . import report
from . import layers as L

# line style by weight format, colour by side: a side's formats share a colour
FORMAT_STYLE = {"fp8_per_channel": "-", "fp8_block": "--", "bf16": "-.", "fp32": ":"}
FORMAT_LABEL = {"fp8_per_channel": "FP8 per-channel", "fp8_block": "FP8 block", "bf16": "BF16", "fp32": "FP32"}
KTFP8_COLOURS = ("#1f4e99", "#2e8b57", "#6a3d9a", "#8c564b", "#17becf")
PEER_COLOURS = ("#d62728", "#ff7f0e", "#e377c2", "#bcbd22", "#7f7f7f", "#9467bd")


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the plot needs matplotlib: pip install matplotlib (or pass --no-plot)") from None
    matplotlib.use("Agg")  # files only: no screen needed
    import matplotlib.pyplot as plt
    return plt


def _shown(rows, default, all_backends):
    """The rows drawn: every peer, and ktfp8's default backend (every backend with all_backends)."""
    return [r for r in rows if r["kind"] == "peer" or all_backends or r["side"] == f"ktfp8 {default}"]


def _colours(rows, default):
    ours = sorted({r["side"] for r in rows if r["kind"] == "ktfp8"}, key=lambda s: (s != f"ktfp8 {default}", s))
    peers = sorted({r["side"] for r in rows if r["kind"] == "peer"})
    colours = {s: KTFP8_COLOURS[i % len(KTFP8_COLOURS)] for i, s in enumerate(ours)}
    colours.update({s: PEER_COLOURS[i % len(PEER_COLOURS)] for i, s in enumerate(peers)})
    return colours


def _series(rows):
    """(side, format) -> sorted rows, ktfp8 first."""
    out = {}
    for r in rows:
        out.setdefault((r["side"], r["format"]), []).append(r)
    order = sorted(out, key=lambda k: (report._side_order(k[0]), list(FORMAT_STYLE).index(k[1])))
    return {k: sorted(out[k], key=lambda r: r["tokens"]) for k in order}


def _floors(rows, limits, default):
    """Floors per token (microseconds) of the default backend's FP8 per-channel and BF16 rows against
    the machine's best limits: [(label, style, [(T, us)])]."""
    lines = []
    for fmt, style in (("fp8_per_channel", "--"), ("bf16", "-.")):
        mine = [r for r in rows if r["side"] == f"ktfp8 {default}" and r["format"] == fmt]
        if mine:
            pts = [(r["tokens"], report.machine_floor_ms(r, limits)[0] * 1e3 / r["tokens"]) for r in mine]
            lines.append((f"memory floor, {FORMAT_LABEL[fmt]}", style, sorted(pts)))
    mine = [r for r in rows if r["side"] == f"ktfp8 {default}" and r["format"] == "fp8_per_channel"]
    if mine:
        unit = mine[0]["compute_unit"]
        pts = [(r["tokens"], report.machine_floor_ms(r, limits)[1] * 1e3 / r["tokens"]) for r in mine]
        lines.append((f"compute floor, {report.roofline.UNIT_NAMES[unit]} peak", ":", sorted(pts)))
    return lines


def title(results):
    """The figure's title: the CPU, and where the weights came from (a walk short of 4 L3s: partly cache)."""
    machine = results.get("machine", {})
    from_dram = all(L.walk_reaches_dram(r.get("walk_bytes"), machine.get("l3_mib")) for r in results["results"])
    return (f"{machine.get('cpu', '')}: each side at its best thread count; "
            + ("weights from DRAM" if from_dram else f"weights partly from cache (walks under "
                                                     f"{L.WALK_L3_MULTIPLE}x the L3)"))


def save(results, out, all_backends=False):
    """Writes the PNG to `out`, a path or a binary file."""
    plt = _matplotlib()
    rows, limits = results["results"], results["limits"]
    default = results.get("default_backend") or next((r["side"][6:] for r in rows if r["kind"] == "ktfp8"), "")
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    fig, axes = plt.subplots(len(layers), 2, figsize=(15, 5.2 * len(layers)), squeeze=False)
    colours = _colours(rows, default)
    for layer, (time_ax, roof_ax) in zip(layers, axes):
        best = report.best_threads([r for r in rows if r["layer"] == layer])
        for (side, fmt), pts in _series(_shown(best, default, all_backends)).items():
            mine = side.startswith("ktfp8")
            name = side + (" (default)" if side == f"ktfp8 {default}" else "")
            style = dict(color=colours[side], linestyle=FORMAT_STYLE.get(fmt, "-"), marker="o" if mine else "s",
                         linewidth=2.4 if mine else 1.3, markersize=5 if mine else 3.5,
                         label=f"{name} · {FORMAT_LABEL.get(fmt, fmt)}")
            T = [r["tokens"] for r in pts]
            time_ax.plot(T, [r["ms"] * 1e3 / r["tokens"] for r in pts], **style)
            roof_ax.plot(T, [100 * r["roofline_fraction"] for r in pts], **style)
        for label, style, pts in _floors(best, limits, default):
            time_ax.plot([t for t, _ in pts], [v for _, v in pts], color="black", linewidth=1.1, linestyle=style,
                         alpha=0.6, label=label)
        time_ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="microseconds per token (lower is better)")
        time_ax.set_title(f"{layer}: time per token", loc="left", fontsize=10)
        roof_ax.axhline(100, color="black", linewidth=1, alpha=0.6)
        roof_ax.set(xscale="log", xlabel="tokens T", ylabel="% of the roofline (higher is better)",
                    ylim=(0, max(110, 10 + max((100 * r["roofline_fraction"] for r in best), default=0))))
        roof_ax.set_title("fraction of the roofline: max(bytes / read bandwidth, FLOPs / unit peak) / time",
                          loc="left", fontsize=10)
        for ax in (time_ax, roof_ax):
            ax.grid(True, which="both", alpha=0.3)
    handles = {}
    for ax in axes.ravel():
        for h in ax.get_lines():
            if not h.get_label().startswith("_"):
                handles.setdefault(h.get_label(), h)
    fig.legend(handles.values(), handles.keys(), loc="center left", bbox_to_anchor=(0.76, 0.5), fontsize=8.5,
               frameon=False)
    fig.suptitle(title(results), fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 0.76, 0.97))
    try:
        fig.savefig(out, dpi=100, format="png")
    finally:
        plt.close(fig)
