"""Packed rows -> one THD stream: pure tensor logic, testable on CPU.

A micro-batch of B rows, each holding several samples, becomes one ``[1, T]`` stream whose segments
are the samples (plus filler), described by THD ``PackedSeqParams``; MRoPE positions restart at
every segment.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.rope import get_rope_index
from megatron.core.packed_seq_params import PackedSeqParams

from datasvc.batch import IGNORE_INDEX

PAD_ID = 0
"""The id in padded slots and unsupervised labels: any id of every vocabulary serves, as a padded slot
lies outside every THD segment and no loss is taken there."""


def real_tokens_per_row(cu_seqlens: torch.Tensor, num_samples: torch.Tensor) -> torch.Tensor:
    """End of the last sample of each row (tokens past it are padding)."""
    rows = torch.arange(cu_seqlens.shape[0], device=cu_seqlens.device)
    return cu_seqlens[rows, num_samples.long()].long()


@dataclass
class PackedTHD:
    """One micro-batch as a single THD stream of T tokens.

    ``segments`` are the attention units in stream order: every sample, plus one filler segment per
    row tail (padding attends only to padding, so it cannot disturb a sample and its outputs stay
    finite). ``sample_spans[k]`` is the (start, end) of sample k (row-major) in the stream.
    """

    tokens: torch.Tensor  # int64 [1, T]
    labels: torch.Tensor  # int64 [1, T], IGNORE_INDEX mapped to PAD_ID (loss_mask is 0 there)
    loss_mask: torch.Tensor  # float32 [1, T]
    cu_seqlens: torch.Tensor  # int32 [n_segments + 1]: real tokens of each segment
    cu_seqlens_padded: torch.Tensor  # int32 [n_segments + 1]: physical extent of each segment
    max_seqlen: int
    sample_spans: list[tuple[int, int]]

    @property
    def params(self) -> PackedSeqParams:
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded, cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen,
        )


# A piece of the stream: (source row or -1 for end filler, source start, real length, physical
# length, is a sample).
_Piece = tuple[int, int, int, int, bool]


def pack_thd(tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
             cu_seqlens: torch.Tensor, num_samples: torch.Tensor, *,
             segment_multiple: int = 1, total_multiple: int = 1) -> PackedTHD:
    """Flatten B packed rows into one THD stream.

    segment_multiple: every segment's physical length is rounded up to it (context parallel needs
        2*CP: each segment is split into 2*CP chunks). Samples are then copied apart with padding
        between them; with 1 the rows are used in place (a reshape).
    total_multiple: the stream length T is rounded up to it (sequence parallel needs T % (TP*CP) == 0).
    T is B*S whenever that fits, so shapes stay fixed from step to step without context parallel.
    """
    m = max(1, segment_multiple)
    pieces, total = _layout(cu_seqlens, num_samples, tokens.shape, m, max(1, total_multiple))
    if m == 1 and total == tokens.numel():
        flat_tokens, flat_labels, flat_mask = tokens.reshape(1, -1), labels.reshape(1, -1), loss_mask.reshape(1, -1)
    else:
        flat_tokens, flat_labels, flat_mask = _copy_pieces(pieces, total, tokens, labels, loss_mask)

    # Supervise only real targets; -100 is not a vocabulary index, so map it to the pad id (masked).
    supervised = flat_labels != IGNORE_INDEX
    flat_mask = flat_mask.float() * supervised
    flat_labels = torch.where(supervised, flat_labels, torch.full_like(flat_labels, PAD_ID))
    cu_real, cu_phys, max_seqlen, spans = _boundaries(pieces, tokens.device)
    return PackedTHD(flat_tokens.long(), flat_labels.long(), flat_mask, cu_real, cu_phys, max_seqlen, spans)


def _layout(cu_seqlens: torch.Tensor, num_samples: torch.Tensor, shape: torch.Size, m: int,
            total_multiple: int) -> tuple[list[_Piece], int]:
    """The stream's pieces in order and its length T."""
    B, S = shape
    spans_per_row = cu_seqlens.long().tolist()
    counts = num_samples.long().tolist()
    pieces: list[_Piece] = []
    for r in range(B):
        for j in range(counts[r]):
            s, e = spans_per_row[r][j], spans_per_row[r][j + 1]
            if e > s:
                pieces.append((r, s, e - s, _round_up(e - s, m), True))
        if m == 1:  # rows in place: the row tail becomes a filler segment
            end = spans_per_row[r][counts[r]] if counts[r] else 0
            if S > end:
                pieces.append((r, end, S - end, S - end, False))
    used = sum(pc[3] for pc in pieces)
    total = _round_up(max(used, B * S if m == 1 else used), math.lcm(m, total_multiple))
    if total > used:  # one filler segment at the end (a multiple of m, since both ends are)
        pieces.append((-1, 0, total - used, total - used, False))
    return pieces, total


def _copy_pieces(pieces: list[_Piece], total: int, tokens: torch.Tensor, labels: torch.Tensor,
                 loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples copied apart into a fresh stream, padding (masked) between them."""
    device = tokens.device
    flat_tokens = torch.full((1, total), PAD_ID, dtype=tokens.dtype, device=device)
    flat_labels = torch.full((1, total), IGNORE_INDEX, dtype=labels.dtype, device=device)
    flat_mask = torch.zeros((1, total), dtype=loss_mask.dtype, device=device)
    at = 0
    for r, s, n, phys, _ in pieces:
        if r >= 0:
            flat_tokens[0, at:at + n] = tokens[r, s:s + n]
            flat_labels[0, at:at + n] = labels[r, s:s + n]
            flat_mask[0, at:at + n] = loss_mask[r, s:s + n]
        at += phys
    return flat_tokens, flat_labels, flat_mask


def _boundaries(pieces: list[_Piece], device) -> tuple[torch.Tensor, torch.Tensor, int, list[tuple[int, int]]]:
    """Cumulative real and physical segment lengths, the longest segment, and the sample spans."""
    real, phys = [0], [0]
    spans, at = [], 0
    for _, _, n, p, is_sample in pieces:
        # A filler segment counts as "real" tokens: attention over it is well defined (no padded
        # holes whose outputs the kernel may leave unset), and the loss mask is 0 there anyway.
        real.append(real[-1] + n)  # TE convention: cumulative real lengths ...
        phys.append(phys[-1] + p)  # ... and cumulative physical extents (offsets in the stream)
        if is_sample:
            spans.append((at, at + n))
        at += p
    cu_real = torch.tensor(real, dtype=torch.int32, device=device)
    cu_phys = torch.tensor(phys, dtype=torch.int32, device=device)
    max_seqlen = max(b - a for a, b in zip(phys[:-1], phys[1:]))
    return cu_real, cu_phys, max_seqlen, spans


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def mrope_position_ids(packed: PackedTHD, model_config, image_grid_thw: torch.Tensor | None,
                       video_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
    """MRoPE positions [3, 1, T] restarted at every segment, via Megatron-Bridge's own Qwen3-VL rope
    index (``get_rope_index`` walks the THD segments and consumes ``image_grid_thw`` and
    ``video_grid_thw`` in order; it splits a video's grid per temporal group, as its timestamps do).
    The image, video and vision-start ids and the merge size are the model's own (``model_config``:
    its Bridge provider), so each model family finds its images by its own vocabulary."""
    grid = image_grid_thw if image_grid_thw is not None and image_grid_thw.numel() else None
    videos = video_grid_thw if video_grid_thw is not None and video_grid_thw.numel() else None
    c = model_config
    position_ids, _ = get_rope_index(
        c.spatial_merge_size, c.image_token_id, c.video_token_id, c.vision_start_token_id, packed.tokens,
        image_grid_thw=grid, video_grid_thw=None if videos is None else videos.clone(),
        packed_seq_params=packed.params,
    )
    return position_ids


def per_sample_losses(token_losses: torch.Tensor, loss_mask: torch.Tensor,
                      spans: list[tuple[int, int]]) -> list[float]:
    """Mean loss over the supervised tokens of each sample (for the packed-vs-alone proof)."""
    lt, lm = token_losses.reshape(-1).float(), loss_mask.reshape(-1).float()
    out = []
    for a, b in spans:
        n = lm[a:b].sum()
        out.append(float((lt[a:b] * lm[a:b]).sum() / n) if n > 0 else float("nan"))
    return out
