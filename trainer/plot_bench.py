"""Plot ``trainer.bench`` results: tokens/s and data-wait share against MBS per strategy, and step
time per data source. ``python -m trainer.plot_bench BENCH.json ... --out PNG``.

Case names follow ``trainer.bench``: ``{strategy}-{source}-mbs{N}[-label]``; failed cases (OOM) are
marked on the MBS axis instead of being dropped.
"""
from __future__ import annotations

import argparse
import json
import re

CASE = re.compile(r"^(?P<strategy>fsdp|3d)-(?P<source>real-large|real|synthetic-large|synthetic|mock-large|mock)"
                  r"-mbs(?P<mbs>\d+)(?:-(?P<label>.+))?$")


def load(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        for r in json.load(open(path)):
            m = CASE.match(r["case"])
            if m:
                rows.append({**r, **m.groupdict(), "mbs": int(m["mbs"]), "label": m["label"] or ""})
    return rows


def plot(rows: list[dict], source: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tok, ax_wait, ax_src) = plt.subplots(1, 3, figsize=(16, 4.8))
    # The MBS sweep: trainable vision, recompute only where MBS needs it.
    sweep = [r for r in rows if r["source"] == source and r["label"] in ("", "recompute")]
    for strategy, colour in (("fsdp", "tab:blue"), ("3d", "tab:orange")):
        ok = sorted((r for r in sweep if r["strategy"] == strategy and r["rc"] == 0), key=lambda r: r["mbs"])
        failed = [r for r in sweep if r["strategy"] == strategy and r["rc"] != 0]
        ax_tok.plot([r["mbs"] for r in ok], [r["tokens_per_s"] for r in ok], "o-", color=colour, label=strategy)
        for r in ok:
            if r["label"]:
                ax_tok.annotate("recompute", (r["mbs"], r["tokens_per_s"]), fontsize=7, xytext=(4, -10),
                                textcoords="offset points")
        for r in failed:
            ax_tok.plot(r["mbs"], 0, "x", color=colour, markersize=10)
        marker = "o-" if strategy == "fsdp" else "s--"
        ax_wait.plot([r["mbs"] for r in ok], [100 * r["data_wait_share"] for r in ok], marker, color=colour,
                     label=strategy)
    for mbs in sorted({r["mbs"] for r in sweep if r["rc"] != 0}):
        ax_tok.annotate("failed (OOM)", (mbs, 0), fontsize=7, xytext=(-30, 10), textcoords="offset points")
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

    suffix = "-large" if source.endswith("-large") else ""
    sources = [f"real{suffix}", f"synthetic{suffix}", f"mock{suffix}"]
    width = 0.38
    for k, (strategy, colour) in enumerate((("fsdp", "tab:blue"), ("3d", "tab:orange"))):
        times = []
        for s in sources:
            match = [r for r in rows if r["strategy"] == strategy and r["source"] == s and r["mbs"] == 2
                     and r["label"] == "" and r["rc"] == 0]
            times.append(match[0]["step_time_s"] if match else 0.0)
        xs = [i + (k - 0.5) * width for i in range(len(sources))]
        ax_src.bar(xs, times, width, color=colour, label=strategy)
        for x, t in zip(xs, times):
            if t:
                ax_src.annotate(f"{t:.2f}s", (x, t), ha="center", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax_src.set_xticks(range(len(sources)), [s.replace(suffix, "") for s in sources])
    ax_src.set(ylabel="step time, s (MBS 2)", title="data source: real vs calibrated synthetic vs mock")
    ax_src.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.plot_bench")
    ap.add_argument("bench_json", nargs="+")
    ap.add_argument("--source", default="real-large", help="real source of the MBS sweep")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    plot(load(args.bench_json), args.source, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
