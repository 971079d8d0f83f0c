"""The benchmark plot (matplotlib, PNG): per layer, effective bandwidth and TFLOP/s against T for every
side at its best thread count with the machine's measured limits as lines, time per token against T,
and the speed-up all threads give over one."""
import os

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


def _style(side):
    return dict(linestyle="-" if side.startswith("ktfp8") else "--", marker="o" if side.startswith("ktfp8") else "s",
                markersize=4)


def save(results, path):
    plt = _matplotlib()
    rows, limits = results["results"], results["limits"]
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    fig, axes = plt.subplots(len(layers), 4, figsize=(24, 5.5 * len(layers)), squeeze=False)
    all_threads = max(limits, key=int)
    for layer, ax in zip(layers, axes):
        mine = [r for r in rows if r["layer"] == layer]
        best = report.best_threads(mine)
        panels = [
            (ax[0], _series(best, lambda r: r["gbs"]), "effective bandwidth (GB/s)",
             [(lim["read_gbs"], f"measured read, {n} thr") for n, lim in limits.items()]),
            (ax[1], _series(best, lambda r: r["tflops"]), "TFLOP/s",
             [(lim["fma_gflops"] / 1e3, f"FP32 FMA peak, {n} thr") for n, lim in limits.items()]
             + [(lim["dpbf16_gflops"] / 1e3, f"vdpbf16ps peak, {n} thr") for n, lim in limits.items()
                if lim.get("dpbf16_gflops")]),
            (ax[2], _series(best, lambda r: r["ms"] * 1e3 / r["tokens"]), "microseconds per token", []),
        ]
        for axis, series, ylabel, lines in panels:
            for (side, fmt), pts in series.items():
                axis.plot([t for t, _ in pts], [v for _, v in pts], label=f"{side} [{fmt}]", **_style(side))
            for value, label in lines:
                axis.axhline(value, color="grey", linewidth=1, linestyle=":" if str(label).endswith(" 1 thr") else "-")
                axis.annotate(label, (1, value), xycoords=("axes fraction", "data"), ha="right", va="bottom",
                              fontsize=7, color="dimgrey")
            axis.set(xscale="log", yscale="log", xlabel="tokens T", ylabel=ylabel)
            axis.grid(True, which="both", alpha=0.3)
        _thread_speedup(ax[3], mine, limits, all_threads)
        ax[0].set_title(layer, loc="left", fontsize=10)
        ax[0].legend(fontsize=7)
    fig.tight_layout()
    tmp = f"{path}.partial"  # renamed into place when complete: never a half-written PNG
    try:
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)


def _thread_speedup(axis, rows, limits, all_threads):
    one = {(r["side"], r["format"], r["tokens"]): r["ms"] for r in rows if int(r["threads"]) == 1}
    many = [r for r in rows if str(r["threads"]) == str(all_threads)]
    ratios = [dict(r, ratio=one[(r["side"], r["format"], r["tokens"])] / r["ms"]) for r in many
              if (r["side"], r["format"], r["tokens"]) in one]
    for (side, fmt), pts in _series(ratios, lambda r: r["ratio"]).items():
        axis.plot([t for t, _ in pts], [v for _, v in pts], label=f"{side} [{fmt}]", **_style(side))
    axis.axhline(float(all_threads), color="grey", linewidth=1)
    axis.set(xscale="log", xlabel="tokens T", ylabel=f"speed-up of {all_threads} threads over 1",
             ylim=(0, float(all_threads) * 1.25))
    axis.grid(True, which="both", alpha=0.3)
