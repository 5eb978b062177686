"""Blends: several datasets drawn in fixed proportions, as one deterministic stream of work items.

``--blend laion=data/laion/*.tar:0.7,vqa=data/vqa/*.tar:0.3`` (a name is optional: ``A:0.7,B:0.3``
names the sources by their patterns), or a YAML file::

    sources:
      - {name: laion, shards: "data/laion/{000..099}.tar", weight: 0.7}
      - {name: vqa, shards: [data/vqa/a.tar, data/vqa/b.tar], weight: 0.3}

or an Energon metadataset (``splits: train: blend: [{path: ./coco, weight: 1}, ...]``, each path a
prepared dataset, read as ``datasvc.read.energon`` reads one).

An epoch of the blend holds ``per_epoch`` work items (default: every source's item count added up),
``round(weight x per_epoch)`` from each source (largest remainders, so they add up exactly). A
source reads its items from its own stream: its items shuffled, then shuffled again once used up,
and so on; epoch ``e`` takes the next stretch of that stream. A source with fewer items than its
share is repeated (every item before any twice), one with more is subsampled (the next epoch goes
on with the items this one did not reach). Within the epoch the sources are interleaved so that
every prefix holds each source's share to within one item (the error-minimizing order Megatron's
blended datasets use), then rank ``r`` of ``dp_size`` takes positions ``r, r + dp_size, ...``.

Everything here is a pure function of (sizes, weights, seed, epoch, rank): the same arguments give
the same order on any machine, which is what makes a blend resume exactly.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class BlendSource:
    name: str
    shards: tuple[str, ...]
    weight: float


def parse_blend(spec: str) -> list[BlendSource]:
    """``NAME=PATTERN:WEIGHT,...`` / ``PATTERN:WEIGHT,...``, or a ``.yaml``/``.yml`` file: ``sources:``
    as above, or an Energon metadataset (``splits: train: blend: [{path, weight}]``)."""
    if spec.endswith((".yaml", ".yml")):
        return _from_yaml(spec)
    sources = []
    for part in filter(None, (p.strip() for p in _top_level_parts(spec))):
        where, colon, weight = part.rpartition(":")
        if not colon or not where:
            raise ValueError(f"blend part {part!r} is not PATTERN:WEIGHT (e.g. data/laion/*.tar:0.7)")
        name, eq, pattern = where.partition("=")
        if not eq or "/" in name or "*" in name:
            name, pattern = where, where
        sources.append(BlendSource(name, (pattern,), _weight(weight, part)))
    return checked(sources)


def _top_level_parts(spec: str) -> list[str]:
    """Split on commas outside braces, so ``a/{0,1}.tar:1`` stays one part."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    return parts + [spec[start:]]


def _weight(text, where: str) -> float:
    try:
        w = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"blend weight of {where!r} is not a number: {text!r}") from None
    if not math.isfinite(w) or w < 0:
        raise ValueError(f"blend weight of {where!r} must be a finite number >= 0, not {text!r}")
    return w


def _from_yaml(path: str) -> list[BlendSource]:
    import yaml

    if not os.path.isfile(path):
        raise ValueError(f"blend file {path!r} does not exist")
    with open(path) as f:
        doc = yaml.safe_load(f)
    if isinstance(doc, dict) and "splits" in doc:
        return checked(_from_energon_metadataset(doc, path))
    entries = doc.get("sources") if isinstance(doc, dict) else doc
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a list of sources, or 'sources:' holding one")
    sources = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or "shards" not in e:
            raise ValueError(f"{path}: source {i} needs 'shards' (a pattern or a list) and 'weight'")
        shards = (e["shards"],) if isinstance(e["shards"], str) else tuple(str(s) for s in e["shards"])
        sources.append(BlendSource(str(e.get("name", shards[0])), shards, _weight(e.get("weight", 1.0), f"{path}#{i}")))
    return checked(sources)


def _from_energon_metadataset(doc: dict, path: str, split: str = "train") -> list[BlendSource]:
    """An Energon ``MetadatasetV2`` file: its split's ``blend`` of prepared datasets (``path``
    relative to the file, ``weight``, ``split_part``), or its single ``path``."""
    part = (doc.get("splits") or {}).get(split)
    if not isinstance(part, dict):
        raise ValueError(f"{path}: no '{split}' split under 'splits'")
    entries = part.get("blend", [part] if "path" in part else None)
    if not isinstance(entries, list):
        raise ValueError(f"{path}: split '{split}' needs 'blend' (a list of datasets) or 'path'")
    base = os.path.dirname(os.path.abspath(path))
    sources = []
    for i, e in enumerate(entries):
        where = f"{path}: {split} blend entry {i}"
        if not isinstance(e, dict) or not isinstance(e.get("path"), str):
            raise ValueError(f"{where} needs a 'path' (a prepared dataset directory)")
        if e["path"].endswith((".yaml", ".yml")) or "blend" in e:
            raise ValueError(f"{where}: nested metadatasets are not read; list their datasets here")
        root = os.path.normpath(os.path.join(base, e["path"]))
        sources.append(BlendSource(os.path.basename(root), (f"{root}:{e.get('split_part') or split}",),
                                   _weight(e.get("weight", 1.0), where)))
    return sources


def checked(sources: list[BlendSource]) -> list[BlendSource]:
    if not sources:
        raise ValueError("a blend needs at least one source")
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"blend source names repeat: {names}; name them (NAME=PATTERN:WEIGHT)")
    if sum(s.weight for s in sources) <= 0:
        raise ValueError("blend weights add up to 0: give at least one source a weight > 0")
    return sources


def quotas(weights, per_epoch: int) -> list[int]:
    """Items per source in an epoch: ``weight x per_epoch`` rounded by largest remainder."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * per_epoch
    out = np.floor(exact).astype(np.int64)
    short = per_epoch - int(out.sum())
    for i in np.argsort(-(exact - out), kind="stable")[:short]:
        out[i] += 1
    return [int(x) for x in out]


def interleave(counts: list[int]) -> np.ndarray:
    """Source id per position, ``counts[s]`` of each, every prefix within one item of its share."""
    total = sum(counts)
    share = np.asarray(counts, dtype=np.float64) / max(1, total)
    taken = np.zeros(len(counts), dtype=np.int64)
    out = np.empty(total, dtype=np.int64)
    for i in range(total):
        s = int(np.argmax(share * (i + 1) - taken))
        out[i] = s
        taken[s] += 1
    return out


def source_items(size: int, seed: int, source: int, start: int, count: int) -> np.ndarray:
    """Items ``start .. start+count`` of a source's stream (its items, reshuffled on each pass)."""
    out = []
    at = start
    while len(out) < count:
        rep, offset = divmod(at, size)
        perm = np.random.default_rng([seed, 7, source, rep]).permutation(size)
        taken = perm[offset:offset + count - len(out)]
        out.extend(int(x) for x in taken)
        at += len(taken)
    return np.asarray(out, dtype=np.int64)


def epoch_order(sizes: list[int], weights, seed: int, epoch: int,
                per_epoch: int | None = None) -> list[tuple[int, int]]:
    """(source, item within that source) for every position of the blend's epoch."""
    if any(n <= 0 for n, w in zip(sizes, weights) if w > 0):
        empty = [i for i, (n, w) in enumerate(zip(sizes, weights)) if w > 0 and n <= 0]
        raise ValueError(f"blend sources {empty} have weight but no items")
    per_epoch = sum(sizes) if per_epoch is None else per_epoch
    counts = quotas(weights, per_epoch)
    picks = [source_items(n, seed, s, epoch * q, q) if q else np.zeros(0, np.int64)
             for s, (n, q) in enumerate(zip(sizes, counts))]
    nxt = [0] * len(sizes)
    order = []
    for s in interleave(counts):
        order.append((int(s), int(picks[s][nxt[s]])))
        nxt[s] += 1
    return order


def rank_order(sizes: list[int], weights, seed: int, epoch: int, rank: int, dp_size: int,
               per_epoch: int | None = None) -> list[tuple[int, int]]:
    """The positions of the epoch this data-parallel rank takes, in delivery order."""
    return epoch_order(sizes, weights, seed, epoch, per_epoch)[rank::dp_size]


def per_source(order: list[tuple[int, int]], names: list[str]) -> dict[str, int]:
    """Items per source name in an order (what a summary reports next to the weights)."""
    counts = np.bincount([s for s, _ in order], minlength=len(names))
    return {name: int(c) for name, c in zip(names, counts)}


class BlendedItems:
    """A blend over concrete work items: what ``EpochPlan`` uses in place of its single shuffled list.

    ``sources``: (name, weight, that source's work items in a fixed order, e.g. by shard path then
    first sample). ``items(epoch, rank)`` is the rank's delivery order; ``source_of(item)`` names
    the source an item came from, for per-source accounting.
    """

    def __init__(self, sources: list[tuple[str, float, list]], seed: int, dp_size: int = 1,
                 per_epoch: int | None = None):
        self.names = [name for name, _, _ in sources]
        self.weights = [float(w) for _, w, _ in sources]
        self._items = [list(items) for _, _, items in sources]
        self.sizes = [len(items) for items in self._items]
        self.seed, self.dp_size = seed, dp_size
        self.per_epoch = sum(self.sizes) if per_epoch is None else per_epoch
        # By shard, not identity: the plan hands out copies of an item marked with their epoch, and a
        # restore reads single samples carried into its chain.
        self._source = {item.shard: name for name, _, items in sources for item in items}

    def items(self, epoch: int, rank: int) -> list:
        order = rank_order(self.sizes, self.weights, self.seed, epoch, rank, self.dp_size, self.per_epoch)
        return [self._items[s][i] for s, i in order]

    def items_per_epoch(self, rank: int) -> int:
        return len(range(rank, self.per_epoch, self.dp_size))

    def source_of(self, item) -> str:
        return self._source[item.shard]

    def shares(self, epoch: int, rank: int) -> dict[str, int]:
        """Items per source this rank gets in the epoch."""
        return per_source(rank_order(self.sizes, self.weights, self.seed, epoch, rank, self.dp_size,
                                     self.per_epoch), self.names)


class SourceCounts:
    """Per-source accounting of a blended stream, beside the stream's own: read, quarantined and
    skipped by rule from each work item's result, delivered from each micro-batch's sample keys.

    A producer holds one: ``add_item(item, result)`` where it merges a result, ``add_delivered(keys)``
    where it counts a micro-batch delivered, ``as_dict()`` in its stats; ``merge`` adds up ranks."""

    def __init__(self, blend: BlendedItems):
        from datasvc.rejects import Accounting

        self.blend = blend
        self.weights = dict(zip(blend.names, blend.weights))
        self._by_shard = {item.shard: blend.source_of(item) for items in blend._items for item in items}
        self.counts = {name: Accounting(max_log=0) for name in blend.names}

    def add_item(self, item, result) -> None:
        self.counts[self.blend.source_of(item)].merge(result.accounting)

    def add_delivered(self, sample_keys) -> None:
        for key in sample_keys:  # "shard/key", and a key may hold "/" too: the shard is a known prefix
            parts = key.split("/")
            for n in range(1, len(parts)):
                source = self._by_shard.get("/".join(parts[:n]))
                if source is not None:
                    self.counts[source].delivered += 1
                    break

    def totals(self) -> "SourceTotals":
        """A copy of the counts, without the blend (what a rank's stats carry)."""
        import copy

        return SourceTotals(dict(self.weights), copy.deepcopy(self.counts))


@dataclass(slots=True)
class SourceTotals:
    """Per blend source: its weight and its ``Accounting``; ranks add up with ``merge``."""

    weights: dict
    counts: dict

    def merge(self, other: "SourceTotals") -> None:
        from datasvc.rejects import Accounting

        for name, acct in other.counts.items():
            self.weights.setdefault(name, other.weights[name])
            self.counts.setdefault(name, Accounting(max_log=0)).merge(acct)

    def as_dict(self) -> dict:
        keep = ("read", "delivered", "quarantined", "skipped_by_rule")
        return {name: {"weight": self.weights[name], **{k: v for k, v in acct.as_dict().items() if k in keep}}
                for name, acct in self.counts.items()}


def blended_items(spec: str, items: list, seed: int, dp_size: int) -> BlendedItems:
    """The blend ``spec`` (``parse_blend``) over an epoch plan's work items, each item given to the
    source whose shard patterns list its shard (the first such source)."""
    from datasvc.read.shards import expand_shards

    sources = parse_blend(spec)
    owner: dict[str, int] = {}
    for s, source in enumerate(sources):
        for path in expand_shards(list(source.shards)):
            owner.setdefault(path, s)
    grouped: list[list] = [[] for _ in sources]
    for item in items:
        if item.shard not in owner:
            raise ValueError(f"shard {item.shard} is in no blend source: list it under one, or leave it out")
        grouped[owner[item.shard]].append(item)
    empty = [src.name for src, g in zip(sources, grouped) if src.weight > 0 and not g]
    if empty:
        raise ValueError(f"blend sources {empty} have weight but no samples")
    return BlendedItems([(src.name, src.weight, g) for src, g in zip(sources, grouped)], seed, dp_size)


def blend_patterns(spec: str) -> tuple[str, ...]:
    """Every shard pattern a blend names (what ``ServiceConfig.shards`` holds for it)."""
    return tuple(dict.fromkeys(p for source in parse_blend(spec) for p in source.shards))
