"""Ray Data as its users feed a VLM trainer: ``read_webdataset`` on the same tars (members as raw
bytes), ``map_batches`` with the Hugging Face Qwen3-VL processor in
a class on an actor pool, ``streaming_split`` to the trainer ranks, and each rank's micro-batches
padded to the longest row (``iter_batches`` of MBS rows, padded as Bridge's collate pads).

Every row leaves the actors holding its float32 ``pixel_values``: that is what the processor
returns, and what a user moves through the object store to the rank.
"""
from __future__ import annotations

import io
import json
import os

import numpy as np
from PIL import Image

from datasvc.batch import TrainBatch
from datasvc.members import IMAGE_EXTS  # every image extension the service reads
from trainer.bench.peers_data import PeerSetting, build_hf_processor, hf_messages, padded_batch


class HFQwen3VLEncoder:
    """The ``map_batches`` class: the HF processor per sample (text by the chat template, then
    processor(text, images)), the assistant reply supervised, labels shifted one to the left."""

    def __init__(self, setting: PeerSetting):
        self.processor = build_hf_processor(setting)
        tok = self.processor.tokenizer
        self.assistant_start = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")
        self.pid = os.getpid()

    def __call__(self, batch: dict) -> dict:
        out = {"input_ids": [], "labels": [], "loss_mask": [], "pixel_values": [], "image_grid_thw": [],
               "key": [], "worker_pid": []}
        keys = batch["__key__"]
        image_columns = sorted(c for c in batch if c.rsplit(".", 1)[-1] in IMAGE_EXTS)
        for i in range(len(keys)):
            images = [Image.open(io.BytesIO(batch[c][i])).convert("RGB") for c in image_columns
                      if _value(batch, c, i) is not None]
            text, doc = _value(batch, "txt", i), _value(batch, "json", i)
            enc = self.encode(images, text.decode() if text else None, json.loads(doc) if doc else None)
            for k, v in enc.items():
                out[k].append(v)
            out["key"].append(str(keys[i]))
            out["worker_pid"].append(self.pid)
        return {k: _column(v) for k, v in out.items()}

    def encode(self, images: list, text: str | None, doc: dict | None) -> dict:
        """One sample (decoded RGB images, its caption or JSON document) as the HF processor makes
        it: input_ids, labels (shifted), loss_mask, float32 pixel_values, image_grid_thw."""
        from datasvc.read.formats import sample_messages
        from datasvc.read.shards import RawSample

        raw = RawSample("", "", [], text, doc)
        messages = hf_messages(sample_messages(raw, len(images)))  # the conversation vlmfeed trains on
        chat = self.processor.apply_chat_template(messages, tokenize=False)
        enc = self.processor(text=[chat], images=images or None, return_tensors="np")
        ids = np.asarray(enc["input_ids"][0], dtype=np.int64)
        mask = self._assistant_mask(ids)
        labels = np.full_like(ids, -100)
        labels[:-1] = np.where(mask[1:] > 0, ids[1:], -100)
        return {"input_ids": ids, "labels": labels, "loss_mask": np.concatenate([mask[1:], [0.0]]).astype(np.float32),
                "pixel_values": np.asarray(enc["pixel_values"], dtype=np.float32),
                "image_grid_thw": np.asarray(enc["image_grid_thw"], dtype=np.int64).reshape(-1, 3)}

    def _assistant_mask(self, ids: np.ndarray) -> np.ndarray:
        """1 on the assistant reply and its <|im_end|> (what Bridge's chat loss supervises)."""
        mask = np.zeros(len(ids), dtype=np.float32)
        n = len(self.assistant_start)
        start = None
        for j in range(len(ids) - n, -1, -1):
            if ids[j:j + n].tolist() == self.assistant_start:
                start = j + n
                break
        if start is not None:
            ends = np.flatnonzero(ids[start:] == self.im_end)
            mask[start:start + (int(ends[0]) + 1 if len(ends) else len(ids) - start)] = 1.0
        return mask


def _value(batch: dict, column: str, i: int):
    value = batch[column][i] if column in batch else None
    return None if value is None or (isinstance(value, float) and np.isnan(value)) else value


def _column(values: list) -> np.ndarray:
    """A ragged list as an object column (Ray Data stores it as a variable-shaped tensor)."""
    col = np.empty(len(values), dtype=object)
    col[:] = values
    return col


# Ray Data's read-ahead bound, as its users set it for a trainer that consumes slower than the
# pool produces: without it the pool runs a whole epoch ahead, and every float32 sample held costs
# tens of MB of object store.
READ_AHEAD_BYTES = 2 << 30


def build_dataset(setting: PeerSetting, actors: int, batch_size: int = 4):
    """read_webdataset -> map_batches(HF processor on an actor pool of ``actors``), the read-ahead
    bounded by ``DataContext``'s object-store limit."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # a log line per second otherwise
    # The object store bounds the read-ahead; CPUs are left to the cluster (the data path's cores),
    # since a CPU limit equal to the pool would leave the read tasks none.
    ctx.execution_options.resource_limits = ray.data.ExecutionResources(object_store_memory=READ_AHEAD_BYTES)
    # Raw bytes, decoded in the actors: Ray's default decoder turns images into arrays per row, and
    # a block whose rows hold different members (one image, or two and a conversation) then fails
    # to become one tensor column.
    ds = ray.data.read_webdataset(list(setting.shards), decoder=None)
    return ds.map_batches(HFQwen3VLEncoder, fn_constructor_args=(setting,), batch_size=batch_size,
                          batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=1)


def split_for_ranks(setting: PeerSetting, ranks: int, actors: int):
    """One streaming iterator per DP rank (equal shares, as Ray Train's dataset sharding does)."""
    return build_dataset(setting, actors).streaming_split(ranks, equal=True)


class RayDataPath:
    """One rank's micro-batches from its ``streaming_split`` iterator, in the rank's contract; the
    epoch starts again when it ends (``epochs`` None: without end)."""

    name = "ray-data"

    def __init__(self, setting: PeerSetting, iterator, pad_id: int, epochs: int | None = None):
        self.setting, self.iterator, self.pad_id, self.epochs = setting, iterator, pad_id, epochs
        self.worker_pids: set[int] = set()
        self._gen = self._batches()

    def __iter__(self):
        return self

    def __next__(self) -> TrainBatch:
        return next(self._gen)

    def _batches(self):
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            for b in self.iterator.iter_batches(batch_size=self.setting.mbs, batch_format="numpy",
                                                drop_last=True, prefetch_batches=2):
                yield self._contract(b)
            epoch += 1

    def _contract(self, b: dict) -> TrainBatch:
        import torch

        self.worker_pids.update(int(p) for p in b["worker_pid"])
        rows = [{"input_ids": b["input_ids"][i], "labels": b["labels"][i], "loss_mask": b["loss_mask"][i]}
                for i in range(len(b["input_ids"]))]
        return padded_batch(rows, self.setting.seq_len, self.pad_id,
                            pixel_values=torch.from_numpy(np.concatenate(list(b["pixel_values"]), axis=0)),
                            image_grid_thw=torch.from_numpy(np.concatenate(list(b["image_grid_thw"]), axis=0)),
                            keys=[str(k) for k in b["key"]])

    def close(self) -> None:
        self._gen.close()
