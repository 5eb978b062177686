"""Megatron-Bridge backend: Qwen3-VL trained on packed rows from the data service.

Reading order (the modules import Megatron-Bridge, except ``overrides``, which imports it when
applied; this package itself imports nothing, so ``python -m trainer.run`` can parse and validate a
job before Megatron is loaded):
  1. ``provider``: the plug-in that feeds any Bridge ``ConfigContainer`` from vlmfeed (the dataset
     provider with ``dataloader_type="external"``, the data geometry read from the container, the
     rank-to-DP mapping, the packed forward step, the service's owner, loader state in Bridge's
     checkpoints); ``trainer.run`` and a user's own recipe (docs/examples/bridge_recipe.py) share it.
  2. ``container``: a validated ``TrainerConfig`` becomes Megatron-Bridge's ``ConfigContainer`` (the
     real Qwen3-VL MoE provider, made by AutoBridge from a Hugging Face config, or from a checkpoint
     with ``--hf-path``), fed through ``provider``.
  3. ``overrides``: Bridge-style ``key=value`` items and ``--config-file`` YAML, applied last.
  4. ``thd``: pure tensor logic (CPU-testable) that turns B packed rows into one THD stream with
     per-sample boundaries and per-sample MRoPE positions.
  5. ``step``: the forward step Megatron-Bridge calls per micro-batch (packed), and the adapter to
     the stock ``qwen3_vl_step`` (padded).
  6. ``metrics``: ``TimedIterator`` (how long the trainer blocks on data) and the per-step records.
  7. ``loop``: ``train``, the entry a ``trainer.run`` rank calls.

Batch contract (``datasvc.batch.TrainBatch``, one per ``DataClient.__next__``): tokens/labels [B,S]
int64 (labels already shifted, -100 ignored), loss_mask [B,S] float32, cu_seqlens [B,K+1] int32
(sample j of row r spans cu_seqlens[r,j]:cu_seqlens[r,j+1]; unused tail entries repeat the row's
end), num_samples [B], pixel_values [N, patch dim], image_grid_thw [n_images,3] (images in row-major
token order), pixel_values_videos and video_grid_thw (None without videos), sample_keys, sample_epochs.

Why THD: several samples share one row, so attention must not cross sample boundaries and MRoPE must
restart at every sample. The model (``Qwen3VLModel``) accepts a flat ``[1, T]`` stream with THD
``PackedSeqParams``; Transformer Engine then attends within each segment only.
"""
