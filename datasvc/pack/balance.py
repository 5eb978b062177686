"""Vision-balanced global batches: which packed micro-batches each data-parallel rank trains.

Every optimizer step waits for the slowest DP rank. Within a rank the packer already spreads
vision patches over its micro-batches (``packing.plan_micro_batches``); across ranks nothing did,
and image-text data gives ranks micro-batches of very different vision cost (the tower's cost grows
with patches, its attention with patches squared per image). This module predicts the cost of a
micro-batch from its shape alone (``CostModel``) and deals one step's micro-batches of all ranks
so that the costliest rank is as cheap as possible (``assign``): longest processing time first,
each rank limited to its count, then pairwise swaps off the costliest rank.

``assign`` is a pure function of the costs and stable keys: every feeder computes the same answer
from the shared plan, so no coordinator is needed, a restart recomputes it exactly, and the ranks'
micro-batches stay disjoint (a partition of the step's). The coefficients are model facts; the
pipeline package provides them (``pipelines/<model>/cost.py``), found through ``registry``.
"""
from __future__ import annotations

import dataclasses
import heapq
from dataclasses import asdict, dataclass

import numpy as np

from datasvc.batch import PackedBatch


@dataclass(frozen=True, slots=True)
class MicroBatchShape:
    """What a micro-batch's cost depends on, known from image headers and token counts alone."""

    slot_tokens: int
    """Row slots, padding included (linear layers run on every position of a row)."""
    sample_lengths: tuple[int, ...]
    """Tokens of each packed sample (attention runs within a sample only)."""
    image_patches: tuple[int, ...]
    """Patches of each group the tower attends within: an image (h*w of its grid), or one temporal
    group of a video (t groups of h*w patches)."""
    key: str = ""
    """Stable identity (first sample's key, or rank/block/index) that breaks cost ties."""

    @property
    def patches(self) -> int:
        return int(sum(self.image_patches))


def shape_of(batch: PackedBatch, key: str | None = None) -> MicroBatchShape:
    """The shape of a packed micro-batch (its key defaults to its first sample's)."""
    lengths: list[int] = []
    for r, n in enumerate(batch.num_samples.tolist()):
        lengths.extend(np.diff(batch.cu_seqlens[r, : n + 1]).tolist())
    patches: list[int] = []
    for grid in (batch.image_grid_thw, getattr(batch, "video_grid_thw", None)):
        for t, h, w in np.asarray(grid if grid is not None else (), np.int64).reshape(-1, 3).tolist():
            patches.extend([h * w] * t)
    if key is None:
        key = batch.sample_keys[0] if batch.sample_keys else ""
    return MicroBatchShape(int(batch.tokens.size), tuple(int(n) for n in lengths), tuple(patches), key)


def shape_from_rows(rows: list[list[tuple[int, tuple[int, ...]]]], seq_len: int, key: str = "",
                    micro_batch_size: int | None = None) -> MicroBatchShape:
    """A micro-batch's shape from its rows, each a list of (sample tokens, sample image patches).
    A micro-batch always has ``micro_batch_size`` rows (empty ones are padding); default: len(rows)."""
    lengths = tuple(n for row in rows for n, _ in row)
    patches = tuple(p for row in rows for _, ps in row for p in ps)
    return MicroBatchShape((micro_batch_size or len(rows)) * seq_len, lengths, patches, key)


def pack_shapes(samples: list[tuple[int, tuple[int, ...]]], seq_len: int, micro_batch_size: int,
                key: str = "") -> list[tuple[MicroBatchShape, list[int]]]:
    """Samples given as (tokens, patches per image), all fitting a row, packed the way a block packs
    (``packing.plan_rows``, then ``plan_micro_batches``): each micro-batch's shape and the indices
    of its samples. Needs only what image headers and the encoder give, no pixels."""
    from datasvc.pack.packing import plan_micro_batches, plan_rows

    rows = plan_rows([n for n, _ in samples], seq_len)
    row_patches = [sum(sum(samples[i][1]) for i in row) for row in rows]
    out = []
    for k, mb in enumerate(plan_micro_batches(row_patches, micro_batch_size)):
        members = [i for r in mb for i in rows[r]]
        shape = shape_from_rows([[samples[i] for i in rows[r]] for r in mb], seq_len, f"{key}{k}", micro_batch_size)
        out.append((shape, members))
    return out


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Predicted seconds of one micro-batch's forward and backward on one DP rank.

    decoder = per_token * slot tokens + per_token_sq * sum(sample length^2)
    vision  = per_patch * patches + per_patch_sq * sum(image patches^2)

    ``step_overhead`` is paid once a step by every rank (optimizer, gradient reduction), so it
    does not move the balance but does dilute the straggler ratio. ``source`` says where the
    numbers came from (commit, hardware, files, fit error).
    """

    decoder_per_token: float
    decoder_per_token_sq: float = 0.0
    vision_per_patch: float = 0.0
    vision_per_patch_sq: float = 0.0
    step_overhead: float = 0.0
    name: str = ""
    source: str = ""

    def __post_init__(self):
        values = (self.decoder_per_token, self.decoder_per_token_sq, self.vision_per_patch,
                  self.vision_per_patch_sq, self.step_overhead)
        if any(v < 0 or not np.isfinite(v) for v in values):
            raise ValueError(f"cost coefficients must be finite and >= 0, got {values}")

    def decoder(self, shape: MicroBatchShape) -> float:
        sq = float(np.square(np.asarray(shape.sample_lengths, dtype=np.float64)).sum())
        return self.decoder_from_sums(shape.slot_tokens, sq)

    def vision(self, shape: MicroBatchShape) -> float:
        p = np.asarray(shape.image_patches, dtype=np.float64)
        return self.vision_from_sums(float(p.sum()), float(np.square(p).sum()))

    def decoder_from_sums(self, slot_tokens: float, sample_tokens_sq: float) -> float:
        """The decoder's seconds from a micro-batch's (or a step's) slot tokens and the sum of its
        samples' tokens squared: what a trainer's step record holds."""
        return self.decoder_per_token * slot_tokens + self.decoder_per_token_sq * sample_tokens_sq

    def vision_from_sums(self, patches: float, patches_sq: float) -> float:
        """The tower's seconds from its patches and the sum of each attention unit's patches squared."""
        return self.vision_per_patch * patches + self.vision_per_patch_sq * patches_sq

    def cost(self, shape: MicroBatchShape) -> float:
        return self.decoder(shape) + self.vision(shape)

    def costs(self, shapes: list[MicroBatchShape]) -> np.ndarray:
        return np.asarray([self.cost(s) for s in shapes], dtype=np.float64)

    def as_dict(self) -> dict:
        return asdict(self)


# ---- assignment ---------------------------------------------------------------------------------
def _check(n_items: int, dp: int, per_rank: int) -> None:
    if dp < 1 or per_rank < 1:
        raise ValueError(f"dp ({dp}) and micro-batches per rank ({per_rank}) must be >= 1")
    if n_items != dp * per_rank:
        raise ValueError(f"a step of {dp} ranks x {per_rank} micro-batches needs {dp * per_rank} micro-batches, "
                         f"got {n_items}: every rank must pack the same global step")


def _order(costs: np.ndarray, keys: list[str] | None) -> list[int]:
    """Costliest first; equal costs by key, then by position, so the order never depends on hashing."""
    keys = keys if keys is not None else [""] * len(costs)
    return sorted(range(len(costs)), key=lambda i: (-float(costs[i]), keys[i], i))


def lpt(costs: np.ndarray, dp: int, per_rank: int, keys: list[str] | None = None) -> list[list[int]]:
    """Longest processing time first with a count limit: each micro-batch, costliest first, goes to
    the cheapest rank that still has room (lowest rank index on ties)."""
    costs = np.asarray(costs, dtype=np.float64)
    _check(len(costs), dp, per_rank)
    ranks: list[list[int]] = [[] for _ in range(dp)]
    heap = [(0.0, r) for r in range(dp)]  # (load, rank) of ranks with room; tuples order ties by rank
    for i in _order(costs, keys):
        load, r = heapq.heappop(heap)
        ranks[r].append(i)
        if len(ranks[r]) < per_rank:
            heapq.heappush(heap, (load + float(costs[i]), r))
    return ranks


def _best_swap(costs: np.ndarray, owner: np.ndarray, load: np.ndarray, top: int, mine: np.ndarray
               ) -> tuple[int, int] | None:
    """The swap of one micro-batch of rank ``top`` with one of another rank that leaves the larger
    of the two ranks' loads lowest, if any beats ``top``'s load: (index in top, index of the other).
    Moving d = c_i - c_j > 0 gives loads (L_top - d, L_j + d); ties go to the first pair in order."""
    d = costs[mine][:, None] - costs[None, :]
    other = load[owner][None, :]
    worse = np.maximum(load[top] - d, other + d)
    ok = (d > 0) & (owner[None, :] != top) & (worse < load[top] * (1 - 1e-12))
    if not ok.any():
        return None
    a, j = np.unravel_index(int(np.argmin(np.where(ok, worse, np.inf))), worse.shape)
    return int(mine[a]), int(j)


def refine(costs: np.ndarray, ranks: list[list[int]], max_rounds: int | None = None,
           tolerance: float = 1e-3) -> list[list[int]]:
    """Swap micro-batches off the costliest rank while a single swap lowers it (each swap takes the
    pair that ends lowest), until the costliest rank is within ``tolerance`` of the mean. Counts
    per rank never change; each swap lowers the sum of squared loads, so it ends."""
    costs = np.asarray(costs, dtype=np.float64)
    ranks = [list(r) for r in ranks]
    owner = np.empty(len(costs), dtype=np.int64)
    for r, items in enumerate(ranks):
        owner[items] = r
    load = np.asarray([costs[r].sum() for r in ranks])
    goal = float(load.mean()) * (1 + tolerance)
    for _ in range(max_rounds if max_rounds is not None else 50 * len(ranks) + 100):
        top = int(np.argmax(load))
        if load[top] <= goal:
            break
        found = _best_swap(costs, owner, load, top, np.asarray(ranks[top]))
        if found is None:
            break
        i, j = found
        other = int(owner[j])
        ranks[top][ranks[top].index(i)] = j
        ranks[other][ranks[other].index(j)] = i
        owner[i], owner[j] = other, top
        moved = costs[i] - costs[j]
        load[top] -= moved
        load[other] += moved
    return ranks


def assign(costs, dp: int, per_rank: int, keys: list[str] | None = None) -> list[list[int]]:
    """One step's micro-batches (all ranks', ``dp * per_rank`` of them) -> the indices each rank
    trains, in a stable order (ascending index), ``per_rank`` each, disjoint and complete.

    LPT then swap refinement. A pure function of ``costs`` and ``keys``: recomputing it (another
    feeder, or after a restart) gives the identical assignment.
    """
    # Whole nanoseconds: sums of integers are exact in float64, so every machine agrees bit for bit.
    costs = np.rint(np.asarray(costs, dtype=np.float64) * 1e9)
    return [sorted(r) for r in refine(costs, lpt(costs, dp, per_rank, keys))]


def unbalanced(dp: int, per_rank: int) -> list[list[int]]:
    """The assignment without balancing: rank r trains its own micro-batches, in the order the
    global step lists them (rank 0's first)."""
    return [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(dp)]


def rank_costs(costs, ranks: list[list[int]], step_overhead: float = 0.0) -> np.ndarray:
    costs = np.asarray(costs, dtype=np.float64)
    return np.asarray([costs[r].sum() + step_overhead for r in ranks])


def straggler_ratio(rank_cost) -> float:
    """max / mean rank cost of one step (1.0 is perfect balance)."""
    rank_cost = np.asarray(rank_cost, dtype=np.float64)
    mean = float(rank_cost.mean()) if rank_cost.size else 0.0
    return float(rank_cost.max()) / mean if mean > 0 else 1.0


# ---- one step, end to end -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StepBalance:
    """The outcome for one step: the assignment and the predicted seconds with and without it."""

    ranks: tuple[tuple[int, ...], ...]
    step_s: float
    step_s_unbalanced: float
    straggler_ratio: float
    straggler_ratio_unbalanced: float

    def as_dict(self) -> dict:
        return {"step_s": self.step_s, "step_s_unbalanced": self.step_s_unbalanced,
                "straggler_ratio": self.straggler_ratio,
                "straggler_ratio_unbalanced": self.straggler_ratio_unbalanced}


def balance_step(shapes: list[MicroBatchShape], dp: int, model: CostModel) -> StepBalance:
    """``shapes``: the step's micro-batches of all ranks, rank 0's first, the same count each (what
    every feeder derives from the shared plan). Returns which of them each rank trains."""
    if dp < 1 or len(shapes) % dp:
        raise ValueError(f"{len(shapes)} micro-batches do not split evenly over {dp} DP ranks")
    per_rank = len(shapes) // dp
    costs = model.costs(shapes)
    ranks = assign(costs, dp, per_rank, [s.key for s in shapes])
    before = rank_costs(costs, unbalanced(dp, per_rank), model.step_overhead)
    after = rank_costs(costs, ranks, model.step_overhead)
    return StepBalance(tuple(tuple(r) for r in ranks), float(after.max()), float(before.max()),
                       straggler_ratio(after), straggler_ratio(before))


def balance_streams(streams: list, per_rank: int, model: CostModel):
    """The integration point for feeders. ``streams[r]`` iterates rank r's planned micro-batches
    as (shape, payload) from the same step on, as every feeder can derive them from the shared
    plan (shapes come from image headers and token counts, so no rank's pixels are needed).
    Yields, per step, each rank's payloads to train: ``out[r]`` is rank r's ``per_rank`` of them.
    Stops at the first step some rank cannot fill (the end of its data)."""
    dp = len(streams)
    iters = [iter(s) for s in streams]
    while True:
        step: list = []
        for it in iters:
            got = [x for _, x in zip(range(per_rank), it)]
            if len(got) < per_rank:
                return
            step.extend(got)
        shapes = [shape for shape, _ in step]
        ranks = assign(model.costs(shapes), dp, per_rank, [s.key for s in shapes])
        yield [[step[i][1] for i in r] for r in ranks]


def predicted_straggler(shapes: list[MicroBatchShape], dp: int, per_rank: int, model: CostModel,
                        balance: bool) -> dict:
    """The profiler's prediction over a stream of micro-batches: consecutive global steps of
    ``dp * per_rank`` micro-batches (rank r's own are its slice), mean and worst straggler ratio
    and mean step seconds, balanced or not. A tail shorter than a step is left out."""
    n = dp * per_rank
    ratios, steps = [], []
    for s in range(len(shapes) // n):
        step = balance_step(shapes[s * n:(s + 1) * n], dp, model)
        ratios.append(step.straggler_ratio if balance else step.straggler_ratio_unbalanced)
        steps.append(step.step_s if balance else step.step_s_unbalanced)
    if not ratios:
        return {"straggler_ratio": None, "straggler_ratio_max": None, "step_s": None, "steps": 0}
    return {"straggler_ratio": float(np.mean(ratios)), "straggler_ratio_max": float(np.max(ratios)),
            "step_s": float(np.mean(steps)), "steps": len(ratios)}


def profile_straggler(shapes: list[MicroBatchShape], dp: int, per_rank: int, model: CostModel, balance: bool,
                      steps: int = 16, seed: int = 0) -> dict:
    """The profiler's prediction for ``dp`` ranks from one rank's measured micro-batches: ``steps``
    global steps, each ``dp * per_rank`` micro-batches drawn (seeded, with replacement) from
    ``shapes``, so any DP size can be judged from a short profile. Mean and worst straggler ratio
    and mean predicted step seconds, with balancing or without."""
    if not shapes:
        return {"straggler_ratio": None, "straggler_ratio_max": None, "step_s": None, "steps": 0}
    rng = np.random.default_rng([seed, dp, per_rank])
    drawn = []
    for s in range(steps):
        picks = rng.integers(len(shapes), size=dp * per_rank)
        drawn.extend(dataclasses.replace(shapes[int(i)], key=f"{s}/{j}") for j, i in enumerate(picks))
    out = predicted_straggler(drawn, dp, per_rank, model, balance)
    return {**out, "dp": dp, "micro_batches_per_rank": per_rank, "balance": balance,
            "measured_micro_batches": len(shapes), "cost_model": model.source}


def cost_model(pipeline: str, preset: str | None = None, calibration: str | None = None, **options) -> CostModel:
    """The pipeline's cost model (its fitted coefficients), found by name; ``options`` are the
    pipeline's own (a model's overrides, say)."""
    from datasvc.registry import pipeline_module

    module = pipeline_module(pipeline)
    if not hasattr(module, "cost_model"):
        raise ValueError(f"pipeline {pipeline!r} has no cost model; balancing needs one (cost_model in its package)")
    return module.cost_model(preset=preset, calibration=calibration, **options)
