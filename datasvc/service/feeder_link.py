"""One client's line to its rank's feeder: the calls that fetch a micro-batch, and the restart of a
feeder that died (with its node, say) at the state the client hands over.

``DataClient`` keeps the stream's order and state; this keeps the Ray side of it, where a call fails
with Ray's exception types and a lost feeder is made again.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, ObjectLostError, RayActorError

from datasvc.batch import PackedBatch
from datasvc.config import ServiceConfig
from datasvc.pack.epoch import Position
from datasvc.service.feeder import DataServiceError, End, feeder_name, start_feeder
from datasvc.service.ready import Handout
from datasvc.service.locality import this_node
from datasvc.stream.loaderstate import LoaderState

ATTEMPTS = 3  # a feeder restarted twice and lost again is not a passing fault


class FeederLink:
    """Calls to the feeder of (``run``, ``dp_rank``) as consumer ``consumer``. ``halted``, once set,
    means the feeder is meant to be gone: a failed call then raises instead of restarting it."""

    def __init__(self, cfg: ServiceConfig, run: str, dp_rank: int, consumer: int, halted: threading.Event,
                 started: bool = False):
        """``started``: the service started this rank's feeder for this client (at a restored state)."""
        self.cfg, self.run, self.dp_rank, self.consumer = cfg, run, dp_rank, consumer
        self._halted = halted
        self._owned = None  # a feeder this link started: it lives as long as the handle
        self._reached = started  # a feeder answered, or was started for this client: a missing one has died
        self.node: str | None = None  # told to the feeder, which counts the bytes that cross nodes
        self.transfer_s = 0.0
        self._handle = None

    def feeder(self):
        """The feeder's handle: looked up by name once, and again after a call to it failed."""
        if self._handle is None:
            self._handle = self._lookup()
        return self._handle

    def _lookup(self):
        return ray.get_actor(feeder_name(self.run, self.dp_rank))

    def fetch(self, step: int, resume: Callable[[], LoaderState]) -> tuple[PackedBatch, dict] | End:
        """Micro-batch ``step`` and its position, or the feeder's ``End``. A micro-batch whose feeder
        died after handing out its ref is lost with it: the feeder restarts at ``resume()`` (the state
        after the last micro-batch fetched) and makes it again."""
        for attempt in range(ATTEMPTS):
            handout = self._call_next(step, resume)
            if isinstance(handout, End):
                return handout
            t0 = time.perf_counter()
            try:
                return ray.get(handout.ref), handout.position.as_dict()
            except ObjectLostError as exc:  # OwnerDiedError among them
                if self._halted.is_set() or attempt == ATTEMPTS - 1:
                    raise DataServiceError(f"micro-batch {step} of dp_rank {self.dp_rank} was lost: {exc}") from exc
                self.reopen(resume())
            finally:
                self.transfer_s += time.perf_counter() - t0
        raise AssertionError("unreachable")

    def _call_next(self, step: int, resume: Callable[[], LoaderState]) -> Handout | End:
        for attempt in range(ATTEMPTS):
            try:
                self.node = self.node or this_node()
                reply = ray.get(self.feeder().next_batch.remote(self.consumer, step, self.node))
                self._reached = True
                return reply
            except (ActorDiedError, ActorUnavailableError, RayActorError, ValueError) as exc:
                stale, self._handle = self._handle, None
                if self._halted.is_set():  # the service was shut down: the feeder is meant to be gone
                    raise DataServiceError(f"client of dp_rank {self.dp_rank} was halted") from exc
                if isinstance(exc, ValueError) and not self._reached and self._owned is None:
                    raise DataServiceError(no_feeder(self.run, self.dp_rank)) from None  # never had one
                if attempt == ATTEMPTS - 1:
                    raise DataServiceError(f"feeder of dp_rank {self.dp_rank} is gone and could not be "
                                           f"restarted: {exc}") from exc
                if not self._replaced(stale):  # else another consumer of the replica restarted it already
                    self.reopen(resume())
        raise AssertionError("unreachable")

    def _replaced(self, stale) -> bool:
        """Whether the feeder's name now belongs to another actor than ``stale`` (a handle that failed)."""
        try:
            return stale is not None and self._lookup()._actor_id != stale._actor_id
        except ValueError:
            return False

    def dataset(self) -> dict | None:
        """The shard files the feeder planned over; None when the feeder is gone."""
        try:
            return ray.get(self.feeder().stats.remote(), timeout=60).dataset
        except (RayActorError, ValueError, ray.exceptions.GetTimeoutError):
            self._handle = None
            return None

    def reopen(self, state: LoaderState) -> None:
        """Consumer 0 of a replica restarts the feeder at ``state``; the others wait for it."""
        self._handle = None
        if self.consumer == 0:
            self._restart(state)
        else:
            self._await(state.position)

    def _restart(self, state: LoaderState) -> None:
        try:
            ray.kill(self._lookup())
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the name frees once the actor is gone
                try:
                    self._lookup()
                    time.sleep(0.1)
                except ValueError:
                    break
        except ValueError:
            pass
        # Non-detached actors die with their last handle: this link owns the new feeder. It goes on
        # this process's node (the old one's node may be the one that was lost).
        self._owned = self._handle = start_feeder(self.cfg, self.run, self.dp_rank, state, node=this_node())

    def _await(self, start: Position) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if ray.get(self._lookup().stats.remote()).stream.start == start:
                    return
            except (ValueError, RayActorError):
                pass
            time.sleep(0.2)
        raise DataServiceError(f"feeder of dp_rank {self.dp_rank} was not restarted at {start}")

    def release(self) -> None:
        """End the feeder this link started, which would otherwise hold its actors' CPUs as long as
        this object lives."""
        if self._owned is not None:
            ray.kill(self._owned)
            self._owned = None


def no_feeder(run: str, dp_rank: int, waited_s: float | None = None) -> str:
    namespace = ray.get_runtime_context().namespace
    waited = f" after {waited_s:.0f} s" if waited_s else ""
    return (f"no feeder for dp_rank {dp_rank} of run {run!r} in Ray namespace {namespace!r}{waited}: start "
            f"DataService(cfg, run={run!r}) in one process of the job and keep it alive, and connect() every "
            "process to the same cluster (RAY_ADDRESS) and namespace")
