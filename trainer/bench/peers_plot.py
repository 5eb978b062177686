"""The peers side by side in one figure: ``python -m trainer.bench.peers_plot TRAIN_JSON ... [--data
DATA_JSON] --out PNG``.

TRAIN_JSON are what ``vlmfeed bench peers train`` writes (``{"mbsN": {path: case}}``, one or more
MBS per file); DATA_JSON what ``peers data`` writes. Panels: training tokens/s per path and MBS (with
two standard errors of the block means), data CPU-seconds per trained sample, and, with DATA_JSON, the
data paths alone (samples/s and CPU-seconds per sample on the same host cores).
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from datasvc.usage import HelpFormatter
from trainer.bench.peers_data import PATHS

COLOURS = {"megatron-bridge": "tab:gray", "energon-packed": "tab:orange", "automodel-packed": "tab:red",
           "ray-data": "tab:purple",
           "vlmfeed-cpu": "tab:blue", "vlmfeed-gpu": "tab:green"}


def load_train(paths: list[str]) -> dict[int, dict]:
    """MBS -> {path: case} over every file, cases that did not run left out."""
    out: dict[int, dict] = {}
    for p in paths:
        for key, cases in json.load(open(p)).items():
            if key.startswith("mbs") and isinstance(cases, dict):
                ran = {k: c for k, c in cases.items() if isinstance(c, dict) and c.get("tokens_per_s")}
                out.setdefault(int(key[3:]), {}).update(ran)
    return out


def plot(train: dict[int, dict], data: dict | None, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if data else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    mbs = sorted(train)
    x = np.arange(len(mbs))
    width = 0.8 / len(PATHS)
    for i, path in enumerate(PATHS):
        cases = [train[m].get(path) for m in mbs]
        tok = [c["tokens_per_s"] if c else 0.0 for c in cases]
        err = [2 * c["tokens_per_s_blocks"][1] if c and c.get("tokens_per_s_blocks") else 0.0 for c in cases]
        cpu = [c.get("cpu_s_per_trained_sample") or 0.0 if c else 0.0 for c in cases]
        pos = x + (i - (len(PATHS) - 1) / 2) * width
        axes[0].bar(pos, tok, width, yerr=err, color=COLOURS[path], label=path)
        for px, c in zip(pos, cases):  # padded peers may run another MBS than the packed paths
            if c and c.get("mbs"):
                axes[0].annotate(f"MBS {c['mbs']:.0f}", (px, 0), ha="center", va="bottom", fontsize=6, rotation=90)
        axes[1].bar(pos, cpu, width, color=COLOURS[path], label=path)
    for ax, ylabel, title in ((axes[0], "tokens / s (steady steps)", "training, same model, each path at its MBS"),
                              (axes[1], "data CPU-s per trained sample", "host CPU the data path spends")):
        ax.set_xticks(x, [f"grid MBS {m}" for m in mbs])
        ax.set(ylabel=ylabel, title=title)
        ax.legend(fontsize=7)
    if data:
        alone = data["data_alone"]["paths"]
        names = [p for p in PATHS if p in alone and alone[p].get("samples_per_s")]
        ax = axes[2]
        ax.bar(range(len(names)), [alone[p]["samples_per_s"] for p in names],
               color=[COLOURS[p] for p in names])
        for i, p in enumerate(names):
            ax.annotate(f"{alone[p]['cpu_s_per_sample']:.3f} CPU-s/sample", (i, alone[p]["samples_per_s"]),
                        ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)), names, fontsize=7, rotation=20)
        ax.set(ylabel="samples / s", title=f"data paths alone, {data['data_alone']['cores']} host cores")
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.bench.peers_plot", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("train_json", nargs="+")
    ap.add_argument("--data", default=None, help="what `peers data` wrote")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    train = load_train(args.train_json)
    if not train:
        ap.error("no training case with tokens/s in " + " ".join(args.train_json))
    plot(train, json.load(open(args.data)) if args.data else None, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
