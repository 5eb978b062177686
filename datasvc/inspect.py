"""See what the trainer will see: run shards through the real data path and write it all down.

    python -m datasvc.inspect SHARDS... --pipeline qwen3vl --out DIR [--decode cpu|gpu]
                              [--seq-len N] [--mbs B] [--max-pixels P] [--min-pixels P]

For every sample that survives: ``DIR/<key>.npz`` with ``pixel_values`` (float32, the model's
[sum(t*h*w), 3*T*P*P] rows), ``image_grid_thw``, ``input_ids`` and ``labels`` (before packing).
A summary table on stdout (key, image sizes, grid, text and vision tokens, reason if rejected),
``DIR/summary.json`` (the same rows, the accounting, packing figures) and ``DIR/quarantine.jsonl``
(shard, key, reason, detail of every sample that did not make it). With ``--seq-len``, the packed
micro-batches too (``DIR/packed-00000.npz``, ...) with packing efficiency against padding.

Samples go through exactly the service's stages (``process_item`` on work items of the shard,
then ``pack``), in shard order with no shuffle.
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

from datasvc.packing import PackingConfig, pack, padding_efficiency
from datasvc.process import WorkItem, process_item
from datasvc.rejects import RULE_REASONS, Accounting
from datasvc.shards import NoShardsError, ReadLimits, expand_shards, index_shard, read_samples
from datasvc.vision import to_pixel_values

ITEM_SAMPLES = 16
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


def inspect_shards(shards: list[str], out_dir: str, pipeline_name: str = "qwen3vl", decode: str = "cpu",
                   seq_len: int | None = None, micro_batch_size: int = 1, pipeline_options: dict | None = None,
                   limits: ReadLimits = ReadLimits(), write_samples: bool = True) -> dict:
    from datasvc.decode import make_decoder
    from datasvc.registry import get_pipeline

    paths = expand_shards(shards)
    pipeline = get_pipeline(pipeline_name, **(pipeline_options or {}))
    spec = pipeline.vision
    decoder = make_decoder(decode, num_threads=1)
    os.makedirs(out_dir, exist_ok=True)

    acct = Accounting(max_log=1 << 30)
    rows: list[dict] = []
    encoded = []
    used_names: set[str] = set()
    for path in paths:
        idx = index_shard(path)
        sizes = {raw.key: _image_sizes(raw.images)
                 for raw in read_samples(path, [s for s in idx.samples if not s.problem], limits)}
        order = {s.key: i for i, s in enumerate(idx.samples)}
        shard_rows: dict[str, dict] = {}
        for first in range(0, len(idx.samples), ITEM_SAMPLES):
            item = WorkItem(path, first, tuple(idx.samples[first:first + ITEM_SAMPLES]))
            res = process_item(item, pipeline, decoder, limits)
            acct.merge(res.accounting)
            for rej in res.accounting.log:
                shard_rows[rej.key] = {"shard": path, "key": rej.key, "status": "rejected", "reason": rej.reason,
                                       "detail": rej.detail, "image_sizes": sizes.get(rej.key, []), "grids": [],
                                       "text_tokens": None, "vision_tokens": None, "file": None}
            for s in res.samples:
                grids = [tuple(int(v) for v in g) for g in s.image_grid_thw]
                vision = sum(spec.vision_tokens(g) for g in grids)
                name = sanitize(s.key)
                if name in used_names:  # same key in two shards
                    name = sanitize(f"{os.path.splitext(os.path.basename(path))[0]}/{s.key}")
                used_names.add(name)
                fname = f"{name}.npz"
                if write_samples:
                    np.savez(os.path.join(out_dir, fname),
                             pixel_values=to_pixel_values(s.pixels, spec, s.image_grid_thw),
                             image_grid_thw=np.asarray(s.image_grid_thw, np.int64).reshape(-1, 3),
                             input_ids=np.asarray(s.input_ids, np.int64),
                             labels=np.asarray(s.labels, np.int64),
                             key=np.array(s.key), shard=np.array(path))
                shard_rows[s.key] = {"shard": path, "key": s.key, "status": "ok", "reason": "", "detail": "",
                                     "image_sizes": sizes.get(s.key, []), "grids": [list(g) for g in grids],
                                     "text_tokens": s.num_tokens - vision, "vision_tokens": vision,
                                     "tokens": s.num_tokens, "file": fname}
                encoded.append(s)
        rows.extend(sorted(shard_rows.values(), key=lambda r: order.get(r["key"], len(order))))

    packing = None
    if seq_len:
        cfg = PackingConfig(seq_len=seq_len, micro_batch_size=micro_batch_size, pad_id=pipeline.pad_id)
        batches, too_long = pack(encoded, cfg, spec.patch_dim)
        long_keys = {(s.shard, s.key) for s in too_long}
        for s in too_long:
            acct.reject(s.shard, s.key, "longer_than_seq_len", f"{s.num_tokens} tokens > seq_len {seq_len}")
        for r in rows:
            if (r["shard"], r["key"]) in long_keys:
                r["status"], r["reason"] = "skipped", "longer_than_seq_len"
        real = row_tokens = 0
        files = []
        for i, b in enumerate(batches):
            fname = f"packed-{i:05d}.npz"
            np.savez(os.path.join(out_dir, fname), tokens=b.tokens, labels=b.labels, loss_mask=b.loss_mask,
                     cu_seqlens=b.cu_seqlens, num_samples=b.num_samples,
                     pixel_values=to_pixel_values(b.pixels, spec, b.image_grid_thw), image_grid_thw=b.image_grid_thw,
                     sample_keys=np.array(b.sample_keys, dtype=str),
                     sample_rows=b.sample_rows if b.sample_rows is not None else np.zeros(0, np.int32))
            files.append(fname)
            real += b.real_tokens
            row_tokens += b.tokens.size
        acct.delivered = sum(len(b.sample_keys) for b in batches)
        packing = {
            "seq_len": seq_len, "micro_batch_size": micro_batch_size, "micro_batches": len(batches),
            "rows": sum(b.tokens.shape[0] for b in batches), "samples_too_long": len(too_long),
            "real_tokens": real, "row_tokens": row_tokens,
            "packing_efficiency": round(real / max(1, row_tokens), 4),
            "padding_efficiency": round(padding_efficiency(encoded, seq_len), 4),
            "rows_if_padded": len(encoded) - len(too_long),
            "files": files,
        }
    else:
        acct.delivered = len(encoded)

    with open(os.path.join(out_dir, "quarantine.jsonl"), "w") as f:
        for r in acct.log:
            kind = "skipped_by_rule" if r.reason in RULE_REASONS else "quarantined"
            f.write(json.dumps({"shard": r.shard, "key": r.key, "reason": r.reason, "detail": r.detail,
                                "kind": kind}) + "\n")
    summary = {
        "shards": paths, "pipeline": pipeline_name, "pipeline_options": pipeline_options or {}, "decode": decode,
        "vision": {"min_pixels": spec.min_pixels, "max_pixels": spec.max_pixels},
        "accounting": acct.as_dict(),
        "balanced": acct.balanced(),
        "samples": rows,
        "packing": packing,
    }
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


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
        print(f"packed {p['micro_batches']} micro-batches ({p['rows']} rows of {p['seq_len']}, MBS "
              f"{p['micro_batch_size']}): packing efficiency {p['packing_efficiency']:.3f} real tokens/row token; "
              f"padding every sample to seq_len would give {p['padding_efficiency']:.3f} "
              f"({p['rows_if_padded']} rows); {p['samples_too_long']} samples longer than seq_len skipped", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m datasvc.inspect",
                                 description="Write what the trainer will see for these shards.")
    ap.add_argument("shards", nargs="+", help="shard paths, globs or brace patterns")
    ap.add_argument("--pipeline", default="qwen3vl")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--decode", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--seq-len", type=int, default=None, help="also pack into rows of this many tokens")
    ap.add_argument("--mbs", type=int, default=1, help="micro-batch size (rows per packed micro-batch)")
    ap.add_argument("--max-pixels", type=int, default=None)
    ap.add_argument("--min-pixels", type=int, default=None)
    ap.add_argument("--tokenizer", default=None, help="HF model id or local path (default: bundled Qwen3)")
    ap.add_argument("--max-rows", type=int, default=500, help="rows of the table to print")
    args = ap.parse_args(argv)

    options = {k: v for k, v in (("max_pixels", args.max_pixels), ("min_pixels", args.min_pixels),
                                 ("tokenizer", args.tokenizer)) if v is not None}
    try:
        summary = inspect_shards(args.shards, args.out, args.pipeline, args.decode, args.seq_len, args.mbs, options)
    except (NoShardsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_summary(summary, args.max_rows)
    print(f"\nwrote {args.out}/: {sum(1 for r in summary['samples'] if r['file'])} sample .npz, "
          f"{len((summary['packing'] or {}).get('files', []))} packed .npz, summary.json, quarantine.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
