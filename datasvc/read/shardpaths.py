"""Shard files from what a user names: paths, globs, brace patterns, directories, object-store URLs
and prepared Energon datasets, each file once; and what tells a file's versions apart (its stamp).

One file reached by several names (a relative and an absolute path, a symlinked directory, a
hardlink) would train every sample once per name: such names are read as one file, the first in
sorted order, and a warning names the others.
"""
from __future__ import annotations

import glob
import logging
import os

from braceexpand import braceexpand

from datasvc.usage import UserError

log = logging.getLogger("vlmfeed.shards")


class NoShardsError(FileNotFoundError, UserError):
    pass


SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def _directory_shards(directory: str) -> list[str]:
    """A directory's shards: its tar files (plain or gzip), sorted; not its subdirectories."""
    return sorted(os.path.join(directory, name) for name in os.listdir(directory)
                  if name.endswith(SHARD_SUFFIXES) and os.path.isfile(os.path.join(directory, name)))


def _local(pattern: str) -> str:
    if pattern.startswith("pipe:"):
        raise NoShardsError(f"{pattern}: pipe: URLs (webdataset's shell commands) are not run; give the "
                            "shard's path, a glob or an s3:// URL")
    return pattern[len("file://"):] if pattern.startswith("file://") else pattern


def expand_shards(patterns: str | list[str]) -> list[str]:
    """Paths, globs, brace patterns (``data/shard-{000..009}.tar``), directories (their tar files) and
    object-store URLs -> sorted existing files.

    A path that does not exist, a directory without tars, or a glob that matches no file is an error
    naming it: a shard left out silently would be data lost uncounted. An unsupported URL scheme or a
    store that refuses the credentials is a ``UserError`` saying so. Names of one local file (its
    device and inode) are kept once, with a warning."""
    if isinstance(patterns, str):
        patterns = [patterns]
    found: list[str] = []
    missing: list[str] = []
    from datasvc.read.energon import split_shards
    from datasvc.read.storage import expand as expand_remote, is_remote

    for pattern in patterns:
        prepared = split_shards(pattern)  # a prepared Energon dataset: DIR or DIR:SPLIT
        if prepared is not None:
            found.extend(prepared)
            continue
        for expanded in map(_local, braceexpand(pattern)):
            if is_remote(expanded):  # s3://, gs://, ...: listed and read through datasvc.read.storage
                hits, lost = expand_remote(expanded)
                found.extend(hits)
                missing.extend(lost)
            elif glob.has_magic(expanded):
                matches = [m for m in sorted(glob.glob(expanded)) if os.path.isfile(m)]
                if not matches:
                    missing.append(f"{expanded} (matches no file)")
                found.extend(matches)
            elif os.path.isdir(expanded):
                inside = _directory_shards(expanded)
                if not inside:
                    missing.append(f"{expanded} (a directory with no {', '.join(SHARD_SUFFIXES)} files)")
                found.extend(inside)
            elif not os.path.isfile(expanded):
                missing.append(f"{expanded} (no such file)")
            else:
                found.append(expanded)
    if missing:
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        others = f" (the other patterns matched {len(set(found))} files)" if found else ""
        raise NoShardsError(f"no shard files match {'; '.join(missing[:10])}{more}: fix or remove "
                            f"{'these' if len(missing) > 1 else 'it'}{others}")
    if not found:
        raise NoShardsError(f"no shard files match {patterns!r}: check the path, glob or brace pattern")
    return _each_file_once(sorted(dict.fromkeys(found)))


def _each_file_once(paths: list[str]) -> list[str]:
    """``paths`` less the later names of a local file already named (same device and inode)."""
    from datasvc.read.storage import is_remote

    first: dict[tuple, str] = {}
    kept, aliases = [], {}
    for path in paths:
        if is_remote(path):
            kept.append(path)
            continue
        st = os.stat(path)
        same = first.setdefault((st.st_dev, st.st_ino), path)
        if same is path:
            kept.append(path)
        else:
            aliases.setdefault(same, []).append(path)
    for path, others in aliases.items():
        log.warning("one shard file named %d ways: %s is read once; %s name%s the same file (%s)",
                    len(others) + 1, path, ", ".join(others), "s" if len(others) == 1 else "",
                    os.path.realpath(path))
    return kept


def shard_stamp(path: str) -> tuple:
    """What tells a shard file's versions apart: (size, modification time), or for an object its
    size and the store's ETag; () when the store says neither."""
    from datasvc.read import storage

    if storage.is_remote(path):
        return tuple(storage.stamp(path) or ())
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def shard_where(path: str) -> str:
    """The one name of a shard that a stamp goes with: its absolute path, or its URL."""
    from datasvc.read import storage

    return path if storage.is_remote(path) else os.path.abspath(path)


def archive_stamp(path: str, archive) -> tuple:
    """``shard_stamp`` of an open archive: of the file as opened where it says (a local file)."""
    stamp = getattr(archive, "stamp", None)
    return tuple(stamp) if stamp else shard_stamp(path)
