"""Feed any Megatron-Bridge ``ConfigContainer`` from vlmfeed: the plug-in for a recipe of your own.

    from trainer.megatron.provider import feed_from_vlmfeed, pretrain

    cfg = qwen3_vl_8b_peft_1gpu_h100_bf16_config()          # any Bridge recipe, or a container of yours
    feed = feed_from_vlmfeed(cfg, ["shards/*.tar"])         # its dataset becomes vlmfeed's stream
    pretrain(cfg, feed.forward_step(), callbacks=feed.callbacks())

What feeding a container means, the same for ``python -m trainer.run`` and a user's recipe:
  - the dataset: ``VlmfeedDataProvider`` (``dataloader_type="external"``) hands Bridge this rank's
    stream; its loader state goes into Bridge's checkpoints (``save_state``/``restore_state``);
  - the data geometry comes from the container: sequence length (``model.seq_length``), rows per
    micro-batch (``train.micro_batch_size``) and the DP size (world size over TP x PP x CP), through
    ``datasvc.training``, so the rows a rank receives are the rows the model was configured for;
  - the rank mapping: ``trainer.workers.RankLayout`` (Megatron's order, checked against Bridge's own
    DP group when the datasets are built): every rank of a DP replica receives the same micro-batches;
  - the forward step: ``trainer.megatron.step.PackedForwardStep`` (several samples a row, THD
    attention, MRoPE restarted per sample), whose loss is per token (the container is set so);
  - the service's owner: under ``trainer.run`` the driver starts ``datasvc.DataService`` and each Ray
    rank is handed its iterator (``feed_from_stream``); in a recipe run by ``torchrun``, global rank 0
    starts it when Bridge builds the datasets, every rank attaches to its DP rank's feeder, and
    rank 0 shuts it down when training ends (``feed_from_vlmfeed``; the service dies with rank 0's
    process otherwise, as Ray ends the actors a driver started).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import uuid
from dataclasses import dataclass

import torch
from megatron.bridge.data.base import DatasetBuildContext, DatasetProvider
from megatron.bridge.training.callbacks import Callback
from megatron.bridge.training.config import ConfigContainer

from trainer.megatron.metrics import ForwardClock, MetricsSink, StepMetrics, TimedForwardStep, TimedIterator
from trainer.megatron.step import PackedForwardStep, to_stock_batch
from trainer.workers import RankLayout

log = logging.getLogger("vlmfeed.megatron")


# ------------------------------------------------------------------------------------------------
# Who starts the data service, and each rank's stream
# ------------------------------------------------------------------------------------------------
class ServiceOwner:
    """Global rank 0 starts the data service (one feeder per DP rank, with its preprocessing actors)
    when Bridge builds the datasets; every rank attaches to its DP rank's feeder. All ranks must join
    one Ray cluster: with more than one rank, start it first (``ray start --head``) and set
    ``RAY_ADDRESS``; one rank alone starts a local one."""

    def __init__(self, data_cfg, run: str | None = None):
        self.data_cfg = data_cfg
        self._run = run
        self.service = None  # rank 0's DataService
        self.client = None
        self.data_stats = None  # the service's ServiceStats, read by rank 0 before it shuts down

    @property
    def run(self) -> str:
        """Names the service's actors: the same on every rank of one job, unique to the job."""
        if self._run is None:
            addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            self._run = f"bridge-{addr}-{port}" if addr and port else f"bridge-{uuid.uuid4().hex[:8]}"
        return self._run

    def open(self, layout: RankLayout, device: str | None):
        import ray

        from datasvc import attach, connect
        from datasvc.service.client import DataService

        if layout.world > 1 and not (ray.is_initialized() or os.environ.get("RAY_ADDRESS")):
            raise RuntimeError(f"{layout.world} ranks need one Ray cluster to share the data service: start it "
                               "first (`ray start --head --node-ip-address 127.0.0.1`) and run the ranks with "
                               "RAY_ADDRESS=127.0.0.1:6379")
        connect()
        if layout.rank == 0:
            self.service = DataService(self.data_cfg, run=self.run)
            self.client = self.service.client(layout.dp_rank, layout.consumer, device=device)
        else:
            self.client = attach(self.data_cfg, layout.dp_rank, layout.consumer, run=self.run, device=device)
        log.info("rank %d reads DP rank %d's stream of data service %s (consumer %d of %d)", layout.rank,
                 layout.dp_rank, self.run, layout.consumer, self.data_cfg.consumers_per_replica)
        return self.client

    def close(self) -> None:
        """Rank 0 reads the service's accounting while every feeder still lives; every rank lets go
        of its feeder; then rank 0 ends the service."""
        if self.service is not None:
            try:
                self.data_stats = self.service.stats()
            except Exception as exc:  # the accounting is a report; training is already done
                log.warning("data service accounting not read: %s", exc)
        if self.client is not None:
            self.client.close()
            self.client = None
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()
        if self.service is not None:
            self.service.shutdown()
            self.service = None


class ReleaseService(Callback):
    """Closes the stream when training ends (after Bridge's last checkpoint, which saved its state)."""

    def __init__(self, owner: ServiceOwner):
        self.owner = owner

    def on_train_end(self, context) -> None:
        self.owner.close()


def rank_layout(container: ConfigContainer, rank: int, world_size: int) -> RankLayout:
    """Where ``rank`` sits in the container's parallel grid (Megatron's order: tp, cp, dp, pp)."""
    m = container.model
    return RankLayout(rank, world_size, m.tensor_model_parallel_size or 1, m.context_parallel_size or 1,
                      m.pipeline_model_parallel_size or 1)


# ------------------------------------------------------------------------------------------------
# The dataset Bridge sees
# ------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class VlmfeedDataProvider(DatasetProvider):
    """``dataloader_type="external"``: Megatron-Bridge passes the stream through untouched (wrapped
    only in its RerunDataIterator) and saves its loader state with each checkpoint. No validation or
    test split unless one is attached; the data service owns sharding (one stream per DP rank,
    identical across the TP/PP/CP ranks of a replica)."""

    dataloader_type: str = "external"
    num_workers: int = 0
    persistent_workers: bool = False
    pin_memory: bool = False
    data_sharding: bool = False
    seq_length: int = 4096  # read by a few Bridge helpers that look at cfg.dataset.seq_length
    skip_getting_attention_mask_from_dataset: bool = True  # stock qwen3_vl_step reads it

    # Where Bridge reads the loader states from on resume; None: beside the checkpoint it loads.
    dataloader_load: str | None = None

    # Streams and their owner are runtime objects, kept off the dataclass fields so the config stays
    # printable and Bridge's override machinery leaves them alone.
    def attach(self, iterator: TimedIterator | None, valid=None) -> "VlmfeedDataProvider":
        """Streams made elsewhere (``trainer.run``: the driver owns the service)."""
        object.__setattr__(self, "_iterator", iterator)
        object.__setattr__(self, "_valid", valid)
        return self

    def serve(self, owner: ServiceOwner, iterator: TimedIterator, container: ConfigContainer) -> "VlmfeedDataProvider":
        """A stream ``owner`` opens when Bridge builds the datasets, into ``iterator``."""
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_container", container)
        return self.attach(iterator)

    @property
    def iterator(self) -> TimedIterator | None:
        return getattr(self, "_iterator", None)

    @property
    def owner(self) -> ServiceOwner | None:
        return getattr(self, "_owner", None)

    def build_datasets(self, context: DatasetBuildContext):
        if self.iterator is None:
            raise RuntimeError("VlmfeedDataProvider has no stream: feed the container with feed_from_vlmfeed "
                               "or feed_from_stream")
        if self.owner is not None and self.iterator.inner is None:
            self.iterator.inner = self._open(context)
        return self.iterator, getattr(self, "_valid", None), None

    def _open(self, context: DatasetBuildContext):
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        layout = rank_layout(self._container, rank, world)
        check_geometry(self._container, self.owner.data_cfg, world)
        dp_group = getattr(context.pg_collection, "dp", None)
        if dp_group is not None and torch.distributed.get_rank(dp_group) != layout.dp_rank:
            raise RuntimeError(f"rank {rank}: Megatron puts it at DP rank {torch.distributed.get_rank(dp_group)}, "
                               f"vlmfeed's RankLayout (order tp, cp, dp, pp) at {layout.dp_rank}; the two must agree "
                               "so that every rank of a replica reads the same stream")
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else None
        return self.owner.open(layout, device=device)


# ------------------------------------------------------------------------------------------------
# Feeding a container
# ------------------------------------------------------------------------------------------------
class VlmfeedFeed:
    """A container fed by vlmfeed, on this rank: the forward step Bridge calls and the callbacks
    that record each step (tokens/s, data wait, peak memory) and release the stream."""

    def __init__(self, container: ConfigContainer, padded: bool = False):
        self.container = container
        self.provider: VlmfeedDataProvider = container.dataset
        self.padded = padded
        self.clock = ForwardClock()
        self.metrics: StepMetrics | None = None

    @property
    def iterator(self) -> TimedIterator:
        return self.provider.iterator

    @property
    def data_cfg(self):
        return self.provider.owner.data_cfg if self.provider.owner else None

    @property
    def records(self) -> list[dict]:
        return self.metrics.records if self.metrics else []

    def forward_step(self):
        """Packed rows: ``PackedForwardStep``; padded (one sample a row): Bridge's stock ``qwen3_vl_step``."""
        if self.padded:
            from megatron.bridge.models.qwen_vl import qwen3_vl_step

            return TimedForwardStep(qwen3_vl_step.forward_step, self.clock)
        return TimedForwardStep(PackedForwardStep(), self.clock)

    def callbacks(self, metrics_sink: MetricsSink = None, samples_path: str | None = None) -> list[Callback]:
        """Per-step records (the last rank writes them to ``metrics_sink``), then the stream's release."""
        self.metrics = StepMetrics(self.iterator, metrics_sink, self.clock, samples_path=samples_path)
        owner = self.provider.owner
        return [self.metrics] + ([ReleaseService(owner)] if owner is not None else [])


def feed_from_vlmfeed(container: ConfigContainer, shards=(), *, world_size: int | None = None,
                      run: str | None = None, padded: bool = False, **data_options) -> VlmfeedFeed:
    """Make ``container`` train on vlmfeed's stream of ``shards`` (paths, globs, ``s3://`` URLs; none:
    the bundled photos). The data config is ``datasvc.for_training``'s, at the container's sequence
    length, micro-batch size and DP size (``world_size``: WORLD_SIZE, else 1); ``data_options`` set
    any other of its arguments (``max_pixels``, ``decode=DecodeConfig(...)``, ``pool=PoolConfig(...)``,
    ...); a ``balance`` section gets the container's micro-batches per step. Global rank 0 starts the
    service when Bridge builds the datasets. Set the container's geometry first."""
    from datasvc.config import BalanceConfig
    from datasvc.training import for_training, micro_batches_per_step

    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    layout = rank_layout(container, 0, world)
    if world % layout.model_parallel:
        raise ValueError(f"world size {world} is not a multiple of TP x CP x PP = {layout.model_parallel}")
    mbs, gbs = container.train.micro_batch_size, container.train.global_batch_size
    balance = dataclasses.replace(data_options.pop("balance", BalanceConfig()),
                                  micro_batches_per_step=micro_batches_per_step(gbs, mbs, layout.dp_size))
    data_cfg = for_training(shards, **{
        "device": "gpu", "seq_len": container.model.seq_length, "micro_batch_size": mbs,
        "dp_size": layout.dp_size, "consumers_per_replica": layout.model_parallel, "pack": not padded,
        "balance": balance, **data_options})
    check_geometry(container, data_cfg, world)
    iterator = TimedIterator(None, adapt=to_stock_batch if padded else None)
    container.dataset = VlmfeedDataProvider(seq_length=container.model.seq_length)
    container.dataset.serve(ServiceOwner(data_cfg, run), iterator, container)
    use_packed_rows(container, padded)
    return VlmfeedFeed(container, padded)


def feed_from_stream(container: ConfigContainer, iterator: TimedIterator, valid: TimedIterator | None = None,
                     *, padded: bool = False) -> VlmfeedFeed:
    """Make ``container`` train on streams made elsewhere (``trainer.run``: the driver started the
    service and handed this rank its iterator, wrapped in a ``TimedIterator``)."""
    container.dataset = VlmfeedDataProvider(seq_length=container.model.seq_length).attach(iterator, valid)
    use_packed_rows(container, padded)
    return VlmfeedFeed(container, padded)


def use_packed_rows(container: ConfigContainer, padded: bool = False) -> None:
    """The model-side settings the packed forward step relies on."""
    m = container.model
    # Packed rows hold different numbers of supervised tokens; averaging per token over the whole
    # global batch weighs every token equally (and CP requires it for Qwen3-VL anyway). Gradients are
    # then summed and divided by the global token count: averaging inside the collective would divide
    # by the DP size a second time.
    m.calculate_per_token_loss = True
    container.ddp.average_in_collective = False
    # With PP, stages exchange activations of shape [tokens, 1, hidden] for the flat THD stream, not
    # [seq_len, mbs, hidden]; variable_seq_lengths makes the P2P layer send the shape first.
    m.variable_seq_lengths = (m.pipeline_model_parallel_size or 1) > 1 and not padded


def check_geometry(container: ConfigContainer, data_cfg, world_size: int) -> None:
    """The data service must make the rows the container trains on: same sequence length, rows per
    micro-batch and DP size. Raises ValueError naming each difference."""
    dp = rank_layout(container, 0, world_size).dp_size
    pairs = {"sequence length (model.seq_length)": (container.model.seq_length, data_cfg.seq_len),
             "rows per micro-batch (train.micro_batch_size)": (container.train.micro_batch_size,
                                                               data_cfg.micro_batch_size),
             "DP size (world size / TP x CP x PP)": (dp, data_cfg.dp_size)}
    wrong = [f"{name}: container {mine}, data service {theirs}" for name, (mine, theirs) in pairs.items()
             if mine != theirs]
    if wrong:
        raise ValueError("the data service was configured for other rows than the container trains on: "
                         + "; ".join(wrong) + " (set the container's geometry before feed_from_vlmfeed)")


# ------------------------------------------------------------------------------------------------
# Running Bridge's loop on this install
# ------------------------------------------------------------------------------------------------
def without_missing_kernels(model_provider) -> None:
    """Megatron's non-TE linear layers (the output layer) implement gradient-accumulation fusion only
    through APEX's fused_weight_gradient_mlp_cuda and refuse to build without it; Bridge's model
    providers turn the fusion on by default, so keep it only where that extension exists."""
    model_provider.gradient_accumulation_fusion = (bool(model_provider.gradient_accumulation_fusion)
                                                   and has_apex_wgrad_fusion())


def has_apex_wgrad_fusion() -> bool:
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def pretrain(container: ConfigContainer, forward_step, callbacks: list[Callback] | None = None) -> None:
    """Megatron-Bridge's ``pretrain(container, forward_step, callbacks)``, with two adjustments for
    this install. Its dataset-helper compile is skipped (``skip_dataset_helper_compile``). And
    ``megatron.bridge.training.pretrain`` imports nvidia-resiliency-ext at module level, whose
    registry release (0.4.1) predates what megatron-core 0.19 needs (>= 0.6, and 0.4.1 breaks its
    import); where it is missing this runs the steps pretrain runs without in-process restart:
    setup, train, finish."""
    skip_dataset_helper_compile()
    try:
        from megatron.bridge.training.pretrain import pretrain as bridge_pretrain
    except ImportError:
        bridge_pretrain = None
    if bridge_pretrain is not None:
        bridge_pretrain(container, forward_step, callbacks=callbacks)
        return

    from megatron.bridge.data.utils import get_dataset_provider
    from megatron.bridge.training.callbacks import normalize_callbacks
    from megatron.bridge.training.config import runtime_config_update
    from megatron.bridge.training.setup import setup
    from megatron.bridge.training.state import GlobalState
    from megatron.bridge.training.train import _finish_train, train as bridge_train

    runtime_config_update(container)
    state = GlobalState()
    state.cfg = container
    manager = normalize_callbacks(callbacks)
    out = setup(state, get_dataset_provider(container.dataset), callback_manager=manager)
    if out.state.train_state.do_train:
        bridge_train(forward_step, out.model, out.optimizer, out.scheduler, out.train_data_iterator,
                     out.valid_data_iterator, out.state, out.checkpoint_manager, out.pg_collection,
                     callback_manager=manager)
    _finish_train(out.state, out.checkpoint_manager)


def skip_dataset_helper_compile() -> None:
    """Megatron-Bridge's initialisation runs ``make`` in megatron/core/datasets to build the C++ index
    helpers of Megatron's own datasets, and exits the process when that fails. The megatron-core wheel
    ships those helpers prebuilt but without the Makefile, so ``make`` always fails there; our data
    arrives through ``dataloader_type="external"`` and never uses them, so skip the compile."""
    import megatron.bridge.training.initialize as bridge_init

    bridge_init.compile_helpers = lambda: log.info("dataset index helpers not compiled: external data iterator")
