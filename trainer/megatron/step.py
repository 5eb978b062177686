"""Forward steps Megatron-Bridge calls per micro-batch: ours on packed rows (THD, MRoPE restarted per
sample, per-token loss), and the adapter that feeds padded rows to the stock ``qwen3_vl_step``."""
from __future__ import annotations

import torch
from megatron.bridge.training.losses import masked_next_token_loss
from megatron.bridge.training.state import GlobalState
from megatron.bridge.training.utils.flop_utils import accumulate_flops_metadata, get_model_chunk_vp_stage
from megatron.bridge.training.utils.pg_utils import get_pg_collection
from megatron.bridge.training.utils.visual_inputs import GenericVisualInputs
from megatron.core.utils import get_model_config

from datasvc.batch import IGNORE_INDEX, TrainBatch
from trainer.megatron.thd import PAD_ID, mrope_position_ids, pack_thd


def _masked_loss(loss_mask: torch.Tensor, output_tensor, check_for_nan_in_loss: bool, check_for_spiky_loss: bool):
    """Bridge's masked next-token loss, with unsupervised positions zeroed first: 0 * NaN would
    otherwise leak a non-finite value from a position nobody trains on into the sum."""
    if isinstance(output_tensor, tuple):  # CP slices the loss mask inside the model
        losses, mask = output_tensor
        output_tensor = (torch.where(mask.bool(), losses, torch.zeros_like(losses)), mask)
    else:
        output_tensor = torch.where(loss_mask.reshape(output_tensor.shape).bool(), output_tensor,
                                    torch.zeros_like(output_tensor))
    return masked_next_token_loss(loss_mask, output_tensor, check_for_nan_in_loss=check_for_nan_in_loss,
                                  check_for_spiky_loss=check_for_spiky_loss)


class PackedForwardStep:
    """Forward step for packed rows: THD PackedSeqParams from the sample boundaries, MRoPE restarted
    per sample, per-token loss. Signature follows Megatron-Bridge (state injected by name)."""

    def __call__(self, state: GlobalState, data_iterator, model, return_schedule_plan: bool = False):
        if return_schedule_plan:
            raise NotImplementedError("overlap_moe_expert_parallel_comm schedule plans are not supported "
                                      "with packed rows")
        timers = state.timers
        timers("batch-generator", log_level=2).start()
        batch = next(data_iterator)
        timers("batch-generator").stop()

        pg = get_pg_collection(model)
        config = get_model_config(model)
        cp, tp = pg.cp.size(), pg.tp.size()
        packed = pack_thd(
            batch.tokens, batch.labels, batch.loss_mask, batch.cu_seqlens, batch.num_samples,
            segment_multiple=2 * cp if cp > 1 else 1,
            total_multiple=tp * cp if config.sequence_parallel or cp > 1 else 1,
        )
        grid, videos = batch.image_grid_thw, batch.video_grid_thw
        has_images, has_videos = batch.has_images, batch.has_videos
        position_ids = mrope_position_ids(packed, config, grid if has_images else None, videos if has_videos else None)

        # Megatron-Bridge FLOP accounting: Σ s_i² over real segments for attention, vision patches for the ViT.
        patches = (grid.prod(dim=-1).sum() if has_images else 0) + (videos.prod(dim=-1).sum() if has_videos else 0)
        accumulate_flops_metadata(
            state, packed.tokens, vp_stage=get_model_chunk_vp_stage(model),
            cu_seqlens=packed.cu_seqlens_padded, cu_seqlens_unpadded=packed.cu_seqlens,
            num_vision_patches=patches if has_images or has_videos else None,
        )

        output = model(
            input_ids=packed.tokens,
            position_ids=position_ids,
            attention_mask=None,
            labels=packed.labels,
            loss_mask=packed.loss_mask,
            packed_seq_params=packed.params,
            pixel_values=batch.pixel_values if has_images else None,
            image_grid_thw=grid if has_images else None,
            pixel_values_videos=batch.pixel_values_videos if has_videos else None,
            video_grid_thw=videos if has_videos else None,
        )
        rsm = state.cfg.rerun_state_machine
        loss_fn = _LossFn(packed.loss_mask, rsm.check_for_nan_in_loss, rsm.check_for_spiky_loss)
        return output, loss_fn


class _LossFn:
    """Picklable partial of ``_masked_loss`` (Megatron calls it with the model output)."""

    def __init__(self, loss_mask, check_nan, check_spiky):
        self.loss_mask, self.check_nan, self.check_spiky = loss_mask, check_nan, check_spiky

    def __call__(self, output_tensor):
        return _masked_loss(self.loss_mask, output_tensor, self.check_nan, self.check_spiky)


def to_stock_batch(batch: TrainBatch) -> dict:
    """Our batch in the form Megatron-Bridge's stock ``qwen3_vl_step`` expects (padded rows, one
    sample per row, ``visual_inputs``); it refuses collate-time packing, so packed rows are an error."""
    if int(batch.num_samples.max()) > 1:
        raise ValueError("--padded runs the stock qwen3_vl_step, which needs one sample per row; configure "
                         "the data service without packing for this mode")
    labels = batch.labels
    supervised = labels != IGNORE_INDEX
    grid, videos = batch.image_grid_thw, batch.video_grid_thw
    has_images, has_videos = batch.has_images, batch.has_videos
    return {
        "tokens": batch.tokens,
        "labels": torch.where(supervised, labels, torch.full_like(labels, PAD_ID)),
        "loss_mask": batch.loss_mask.float() * supervised,
        "position_ids": None,  # the model computes MRoPE from input_ids and grids
        "attention_mask": None,
        "visual_inputs": GenericVisualInputs(
            pixel_values=batch.pixel_values if has_images else None, image_grid_thw=grid if has_images else None,
            pixel_values_videos=batch.pixel_values_videos if has_videos else None,
            video_grid_thw=videos if has_videos else None)
        if has_images or has_videos else None,
    }
