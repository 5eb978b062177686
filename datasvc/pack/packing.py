"""Packing encoded samples into fixed-shape micro-batches of B rows x S tokens.

Choose, then merge (as in Energon): ``plan_rows`` assigns samples to rows by best-fit decreasing
(no sample or image span is ever split), ``plan_micro_batches`` deals rows to micro-batches so
their vision patch counts are balanced, ``merge`` builds the arrays.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

import numpy as np

from datasvc.batch import IGNORE_INDEX, EncodedSample, PackedBatch
from datasvc.media.vision import grid_hw


@dataclass(frozen=True, kw_only=True, slots=True)
class PackingConfig:
    seq_len: int = 4096
    micro_batch_size: int = 1
    pad_id: int = 0
    pack: bool = True
    """False: one sample per row, padded (the stock loaders' layout, kept for comparison)."""

    def __post_init__(self):
        if self.seq_len < 16:
            raise ValueError(f"seq_len={self.seq_len} is too small to hold a chat turn; use >= 16")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")


def plan_rows(lengths: list[int], seq_len: int, first: set[int] = frozenset()) -> list[list[int]]:
    """Best-fit decreasing bin packing; returns sample indices per row (callers drop > seq_len).
    The samples of ``first`` are placed before the rest, so the rest fill the rows around them."""
    order = sorted(range(len(lengths)), key=lambda i: (i not in first, -lengths[i], i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        best, best_free = -1, seq_len + 1
        for r, f in enumerate(free):
            if lengths[i] <= f < best_free:
                best, best_free = r, f
        if best < 0:
            rows.append([i])
            free.append(seq_len - lengths[i])
        else:
            rows[best].append(i)
            free[best] -= lengths[i]
    return rows


def plan_micro_batches(row_patches: list[int], micro_batch_size: int) -> list[list[int]]:
    """Deal rows to ceil(R/B) micro-batches, heaviest first to the lightest one with room."""
    n_mb = -(-len(row_patches) // micro_batch_size)
    batches: list[list[int]] = [[] for _ in range(n_mb)]
    load = [0] * n_mb
    for r in sorted(range(len(row_patches)), key=lambda r: (-row_patches[r], r)):
        open_mb = [b for b in range(n_mb) if len(batches[b]) < micro_batch_size]
        b = min(open_mb, key=lambda b: (load[b], b))
        batches[b].append(r)
        load[b] += row_patches[r]
    return [sorted(b) for b in batches]


def merge(rows: list[list[EncodedSample]], cfg: PackingConfig, patch_dim: int) -> PackedBatch:
    B, S = cfg.micro_batch_size, cfg.seq_len
    k = max(1, max((len(r) for r in rows), default=1))
    tokens = np.full((B, S), cfg.pad_id, dtype=np.int64)
    labels = np.full((B, S), IGNORE_INDEX, dtype=np.int64)
    cu = np.zeros((B, k + 1), dtype=np.int32)
    num = np.zeros(B, dtype=np.int32)
    keys, sample_rows, pixels, grids, video_pixels, video_grids = [], [], [], [], [], []
    for r, row in enumerate(rows):
        pos = 0
        for j, s in enumerate(row):
            n = s.num_tokens
            tokens[r, pos:pos + n] = s.input_ids
            labels[r, pos:pos + n] = s.labels
            pos += n
            cu[r, j + 1] = pos
            keys.append(f"{s.shard}/{s.key}")
            sample_rows.append(r)
            pixels.extend(s.pixel_blocks)
            grids.append(s.image_grid_thw)
            if len(s.video_grid_thw):
                video_pixels.append(s.video_pixels)
                video_grids.append(s.video_grid_thw)
        cu[r, len(row) + 1:] = pos
        num[r] = len(row)
    return PackedBatch(
        tokens=tokens, labels=labels, loss_mask=(labels != IGNORE_INDEX).astype(np.float32),
        cu_seqlens=cu, num_samples=num,
        pixels=np.concatenate(pixels) if pixels else np.zeros((0, patch_dim), np.uint8),
        image_grid_thw=np.concatenate(grids) if grids else np.zeros((0, 3), np.int64),
        image_frame_hw=_frame_sizes([s for row in rows for s in row], patch_dim),
        sample_keys=keys, sample_rows=np.asarray(sample_rows, dtype=np.int32),
        sample_epochs=np.asarray([s.epoch for row in rows for s in row], dtype=np.int64),
        sample_ordinals=np.asarray([s.ordinal for row in rows for s in row], dtype=np.int64),
        video_pixels=np.concatenate(video_pixels) if video_pixels else np.zeros((0, patch_dim), np.uint8),
        video_grid_thw=np.concatenate(video_grids) if video_grids else np.zeros((0, 3), np.int64))


def _frame_sizes(samples: list[EncodedSample], patch_dim: int) -> np.ndarray | None:
    """The samples' ``image_frame_hw`` in turn (an image at its grid's size has that size), or None
    when all are."""
    if all(s.image_frame_hw is None for s in samples):
        return None
    patch = math.isqrt(patch_dim // 3)  # patch_dim is 3 * P * P
    return np.concatenate([s.image_frame_hw if s.image_frame_hw is not None
                           else grid_hw(s.image_grid_thw, patch) for s in samples]).astype(np.int64)


def plan_block(samples: list[EncodedSample], cfg: PackingConfig
               ) -> tuple[list[EncodedSample], list[list[int]], list[EncodedSample]]:
    """A block's samples -> (those that fit a row, their rows as indices into them, those too long).
    Samples that waited for a fuller row already are placed first, so the rest fill the rows around them."""
    fits = [s for s in samples if s.num_tokens <= cfg.seq_len]
    too_long = [s for s in samples if s.num_tokens > cfg.seq_len]
    waited = {j for j, s in enumerate(fits) if s.waited}
    rows = (plan_rows([s.num_tokens for s in fits], cfg.seq_len, waited) if cfg.pack
            else [[i] for i in range(len(fits))])
    return fits, rows, too_long


def hold_partial(fits: list[EncodedSample], rows: list[list[int]], micro_batch_size: int, seq_len: int = 0,
                 min_fill: float = 0.0, must_go: set[int] = frozenset()
                 ) -> tuple[list[list[int]], list[EncodedSample]]:
    """Rows that fill whole micro-batches, and the samples of the rest, to be packed with the next
    block's samples: the emptiest ``len(rows) % micro_batch_size`` rows, which would otherwise leave
    row slots empty, and the rows below ``min_fill`` of ``seq_len``, in whole micro-batches. Those
    wait up to half the block's rows (a micro-batch's worth at least), so data whose rows cannot
    fill never stalls and the samples carried stay bounded (about one block's new samples at most).
    Rows holding a sample of ``must_go`` (indices into ``fits``: samples that waited long enough)
    wait last for whole micro-batches and never for the floor."""
    tokens = [sum(fits[i].num_tokens for i in row) for row in rows]
    late = [any(i in must_go for i in row) for row in rows]
    order = sorted(range(len(rows)), key=lambda r: (late[r], tokens[r], -r))
    extra = len(rows) % micro_batch_size
    emptier = sum(1 for r in order[extra:] if not late[r] and tokens[r] < min_fill * seq_len)
    if emptier:
        most = max(micro_batch_size, (len(rows) - extra) // HELD_SHARE // micro_batch_size * micro_batch_size)
        extra += min(-(-emptier // micro_batch_size) * micro_batch_size, most)
    if not extra:
        return rows, []
    held = set(order[:extra])
    kept = [list(row) for r, row in enumerate(rows) if r not in held]
    waiting = [i for r in sorted(held) for i in rows[r]]
    _top_up(kept, waiting, [s.num_tokens for s in fits], seq_len, min_fill * seq_len, must_go)
    return kept, [fits[i] for i in waiting]


def _top_up(rows: list[list[int]], waiting: list[int], lengths: list[int], seq_len: int, floor: float,
            must_go: set[int] = frozenset()) -> None:
    """Rows that train below ``floor`` tokens (they hold a sample that waited long enough, or more rows
    were below the floor than may wait) are lifted to it, where the waiting samples allow, by the
    first of: taking waiting samples; one of their samples (not of ``must_go``) trading places with a
    longer waiting one; trading with another row that trains; passing a sample to another row and
    then taking waiting ones. In place; the samples taken train now instead of a block later."""
    for row in sorted(rows, key=lambda row: sum(lengths[i] for i in row)):
        filled = sum(lengths[i] for i in row)
        if filled >= floor:
            continue
        picked = _subset_to(waiting, lengths, floor - filled, seq_len - filled)
        if picked is not None:
            row.extend(picked)
            for w in picked:
                waiting.remove(w)
            continue
        trades = [(filled - lengths[i] + lengths[w], -i, -w, i, w) for i in row if i not in must_go
                  for w in waiting if floor <= filled - lengths[i] + lengths[w] <= seq_len]
        if trades:
            *_, out, into = max(trades)
            row[row.index(out)] = into
            waiting[waiting.index(into)] = out
            continue
        if not _trade_with_fuller_rows(row, filled, rows, lengths, seq_len, floor):
            _relay(row, filled, rows, waiting, lengths, seq_len, floor, must_go)


def _sums(pool: list[int], lengths: list[int], most: int) -> list[int]:
    """The subset sums up to ``most`` of each prefix of ``pool``'s lengths, each as the bits of one
    integer (the last is the whole pool's)."""
    mask = (1 << (most + 1)) - 1
    reach = [1]
    for i in pool:
        reach.append((reach[-1] | (reach[-1] << lengths[i])) & mask)
    return reach


def _subset_to(pool: list[int], lengths: list[int], low: float, high: int) -> list[int] | None:
    """Samples of ``pool`` whose lengths sum to the most that is at most ``high`` and at least ``low``
    (None where no such sum exists): the subset sums walked back."""
    if high < max(low, 0):
        return None
    if low <= 0:
        return []
    reach = _sums(pool, lengths, high)
    total = reach[-1].bit_length() - 1
    if total < low:
        return None
    picked = []
    for k in range(len(pool), 0, -1):
        if not reach[k - 1] >> total & 1:
            picked.append(pool[k - 1])
            total -= lengths[pool[k - 1]]
    return picked


def _trade_with_fuller_rows(row: list[int], filled: int, rows: list[list[int]], lengths: list[int],
                            seq_len: int, floor: float) -> bool:
    """One sample of ``row`` trades places with a longer one of another row that trains, where that
    lifts ``row`` to ``floor`` and leaves the other row at the floor or above (or as full as it was)."""
    best = None
    for other in rows:
        if other is row:
            continue
        theirs = sum(lengths[i] for i in other)
        for a in row:
            for b in other:
                gain = lengths[b] - lengths[a]
                if gain <= 0 or not floor <= filled + gain <= seq_len or theirs - gain < min(theirs, floor):
                    continue
                key = (filled + gain, theirs - gain, -a, -b)
                if best is None or key > best[0]:
                    best = (key, other, a, b)
    if best is None:
        return False
    _, other, a, b = best
    row[row.index(a)], other[other.index(b)] = b, a
    return True


def _relay(row: list[int], filled: int, rows: list[list[int]], waiting: list[int], lengths: list[int],
           seq_len: int, floor: float, must_go: set[int]) -> bool:
    """One sample of ``row`` moves to another row that trains, which gives up one of its samples (not
    of ``must_go``) to the waiting ones or has room, and ``row`` then fills from the waiting samples
    to ``floor``: for rows of samples that all waited long enough and leave a gap no waiting sample fits."""
    reach = _sums(waiting, lengths, seq_len)[-1]
    fills = {id(other): sum(lengths[i] for i in other) for other in rows}
    for a in sorted(row, key=lambda i: (-lengths[i], i)):
        low, high = math.ceil(floor - filled + lengths[a]), seq_len - filled + lengths[a]
        if high < low:
            continue
        for other in rows:
            if other is row:
                continue
            theirs = fills[id(other)]
            for b in [None, *[i for i in other if i not in must_go]]:
                after = theirs + lengths[a] - (lengths[b] if b is not None else 0)
                if not min(theirs, floor) <= after <= seq_len:
                    continue
                sums = reach if b is None else reach | (reach << lengths[b])
                if not sums >> low & ((1 << (high - low + 1)) - 1):  # no subset lands in the gap
                    continue
                picked = _subset_to(waiting + ([b] if b is not None else []), lengths, low, high)
                if picked is None:
                    continue
                row.remove(a)
                row.extend(picked)
                other.append(a)
                if b is not None:
                    other.remove(b)
                    waiting.append(b)
                for w in picked:
                    waiting.remove(w)
                return True
    return False


HELD_SHARE = 2
"""At most 1/HELD_SHARE of a block's rows wait for the next block for being below the fill floor:
1/4 left rows of 0.93-0.95 in the CPU trainer's stream (small samples in 1,024-token rows); 1/2 none."""


def micro_batches(fits: list[EncodedSample], rows: list[list[int]], cfg: PackingConfig, patch_dim: int
                  ) -> list[PackedBatch]:
    row_patches = [sum(fits[i].vision_patches for i in row) for row in rows]  # images' and videos' patches
    return [merge([[fits[i] for i in rows[r]] for r in mb], cfg, patch_dim)
            for mb in plan_micro_batches(row_patches, cfg.micro_batch_size)]


def pack(samples: list[EncodedSample], cfg: PackingConfig, patch_dim: int
         ) -> tuple[list[PackedBatch], list[EncodedSample]]:
    """All samples of one block -> micro-batches, plus the samples too long for a row."""
    fits, rows, too_long = plan_block(samples, cfg)
    return micro_batches(fits, rows, cfg, patch_dim), too_long


def padding_efficiency(samples: list[EncodedSample], seq_len: int) -> float:
    """Real-token fraction if every sample were padded to seq_len alone (the stock loaders' way)."""
    fits = [s.num_tokens for s in samples if s.num_tokens <= seq_len]
    return sum(fits) / max(1, len(fits) * seq_len)
