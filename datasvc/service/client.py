"""The per-rank end of the data service: an iterator of micro-batches for one trainer rank, and
``DataService``, which starts the feeders in the driver and hands out these clients.

A background thread (``datasvc.stream.prefetch``) keeps ``prefetch`` micro-batches in flight: it
fetches refs from the rank's feeder (``datasvc.service.feeder_link``, which restarts a feeder that
died), reads the (read-only, zero-copy) arrays from the object store, copies them into torch
tensors (pinned and moved to the GPU when there is one) and expands uint8 pixel rows to float
``pixel_values`` in patch order (``datasvc.stream.tensors``). ``save_state``/``restore_state`` give exact resume.
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass

import ray

from datasvc.config import ServiceConfig
from datasvc.read.shards import expand_shards
from datasvc.rejects import Accounting
from datasvc.remainder import TrainedSamples
from datasvc.service.cluster import head_address, unreachable_head
from datasvc.service.feeder import DataServiceError, End, EndOfData, FeederStats, feeder_name, start_feeder
from datasvc.service.feeder_link import FeederLink, no_feeder
from datasvc.service.locality import release_budgets
from datasvc.stream.loaderstate import LoaderState
from datasvc.stream.prefetch import Prefetcher
from datasvc.stream.rankstats import StreamTotals
from datasvc.stream.tensors import batch_tensors


class DataClient:
    """A rank's micro-batches in order. ``output="torch"``: ``TrainBatch``es of tensors on ``device`` with
    the model's ``pixel_values`` (images the actors left unresized resized here, on that device);
    ``"numpy"``: the ``PackedBatch`` itself, whose pixels ``vision.to_pixel_values(...,
    frames_hw=batch.image_frame_hw)`` makes into ``pixel_values``."""

    def __init__(self, cfg: ServiceConfig, dp_rank: int, consumer: int = 0, *, run: str = "vlmfeed",
                 device: str | None = None, output: str = "torch", pixel_dtype: str = "float32",
                 start: LoaderState | dict | None = None):
        """``start``: the saved state the service started this rank's feeder from
        (``DataService(restore=...)``); the client takes the stream up there."""
        if not 0 <= dp_rank < cfg.dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {cfg.dp_size})")
        if output not in ("torch", "numpy"):
            raise ValueError("output must be 'torch' or 'numpy'")
        self.cfg, self.dp_rank, self.consumer, self.run = cfg, dp_rank, consumer, run
        self.device, self.output, self.pixel_dtype = device, output, pixel_dtype
        self._spec = cfg.model_layout().vision
        self._next_step = 0
        self._last_pos: dict | None = None
        self._fetched_pos: dict | None = None
        self._ahead: Prefetcher | None = None
        self._halt = threading.Event()  # closed: nothing fetched, no feeder restarted
        self._link = FeederLink(cfg, run, dp_rank, consumer, self._halt, started=bool(start))
        self._dataset: dict | None = None  # the shard files the feeder planned over, for saved states
        self._head = head_address()  # noted now: once the head is lost Ray may no longer say it
        self.trained = TrainedSamples()  # every sample of the micro-batches returned, by epoch
        self.wait_s = 0.0
        self._materialize_s = 0.0
        self.delivered = 0
        if start:
            self._take_up(start if isinstance(start, LoaderState) else LoaderState.from_dict(start))

    # ---- iterator ---------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self):
        if self._ahead is None:
            if self._halt.is_set():
                raise DataServiceError(f"the client of dp_rank {self.dp_rank} was closed or its service shut down; "
                                       "make a new client, or call restore_state to resume")
            self._ahead = Prefetcher(self._fetch_next, self._next_step, self.cfg.prefetch, f"client-{self.dp_rank}",
                                     name_error=self._named_cause)
        t0 = time.perf_counter()
        try:
            batch, pos, marks = self._ahead.get()
        except BaseException:
            self._ahead = None  # its thread ended with the error
            raise
        finally:
            self.wait_s += time.perf_counter() - t0
        self._last_pos = pos
        self.trained.add(*marks)
        self.delivered += 1
        return batch

    @property
    def last_position(self) -> dict | None:
        """Position (epoch, block, batch, step) of the micro-batch last returned."""
        return self._last_pos

    @property
    def transfer_s(self) -> float:
        """Seconds spent reading micro-batches from the object store and making them tensors."""
        return self._link.transfer_s + self._materialize_s

    def halt(self) -> None:
        """Stop fetching, at once and for good: a feeder that dies after this is not restarted."""
        self._halt.set()
        if self._ahead is not None:
            self._ahead.halt()

    def close(self) -> None:
        """Halt, wait for the fetch thread, and end the feeder this client started (on restore or
        recovery), which would otherwise live, holding its actors' CPUs, as long as this object."""
        self.halt()
        if self._ahead is not None:
            self._ahead.halt(join_s=5)
        self._ahead = None
        self._link.release()

    # ---- state ------------------------------------------------------------------------------
    def save_state(self) -> dict:
        """Where this rank stands, in the form a checkpoint stores (``LoaderState.as_dict``): restoring
        continues with the micro-batch after the last one returned by ``__next__`` (prefetched ones are
        fetched again)."""
        return self._state_after(self._last_pos).as_dict()

    def restore_state(self, state: dict | LoaderState) -> None:
        state = state if isinstance(state, LoaderState) else LoaderState.from_dict(state)
        if state.dp_rank not in (-1, self.dp_rank):
            raise DataServiceError(f"state belongs to dp_rank {state.dp_rank}, not {self.dp_rank}")
        if (self._ahead is None and not self._halt.is_set()
                and self._state_after(self._last_pos).as_dict() == state.as_dict()):
            return  # its feeder was started at this state (``start``) and nothing was fetched since
        self.close()
        self._halt.clear()
        self._reopen(state)
        self._take_up(state)

    def _take_up(self, state: LoaderState) -> None:
        """Continue from ``state`` on a feeder already started there."""
        self._next_step = state.position.step
        self.trained = state.trained
        self._fetched_pos = self._last_pos = state.last_delivered

    def _state_after(self, pos: dict | None) -> LoaderState:
        """The state that resumes right after the micro-batch at ``pos`` (None: from the start)."""
        if self._dataset is None:  # asked once per feeder; a feeder that is gone leaves the state without it
            self._dataset = self._link.dataset()
        return LoaderState.after(pos, self.cfg.fingerprint(), self.dp_rank, self.trained, self._dataset,
                                 self.cfg.remainder or None)

    def _reopen(self, state: LoaderState) -> None:
        self._dataset = None  # the new feeder's plan (re-planned, with replan_on_dataset_change)
        self._link.reopen(state)

    # ---- background fetch ---------------------------------------------------------------------
    def _fetch_next(self, step: int) -> tuple:
        """Micro-batch ``step`` as the trainer takes it, with its position and its samples' marks
        (run on the prefetch thread)."""
        reply = self._link.fetch(step, resume=lambda: self._state_after(self._fetched_pos))
        if isinstance(reply, End):
            if reply.error:
                raise DataServiceError(f"data service, dp_rank {self.dp_rank}: {reply.error}")
            raise EndOfData(f"dp_rank {self.dp_rank}: epochs={self.cfg.epochs} exhausted after "
                            f"{reply.steps} micro-batches; raise epochs or lower train_iters")
        packed, pos = reply
        marks = (packed.sample_epochs, packed.sample_ordinals)
        t0 = time.perf_counter()
        batch = packed if self.output == "numpy" else batch_tensors(packed, self._spec, self.device, self.pixel_dtype)
        self._materialize_s += time.perf_counter() - t0
        self._fetched_pos = pos
        self._next_step = step + 1
        return batch, pos, marks

    def _named_cause(self, exc: BaseException) -> BaseException:
        """``exc``, or when the Ray head is gone, an error that says so and how to go on."""
        if isinstance(exc, (EndOfData, KeyboardInterrupt)) or (head := unreachable_head(address=self._head)) is None:
            return exc
        error = DataServiceError(f"dp_rank {self.dp_rank}: the Ray head at {head} is unreachable, so the cluster "
                                 f"is lost; start a new one and resume with restore_state() of the last "
                                 f"save_state()")
        error.__cause__ = exc
        return error


def attach(cfg: ServiceConfig, dp_rank: int, consumer: int = 0, *, run: str = "vlmfeed", wait_s: float = 120.0,
           **kwargs) -> DataClient:
    """The client of ``dp_rank`` in a process other than the one that started the service (a
    ``torchrun`` rank): waits up to ``wait_s`` for the feeder that ``DataService(cfg, run=run)``
    starts, then fails naming what to check. ``kwargs`` go to ``DataClient``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            ray.get_actor(feeder_name(run, dp_rank))
            return DataClient(cfg, dp_rank, consumer, run=run, **kwargs)
        except ValueError:
            if time.monotonic() > deadline:
                raise DataServiceError(no_feeder(run, dp_rank, wait_s)) from None
            time.sleep(0.25)


@dataclass(slots=True)
class ServiceStats:
    """Every rank's ``FeederStats`` and their totals; ``as_dict()`` is what a run summary writes."""

    ranks: list[FeederStats]

    def totals(self) -> StreamTotals:
        totals = StreamTotals()
        for r in self.ranks:
            totals.add(r.stream)
        return totals

    @property
    def accounting(self) -> Accounting:
        return self.totals().accounting

    def as_dict(self) -> dict:
        totals = self.totals()
        moved = {k: sum(getattr(r.placement, k) for r in self.ranks) for k in ("bytes_same_node", "bytes_cross_node")}
        return {"ranks": [r.as_dict() for r in self.ranks],
                "accounting": {**totals.accounting.as_dict(), "in_flight": totals.in_flight},
                **({"sources": totals.sources.as_dict()} if totals.sources else {}), **moved}


class DataService:
    """Starts one feeder per DP rank (on ``nodes[rank]``, the node of the ranks it feeds, when given and
    it fits there); hands out per-rank clients; aggregates stats."""

    def __init__(self, cfg: ServiceConfig, run: str = "vlmfeed", restore: dict[int, dict | LoaderState] | None = None,
                 nodes: dict[int, str] | None = None):
        expand_shards(list(cfg.shards))  # fail fast, in the driver, when nothing matches
        try:  # fail fast, in the driver, on an unknown pipeline or option
            cfg.model_layout()
        except TypeError as exc:
            raise ValueError(f"pipeline {cfg.pipeline!r} does not take these options: {exc}") from None
        self.cfg = cfg
        self.run = run
        # saved states arrive in their checkpoint form (``DataClient.save_state``)
        self.restore = {r: st if isinstance(st, LoaderState) else LoaderState.from_dict(st)
                        for r, st in (restore or {}).items()}
        self.feeders = [start_feeder(cfg, run, r, self.restore.get(r), (nodes or {}).get(r))
                        for r in range(cfg.dp_size)]
        self._clients: weakref.WeakSet = weakref.WeakSet()

    def client(self, dp_rank: int, consumer: int = 0, **kwargs) -> DataClient:
        client = DataClient(self.cfg, dp_rank, consumer, run=self.run, start=self.restore.get(dp_rank), **kwargs)
        self._clients.add(client)
        return client

    def stats(self) -> ServiceStats:
        return ServiceStats(ray.get([self._live_feeder(r).stats.remote() for r in range(self.cfg.dp_size)]))

    def _live_feeder(self, rank: int):
        """The feeder of ``rank`` now (a client may have restarted it since this service started it)."""
        try:
            return ray.get_actor(feeder_name(self.run, rank))
        except ValueError:
            return self.feeders[rank]

    def shutdown(self) -> None:
        # Halt this service's clients first: a client whose call fails on a killed feeder would
        # otherwise restart it, as it must after a crash, and the restarted feeder would outlive us.
        clients = list(self._clients)
        for c in clients:
            c.halt()
        for f in self.feeders:
            try:
                ray.get(f.shutdown.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(f)
        for c in clients:
            c.close()
        release_budgets(self.run)
