"""Tar archives as shards come: plain or gzip-compressed, read by offset, headers scanned past damage.

``open_archive(path)`` gives random access to an archive's bytes: the file (or object-store object,
``datasvc.read.storage``) itself, or for a gzip shard (``.tar.gz``, ``.tgz``, recognized by its magic bytes)
the decompressed stream, reached through access points that the process records as it inflates.
``Scan(archive)`` walks the headers and yields an ``Entry`` per member and a ``Gap`` for bytes lost
to a corrupt header, then says how the archive ended (``Scan.ending``: empty when it ended in its
end-of-archive blocks).

Members are what ``tarfile`` lists on the same archive (names from GNU long-name and pax headers,
the first of several winning; data offsets and sizes; the data skipped after a member by its rule),
which tests/test_tar_edge_cases.py checks archive by archive. Where they part: ``tarfile`` stops
quietly at the first bad header, so every later member is lost uncounted, and reads a .tar.gz only
front to back; it reads an extended header of any declared size whole, and the pax parser of the
Python this runs on (3.12.1) backtracks on hostile records (CVE-2024-6232). Here every size a header
declares is checked before anything is read: a pax ``size`` that is not a size is damage (the
ustar size is used, as GNU tar does), an extended header over ``MAX_EXTENDED_HEADER`` costs its
member alone, and a member running past the file ends the scan. Sparse members (old GNU ``S``, pax
``GNU.sparse.*`` 0.0, 0.1 and 1.0) are listed under their real names as kind ``sparse``, never read
as if their stored bytes were the file. Headers are still parsed by ``tarfile.TarInfo.frombuf``
(checksums, number fields, ustar name prefixes). Nothing here writes to disk or unpickles anything.
"""
from __future__ import annotations

import bisect
import collections
import os
import tarfile
import threading
import zlib
from dataclasses import dataclass, field

BLOCK = 512
GZIP_MAGIC = b"\x1f\x8b"
MAX_EXTENDED_HEADER = 16 << 20
"""Bytes of one GNU long name or pax header read whole: real ones hold a path and a few attributes
(extended attributes are 64 KiB at most on Linux); a larger one costs its member, not the shard."""


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    kind: str  # "file", "hardlink", "symlink", "dir", "sparse" or "special" (devices, fifos, unknown types)
    offset: int  # where the member's data starts
    size: int
    linkname: str = ""
    problem: str = ""  # what its own headers got wrong (a rejection reason): its data is not to be trusted
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Gap:
    """Bytes between a header that failed its checksum and the next valid header."""

    offset: int
    end: int
    name: str  # what the damaged header's name field still reads, "" when illegible
    size: int | None  # its size field, when legible

    @property
    def one_member(self) -> bool:
        """The damaged header's own member spans the gap exactly: nothing else was lost."""
        return bool(self.name) and self.size is not None and self.offset + BLOCK + padded(self.size) == self.end


def padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


class PlainArchive:
    def __init__(self, path: str):
        self._f = open(path, "rb")
        st = os.fstat(self._f.fileno())
        self.size: int | None = st.st_size
        self.identity = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
        self.stamp = (st.st_size, st.st_mtime_ns)

    def stamp_now(self) -> tuple:
        """(size, modification time) of the file as it is now: a rewrite in place changes it."""
        st = os.fstat(self._f.fileno())
        return st.st_size, st.st_mtime_ns

    def read_at(self, offset: int, size: int) -> bytes:
        self._f.seek(offset)
        return self._f.read(size)

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass(frozen=True, slots=True)
class _Point:
    out_pos: int  # offset in the decompressed stream
    in_pos: int  # file offset of the first compressed byte not yet handed to the inflater
    inflater: object  # a zlib decompressor's state there (copied before use, never used itself)
    tail: bytes  # compressed bytes handed over but not yet consumed


# Access points per gzip shard, recorded by whoever inflates it in this process (a few MB a GB of
# shard), so that reading a work item costs at most _SPACING of inflating, not the shard up to it.
_SPACING = 8 << 20
_STEP = 1 << 20  # most output one inflate call may produce: a 1 KB gzip can expand to 1 GB of zeros
_IN_CHUNK = 1 << 16
_POINTS: collections.OrderedDict[tuple, list[_Point]] = collections.OrderedDict()
_POINTS_LOCK = threading.Lock()
_POINTS_SHARDS = 16


class GzipArchive:
    """Random access to a gzip stream (one or several members) by inflating from the nearest access
    point at or before the offset asked for."""

    size = None  # unknown without inflating it all

    def __init__(self, compressed, identity: tuple):
        """``compressed``: the gzip file's bytes by ``read_at`` (a local or object-store archive)."""
        self._raw = compressed
        self.stamp = getattr(compressed, "stamp", None)
        key = identity
        with _POINTS_LOCK:
            if key not in _POINTS:
                _POINTS[key] = [_Point(0, 0, zlib.decompressobj(31), b"")]
                while len(_POINTS) > _POINTS_SHARDS:
                    _POINTS.popitem(last=False)
            _POINTS.move_to_end(key)
            self._points = _POINTS[key]
        self._restore(self._points[0])

    def _restore(self, p: _Point) -> None:
        self._z, self._in_pos, self._tail, self._pos = p.inflater.copy(), p.in_pos, p.tail, p.out_pos
        self._member_out = p.out_pos  # output of the current gzip member so far (0 only at its start)

    def read_at(self, offset: int, size: int) -> bytes:
        if offset < self._pos or offset - self._pos > _SPACING:
            starts = [p.out_pos for p in self._points]
            p = self._points[bisect.bisect_right(starts, offset) - 1]
            if offset < self._pos or p.out_pos > self._pos:
                self._restore(p)
        while self._pos < offset:
            if not self._inflate(min(_STEP, offset - self._pos)):
                return b""
        parts, want = [], size
        while want > 0:
            out = self._inflate(min(_STEP, want))
            if not out:
                break
            parts.append(out)
            want -= len(out)
        return b"".join(parts)

    def stamp_now(self):
        return self._raw.stamp_now() if hasattr(self._raw, "stamp_now") else self.stamp

    def _inflate(self, limit: int) -> bytes:
        """Up to ``limit`` bytes of the stream from the current position; b"" at its end."""
        while True:
            if self._z.eof and not self._next_member():
                return b""
            data = self._tail or self._read_in()
            if not data:
                raise EOFError("the gzip stream is cut short inside a member")
            try:
                out = self._z.decompress(data, limit)
            except zlib.error:
                if self._member_out == 0 and self._pos > 0:
                    return b""  # bytes after the last member are not another member: padding
                raise
            self._tail = self._z.unconsumed_tail
            if out:
                self._pos += len(out)
                self._member_out += len(out)
                self._record()
                return out

    def _next_member(self) -> bool:
        rest = self._z.unused_data or self._read_in()
        if not rest.strip(b"\0"):
            return False
        self._z, self._tail, self._member_out = zlib.decompressobj(31), rest, 0
        return True

    def _read_in(self) -> bytes:
        data = self._raw.read_at(self._in_pos, _IN_CHUNK)
        self._in_pos += len(data)
        return data

    def _record(self) -> None:
        if self._pos < self._points[-1].out_pos + _SPACING or self._z.eof:
            return
        with _POINTS_LOCK:
            if self._pos >= self._points[-1].out_pos + _SPACING:
                self._points.append(_Point(self._pos, self._in_pos, self._z.copy(), self._tail))

    def close(self) -> None:
        self._raw.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_archive(path: str):
    """The archive's bytes by ``read_at``: local or on object storage (``datasvc.read.storage``: ranged
    GETs), plain or gzip (inflated from this process's access points)."""
    from datasvc.read.storage import RemoteArchive, is_remote

    raw = RemoteArchive(path) if is_remote(path) else PlainArchive(path)
    try:
        if raw.read_at(0, 2) != GZIP_MAGIC:
            return raw
        return GzipArchive(raw, getattr(raw, "identity", (path, raw.size)))
    except BaseException:
        raw.close()
        raise


def _header(block: bytes) -> tarfile.TarInfo | None:
    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return None
    return info if info.size >= 0 else None  # a base-256 size field can be negative: damage, not a size


def _text(field: bytes) -> str:
    """A header text field if it reads as a plain name, else ''."""
    raw = field.split(b"\0", 1)[0]
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError:
        return ""
    return s if s.isprintable() else ""


def _legible(block: bytes) -> tuple[str, int | None]:
    """(name, size) that a damaged header still shows, for counting what its loss cost."""
    name = _text(block[0:100])
    prefix = _text(block[345:500]) if block[257:262] == b"ustar" else ""
    if name and prefix:
        name = f"{prefix}/{name}"
    digits = block[124:136].split(b"\0", 1)[0].strip()
    try:
        size = int(digits, 8) if digits else None
    except ValueError:
        size = None
    return name, size


_PAX_KEYS = ("path", "linkpath", "size")


def _pax(payload: bytes) -> tuple[dict, str]:
    """pax records ("<length> <key>=<value>\\n") -> (the ones a sample's member needs, what was
    malformed or ''). tarfile stops at a zero length; here any record that does not parse is damage."""
    out, pos = {}, 0
    while pos < len(payload) and payload[pos:].strip(b"\0"):
        space = payload.find(b" ", pos, pos + 21)
        digits = payload[pos:space] if space > pos else b""
        length = int(digits) if digits.isdigit() else 0
        record = payload[space + 1:pos + length]
        if length <= 0 or pos + length > len(payload) or not record.endswith(b"\n") or b"=" not in record:
            return out, f"malformed pax record at byte {pos} of its header"
        key, _, value = record[:-1].partition(b"=")
        name = key.decode("utf-8", "surrogateescape")
        if name in _PAX_KEYS or name.startswith("GNU.sparse."):
            out[name] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out, ""


def _records(kind: bytes, payload: bytes) -> tuple[dict, str]:
    if kind == tarfile.GNUTYPE_LONGNAME:
        return {"path": payload.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")}, ""
    if kind == tarfile.GNUTYPE_LONGLINK:
        return {"linkpath": payload.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")}, ""
    if kind == tarfile.XGLTYPE:
        return {}, ""  # global pax header: nothing a sample's member needs
    return _pax(payload)


@dataclass(slots=True)
class _Extended:
    """What the extended headers before a member (GNU long names, pax records) said of it."""

    records: dict = field(default_factory=dict)
    problem: str = ""
    detail: str = ""

    def add(self, records: dict) -> None:
        for key, value in records.items():  # the first header wins, as in tarfile
            self.records.setdefault(key, value)

    def damage(self, problem: str, detail: str) -> None:
        if not self.problem:
            self.problem, self.detail = problem, detail


_KINDS = {tarfile.REGTYPE: "file", tarfile.AREGTYPE: "file", tarfile.CONTTYPE: "file",
          tarfile.LNKTYPE: "hardlink", tarfile.SYMTYPE: "symlink", tarfile.DIRTYPE: "dir",
          tarfile.GNUTYPE_SPARSE: "sparse"}
_EXTENDED = {tarfile.GNUTYPE_LONGNAME: "GNU long name", tarfile.GNUTYPE_LONGLINK: "GNU long link name",
             tarfile.XHDTYPE: "pax header", tarfile.SOLARIS_XHDTYPE: "pax header", tarfile.XGLTYPE: "global pax header"}


def _carries_data(info: tarfile.TarInfo) -> bool:
    """tarfile's rule: data blocks follow regular members and types it does not know, nothing else."""
    return info.type in tarfile.REGULAR_TYPES or info.type not in tarfile.SUPPORTED_TYPES


class Scan:
    """Iterate to get each member (``Entry``) and each stretch lost to damage (``Gap``) in order."""

    def __init__(self, archive):
        self.archive = archive
        self.ending = ""  # why the archive ended before its end-of-archive blocks; "" if it did not
        self.members = 0  # entries yielded
        self.only_zeros = True  # every block met so far was zero (an empty archive, a file never written)
        self.scanned = 0  # bytes the scan reached

    def __iter__(self):
        pos, ext = 0, _Extended()
        while True:
            block = self.archive.read_at(pos, BLOCK)
            self.scanned = pos + len(block)
            if len(block) < BLOCK:
                self.ending = "ends inside a header" if block else "ends without its end-of-archive blocks"
                return
            info = _header(block)
            if info is None or not info.name:
                nxt = yield from self._damaged(pos, block)
                if nxt is None:
                    return
                pos, ext = nxt, _Extended()
                continue
            self.only_zeros = False
            data = pos + BLOCK
            if info.type in _EXTENDED:
                pos = self._extended(info, data, ext)
                if pos is None:
                    return
                continue
            entry, pos = self._entry(info, block, data, ext)
            ext = _Extended()
            self.members += 1
            yield entry
            if self.archive.size is not None and _carries_data(info) and entry.offset + entry.size > self.archive.size:
                self.ending = f"member {entry.name} runs past the end of the file"
                return

    def _damaged(self, pos: int, block: bytes):
        """Yield the Gap a bad header opens (none for zero blocks between archives); return where
        the next valid header starts, None when there is none."""
        zeros = block.count(0) == BLOCK
        nxt, all_zero, scanned_to = self._resync(pos + BLOCK)
        self.scanned = max(self.scanned, scanned_to)
        if not (zeros and all_zero):  # zero blocks between two archives are not a loss
            self.only_zeros = False
            name, size = ("", None) if zeros else _legible(block)
            yield Gap(pos, scanned_to if nxt is None else nxt, name, size)
        return nxt

    def _extended(self, info: tarfile.TarInfo, data: int, ext: _Extended) -> int | None:
        """Take in one extended header; where the next header starts (None: the scan ends here)."""
        what, end = _EXTENDED[info.type], data + padded(info.size)
        if self.archive.size is not None and data + info.size > self.archive.size:
            self.ending = f"ends inside a {what} ({info.size} bytes declared at byte {data - BLOCK})"
            return None
        if info.size > MAX_EXTENDED_HEADER:
            if info.type != tarfile.XGLTYPE:
                ext.damage("tar_header_too_large", f"{what} of {info.size} bytes at byte {data - BLOCK}, over "
                           f"the {MAX_EXTENDED_HEADER >> 20} MiB read for one header: its member is not read")
            return end
        payload = self.archive.read_at(data, info.size)
        if len(payload) < info.size:
            self.ending = f"ends inside a {what}"
            return None
        records, malformed = _records(info.type, payload)
        ext.add(records)
        if malformed:
            ext.damage("corrupt_tar_header", f"{malformed} at byte {data - BLOCK}")
        return end

    def _entry(self, info: tarfile.TarInfo, block: bytes, data: int, ext: _Extended) -> tuple[Entry, int]:
        """The member a header (and the extended headers before it) describe, and where the next
        header starts."""
        data = self._skip_sparse_map(info, block, data)
        rec, size = ext.records, info.size
        declared = rec.get("size")
        if declared is not None and declared.isascii() and declared.isdigit():
            size = int(declared)
        elif declared is not None:  # GNU tar's rule: say so, and go by the header's own size
            ext.damage("corrupt_tar_header", f"pax size={declared[:24]!r} is not a size (the header says {size})")
        end = self.archive.size
        if size != info.size and end is not None and data + size > end >= data + info.size:
            ext.damage("corrupt_tar_header", f"pax size={size} runs past the end of the file (the header says {info.size})")
            size = info.size
        sparse = info.type == tarfile.GNUTYPE_SPARSE or any(k.startswith("GNU.sparse.") for k in rec)
        name = rec.get("GNU.sparse.name") or rec.get("path", "").rstrip("/") or info.name
        kind = "sparse" if sparse else _KINDS.get(info.type, "special")
        entry = Entry(name, kind, data, size, rec.get("linkpath", info.linkname), ext.problem, ext.detail)
        return entry, data + padded(size) if _carries_data(info) else data

    def _skip_sparse_map(self, info: tarfile.TarInfo, block: bytes, data: int) -> int:
        """Old GNU sparse members may be followed by extension blocks of their sparse map."""
        more = info.type == tarfile.GNUTYPE_SPARSE and block[482]
        while more:
            ext = self.archive.read_at(data, BLOCK)
            data += BLOCK
            more = len(ext) == BLOCK and ext[504]
        return data

    def _resync(self, start: int) -> tuple[int | None, bool, int]:
        """The next valid header at or after ``start`` (on a block boundary, with ustar magic), whether
        every byte skipped to reach it was zero, and where the search stopped."""
        chunk_size, pos, all_zero = 1 << 20, start, True
        while True:
            chunk = self.archive.read_at(pos, chunk_size)
            if not chunk:
                return None, all_zero, pos
            i = chunk.find(b"ustar", 257)
            while i != -1:
                at = i - 257
                if at % BLOCK == 0:
                    info = _header(chunk[at:at + BLOCK])
                    if info is not None and info.name:
                        return pos + at, all_zero and chunk.count(0, 0, at) == at, pos + at
                i = chunk.find(b"ustar", i + 1)
            all_zero = all_zero and chunk.count(0) == len(chunk)
            pos += len(chunk)
