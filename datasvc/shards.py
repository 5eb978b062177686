"""WebDataset shards: listing, indexing by tar headers, and reading samples by byte offset.

A shard is indexed once (headers only: names, offsets, sizes) into sample groups; a work item then
names a range of groups and is read with plain seeks, so any actor can redo any item exactly.
Member data is only ever read as bytes: nothing is unpickled, nothing is written to disk.
"""
from __future__ import annotations

import glob
import os
import re
import tarfile
from dataclasses import dataclass, field

from braceexpand import braceexpand

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
TEXT_EXTS = ("txt", "json")
# Members that would execute code when unpickled: never loaded, always counted.
PICKLE_EXTS = ("pyd", "pickle", "pkl", "pth", "npy", "npz")


class NoShardsError(FileNotFoundError):
    pass


def expand_shards(patterns: str | list[str]) -> list[str]:
    """Paths, globs and brace patterns (``data/shard-{000..009}.tar``) -> sorted existing files."""
    if isinstance(patterns, str):
        patterns = [patterns]
    found: list[str] = []
    for pattern in patterns:
        for expanded in braceexpand(pattern):
            matches = sorted(glob.glob(expanded)) if glob.has_magic(expanded) else [expanded]
            found.extend(m for m in matches if os.path.isfile(m))
    if not found:
        raise NoShardsError(f"no shard files match {patterns!r}: check the path, glob or brace pattern")
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


@dataclass(slots=True)
class ShardIndex:
    path: str
    samples: list[SampleIndex] = field(default_factory=list)
    truncated: bool = False


_UNSAFE = re.compile(r"(^/|(^|/)\.\.(/|$))")


def split_name(name: str) -> tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of the basename."""
    directory, base = os.path.split(name)
    stem, dot, ext = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), ext.lower()


def index_shard(path: str) -> ShardIndex:
    """Group consecutive tar members into samples by key, reading headers only."""
    index = ShardIndex(path)
    groups: list[tuple[str, list[Member], str]] = []
    try:
        with tarfile.open(path, mode="r:") as tar:
            while True:
                info = tar.next()
                if info is None:
                    break
                if not info.isfile():
                    continue
                key, ext = split_name(info.name)
                problem = "unsafe_member_name" if _UNSAFE.search(info.name) else ""
                if groups and groups[-1][0] == key:
                    groups[-1][1].append(Member(ext, info.offset_data, info.size))
                    if problem and not groups[-1][2]:
                        groups[-1] = (key, groups[-1][1], problem)
                else:
                    groups.append((key, [Member(ext, info.offset_data, info.size)], problem))
            end = tar.offset
        size = os.path.getsize(path)
        if groups and any(m.offset + m.size > size for m in groups[-1][1]):
            raise tarfile.ReadError("member data runs past the end of the file")
        # tarfile stops quietly at a cut header; a complete archive ends in zero blocks.
        with open(path, "rb") as f:
            f.seek(end)
            trailer = f.read(1 << 16)
        if groups and (not trailer or trailer.strip(b"\0")):
            raise tarfile.ReadError("archive ends without its end-of-archive blocks")
    except (tarfile.TarError, EOFError, OSError):
        index.truncated = True
        if groups:  # the last group may be incomplete: it is read as a rejection, not silently dropped
            key, members, _ = groups[-1]
            groups[-1] = (key, members, "truncated_tar")
        else:
            groups.append(("<unreadable>", [], "unreadable_tar"))
    index.samples = [SampleIndex(k, tuple(m), p) for k, m, p in groups]
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


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadLimits:
    max_images_per_sample: int = 64
    max_text_bytes: int = 256 * 1024
    max_image_bytes: int = 64 * 1024 * 1024


def _image_order(ext: str) -> tuple:
    parts = ext.split(".")
    return tuple(int(p) if p.isdigit() else p for p in parts)


def read_samples(path: str, samples: list[SampleIndex], limits: ReadLimits, ignored: "dict | None" = None):
    """Yield a RawSample per indexed sample, reading member bytes by offset."""
    import json

    from datasvc.formats import attach_json

    with open(path, "rb") as f:
        for s in samples:
            raw = RawSample(path, s.key, [], None, None, s.problem)
            if s.problem:
                yield raw
                continue
            image_members, text_member, json_member = [], None, None
            for m in s.members:
                last = m.ext.rsplit(".", 1)[-1]
                if last in IMAGE_EXTS:
                    image_members.append(m)
                elif m.ext == "txt":
                    text_member = m
                elif m.ext == "json":
                    json_member = m
                elif ignored is not None:
                    kind = "pickle_never_loaded" if last in PICKLE_EXTS else f"unknown:{last[:16]}"
                    ignored[kind] = ignored.get(kind, 0) + 1
            if len(image_members) > limits.max_images_per_sample:
                raw.problem, raw.detail = "too_many_images", f"{len(image_members)} > {limits.max_images_per_sample}"
                yield raw
                continue
            for m in (text_member, json_member):
                if m is not None and m.size > limits.max_text_bytes:
                    raw.problem, raw.detail = "text_too_long", f"{m.size} bytes > {limits.max_text_bytes}"
            big = [m for m in image_members if m.size > limits.max_image_bytes]
            if big:
                raw.problem, raw.detail = "image_file_too_large", f"{big[0].size} bytes"
            if raw.problem:
                yield raw
                continue

            def read(m: Member) -> bytes:
                f.seek(m.offset)
                data = f.read(m.size)
                if len(data) != m.size:
                    raise EOFError("short read")
                return data

            try:
                raw.images = [(m.ext, read(m)) for m in sorted(image_members, key=lambda m: _image_order(m.ext))]
                if text_member is not None:
                    raw.text = read(text_member).decode("utf-8")
                if json_member is not None:
                    attach_json(raw, json.loads(read(json_member).decode("utf-8")))
            except UnicodeDecodeError as exc:
                raw.problem, raw.detail = "text_not_utf8", str(exc)[:120]
            except json.JSONDecodeError as exc:
                raw.problem, raw.detail = "bad_json", str(exc)[:120]
            except (EOFError, OSError) as exc:
                raw.problem, raw.detail = "truncated_tar", str(exc)
            yield raw
