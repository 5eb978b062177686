"""Per-step metrics of the Megatron-Bridge backend: how long the trainer blocks on data
(``TimedIterator``) and one record per optimizer step (``StepMetrics``), in the same names as the
CPU development path (``data_wait_share``, ``tokens_per_s``, ``real_token_fraction``...)."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from megatron.bridge.training.callbacks import Callback, CallbackContext
from megatron.bridge.training.state import GlobalState

from datasvc.batch import TrainBatch
from trainer.megatron.thd import real_tokens_per_row
from trainer.rank_spread import gather_rank_spread

log = logging.getLogger("vlmfeed.megatron")

MetricsSink = str | Path | Callable[[dict], None] | None


class TimedIterator:
    """Wraps the per-rank data iterator: counts time blocked in ``__next__`` and the real/slot tokens
    of each micro-batch. ``StepMetrics`` drains the counters once per optimizer step."""

    def __init__(self, inner: Iterator[TrainBatch], adapt: Callable[[TrainBatch], Any] | None = None):
        self.inner = inner
        self.adapt = adapt
        self.reset()

    def reset(self) -> None:
        self.samples: list[list] = []  # [key, epoch] of each sample of the step's micro-batches
        self.wait_s = 0.0
        self.real_tokens = 0
        self.slot_tokens = 0
        self.micro_batches = 0
        self.vision_patches = 0
        self.vision_patches_sq = 0
        self.sample_tokens_sq = 0

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        batch = next(self.inner)
        self.wait_s += time.perf_counter() - t0
        tokens = batch.tokens
        self.slot_tokens += tokens.numel()
        self.real_tokens += int(real_tokens_per_row(batch.cu_seqlens, batch.num_samples).sum())
        self.vision_patches += batch.vision_patches
        self.vision_patches_sq += batch.vision_patches_sq
        self.sample_tokens_sq += batch.sample_tokens_sq
        self.micro_batches += 1
        self.samples += [[k, e] for k, e in zip(batch.sample_keys, batch.sample_epochs)]
        return self.adapt(batch) if self.adapt else batch

    # Bridge saves these with each checkpoint (one file per DP rank) and restores them on resume.
    def save_state(self):
        return self.inner.save_state()

    def restore_state(self, state) -> None:
        if self.ignore_restore:  # the driver dealt the rest of the epoch anew (another DP size)
            return
        self.inner.restore_state(state)

    ignore_restore = False


class ForwardClock:
    """GPU seconds of this rank's forward steps, from CUDA events recorded on the current stream
    around each call of the forward step (no synchronisation inside the step, and no hooks on the
    model: Transformer Engine refuses to capture CUDA graphs of modules that have hooks). The DP
    ranks' totals per step give the measured straggler ratio. The forward is timed, not the
    backward, because Megatron overlaps the gradient reduce with the backward; under FSDP the
    forward holds the parameter gathers too, which line the ranks up layer by layer and so
    understate the spread."""

    def __init__(self):
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start: torch.cuda.Event | None = None

    def start(self) -> None:
        if torch.cuda.is_current_stream_capturing():  # an event recorded into a CUDA graph has no time
            self._start = None
            return
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def stop(self) -> None:
        if self._start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._spans.append((self._start, end))
        self._start = None

    def drain(self) -> float:
        """Seconds of the forwards since the last drain; call after the step's synchronisation."""
        total = sum(start.elapsed_time(end) for start, end in self._spans) / 1e3
        self._spans.clear()
        return total


class TimedForwardStep:
    """A forward step timed by ``clock``; the signature Bridge inspects (state injected by name) is
    the wrapped step's."""

    def __init__(self, inner, clock: ForwardClock):
        self.inner, self.clock = inner, clock

    def __call__(self, state: GlobalState, data_iterator, model, return_schedule_plan: bool = False):
        self.clock.start()
        try:
            return self.inner(state, data_iterator, model, return_schedule_plan)
        finally:
            self.clock.stop()


class StepMetrics(Callback):
    """Per optimizer step: step time, data wait, tokens/s, real-token fraction, TFLOP/s per GPU,
    peak memory, loss. FLOPs come from Megatron-Bridge's own accounting: train.py adds the step's
    FLOPs to ``train_state.floating_point_operations_so_far`` right after ``on_train_step_end``, so a
    step's record is completed at the next step's start (or at train end)."""

    def __init__(self, iterator: TimedIterator, sink: MetricsSink, clock: ForwardClock | None = None,
                 samples_path: str | None = None):
        self.iterator = iterator
        self.sink = sink
        self.clock = clock
        self.samples_path = samples_path  # each step's [sample key, epoch] pairs (this DP rank's)
        self.records: list[dict] = []
        self._pending: dict | None = None
        self._pending_samples: list = []
        self._state: GlobalState | None = None
        self._step_end = 0.0
        self._t0 = 0.0
        self._flops_before = 0.0

    def on_train_step_start(self, context: CallbackContext) -> None:
        self._finish_pending(context)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self._flops_before = context.state.train_state.floating_point_operations_so_far
        self._t0 = time.perf_counter()

    def on_train_step_end(self, context: CallbackContext) -> None:
        torch.cuda.synchronize()
        self._state = context.state
        samples = self.iterator.samples
        spread = self._rank_spread()
        # This rank's own step inputs, what the cost model is fitted on (datasvc.pack.balance).
        it, elapsed = self.iterator, time.perf_counter() - self._t0
        own = {"vision_patches": it.vision_patches, "vision_patches_sq": it.vision_patches_sq,
               "sample_tokens_sq": it.sample_tokens_sq, "compute_s": elapsed - it.wait_s}
        real, slots, wait, peak_gib, step_time = self._reduce_step(elapsed)
        self._pending = {
            "step": context.state.train_state.step + 1,
            "step_time_s": step_time,
            "data_wait_s": wait,
            "data_wait_share": wait / step_time if step_time > 0 else 0.0,
            "tokens_per_s": real / step_time,
            "slot_tokens_per_s": slots / step_time,
            "real_token_fraction": real / slots if slots else 0.0,
            "peak_mem_gib": peak_gib,
            "loss": _loss(context.loss_dict),
            "grad_norm": context.grad_norm,
            "skipped": context.skipped_iter,
            "lr": context.optimizer.param_groups[0]["lr"] if context.optimizer is not None else None,
            **spread,
            **own,
        }
        self._pending_samples = samples
        self._step_end = time.perf_counter()

    def on_eval_end(self, context: CallbackContext) -> None:
        """The validation loss (last pipeline stage only) goes with the step it followed."""
        loss = _loss(context.total_loss_dict) if context.total_loss_dict else None
        if loss is not None and self._pending is not None:
            self._pending["val_loss"] = loss

    def on_checkpoint_save(self, context: CallbackContext) -> None:
        """Seconds from the step's end to the checkpoint's (the save, and any validation before it)."""
        if self._pending is not None:
            self._pending["checkpoint_s"] = round(time.perf_counter() - self._step_end, 3)

    def finish(self, reason: str | None = None) -> None:
        """Complete the last record when Bridge stops the loop early (a signal, --exit-interval)."""
        if self._pending is not None and reason:
            self._pending["exit_reason"] = reason
        if self._state is not None:
            self._finish_pending(CallbackContext(state=self._state, model=[]))

    def _rank_spread(self) -> dict:
        """Every DP replica's forward seconds and vision patches of this step (forward seconds and the
        straggler ratio are None without a forward clock)."""
        from megatron.core import parallel_state

        forward_s = self.clock.drain() if self.clock else 0.0
        spread = gather_rank_spread(forward_s, self.iterator.vision_patches,
                                    group=parallel_state.get_data_parallel_group(), device=torch.cuda.current_device())
        return {"rank_forward_s": spread.seconds if self.clock else None, "rank_vision_patches": spread.vision_patches,
                "straggler_ratio": spread.straggler_ratio if self.clock else None}

    def _reduce_step(self, step_time: float) -> tuple[float, float, float, float, float]:
        """(real tokens, slot tokens, data wait, peak GiB, step time) of this step over the job: tokens
        summed over DP replicas (each replica's TP/PP/CP ranks saw the same rows); the slowest rank's
        wait, memory and step time, which are what bound the job."""
        from megatron.core import parallel_state

        it = self.iterator
        dev = torch.cuda.current_device()
        sums = torch.tensor([it.real_tokens, it.slot_tokens], dtype=torch.float64, device=dev)
        maxes = torch.tensor([it.wait_s, torch.cuda.max_memory_allocated() / 2**30, step_time],
                             dtype=torch.float64, device=dev)
        it.reset()
        torch.distributed.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        torch.distributed.all_reduce(maxes, op=torch.distributed.ReduceOp.MAX)
        return (*sums.tolist(), *maxes.tolist())

    def on_train_end(self, context: CallbackContext) -> None:
        self._finish_pending(context)

    def _finish_pending(self, context: CallbackContext) -> None:
        rec, self._pending = self._pending, None
        if rec is None:
            return
        flops = context.state.train_state.floating_point_operations_so_far - self._flops_before
        world = torch.distributed.get_world_size()
        rec["tflops_per_gpu"] = flops / rec["step_time_s"] / world / 1e12 if rec["step_time_s"] else 0.0
        self.records.append(rec)
        # The last rank sits on the last pipeline stage (Megatron's rank order keeps PP outermost),
        # the only place the loss exists.
        if torch.distributed.get_rank() == world - 1:
            log.info("step %(step)d loss %(loss)s step %(step_time_s).3fs wait %(data_wait_s).4fs "
                     "%(tokens_per_s).0f tok/s real %(real_token_fraction).3f %(tflops_per_gpu).1f TFLOP/s/GPU "
                     "peak %(peak_mem_gib).1f GiB straggler %(straggler_ratio)s", rec)
            if callable(self.sink):
                self.sink(rec)
            elif self.sink is not None:
                with open(self.sink, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            if self.samples_path:
                with open(self.samples_path, "a") as f:
                    f.write(json.dumps({"step": rec["step"], "samples": self._pending_samples}) + "\n")


def _loss(loss_dict: dict | None) -> float | None:
    """The step's language-model loss from Bridge's reduced loss dict (None off the last stage)."""
    for key, value in (loss_dict or {}).items():
        if "loss" in key:
            return float(value.item() if torch.is_tensor(value) else value)
    return None
