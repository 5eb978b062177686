"""What a run leaves behind for a person: ``loss.png`` (loss, validation loss, tokens/s and data wait
per step) and the list of files it wrote."""
from __future__ import annotations

import json
import os


def draw_run(metrics_path: str, png_path: str) -> str | None:
    """Plot the run's per-step records; returns the PNG's path, or None when there is nothing to draw."""
    if not os.path.exists(metrics_path):
        return None
    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    axes[0].plot(steps, [r["loss"] for r in records], label="train")
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if val:
        axes[0].plot(*zip(*val), "o-", label="validation")
    axes[0].set_ylabel("loss")
    axes[0].legend()
    axes[1].plot(steps, [r.get("tokens_per_s") or 0 for r in records])
    axes[1].set_ylabel("real tokens/s")
    axes[2].plot(steps, [100 * (r.get("data_wait_share") or 0) for r in records])
    axes[2].set_ylabel("data wait (% of step)")
    axes[2].set_xlabel("step")
    for step in (r["step"] for r in records if r.get("checkpoint_s") is not None):
        for ax in axes:
            ax.axvline(step, color="grey", lw=0.5, ls=":")
    fig.suptitle(f"{records[0].get('backend', '')} run: {len(records)} steps (dotted: checkpoints)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def written(out: str, save: str | None, export_hf: str | None) -> list[str]:
    """The run's outputs, for its last lines."""
    files = [os.path.join(out, n) for n in ("metrics.jsonl", "samples.jsonl", "summary.json", "loss.png")
             if os.path.exists(os.path.join(out, n))]
    if save:
        from trainer.checkpoint import iter_name, latest_step

        step = latest_step(save)
        if step is not None:
            files.append(f"{save.rstrip('/')}/{iter_name(step)} (checkpoint, step {step})")
    if export_hf and os.path.exists(export_hf):
        files.append(f"{export_hf} (Hugging Face checkpoint)")
    return files
