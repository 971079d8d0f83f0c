"""The benchmark plot (matplotlib, PNG): per layer, effective bandwidth and TFLOP/s against T for every
side at its best thread count with the machine's measured limits as lines, time per token against T,
and the speed-up all threads give over one."""
from . import report


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the plot needs matplotlib: pip install matplotlib (or pass --no-plot)") from None
    matplotlib.use("Agg")  # files only: no screen needed
    import matplotlib.pyplot as plt
    return plt


def _series(rows, value):
    """(side, format) -> sorted [(T, value)]."""
    out = {}
    for r in rows:
        out.setdefault((r["side"], r["format"]), []).append((r["tokens"], value(r)))
    return {k: sorted(v) for k, v in sorted(out.items(), key=lambda kv: (report._side_order(kv[0][0]), kv[0][1]))}


def _style(side, fmt, colors):
    """ktfp8 solid with circles, peers dashed with squares; one colour per (side, format) in all panels."""
    mine = side.startswith("ktfp8")
    return dict(color=colors[(side, fmt)], linestyle="-" if mine else "--", marker="o" if mine else "s",
                markersize=4, label=f"{side} [{fmt}]")


def save(results, out):
    """Writes the PNG to `out`, a path or a binary file."""
    plt = _matplotlib()
    rows, limits = results["results"], results["limits"]
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    fig, axes = plt.subplots(len(layers), 4, figsize=(24, 5.5 * len(layers)), squeeze=False)
    all_threads = max(limits, key=int)
    keys = sorted({(r["side"], r["format"]) for r in rows}, key=lambda k: (report._side_order(k[0]), k[1]))
    palette = plt.get_cmap("tab20").colors
    colors = {k: palette[i % len(palette)] for i, k in enumerate(keys)}
    for layer, ax in zip(layers, axes):
        mine = [r for r in rows if r["layer"] == layer]
        best = report.best_threads(mine)
        panels = [
            (ax[0], _series(best, lambda r: r["gbs"]), "effective bandwidth (GB/s): active weight bytes / time",
             [(lim["read_gbs"], f"measured read, {n} thr") for n, lim in limits.items()]),
            (ax[1], _series(best, lambda r: r["tflops"]), "TFLOP/s",
             [(lim["fma_gflops"] / 1e3, f"FP32 FMA peak, {n} thr") for n, lim in limits.items()]
             + [(lim["dpbf16_gflops"] / 1e3, f"vdpbf16ps peak, {n} thr") for n, lim in limits.items()
                if lim.get("dpbf16_gflops")]),
            (ax[2], _series(best, lambda r: r["ms"] * 1e3 / r["tokens"]), "microseconds per token", []),
        ]
        for axis, series, ylabel, lines in panels:
            for (side, fmt), pts in series.items():
                axis.plot([t for t, _ in pts], [v for _, v in pts], **_style(side, fmt, colors))
            for value, label in lines:
                axis.axhline(value, color="grey", linewidth=1, linestyle=":" if str(label).endswith(" 1 thr") else "-")
                axis.annotate(label, (1, value), xycoords=("axes fraction", "data"), ha="right", va="bottom",
                              fontsize=7, color="dimgrey")
            axis.set(xscale="log", yscale="log", xlabel="tokens T", ylabel=ylabel)
            axis.grid(True, which="both", alpha=0.3)
        _thread_speedup(ax[3], mine, all_threads, colors)
        ax[0].set_title(f"{layer} (each side at its best thread count)", loc="left", fontsize=10)
        ax[3].set_title("thread scaling", loc="left", fontsize=10)
    handles = {h.get_label(): h for a in axes.ravel() for h in a.get_lines() if not h.get_label().startswith("_")}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.04 + 0.02 * (len(handles) // 4), 1, 1))
    try:
        fig.savefig(out, dpi=110, format="png")
    finally:
        plt.close(fig)


def _thread_speedup(axis, rows, all_threads, colors):
    one = {(r["side"], r["format"], r["tokens"]): r["ms"] for r in rows if int(r["threads"]) == 1}
    many = [r for r in rows if str(r["threads"]) == str(all_threads)]
    ratios = [dict(r, ratio=one[(r["side"], r["format"], r["tokens"])] / r["ms"]) for r in many
              if (r["side"], r["format"], r["tokens"]) in one]
    for (side, fmt), pts in _series(ratios, lambda r: r["ratio"]).items():
        axis.plot([t for t, _ in pts], [v for _, v in pts], **_style(side, fmt, colors))
    axis.axhline(float(all_threads), color="grey", linewidth=1)
    axis.set(xscale="log", xlabel="tokens T", ylabel=f"speed-up of {all_threads} threads over 1",
             ylim=(0, float(all_threads) * 1.25))
    axis.grid(True, which="both", alpha=0.3)
