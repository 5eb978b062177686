"""Write WebDataset shards from the data people already have: Parquet (a file or a directory of
them, as Hugging Face ``datasets`` writes it: image columns in the ``Image`` feature layout, a struct
of ``bytes`` and ``path``, or a list of them; plain binary image columns too) with text, messages or
conversations columns; or a LLaVA-style JSON (a list of ``{"id", "image", "conversations"}``) with
its image folder.

    python -m datasvc.tools.convert data/train/ --out shards/ --shard-bytes 512MB
    python -m datasvc.tools.convert llava_v1_5_mix665k.json --images-dir images/ --out shards/

Each sample becomes ``KEY.jpg`` (``KEY.0.jpg``, ``KEY.1.jpg``, ... for several images, in order),
``KEY.txt`` (a caption column) and ``KEY.json`` (the conversation and every other column, which the
data service keeps as metadata for filters); keys are the running sample number. A shard is closed
when the next sample would take it past ``--shard-bytes``. Shards are written deterministically
(fixed tar headers) under a temporary name, renamed when complete, and listed in
``OUT/.convert-progress.json``: a rerun keeps the complete shards that are still intact and goes on
from the first that is not. Samples that cannot be converted (an image path that does not exist,
no image bytes) are counted by reason in the summary, never fatal.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import os
import sys
import tarfile
from dataclasses import dataclass, field

PROGRESS = ".convert-progress.json"
TEXT_COLUMNS = ("text", "caption", "txt")
CONVERSATION_COLUMNS = ("messages", "conversations")
_MAGIC = ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG\r\n\x1a\n", "png"), (b"RIFF", "webp"))


def image_ext(data: bytes, fallback: str = "jpg") -> str:
    for magic, ext in _MAGIC:
        if data.startswith(magic) and (ext != "webp" or data[8:12] == b"WEBP"):
            return ext
    return fallback


def parse_bytes(text: str) -> int:
    """``512MB``, ``1GiB``, ``100000`` -> bytes."""
    units = {"": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": 1 << 20, "g": 1e9, "gb": 1e9,
             "gib": 1 << 30}
    t = text.strip().lower()
    number = t.rstrip("kmgib")
    try:
        return int(float(number) * units[t[len(number):]])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MB, 1GiB)") from None


@dataclass(slots=True)
class Converted:
    """One sample as tar members: images in order, a caption, a JSON document."""

    images: list[bytes]
    text: str | None = None
    doc: dict | None = None

    def members(self, key: str) -> list[tuple[str, bytes]]:
        out = []
        for i, data in enumerate(self.images):
            ext = image_ext(data)
            out.append((f"{key}.{ext}" if len(self.images) == 1 else f"{key}.{i}.{ext}", data))
        if self.text is not None:
            out.append((f"{key}.txt", self.text.encode("utf-8")))
        if self.doc:
            out.append((f"{key}.json", json.dumps(self.doc, ensure_ascii=False, default=str).encode("utf-8")))
        return out


class Skip(Exception):
    """A source row that cannot become a sample; ``reason`` is counted."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ---- sources: ``from_row(n)`` yields (row, convert) in a fixed order; convert() -> Converted or Skip ----

def parquet_files(src: str) -> list[str]:
    if os.path.isdir(src):
        return sorted(glob.glob(os.path.join(src, "**", "*.parquet"), recursive=True))
    return [src]


def _is_image_type(t) -> bool:
    import pyarrow as pa

    if pa.types.is_struct(t):
        return {t.field(i).name for i in range(t.num_fields)} >= {"bytes", "path"}
    return pa.types.is_list(t) and _is_image_type(t.value_type)


def _image_bytes(value, base_dir: str) -> list[bytes]:
    if value is None:
        return []
    if isinstance(value, list):
        return [b for v in value for b in _image_bytes(v, base_dir)]
    if isinstance(value, (bytes, bytearray)):
        return [bytes(value)]
    data, path = value.get("bytes"), value.get("path")
    if data:
        return [bytes(data)]
    if path:
        full = path if os.path.isabs(path) else os.path.join(base_dir, path)
        if os.path.isfile(full):
            with open(full, "rb") as f:
                return [f.read()]
        raise Skip("image_file_not_found")
    raise Skip("image_without_bytes")


def _without_nulls(value):
    """Arrow gives every struct in a column every field, null where a row had none (an image part
    gets ``"text": None``): leave those out, as the row was written."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


@dataclass(slots=True)
class ParquetSource:
    files: list[str]
    image_columns: list[str] | None = None
    text_column: str | None = None
    batch_rows: int = 256

    def rows(self) -> int:
        import pyarrow.parquet as pq

        return sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)

    def describe(self) -> dict:
        return {"kind": "parquet", "files": [(f, os.path.getsize(f)) for f in self.files],
                "image_columns": self.image_columns, "text_column": self.text_column}

    def from_row(self, start: int):
        """(row number, convert) from row ``start`` on; whole files before it are not read."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        row = 0
        for path in self.files:
            pf = pq.ParquetFile(path)
            if row + pf.metadata.num_rows <= start:
                row += pf.metadata.num_rows
                continue
            schema = pf.schema_arrow
            images = self.image_columns or [f.name for f in schema if _is_image_type(f.type)
                                            or (pa.types.is_binary(f.type) and f.name in ("image", "jpg", "png"))]
            text = self.text_column or next((c for c in TEXT_COLUMNS if c in schema.names), None)
            for batch in pf.iter_batches(batch_size=self.batch_rows):
                if row + batch.num_rows <= start:
                    row += batch.num_rows
                    continue
                for values in batch.to_pylist():
                    if row >= start:
                        yield row, lambda v=values: self._convert(v, images, text, os.path.dirname(path))
                    row += 1

    @staticmethod
    def _convert(row: dict, image_columns: list[str], text_column: str | None, base_dir: str) -> Converted:
        out = Converted([b for c in image_columns for b in _image_bytes(row.get(c), base_dir)])
        caption = row.get(text_column) if text_column else None
        out.text = caption if isinstance(caption, str) else None
        doc = {k: _without_nulls(v) for k, v in row.items()
               if k not in image_columns and k != text_column and v is not None}
        out.doc = doc or None
        if out.text is None and not any(c in doc for c in CONVERSATION_COLUMNS):
            raise Skip("no_text_or_messages")
        return out


@dataclass(slots=True)
class LlavaSource:
    path: str
    images_dir: str | None = None
    _entries: list = field(default_factory=list)

    def _load(self) -> list:
        if not self._entries:
            with open(self.path, encoding="utf-8") as f:
                first = f.read(1)
                f.seek(0)
                self._entries = json.load(f) if first == "[" else [json.loads(line) for line in f if line.strip()]
        return self._entries

    def rows(self) -> int:
        return len(self._load())

    def describe(self) -> dict:
        return {"kind": "llava", "file": (self.path, os.path.getsize(self.path)), "images_dir": self.images_dir}

    def from_row(self, start: int):
        base = self.images_dir or os.path.dirname(os.path.abspath(self.path))
        for row, entry in enumerate(self._load()[start:], start):
            yield row, lambda e=entry: self._convert(e, base)

    @staticmethod
    def _convert(entry, base: str) -> Converted:
        if not isinstance(entry, dict) or not any(c in entry for c in CONVERSATION_COLUMNS):
            raise Skip("not_a_llava_entry")
        names = entry.get("image") or entry.get("images") or []
        images = []
        for name in [names] if isinstance(names, str) else names:
            full = os.path.join(base, name)
            if not os.path.isfile(full):
                raise Skip("image_file_not_found")
            with open(full, "rb") as f:
                images.append(f.read())
        return Converted(images, None, {k: v for k, v in entry.items() if k not in ("image", "images")})


def open_source(src: str, images_dir: str | None = None, image_columns=None, text_column=None):
    if src.endswith((".json", ".jsonl")):
        return LlavaSource(src, images_dir)
    files = parquet_files(src)
    if not files or not all(os.path.isfile(f) for f in files):
        raise SystemExit(f"no Parquet files at {src!r}: pass a .parquet file, a directory of them, or a LLaVA .json")
    return ParquetSource(files, image_columns, text_column)


# ---- the writer ----------------------------------------------------------------------------------

def _tar_member(name: str, data: bytes) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
    info.uname = info.gname = ""
    header = info.tobuf(format=tarfile.USTAR_FORMAT if len(name) < 100 else tarfile.PAX_FORMAT)
    return header + data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)


@dataclass(slots=True)
class Summary:
    shards: int = 0
    samples: int = 0
    bytes: int = 0
    kept_shards: int = 0
    skipped: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"shards": self.shards, "samples": self.samples, "bytes": self.bytes,
                "kept_from_earlier_run": self.kept_shards, "skipped": self.skipped}


def _load_progress(out: str, fingerprint: str) -> list[dict]:
    """The complete shards of an earlier run of the same conversion that are still intact."""
    path = os.path.join(out, PROGRESS)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        state = json.load(f)
    if state.get("fingerprint") != fingerprint:
        raise SystemExit(f"{out} holds shards of another conversion (other source or options): "
                         "pass an empty --out directory, or delete it")
    kept = []
    for shard in state["shards"]:
        full = os.path.join(out, shard["name"])
        if not (os.path.isfile(full) and os.path.getsize(full) == shard["file_bytes"]):
            break
        kept.append(shard)
    return kept


def _save_progress(out: str, fingerprint: str, shards: list[dict], done: bool) -> None:
    tmp = os.path.join(out, PROGRESS + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"fingerprint": fingerprint, "shards": shards, "complete": done}, f, indent=1)
    os.replace(tmp, os.path.join(out, PROGRESS))


def convert(source, out: str, shard_bytes: int = 512 << 20, prefix: str = "shard", progress: bool = True) -> Summary:
    """Write ``source``'s samples as shards under ``out``; resumes an interrupted run of the same job."""
    from tqdm import tqdm

    os.makedirs(out, exist_ok=True)
    fingerprint = hashlib.sha1(json.dumps([source.describe(), shard_bytes, prefix], default=str)
                               .encode()).hexdigest()[:16]
    shards = _load_progress(out, fingerprint)
    summary = Summary(kept_shards=len(shards))
    resume_at = shards[-1]["next_row"] if shards else 0
    for stale in glob.glob(os.path.join(out, f"{prefix}-*.tar*")):  # partial, or past the intact ones
        if os.path.basename(stale) not in {s["name"] for s in shards}:
            os.remove(stale)
    for s in shards:
        for reason, n in s["skipped"].items():
            summary.skipped[reason] = summary.skipped.get(reason, 0) + n
        summary.samples += s["samples"]
    bar = tqdm(total=source.rows(), initial=resume_at, unit="row", disable=not progress, file=sys.stderr,
               desc=f"convert -> {out}")
    pending: list[bytes] = []
    pending_bytes, pending_samples, pending_skipped = 0, 0, {}

    def close_shard(next_row: int) -> None:
        nonlocal pending, pending_bytes, pending_samples, pending_skipped
        name = f"{prefix}-{len(shards):06d}.tar"
        tmp = os.path.join(out, name + ".tmp")
        with open(tmp, "wb") as f:
            f.writelines(pending)
            f.write(b"\0" * (2 * tarfile.BLOCKSIZE))
            f.write(b"\0" * (-f.tell() % tarfile.RECORDSIZE))
        os.replace(tmp, os.path.join(out, name))
        shards.append({"name": name, "samples": pending_samples, "file_bytes": os.path.getsize(os.path.join(out, name)),
                       "next_row": next_row, "skipped": pending_skipped})
        _save_progress(out, fingerprint, shards, done=False)
        pending, pending_bytes, pending_samples, pending_skipped = [], 0, 0, {}

    for row, make in source.from_row(resume_at):
        try:
            sample = make()
        except Skip as exc:
            pending_skipped[exc.reason] = pending_skipped.get(exc.reason, 0) + 1
            summary.skipped[exc.reason] = summary.skipped.get(exc.reason, 0) + 1
            bar.update(1)
            continue
        blob = b"".join(_tar_member(n, d) for n, d in sample.members(f"{row:09d}"))
        if pending and pending_bytes + len(blob) > shard_bytes:
            close_shard(row)
        pending.append(blob)
        pending_bytes += len(blob)
        pending_samples += 1
        summary.samples += 1
        bar.update(1)
    if pending:
        close_shard(source.rows())
    elif pending_skipped and shards:  # skipped rows after the last sample belong to the last shard
        for reason, n in pending_skipped.items():
            shards[-1]["skipped"][reason] = shards[-1]["skipped"].get(reason, 0) + n
        shards[-1]["next_row"] = source.rows()
    bar.close()
    _save_progress(out, fingerprint, shards, done=True)
    summary.shards = len(shards)
    summary.bytes = sum(s["file_bytes"] for s in shards)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vlmfeed convert", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="a .parquet file, a directory of them, or a LLaVA-style .json/.jsonl")
    ap.add_argument("--out", required=True, help="directory for the shards (a rerun resumes there)")
    ap.add_argument("--shard-bytes", type=parse_bytes, default=512 << 20, help="close a shard before it passes this")
    ap.add_argument("--prefix", default="shard", help="shard file names: PREFIX-000000.tar, ...")
    ap.add_argument("--images-dir", default=None, help="LLaVA: where the entries' image paths start (default: the "
                                                       "JSON's directory)")
    ap.add_argument("--image-column", action="append", default=None, help="Parquet: image column(s) (default: every "
                                                                           "column in the Image feature layout)")
    ap.add_argument("--text-column", default=None, help=f"Parquet: the caption column (default: first of "
                                                        f"{', '.join(TEXT_COLUMNS)})")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    source = open_source(args.src, args.images_dir, args.image_column, args.text_column)
    summary = convert(source, args.out, args.shard_bytes, args.prefix, progress=not args.quiet)
    print(json.dumps(summary.as_dict(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
