"""The profiler's tables and figure: per-setting rates and stage shares, verdicts, comparisons."""
from __future__ import annotations

import os

import numpy as np

from datasvc.stats import STAGES


def _fmt(v, f="{:.2f}") -> str:
    return "-" if v is None else f.format(v)


def table(report: dict) -> str:
    runs = report["runs"]
    lines = []
    hdr = (f"{'MBS':>4} {'act':>4} {'samp/s':>8} {'img/s':>8} {'MP/s':>7} {'txt tok/s':>10} {'vis tok/s':>10} "
           f"{'mb/s':>7} {'pack eff':>8} {'cores':>6} | " + " ".join(f"{s[:7]:>7}" for s in STAGES) + "  (stage time share)")
    lines.append(hdr)
    for r in runs:
        rt = r["rates"]
        cores = r["cpu"].get("service_cores_busy")
        lines.append(
            f"{r['micro_batch_size']:>4} {r['actors']:>4} {rt['samples_per_s']:>8.1f} {rt['images_per_s']:>8.1f} "
            f"{rt['megapixels_per_s']:>7.2f} {rt['text_tokens_per_s']:>10.0f} {rt['vision_tokens_per_s']:>10.0f} "
            f"{rt['micro_batches_per_s']:>7.2f} {r['packing_efficiency']:>8.3f} {_fmt(cores, '{:.2f}'):>6} | "
            + " ".join(f"{100 * r['stages'][s]['share']:>6.1f}%" for s in STAGES)
            + ("  (short run)" if r["short_run"] else ""))
    lines += [_video_line(r) for r in runs if r.get("video")]
    rej = {}
    for r in runs:
        for k, v in r["rejected"].items():
            rej[k] = rej.get(k, 0) + v
    lines.append("rejected samples: " + (", ".join(f"{k} {v}" for k, v in sorted(rej.items())) or "none"))
    r0 = runs[0]
    lines.append(f"per sample: {r0['per_sample']['images']:.2f} images, {r0['per_sample']['megapixels']:.3f} MP, "
                 f"{r0['per_sample']['text_tokens']:.0f} text + {r0['per_sample']['vision_tokens']:.0f} vision tokens")
    d = report["demand"]
    if d["kind"] == "model":
        lines.append(f"demand: {d['model']['name']} ({d['active_params'] / 1e9:.2f}B active / "
                     f"{d['total_params'] / 1e9:.1f}B total), {d['gpus']} GPUs, DP {d['dp']}, "
                     f"{d['peak_tflops']:.0f} TFLOP/s peak x MFU {d['mfu']:.2f}")
    elif d["kind"] == "step_time":
        lines.append(f"demand: step time {d['step_time_s']} s per {d['grad_accum']} micro-batch(es) per DP rank")
    for v in report["verdicts"]:
        extra = ""
        r = [x for x in runs if x["micro_batch_size"] == v["micro_batch_size"]]
        if r and r[0].get("flops_per_micro_batch"):
            extra = (f" [{r[0]['flops_per_micro_batch'] / 1e12:.1f} TFLOP per micro-batch, "
                     f"{100 * r[0]['flops_vision_fraction']:.1f}% vision]")
        lines.append("verdict " + v["summary"] + extra)
    return "\n".join(lines)


def _video_line(run: dict) -> str:
    v = run["video"]
    share = lambda k: "-" if v.get(k) is None else f"{100 * v[k]:.0f}%"  # noqa: E731
    return (f"video MBS {run['micro_batch_size']} x{run['actors']}: {v['videos']} videos, {v['frames_decoded']} frames "
            f"decoded, {_fmt(v['decode_ms_per_frame'])} ms decode + {_fmt(v['preprocess_ms_per_frame'])} ms resize "
            f"per frame, {_fmt(v.get('video_vision_tokens_per_s'), '{:.0f}')} video tokens/s "
            f"({share('video_token_share')} of vision tokens; {share('decode_time_share')} of decode time)")


def figure(report: dict, path: str, compare: dict | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = compare["reports"] if compare else {report.get("label") or "data": report}
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    ax = axes[0]
    markers = "osD^v<>"
    for j, (name, rep) in enumerate(reports.items()):
        for i, mbs in enumerate(rep["settings"]["mbs"]):
            rs = sorted((r for r in rep["runs"] if r["micro_batch_size"] == mbs), key=lambda r: r["actors"])
            line, = ax.plot([r["actors"] for r in rs], [r["rates"]["micro_batches_per_s"] for r in rs],
                            marker=markers[j % len(markers)], label=f"{name} MBS {mbs}" if len(reports) > 1 else f"MBS {mbs}")
            v = next(x for x in rep["verdicts"] if x["micro_batch_size"] == mbs)
            if v["demand_micro_batches_per_s"]:
                ax.axhline(v["demand_micro_batches_per_s"], color=line.get_color(), ls="--", lw=1)
                who = f"{name} " if len(reports) > 1 else ""
                ax.annotate(f"{who}demand MBS {mbs}: {v['demand_micro_batches_per_s']:.3g}/s",
                            (rs[0]["actors"], v["demand_micro_batches_per_s"]), textcoords="offset points",
                            xytext=(2 + 110 * (j % 3), 3), fontsize=8, color=line.get_color())
    ax.set_xlabel("preprocessing actors per DP rank")
    ax.set_ylabel("micro-batches / s (one DP rank)")
    ax.set_yscale("log")
    fmt = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: f"{v:g}" if f"{v:.1e}"[0] in "25" else ""))
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_title("Throughput vs actors (dashed: trainer demand per DP rank)")
    actor_vals = sorted({r["actors"] for rep in reports.values() for r in rep["runs"]})
    ax.set_xticks(actor_vals)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")

    ax = axes[1]
    labels, shares = [], []
    for name, rep in reports.items():
        for r in rep["runs"]:
            labels.append((f"{name}\n" if len(reports) > 1 else "") + f"MBS {r['micro_batch_size']} x{r['actors']}")
            shares.append([100 * r["stages"][s]["share"] for s in STAGES])
    shares = np.array(shares)
    left = np.zeros(len(labels))
    colors = plt.get_cmap("tab10").colors
    for k, s in enumerate(STAGES):
        ax.barh(labels, shares[:, k], left=left, label=s, color=colors[k])
        left += shares[:, k]
    ax.invert_yaxis()
    ax.set_xlabel("share of stage time (%)")
    ax.set_xlim(0, 100)
    ax.set_title("Where the time goes\n(actors: read, decode, preprocess, tokenize; feeder: pack; client: transfer)",
                 fontsize=10)
    ax.legend(fontsize=8, ncol=len(STAGES), loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compare_table(cmp: dict) -> str:
    names = list(cmp["reports"])
    first = cmp["reference"]
    w = max(20, max(len(n) for n in names) + 12)
    lw = max(22, max(len(k) for k in cmp["rows"]) + 1)
    lines = [f"{'':{lw}s}" + "".join(f"{n:>{w}s}" for n in names)]
    for label, row in cmp["rows"].items():
        cells = []
        for n in names:
            v, r = row["values"][n], row["ratio"][n]
            if v is None:
                cells.append(f"{'-':>{w}s}")
            elif n == first:
                cells.append(f"{v:>{w}.3g}")
            else:
                cells.append(f"{f'{v:.3g} ({r:.2f}x)' if r is not None else f'{v:.3g}':>{w}s}")
        lines.append(f"{label:{lw}s}" + "".join(cells))
    return "\n".join(lines)


def image_cost_table(cost: dict) -> str:
    return cost_table(cost, "in-process, CPU time", [
        ("samples", "samples", "{:.0f}"), ("images", "images", "{:.0f}"),
        ("vision tokens/sample", "vision_tokens_per_sample", "{:.1f}"),
        ("MP/sample", "megapixels_per_sample", "{:.3f}"),
        ("dec+prep MP per CPU-s", "megapixels_per_cpu_s", "{:.1f}"),
        ("dec+prep CPU ms/sample", "cpu_ms_per_sample", "{:.2f}")])


def cost_table(cost: dict, title: str, rows: list[tuple[str, str, str]]) -> str:
    """Sources side by side, one row per (label, key, format); each source after the first shows
    its ratio to the first (``cost[name]["ratio"][key]``)."""
    names = list(cost)
    lines = [f"{title:24s}" + "".join(f"{n:>20s}" for n in names)]
    for label, key, f in rows:
        cells = []
        for n in names:
            v = cost[n].get(key)
            r = cost[n]["ratio"].get(key)
            txt = "-" if v is None else f.format(v) + (f" ({r:.2f}x)" if r is not None and n != names[0] else "")
            cells.append(f"{txt:>20s}")
        lines.append(f"{label:24s}" + "".join(cells))
    return "\n".join(lines)
