"""``vlmfeed inspect``'s record of every sample it reads: a row of the table per sample (sizes, grids,
text and vision tokens, where it went or why it was rejected), and the table itself."""
from __future__ import annotations

import io
import os
import re
import sys
import warnings

from datasvc.rejects import RULE_PREFIX, RULE_REASONS, Rejection

_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._+=,@-]")


def sanitize(key: str) -> str:
    """A sample key as one safe file name: '/' becomes '__', other odd characters '_'."""
    name = _UNSAFE_CHARS.sub("_", key.replace("/", "__").replace(os.sep, "__"))
    name = name.lstrip(".") or "_"
    return name[:200]


def _image_sizes(members) -> list[str]:
    from PIL import Image

    sizes = []
    for _ext, data in members:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                im = Image.open(io.BytesIO(data))
            sizes.append(f"{im.width}x{im.height}")
        except Exception:
            sizes.append("?")
    return sizes


def _video_sizes(members) -> list[str]:
    """Each video's stored size, frames and rate, read from its container alone."""
    from datasvc.media.video import probe_video

    sizes = []
    for _ext, data in members:
        try:
            h = probe_video(data)
            sizes.append(f"{h.width}x{h.height} {h.frames}f@{h.fps:g}")
        except Exception:
            sizes.append("?")
    return sizes


class SampleRecorder:
    """Runs the preprocessing actors' work on an item (what the producer calls) and records each
    sample: its table row, and each rejection (every one: no log cap). ``keep``: also hold the
    encoded samples until ``take_kept`` (the ``--no-pack`` files are written from them)."""

    def __init__(self, processor, keep: bool = False):
        self.processor, self.keep = processor, keep
        self.spec = processor.pipeline.vision
        self.rows: dict[tuple[str, str], dict] = {}
        self.by_full_key: dict[str, dict] = {}  # a packed micro-batch names its samples "shard/key"
        self.rejections: list[Rejection] = []
        self.kept: list = []

    def __call__(self, item):
        from datasvc.read.shards import read_samples

        res = self.processor(item)
        raws = read_samples(item.shard, [s for s in item.samples if not s.problem], self.processor.limits)
        sizes = {raw.key: (_image_sizes(raw.images), _video_sizes(raw.videos)) for raw in raws}
        self.rejections.extend(res.accounting.log)
        where = {sample.key: item.first + i for i, sample in enumerate(item.samples)}  # for the table's order
        for rej in res.accounting.log:
            images, videos = sizes.get(rej.key, ([], []))
            self.rows[(item.shard, rej.key)] = {
                "shard": item.shard, "key": rej.key, "status": "rejected", "reason": rej.reason, "detail": rej.detail,
                "image_sizes": images, "video_sizes": videos, "grids": [], "video_grids": [], "text_tokens": None,
                "image_tokens": None, "video_tokens": None, "vision_tokens": None, "file": None,
                "index": where.get(rej.key, 0)}
        for s in res.samples:
            images, videos = sizes.get(s.key, ([], []))
            row = {**self._sample_row(item.shard, s, images, videos), "index": where.get(s.key, 0)}
            self.rows[(item.shard, s.key)] = self.by_full_key[f"{item.shard}/{s.key}"] = row
        if self.keep:
            self.kept.extend(res.samples)
        return res

    def _sample_row(self, shard: str, s, images: list[str], videos: list[str]) -> dict:
        grids = [[int(v) for v in g] for g in s.image_grid_thw]
        video_grids = [[int(v) for v in g] for g in s.video_grid_thw]
        image_tokens = sum(self.spec.vision_tokens(g) for g in grids)
        video_tokens = sum(self.spec.vision_tokens(g) for g in video_grids)
        vision = image_tokens + video_tokens
        return {"shard": shard, "key": s.key, "status": "ok", "reason": "", "detail": "", "image_sizes": images,
                "video_sizes": videos, "grids": grids, "video_grids": video_grids, "text_tokens": s.num_tokens - vision,
                "image_tokens": image_tokens, "video_tokens": video_tokens, "vision_tokens": vision,
                "tokens": s.num_tokens, "file": None}

    def take_kept(self) -> list:
        kept, self.kept = self.kept, []
        return kept

    def mark_too_long(self, seq_len: int) -> list[Rejection]:
        """The samples packing skips (each longer than a row), marked in the table, as rejections."""
        out = []
        for r in self.rows.values():
            if r["status"] == "ok" and r["tokens"] > seq_len:
                r.update(status="skipped", reason="longer_than_seq_len")
                out.append(Rejection(r["shard"], r["key"], r["reason"], f"{r['tokens']} tokens > seq_len {seq_len}"))
        return out


def write_quarantine(path: str, rejections: list[Rejection]) -> None:
    import json

    with open(path, "w") as f:
        for r in rejections:
            is_rule = r.reason in RULE_REASONS or r.reason.startswith(RULE_PREFIX)
            f.write(json.dumps({"shard": r.shard, "key": r.key, "reason": r.reason, "detail": r.detail,
                                "kind": "skipped_by_rule" if is_rule else "quarantined"}) + "\n")


def _grids_text(row: dict) -> str:
    grids = ["x".join(map(str, g)) for g in row["grids"]] + ["v" + "x".join(map(str, g)) for g in row["video_grids"]]
    return ",".join(grids) or "-"


def print_table(rows: list[dict], max_rows: int = 500, out=sys.stdout) -> None:
    """One line per sample: key, stored sizes, grids (videos as vTxHxW), text and vision tokens
    (image and video pads alike), the packed file it is in, the reason it was rejected."""
    w = min(48, max([10] + [len(r["key"]) for r in rows[:max_rows]]))
    print(f"{'key':{w}} {'stored (WxH)':22} {'grid (t,h,w)':22} {'text':>6} {'vision':>7} {'file':17} reason", file=out)
    for r in rows[:max_rows]:
        sizes = ",".join(r["image_sizes"] + r["video_sizes"]) or "-"
        text = "-" if r["text_tokens"] is None else str(r["text_tokens"])
        vision = "-" if r["vision_tokens"] is None else str(r["vision_tokens"])
        reason = r["reason"] + (f" ({r['detail'][:60]})" if r["detail"] else "")
        file = (r["file"] or "-") + (f":{r['row']}" if r.get("row") is not None else "")
        print(f"{r['key'][:w]:{w}} {sizes[:22]:22} {_grids_text(r)[:22]:22} {text:>6} {vision:>7} {file:17} {reason}",
              file=out)
    if len(rows) > max_rows:
        print(f"... {len(rows) - max_rows} more rows in summary.json", file=out)
