"""Plot ``trainer.bench`` results: tokens/s and data-wait share against MBS per strategy, step time
per data source, and where the runs hold them, one GPU against several and the GPU decode comparison.
``python -m trainer.bench.plots BENCH.json ... [--decode gpu_decode.json] --out PNG``; with
``--by-source``, every data source against MBS instead (tokens/s, data wait, row fill, ratios to real).

Case names follow ``trainer.bench``: ``{strategy}-{source}-mbs{N}[-label]``; failed cases (OOM) are
marked on the MBS axis instead of being dropped.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics

from datasvc.usage import HelpFormatter
from trainer.summary import steady_window

# Older results name a metric as it was once written; each maps to the name it has now.
FORMER_NAMES = {"data_wait_frac": "data_wait_share"}
CASE = re.compile(r"^(?P<strategy>fsdp|3d)-(?P<source>real-large|real|synthetic-large|synthetic|mock-large|mock|video-mix)"
                  r"-mbs(?P<mbs>\d+)(?:-(?P<label>.+))?$")


COLOURS = {"fsdp": "tab:blue", "3d": "tab:orange"}


def load(paths: list[str]) -> list[dict]:
    """Bench rows with their case name parsed; each gets ``tokens_per_s_sem`` where its per-step
    metrics lie beside the JSON as ``trainer.bench`` leaves them (``OUT/bench.json`` with
    ``OUT/CASE.metrics.jsonl``; ``X_bench_Y.json`` with ``X_CASE.metrics.jsonl``)."""
    rows = []
    for path in paths:
        prefix = os.path.join(os.path.dirname(path), os.path.basename(path).partition("bench")[0])
        for r in json.load(open(path)):
            r = current_names(r)
            m = CASE.match(r["case"])
            if m:
                row = {**r, **m.groupdict(), "mbs": int(m["mbs"]), "label": m["label"] or ""}
                sem = steady_tokens_sem(f"{prefix}{r['case']}.metrics.jsonl", r.get("tokens_per_s"))
                if sem is not None:
                    row.setdefault("tokens_per_s_sem", sem)
                rows.append(row)
    return rows


def current_names(row: dict) -> dict:
    """The row with every former metric name replaced by the current one (a current value wins)."""
    out = {FORMER_NAMES.get(k, k): v for k, v in row.items() if k not in FORMER_NAMES}
    for old, new in FORMER_NAMES.items():
        if old in row and out.get(new) is None:
            out[new] = row[old]
    return out


def steady_tokens_sem(metrics_path: str, mean: float | None) -> float | None:
    """Standard error of a case's steady-state tokens/s (the window ``trainer.summary.summarize``
    averages). None where the file is missing, holds under 3 steady steps, or is from another run
    of the case (its mean is not ``mean``)."""
    if mean is None or not os.path.exists(metrics_path):
        return None
    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    values = [r["tokens_per_s"] for r in steady_window(records) if r.get("tokens_per_s") is not None]
    if len(values) < 3 or abs(statistics.fmean(values) - mean) > 1e-3 * mean + 0.1:
        return None
    return statistics.stdev(values) / math.sqrt(len(values))


def plot(rows: list[dict], source: str, out: str, decode: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suffix = _suffix(source)
    scaling = [r for r in rows if re.search(r"(^|-)\d+gpu$", r["label"]) and r["rc"] == 0]
    ratios = source_ratios(rows, suffix)
    second_row = bool(scaling or decode or len(ratios) > 1)
    fig, axes = plt.subplots(2 if second_row else 1, 3, figsize=(16, 9.6 if second_row else 4.8), squeeze=False)
    ax_tok, ax_wait, ax_src = axes[0]
    # The MBS sweep: trainable vision, recompute only where MBS needs it.
    sweep = [r for r in rows if r["source"] == source and r["label"] in ("", "recompute")]
    for strategy, colour in COLOURS.items():
        ok = sorted((r for r in sweep if r["strategy"] == strategy and r["rc"] == 0), key=lambda r: r["mbs"])
        failed = [r for r in sweep if r["strategy"] == strategy and r["rc"] != 0]
        ax_tok.plot([r["mbs"] for r in ok], [r["tokens_per_s"] for r in ok], "o-", color=colour, label=strategy)
        for mbs in sorted({r["mbs"] for r in ok if r["label"]}):  # once, even where runs repeat a case
            top = max(r["tokens_per_s"] for r in ok if r["mbs"] == mbs)
            ax_tok.annotate("recompute", (mbs, top), fontsize=7, xytext=(4, -10), textcoords="offset points")
        for r in failed:
            ax_tok.plot(r["mbs"], 0, "x", color=colour, markersize=10)
        marker = "o-" if strategy == "fsdp" else "s--"
        ax_wait.plot([r["mbs"] for r in ok], [100 * r["data_wait_share"] for r in ok], marker, color=colour,
                     label=strategy)
    for mbs in sorted({r["mbs"] for r in sweep if r["rc"] != 0}):
        ax_tok.annotate("failed (OOM)", (mbs, 0), fontsize=7, xytext=(-30, 10), textcoords="offset points")
    # The vision tower run over whole-image chunks (trainable), where one call per micro-batch failed.
    chunked = [r for r in rows if r["source"] == source and "vchunk" in r["label"] and r.get("tokens_per_s")
               and r["mbs"] >= 8]
    for r in chunked:
        colour = COLOURS[r["strategy"]]
        ax_tok.plot(r["mbs"], r["tokens_per_s"], "*", color=colour, markersize=12,
                    markerfacecolor="none" if r.get("partial") else colour)
        ax_wait.plot(r["mbs"], 100 * r["data_wait_share"], "*", color=colour, markersize=12,
                     markerfacecolor="none" if r.get("partial") else colour)
    for strategy in COLOURS:  # one label per strategy, at its best run, where runs repeat the case
        runs = [r for r in chunked if r["strategy"] == strategy]
        if runs:
            best = max(runs, key=lambda r: r["tokens_per_s"])
            ax_tok.annotate(f"{strategy}, vision in chunks{' (partial)' if best.get('partial') else ''}",
                            (best["mbs"], best["tokens_per_s"]), fontsize=7, textcoords="offset points",
                            xytext=(-130, 6) if strategy == "3d" else (-120, -14))
    frozen = [r for r in rows if r["source"] == source and "frozen-vision" in r["label"] and r["rc"] == 0]
    for r in frozen:
        ax_tok.plot(r["mbs"], r["tokens_per_s"], "^", color="tab:green")
        ax_tok.annotate(f"{r['strategy']}, vision frozen", (r["mbs"], r["tokens_per_s"]), fontsize=7,
                        xytext=(-90, -3), textcoords="offset points")
    ax_tok.set(xscale="log", xlabel="micro-batch size", ylabel="real tokens / s (1 GPU)",
               title=f"tokens/s vs MBS ({source} photos)")
    ax_tok.legend()
    ax_wait.axhline(1.0, color="red", linestyle="--", linewidth=1, label="1% target")
    ax_wait.set(xscale="log", xlabel="micro-batch size", ylabel="data wait, % of step time",
                title="trainer waiting for data", ylim=(-0.05, 1.5))
    ax_wait.legend()
    from matplotlib.ticker import NullFormatter

    for ax in (ax_tok, ax_wait):
        ax.set_xlim(0.8, 10)
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.xaxis.set_minor_formatter(NullFormatter())

    sources = [f"real{suffix}", f"synthetic{suffix}", f"mock{suffix}"]
    _grouped_bars(ax_src, [s.replace(suffix, "") for s in sources],
                  [(strategy, COLOURS[strategy], [step_time(rows, strategy, s, 2, "") or 0.0 for s in sources])
                   for strategy in ("fsdp", "3d")], "{:.2f}s")
    ax_src.set(ylabel="step time, s (MBS 2)", title="real vs calibrated synthetic vs mock")
    if second_row:
        ax_gpus, ax_dec, ax_ratio = axes[1]
        _plot_scaling(ax_gpus, scaling)
        _plot_decode(ax_dec, decode)
        _plot_source_ratios(ax_ratio, rows, suffix)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _suffix(source: str) -> str:
    """The set-size suffix shared by a real source and its synthetic and mock twins."""
    return "-large" if source.endswith("-large") else ""


def step_time(rows: list[dict], strategy: str, source: str, mbs: int, label: str) -> float | None:
    """Step time of the first finished case with exactly these options; None when there is none."""
    row = _first(rows, "step_time_s", strategy, source, mbs, label)
    return row["step_time_s"] if row else None


def _first(rows: list[dict], key: str, strategy: str, source: str, mbs: int, label: str) -> dict | None:
    """The first finished case with exactly these options that has ``key``."""
    return next((r for r in rows if (r["strategy"], r["source"], r["mbs"], r["label"]) ==
                 (strategy, source, mbs, label) and r["rc"] == 0 and r.get(key)), None)


KINDS = ("synthetic", "mock")


def source_settings(rows: list[dict], suffix: str) -> dict[str, dict[str, dict]]:
    """{"3d MBS 8": {"real": row, "synthetic": row, "mock": row}, ...} in table order, for each
    (strategy, MBS) where real photos and a synthetic or mock source finished with the same options.
    One real run per setting, the first that has a partner, so a setting's ratios never mix real
    runs of different options."""
    out: dict[str, dict[str, dict]] = {}
    for r in rows:
        setting = f"{r['strategy']} MBS {r['mbs']}"
        if r["source"] != f"real{suffix}" or r["rc"] != 0 or not r.get("tokens_per_s") or setting in out:
            continue
        partners = {kind: _first(rows, "tokens_per_s", r["strategy"], f"{kind}{suffix}", r["mbs"], r["label"])
                    for kind in KINDS}
        partners = {kind: row for kind, row in partners.items() if row}
        if partners:
            out[setting] = {"real": r, **partners}
    return {k: out[k] for k in sorted(out, key=_settings_order)}


def source_ratios(rows: list[dict], suffix: str) -> dict[str, dict[str, float]]:
    """Per (strategy, MBS) setting where real and another source ran with the same options: that
    source's real tokens/s over real photos' ({"3d MBS 8": {"synthetic": 0.96, "mock": 2.3}}).

    Tokens/s, not step time: a source whose rows are emptier has shorter steps without being faster
    (with fixed 4-item blocks, mock rows were 10% full, so its steps looked 4.3x faster while its
    tokens/s was half of real's)."""
    return {setting: {kind: round(_ratio(cells, kind), 3) for kind in KINDS if kind in cells}
            for setting, cells in source_settings(rows, suffix).items()}


def _ratio(cells: dict[str, dict], kind: str) -> float:
    return cells[kind]["tokens_per_s"] / cells["real"]["tokens_per_s"]


def ratio_error(real: dict, other: dict) -> float | None:
    """Standard error of other/real tokens/s from both cases' step-to-step spread; None where
    either has no per-step metrics."""
    if real.get("tokens_per_s_sem") is None or other.get("tokens_per_s_sem") is None:
        return None
    ratio = other["tokens_per_s"] / real["tokens_per_s"]
    return ratio * math.hypot(real["tokens_per_s_sem"] / real["tokens_per_s"],
                              other["tokens_per_s_sem"] / other["tokens_per_s"])


def source_table(rows: list[dict], suffix: str) -> str:
    """The ratios as a Markdown table, +/- two standard errors (about 95%) where per-step metrics
    exist, with each source's row fill beside its ratio."""

    def pm(value: float, error: float | None, fmt: str) -> str:
        return fmt.format(value) + ("" if error is None else " ± " + fmt.format(2 * error))

    lines = ["| setting | real tokens/s | real fill | synthetic / real | synthetic fill | mock / real | mock fill |",
             "|---|---|---|---|---|---|---|"]
    for setting, cells in source_settings(rows, suffix).items():
        real = cells["real"]
        line = [setting, pm(real["tokens_per_s"], real.get("tokens_per_s_sem"), "{:,.0f}"),
                f"{real.get('real_token_fraction') or 0:.2f}"]
        for kind in KINDS:
            if kind not in cells:
                line += ["", ""]
                continue
            line += [pm(_ratio(cells, kind), ratio_error(real, cells[kind]), "{:.2f}x"),
                     f"{cells[kind].get('real_token_fraction') or 0:.2f}"]
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def _settings_order(key: str) -> tuple:
    strategy, _, mbs = key.split()
    return strategy != "3d", int(mbs)


def _plot_source_ratios(ax, rows: list[dict], suffix: str) -> None:
    """Ratio bars per setting, with +/- two standard errors where per-step metrics exist."""
    settings = source_settings(rows, suffix)
    if not settings:
        ax.axis("off")
        return

    def bar(cells: dict, kind: str) -> tuple[float, float]:
        if kind not in cells:
            return 0.0, math.nan
        error = ratio_error(cells["real"], cells[kind])
        return _ratio(cells, kind), math.nan if error is None else 2 * error

    bars = {kind: [bar(cells, kind) for cells in settings.values()] for kind in KINDS}
    _grouped_bars(ax, [k.replace(" MBS", "\nMBS") for k in settings],
                  [(f"{kind} / real", colour, [v for v, _ in bars[kind]])
                   for kind, colour in zip(KINDS, ("tab:green", "tab:red"))], "{:.2f}x",
                  errors=[[e for _, e in bars[kind]] for kind in KINDS])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set(ylabel="tokens/s over real photos' (x)", title="how optimistic each source is, same run (±2 SE)")


SOURCE_COLOURS = {"real": "tab:blue", "synthetic": "tab:green", "mock": "tab:red"}
VARIANTS = ("frozen", "padded", "gpu", "blocks", "decode", "chain")
"""Labels of cases that change more than memory options (recompute, chunks, allocator), so they are
not points of the plain sweep."""


def plot_sources(rows: list[dict], source: str, out: str) -> None:
    """Every source against MBS: tokens/s, data-wait share, real-token fraction of the rows, and the
    tokens/s ratios to real photos (``source``); 3d as lines, fsdp as hollow markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    suffix = _suffix(source)
    sweep = [r for r in rows if r["rc"] == 0 and r.get("tokens_per_s") and not any(v in r["label"] for v in VARIANTS)]
    fig, ((ax_tok, ax_wait), (ax_fill, ax_ratio)) = plt.subplots(2, 2, figsize=(13, 9.6))
    panels = ((ax_tok, "tokens_per_s", 1.0, "real tokens / s (1 GPU)", "tokens/s vs MBS per source"),
              (ax_wait, "data_wait_share", 100.0, "data wait, % of step time", "trainer waiting for data"),
              (ax_fill, "real_token_fraction", 1.0, "real tokens / row slots", "how full the packed rows are"))
    for kind, colour in SOURCE_COLOURS.items():
        for strategy, style in (("3d", dict(marker="o", linestyle="-")), ("fsdp", dict(marker="s", linestyle=":",
                                                                                      markerfacecolor="none"))):
            points = {}
            for r in sweep:  # the first run of each MBS, as step_time pairs them
                if (r["strategy"], r["source"]) == (strategy, f"{kind}{suffix}"):
                    points.setdefault(r["mbs"], r)
            if not points:
                continue
            mbs = sorted(points)
            for ax, key, scale, _, _ in panels:
                ax.plot(mbs, [scale * (points[m].get(key) or 0.0) for m in mbs], color=colour,
                        label=f"{kind}, {strategy}", markersize=7, **style)
    for ax, _, _, ylabel, title in panels:
        ax.set(xscale="log", xlabel="micro-batch size", ylabel=ylabel, title=title, xlim=(0.8, 10))
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=7)
    ax_wait.axhline(1.0, color="red", linestyle="--", linewidth=1)
    ax_wait.set_ylim(-0.05, 1.5)
    ax_fill.set_ylim(0, 1.05)
    _plot_source_ratios(ax_ratio, rows, suffix)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def per_gpu_tokens(rows: list[dict], strategy: str, gpus: int) -> float:
    """Real tokens/s per GPU of the ``{gpus}gpu`` cases of a strategy (their mean when several runs
    repeat one, as each multi-GPU run repeats its 1-GPU baseline); 0.0 when there is none."""
    match = [r["tokens_per_s"] / gpus for r in rows
             if r["strategy"] == strategy and re.search(rf"(^|-){gpus}gpu$", r["label"])]
    return sum(match) / len(match) if match else 0.0


def _plot_scaling(ax, rows: list[dict]) -> None:
    """Real tokens/s per GPU on one GPU against two or four, per strategy; a 1-GPU baseline repeated
    in several runs is their mean."""
    if not rows:
        ax.axis("off")
        return
    strategies = [s for s in ("3d", "fsdp") if any(r["strategy"] == s for r in rows)]
    counts = sorted({int(re.search(r"(\d+)gpu$", r["label"])[1]) for r in rows})

    colours = {1: "tab:gray", 2: "tab:purple", 4: "tab:red", 8: "tab:brown"}
    _grouped_bars(ax, [f"{s} (EP = GPUs)" if s == "3d" else s for s in strategies],
                  [(f"{g} GPU{'s' if g > 1 else ''}", colours.get(g, "tab:olive"), [per_gpu_tokens(rows, s, g) for s in strategies])
                   for g in counts], "{:,.0f}")
    ax.set(ylabel="real tokens / s per GPU (MBS 2)", title=f"per GPU on {', '.join(map(str, counts))} GPUs")


def _grouped_bars(ax, groups: list[str], series: list[tuple[str, str, list[float]]], fmt: str,
                  errors: list[list[float]] | None = None) -> None:
    """One bar per series in each group, (name, colour, one value per group) each, labelled with
    ``fmt``; 0 = missing. ``errors``: error-bar half-heights, one list per series (NaN: none)."""
    width = 0.8 / len(series)
    for k, (name, colour, values) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        yerr = errors[k] if errors else None
        ax.bar(xs, values, width, color=colour, label=name, yerr=yerr, capsize=3 if yerr else 0)
        for i, (x, v) in enumerate(zip(xs, values)):
            if v:
                top = v + (yerr[i] if yerr and not math.isnan(yerr[i]) else 0.0)
                ax.annotate(fmt.format(v), (x, top), ha="center", fontsize=7,
                            xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(groups)), groups)
    ax.legend()


def _plot_decode(ax, decode: dict | None) -> None:
    """img/s per decode path (``trainer.bench --gpu-decode-only`` output), against the 5,000 goal."""
    paths = [(k, v["img_s"]) for k, v in (decode or {}).items()
             if isinstance(v, dict) and v.get("img_s") and "pixel_values_kernel" not in k]  # not decode paths
    if not paths:
        ax.axis("off")
        return
    names = [k.replace("_", " ").replace("to gpu pixel values", "-> GPU pixel_values")
             .replace("to host patches", "-> host patches") for k, _ in paths]
    colours = ["tab:green" if k.startswith("dali_gpu") else "tab:gray" if k.startswith("torchvision") else "tab:blue"
               for k, _ in paths]
    ax.barh(range(len(paths)), [v for _, v in paths], color=colours)
    for i, (_, v) in enumerate(paths):
        ax.annotate(f"{v:,.0f}", (v, i), va="center", fontsize=7, xytext=(3, 0), textcoords="offset points")
    ax.axvline(5000, color="red", linestyle="--", linewidth=1, label="goal, batches of 8: 5,000 img/s")
    ax.axvline(8000, color="darkred", linestyle=":", linewidth=1, label="goal, batches of 64: 8,000 img/s")
    ax.set_yticks(range(len(paths)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="images / s (1-2 MP JPEGs, one H200)", title="decode paths, same run")
    ax.legend(fontsize=7)


def plot_decode(decode: dict, out: str) -> None:
    """The decode paths of one ``--gpu-decode-only`` run alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.28 * len(decode) + 1.2))
    _plot_decode(ax, decode)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.bench.plots", formatter_class=HelpFormatter)
    ap.add_argument("bench_json", nargs="*", help="training bench JSONs (none with --decode: the decode paths alone)")
    ap.add_argument("--source", default="real-large", help="real source of the MBS sweep")
    ap.add_argument("--decode", default=None, help="gpu_decode.json from trainer.bench --gpu-decode-only")
    ap.add_argument("--by-source", action="store_true",
                    help="plot every source against MBS (tokens/s, data wait, row fill, ratios to real)")
    ap.add_argument("--table", action="store_true",
                    help="print the source ratios as a Markdown table (+/- two standard errors) instead of plotting")
    ap.add_argument("--out", default=None, help="PNG to write (required unless --table)")
    args = ap.parse_args(argv)
    if args.table:
        print(source_table(load(args.bench_json), _suffix(args.source)))
        return 0
    if args.out is None:
        ap.error("--out PNG is required unless --table is given")
    if not args.bench_json:
        if not args.decode:
            ap.error("give training bench JSONs, or --decode gpu_decode.json to plot the decode paths alone")
        plot_decode(json.load(open(args.decode)), args.out)
    elif args.by_source:
        plot_sources(load(args.bench_json), args.source, args.out)
    else:
        decode = json.load(open(args.decode)) if args.decode else None
        plot(load(args.bench_json), args.source, args.out, decode)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
