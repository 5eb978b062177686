"""NeMo AutoModel 0.7.0's VLM packing in a process of its own, as an AutoModel user's DataLoader makes
packed Qwen3-VL micro-batches; ``peers_automodel.AutoModelPackedPath`` starts it and reads its stream.

AutoModel pins transformers 5.18 and our environment holds 5.12, so this module runs under
``.venv-automodel`` (its own transformers and AutoModel, torch and the rest shared with ``.venv``):

    python -m trainer.bench.automodel_packer --shards A.tar B.tar --seq-len 4096 --mbs 2 --pad-id ID

The stages are AutoModel's own, wired as its ``VlmDataloaderConfig.build`` wires them for a packed
THD recipe: the shards' conversations (AutoModel's ``conversation`` schema, images as PIL, each
image's ``[height, width]`` in ``mm_inputs_meta``) -> ``PreTokenizedDatasetWrapper`` (the Hugging
Face Qwen3-VL processor per sample, in the DataLoader's workers) -> ``NeatPackConfig.build``
(``neat_pack_dataset_vlm``: lengths estimated from metadata, bins by ``greedy_knapsack_vt_balanced``,
sorted by vision tokens so consecutive packs, one per DP rank in a step, carry similar ViT work) ->
``DistributedSampler`` without shuffling (which keeps consecutive packs on the ranks of one step) ->
``packed_sequence_thd_vlm_collater``. Each micro-batch leaves as the rank's contract.

Wire format on stdout: one frame per message, an 8-byte little-endian length and a ``torch.save``
payload: first the plan (``{"bins": [[sample key, ...], ...]}``), then micro-batches without end, each
a ``TrainBatch.as_dict()`` (the reader loads weights only, which admits no class of ours).
Everything else the libraries print goes to stderr.
"""
from __future__ import annotations

import argparse
import io
import itertools
import logging
import os
import signal
import struct
import sys
from functools import partial

import torch
from PIL import Image

from datasvc.batch import TrainBatch
from trainer.bench.peers_data import PeerSetting, build_hf_processor, hf_messages, shard_samples

FRAME_HEADER = struct.Struct("<Q")
LABEL_IGNORED = -100


# ------------------------------------------------------------------------------------------------
# The shards as AutoModel's raw conversations
# ------------------------------------------------------------------------------------------------
class ShardConversations:
    """Every good sample of the shards (images, and the conversation vlmfeed trains on: the same
    ``sample_messages`` every peer uses) as AutoModel's raw dataset. Each item is made fresh: the
    pretokenizing wrapper writes decoded images into the item it gets, and a shared item would keep
    them. ``served`` is the last index handed out, read by ``TracedSamples`` in the same process."""

    def __init__(self, shards, tokenizer):
        # The shards read as every peer reads them (bad samples and samples without images left out).
        samples = shard_samples(shards)
        self.keys: list[str] = [sample["key"] for sample in samples]
        self.images: list[list[bytes]] = [[data for _, data in sample["images"]] for sample in samples]
        self.messages: list[list[dict]] = [sample["messages"] for sample in samples]
        # The text's token count, as AutoModel's scripts/precompute_tokens.py writes it for its packing
        # plan (the turns' text joined by newlines); without it the plan guesses chars // 3, which
        # over-counts English text by about a third and leaves packs a quarter empty.
        self.text_tokens = [len(tokenizer.encode("\n".join(t.strip() for m in messages for t in m["content"]
                                                             if isinstance(t, str) and t.strip()),
                                                   add_special_tokens=False)) for messages in self.messages]
        self.served = -1

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> dict:
        self.served = index
        opened = [Image.open(io.BytesIO(data)) for data in self.images[index]]  # headers only; decoded when used
        conversation = hf_messages(self.messages[index])
        parts = (p for m in conversation for p in m["content"] if p["type"] == "image")
        for part, image in zip(parts, opened):
            part["image"] = image
        return {"conversation": conversation, "_text_tokens": self.text_tokens[index],
                "mm_inputs_meta": {"images_meta": [[image.height, image.width] for image in opened]}}


# ------------------------------------------------------------------------------------------------
# Which samples each pack holds
# ------------------------------------------------------------------------------------------------
class TracedSamples(torch.utils.data.Dataset):
    """AutoModel's pretokenizing wrapper, noting per sample the raw index it really served (it
    replaces a sample that fails or runs long) and the sample's length after the packer's shift."""

    def __init__(self, pretokenized, raw: ShardConversations):
        self.pretokenized, self.raw = pretokenized, raw
        self.trace: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self.pretokenized)

    def __getitem__(self, index: int) -> dict:
        sample = self.pretokenized[index]
        self.trace.append((self.raw.served, len(sample["input_ids"]) - 1))
        return sample


def kept_indices(trace: list[tuple[int, int]], pack_lengths: list[int]) -> list[int]:
    """The traced samples a pack kept: the packer keeps a subsequence of its bin in order (it drops a
    sample that overflows the row), so each kept length matches the earliest unmatched sample of that
    length (a dropped sample's equal-length successor would have been dropped too)."""
    kept, position = [], 0
    for length in pack_lengths:
        match = next((j for j in range(position, len(trace)) if trace[j][1] == length), None)
        if match is None:
            continue  # the packer's padding-only row when it kept nothing: no sample to name
        kept.append(trace[match][0])
        position = match + 1
    return kept


class KeyedPacks(torch.utils.data.Dataset):
    """AutoModel's packed dataset, each pack carrying the keys of the samples it holds."""

    def __init__(self, packed, traced: TracedSamples, keys: list[str]):
        self.packed, self.traced, self.keys = packed, traced, keys

    def __len__(self) -> int:
        return len(self.packed)

    def __getitem__(self, index: int) -> dict:
        self.traced.trace.clear()
        pack = self.packed[index]
        pack["sample_keys"] = [self.keys[i] for i in kept_indices(self.traced.trace, pack["seq_lens"])]
        return pack


# ------------------------------------------------------------------------------------------------
# AutoModel's collated batch as the rank's contract
# ------------------------------------------------------------------------------------------------
def contract_collate(packs: list[dict], *, pad_id: int, seq_len: int) -> TrainBatch:
    from nemo_automodel.components.datasets.vlm.collate_fns import packed_sequence_thd_vlm_collater

    keys = [k for pack in packs for k in pack.pop("sample_keys")]
    batch = packed_sequence_thd_vlm_collater(packs, padding_idx=pad_id, max_length=seq_len)
    return rank_contract(batch, keys)


def rank_contract(batch: dict, keys: list[str]) -> TrainBatch:
    """tokens/labels [B,S] (AutoModel shifted each sample's labels before packing), loss_mask where a
    label is, cu_seqlens [B,K+1] from the real ``seq_lens`` (the collater pads ragged rows with a
    negative sentinel), the unused tail repeating the row's end."""
    lengths = [[n for n in row if n >= 0] for row in batch["seq_lens"].tolist()]
    cu = torch.zeros((len(lengths), max(map(len, lengths)) + 1), dtype=torch.int32)
    for i, row in enumerate(lengths):
        ends = torch.tensor(row, dtype=torch.int32).cumsum(0)
        cu[i, 1:len(row) + 1] = ends
        cu[i, len(row) + 1:] = ends[-1]
    labels = batch["labels"]
    return TrainBatch(tokens=batch["input_ids"], labels=labels, loss_mask=(labels != LABEL_IGNORED).float(),
                      cu_seqlens=cu, num_samples=torch.tensor([len(row) for row in lengths], dtype=torch.int32),
                      # bfloat16, as AutoModel's collater hands them to its model
                      pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"], sample_keys=keys)


# AutoModel's headroom for its length estimate (its docs suggest 0.9): the estimate leaves out the
# chat template's tokens, 2-5% of a sample here, and a pack that overflows its row at materialization
# loses whole samples. 0.95 packed fullest of 0.9, 0.95 and 1.0 on the LLaVA-style profile.
PACKING_RATIO = 0.95


def build_loader(setting: PeerSetting, *, pad_id: int, num_workers: int, dp_rank: int = 0, dp_size: int = 1):
    """AutoModel's packed VLM DataLoader over the shards; returns (loader, plan: each bin's keys)."""
    from nemo_automodel.components.datasets.vlm.datasets import PreTokenizedDatasetWrapperConfig
    from nemo_automodel.components.datasets.vlm.neat_packing_vlm import NeatPackConfig
    from torch.utils.data import DataLoader, DistributedSampler

    processor = build_hf_processor(setting)
    raw = ShardConversations(setting.shards, processor.tokenizer)
    # A sample one token over the row still fits once shifted; a longer one is cut, as the other
    # peers cut it (AutoModel's recipes truncate whenever a max_length is set).
    pretokenized = PreTokenizedDatasetWrapperConfig(max_length=setting.seq_len + 1, truncate=True).build(
        dataset=raw, processor=processor)
    traced = TracedSamples(pretokenized, raw)
    packed = NeatPackConfig(pack_size=setting.seq_len, packing_ratio=PACKING_RATIO, balance_media_tokens=True,
                            packing_format="thd").build(
        dataset=traced, padding_idx=pad_id, ds_raw=raw, processor=processor)
    dataset = KeyedPacks(packed, traced, raw.keys)
    # No shuffling: the plan's order is what puts packs of similar vision work on the ranks of one step.
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    loader = DataLoader(dataset, sampler=sampler, batch_size=setting.mbs, num_workers=num_workers,
                        collate_fn=partial(contract_collate, pad_id=pad_id, seq_len=setting.seq_len),
                        drop_last=True, persistent_workers=num_workers > 0)
    return loader, [[raw.keys[i] for i in b] for b in packed.bins]


# ------------------------------------------------------------------------------------------------
# The stream
# ------------------------------------------------------------------------------------------------
def write_frame(out, payload) -> None:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    out.write(FRAME_HEADER.pack(buffer.tell()))
    out.write(buffer.getbuffer())
    out.flush()


def read_frame(stream):
    """One frame from ``stream``, or None at its end."""
    header = stream.read(FRAME_HEADER.size)
    if len(header) < FRAME_HEADER.size:
        return None
    (size,) = FRAME_HEADER.unpack(header)
    payload = stream.read(size)
    if len(payload) < size:
        return None
    return torch.load(io.BytesIO(payload), weights_only=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="automodel_packer", description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", nargs="+", required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--mbs", type=int, required=True)
    p.add_argument("--min-pixels", type=int, required=True)
    p.add_argument("--max-pixels", type=int, required=True)
    p.add_argument("--pipeline", default="qwen3vl")
    p.add_argument("--pad-id", type=int, required=True)
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--epochs", type=int, default=None, help="passes over the plan; without end if not given")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    # The stream owns the real stdout; whatever else would print there goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # Terminated by the reader: leave through SystemExit, so the DataLoader stops its workers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    setting = PeerSetting(shards=tuple(args.shards), seq_len=args.seq_len, mbs=args.mbs,
                          min_pixels=args.min_pixels, max_pixels=args.max_pixels, pipeline=args.pipeline)
    loader, plan = build_loader(setting, pad_id=args.pad_id, num_workers=args.num_workers,
                                dp_rank=args.dp_rank, dp_size=args.dp_size)
    try:
        write_frame(out, {"bins": plan})
        for epoch in itertools.count() if args.epochs is None else range(args.epochs):
            loader.sampler.set_epoch(epoch)
            for batch in loader:
                write_frame(out, batch.as_dict())
    except BrokenPipeError:
        pass  # the reader closed: the run is over
    finally:
        try:
            out.close()
        except BrokenPipeError:
            pass


if __name__ == "__main__":
    main()
