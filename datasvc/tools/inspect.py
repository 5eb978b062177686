"""See what a trainer rank receives: run shards through the training stream and write it all down.

    vlmfeed inspect SHARDS... --out DIR [--limit N | --all] [--device cpu|gpu] [--no-pack]
                    [--seq-len N] [--mbs B] [--dp-size D] [--rank R] [--data-seed S] [--max-pixels P]
                    [--min-pixels P] [--decode cpu|gpu] [--pipeline qwen3vl] [--tokenizer T]

The stream is the one ``trainer.run`` trains from, built by ``datasvc.training.training_config``:
the device's sequence length and pixel cap (``--device``: gpu where torch sees a CUDA GPU, as
``trainer.run`` then trains on GPUs, else its CPU path's), blocks sized from the shards and packed
in chains, made by the block producer a feeder runs, for DP rank ``--rank``; flags override any of
it. One epoch: up to the epoch's last block this is the trainer's stream exactly (at that block
the trainer's stream runs on into the next epoch, and holds part-full rows for it).

``--limit N`` (default 16; ``--all`` or 0 for every sample) stops after the micro-batch that brings
the rank's samples to N: whole micro-batches, so a few more than N may come. The samples of the
blocks read past it are counted as ``in_flight``.

In DIR, per micro-batch NNNNN of the rank's stream, in delivery order:

- ``packed-NNNNN.npz`` (compressed; ``datasvc.tools.inspect_arrays``): ``tokens``, ``labels``,
  ``loss_mask``, ``cu_seqlens``, ``num_samples``, ``image_grid_thw`` and ``video_grid_thw`` as the
  rank gets them; ``image_pixels`` and ``video_pixels``, the uint8 RGB images (at their grid's
  size) and video frames the rank's float ``pixel_values`` and ``pixel_values_videos`` are made
  from, in rows of one patch, with ``image_mean``, ``image_std`` and the patch sizes;
  ``image_frame_hw`` (the size each image travels at); the samples' keys, names, rows, epochs, plan
  ordinals, image and video counts; ``position`` (epoch, block, batch, step).
  ``inspect_arrays.rank_fields(path)`` rebuilds the float arrays with the rank's own functions.
- ``sheet-NNNNN.png``: its images and a few frames of each video as labelled thumbnails
  (key, row, grid t x h x w, vision tokens; ``datasvc.tools.inspect_sheet``).
- ``text-NNNNN.txt``: each row's decoded ChatML, image and video pad runs collapsed to
  ``<image HxW = N tokens>``, untrained tokens in ``[[...]]`` (``datasvc.tools.inspect_text``).

And ``summary.json`` (the geometry, the table's rows, the accounting, packing figures, each
micro-batch's fields and shapes as the rank receives them), ``quarantine.jsonl`` (shard, key,
reason, detail of every sample that did not make it). ``--no-pack`` shows samples alone, in shard
order through the preprocessing actors' work: ``samples/KEY.npz`` (``input_ids``, ``labels``, grids
and uint8 pixels, before packing) instead of the micro-batch files.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Literal

from datasvc.read.shards import NoShardsError, expand_shards
from datasvc.tools import inspect_arrays
from datasvc.tools.inspect_samples import SampleRecorder, print_table, sanitize, write_quarantine
from datasvc.tools.inspect_stream import write_stream
from datasvc.training import add_data_flags, default_device
from datasvc.usage import UserError

DEFAULT_LIMIT = 16


@dataclass(frozen=True, kw_only=True)
class InspectConfig:
    """What to inspect; unset geometry (None) is the device's, as ``trainer.run`` trains."""

    pipeline: str = "qwen3vl"
    device: Literal["cpu", "gpu"] | None = None  # None: gpu where torch sees a CUDA GPU
    decode: Literal["cpu", "gpu"] = "cpu"
    pack: bool = True  # False: samples alone, in shard order
    seq_len: int | None = None
    micro_batch_size: int = 1
    dp_size: int = 1
    rank: int = 0
    seed: int = 0
    max_pixels: int | None = None
    min_pixels: int | None = None
    pipeline_options: dict = field(default_factory=dict)
    limit: int | None = DEFAULT_LIMIT  # samples; None: all
    write_samples: bool = True  # --no-pack's samples/KEY.npz
    progress: bool = False  # progress lines on stderr once a run takes a few seconds

    def __post_init__(self):
        if self.device not in (None, "cpu", "gpu"):
            raise UserError(f"--device {self.device}: use cpu or gpu")
        for name in ("micro_batch_size", "dp_size", "seq_len", "max_pixels", "min_pixels"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, not {value}")
        if not 0 <= self.rank < self.dp_size:
            raise UserError(f"--rank {self.rank} must be in [0, --dp-size {self.dp_size})")
        if self.limit is not None and self.limit < 0:
            raise UserError(f"--limit must be >= 0 (0: every sample), not {self.limit}")


def service_config(paths: list[str], config: InspectConfig):
    """(``ServiceConfig``, block sizing or None): ``trainer.run``'s stream for these shards, one epoch."""
    from datasvc.config import DecodeConfig
    from datasvc.training import training_config

    options = dict(config.pipeline_options)
    # training_config takes the pixel caps as arguments of their own, not among the pipeline's options
    caps = {name: options.pop(name, None) for name in ("max_pixels", "min_pixels")}
    return training_config(paths, device=config.device or default_device(), pipeline=config.pipeline,
                           seq_len=config.seq_len, micro_batch_size=config.micro_batch_size, dp_size=config.dp_size,
                           max_pixels=config.max_pixels or caps["max_pixels"],
                           min_pixels=config.min_pixels or caps["min_pixels"], pipeline_options=options,
                           items_per_block=None if config.pack else 1, decode=DecodeConfig(device=config.decode),
                           seed=config.seed,
                           epochs=1)


class Progress:
    """Progress lines on stderr once a run has taken ``after_s``, then one every ``every_s``."""

    def __init__(self, enabled: bool, after_s: float = 3.0, every_s: float = 2.0, out=sys.stderr):
        self.enabled, self.after_s, self.every_s, self.out = enabled, after_s, every_s, out
        self.start = self.last = time.monotonic()
        self.shown = False

    def update(self, text: str) -> None:
        now = time.monotonic()
        if self.enabled and now - self.start >= self.after_s and (not self.shown or now - self.last >= self.every_s):
            print(f"inspect: {text} ({now - self.start:.0f} s)", file=self.out, flush=True)
            self.shown, self.last = True, now


class OutputFiles:
    """The files a run writes under its directory, for the closing list and their size on disk."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.names: list[str] = []

    def path(self, name: str) -> str:
        return os.path.join(self.out_dir, name)

    def added(self, name: str) -> str:
        self.names.append(name)
        return name

    def json(self, name: str, data) -> None:
        with open(self.path(name), "w") as f:
            json.dump(data, f, indent=1)
        self.added(name)

    def text(self, name: str, text: str) -> None:
        with open(self.path(name), "w") as f:
            f.write(text)
        self.added(name)

    def total_bytes(self) -> int:
        return sum(os.path.getsize(self.path(n)) for n in self.names)

    def describe(self) -> str:
        """``6 packed-*.npz, 6 sheet-*.png, ..., summary.json``: counted by kind."""
        kinds: dict[str, int] = {}
        for name in self.names:
            stem, ext = os.path.splitext(name)
            prefix = stem.split("-")[0] if stem[-5:].isdigit() else None
            kind = f"samples/*{ext}" if name.startswith("samples/") else f"{prefix}-*{ext}" if prefix else name
            kinds[kind] = kinds.get(kind, 0) + 1
        return ", ".join(k if n == 1 and "*" not in k else f"{n} {k}" for k, n in kinds.items())


class RecoveringRecorder(SampleRecorder):
    """A ``SampleRecorder`` whose items fail as the service's do (``datasvc.stream.recovery``): an item that
    raises is run again, then sample by sample, and a sample that still raises is quarantined
    ``worker_error`` with the exception, in the table and ``quarantine.jsonl`` like any rejection.
    So a shard this process may not read (permission denied) is counted, as the service counts it."""

    def __call__(self, item):
        from datasvc.stream.recovery import Recovery, Task

        recovery, done = Recovery(rank=0), []
        recovery.backlog.append(Task("item", item))
        while recovery.backlog:
            task = recovery.backlog.pop(0)
            try:
                recovery.finish(task, super().__call__(task.item), done)
            except Exception as exc:  # what a preprocessing actor raising would be
                recovery.raised(task, f"{type(exc).__name__}: {exc}"[:300], done)
        ((_, result),) = done
        where = {s.key: item.first + i for i, s in enumerate(item.samples)}
        for rej in result.accounting.log:
            if (item.shard, rej.key) not in self.rows:  # quarantined whole: no row recorded yet
                self.rejections.append(rej)
                self.rows[(item.shard, rej.key)] = {
                    "shard": item.shard, "key": rej.key, "status": "rejected", "reason": rej.reason,
                    "detail": rej.detail, "image_sizes": [], "video_sizes": [], "grids": [], "video_grids": [],
                    "text_tokens": None, "image_tokens": None, "video_tokens": None, "vision_tokens": None,
                    "file": None, "index": where.get(rej.key, 0)}
        return result


def inspect_shards(shards: list[str], out_dir: str, **options) -> dict:
    """Write what a rank receives for ``shards`` under ``out_dir`` (see the module docstring);
    ``options`` are ``InspectConfig``'s fields. Returns the summary (also ``summary.json``)."""
    from datasvc.stream.process import ItemProcessor

    config = InspectConfig(**options)
    paths = expand_shards(shards)
    config = replace(config, device=config.device or default_device())
    cfg, _sizing = service_config(paths, config)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {out_dir}: {exc.strerror or exc}") from None
    files = OutputFiles(out_dir)
    recorder = RecoveringRecorder(ItemProcessor(cfg), keep=not config.pack and config.write_samples)
    progress = Progress(config.progress)
    if config.pack:
        outcome = write_stream(cfg, config, recorder, files, progress)
    else:
        outcome = _samples_in_shard_order(cfg, config, recorder, files, progress)
    write_quarantine(files.path(files.added("quarantine.jsonl")), outcome["rejections"])
    spec = recorder.spec
    summary = {
        "shards": paths, "pipeline": config.pipeline, "pipeline_options": dict(cfg.pipeline_options),
        "decode": config.decode, "geometry": _geometry(cfg, config, spec),
        "vision": {"min_pixels": spec.min_pixels, "max_pixels": spec.max_pixels},
        "limit": config.limit, "stopped_at_limit": outcome["stopped"], "accounting": outcome["accounting"],
        "balanced": _balanced(outcome["accounting"]), "samples": outcome["rows"], "packing": outcome.get("packing"),
        "preview": outcome.get("preview", ""),
    }
    files.json("summary.json", summary)
    summary["written"] = {"dir": out_dir, "files": list(files.names), "bytes": files.total_bytes(),
                          "description": files.describe()}
    return summary


def _geometry(cfg, config: InspectConfig, spec) -> dict:
    packed = {"seq_len": cfg.seq_len, "micro_batch_size": cfg.micro_batch_size, "items_per_block": cfg.items_per_block,
              "chain_blocks": cfg.chain_blocks} if config.pack else {}
    return {"device": config.device, "built_by": "datasvc.training.training_config", "packed": config.pack, **packed,
            "max_pixels": spec.max_pixels, "min_pixels": spec.min_pixels, "samples_per_item": cfg.samples_per_item,
            "dp_size": cfg.dp_size, "rank": config.rank, "seed": cfg.seed, "epochs": cfg.epochs}


def _balanced(a: dict) -> bool:
    return a["read"] == (a["delivered"] + sum(a["quarantined"].values()) + sum(a["skipped_by_rule"].values())
                         + a.get("in_flight", 0))


def _samples_in_shard_order(cfg, config: InspectConfig, recorder: SampleRecorder, files: OutputFiles,
                            progress: Progress) -> dict:
    """Samples of the shards in shard order, in work items as the actors get them, until the limit."""
    from datasvc.read.shards import index_shard
    from datasvc.rejects import Accounting
    from datasvc.wire import WorkItem

    acct, names, stopped = Accounting(max_log=0), set(), False
    if config.write_samples:
        os.makedirs(files.path("samples"), exist_ok=True)
    for path in cfg.shards:
        samples = index_shard(path).samples
        for first in range(0, len(samples), cfg.samples_per_item):
            stopped = bool(config.limit) and acct.delivered >= config.limit
            if stopped:
                break
            result = recorder(WorkItem(path, first, tuple(samples[first:first + cfg.samples_per_item])))
            acct.merge(result.accounting)
            acct.delivered += len(result.samples)
            for sample in recorder.take_kept():
                _write_sample(sample, recorder, files, names)
            progress.update(f"{acct.read} samples read")
        if stopped:
            break
    order = {p: i for i, p in enumerate(cfg.shards)}
    rows = sorted(recorder.rows.values(), key=lambda r: (order.get(r["shard"], len(order)), r["index"], r["key"]))
    return {"rows": rows, "accounting": acct.as_dict(), "rejections": recorder.rejections, "stopped": stopped}


def _write_sample(sample, recorder: SampleRecorder, files: OutputFiles, names: set[str]) -> None:
    name = sanitize(sample.key)
    if name in names:  # same key in two shards
        name = sanitize(f"{os.path.splitext(os.path.basename(sample.shard))[0]}/{sample.key}")
    names.add(name)
    fname = f"samples/{name}.npz"
    inspect_arrays.save(files.path(fname), inspect_arrays.sample_arrays(sample, recorder.spec))
    recorder.rows[(sample.shard, sample.key)]["file"] = files.added(fname)


def print_summary(summary: dict, max_rows: int = 500, out=sys.stdout) -> None:
    g = summary["geometry"]
    print(f"geometry ({g['built_by']}, device {g['device']}): " + (
        f"seq_len {g['seq_len']}, MBS {g['micro_batch_size']}, blocks of {g['items_per_block']} items in chains "
        f"of {g['chain_blocks']}, " if g["packed"] else "not packed, ")
        + f"pixel cap {g['max_pixels']} (min {g['min_pixels']}), rank {g['rank']} of {g['dp_size']}, seed {g['seed']}",
        file=out)
    print_table(summary["samples"], max_rows, out)
    a = summary["accounting"]
    print(f"\nread {a['read']}, delivered {a['delivered']}, quarantined {sum(a['quarantined'].values())} "
          f"{dict(a['quarantined'])}, skipped by rule {sum(a['skipped_by_rule'].values())} "
          f"{dict(a['skipped_by_rule'])}" + (f", ignored members {dict(a['ignored_members'])}"
                                             if a["ignored_members"] else "")
          + (f", in flight {a['in_flight']} (read, not handed out before the limit)" if a.get("in_flight") else ""),
          file=out)
    if summary["stopped_at_limit"]:
        print(f"stopped at --limit {summary['limit']} samples; --all for every sample", file=out)
    p = summary.get("packing")
    if p:
        print(f"rank {p['rank']} of {p['dp_size']} receives {p['micro_batches']} micro-batches ({p['rows']} rows of "
              f"{p['seq_len']}, MBS {p['micro_batch_size']}; blocks of {p['items_per_block']} items in chains of "
              f"{p['chain_blocks']}): packing efficiency {p['packing_efficiency']:.3f} real tokens/row token; "
              f"padding every sample to seq_len would give {p['padding_efficiency']:.3f} "
              f"({p['rows_if_padded']} rows); {p['samples_too_long']} samples longer than seq_len skipped; "
              f"vision tokens {p['image_tokens']} image + {p['video_tokens']} video", file=out)
    if summary.get("preview"):
        print(f"\ndecoded text, first samples ([[...]]: not trained):\n{summary['preview']}", file=out)


def _parser() -> argparse.ArgumentParser:
    from datasvc.usage import HelpFormatter

    ap = argparse.ArgumentParser(prog="vlmfeed inspect", formatter_class=HelpFormatter,
                                 description="Write what a trainer rank receives for these shards: packed "
                                             "micro-batches, contact sheets, decoded text, a summary.")
    ap.add_argument("shards", nargs="+", help="shard paths, globs or brace patterns")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--limit", type=int, default=DEFAULT_LIMIT,
                    help="stop after the micro-batch that brings the rank's samples to this many (0: all)")
    ap.add_argument("--all", action="store_true", help="every sample of the epoch (--limit 0)")
    add_data_flags(ap, "--device", "--seq-len", "--max-pixels", "--min-pixels", "--decode")
    ap.add_argument("--no-pack", action="store_true", help="samples alone in shard order, no micro-batches")
    ap.add_argument("--mbs", type=int, default=1, help="micro-batch size (rows per packed micro-batch)")
    ap.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks the shards are split over")
    ap.add_argument("--rank", type=int, default=0, help="the data-parallel rank whose micro-batches to write")
    add_data_flags(ap, "--data-seed", "--pipeline")
    ap.add_argument("--tokenizer", default=None, help="HF model id or local path (default: bundled Qwen3)")
    ap.add_argument("--max-rows", type=int, default=500, help="rows of the table to print")
    return ap


def run(argv: list[str] | None = None) -> int:
    """``main`` without the error handling: mistakes raise ``UserError``."""
    from datasvc.stream.producer import DataServiceError

    args = _parser().parse_args(argv)
    try:
        summary = inspect_shards(
            args.shards, args.out, pipeline=args.pipeline, device=args.device, decode=args.decode,
            pack=not args.no_pack, seq_len=args.seq_len, micro_batch_size=args.mbs, dp_size=args.dp_size,
            rank=args.rank, seed=args.data_seed, max_pixels=args.max_pixels, min_pixels=args.min_pixels,
            pipeline_options={"tokenizer": args.tokenizer} if args.tokenizer else {},
            limit=None if args.all or args.limit == 0 else args.limit, progress=True)
    except (NoShardsError, DataServiceError, ValueError) as exc:  # a pattern, a rank or an option that cannot be
        raise UserError(str(exc)) from None
    print_summary(summary, args.max_rows)
    w = summary["written"]
    print(f"\nwrote {w['dir']}/ ({_size(w['bytes'])} on disk): {w['description']}")
    return 0


def _size(n: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except UserError as exc:
        print(f"vlmfeed inspect: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
