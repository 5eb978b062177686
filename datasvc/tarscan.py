"""Tar archives as shards come: plain or gzip-compressed, read by offset, headers scanned past damage.

``open_archive(path)`` gives random access to an archive's bytes: the file (or object-store object,
``datasvc.storage``) itself, or for a gzip shard (``.tar.gz``, ``.tgz``, recognized by its magic bytes)
the decompressed stream, reached through access points that the process records as it inflates.
``Scan(archive)`` walks the headers and yields an ``Entry`` per member and a ``Gap`` for bytes lost
to a corrupt header, then says how the archive ended (``Scan.ending``: empty when it ended in its
end-of-archive blocks).

Why not ``tarfile``'s reader: it stops quietly at the first bad header, so every later member is lost
uncounted, and it reads a .tar.gz only front to back. Headers are still parsed by
``tarfile.TarInfo.frombuf`` (checksums, number fields, ustar name prefixes). Nothing here writes to
disk or unpickles anything.
"""
from __future__ import annotations

import bisect
import collections
import os
import tarfile
import threading
import zlib
from dataclasses import dataclass

BLOCK = 512
GZIP_MAGIC = b"\x1f\x8b"
_MAX_EXTENDED_HEADER = 1 << 20  # a long name or pax header larger than this is damage, not a name


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    kind: str  # "file", "hardlink", "symlink", "dir" or "special" (devices, fifos, sparse files)
    offset: int  # where the member's data starts
    size: int
    linkname: str = ""


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
    """The archive's bytes by ``read_at``: local or on object storage (``datasvc.storage``: ranged
    GETs), plain or gzip (inflated from this process's access points)."""
    from datasvc.storage import RemoteArchive, is_remote

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
        return tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return None


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


def _pax(payload: bytes) -> dict:
    """pax extended header records ("<len> key=value\\n"): path, linkpath and size are used."""
    out, pos = {}, 0
    while pos < len(payload):
        space = payload.find(b" ", pos)
        if space < 0:
            break
        try:
            length = int(payload[pos:space])
        except ValueError:
            break
        if length <= 0:
            break
        key, _, value = payload[space + 1:pos + length - 1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


_KINDS = {tarfile.REGTYPE: "file", tarfile.AREGTYPE: "file", tarfile.CONTTYPE: "file",
          tarfile.LNKTYPE: "hardlink", tarfile.SYMTYPE: "symlink", tarfile.DIRTYPE: "dir"}
_EXTENDED = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE,
             tarfile.XGLTYPE)


class Scan:
    """Iterate to get each member (``Entry``) and each stretch lost to damage (``Gap``) in order."""

    def __init__(self, archive):
        self.archive = archive
        self.ending = ""  # why the archive ended before its end-of-archive blocks; "" if it did not

    def __iter__(self):
        pos, names = 0, {}
        while True:
            block = self.archive.read_at(pos, BLOCK)
            if len(block) < BLOCK:
                self.ending = "ends inside a header" if block else "ends without its end-of-archive blocks"
                return
            info = _header(block)
            if info is None or not info.name:
                zeros = block.count(0) == BLOCK
                nxt, all_zero, scanned_to = self._resync(pos + BLOCK)
                if not (zeros and all_zero):  # zero blocks between two archives are not a loss
                    name, size = ("", None) if zeros else _legible(block)
                    yield Gap(pos, scanned_to if nxt is None else nxt, name, size)
                if nxt is None:
                    return
                pos, names = nxt, {}
                continue
            data = pos + BLOCK
            if info.type in _EXTENDED:
                if info.size > _MAX_EXTENDED_HEADER:
                    self.ending = f"extended header of {info.size} bytes at byte {pos}"
                    return
                payload = self.archive.read_at(data, info.size)
                if len(payload) < info.size:
                    self.ending = "ends inside an extended header"
                    return
                names.update(_extended(info.type, payload))
                pos = data + padded(info.size)
                continue
            data = self._skip_sparse_map(info, block, data)
            size = _number(names.get("size"), info.size)
            kind = _KINDS.get(info.type, "special")
            name, link = names.get("path", info.name), names.get("linkpath", info.linkname)
            yield Entry(name, kind, data, size, link)
            names = {}
            if kind in ("hardlink", "symlink", "dir"):
                pos = data  # no data blocks follow these (tarfile's rule)
                continue
            pos = data + padded(size)
            if self.archive.size is not None and data + size > self.archive.size:
                self.ending = f"member {name} runs past the end of the file"
                return

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


def _number(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


def _extended(kind: bytes, payload: bytes) -> dict:
    if kind == tarfile.GNUTYPE_LONGNAME:
        return {"path": payload.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")}
    if kind == tarfile.GNUTYPE_LONGLINK:
        return {"linkpath": payload.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")}
    if kind == tarfile.XGLTYPE:
        return {}  # global pax header: nothing a sample's member needs
    return {k: v for k, v in _pax(payload).items() if k in ("path", "linkpath", "size")}
