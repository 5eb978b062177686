"""The vision tower at one fixed length, attending within each image.

Megatron-Bridge 0.6.2 runs the Qwen3-VL vision tower at a fixed number of patches when its layers
are CUDA graphs (``vision_cuda_graph_impl="transformer_engine"``): a graph cannot take THD
boundaries, so the patches are padded to ``max_vision_cuda_graph_seq_length`` and attention takes a
mask. Bridge's mask hides only the padding, so every image of the call attends to every other one,
which is not the model (the tower attends within each image, and within each temporal group of a
video, as Hugging Face's does); and its layers are built without a mask type, so even that mask is
ignored and the padding is attended to as well. ``attend_within_frames`` gives the layers an
arbitrary mask and the mask that keeps the model: block-diagonal over the frames, padding apart.
Megatron-Core's capture of those layers also leaves out their rotary positions; they are captured
as an input here (``capture_with_positions``).
"""
from __future__ import annotations

import torch


def per_frame_attention_mask(grid_thw: torch.Tensor, length: int,
                             device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean mask ``[1, 1, length, length]``, True where attention is masked (Transformer Engine's
    convention): each temporal group of ``h * w`` patches attends within itself; a padding patch
    (past the grids' total) attends only to itself, so no row is fully masked."""
    grid = grid_thw.to(device="cpu", dtype=torch.long).reshape(-1, 3)
    frames = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
    real = int(frames.sum())
    if real > length:
        raise ValueError(f"{real} vision patches do not fit the fixed length {length}")
    unit = torch.empty(length, dtype=torch.long)
    unit[:real] = torch.repeat_interleave(torch.arange(len(frames)), frames)
    unit[real:] = torch.arange(len(frames), len(frames) + length - real)  # each padding patch its own unit
    unit = unit.to(device)
    return (unit[:, None] != unit[None, :]).reshape(1, 1, length, length)


def _setup_within_frames(use_cuda_graph_padding, hidden_states, original_seq_len, seq_len, grid_thw,
                         build_packed_seq_params):
    """``_vision_forward_packed_attention_setup`` of Bridge's vision model, with the per-frame mask."""
    if not use_cuda_graph_padding:
        return build_packed_seq_params(grid_thw), None
    return None, per_frame_attention_mask(grid_thw, seq_len, hidden_states.device)


def attend_within_frames(vision_model) -> None:
    """Make ``vision_model``'s fixed-length path attend within each frame: its layers' attention
    takes an arbitrary mask (Bridge builds them with none, so its padding mask is ignored and every
    patch attends to every patch, padding included), and the mask is the per-frame one."""
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import vision_model as bridge_vision
    from megatron.core.transformer.enums import AttnMaskType

    bridge_vision._vision_forward_packed_attention_setup = _setup_within_frames
    for layer in vision_model.decoder.layers:
        layer.self_attention.attn_mask_type = AttnMaskType.arbitrary
        capture_with_positions(layer)


def capture_with_positions(layer) -> None:
    """Capture ``layer``'s graph with a rotary-position input. Megatron-Core captures vision layers
    on hidden states and a mask alone, and a replay passes on only the inputs captured, so the
    positions the tower computes per call would be dropped and the graphed tower would attend
    without them."""
    base = layer.get_layer_static_inputs
    head_dim = layer.config.hidden_size // layer.config.num_attention_heads  # as Qwen3VLVisionModel sizes it

    def static_inputs(seq_length: int, micro_batch_size: int) -> dict:
        inputs = base(seq_length, micro_batch_size)
        # [patches, 1, 1, head_dim] in float32, as Qwen3VLVisionModel.forward makes them
        inputs["rotary_pos_emb"] = torch.zeros(seq_length, 1, 1, head_dim, dtype=torch.float32,
                                               device=inputs["hidden_states"].device)
        return inputs

    layer.get_layer_static_inputs = static_inputs


def within_frames_hook(models: list) -> list:
    """A Megatron-Bridge pre-wrap hook applying ``attend_within_frames`` to every model chunk's tower."""
    for model in models:
        vision = getattr(model, "vision_model", None)
        if vision is not None:  # absent on pipeline stages after the first
            attend_within_frames(vision)
    return models
