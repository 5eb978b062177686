"""Write WebDataset shards from the data people already have: Parquet (a file or a directory of
them, as Hugging Face ``datasets`` writes it: image columns in the ``Image`` feature layout, a struct
of ``bytes`` and ``path``, or a list of them; plain binary image columns, or columns of image file
paths, too) with text, messages or conversations columns; or a LLaVA-style JSON (a list of
``{"id", "image", "conversations"}``) with its image folder.

    python -m datasvc.tools.convert data/train/ --out shards/ --shard-bytes 512MB
    python -m datasvc.tools.convert llava_v1_5_mix665k.json --images-dir images/ --out shards/

Each sample becomes ``KEY.jpg`` (``KEY.0.jpg``, ``KEY.1.jpg``, ... for several images, in order),
``KEY.txt`` (a caption column) and ``KEY.json`` (the conversation and every other column, which the
data service keeps as metadata for filters); keys are the running sample number. A shard is closed
when the next sample would take it past ``--shard-bytes``. Shards are written deterministically
(fixed tar headers) under a temporary name, renamed when complete, and listed in
``OUT/.convert-progress.json``: a rerun keeps the complete shards that are still intact and goes on
from the first that is not.

Nothing is written until the input passes ``datasvc.tools.convert_inputs``' checks (a kind convert
reads, the columns asked for there and holding what they are named for, no bytes bound for the
JSON). A row that cannot become a sample (an image file that does not exist, no text) is skipped,
counted by reason, and named in ``OUT/convert-report.jsonl``; a run that writes no sample fails.
"""
from __future__ import annotations

import argparse
import functools
import glob
import hashlib
import json
import os
import sys
import tarfile
from dataclasses import dataclass, field

from datasvc.tools.convert_inputs import (CONVERSATION_COLUMNS, TEXT_COLUMNS, BadLine, Converted,
                                          Skip, check_llava_images, image_bytes, image_names, input_kind,
                                          load_llava, parquet_files, parquet_schema, read_image_file,
                                          resolve_columns, without_nulls)
from datasvc.usage import HelpFormatter, UserError

PROGRESS = ".convert-progress.json"
REPORT = "convert-report.jsonl"


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


# ---- sources: ``from_row(n)`` yields (row, convert, where) in a fixed order; convert() -> Converted
# or Skip; ``where`` locates the row for the report ----

@dataclass(slots=True)
class ParquetSource:
    files: list[str]
    image_columns: list[str] | None = None
    text_column: str | None = None
    drop_columns: list[str] = field(default_factory=list)
    no_images: bool = False
    batch_rows: int = 256
    _columns: dict = field(default_factory=dict)  # file -> (image columns, caption column)

    def check(self) -> None:
        """Every file's columns, from the footers, before anything is written."""
        for path in self.files:
            self.columns(path)

    def columns(self, path: str) -> tuple[list[str], str | None]:
        if path not in self._columns:
            self._columns[path] = resolve_columns(path, parquet_schema(path), self.image_columns, self.text_column,
                                                  self.drop_columns, self.no_images)
        return self._columns[path]

    def rows(self) -> int:
        import pyarrow.parquet as pq

        return sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)

    def describe(self) -> dict:
        extra = {"drop_columns": self.drop_columns} if self.drop_columns else {}
        return {"kind": "parquet", "files": [(f, os.path.getsize(f)) for f in self.files],
                "image_columns": self.image_columns, "text_column": self.text_column} | extra

    def from_row(self, start: int):
        """(row number, convert, where) from row ``start`` on; whole files before it are not read."""
        import pyarrow.parquet as pq

        row = 0
        for path in self.files:
            pf = pq.ParquetFile(path)
            if row + pf.metadata.num_rows <= start:
                row += pf.metadata.num_rows
                continue
            images, text = self.columns(path)
            first_row = row
            for batch in pf.iter_batches(batch_size=self.batch_rows):
                if row + batch.num_rows <= start:
                    row += batch.num_rows
                    continue
                for values in batch.to_pylist():
                    if row >= start:
                        where = {"file": path, "file_row": row - first_row} | (
                            {"id": values["id"]} if isinstance(values.get("id"), (str, int)) else {})
                        yield row, functools.partial(self._convert, values, images, text, os.path.dirname(path)), where
                    row += 1

    def _convert(self, row: dict, image_columns: list[str], text_column: str | None, base_dir: str) -> Converted:
        out = Converted([b for c in image_columns for b in image_bytes(row.get(c), base_dir)])
        caption = row.get(text_column) if text_column else None
        out.text = caption if isinstance(caption, str) and caption.strip() else None
        doc = {k: without_nulls(v) for k, v in row.items()
               if k not in image_columns and k != text_column and k not in self.drop_columns and v is not None}
        out.doc = doc or None
        if out.text is None and not any(c in doc for c in CONVERSATION_COLUMNS):
            raise Skip("no_text_or_messages", f"{text_column or 'no caption column'} is empty and there is no "
                                              f"{' or '.join(CONVERSATION_COLUMNS)}")
        if not out.images and not self.no_images and not any(c in doc for c in CONVERSATION_COLUMNS):
            # a caption describes its image: alone it would train as text what was never seen
            raise Skip("no_image", f"{', '.join(image_columns)} empty in this row")
        return out


@dataclass(slots=True)
class LlavaSource:
    path: str
    images_dir: str | None = None
    _entries: list | None = None

    def _load(self) -> list:
        if self._entries is None:
            self._entries = load_llava(self.path)
        return self._entries

    @property
    def base(self) -> str:
        return self.images_dir or os.path.dirname(os.path.abspath(self.path))

    def check(self) -> None:
        check_llava_images(self.path, self._load(), self.base, self.images_dir is not None)

    def rows(self) -> int:
        return len(self._load())

    def describe(self) -> dict:
        return {"kind": "llava", "file": (self.path, os.path.getsize(self.path)), "images_dir": self.images_dir}

    def from_row(self, start: int):
        for row, entry in enumerate(self._load()[start:], start):
            where = {"id": entry["id"]} if isinstance(entry, dict) and isinstance(entry.get("id"), (str, int)) else {}
            yield row, functools.partial(self._convert, entry, self.base), where

    @staticmethod
    def _convert(entry, base: str) -> Converted:
        if isinstance(entry, BadLine):
            raise Skip("bad_json", entry.detail)
        if not isinstance(entry, dict) or not any(c in entry for c in CONVERSATION_COLUMNS):
            raise Skip("not_a_llava_entry", f"keys: {', '.join(map(str, entry))[:200]}" if isinstance(entry, dict)
                       else f"a JSON {type(entry).__name__}, not an object")
        names = image_names(entry)
        if not all(isinstance(n, str) for n in names):
            raise Skip("image_value_unreadable", f"image names must be strings: {names!r}"[:200])
        images = [read_image_file(name, base) for name in names]
        return Converted(images, None, {k: v for k, v in entry.items() if k not in ("image", "images")})


def open_source(src: str, images_dir: str | None = None, image_columns=None, text_column=None,
                drop_columns=(), no_images: bool = False):
    """The source for ``src``, its input checked (``UserError`` otherwise)."""
    if input_kind(src) == "llava":
        source = LlavaSource(src, images_dir)
    else:
        source = ParquetSource(parquet_files(src), image_columns, text_column, list(drop_columns), no_images)
    source.check()
    return source


# ---- the writer ----------------------------------------------------------------------------------

def _tar_member(name: str, data: bytes) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
    info.uname = info.gname = ""
    header = info.tobuf(format=tarfile.USTAR_FORMAT if len(name) < 100 else tarfile.PAX_FORMAT)
    return header + data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)


@dataclass(slots=True)
class Summary:
    out: str = ""
    shards: int = 0
    samples: int = 0
    bytes: int = 0
    kept_shards: int = 0
    skipped: dict = field(default_factory=dict)
    names: list = field(default_factory=list)  # the shard files, in order
    report: str = ""  # every skipped row, one JSON line each

    def as_dict(self) -> dict:
        return {"out": self.out, "shards": self.shards, "samples": self.samples, "bytes": self.bytes,
                "kept_from_earlier_run": self.kept_shards, "skipped": self.skipped, "report": self.report}

    def lines(self) -> list[str]:
        """What a run wrote, for people: where, how much, and what it left out."""
        first_last = " .. ".join(dict.fromkeys([self.names[0], self.names[-1]])) if self.names else ""
        kept = f"; {self.kept_shards} kept from an earlier run" if self.kept_shards else ""
        lines = [f"wrote {_count(self.samples, 'sample')} in {_count(self.shards, 'shard')} ({self.bytes / 1e6:.1f} MB) "
                 f"to {self.out}"
                 + (f": {first_last}" if first_last else "") + kept]
        if self.skipped:
            reasons = ", ".join(f"{r} {n}" for r, n in sorted(self.skipped.items(), key=lambda kv: -kv[1]))
            lines.append(f"skipped {_count(sum(self.skipped.values()), 'row')} ({reasons}), each named in {self.report}")
        return lines


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _load_progress(out: str, fingerprint: str) -> list[dict]:
    """The complete shards of an earlier run of the same conversion that are still intact."""
    path = os.path.join(out, PROGRESS)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        state = json.load(f)
    if state.get("fingerprint") != fingerprint:
        raise UserError(f"{out} holds shards of another conversion (other source or options): "
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


class _ShardWriter:
    """Samples into shards closed before they pass ``shard_bytes``, each written under a temporary
    name, renamed when whole and then recorded in the progress file with the rows it covers."""

    def __init__(self, out: str, prefix: str, fingerprint: str, shard_bytes: int):
        self.out, self.prefix, self.fingerprint, self.shard_bytes = out, prefix, fingerprint, shard_bytes
        self.shards = _load_progress(out, fingerprint)
        self.kept = len(self.shards)
        self.samples = sum(s["samples"] for s in self.shards)
        self.skipped: dict[str, int] = {}
        for s in self.shards:
            for reason, n in s["skipped"].items():
                self.skipped[reason] = self.skipped.get(reason, 0) + n
        self._start_shard()

    @property
    def resume_at(self) -> int:
        return self.shards[-1]["next_row"] if self.shards else 0

    def remove_stale(self) -> None:
        """Partial shards, and shards past the intact ones."""
        intact = {s["name"] for s in self.shards}
        for stale in glob.glob(os.path.join(self.out, f"{self.prefix}-*.tar*")):
            if os.path.basename(stale) not in intact:
                os.remove(stale)

    def _start_shard(self) -> None:
        self.pending: list[bytes] = []
        self.pending_bytes, self.pending_samples, self.pending_skipped = 0, 0, {}

    def add(self, row: int, blob: bytes) -> None:
        if self.pending and self.pending_bytes + len(blob) > self.shard_bytes:
            self._close(row)
        self.pending.append(blob)
        self.pending_bytes += len(blob)
        self.pending_samples += 1
        self.samples += 1

    def skip(self, reason: str) -> None:
        self.pending_skipped[reason] = self.pending_skipped.get(reason, 0) + 1
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def _close(self, next_row: int) -> None:
        name = f"{self.prefix}-{len(self.shards):06d}.tar"
        path = os.path.join(self.out, name)
        with open(path + ".tmp", "wb") as f:
            f.writelines(self.pending)
            f.write(b"\0" * (2 * tarfile.BLOCKSIZE))
            f.write(b"\0" * (-f.tell() % tarfile.RECORDSIZE))
        os.replace(path + ".tmp", path)
        self.shards.append({"name": name, "samples": self.pending_samples, "file_bytes": os.path.getsize(path),
                            "next_row": next_row, "skipped": self.pending_skipped})
        _save_progress(self.out, self.fingerprint, self.shards, done=False)
        self._start_shard()

    def finish(self, total_rows: int) -> None:
        if self.pending:
            self._close(total_rows)
        elif self.pending_skipped and self.shards:  # skipped rows after the last sample belong to the last shard
            for reason, n in self.pending_skipped.items():
                self.shards[-1]["skipped"][reason] = self.shards[-1]["skipped"].get(reason, 0) + n
            self.shards[-1]["next_row"] = total_rows
        _save_progress(self.out, self.fingerprint, self.shards, done=True)

    def summary(self, report: str) -> Summary:
        return Summary(self.out, len(self.shards), self.samples, sum(s["file_bytes"] for s in self.shards),
                       self.kept, dict(self.skipped), [s["name"] for s in self.shards], report)


class _SkipReport:
    """``OUT/convert-report.jsonl``: one line per row that became no sample, where it is and why.
    A resumed run keeps the lines of the rows its kept shards cover and writes the rest again."""

    def __init__(self, path: str, resume_at: int):
        self.path = path
        earlier = []
        if resume_at and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                earlier = [line for line in f if _report_row(line) < resume_at]
        self._file = open(path, "w", encoding="utf-8")
        self._file.writelines(earlier)

    def add(self, row: int, skip: Skip, where: dict) -> None:
        entry = {"row": row, **where, "reason": skip.reason} | ({"detail": skip.detail} if skip.detail else {})
        self._file.write(json.dumps(entry, ensure_ascii=False, default=str) + "\n")

    def close(self) -> None:
        self._file.close()


def _report_row(line: str) -> float:
    try:
        return json.loads(line)["row"]
    except (ValueError, KeyError, TypeError):  # a line cut by an interrupted run: written again
        return float("inf")


def _sample_blob(make, row: int) -> bytes:
    """One row as tar members, or ``Skip``; whatever else a row's values raise costs that row alone."""
    try:
        return b"".join(_tar_member(n, d) for n, d in make().members(f"{row:09d}"))
    except Skip:
        raise
    except Exception as exc:  # e.g. a lone surrogate in a string, which UTF-8 cannot encode
        raise Skip("unconvertible_row", f"{type(exc).__name__}: {exc}"[:300]) from None


def convert(source, out: str, shard_bytes: int = 512 << 20, prefix: str = "shard", progress: bool = True) -> Summary:
    """Write ``source``'s samples as shards under ``out``; resumes an interrupted run of the same job."""
    from tqdm import tqdm

    os.makedirs(out, exist_ok=True)
    fingerprint = hashlib.sha1(json.dumps([source.describe(), shard_bytes, prefix], default=str)
                               .encode()).hexdigest()[:16]
    writer = _ShardWriter(out, prefix, fingerprint, shard_bytes)
    writer.remove_stale()
    report = _SkipReport(os.path.join(out, REPORT), writer.resume_at)
    total = source.rows()
    bar = tqdm(total=total, initial=writer.resume_at, unit="row", disable=not progress, file=sys.stderr,
               desc=f"convert -> {out}")
    try:
        for row, make, where in source.from_row(writer.resume_at):
            try:
                writer.add(row, _sample_blob(make, row))
            except Skip as exc:
                writer.skip(exc.reason)
                report.add(row, exc, where)
            bar.update(1)
    finally:
        report.close()
        bar.close()
    writer.finish(total)
    return writer.summary(report.path)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vlmfeed convert", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("src", help="a .parquet file, a directory of them, or a LLaVA-style .json/.jsonl")
    ap.add_argument("--out", required=True, help="directory for the shards (a rerun resumes there)")
    ap.add_argument("--shard-bytes", type=parse_bytes, default=512 << 20, help="close a shard before it passes this")
    ap.add_argument("--prefix", default="shard", help="shard file names: PREFIX-000000.tar, ...")
    ap.add_argument("--images-dir", default=None, help="LLaVA: where the entries' image paths start (default: the "
                                                       "JSON's directory)")
    ap.add_argument("--image-column", action="append", default=None, help="Parquet: image column(s), holding bytes, "
                    "the Image feature or file paths (default: every column in the Image feature layout)")
    ap.add_argument("--text-column", default=None, help=f"Parquet: the caption column (default: first of "
                                                        f"{', '.join(TEXT_COLUMNS)})")
    ap.add_argument("--drop-column", action="append", default=[], help="Parquet: a column left out of the samples")
    ap.add_argument("--no-images", action="store_true", help="Parquet: text-only data; no image column expected")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise UserError(f"--out {args.out} is a file; pass a directory (a new one, or one this command wrote)")
        source = open_source(args.src, args.images_dir, args.image_column, args.text_column, args.drop_column,
                             args.no_images)
        summary = convert(source, args.out, args.shard_bytes, args.prefix, progress=not args.quiet)
    except UserError as exc:
        print(f"vlmfeed convert: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk, a directory not writable: the shards written so far stay
        print(f"vlmfeed convert: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    for line in summary.lines():
        print(line)
    if isinstance(source, LlavaSource) and "image_file_not_found" in summary.skipped:
        print(f"image paths were looked up under {source.base}; pass --images-dir if they start elsewhere")
    if summary.samples == 0:
        why = "the input has no rows" if not summary.skipped else f"every row was skipped, see {summary.report}"
        print(f"vlmfeed convert: nothing usable was written: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from datasvc.tools.cli import main as vlmfeed

    sys.exit(vlmfeed(["convert", *sys.argv[1:]]))
