"""WebDataset shards: listing, indexing by tar headers, and reading samples by byte offset.

A shard is indexed once (headers only: names, offsets, sizes) into sample groups; a work item then
names a range of groups and is read with plain seeks, so any actor can redo any item exactly.
Plain and gzip tars are read (``datasvc.tarscan``); a damaged header costs the samples it touched,
not the rest of the shard. Member data is only ever read as bytes: nothing is unpickled, nothing is
written to disk, and no link is followed outside the shard.

Every sample indexed comes out of ``read_samples`` as a ``RawSample``, clean or with the ``problem``
the run counts it under; no exception of one sample's bytes escapes it.
"""
from __future__ import annotations

import glob
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field

from braceexpand import braceexpand

from datasvc.tarscan import Entry, Gap, Scan, open_archive

IMAGE_EXTS = ("jpg", "jpeg", "jpe", "jfif", "png", "apng", "webp", "gif", "bmp", "tif", "tiff")
# Images and videos this service does not decode: the sample is rejected rather than trained
# without them as text alone.
UNDECODED_MEDIA_EXTS = ("heic", "heif", "avif", "jxl", "jp2", "j2k", "jpx", "svg", "ico", "tga", "psd", "pbm",
                        "pgm", "ppm", "pnm", "dng", "cr2", "nef", "arw", "exr", "hdr", "dds", "pcx", "eps", "xcf",
                        "avi", "m4v")
VIDEO_EXTS = ("mp4", "webm", "mkv", "mov")  # decoded by datasvc.video
# Members that would execute code when unpickled: never loaded, always counted.
PICKLE_EXTS = ("pyd", "pickle", "pkl", "pth", "npy", "npz")
MAX_JSON_DEPTH = 64
"""JSON nested deeper than this is ``bad_json``: a conversation is 3 levels, metadata a few more, and
deeper values would hit Python's recursion limit wherever they are printed or pickled."""


class NoShardsError(FileNotFoundError):
    pass


def expand_shards(patterns: str | list[str]) -> list[str]:
    """Paths, globs and brace patterns (``data/shard-{000..009}.tar``) -> sorted existing files.

    A path that does not exist, a directory, or a glob that matches no file is an error naming it:
    a shard left out silently would be data lost uncounted."""
    if isinstance(patterns, str):
        patterns = [patterns]
    found: list[str] = []
    missing: list[str] = []
    from datasvc.energon import split_shards
    from datasvc.storage import expand as expand_remote, is_remote

    for pattern in patterns:
        prepared = split_shards(pattern)  # a prepared Energon dataset: DIR or DIR:SPLIT
        if prepared is not None:
            found.extend(prepared)
            continue
        for expanded in braceexpand(pattern):
            if is_remote(expanded):  # s3://, gs://, ...: listed and read through datasvc.storage
                hits, lost = expand_remote(expanded)
                found.extend(hits)
                missing.extend(lost)
            elif glob.has_magic(expanded):
                matches = [m for m in sorted(glob.glob(expanded)) if os.path.isfile(m)]
                if not matches:
                    missing.append(f"{expanded} (matches no file)")
                found.extend(matches)
            elif os.path.isdir(expanded):
                missing.append(f"{expanded} (a directory: name its files, e.g. {os.path.join(expanded, '*.tar')})")
            elif not os.path.isfile(expanded):
                missing.append(f"{expanded} (no such file)")
            else:
                found.append(expanded)
    if not found:
        raise NoShardsError(f"no shard files match {patterns!r}: check the path, glob or brace pattern")
    if missing:
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise NoShardsError(f"no shard files match {'; '.join(missing[:10])}{more}: fix or remove these "
                            f"(the other patterns matched {len(set(found))} files)")
    return sorted(dict.fromkeys(found))


@dataclass(frozen=True, slots=True)
class Member:
    ext: str  # lower-cased, e.g. "jpg", "0.jpg", "txt"
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class SampleIndex:
    key: str
    members: tuple[Member, ...]
    problem: str = ""  # a reason found while indexing (unsafe name, truncated), read as a rejection
    detail: str = ""
    repeated: bool = False  # the key was seen earlier in this shard (counted, still read)


@dataclass(slots=True)
class ShardIndex:
    path: str
    samples: list[SampleIndex] = field(default_factory=list)
    truncated: bool = False
    damaged_headers: int = 0  # headers that failed their checksum; the bytes after each were skipped
    lost_bytes: int = 0  # bytes skipped to the next valid header


_UNSAFE = re.compile(r"(^/|(^|/)\.\.(/|$))")


def split_name(name: str) -> tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of the basename."""
    directory, base = os.path.split(name)
    stem, dot, ext = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), ext.lower()


def _clean(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name


@dataclass(slots=True)
class _Group:
    key: str
    members: list = field(default_factory=list)
    problem: str = ""
    detail: str = ""
    repeated: bool = False
    exts: set = field(default_factory=set)

    def mark(self, problem: str, detail: str = "") -> None:
        if not self.problem:
            self.problem, self.detail = problem, detail


class _Grouper:
    """Consecutive members with one key make a sample; what the scan met is charged to samples."""

    def __init__(self):
        self.groups: list[_Group] = []
        self.files: dict[str, tuple[int, int]] = {}  # regular members so far, for hardlinks
        self.keys: set[str] = set()
        self.lost_key: str | None = None  # a damaged header's key, not yet matched to a sample
        self.unnamed: list[list] = []  # [sample before, sample after, where, trust neither] per gap
        self.damaged, self.lost_bytes = 0, 0

    def entry(self, e: Entry) -> None:
        if e.kind == "dir":
            return
        name = _clean(e.name)
        key, ext = split_name(name)
        g = self._group(key)
        if self.unnamed and self.unnamed[-1][1] is None:
            self.unnamed[-1][1] = g
        if _UNSAFE.search(name):
            g.mark("unsafe_member_name", name[:120])
        elif e.kind == "symlink":
            g.mark("symlink_member", f"{name} -> {e.linkname}"[:200])
        elif e.kind == "special":
            g.mark("special_member", f"{name} is not a regular file")
        elif ext in g.exts:
            g.mark("duplicate_member", f"{name} appears twice in a row of members")
        g.exts.add(ext)
        if e.kind == "hardlink":
            target = self.files.get(_clean(e.linkname))
            if target is None:
                g.mark("dangling_hardlink", f"{name} links to {e.linkname}, not an earlier member of this shard")
                return
            g.members.append(Member(ext, *target))
        elif e.kind == "file":
            self.files[name] = (e.offset, e.size)
            g.members.append(Member(ext, e.offset, e.size))

    def _group(self, key: str) -> _Group:
        if self.groups and self.groups[-1].key == key:
            return self.groups[-1]
        self._settle_lost(key)
        g = _Group(key, repeated=key in self.keys)
        self.keys.add(key)
        if self.lost_key == key:
            g.mark("corrupt_tar_header", "a member's header is damaged")
            self.lost_key = None
        self.groups.append(g)
        return g

    def _settle_lost(self, next_key: str | None) -> None:
        """A damaged member whose sample neither precedes nor follows the gap was a sample alone."""
        if self.lost_key is not None and self.lost_key != next_key:
            self.groups.append(_Group(self.lost_key, problem="corrupt_tar_header",
                                      detail="every member's header is damaged"))
            self.keys.add(self.lost_key)
            self.lost_key = None

    def gap(self, gap: Gap) -> None:
        self.damaged += 1
        self.lost_bytes += max(0, gap.end - gap.offset)
        where = f"damaged tar header at byte {gap.offset}"
        key = split_name(_clean(gap.name))[0] if gap.name else None
        self._settle_lost(key)
        if gap.one_member:  # exactly one member lost, and its name is known
            if self.groups and self.groups[-1].key == key:
                self.groups[-1].mark("corrupt_tar_header", where)
            else:
                self.lost_key = key
            return
        if key is None:  # who lost what is settled at the end, from the samples on either side
            self.unnamed.append([self.groups[-1] if self.groups else None, None, where, False])
            return
        # A legible name, but more than its member was lost: neither neighbour is trusted.
        self.unnamed.append([self.groups[-1] if self.groups else None, None, where, True])
        self.lost_key = key

    def _settle_unnamed(self) -> None:
        """Charge each illegible header's loss: a neighbour missing a member the shard's samples
        usually have lost it; if both are whole, the bytes held a sample of their own, counted as
        lost; if both lack one, both are rejected."""
        usual = Counter(frozenset(g.exts) for g in self.groups).most_common(1)
        usual = usual[0][0] if usual else frozenset()
        for before, after, where, distrust in self.unnamed:
            split = before is not None and before is after  # the gap fell inside one sample
            sides = [g for g in ((before,) if split else (before, after)) if g is not None]
            short = sides if distrust or split else [g for g in sides if frozenset(g.exts) < usual]
            for g in short:
                g.mark("corrupt_tar_header", f"{where}; this sample lost a member")
            if sides and not short:
                at = next(i for i, g in enumerate(self.groups) if g is (before or after)) + (before is not None)
                self.groups.insert(at, _Group(f"<lost {where}>", problem="corrupt_tar_header",
                                              detail="the damaged bytes held a sample of their own"))

    def finish(self, ending: str) -> list[SampleIndex]:
        self._settle_lost(None)
        self._settle_unnamed()
        if ending and self.groups:  # the last sample may be incomplete: a rejection, not dropped silently
            self.groups[-1].problem, self.groups[-1].detail = "truncated_tar", ending
        if not self.groups and (ending or self.damaged):
            self.groups.append(_Group("<unreadable>", problem="unreadable_tar",
                                      detail=ending or "no valid tar header anywhere in the file"))
        return [SampleIndex(g.key, tuple(g.members), g.problem, g.detail, g.repeated) for g in self.groups]


def index_shard(path: str) -> ShardIndex:
    """Group consecutive tar members into samples by key, reading headers only."""
    index = ShardIndex(path)
    grouper = _Grouper()
    ending = ""
    try:
        with open_archive(path) as archive:
            scan = Scan(archive)
            for event in scan:
                grouper.gap(event) if isinstance(event, Gap) else grouper.entry(event)
            ending = scan.ending
    except Exception as exc:  # unreadable file, broken gzip stream: what was indexed stands
        ending = f"{type(exc).__name__}: {exc}"[:200] or type(exc).__name__
    index.samples = grouper.finish(ending)
    index.truncated = bool(ending)
    index.damaged_headers, index.lost_bytes = grouper.damaged, grouper.lost_bytes
    return index


@dataclass(slots=True)
class RawSample:
    shard: str
    key: str
    images: list[tuple[str, bytes]]  # (ext, bytes) in member-name order
    text: str | None  # caption
    conversation: object | None  # parsed json (never pickle)
    problem: str = ""
    detail: str = ""
    metadata: dict = field(default_factory=dict)  # a non-conversation JSON (img2dataset: url, similarity, ...)
    videos: list[tuple[str, bytes]] = field(default_factory=list)  # (ext, bytes) in member-name order


def why_no_text(raw: RawSample) -> str:
    """The ``missing_text`` detail: no text member at all, or a JSON member that says nothing usable."""
    if raw.metadata:
        keys = sorted(map(str, raw.metadata))
        return f"json member holds no caption text or conversation (keys: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''})"
    return "no txt or json member"


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadLimits:
    max_images_per_sample: int = 64
    max_text_bytes: int = 256 * 1024
    max_image_bytes: int = 64 * 1024 * 1024


class _Rejected(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def _image_order(ext: str) -> tuple:
    """Natural order of image members: ``2.jpg`` before ``10.jpg``, numbers before names; total for
    any mix of names (``jpg`` and ``0.jpg``), so sorting never fails."""
    return tuple((0, int(p), p) if p.isascii() and p.isdigit() else (1, 0, p) for p in ext.split("."))


def read_samples(path: str, samples: list[SampleIndex], limits: ReadLimits, ignored: "dict | None" = None):
    """Yield a RawSample per indexed sample, reading member bytes by offset.

    ``ignored`` counts members that are not part of a sample (pickles, unknown extensions) and
    ``repeated_key``: samples whose key appeared earlier in the shard."""
    with open_archive(path) as archive:
        for s in samples:
            raw = RawSample(path, s.key, [], None, None, s.problem, s.detail)
            if ignored is not None and s.repeated:
                ignored["repeated_key"] = ignored.get("repeated_key", 0) + 1
            if not s.problem:
                try:
                    _fill(raw, s, archive, limits, ignored)
                except _Rejected as exc:
                    raw = RawSample(path, s.key, [], None, None, exc.reason, exc.detail[:200])
                except Exception as exc:  # whatever one sample's bytes do, it costs that sample alone
                    raw = RawSample(path, s.key, [], None, None, "unreadable_sample", f"{type(exc).__name__}: {exc}"[:200])
            yield raw


def _fill(raw: RawSample, s: SampleIndex, archive, limits: ReadLimits, ignored: dict | None) -> None:
    from datasvc.formats import attach_json

    images, videos, text_member, json_member = [], [], None, None
    for m in s.members:
        last = m.ext.rsplit(".", 1)[-1]
        if last in IMAGE_EXTS:
            images.append(m)
        elif last in VIDEO_EXTS:
            videos.append(m)
        elif any(p in UNDECODED_MEDIA_EXTS or p in IMAGE_EXTS or p in VIDEO_EXTS for p in m.ext.split(".")):  # .heic, .jpg.gz
            raise _Rejected("unsupported_format", f"member .{m.ext}: not an image format decoded here")
        elif m.ext == "txt":
            text_member = m
        elif m.ext == "json":
            json_member = m
        elif ignored is not None:
            kind = "pickle_never_loaded" if last in PICKLE_EXTS else f"unknown:{last[:16]}"
            ignored[kind] = ignored.get(kind, 0) + 1
    if len(images) > limits.max_images_per_sample:
        raise _Rejected("too_many_images", f"{len(images)} > {limits.max_images_per_sample}")
    for m in (text_member, json_member):
        if m is not None and m.size > limits.max_text_bytes:
            raise _Rejected("text_too_long", f"{m.size} bytes > {limits.max_text_bytes}")
    big = [m for m in images + videos if m.size > limits.max_image_bytes]
    if big:
        raise _Rejected("image_file_too_large", f"{big[0].size} bytes")

    def read(m: Member) -> bytes:
        data = archive.read_at(m.offset, m.size)
        if len(data) != m.size:
            raise _Rejected("truncated_tar", f"member .{m.ext}: {len(data)} of {m.size} bytes")
        return data

    raw.images = [(m.ext, read(m)) for m in sorted(images, key=lambda m: _image_order(m.ext))]
    raw.videos = [(m.ext, read(m)) for m in sorted(videos, key=lambda m: _image_order(m.ext))]
    try:
        if text_member is not None:
            raw.text = read(text_member).decode("utf-8")
        if json_member is not None:
            attach_json(raw, parse_json(read(json_member).decode("utf-8")))
    except UnicodeDecodeError as exc:
        raise _Rejected("text_not_utf8", str(exc)[:120]) from None


_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json(text: str):
    """A JSON member -> its value, or ``_Rejected``: bad syntax, nesting deeper than
    ``MAX_JSON_DEPTH``, an integer too long to convert, or a lone surrogate escape (valid JSON,
    but not text a tokenizer can take)."""
    try:
        doc = json.loads(text)
    except RecursionError:
        raise _Rejected("bad_json", f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # syntax, and integers over Python's digit limit
        raise _Rejected("bad_json", str(exc)[:120]) from None
    stack = [(doc, 1)]
    while stack:  # iterative: the check must not recurse either
        node, depth = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise _Rejected("text_not_utf8", f"lone surrogate escape in a JSON string: {node[:40]!r}")
        elif isinstance(node, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise _Rejected("bad_json", f"nested deeper than {MAX_JSON_DEPTH} levels")
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for k, v in items:
                if isinstance(k, str):
                    stack.append((k, depth))
                stack.append((v, depth + 1))
    return doc
