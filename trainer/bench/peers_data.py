"""What the peer data paths share: the shards read once into the forms the peers need (image files
and a JSON list of conversations for Megatron-Bridge's dataset; WebDataset tars as they are for Ray
Data), the Hugging Face Qwen3-VL processor built offline, and the rank's batch contract that every
peer adapter yields and ``check_contract`` verifies.

The contract is ``datasvc.batch.TrainBatch``, as ``trainer/megatron/step.py`` takes it: tokens/labels
int64 [B,S] (labels shifted, -100 ignored), loss_mask float32 [B,S], cu_seqlens int32 [B,K+1] and
num_samples [B] (one sample a row for the padded peers), pixel_values float [sum(t*h*w), patch dim],
image_grid_thw int64 [n,3], and each image's ``<|image_pad|>`` run exactly t*h*w / merge**2 tokens long.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from datasvc.batch import IGNORE_INDEX, TrainBatch
from pipelines.qwen3vl.data import HF_CHAT_TEMPLATE

# Megatron-Bridge's Qwen-VL collate passes these pixel limits to the processor unless told otherwise
# (models/qwen_vl/data/collate_fn.py QWEN_VL_MIN_PIXELS / QWEN_VL_MAX_PIXELS): every peer, vlmfeed
# included, uses the same limits so the vision work per sample is the same.
STOCK_MIN_PIXELS = 200704
STOCK_MAX_PIXELS = 1003520

PATHS = ("megatron-bridge", "energon-packed", "automodel-packed", "ray-data", "vlmfeed-cpu", "vlmfeed-gpu")
PADDED = ("megatron-bridge", "ray-data")  # one sample a row, into the stock qwen3_vl_step
IN_RANK = ("megatron-bridge", "energon-packed", "automodel-packed")  # processes the rank starts, no Ray


@dataclass(frozen=True, kw_only=True)
class PeerSetting:
    """What every peer runs with, so their figures compare."""

    shards: tuple[str, ...]
    seq_len: int = 4096
    mbs: int = 2
    min_pixels: int = STOCK_MIN_PIXELS
    max_pixels: int = STOCK_MAX_PIXELS
    pipeline: str = "qwen3vl"

    def vision(self):
        from datasvc.registry import get_layout

        return get_layout(self.pipeline, min_pixels=self.min_pixels, max_pixels=self.max_pixels).vision


# ------------------------------------------------------------------------------------------------
# The shards, converted once (outside any timed part)
# ------------------------------------------------------------------------------------------------
def shard_samples(shards) -> list[dict]:
    """Every good sample of the shards as {key, images: [(ext, bytes)], messages}, in shard order;
    ``messages`` is what vlmfeed trains on (``datasvc.read.formats.sample_messages``: a caption or a
    conversation, images placed), so every peer trains on the same conversations."""
    from datasvc.read.formats import sample_messages
    from datasvc.read.shards import ReadLimits, index_shard, read_samples
    from datasvc.rejects import SampleRejected

    out = []
    for path in shards:
        for raw in read_samples(path, index_shard(path).samples, ReadLimits()):
            if raw.problem or not raw.images:
                continue  # bad samples are vlmfeed's counted rejects; the peers never see them
            try:
                messages = sample_messages(raw, len(raw.images))
            except SampleRejected:
                continue
            out.append({"key": f"{os.path.basename(path)}/{raw.key}", "images": raw.images, "messages": messages})
    return out


def hf_messages(messages: list[dict], image_paths: list[str] | None = None) -> list[dict]:
    """vlmfeed's messages (content: text strings and image markers) as Hugging Face chat parts;
    image parts carry their file path when given (qwen_vl_utils opens it)."""
    paths = iter(image_paths or [])
    out = []
    for m in messages:
        parts = []
        for p in m["content"]:
            if isinstance(p, str):
                parts.append({"type": "text", "text": p})
            else:
                path = next(paths, None)
                parts.append({"type": "image", "image": path} if path else {"type": "image"})
        out.append({"role": m["role"], "content": parts})
    return out


def write_conversations(shards, out_dir: str) -> str:
    """The shards as a Megatron-Bridge user feeds its Hugging Face dataset provider: image files
    and one JSON line per sample holding its conversation (``{"conversation": [...]}``, the native
    conversation schema, image parts by path). Returns the JSON-lines path; written once."""
    path = os.path.join(out_dir, "conversations.jsonl")
    if os.path.exists(path):
        return path
    images_dir = os.path.join(out_dir, "images")
    os.makedirs(images_dir, exist_ok=True)
    rows = []
    for i, s in enumerate(shard_samples(shards)):
        paths = []
        for j, (ext, data) in enumerate(s["images"]):
            paths.append(os.path.join(images_dir, f"{i:06d}_{j}.{ext.rsplit('.', 1)[-1]}"))
            with open(paths[-1], "wb") as f:
                f.write(data)
        rows.append({"conversation": hf_messages(s["messages"], paths)})
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return path


def save_hf_processor(setting: PeerSetting, out_dir: str) -> str:
    """The Hugging Face Qwen3-VL processor, built offline from the pipeline's vision numbers and the
    bundled Qwen3 tokenizer, saved where ``AutoProcessor.from_pretrained`` (Megatron-Bridge's
    ``hf_processor_path``) loads it. Returns the directory."""
    if os.path.exists(os.path.join(out_dir, "processor_config.json")):
        return out_dir
    proc = build_hf_processor(setting)
    proc.save_pretrained(out_dir)
    return out_dir


def build_hf_processor(setting: PeerSetting):
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    from pipelines.qwen3vl.data import bundled_qwen3_tokenizer_dir

    v = setting.vision()
    image = Qwen2VLImageProcessor(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                                  merge_size=v.merge_size, image_mean=list(v.image_mean), image_std=list(v.image_std),
                                  min_pixels=setting.min_pixels, max_pixels=setting.max_pixels)
    video = Qwen3VLVideoProcessor(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                                  merge_size=v.merge_size)
    tokenizer = AutoTokenizer.from_pretrained(bundled_qwen3_tokenizer_dir())
    return Qwen3VLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=video,
                            chat_template=HF_CHAT_TEMPLATE)


# ------------------------------------------------------------------------------------------------
# The rank's contract
# ------------------------------------------------------------------------------------------------
def padded_batch(rows: list[dict], seq_len: int, pad_id: int, *, pixel_values: torch.Tensor,
                 image_grid_thw: torch.Tensor, keys: list[str] | None = None) -> TrainBatch:
    """Rows of one sample each ({input_ids, labels, loss_mask} 1-D, labels already shifted) padded
    to the longest row (capped at seq_len, a multiple of 128 as Bridge's collate pads) into the
    rank's contract; the images (``pixel_values``, ``image_grid_thw``) follow rows in order."""
    longest = min(seq_len, max(len(r["input_ids"]) for r in rows))
    width = min(seq_len, -(-longest // 128) * 128)
    b = len(rows)
    tokens = torch.full((b, width), pad_id, dtype=torch.int64)
    labels = torch.full((b, width), IGNORE_INDEX, dtype=torch.int64)
    loss_mask = torch.zeros((b, width), dtype=torch.float32)
    lengths = []
    for i, r in enumerate(rows):
        n = min(len(r["input_ids"]), width)
        tokens[i, :n] = torch.as_tensor(r["input_ids"][:n])
        labels[i, :n] = torch.as_tensor(r["labels"][:n])
        loss_mask[i, :n] = torch.as_tensor(r["loss_mask"][:n], dtype=torch.float32)
        lengths.append(n)
    cu = torch.tensor([[0, n] for n in lengths], dtype=torch.int32)
    return TrainBatch(tokens=tokens, labels=labels, loss_mask=loss_mask, cu_seqlens=cu,
                      num_samples=torch.ones(b, dtype=torch.int32), pixel_values=pixel_values,
                      image_grid_thw=image_grid_thw, sample_keys=keys or [""] * b)


def check_contract(batch: TrainBatch, image_pad_id: int, merge_size: int, patch_dim: int, seq_len: int) -> dict:
    """Fields, shapes and dtypes of one micro-batch; each row's image pad runs against its grids.
    Raises AssertionError naming what is wrong; returns a few counts."""
    tokens, labels, loss_mask = batch.tokens, batch.labels, batch.loss_mask
    assert tokens.dtype == torch.int64 and labels.dtype == torch.int64, (tokens.dtype, labels.dtype)
    assert loss_mask.dtype == torch.float32, loss_mask.dtype
    assert tokens.dim() == 2 and tokens.shape == labels.shape == loss_mask.shape, (tokens.shape, labels.shape)
    assert tokens.shape[1] <= seq_len, f"row of {tokens.shape[1]} tokens over seq_len {seq_len}"
    grid, pv = batch.image_grid_thw, batch.pixel_values
    assert grid.dtype == torch.int64 and grid.dim() == 2 and grid.shape[1] == 3, (grid.dtype, grid.shape)
    assert pv.is_floating_point() and pv.dim() == 2 and pv.shape[1] == patch_dim, (pv.dtype, pv.shape)
    assert pv.shape[0] == int(grid.prod(dim=1).sum()), (pv.shape, grid.tolist())
    assert batch.cu_seqlens.shape[0] == tokens.shape[0] and batch.num_samples.shape[0] == tokens.shape[0]
    # Supervised positions carry a label; unsupervised ones none.
    assert bool(((labels != IGNORE_INDEX) == (loss_mask > 0)).all()), "loss_mask and labels disagree"
    pads = (tokens == image_pad_id).sum().item()
    vision_tokens = int((grid.prod(dim=1) // merge_size ** 2).sum())
    assert pads == vision_tokens, f"{pads} image pad tokens for {vision_tokens} vision tokens"
    return {"rows": int(tokens.shape[0]), "width": int(tokens.shape[1]), "images": int(grid.shape[0]),
            "real_token_fraction": real_token_fraction(batch), "supervised": int(loss_mask.sum())}


def real_token_fraction(batch: TrainBatch) -> float:
    """Tokens in samples over the slots of the micro-batch (from the sample boundaries)."""
    cu = batch.cu_seqlens
    real = int((cu[:, -1] - cu[:, 0]).sum())
    return real / batch.tokens.numel()
