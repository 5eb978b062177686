"""What ``vlmfeed convert`` reads, and how: the checks made before anything is written (that the
input is a kind convert reads, with what to do instead for a Hub dataset id, a ``datasets``
``save_to_disk`` folder or another file type; that the columns asked for exist and hold what they
are named for; that no column of bytes would reach the samples' JSON as text), each failing as a
one-line ``UserError`` that names the fix (exit status 2); and a row's values as a sample's
members (``Converted``), or the reason the row is skipped (``Skip``). Image files a row names are
read only from under the images folder (``image_file_under``): the input says which files to read,
and nothing else on the machine may end up in a shard.
"""
from __future__ import annotations

import glob
import json
import os
import re
import stat
from dataclasses import dataclass

from datasvc.usage import UserError

TEXT_COLUMNS = ("text", "caption", "txt")
CONVERSATION_COLUMNS = ("messages", "conversations")
BINARY_IMAGE_NAMES = ("image", "jpg", "png")  # plain binary columns taken as images without being named
READS = "a .parquet file, a directory of them, or a LLaVA-style .json/.jsonl with its --images-dir"
LLAVA_IMAGES_CHECKED = 32  # entries whose images are looked for before writing: a wrong folder fails fast
_MAGIC = ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG\r\n\x1a\n", "png"), (b"RIFF", "webp"))


def input_kind(src: str) -> str:
    """``"parquet"`` or ``"llava"``, or a ``UserError`` saying what to pass instead."""
    if os.path.isdir(src):
        if parquet_files(src):
            return "parquet"
        if _saved_by_datasets(src):
            raise UserError(f"{src} is a `datasets` save_to_disk folder (Arrow files); convert reads Parquet: "
                             f"write it with `datasets.load_from_disk({src!r}).to_parquet('data.parquet')` "
                             "(a DatasetDict: `ds['train'].to_parquet(...)` per split) and pass that file")
        raise UserError(f"no .parquet files under {src}; convert reads {READS}")
    if os.path.isfile(src):
        lowered = src.lower()
        if lowered.endswith(".parquet"):
            return "parquet"
        if lowered.endswith((".json", ".jsonl")):
            return "llava"
        if lowered.endswith(".arrow"):
            raise UserError(f"{src} is an Arrow file; convert reads Parquet: write it with "
                             f"`datasets.Dataset.from_file({src!r}).to_parquet('data.parquet')` and pass that file")
        ext = os.path.splitext(src)[1] or "extension-less"
        raise UserError(f"{src}: convert does not read {ext} files; it reads {READS}")
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", src):
        raise UserError(f"{src!r} is not a local path; for a Hugging Face Hub dataset, write it as Parquet first "
                         f"(`datasets.load_dataset({src!r}, split='train').to_parquet('train.parquet')`, or "
                         f"`hf download {src} --repo-type dataset --include '*.parquet' --local-dir DIR` where "
                         "the repository holds Parquet) and pass the file or DIR")
    raise UserError(f"{src}: no such file or directory; convert reads {READS}")


def parquet_files(src: str) -> list[str]:
    if os.path.isdir(src):
        return sorted(glob.glob(os.path.join(src, "**", "*.parquet"), recursive=True))
    return [src]


def _saved_by_datasets(directory: str) -> bool:
    markers = ("dataset_dict.json", "state.json", "dataset_info.json")
    return any(os.path.exists(os.path.join(directory, m)) for m in markers) or bool(
        glob.glob(os.path.join(directory, "**", "*.arrow"), recursive=True))


def parquet_schema(path: str):
    """The file's Arrow schema from its footer, or a ``UserError`` for a file that is no Parquet."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).schema_arrow
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for bytes that are not Parquet
        raise UserError(f"{path} is not a readable Parquet file ({type(exc).__name__}: {exc})") from None


# ---- a row as a sample ---------------------------------------------------------------------------

def image_ext(data: bytes, fallback: str = "jpg") -> str:
    for magic, ext in _MAGIC:
        if data.startswith(magic) and (ext != "webp" or data[8:12] == b"WEBP"):
            return ext
    return fallback


class Skip(Exception):
    """A source row that cannot become a sample; ``reason`` is counted, ``detail`` reported."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def _json_value(value):
    """Values JSON has no type for (dates, decimals) as text; bytes never: they would be image data
    written as a string (the column checks keep bytes out; this is the last guard)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise Skip("bytes_in_json", f"{len(value)} bytes in a JSON field")
    return str(value)


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
            out.append((f"{key}.json", json.dumps(self.doc, ensure_ascii=False, default=_json_value).encode("utf-8")))
        return out


def image_file_under(path: str, base_dir: str) -> str:
    """The real path of the image file a row names, which must lie under ``base_dir`` (the
    --images-dir, or the folder of the file that names it): an absolute path, a ``..`` or a symlink
    leading out of it is ``image_outside_images_dir``, so a row cannot pack ``/proc/self/environ``,
    a key or any file beside the images into a shard. Real paths are compared, symlinks resolved."""
    root = os.path.realpath(base_dir)
    real = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, real]) != root:
        raise Skip("image_outside_images_dir", f"{path!r} leads to {real}, outside {root}")
    return real


def read_image_file(path: str, base_dir: str) -> bytes:
    """The bytes of a regular file under ``base_dir`` (``image_file_under``); ``image_file_not_found``
    for one that is not there or not a file (a FIFO is never opened to wait on)."""
    real = image_file_under(path, base_dir)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        raise Skip("image_file_not_found", os.path.join(base_dir, path)) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Skip("image_file_not_found", f"{os.path.join(base_dir, path)} is not a regular file")
        return f.read()


def image_bytes(value, base_dir: str) -> list[bytes]:
    if value is None:
        return []
    if isinstance(value, list):
        return [b for v in value for b in image_bytes(v, base_dir)]
    if isinstance(value, (bytes, bytearray)):
        return [bytes(value)]
    if isinstance(value, str):
        return [read_image_file(value, base_dir)]
    if not isinstance(value, dict):
        raise Skip("image_value_unreadable", f"a {type(value).__name__} where an image was expected")
    data, path = value.get("bytes"), value.get("path")
    if data:
        return [bytes(data)]
    if path:
        return [read_image_file(path, base_dir)]
    raise Skip("image_without_bytes")


def without_nulls(value):
    """Arrow gives every struct in a column every field, null where a row had none (an image part
    gets ``"text": None``): leave those out, as the row was written."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


# ---- column types ---------------------------------------------------------------------------------

def is_image_type(t) -> bool:
    """The ``datasets`` Image feature (a struct of ``bytes`` and ``path``), or a list of them."""
    import pyarrow as pa

    if pa.types.is_struct(t):
        return {t.field(i).name for i in range(t.num_fields)} >= {"bytes", "path"}
    return _is_list_type(t) and is_image_type(t.value_type)


def holds_bytes(t) -> bool:
    """Whether values of this type carry raw bytes anywhere (nested in structs, lists, maps)."""
    import pyarrow as pa

    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t) \
            or pa.types.is_binary_view(t):
        return True
    if pa.types.is_struct(t):
        return any(holds_bytes(t.field(i).type) for i in range(t.num_fields))
    if _is_list_type(t):
        return holds_bytes(t.value_type)
    if pa.types.is_map(t):
        return holds_bytes(t.key_type) or holds_bytes(t.item_type)
    if pa.types.is_dictionary(t):
        return holds_bytes(t.value_type)
    return False


def _is_list_type(t) -> bool:
    import pyarrow as pa

    return (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
            or pa.types.is_list_view(t) or pa.types.is_large_list_view(t))


def _is_string_type(t) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        return _is_string_type(t.value_type)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _can_hold_images(t) -> bool:
    """Bytes, the Image feature, or file paths (strings, or lists of them)."""
    return holds_bytes(t) or _is_string_type(t) or (_is_list_type(t) and _is_string_type(t.value_type))


# ---- the columns of one Parquet file ----------------------------------------------------------------

def resolve_columns(path: str, schema, image_columns: list[str] | None, text_column: str | None,
                    drop_columns: list[str], no_images: bool) -> tuple[list[str], str | None]:
    """(image columns, caption column or None) of one file, or a ``UserError``: a column named
    that is not there, a column that does not hold what it is named for, no text, no images, or
    a column of bytes that nothing claims (it would reach the JSON as text)."""
    names = list(schema.names)
    listing = ", ".join(names)
    for option, columns in (("--image-column", image_columns or []), ("--drop-column", drop_columns),
                            ("--text-column", [text_column] if text_column else [])):
        for col in columns:
            if col not in names:
                raise UserError(f"no column {col!r} in {path}; its columns are: {listing}. "
                                 f"Pass {option} with one of them.")
    for col in image_columns or []:
        if not _can_hold_images(schema.field(col).type):
            raise UserError(f"column {col!r} in {path} holds {schema.field(col).type}, not images (bytes, the "
                             f"Image feature, or file paths); its columns are: {listing}. "
                             "Pass --image-column with the one that holds images.")
    kept = [n for n in names if n not in drop_columns]
    images = list(image_columns) if image_columns else [] if no_images else [
        n for n in kept if is_image_type(schema.field(n).type)
        or (holds_bytes(schema.field(n).type) and n in BINARY_IMAGE_NAMES)]
    text = text_column or next((c for c in TEXT_COLUMNS if c in kept), None)
    if text is not None:
        _check_text_column(path, text, schema.field(text).type)
    elif not any(c in kept for c in CONVERSATION_COLUMNS):
        raise UserError(f"no text in {path}: no column named {', '.join(TEXT_COLUMNS + CONVERSATION_COLUMNS)}; "
                         f"its columns are: {listing}. Pass --text-column with the caption column.")
    if not images and not no_images:
        raise UserError(f"no image column in {path} (none in the Image feature layout, no binary column named "
                         f"{'/'.join(BINARY_IMAGE_NAMES)}); its columns are: {listing}. Pass --image-column with the "
                         "one that holds images, or --no-images for text-only data.")
    unclaimed = [n for n in kept if n not in images and n != text and holds_bytes(schema.field(n).type)]
    if unclaimed:
        cols = ", ".join(repr(c) for c in unclaimed)
        raise UserError(f"{cols} in {path} hold{'s' if len(unclaimed) == 1 else ''} bytes, which would be written "
                         f"into each sample's JSON as text: pass --image-column {unclaimed[0]} if they are images "
                         f"(once per image column), or --drop-column {unclaimed[0]} to leave them out")
    return images, text


def _check_text_column(path: str, column: str, t) -> None:
    if holds_bytes(t):
        raise UserError(f"column {column!r} in {path} holds bytes ({t}), not text: pass it as --image-column if "
                         "it holds images, and --text-column with the caption column")
    if not _is_string_type(t):
        raise UserError(f"column {column!r} in {path} holds {t}, not text; pass --text-column with a string column")


# ---- LLaVA JSON ------------------------------------------------------------------------------------

class BadLine:
    """A JSON Lines line that does not parse: one row skipped and reported, not the whole file."""

    def __init__(self, detail: str):
        self.detail = detail


def load_llava(path: str) -> list:
    """The entries of a LLaVA JSON list or JSON Lines file, or a ``UserError``."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.read(1)
            f.seek(0)
            if first == "[":
                entries = json.load(f)
            else:
                entries = [_json_line(line) for line in f if line.strip()]
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is not UTF-8 text ({exc})") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); convert reads a LLaVA JSON list or JSON Lines") from None
    if not isinstance(entries, list) or (first != "[" and all(isinstance(e, BadLine) for e in entries)):
        raise UserError(f"{path} holds no LLaVA entries; convert reads a JSON list of "
                         "{\"id\", \"image\", \"conversations\"} objects, or one such object per line")
    return entries


def _json_line(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        return BadLine(f"bad JSON line: {exc}")


def image_names(entry) -> list:
    """An entry's image paths: ``image`` (one or a list) or ``images``."""
    if not isinstance(entry, dict):
        return []
    names = entry.get("image") or entry.get("images") or []
    return [names] if isinstance(names, str) else list(names) if isinstance(names, list) else []


def check_llava_images(path: str, entries: list, base: str, images_dir_given: bool) -> None:
    """Fail before writing when none of the first entries' images is where they are looked for:
    a wrong or missing --images-dir, not a few missing files."""
    named = [n for e in entries[:LLAVA_IMAGES_CHECKED] for n in image_names(e)[:1] if isinstance(n, str)]
    if not named or any(_is_file_under(n, base) for n in named):
        return
    where = f"under --images-dir {base}" if images_dir_given else f"under {base} (the JSON's folder)"
    raise UserError(f"none of the first {len(named)} images named in {path} is {where}, e.g. {named[0]!r}; "
                     "pass --images-dir with the folder the entries' image paths start from")


def _is_file_under(path: str, base_dir: str) -> bool:
    try:
        return os.path.isfile(image_file_under(path, base_dir))
    except Skip:
        return False
