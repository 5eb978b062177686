"""Run the vision tower over a micro-batch's images a few at a time.

Why: at MBS 8 with full 4,096-token rows, one micro-batch carries ~30 images and the vision tower's
attention backward asked for a single 54.75 GiB buffer (H200; docs/benchmarks/mbs-sweep-and-large-micro-batches.md), which grows
with the number of images in one call times the longest image squared, not with the patches alone.
Whole images never span chunks, and every image attends only to itself, so the outputs are the
same as one call over all images; activations kept for backward are unchanged, only the transient
attention buffers shrink to one chunk's.

The chunking wraps the vision module's ``forward``, below its ``__call__``, so hooks that wrappers
put on the module (Megatron-FSDP's parameter gathering) still run once per micro-batch.
"""
from __future__ import annotations

from typing import Callable

import torch


def image_groups(patches_per_image: list[int], max_patches: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) image ranges of at most ``max_patches`` patches each; an image larger
    than ``max_patches`` gets a range of its own."""
    groups, start, size = [], 0, 0
    for i, n in enumerate(patches_per_image):
        if size and size + n > max_patches:
            groups.append((start, i))
            start, size = i, 0
        size += n
    if start < len(patches_per_image):
        groups.append((start, len(patches_per_image)))
    return groups


def chunked(forward: Callable, max_patches: int) -> Callable:
    """``forward(pixel_rows, grid_thw, **kw) -> (embeddings, deepstack_features)`` run per image group,
    outputs concatenated in image order."""

    def run(hidden_states: torch.Tensor, grid_thw: torch.Tensor, *args, **kwargs):
        patches = grid_thw.prod(dim=-1).tolist()
        groups = image_groups(patches, max_patches)
        if len(groups) <= 1:
            return forward(hidden_states, grid_thw, *args, **kwargs)
        embeddings, deepstack, offset = [], [], 0
        for start, end in groups:
            n = sum(patches[start:end])
            emb, features = forward(hidden_states[offset:offset + n], grid_thw[start:end], *args, **kwargs)
            embeddings.append(emb)
            deepstack.append(features)
            offset += n
        return torch.cat(embeddings), [torch.cat(parts) for parts in zip(*deepstack)]

    return run


def chunk_vision_hook(max_patches: int) -> Callable[[list], list]:
    """A Megatron-Bridge pre-wrap hook that chunks every model chunk's ``vision_model``."""

    def hook(models: list) -> list:
        for model in models:
            vision = getattr(model, "vision_model", None)
            if vision is not None:  # absent on pipeline stages after the first
                vision.forward = chunked(vision.forward, max_patches)
        return models

    return hook
