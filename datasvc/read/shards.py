"""WebDataset shards: listing, indexing by tar headers, and reading samples by byte offset.

A shard is indexed once (headers only: names, offsets, sizes) into sample groups; a work item then
names a range of groups and is read with plain seeks, so any actor can redo any item exactly.
Plain and gzip tars are read (``datasvc.read.tarscan``); a damaged header costs the samples it touched,
not the rest of the shard. Member data is only ever read as bytes: nothing is unpickled, nothing is
written to disk, and no link is followed outside the shard.

Every sample indexed comes out of ``read_samples`` as a ``RawSample``, clean or with the ``problem``
the run counts it under; no exception of one sample's bytes escapes it. Each sample carries the
shard's identity when it was indexed (size and modification time, or size and ETag), and is read
only while the file still has it: a shard rewritten since costs its samples ``shard_changed``
instead of handing out bytes that moved. Every size a header declares is checked against the
file and the read limits before a byte of it is read.

Keys follow WebDataset's rule (the path up to the first dot of the basename; the rest, lower-cased,
is the member's extension), with keys in Unicode NFC, so a caption named in NFD meets its image.
"""
from __future__ import annotations

import json
import os
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field

from datasvc.members import (IMAGE_EXTS, MEDIA_EXTS, PICKLE_EXTS, UNDECODED_MEDIA_EXTS, VIDEO_EXTS,  # noqa: F401
                             encoded_bytes, image_order, sort_members)
from datasvc.read.shardpaths import (SHARD_SUFFIXES, NoShardsError, archive_stamp, expand_shards,  # noqa: F401
                                shard_stamp, shard_where)
from datasvc.read.tarscan import Entry, Gap, Scan, open_archive

MAX_JSON_DEPTH = 64
"""JSON nested deeper than this is ``bad_json``: a conversation is 3 levels, metadata a few more, and
deeper values would hit Python's recursion limit wherever they are printed or pickled."""


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
    image_expected: bool = False  # it holds no image or video, and other samples of its shard do
    # The shard's identity when indexed: (absolute path or URL, *``shard_stamp``); () reads it
    # unchecked. Where the sample came from, not what it is: two listings of one sample compare equal.
    stamp: tuple = field(default=(), compare=False)


@dataclass(slots=True)
class ShardIndex:
    path: str
    samples: list[SampleIndex] = field(default_factory=list)
    truncated: bool = False
    damaged_headers: int = 0  # headers that failed their checksum; the bytes after each were skipped
    lost_bytes: int = 0  # bytes skipped to the next valid header
    stamp: tuple = ()  # the file's identity when indexed, as ``SampleIndex.stamp``


_UNSAFE = re.compile(r"(^/|(^|/)\.\.(/|$))")


def split_name(name: str) -> tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of the basename, the extension the
    rest, lower-cased (``img.001.jpg``: key ``img``, extension ``001.jpg``). Keys are NFC, so names
    written in NFD by one tool and NFC by another (macOS, Linux) still pair up."""
    directory, base = os.path.split(unicodedata.normalize("NFC", name))
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
        if e.problem:
            g.mark(e.problem, f"{name}: {e.detail}")
        elif _UNSAFE.search(name):
            g.mark("unsafe_member_name", name[:120])
        elif e.kind == "sparse":
            g.mark("sparse_member", f"{name} is stored sparse (holes and data, GNU tar -S): not read")
        elif e.kind == "symlink":
            g.mark("symlink_member", f"{name} -> {e.linkname}"[:200])
        elif e.kind == "special":
            g.mark("special_member", f"{name} is not a regular file")
        elif ext in g.exts:
            g.mark("duplicate_member", f"{name} appears twice in a row of members")
        g.exts.add(ext)
        if e.kind == "hardlink":
            target = self.files.get(unicodedata.normalize("NFC", _clean(e.linkname)))
            if target is None:
                g.mark("dangling_hardlink", f"{name} links to {e.linkname}, not an earlier member of this shard")
                return
            g.members.append(Member(ext, *target))
        elif e.kind == "file":
            self.files[unicodedata.normalize("NFC", name)] = (e.offset, e.size)
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

    def finish(self, ending: str, stamp: tuple = (), empty: str = "") -> list[SampleIndex]:
        """The samples; ``empty`` says why a shard with none is counted once as ``unreadable_tar``."""
        self._settle_lost(None)
        self._settle_unnamed()
        if ending and self.groups:  # the last sample may be incomplete: a rejection, not dropped silently
            self.groups[-1].problem, self.groups[-1].detail = "truncated_tar", ending
        if not self.groups:
            self.groups.append(_Group("<unreadable>", problem="unreadable_tar", detail=ending or (
                "no valid tar header anywhere in the file" if self.damaged else empty or "no member in the file")))
        media = [any(e.rsplit(".", 1)[-1] in MEDIA_EXTS for e in g.exts) for g in self.groups]
        return [SampleIndex(g.key, tuple(g.members), g.problem, g.detail, g.repeated,
                            image_expected=any(media) and not has, stamp=stamp) for g, has in zip(self.groups, media)]


def index_shard(path: str) -> ShardIndex:
    """Group consecutive tar members into samples by key, reading headers only."""
    index = ShardIndex(path)
    grouper = _Grouper()
    ending, empty, stamp = "", "", ()
    try:
        with open_archive(path) as archive:
            stamp = (shard_where(path), *archive_stamp(path, archive))
            scan = Scan(archive)
            for event in scan:
                grouper.gap(event) if isinstance(event, Gap) else grouper.entry(event)
            ending = scan.ending
            empty = (f"all {scan.scanned} bytes are zero: no tar member (an empty archive, or a file "
                     f"allocated and never written)" if scan.only_zeros else
                     f"its {scan.members} member(s) are all directories: no sample" if scan.members else "")
    except Exception as exc:  # unreadable file, broken gzip stream: what was indexed stands
        ending = f"{type(exc).__name__}: {exc}"[:200] or type(exc).__name__
    index.samples = grouper.finish(ending, stamp, empty)
    index.stamp = stamp
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
    max_sample_bytes: int = 512 << 20
    """Encoded bytes of one sample's members (images, videos, text), from its tar headers: a sample
    over it is ``sample_too_large`` before a byte is read (``BudgetConfig.encoded_bytes_budget``)."""

    @classmethod
    def of(cls, budget) -> "ReadLimits":
        """The limits a ``BudgetConfig`` sets, so every reader of a config's shards refuses the same samples."""
        return cls(max_images_per_sample=budget.max_images_per_sample, max_text_bytes=budget.max_text_bytes,
                   max_sample_bytes=budget.encoded_bytes_budget)


class _Rejected(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def sample_bytes(s: SampleIndex) -> int:
    """Encoded bytes reading the sample holds: its images, videos and text, from its tar headers."""
    return encoded_bytes(s.members)


def read_samples(path: str, samples: list[SampleIndex], limits: ReadLimits, ignored: "dict | None" = None):
    """Yield a RawSample per indexed sample, reading member bytes by offset.

    ``ignored`` counts members that are not part of a sample (pickles, unknown extensions) and
    ``repeated_key``: samples whose key appeared earlier in the shard."""
    with open_archive(path) as archive:
        changed = _changed(path, archive, samples)
        for s in samples:
            raw = RawSample(path, s.key, [], None, None, s.problem, s.detail)
            if ignored is not None and s.repeated:
                ignored["repeated_key"] = ignored.get("repeated_key", 0) + 1
            changed = changed or _changed(path, archive, [s], recheck=True)
            if changed and not s.problem:
                raw.problem, raw.detail = "shard_changed", changed
            elif not s.problem:
                try:
                    _fill(raw, s, archive, limits, ignored)
                except _Rejected as exc:
                    raw = RawSample(path, s.key, [], None, None, exc.reason, exc.detail[:200])
                except Exception as exc:  # whatever one sample's bytes do, it costs that sample alone
                    raw = RawSample(path, s.key, [], None, None, "unreadable_sample", f"{type(exc).__name__}: {exc}"[:200])
            yield raw


def _changed(path: str, archive, samples: list[SampleIndex], recheck: bool = False) -> str:
    """Why the file is no longer the one these samples were indexed from, or ''. ``recheck``: look
    again where it is cheap (a local file), between samples."""
    where, *then = next((s.stamp for s in samples if s.stamp), ("",))
    if not then or where != shard_where(path) or (recheck and not hasattr(archive, "stamp_now")):
        return ""  # no identity recorded, or bytes of another copy: nothing to compare
    now = list(archive.stamp_now() if recheck else archive_stamp(path, archive))
    if not now or now == then:
        return ""
    return (f"the file changed since it was indexed (size, version {then} then, {now} now): "
            "its samples are not read from bytes that moved; a new plan indexes it again")[:200]


def _fill(raw: RawSample, s: SampleIndex, archive, limits: ReadLimits, ignored: dict | None) -> None:
    from datasvc.read.formats import attach_json

    members = sort_members(s.members)
    _refuse_from_headers(s, members, archive, limits)
    if ignored is not None:
        for m in members.ignored:
            last = m.ext.rsplit(".", 1)[-1]
            kind = "pickle_never_loaded" if last in PICKLE_EXTS else f"unknown:{last[:16]}"
            ignored[kind] = ignored.get(kind, 0) + 1
        if members.dotted_text and (members.text or members.json):
            ignored["unused_dotted_text"] = ignored.get("unused_dotted_text", 0) + len(members.dotted_text)

    def read(m: Member) -> bytes:
        data = archive.read_at(m.offset, m.size)
        if len(data) != m.size:
            raise _Rejected("truncated_tar", f"member .{m.ext}: {len(data)} of {m.size} bytes")
        return data

    raw.images = [(m.ext, read(m)) for m in sorted(members.images, key=lambda m: image_order(m.ext))]
    raw.videos = [(m.ext, read(m)) for m in sorted(members.videos, key=lambda m: image_order(m.ext))]
    try:
        if members.text is not None:
            raw.text = read(members.text).decode("utf-8")
        if members.json is not None:
            attach_json(raw, parse_json(read(members.json).decode("utf-8")))
    except UnicodeDecodeError as exc:
        raise _Rejected("text_not_utf8", str(exc)[:120]) from None
    if s.image_expected and raw.conversation is None and raw.text is not None:
        raise _Rejected("missing_image", f"a caption with no image or video member (members: "
                        f"{', '.join(sorted(m.ext for m in s.members))}), where the shard's other samples have them")


def _refuse_from_headers(s: SampleIndex, members, archive, limits: ReadLimits) -> None:
    """The reasons a sample is refused from its headers alone, before any byte of it is read."""
    if members.unsupported:
        raise _Rejected("unsupported_format", f"member .{members.unsupported[0].ext}: not an image format decoded here")
    if members.dotted_text and not (members.text or members.json):
        exts = ", ".join(f".{m.ext}" for m in members.dotted_text[:4])
        raise _Rejected("dotted_text_member", f"text in {exts} but no {s.key}.txt or {s.key}.json: a key ends at the "
                        f"first dot of the name (WebDataset's rule), so these are extensions of sample {s.key!r}")
    if len(members.images) > limits.max_images_per_sample:
        raise _Rejected("too_many_images", f"{len(members.images)} > {limits.max_images_per_sample}")
    for m in (members.text, members.json):
        if m is not None and m.size > limits.max_text_bytes:
            raise _Rejected("text_too_long", f"{m.size} bytes > {limits.max_text_bytes}")
    big = [m for m in members.images + members.videos if m.size > limits.max_image_bytes]
    if big:
        raise _Rejected("image_file_too_large", f"{big[0].size} bytes")
    total = sample_bytes(s)
    if total > limits.max_sample_bytes:
        raise _Rejected("sample_too_large", f"its members hold {total >> 20} MiB encoded > encoded_bytes_budget "
                        f"{limits.max_sample_bytes >> 20} MiB (from its tar headers, nothing read)")
    end = getattr(archive, "size", None)
    for m in members.read:
        if m.size < 0 or m.offset < 0 or (end is not None and m.offset + m.size > end):
            raise _Rejected("truncated_tar", f"member .{m.ext} declares bytes [{m.offset}, {m.offset + m.size}) "
                            f"that the file ({end} bytes) does not hold")


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
