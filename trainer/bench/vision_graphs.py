"""Can the vision tower run at one fixed shape, as CUDA graphs need, and what does that shape cost?

    python -m trainer.bench.vision_graphs [--lengths 4096 8192 16384] [--out DIR]

Megatron-Bridge 0.6.2 captures the Qwen3-VL vision tower's layers as CUDA graphs when the provider's
``vision_cuda_graph_impl`` is ``"transformer_engine"``: every call's patches are padded to one length,
``max_vision_cuda_graph_seq_length``, and attention takes a mask over that length in place of THD
per-image boundaries (a graph cannot take THD metadata). That padded path runs eagerly too, during
the warm-up steps before capture, so two questions can be answered without capturing anything:

- **Does it compute the model?** The tower attends within each image (each temporal group of a
  video). The fixed-length path's outputs for a few images, as Bridge ships it and with the trainer's
  per-frame mask (``trainer.megatron.vision_graphs``), are compared with each image run alone, and
  so are the THD path's (the control: it must agree).
- **What does the fixed shape cost?** Forward plus backward time of the tower over images filling
  ``L`` patches, on the THD path and on the fixed-length path at ``L``; and the activation memory the
  fixed-length path asks for. Graphs can only win back kernel-launch time, which the eager THD time
  bounds from above.

Runs on one GPU; prints a table and writes JSON (under ``--out`` or $OUT).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch

from datasvc.usage import HelpFormatter

# Image grids (t, h, w) in patches: photos of about 1,000 patches, the size a 0.25 MP photo gets.
PHOTO_GRIDS = [(1, 32, 32), (1, 28, 36), (1, 24, 40), (1, 36, 28)]


def vision_tower(num_layers: int = 4, num_experts: int = 16):
    """The full Qwen3-VL vision tower of the small proxy, in bf16, in training mode."""
    from megatron.core.utils import get_attr_wrapped_model

    from trainer.bench.gpu_proof import build_model

    model, _ = build_model(num_layers, num_experts, seq_len=1024)
    tower = get_attr_wrapped_model(model, "vision_model")
    tower.train()
    return tower


def patch_dim(tower) -> int:
    pe = tower.patch_embed
    return pe.in_channels * pe.temporal_patch_size * pe.patch_size ** 2


def images_filling(patches: int) -> list[tuple[int, int, int]]:
    """Photo grids, cycled, whose patches add up to at most ``patches``."""
    grids, total, i = [], 0, 0
    while True:
        g = PHOTO_GRIDS[i % len(PHOTO_GRIDS)]
        if total + g[0] * g[1] * g[2] > patches:
            return grids
        grids.append(g)
        total, i = total + g[0] * g[1] * g[2], i + 1


def set_fixed_length(tower, length: int | None) -> None:
    """Turn the tower's fixed-length path on (at ``length`` patches) or off. The tower asks per call
    (``Qwen3VLVisionModel._uses_vision_cuda_graph``); its layers, built without graphs, run eagerly."""
    tower._uses_vision_cuda_graph = lambda: bool(length)
    tower.config.max_vision_cuda_graph_seq_length = length


def run_tower(tower, pixels: torch.Tensor, grids: list[tuple[int, int, int]]):
    grid = torch.tensor(grids, dtype=torch.long, device=pixels.device)
    embeddings, deepstack = tower(pixels, grid)
    return torch.cat([embeddings, *deepstack], dim=-1)


@contextlib.contextmanager
def within_frames(tower):
    """The tower's fixed-length path as the trainer runs it (``trainer.megatron.vision_graphs``)
    inside the block, as Megatron-Bridge ships it outside."""
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import vision_model as bridge_vision

    from trainer.megatron.vision_graphs import attend_within_frames

    setup = bridge_vision._vision_forward_packed_attention_setup
    layers = list(tower.decoder.layers)
    kinds = [layer.self_attention.attn_mask_type for layer in layers]
    attend_within_frames(tower)
    try:
        yield
    finally:
        bridge_vision._vision_forward_packed_attention_setup = setup
        for layer, kind in zip(layers, kinds):
            layer.self_attention.attn_mask_type = kind
            del layer.get_layer_static_inputs  # the capture inputs attend_within_frames set on the instance


@torch.no_grad()
def semantics(tower, fixed_length: int) -> dict:
    """Largest difference of each path's outputs from every image run alone (THD, one image)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    grids = PHOTO_GRIDS[:3]
    sizes = [t * h * w for t, h, w in grids]
    pixels = torch.randn(sum(sizes), patch_dim(tower), generator=gen, device="cuda", dtype=torch.bfloat16)
    set_fixed_length(tower, None)
    alone = torch.cat([run_tower(tower, part, [g]) for part, g in zip(pixels.split(sizes), grids)])
    together = run_tower(tower, pixels, grids)
    set_fixed_length(tower, fixed_length)
    bridge = run_tower(tower, pixels, grids)
    with within_frames(tower):
        ours = run_tower(tower, pixels, grids)
    set_fixed_length(tower, None)
    scale = alone.float().abs().mean().item()

    def gap(out):
        return (out.float() - alone.float()).abs().max().item()

    return {"images": grids, "fixed_length": fixed_length, "mean_abs_output": scale, "thd_max_abs_diff": gap(together),
            "bridge_fixed_length_max_abs_diff": gap(bridge), "per_frame_fixed_length_max_abs_diff": gap(ours)}


def timed(tower, pixels: torch.Tensor, grids, repeats: int) -> dict:
    """Median forward+backward seconds and the peak memory above the start."""
    times = []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(repeats + 1):
        start = time.perf_counter()
        run_tower(tower, pixels, grids).float().square().mean().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    tower.zero_grad(set_to_none=True)
    times = sorted(times[1:])  # the first call pays one-off allocation and kernel selection
    return {"seconds": times[len(times) // 2], "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}


def cost(tower, length: int, repeats: int) -> dict:
    grids = images_filling(length)
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(patches, patch_dim(tower), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    row = {"length": length, "images": len(grids), "patches": patches}
    set_fixed_length(tower, None)
    row["thd"] = timed(tower, pixels, grids, repeats)
    for name, context in (("bridge_fixed_length", contextlib.nullcontext()), ("per_frame_fixed_length", within_frames(tower))):
        set_fixed_length(tower, length)
        try:
            with context:
                row[name] = timed(tower, pixels, grids, repeats)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            row[name] = {"error": str(exc).splitlines()[0][:300]}
            torch.cuda.empty_cache()
        finally:
            set_fixed_length(tower, None)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384],
                    help="fixed lengths (patches) to time")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per path and length")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for vision-graphs.json")
    args = ap.parse_args(argv)
    tower = vision_tower()
    result = {"semantics": semantics(tower, fixed_length=min(args.lengths)),
              "cost": [cost(tower, n, args.repeats) for n in args.lengths],
              "gpu": torch.cuda.get_device_name()}
    s = result["semantics"]
    print(f"outputs vs each image alone (mean |output| {s['mean_abs_output']:.3f}), max |diff|: THD path "
          f"{s['thd_max_abs_diff']:.4f}, Bridge's fixed-length path {s['bridge_fixed_length_max_abs_diff']:.4f}, "
          f"per-frame fixed-length path {s['per_frame_fixed_length_max_abs_diff']:.4f}")
    names = ("thd", "bridge_fixed_length", "per_frame_fixed_length")
    print("| patches | images | " + " | ".join(f"{n} fwd+bwd s, peak GiB" for n in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r in result["cost"]:
        cells = [f"{r[n]['seconds']:.4f}, {r[n]['peak_gib']:.2f}" if "seconds" in r[n] else r[n]["error"][:60]
                 for n in names]
        print(f"| {r['length']} | {r['images']} | " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "vision-graphs.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
