"""Data service configuration: one typed dataclass, checked when built."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Literal

from datasvc.flags import flag
from datasvc.read.blend import blend_patterns, parse_blend
from datasvc.read.filters import Rule
from datasvc.usage import UserError

# Decoded frames on transparent huge pages (where the kernel grants them on request), freed blocks up
# to 32 MiB kept on the heap instead of unmapped, and up to 64 MiB of free heap kept: a new frame
# reuses memory instead of faulting in fresh 4 KiB pages (about 6,000 faults per 8-16 MP photo).
ACTOR_MALLOC_TUNABLES = ":".join(("glibc.malloc.hugetlb=1", "glibc.malloc.mmap_threshold=33554432",
                                  "glibc.malloc.trim_threshold=67108864"))
_TUNABLE = re.compile(r"glibc\.[a-z_]+\.[a-z_]+=[0-9A-Za-z_]+")


# A field that must match for a saved loader state to restore exactly (``ServiceConfig.fingerprint``);
# IF_SET: only once it differs from its default, so states saved before the option existed still restore.
RESUME = {"resume": "always"}
RESUME_IF_SET = {"resume": "if_set"}


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


class InvalidConfig(ValueError, UserError):
    """Settings of the data service that cannot work together, each named with its fix."""


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """Where and how the preprocessing actors decode images and video."""

    device: Literal["cpu", "gpu"] = field(default="cpu", metadata=flag(
        "where the preprocessing actors decode images (gpu: DALI's hardware JPEG decoder)", name="--decode"))
    threads: int = field(default=1, metadata=flag("decode threads (CPUs) per preprocessing actor",
                                                  name="--decode-threads"))
    """Decode threads (and CPU slots) per preprocessing actor."""
    cpu_jpeg_decoder: Literal["dali", "libjpeg-turbo"] = field(default="dali", metadata=flag(
        "with --decode cpu: libjpeg-turbo decodes JPEGs at a reduced DCT scale (faster on photos well above the "
        "pixel cap)"))
    """With ``device="cpu"``: "libjpeg-turbo" decodes RGB and grayscale JPEGs with libjpeg-turbo at
    the reduced DCT scale that still covers the target (``datasvc.media.jpegscale``), which DALI cannot;
    faster on photos well above the pixel cap, within the same HF exactness. Other images: DALI."""
    resize_on: Literal["rank", "actor"] = field(default="rank", metadata=flag(
        "with --decode cpu: where an image's last resize runs; rank: on the trainer's GPU with HF's own resize, "
        "sparing the preprocessing actors nearly half their CPU time"))
    """With ``device="cpu"``, where a CPU-decoded image's last resize runs. "rank": the actor sends
    the decoded frame (when within ``decode.RANK_RESIZE_MAX_AREA`` of its target's pixels) and the
    client resizes it on the rank's device with HF's own resize, as it makes ``pixel_values``. At
    the default cap that resize is nearly a decode's CPU time in the actor and a few microseconds of
    a GPU (docs/benchmarks/cpu-preprocessing-per-core.md). "actor": the actor resizes every image
    and sends rows at the grid's size."""
    gpu_share: float = 0.25
    """GPU fraction each preprocessing actor requests when ``device`` is "gpu"."""

    def problems(self) -> list[str]:
        out = []
        if self.device not in ("cpu", "gpu"):
            out.append(f"decode device must be 'cpu' or 'gpu', not {self.device!r}")
        if self.threads < 1:
            out.append(f"decode threads must be >= 1, not {self.threads}")
        if self.cpu_jpeg_decoder not in ("dali", "libjpeg-turbo"):
            out.append(f"cpu_jpeg_decoder={self.cpu_jpeg_decoder!r}: use 'dali' or 'libjpeg-turbo'")
        if self.resize_on not in ("rank", "actor"):
            out.append(f"resize_on={self.resize_on!r}: use 'rank' or 'actor'")
        if self.device == "gpu" and not 0 < self.gpu_share <= 1:
            out.append(f"decode gpu_share must be in (0, 1], not {self.gpu_share}")
        return out


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """One DP rank's preprocessing actors: how many, their processes, and how far ahead they run."""

    min_actors: int = 1
    max_actors: int = 2
    """Preprocessing actors per data-parallel rank, autoscaled between these."""
    node_data_cpus: int | None = None
    """CPUs of one node that the preprocessing actors of all feeders on it may hold together (each
    feeder's ``min_actors`` always start). None: the node's CPUs less one per GPU (the trainer ranks')."""
    max_batches_ahead: int = 4
    max_bytes_ahead: int = 1 << 30
    """Per DP rank: produced-but-unconsumed micro-batches are bounded by both."""
    autoscale_interval_s: float = 2.0
    actor_malloc_tunables: str = ACTOR_MALLOC_TUNABLES
    """glibc's allocator settings (``GLIBC_TUNABLES``) for the preprocessing actors' processes. The
    default spares a large photo's decode most of its page faults: 1.05-1.34x less CPU per image in
    the actors on 8-16 MP photos (1.34x on an H200 host), about the same on 0.3-4 MP
    (``python -m datasvc.tools.bench.allocator``; docs/benchmarks/cpu-preprocessing-per-core.md).
    Empty: glibc's defaults. Entries of a GLIBC_TUNABLES that the cluster's processes were
    started with win over these."""
    actor_hook: tuple = ()
    """``("module:factory", {keyword: value})``: each preprocessing actor calls ``factory(**keywords)``
    once when it starts and the callable it returns with every work item before processing it (for
    tracing, or the soak bench's real faults: ``datasvc.tools.bench.faults``). Empty: none."""

    def problems(self) -> list[str]:
        out = []
        if not 1 <= self.min_actors <= self.max_actors:
            out.append(f"need 1 <= min_actors ({self.min_actors}) <= max_actors ({self.max_actors})")
        if self.node_data_cpus is not None and self.node_data_cpus < 1:
            out.append(f"node_data_cpus must be >= 1 or None (the node's CPUs less its GPUs), "
                       f"not {self.node_data_cpus}")
        if self.max_batches_ahead < 1:
            out.append("max_batches_ahead must be >= 1")
        bad = [t for t in self.actor_malloc_tunables.split(":") if t and not _TUNABLE.fullmatch(t)]
        if bad:
            out.append(f"actor_malloc_tunables: {bad} are not glibc tunables "
                       f"(glibc.NAMESPACE.NAME=VALUE, joined by ':'); use '' for glibc's defaults")
        if self.actor_hook and not (len(self.actor_hook) == 2 and ":" in str(self.actor_hook[0])
                                    and isinstance(self.actor_hook[1], dict)):
            out.append(f"actor_hook must be ('module:factory', {{keywords}}), not {self.actor_hook!r}")
        return out

    def actor_env(self) -> dict[str, str]:
        """Environment variables of the preprocessing actors' processes."""
        tunables = ":".join(t for t in (self.actor_malloc_tunables, os.environ.get("GLIBC_TUNABLES", "")) if t)
        return {"GLIBC_TUNABLES": tunables} if tunables else {}


@dataclass(frozen=True, kw_only=True)
class BudgetConfig:
    """What one sample may hold, and how many bad samples a run tolerates before it stops."""

    max_images_per_sample: int = 64
    max_text_bytes: int = 256 * 1024
    max_consecutive_rejections: int | None = 1000
    """The run stops, naming the top reasons, after this many quarantined samples in a row
    (Energon's failure tolerance). None: no limit."""
    max_rejection_rate: float | None = 0.5
    """The run stops, naming the top reasons, once more than this share of the samples read were
    quarantined (after ``rejection_rate_min_samples``). None: no limit."""
    rejection_rate_min_samples: int = 1000
    decoded_bytes_budget: int = 2 << 30
    """Per preprocessing actor: decoded pixels held at once, estimated from image headers before
    any decode. A work item is decoded in parts that fit; a sample over it is rejected
    ``sample_too_large``."""
    encoded_bytes_budget: int = 512 << 20
    """Per preprocessing actor: encoded bytes (image, video and text members) held at once, from the
    tar headers before anything is read. A work item is read in parts that fit; a sample over it is
    rejected ``sample_too_large`` unread (a 2 MB .tar.gz can hold GBs of padded members)."""

    def problems(self) -> list[str]:
        out = []
        if self.max_consecutive_rejections is not None and self.max_consecutive_rejections < 1:
            out.append("max_consecutive_rejections must be >= 1 or None (no limit)")
        if self.max_rejection_rate is not None and not 0 < self.max_rejection_rate <= 1:
            out.append(f"max_rejection_rate must be in (0, 1] or None, not {self.max_rejection_rate}")
        if self.decoded_bytes_budget < 1 << 20:
            out.append(f"decoded_bytes_budget must be >= 1 MiB, not {self.decoded_bytes_budget}")
        if self.encoded_bytes_budget < 1 << 20:
            out.append(f"encoded_bytes_budget must be >= 1 MiB, not {self.encoded_bytes_budget}")
        return out


@dataclass(frozen=True, kw_only=True)
class BalanceConfig:
    """Dealing each optimizer step's micro-batches across DP ranks by predicted cost
    (``datasvc.stream.balanced``): every feeder plans every rank's micro-batches from image headers,
    then decodes only its share."""

    enabled: bool = field(default=False, metadata=flag(
        "deal each optimizer step's micro-batches across DP ranks by predicted cost, so no rank straggles (needs "
        "GBS / (DP x MBS) >= 2)", name="--balance-dp", action="store_true"))
    micro_batches_per_step: int = 1
    """GBS / (DP x MBS): the micro-batches a DP rank trains per optimizer step (what is dealt)."""
    cost: dict = field(default_factory=dict)
    """Options of the pipeline's ``cost_model`` (``preset``, ``calibration``)."""
    sizes_index: str = field(default="", metadata=flag(
        "with --balance-dp: a directory every feeder can read, holding each shard's sample sizes so its headers are "
        "read once per job, not once per DP rank (`vlmfeed sizes` fills it ahead; feeders add what is missing)",
        name="--sizes-index", metavar="DIR"))
    """A directory all feeders can read (``datasvc.pack.sizes``) where each shard's per-sample sizes
    are kept, so a shard's headers are read once per job instead of once per feeder.
    Empty: every feeder plans from headers."""

    def problems(self) -> list[str]:
        if self.micro_batches_per_step < 1 or (self.enabled and self.micro_batches_per_step < 2):
            return [f"micro_batches_per_step={self.micro_batches_per_step}: balancing deals a step's micro-batches "
                    "between ranks, so set it to GBS / (DP x MBS) >= 2 (with 1 there is nothing to deal)"]
        return []


@dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """The data service: what it reads and for which model and the stream's geometry (top level), and
    one section per component (``decode``, ``pool``, ``budget``, ``balance``) that its owner takes."""

    shards: tuple[str, ...] = field(metadata=RESUME)
    """Shard paths, globs or brace patterns."""
    pipeline: str = field(default="qwen3vl", metadata=RESUME)
    pipeline_options: dict = field(default_factory=dict, metadata=RESUME)
    """Passed to the pipeline's ``build`` (e.g. max_pixels, tokenizer)."""
    seq_len: int = field(default=4096, metadata=RESUME)
    micro_batch_size: int = field(default=1, metadata=RESUME)
    pack: bool = field(default=True, metadata=RESUME)
    """Several samples per row; False pads one sample per row (for comparison with stock loaders)."""
    dp_size: int = field(default=1, metadata=RESUME)
    consumers_per_replica: int = 1
    """Ranks of one data-parallel replica (TP x PP x CP): each receives every micro-batch."""
    epochs: int | None = 1
    """None streams forever."""
    seed: int = field(default=0, metadata=RESUME)
    samples_per_item: int = field(default=16, metadata=RESUME)
    """Samples per work item (the unit an actor processes and redoes after a failure)."""
    items_per_block: int = field(default=4, metadata=RESUME)
    """Work items shuffled and packed together; also the granularity of exact resume."""
    blocks_span_epochs: bool = field(default=False, metadata=RESUME_IF_SET)
    """Cut blocks from the epochs laid end to end: an epoch then ends without a part-empty block.
    Positions count blocks from the stream's start; each epoch still holds each sample once."""
    remainder: dict | None = field(default=None, metadata=RESUME_IF_SET | {"as": "_remainder_digest"})
    """Where a resume at another data-parallel size took the stream up (``datasvc.remainder``): the
    first epoch, and the samples of each epoch under way already trained, which the plan leaves out."""
    chain_blocks: int = field(default=1, metadata=RESUME_IF_SET)
    """Blocks packed as a chain: rows that would leave a block's last micro-batch part empty are held
    and packed with the next block's samples, up to the end of a chain of this many blocks (and at
    the end of each epoch unless blocks span epochs). 1: every block packs on its own. Restoring
    mid-chain re-reads the chain's earlier blocks, so this bounds the cost of a restore."""
    prefetch: int = 2
    """Micro-batches a client fetches ahead on a background thread."""
    replan_on_dataset_change: bool = False
    """Restore a saved loader state even though the shard files changed since (added, removed,
    rewritten): the stream is re-planned over the files as they are now, and a warning says so.
    Without it such a restore fails, naming what changed."""
    filters: tuple[str, ...] = field(default=(), metadata=RESUME_IF_SET)
    """Rules a sample must pass, e.g. ("similarity>=0.28", "status==success", "image_min_side>=64");
    the others are counted as skipped_by_rule under the rule (grammar: datasvc.read.filters)."""
    blend: str = field(default="", metadata=RESUME_IF_SET | {"as": "_blend_sources"})
    """Datasets drawn in fixed proportions: ``NAME=PATTERN:WEIGHT,...`` or a YAML file (grammar:
    datasvc.read.blend). ``shards`` may then be left empty: it becomes every pattern the blend names."""
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig, metadata=RESUME_IF_SET | {
        "as": "_balance_identity", "key": "balance_dp"})

    def __post_init__(self):
        if isinstance(self.shards, str):
            object.__setattr__(self, "shards", (self.shards,))
        else:
            object.__setattr__(self, "shards", tuple(self.shards))
        problems = []
        if self.blend:
            try:
                object.__setattr__(self, "shards", self.shards or blend_patterns(self.blend))
            except ValueError as exc:
                problems.append(str(exc))
        if not self.shards:
            problems.append("shards is empty: pass at least one path, glob or brace pattern")
        if self.dp_size < 1 or self.consumers_per_replica < 1:
            problems.append("dp_size and consumers_per_replica must be >= 1")
        if self.samples_per_item < 1 or self.items_per_block < 1:
            problems.append("samples_per_item and items_per_block must be >= 1")
        if self.chain_blocks < 1:
            problems.append(f"chain_blocks must be >= 1 (1 packs every block on its own), not {self.chain_blocks}")
        if self.epochs is not None and self.epochs < 1:
            problems.append("epochs must be >= 1 or None (stream forever)")
        if self.seq_len < 16 or self.micro_batch_size < 1:
            problems.append("seq_len must be >= 16 and micro_batch_size >= 1")
        object.__setattr__(self, "filters", (self.filters,) if isinstance(self.filters, str) else tuple(self.filters))
        for rule in self.filters:
            try:
                Rule.parse(rule)
            except ValueError as exc:
                problems.append(str(exc))
        for name, kind in (("decode", DecodeConfig), ("pool", PoolConfig), ("budget", BudgetConfig),
                           ("balance", BalanceConfig)):
            section = getattr(self, name)
            if isinstance(section, kind):
                problems += section.problems()
            else:
                problems.append(f"{name} must be a {kind.__name__}, not {type(section).__name__} ({section!r})")
        if problems:
            raise InvalidConfig("invalid data service config: " + "; ".join(problems))

    def model_layout(self):
        """The model's vision layout and pad id (``datasvc.registry.PipelineLayout``) at this config's
        pipeline options: what a stage needs of the model without its tokenizer."""
        from datasvc.registry import get_layout

        return get_layout(self.pipeline, **self.pipeline_options)

    def build_pipeline(self):
        """The model's ``Pipeline`` (tokenizer, chat format, vision and video specs) at this config's
        options; each process that tokenizes builds its own."""
        from datasvc.registry import get_pipeline

        return get_pipeline(self.pipeline, **self.pipeline_options)

    def fingerprint(self) -> str:
        """What must match for a saved loader state to be restored exactly: the fields marked ``RESUME``
        (and ``RESUME_IF_SET`` ones that differ from their defaults), each as its ``as`` method gives it."""
        fields = {}
        for f in dataclasses.fields(self):
            when = f.metadata.get("resume")
            value = getattr(self, f.name)
            if when is None or (when == "if_set" and value == _default(f)):
                continue
            value = getattr(self, f.metadata["as"])() if "as" in f.metadata else value
            if value is not None:
                fields[f.metadata.get("key", f.name)] = value
        blob = json.dumps(fields, sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()[:16]

    def _remainder_digest(self) -> str:
        return hashlib.sha1(json.dumps(self.remainder, sort_keys=True).encode()).hexdigest()

    def _blend_sources(self) -> list:
        """The sources as parsed, so an edited blend file is a different stream."""
        return [[s.name, list(s.shards), s.weight] for s in parse_blend(self.blend)]

    def _balance_identity(self) -> list | None:
        """Balanced dealing changes the stream only when on (its index directory never does)."""
        b = self.balance
        return [b.micro_batches_per_step, b.cost] if b.enabled else None
