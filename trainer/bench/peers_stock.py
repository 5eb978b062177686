"""Megatron-Bridge 0.6.2's own Qwen3-VL data path, configured as its recipes configure it.

Its Qwen3-VL SFT recipes (``recipes/qwen_vl/h100/qwen3_vl.py`` on ``recipes/common.py``
``_sft_common_vlm``) take a ``DirectHFSFTDatasetConfig``: a Hugging Face source normalized to
conversations, the HF processor from ``hf_processor_path``, ``num_workers=2`` torch DataLoader
workers per rank, ``dataloader_type="cyclic"`` with data sharding, pinned memory, in-batch packing
enabled but deferred to the step (``defer_in_batch_packing_to_step=True``: ``qwen3_vl_step`` keeps
one sample per padded row and only marks row boundaries). Each worker runs the model-owned collate
(``qwen2_5_collate_fn``, chosen by processor type: qwen_vl_utils' ``process_vision_info`` opens and
resizes the images, then the HF processor resizes again, normalizes and cuts patches).

``StockPath`` builds exactly that with Bridge's classes (the recipe's dataset config, its builder,
its ``build_pretraining_data_loader``) on the shards converted once to a JSON list of
conversations, and turns each of its batches into the rank's contract. The trainer then runs it
through ``to_stock_batch`` into the stock ``qwen3_vl_step``, as a Bridge user's job would.
"""
from __future__ import annotations

import os

import torch

from datasvc.batch import IGNORE_INDEX, TrainBatch
from trainer.bench.peers_data import PeerSetting, save_hf_processor, write_conversations


def recipe_dataset_config(setting: PeerSetting, conversations: str, processor_dir: str, *,
                          num_workers: int | None = None):
    """The Qwen3-VL SFT recipes' dataset config, pointed at our conversations and processor. The
    values are ``_sft_common_vlm``'s and the Qwen3-VL SFT configs' own (``megatron.bridge.recipes``
    cannot be imported without diffusers, which its flux recipes need, so they are repeated here)."""
    from megatron.bridge.data.builders import (ChatSFTPreprocessingConfig, DirectHFSFTDatasetConfig,
                                               HFDatasetSourceConfig)

    return DirectHFSFTDatasetConfig(
        seq_length=setting.seq_len,
        preprocessing=ChatSFTPreprocessingConfig(),
        hf_processor_path=processor_dir,
        source=HFDatasetSourceConfig(path_or_dataset="json", load_kwargs={"data_files": conversations}),
        num_workers=2 if num_workers is None else num_workers,
        dataloader_type="cyclic",
        data_sharding=True,
        pin_memory=True,
        persistent_workers=False,
        enable_in_batch_packing=True,
        defer_in_batch_packing_to_step=True,  # as qwen3_vl_{8b,30b_a3b,235b_a22b}_sft configs set it
        do_validation=False,
        do_test=False,
    )


class StockPath:
    """One rank's Megatron-Bridge data loader, yielding the rank's contract."""

    name = "megatron-bridge"

    def __init__(self, setting: PeerSetting, work_dir: str, *, samples: int, dp_rank: int = 0, dp_size: int = 1,
                 num_workers: int | None = None, seed: int = 1234):
        from megatron.bridge.data.base import DatasetBuildContext
        from megatron.bridge.data.builders import DirectHFSFTDatasetBuilder
        from megatron.bridge.data.samplers import build_pretraining_data_loader

        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        self.setting = setting
        conversations = write_conversations(setting.shards, os.path.join(work_dir, "conversations"))
        processor_dir = save_hf_processor(setting, os.path.join(work_dir, "hf-processor"))
        self.config = recipe_dataset_config(setting, conversations, processor_dir, num_workers=num_workers)
        self.config.finalize()
        train, _, _ = DirectHFSFTDatasetBuilder(self.config).build(
            DatasetBuildContext(train_samples=samples, valid_samples=0, test_samples=0))
        self.processor = train._processor
        self.loader = build_pretraining_data_loader(
            train, 0, self.config.dataloader_type, setting.mbs, self.config.num_workers, self.config.data_sharding,
            collate_fn=train.collate_fn, pin_memory=self.config.pin_memory and torch.cuda.is_available(),
            persistent_workers=self.config.persistent_workers, data_parallel_rank=dp_rank,
            data_parallel_size=dp_size, seed=seed)
        self._it = None
        self.pad_id = self.processor.tokenizer.pad_token_id

    @property
    def workers(self) -> int:
        return self.config.num_workers

    def __iter__(self):
        return self

    def __next__(self) -> TrainBatch:
        if self._it is None:
            self._it = iter(self.loader)
        return to_contract(next(self._it))

    def close(self) -> None:
        self._it = None  # the DataLoader's workers exit with their iterator


def to_contract(batch: dict) -> TrainBatch:
    """A batch of Bridge's Qwen-VL collate (input_ids, labels, loss_mask, attention_mask,
    visual_inputs) as the rank's contract: one sample a row, its length from the attention mask."""
    tokens = batch["input_ids"].to(torch.int64)
    visual = batch.get("visual_inputs")
    pv = getattr(visual, "pixel_values", None) if visual is not None else None
    grid = getattr(visual, "image_grid_thw", None) if visual is not None else None
    if grid is None:
        grid, pv = torch.zeros((0, 3), dtype=torch.int64), torch.zeros((0, 1), dtype=torch.float32)
    if grid.dim() == 3:  # nested per-sample [B, N, 3]
        grid = grid.flatten(0, 1)
    mask = batch.get("attention_mask")
    lengths = mask.sum(dim=1) if mask is not None else (tokens != 0).sum(dim=1)
    labels = batch["labels"].to(torch.int64)
    loss_mask = batch["loss_mask"].to(torch.float32)
    cu = torch.stack([torch.zeros_like(lengths), lengths], dim=1).to(torch.int32)
    return TrainBatch(tokens=tokens,
                      labels=torch.where(loss_mask > 0, labels, torch.full_like(labels, IGNORE_INDEX)),
                      loss_mask=loss_mask, cu_seqlens=cu, num_samples=torch.ones(len(tokens), dtype=torch.int32),
                      pixel_values=pv, image_grid_thw=grid.to(torch.int64), sample_keys=[""] * len(tokens))
