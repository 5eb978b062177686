"""Megatron-Energon 7.4.1 with its own packing, as an Energon user packs a VLM's samples.

The shards are prepared once with ``energon prepare`` as a ``CrudeWebdataset``; a cooker turns each
crude sample (images decoded by Energon's decoder to PIL, the caption or JSON document) into a
``Sample``; ``encode_sample`` runs the Hugging Face Qwen3-VL processor in Energon's worker processes
(the same per-sample work as the Ray Data peer: ``HFQwen3VLEncoder.encode``); with
``packing_buffer_size`` set, Energon hands a buffer of encoded samples to ``select_samples_to_pack``
(first-fit-decreasing into ``seq_len`` bins, as Megatron-Bridge 0.7's Energon packing for Qwen-VL
does) and each bin to ``pack_selected_samples``; ``batch`` stacks MBS packed rows into the rank's
contract, which trains through the same packed THD step as vlmfeed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import torch

from datasvc.batch import IGNORE_INDEX, TrainBatch
from datasvc.members import IMAGE_EXTS  # every image extension the service reads
from trainer.bench.peers_data import PeerSetting


def prepared_dataset(setting: PeerSetting, work_dir: str) -> str:
    """The shards linked into one directory and prepared by ``energon prepare`` (all of them the
    train split, samples read raw); made once per work directory."""
    root = os.path.join(work_dir, "energon")
    if os.path.exists(os.path.join(root, ".nv-meta", "dataset.yaml")):
        return root
    os.makedirs(root, exist_ok=True)
    for i, shard in enumerate(setting.shards):
        link = os.path.join(root, f"part-{i:06d}.tar")
        if not os.path.exists(link):
            os.symlink(os.path.abspath(shard), link)
    energon = os.path.join(os.path.dirname(sys.executable), "energon")
    cmd = [energon if os.path.exists(energon) else "energon", "prepare", root, "--non-interactive",
           "--no-progress", "--split-ratio", "1,0,0", "--sample-type", "CrudeWebdataset", "--force-overwrite"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"energon prepare failed: {done.stderr[-2000:]}")
    return root


@dataclasses.dataclass
class EncodedSample:
    """One sample as the HF processor made it (Energon's sample keys kept for its state)."""

    __key__: str
    __restore_key__: tuple
    __subflavors__: dict | None
    __sources__: tuple | None
    input_ids: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray
    pixel_values: np.ndarray
    image_grid_thw: np.ndarray
    lengths: list[int] | None = None  # the samples' lengths, once packed into one row


def _task_encoder_class():
    """Built on first use: Energon is imported only where this peer runs."""
    from megatron.energon import Cooker, DefaultTaskEncoder, Sample, SampleDecoder, stateless

    @dataclasses.dataclass
    class PhotoTextSample(Sample):
        images: list
        text: str | None
        doc: dict | None

    @stateless
    def cook(crude: dict) -> PhotoTextSample:
        from megatron.energon.task_encoder.cooking import basic_sample_keys

        images = [crude[k].convert("RGB") for k in sorted(crude) if k.rsplit(".", 1)[-1] in IMAGE_EXTS]
        text, doc = crude.get("txt"), crude.get("json")
        text = text.decode() if isinstance(text, bytes) else text
        doc = json.loads(doc) if isinstance(doc, (bytes, str)) else doc
        return PhotoTextSample(**basic_sample_keys(crude), images=images, text=text, doc=doc)

    class PackingQwen3VLEncoder(DefaultTaskEncoder):
        cookers = [Cooker(cook)]

        def __init__(self, setting: PeerSetting, pad_id: int):
            super().__init__()
            from trainer.bench.peers_raydata import HFQwen3VLEncoder

            self.decoder = SampleDecoder(image_decode="pil")
            self.hf = HFQwen3VLEncoder(setting)
            self.seq_len, self.pad_id = setting.seq_len, pad_id

        @stateless
        def encode_sample(self, sample: PhotoTextSample) -> EncodedSample:
            enc = self.hf.encode(sample.images, sample.text, sample.doc)
            n = min(len(enc["input_ids"]), self.seq_len)  # a sample longer than a row is cut, as Bridge's collate cuts it
            return EncodedSample(sample.__key__, sample.__restore_key__, sample.__subflavors__,
                                 getattr(sample, "__sources__", None), enc["input_ids"][:n], enc["labels"][:n],
                                 enc["loss_mask"][:n], enc["pixel_values"], enc["image_grid_thw"])

        def select_samples_to_pack(self, samples: list[EncodedSample]) -> list[list[EncodedSample]]:
            return first_fit_decreasing(samples, [len(s.input_ids) for s in samples], self.seq_len)

        @stateless
        def pack_selected_samples(self, samples: list[EncodedSample]) -> EncodedSample:
            return pack_samples(samples)

        @stateless
        def batch(self, rows: list[EncodedSample]) -> TrainBatch:
            return contract_batch(rows, self.seq_len, self.pad_id)

        @stateless
        def encode_batch(self, batch: TrainBatch) -> TrainBatch:
            return batch

    return PackingQwen3VLEncoder


def first_fit_decreasing(items: list, lengths: list[int], capacity: int) -> list[list]:
    """Bins of total length at most ``capacity``: each item, longest first, into the first bin it fits."""
    bins: list[list] = []
    room: list[int] = []
    for i in sorted(range(len(items)), key=lambda i: -lengths[i]):
        for b, left in enumerate(room):
            if lengths[i] <= left:
                bins[b].append(items[i])
                room[b] -= lengths[i]
                break
        else:
            bins.append([items[i]])
            room.append(capacity - lengths[i])
    return bins


def pack_samples(samples: list[EncodedSample]) -> EncodedSample:
    """Samples end to end in one row, with their lengths."""
    first = samples[0]
    cat = lambda name: np.concatenate([getattr(s, name) for s in samples])  # noqa: E731
    packed = EncodedSample(",".join(s.__key__ for s in samples), tuple(s.__restore_key__ for s in samples),
                           first.__subflavors__, first.__sources__, cat("input_ids"), cat("labels"),
                           cat("loss_mask"), cat("pixel_values"), cat("image_grid_thw"),
                           lengths=[len(s.input_ids) for s in samples])
    return packed


def contract_batch(rows: list[EncodedSample], seq_len: int, pad_id: int) -> TrainBatch:
    """Packed rows padded to ``seq_len`` into the rank's contract (``cu_seqlens`` [B, K+1], the unused
    tail repeating the row's end)."""
    b = len(rows)
    lengths = [r.lengths or [len(r.input_ids)] for r in rows]
    k = max(len(x) for x in lengths)
    tokens = torch.full((b, seq_len), pad_id, dtype=torch.int64)
    labels = torch.full((b, seq_len), IGNORE_INDEX, dtype=torch.int64)
    loss_mask = torch.zeros((b, seq_len), dtype=torch.float32)
    cu = torch.zeros((b, k + 1), dtype=torch.int32)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        tokens[i, :n] = torch.from_numpy(r.input_ids)
        labels[i, :n] = torch.from_numpy(r.labels)
        loss_mask[i, :n] = torch.from_numpy(r.loss_mask)
        ends = np.cumsum(lengths[i])
        cu[i, 1:len(ends) + 1] = torch.from_numpy(ends.astype(np.int32))
        cu[i, len(ends) + 1:] = int(ends[-1])
    return TrainBatch(tokens=tokens, labels=labels, loss_mask=loss_mask, cu_seqlens=cu,
                      num_samples=torch.tensor([len(x) for x in lengths], dtype=torch.int32),
                      pixel_values=torch.from_numpy(np.concatenate([r.pixel_values for r in rows])),
                      image_grid_thw=torch.from_numpy(np.concatenate([r.image_grid_thw for r in rows])),
                      sample_keys=[k for r in rows for k in r.__key__.split(",")])


class EnergonPackedPath:
    """One rank's Energon loader with packing, yielding the rank's contract. ``packing_buffer_size``
    encoded samples are buffered per worker and packed (Energon's own guidance: a buffer a few
    times the samples a row holds)."""

    name = "energon-packed"

    def __init__(self, setting: PeerSetting, work_dir: str, *, pad_id: int, num_workers: int, dp_rank: int = 0,
                 dp_size: int = 1, packing_buffer_size: int = 64, seed: int = 1234):
        from megatron.energon import WorkerConfig, get_loader, get_train_dataset

        self.setting = setting
        root = prepared_dataset(setting, work_dir)
        worker_config = WorkerConfig(rank=dp_rank, world_size=dp_size, num_workers=num_workers, seed_offset=seed)
        encoder = _task_encoder_class()(setting, pad_id)
        self.dataset = get_train_dataset(root, worker_config=worker_config, batch_size=setting.mbs,
                                         packing_buffer_size=packing_buffer_size, shuffle_buffer_size=None,
                                         max_samples_per_sequence=None, task_encoder=encoder)
        self.loader = get_loader(self.dataset)
        self._it = None
        # Each worker buffers a packing buffer and the loader prefetches batches: a warm-up past
        # them measures the steady state.
        self.buffered_samples = max(1, num_workers) * packing_buffer_size

    def __iter__(self):
        return self

    def __next__(self) -> TrainBatch:
        if self._it is None:
            self._it = iter(self.loader)
        return next(self._it)

    def close(self) -> None:
        self._it = None
