"""See what a trainer rank receives: run shards through the real data path and write it all down.

    vlmfeed inspect SHARDS... --out DIR [--pipeline qwen3vl] [--decode cpu|gpu]
                    [--seq-len N --mbs B [--dp-size D --rank R] [--seed S]] [--max-pixels P] [--min-pixels P]

For every sample that survives: ``DIR/<key>.npz`` with ``pixel_values`` (float32, the model's
[sum(t*h*w), 3*T*P*P] rows), ``image_grid_thw``, ``input_ids`` and ``labels`` (before packing).
A summary table on stdout (key, image sizes, grid, text and vision tokens, reason if rejected),
``DIR/summary.json`` (the same rows, the accounting, packing figures) and ``DIR/quarantine.jsonl``
(shard, key, reason, detail of every sample that did not make it).

With ``--seq-len``, the micro-batches of DP rank ``--rank`` too (``DIR/packed-00000.npz``, ... in
delivery order, each with its position: epoch, block, batch, step), made by the same block
producer a feeder runs (``datasvc.producer``): the rank's work items in the epoch's shuffled
order, blocks sized and packed in chains as ``trainer.run`` makes them, one epoch. Without it,
samples go through the preprocessing actors' work (``process.ItemProcessor``) in shard order.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import warnings

import numpy as np

from datasvc.rejects import RULE_PREFIX, RULE_REASONS
from datasvc.shards import NoShardsError, expand_shards
from datasvc.vision import to_pixel_values

_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._+=,@-]")


def sanitize(key: str) -> str:
    """A sample key as one safe file name: '/' becomes '__', other odd characters '_'."""
    name = _UNSAFE_CHARS.sub("_", key.replace("/", "__").replace(os.sep, "__"))
    name = name.lstrip(".") or "_"
    return name[:200]


def _image_sizes(data_list) -> list[str]:
    from PIL import Image

    sizes = []
    for _ext, data in data_list:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                im = Image.open(io.BytesIO(data))
            sizes.append(f"{im.width}x{im.height}")
        except Exception:
            sizes.append("?")
    return sizes


class _SampleWriter:
    """Runs the preprocessing actors' work on an item and writes down what came of each sample: a
    row for the table, the sample's ``.npz``, and each rejection (every one: no log cap)."""

    def __init__(self, processor, out_dir: str, write_samples: bool):
        self.processor, self.out_dir, self.write_samples = processor, out_dir, write_samples
        self.spec = processor.pipeline.vision
        self.rows: dict[tuple[str, str], dict] = {}
        self.rejections: list = []
        self.names: set[str] = set()

    def __call__(self, item):
        from datasvc.shards import read_samples

        res = self.processor(item)
        sizes = {raw.key: _image_sizes(raw.images)
                 for raw in read_samples(item.shard, [s for s in item.samples if not s.problem], self.processor.limits)}
        self.rejections.extend(res.accounting.log)
        where = {sample.key: item.first + i for i, sample in enumerate(item.samples)}  # for the table's order
        for rej in res.accounting.log:
            self.rows[(item.shard, rej.key)] = {
                "shard": item.shard, "key": rej.key, "status": "rejected", "reason": rej.reason, "detail": rej.detail,
                "image_sizes": sizes.get(rej.key, []), "grids": [], "text_tokens": None, "vision_tokens": None,
                "file": None, "index": where.get(rej.key, 0)}
        for s in res.samples:
            self.rows[(item.shard, s.key)] = {**self._sample_row(item.shard, s, sizes.get(s.key, [])),
                                              "index": where.get(s.key, 0)}
        return res

    def _sample_row(self, shard: str, s, sizes: list[str]) -> dict:
        grids = [tuple(int(v) for v in g) for g in s.image_grid_thw]
        vision = sum(self.spec.vision_tokens(g) for g in grids)
        name = sanitize(s.key)
        if name in self.names:  # same key in two shards
            name = sanitize(f"{os.path.splitext(os.path.basename(shard))[0]}/{s.key}")
        self.names.add(name)
        fname = f"{name}.npz"
        if self.write_samples:
            np.savez(os.path.join(self.out_dir, fname),
                     pixel_values=to_pixel_values(s.pixels, self.spec, s.image_grid_thw, frames_hw=s.image_frame_hw),
                     image_grid_thw=np.asarray(s.image_grid_thw, np.int64).reshape(-1, 3),
                     input_ids=np.asarray(s.input_ids, np.int64), labels=np.asarray(s.labels, np.int64),
                     key=np.array(s.key), shard=np.array(shard))
        return {"shard": shard, "key": s.key, "status": "ok", "reason": "", "detail": "", "image_sizes": sizes,
                "grids": [list(g) for g in grids], "text_tokens": s.num_tokens - vision, "vision_tokens": vision,
                "tokens": s.num_tokens, "file": fname}


def _data_config(paths: list[str], pipeline_name: str, pipeline_options: dict, decode: str, seq_len: int | None,
                 micro_batch_size: int, dp_size: int, seed: int):
    """The config a trainer's feeder would run (one epoch), with blocks as ``trainer.run`` sizes them."""
    from datasvc.config import ServiceConfig
    from datasvc.plan import TRAINING_CHAIN_BLOCKS, size_blocks

    cfg = ServiceConfig(shards=tuple(paths), pipeline=pipeline_name, pipeline_options=pipeline_options,
                        seq_len=seq_len or ServiceConfig.seq_len, micro_batch_size=micro_batch_size, decode=decode,
                        dp_size=dp_size, seed=seed, epochs=1, blocks_span_epochs=True,
                        chain_blocks=TRAINING_CHAIN_BLOCKS)
    return size_blocks(cfg)[0] if seq_len else cfg


def _pack_with_producer(cfg, rank: int, writer: _SampleWriter, out_dir: str) -> tuple[dict, dict]:
    """The rank's micro-batches as its feeder makes them, written in delivery order; (packing
    figures, the producer's accounting)."""
    from types import SimpleNamespace

    from datasvc.packing import padding_efficiency
    from datasvc.producer import BlockProducer

    producer = BlockProducer(cfg, rank, process=writer)
    files, positions = [], []
    real = row_tokens = rows = 0
    for b, pos in producer.micro_batches():
        fname = f"packed-{len(files):05d}.npz"
        np.savez(os.path.join(out_dir, fname), tokens=b.tokens, labels=b.labels, loss_mask=b.loss_mask,
                 cu_seqlens=b.cu_seqlens, num_samples=b.num_samples,
                 pixel_values=to_pixel_values(b.pixels, writer.spec, b.image_grid_thw, frames_hw=b.image_frame_hw),
                 image_grid_thw=b.image_grid_thw, sample_keys=np.array(b.sample_keys, dtype=str),
                 sample_rows=b.sample_rows if b.sample_rows is not None else np.zeros(0, np.int32),
                 position=np.array([pos.epoch, pos.block, pos.batch, pos.step], np.int64))
        files.append(fname)
        positions.append(pos.as_dict())
        real += b.real_tokens
        row_tokens += b.tokens.size
        rows += b.tokens.shape[0]
    lengths = [r["tokens"] for r in writer.rows.values() if r["status"] == "ok"]
    packing = {
        "seq_len": cfg.seq_len, "micro_batch_size": cfg.micro_batch_size, "rank": rank, "dp_size": cfg.dp_size,
        "seed": cfg.seed, "items_per_block": cfg.items_per_block, "chain_blocks": cfg.chain_blocks,
        "micro_batches": len(files), "rows": rows, "real_tokens": real, "row_tokens": row_tokens,
        "samples_too_long": sum(n > cfg.seq_len for n in lengths),
        "packing_efficiency": round(real / max(1, row_tokens), 4),
        "padding_efficiency": round(padding_efficiency([SimpleNamespace(num_tokens=n) for n in lengths],
                                                       cfg.seq_len), 4),
        "rows_if_padded": sum(n <= cfg.seq_len for n in lengths), "files": files, "positions": positions,
    }
    return packing, producer.stats()["accounting"]


def _too_long(writer: _SampleWriter, seq_len: int) -> list:
    """The samples packing skips (each longer than a row), marked in the table, as rejections."""
    from datasvc.rejects import Rejection

    out = []
    for r in writer.rows.values():
        if r["status"] == "ok" and r["tokens"] > seq_len:
            r.update(status="skipped", reason="longer_than_seq_len")
            out.append(Rejection(r["shard"], r["key"], r["reason"], f"{r['tokens']} tokens > seq_len {seq_len}"))
    return out


def _process_in_shard_order(cfg, writer: _SampleWriter) -> dict:
    """Every sample of the shards in shard order, in work items as the actors get them; the accounting."""
    from datasvc.process import WorkItem
    from datasvc.rejects import Accounting
    from datasvc.shards import index_shard

    acct = Accounting(max_log=0)
    for path in cfg.shards:
        samples = index_shard(path).samples
        for first in range(0, len(samples), cfg.samples_per_item):
            acct.merge(writer(WorkItem(path, first, tuple(samples[first:first + cfg.samples_per_item]))).accounting)
    acct.delivered = sum(1 for r in writer.rows.values() if r["status"] == "ok")
    return acct.as_dict()


def _balanced(a: dict) -> bool:
    return a["read"] == a["delivered"] + sum(a["quarantined"].values()) + sum(a["skipped_by_rule"].values())


def inspect_shards(shards: list[str], out_dir: str, pipeline_name: str = "qwen3vl", decode: str = "cpu",
                   seq_len: int | None = None, micro_batch_size: int = 1, pipeline_options: dict | None = None,
                   write_samples: bool = True, dp_size: int = 1, rank: int = 0, seed: int = 0) -> dict:
    from datasvc.process import ItemProcessor

    paths = expand_shards(shards)
    if not 0 <= rank < dp_size:
        raise ValueError(f"--rank {rank} must be in [0, --dp-size {dp_size})")
    cfg = _data_config(paths, pipeline_name, pipeline_options or {}, decode, seq_len, micro_batch_size, dp_size, seed)
    os.makedirs(out_dir, exist_ok=True)
    writer = _SampleWriter(ItemProcessor(cfg), out_dir, write_samples)
    if seq_len:
        packing, acct = _pack_with_producer(cfg, rank, writer, out_dir)
        rejections = writer.rejections + _too_long(writer, cfg.seq_len)
    else:
        packing, acct = None, _process_in_shard_order(cfg, writer)
        rejections = writer.rejections
    order = {p: i for i, p in enumerate(paths)}
    rows = sorted(writer.rows.values(), key=lambda r: (order.get(r["shard"], len(order)), r.get("index", 0), r["key"]))
    _write_quarantine(os.path.join(out_dir, "quarantine.jsonl"), rejections)
    spec = writer.spec
    summary = {
        "shards": paths, "pipeline": pipeline_name, "pipeline_options": pipeline_options or {}, "decode": decode,
        "vision": {"min_pixels": spec.min_pixels, "max_pixels": spec.max_pixels},
        "accounting": acct, "balanced": _balanced(acct), "samples": rows, "packing": packing,
    }
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def _write_quarantine(path: str, rejections: list) -> None:
    with open(path, "w") as f:
        for r in rejections:
            is_rule = r.reason in RULE_REASONS or r.reason.startswith(RULE_PREFIX)
            f.write(json.dumps({"shard": r.shard, "key": r.key, "reason": r.reason, "detail": r.detail,
                                "kind": "skipped_by_rule" if is_rule else "quarantined"}) + "\n")


def print_summary(summary: dict, max_rows: int = 500, out=sys.stdout) -> None:
    rows = summary["samples"]
    w = max([10] + [len(r["key"]) for r in rows[:max_rows]])
    w = min(w, 48)
    print(f"{'key':{w}} {'images (WxH)':22} {'grid (t,h,w)':22} {'text':>6} {'vision':>7}  reason", file=out)
    for r in rows[:max_rows]:
        sizes = ",".join(r["image_sizes"]) or "-"
        grids = ",".join("x".join(str(v) for v in g) for g in r["grids"]) or "-"
        text = "-" if r["text_tokens"] is None else str(r["text_tokens"])
        vision = "-" if r["vision_tokens"] is None else str(r["vision_tokens"])
        reason = r["reason"] + (f" ({r['detail'][:60]})" if r["detail"] else "")
        print(f"{r['key'][:w]:{w}} {sizes[:22]:22} {grids[:22]:22} {text:>6} {vision:>7}  {reason}", file=out)
    if len(rows) > max_rows:
        print(f"... {len(rows) - max_rows} more rows in summary.json", file=out)
    a = summary["accounting"]
    print(f"\nread {a['read']}, delivered {a['delivered']}, quarantined {sum(a['quarantined'].values())} "
          f"{dict(a['quarantined'])}, skipped by rule {sum(a['skipped_by_rule'].values())} "
          f"{dict(a['skipped_by_rule'])}" + (f", ignored members {dict(a['ignored_members'])}"
                                             if a["ignored_members"] else ""), file=out)
    p = summary.get("packing")
    if p:
        print(f"rank {p['rank']} of {p['dp_size']} receives {p['micro_batches']} micro-batches ({p['rows']} rows of "
              f"{p['seq_len']}, MBS {p['micro_batch_size']}; blocks of {p['items_per_block']} items in chains of "
              f"{p['chain_blocks']}): packing efficiency {p['packing_efficiency']:.3f} real tokens/row token; "
              f"padding every sample to seq_len would give {p['padding_efficiency']:.3f} "
              f"({p['rows_if_padded']} rows); {p['samples_too_long']} samples longer than seq_len skipped", file=out)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vlmfeed inspect", description="Write what a trainer rank receives for these shards.")
    ap.add_argument("shards", nargs="+", help="shard paths, globs or brace patterns")
    ap.add_argument("--pipeline", default="qwen3vl")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--decode", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--seq-len", type=int, default=None, help="also pack into rows of this many tokens, as a feeder does")
    ap.add_argument("--mbs", type=int, default=1, help="micro-batch size (rows per packed micro-batch)")
    ap.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks the shards are split over")
    ap.add_argument("--rank", type=int, default=0, help="the data-parallel rank whose micro-batches to write")
    ap.add_argument("--seed", type=int, default=0, help="the data seed (the order of work items and of samples)")
    ap.add_argument("--max-pixels", type=int, default=None)
    ap.add_argument("--min-pixels", type=int, default=None)
    ap.add_argument("--tokenizer", default=None, help="HF model id or local path (default: bundled Qwen3)")
    ap.add_argument("--max-rows", type=int, default=500, help="rows of the table to print")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    options = {k: v for k, v in (("max_pixels", args.max_pixels), ("min_pixels", args.min_pixels),
                                 ("tokenizer", args.tokenizer)) if v is not None}
    try:
        summary = inspect_shards(args.shards, args.out, args.pipeline, args.decode, args.seq_len, args.mbs, options,
                                 dp_size=args.dp_size, rank=args.rank, seed=args.seed)
    except (NoShardsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_summary(summary, args.max_rows)
    print(f"\nwrote {args.out}/: {sum(1 for r in summary['samples'] if r['file'])} sample .npz, "
          f"{len((summary['packing'] or {}).get('files', []))} packed .npz, summary.json, quarantine.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
