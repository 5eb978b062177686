"""Shards on object storage (``s3://``, ``gs://``, any fsspec URL), read by offset as local shards are.

An archive is read with ranged GETs: indexing reads headers through a small read-ahead window,
and a work item reads only its samples' bytes; no shard is downloaded whole. Credentials and the
endpoint come the usual way for the store (for S3: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
/ ``AWS_ENDPOINT_URL`` for an S3-compatible server, or ``~/.aws``), so set them in the Ray job's
environment for the preprocessing actors too.

A failed GET (a dropped connection, a cut body, a timeout) is retried with backoff, up to
``ATTEMPTS`` times, and counted (``counters()``: gets, bytes, retries, failures); the store's own
client is asked not to retry on its own so that every retry is seen. When the attempts run out
the read raises ``OSError``, which costs the samples being read, counted under their reason.
"""
from __future__ import annotations

import os
import re
import threading
import time

from datasvc.usage import UserError

REMOTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
ATTEMPTS = 4
WINDOW = 256 << 10  # bytes fetched at least per GET: tar headers are read one 512-byte block at a time
FIRST_READ = 4096  # the gzip check and the first tar header
LOOKUP_ATTEMPTS = 2  # listing at start: an endpoint that is down is said within two timeouts
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 20
_COUNTERS = {"gets": 0, "bytes": 0, "retries": 0, "failures": 0}
_LOCK = threading.Lock()


def is_remote(path: str) -> bool:
    return bool(REMOTE.match(path)) and not path.startswith("file://")


def counters() -> dict:
    """Object-store reads by this process so far."""
    with _LOCK:
        return dict(_COUNTERS)


def _count(**delta) -> None:
    with _LOCK:
        for k, v in delta.items():
            _COUNTERS[k] += v


class StoreError(OSError, UserError):
    """A store that cannot be read as asked: an unknown scheme, missing or refused credentials."""


def filesystem(url: str):
    """(fsspec filesystem, path within it, protocol) for a URL."""
    from fsspec.core import url_to_fs

    protocol = url.split("://", 1)[0].lower()
    # An endpoint that accepts and never answers would hold a read for botocore's 60 s per attempt.
    # Every retry is ours (counted), none botocore's own.
    options = {"config_kwargs": {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S,
                                 "retries": {"mode": "standard", "max_attempts": 1}}} \
        if protocol in ("s3", "s3a") else {}
    try:
        fs, path = url_to_fs(url, **options)
    except (ImportError, ValueError) as exc:  # fsspec: an unknown protocol, or its package not installed
        raise StoreError(f"{url}: cannot read {protocol}:// URLs here ({exc}); use a local path or s3:// "
                         f"(install the fsspec package for {protocol}:// to read it)") from None
    if isinstance(getattr(fs, "retries", None), int):
        fs.retries = 1  # s3fs retries quietly on its own: the retries are ours, so that they are counted
    return fs, path, protocol


def _missing_credentials(exc: Exception) -> bool:
    return type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError")


def _fatal(exc: Exception) -> bool:
    """Errors a retry cannot fix: the object, the permission or the credentials are not there."""
    return isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)) or _missing_credentials(exc)


def _access_error(url: str, exc: Exception) -> StoreError | None:
    """The one-line error for credentials the store lacks or refuses; None for other failures."""
    if _missing_credentials(exc):
        return StoreError(f"{url}: no credentials for the store ({exc}); set AWS_ACCESS_KEY_ID and "
                          "AWS_SECRET_ACCESS_KEY (or ~/.aws/credentials, AWS_PROFILE), and AWS_ENDPOINT_URL for "
                          "an S3-compatible server")
    if isinstance(exc, PermissionError):
        return StoreError(f"{url}: the store refused access ({exc}); check the credentials and that they may "
                          "list and read this bucket")
    return None


def retried(what: str, fn, *args, attempts: int = ATTEMPTS):
    delay = 0.05
    for attempt in range(1, attempts + 1):
        try:
            return fn(*args)
        except Exception as exc:  # the store's clients raise many types for one dropped connection
            if _fatal(exc) or attempt == attempts:
                _count(failures=1)
                if _fatal(exc):
                    raise
                raise OSError(f"{what}: {type(exc).__name__}: {exc} (after {attempts} attempts)") from exc
            _count(retries=1)
            time.sleep(delay)
            delay *= 4


def stamp(url: str) -> list | None:
    """What identifies an object's current bytes: its size and the store's ETag (or modification
    time where there is none); None when the store says neither."""
    fs, path, _ = filesystem(url)
    info = retried(f"stat of {url}", fs.info, path)
    version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime")
    return [int(info.get("size") or 0), str(version)] if version else None


class RemoteArchive:
    """``read_at(offset, size)`` on an object, by ranged GETs through a read-ahead window."""

    def __init__(self, url: str, window: int = WINDOW):
        self.url = url
        self.fs, self.path, _ = filesystem(url)
        self.size: int | None = retried(f"size of {url}", self.fs.size, self.path)
        self.window = window
        self._start, self._buf = 0, b""

    def _get(self, start: int, end: int) -> bytes:
        data = retried(f"read {self.url} [{start}, {end})",
                       lambda: self.fs.cat_file(self.path, start=start, end=end))  # s3fs: 2nd positional is a version
        _count(gets=1, bytes=len(data))
        return data

    def read_at(self, offset: int, size: int) -> bytes:
        end = min(offset + size, self.size)
        if offset >= end:
            return b""
        buf_end = self._start + len(self._buf)
        if self._start <= offset and end <= buf_end:
            return self._buf[offset - self._start:end - self._start]
        if self._start <= offset < buf_end:  # runs past the window: fetch only what is missing
            self._buf = self._buf[offset - self._start:] + self._get(buf_end, min(max(end, buf_end + self.window),
                                                                                self.size))
            self._start = offset
            return self._buf[:end - offset]
        if size >= self.window:  # a large member: exactly its bytes, nothing kept
            return self._get(offset, end)
        # The first read is the format check: a few bytes, not a window that a work item may not use.
        ahead = self.window if self._buf or offset else FIRST_READ
        self._start = offset
        self._buf = self._get(offset, min(max(end, offset + ahead), self.size))
        return self._buf[:end - offset]

    def close(self) -> None:
        self._buf = b""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def expand(pattern: str) -> tuple[list[str], list[str]]:
    """(matching object URLs, what matched nothing) for one remote path or glob."""
    import glob

    fs, path, protocol = filesystem(pattern)
    try:
        if glob.has_magic(path):
            listed = retried(f"list {pattern}", fs.glob, path, attempts=LOOKUP_ATTEMPTS)
            found = sorted(f"{protocol}://{p}" for p in listed if not p.endswith("/"))
            return found, ([] if found else [f"{pattern} (matches no object)"])
        info = retried(f"look up {pattern}", fs.info, path, attempts=LOOKUP_ATTEMPTS)
    except FileNotFoundError:
        return [], [f"{pattern} (no such object)"]
    except Exception as exc:
        access = _access_error(pattern, exc)
        if access is not None:
            raise access from None
        if isinstance(exc, OSError):  # the store could not be reached after every attempt
            endpoint = getattr(getattr(fs, "client_kwargs", None) or {}, "get", lambda *_: None)("endpoint_url") \
                or os.environ.get("AWS_ENDPOINT_URL") or "the store's default endpoint"
            raise StoreError(f"{pattern}: {endpoint} is unreachable ({exc}); check AWS_ENDPOINT_URL and the "
                             "network") from None
        raise
    if info.get("type") == "directory":
        return expand(pattern.rstrip("/") + "/*.tar")
    return [pattern], []
