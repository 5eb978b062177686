"""``vlmfeed info``: what shards hold, from tar and image headers, without decoding a pixel (as
Megatron-Energon's ``energon info`` describes a prepared dataset): shards and samples, member
formats, image sizes, text and vision tokens per sample at the pipeline's pixel limits, and the
samples a run would reject, by the service's own reasons, wherever headers tell.

    vlmfeed info 'laion/{00000..00009}.tar' --limit 20000 --json laion-info.json

Each sample takes the service's header path, the one ``datasvc.pack.sizes`` plans balanced runs with:
the shard reader's rejections (cut tars, unsafe or repeated members, text over the read limit, bad
JSON, formats not decoded here), missing text, the ``--filter`` rules, each image's header probe
(the pixel cap, cut files, bytes no decoder identifies) and the chat template
(``datasvc.pack.headers.encode_from_headers``), and each video's container headers. Members are read
whole within the read limits (an image file over 64 MiB is rejected unread), because a cut image
shows only at its end; PIL parses the header and no pixel is decoded. Text tokens are a sample's
ChatML row without its vision placeholders; vision tokens are those placeholders, at the grid the
pipeline's pixel limits give each image and video.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter, defaultdict

import numpy as np

from datasvc.read.filters import add_filter_flags, filters_from_flags
from datasvc.training import add_data_flags, geometry_from_flags
from datasvc.usage import HelpFormatter, UserError, positive_int

# (key, table label) of the distributions reported, in table order
MEASURES = (("image_width", "image width (px)"), ("image_height", "image height (px)"),
            ("image_megapixels", "image megapixels"), ("image_kib", "image file (KiB)"),
            ("images_per_sample", "images / sample"), ("video_seconds", "video seconds"),
            ("text_tokens", "text tokens / sample"), ("vision_tokens", "vision tokens / sample"),
            ("tokens", "tokens / sample"))
EXAMPLES_PER_REASON = 3


class Census:
    """What the samples read so far hold: member formats, sample shapes, each measure's values,
    and every rejection counted by reason as a run counts them (``datasvc.rejects.Accounting``)."""

    def __init__(self):
        from datasvc.rejects import Accounting

        self.acct = Accounting(max_log=0)  # counts only: the examples below name a few per reason
        self.shards_read = 0
        self.members: Counter = Counter()  # member extension (its last part: 0.jpg -> jpg) -> count
        self.shapes: Counter = Counter()  # usable samples by what they hold
        self.values: dict[str, list] = defaultdict(list)
        self.examples: dict[str, list] = defaultdict(list)

    def reject(self, shard: str, key: str, reason: str, detail: str = "") -> None:
        self.acct.reject(shard, key, reason, detail)
        if len(self.examples[reason]) < EXAMPLES_PER_REASON:
            self.examples[reason].append({"shard": shard, "key": key, "detail": detail[:200]})

    def usable(self, images: list, videos: list, tokens: int, vision_tokens: int) -> None:
        """``images``: (ImageHeader, file bytes) each; ``videos``: ``datasvc.media.video.VideoPlan`` each."""
        self.acct.delivered += 1
        self.shapes["with video" if videos else "text only" if not images else
                    "one image" if len(images) == 1 else "several images"] += 1
        for header, size in images:
            self.values["image_width"].append(header.width)
            self.values["image_height"].append(header.height)
            self.values["image_megapixels"].append(header.pixels / 1e6)
            self.values["image_kib"].append(size / 1024)
        self.values["video_seconds"].extend(v.header.duration for v in videos)
        self.values["images_per_sample"].append(len(images))
        self.values["text_tokens"].append(tokens - vision_tokens)
        self.values["vision_tokens"].append(vision_tokens)
        self.values["tokens"].append(tokens)

    def as_dict(self, shards: list[str], pipeline, limit: int | None) -> dict:
        acct = self.acct
        measures = {key: _distribution(self.values[key]) for key, _ in MEASURES if self.values[key]}
        return {
            "shards": {"count": len(shards), "read": self.shards_read, "first": shards[0], "last": shards[-1]},
            "limit": limit,
            "pipeline": {"name": pipeline.name, "min_pixels": pipeline.vision.min_pixels,
                         "max_pixels": pipeline.vision.max_pixels,
                         "max_decode_pixels": pipeline.vision.max_decode_pixels},
            "samples": {"read": acct.read, "usable": acct.delivered, "rejected": acct.n_quarantined,
                        "skipped_by_rule": acct.n_skipped},
            "shapes": dict(self.shapes.most_common()),
            "members": dict(self.members.most_common()),
            "measures": measures,
            "rejected": dict(acct.quarantined.most_common()),
            "skipped_by_rule": dict(acct.skipped_by_rule.most_common()),
            "ignored_members": dict(acct.ignored_members.most_common()),
            "noted": dict(acct.noted.most_common()),
            "examples": dict(self.examples),
        }


def _distribution(values: list) -> dict:
    p50, p90 = np.percentile(values, [50, 90])
    return {"count": len(values), "p50": float(p50), "p90": float(p90), "max": float(max(values)),
            "mean": float(np.mean(values))}


class HeaderReader:
    """Samples read as the service's header planner reads them (``datasvc.pack.sizes.HeaderProcessor``):
    the same pipeline, read limits and rules, built from a ``ServiceConfig`` the same way."""

    def __init__(self, cfg, seq_len: int | None = None):
        from datasvc.pack.sizes import HeaderProcessor

        planner = HeaderProcessor(cfg)
        self.pipeline, self.limits, self.rules = planner.pipeline, planner.limits, planner.rules
        self.seq_len = seq_len

    def read_shard(self, path: str, census: Census, limit: int | None = None) -> int:
        """Read up to ``limit`` of the shard's samples into ``census``; how many were read."""
        from datasvc.read.shards import index_shard, read_samples

        samples = index_shard(path).samples[:limit]
        for s in samples:
            census.members.update(m.ext.rsplit(".", 1)[-1] for m in s.members)
        ignored: dict = {}
        for raw in read_samples(path, samples, self.limits, ignored):
            self.read_sample(raw, census)
        census.acct.count_read(ignored)
        census.shards_read += 1
        return len(samples)

    def read_sample(self, raw, census: Census) -> None:
        from datasvc.media.imagefile import probe
        from datasvc.media.video import plan_video
        from datasvc.pack.headers import encode_from_headers
        from datasvc.read.shards import why_no_text

        census.acct.read += 1
        if not raw.problem and raw.text is None and raw.conversation is None:
            return census.reject(raw.shard, raw.key, "missing_text", why_no_text(raw))
        broken = self.rules.check(raw) if self.rules and not raw.problem else None
        if broken:
            return census.reject(raw.shard, raw.key, broken)
        spec = self.pipeline.vision
        try:
            ids, _labels, grids = encode_from_headers(raw, self.pipeline)
            videos = [plan_video(data, spec, self.pipeline.video) for _ext, data in raw.videos]
            images = [(probe(data, spec.max_decode_pixels, spec.exif_orientation), len(data))
                      for _ext, data in raw.images]
        except Exception as exc:  # ImageRejected, SampleRejected; anything else a run counts as encode_error
            reason = getattr(exc, "reason", "encode_error")
            return census.reject(raw.shard, raw.key, reason, getattr(exc, "detail", f"{type(exc).__name__}: {exc}"))
        if self.seq_len and len(ids) > self.seq_len:
            return census.reject(raw.shard, raw.key, "longer_than_seq_len",
                                 f"{len(ids)} tokens > seq_len {self.seq_len}")
        vision = sum(spec.vision_tokens(g) for g in grids) + sum(spec.vision_tokens(v.grid) for v in videos)
        census.usable(images, videos, len(ids), vision)


# ---- the table ------------------------------------------------------------------------------------

def _number(value: float) -> str:
    if abs(value) >= 100 or float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:.2f}"


def _counts(counts: dict) -> str:
    return ", ".join(f"{name} {n:,}" for name, n in counts.items()) or "none"


def render(info: dict) -> str:
    """The report as people read it: totals, then the distributions, then the rejections."""
    shards, samples, pipe = info["shards"], info["samples"], info["pipeline"]
    where = shards["first"] if shards["count"] == 1 else f"{shards['first']} .. {shards['last']}"
    read = f"{shards['read']} of {shards['count']}" if shards["read"] < shards["count"] else f"{shards['count']}"
    limit = f" (--limit {info['limit']})" if info["limit"] else ""
    lines = [f"shards    {read} read: {where}",
             f"samples   {samples['read']:,} read{limit}: {samples['usable']:,} usable, {samples['rejected']:,} "
             f"rejected, {samples['skipped_by_rule']:,} skipped by rule",
             f"shapes    {_counts(info['shapes'])}",
             f"members   {_counts(info['members'])}"]
    if info["ignored_members"] or info["noted"]:
        lines.append(f"ignored   {_counts(info['ignored_members'] | info['noted'])}")
    lines.append(f"pipeline  {pipe['name']}: images resized to {pipe['min_pixels']:,}-{pipe['max_pixels']:,} pixels, "
                 f"headers over {pipe['max_decode_pixels']:,} pixels rejected")
    if info["measures"]:
        lines += ["", f"{'usable samples':26}{'p50':>10}{'p90':>10}{'max':>10}{'count':>10}"]
        for key, label in MEASURES:
            d = info["measures"].get(key)
            if d:
                lines.append(f"{label:26}" + "".join(f"{_number(d[k]):>10}" for k in ("p50", "p90", "max"))
                             + f"{d['count']:>10,}")
    for title, counts in (("rejected, as a run would count them", info["rejected"]),
                          ("skipped by rule", info["skipped_by_rule"])):
        if counts:
            lines += ["", title]
            for reason, n in counts.items():
                first = info["examples"][reason][0]
                example = f"{os.path.basename(first['shard'])}:{first['key']}" + (
                    f"  {first['detail']}" if first["detail"] else "")
                lines.append(f"  {reason:28}{n:>8,}   e.g. {example}")
    return "\n".join(lines)


# ---- the command ----------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vlmfeed info", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("shards", nargs="+", help="shard paths, globs, brace patterns, directories or s3:// URLs")
    ap.add_argument("--limit", type=positive_int, default=None, help="read only the first N samples")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    add_data_flags(ap, "--pipeline")
    # vision tokens and the samples a run would skip as too long (longer_than_seq_len), at its geometry
    add_data_flags(ap, "--device", "--seq-len", "--max-pixels", "--min-pixels")
    add_filter_flags(ap)  # the rules a run would apply
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (shown after a few seconds)")
    return ap


def _reader(args, paths: list[str]) -> HeaderReader:
    from datasvc.config import ServiceConfig

    try:
        geometry = geometry_from_flags(args, args.pipeline)
        cfg = ServiceConfig(shards=tuple(paths), pipeline=args.pipeline, pipeline_options=geometry["pipeline_options"],
                            filters=filters_from_flags(args))
        return HeaderReader(cfg, geometry["seq_len"])
    except (ValueError, TypeError) as exc:  # an unknown pipeline or option, limits that contradict
        raise UserError(str(exc)) from None


def census_of(paths: list[str], reader: HeaderReader, limit: int | None = None, progress: bool = True) -> Census:
    """Every shard's samples (the first ``limit`` in shard order) read into one census."""
    from tqdm import tqdm

    census = Census()
    bar = tqdm(total=len(paths), unit="shard", desc="vlmfeed info", delay=3, file=sys.stderr, disable=not progress)
    left = limit
    for path in paths:
        if left is not None and left <= 0:
            break
        read = reader.read_shard(path, census, left)
        left = None if left is None else left - read
        bar.set_postfix(samples=census.acct.read, refresh=False)
        bar.update(1)
    bar.close()
    return census


def main(argv: list[str] | None = None) -> int:
    from datasvc.read.shards import expand_shards

    args = _parser().parse_args(argv)
    try:
        if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
            raise UserError(f"--json {args.json}: no such directory to write it in")
        paths = expand_shards(args.shards)  # NoShardsError is a UserError
        reader = _reader(args, paths)
    except UserError as exc:
        print(f"vlmfeed info: {exc}", file=sys.stderr)
        return 2
    census = census_of(paths, reader, args.limit, progress=not args.no_progress)
    info = census.as_dict(paths, reader.pipeline, args.limit)
    print(render(info))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    from datasvc.tools.cli import main as vlmfeed

    sys.exit(vlmfeed(["info", *sys.argv[1:]]))
