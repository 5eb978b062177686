"""Megatron-Bridge backend: Qwen3-VL MoE trained on packed rows from the data service.

Reading order (each module imports Megatron-Bridge; this package itself imports nothing, so
``python -m trainer.run`` can parse and validate a job before Megatron is loaded):
  1. ``container``: a validated ``TrainerConfig`` becomes Megatron-Bridge's ``ConfigContainer`` (the
     real Qwen3-VL MoE provider, made by AutoBridge from a Hugging Face config, or from a checkpoint
     with ``--hf-path``); ``ExternalDataProvider`` plugs our per-rank iterator in with
     ``dataloader_type="external"``.
  2. ``thd``: pure tensor logic (CPU-testable) that turns B packed rows into one THD stream with
     per-sample boundaries and per-sample MRoPE positions.
  3. ``step``: the forward step Megatron-Bridge calls per micro-batch (packed), and the adapter to
     the stock ``qwen3_vl_step`` (padded).
  4. ``metrics``: ``TimedIterator`` (how long the trainer blocks on data) and the per-step records.
  5. ``loop``: ``train``, the entry a rank calls, and the glue to Bridge's pretrain loop.

Batch contract (``datasvc.client.DataClient``, one dict per ``__next__``): tokens/labels [B,S] int64
(labels already shifted, -100 ignored), loss_mask [B,S] float32, cu_seqlens [B,K+1] int32 (sample j
of row r spans cu_seqlens[r,j]:cu_seqlens[r,j+1]; unused tail entries repeat the row's end),
num_samples [B], pixel_values [N, patch dim], image_grid_thw [n_images,3] (images in row-major token
order), sample_keys.

Why THD: several samples share one row, so attention must not cross sample boundaries and MRoPE must
restart at every sample. The model (``Qwen3VLModel``) accepts a flat ``[1, T]`` stream with THD
``PackedSeqParams``; Transformer Engine then attends within each segment only.
"""
