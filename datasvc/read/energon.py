"""Megatron-Energon datasets, read as they are: a directory that ``energon prepare`` made (its
``.nv-meta/`` holding ``dataset.yaml``, ``split.yaml`` and the shard index) is a shard source.

- ``--shards /data/ds`` reads the ``train`` split, ``--shards /data/ds:val`` another; the split's
  parts are ``split.yaml``'s brace patterns, less its excluded shards, in its order.
- ``dataset.yaml``'s sample type and ``field_map`` say what a sample is. ``CaptioningSample``
  (``image``, ``caption``), ``VQASample`` (``image``, ``context``, ``answers``; the first answer is
  the reply) and ``CrudeWebdataset`` (the parts as they are) are read; a field is a part (``txt``,
  ``jpg``) or a path into the JSON part (``json[question]``, ``json[meta][alt]``, alternatives by
  comma). Image fields take the sample's image parts in member order, as for any shard.
- A ``sample_loader`` (Python code in the dataset) is never run: such a dataset is read by the
  plain WebDataset rules, with a warning. Other sample types fail fast, naming what is supported.
- The schema applies only to a dataset named by its directory (``DIR`` or ``DIR:SPLIT``), and the
  log says which schema goes with which shards. Shards named by their own paths or globs are plain
  shards, whatever ``.nv-meta`` a parent directory holds: a stray one must not rewrite their captions.
  Each process that reads samples learns the named datasets from the patterns it expands
  (``split_shards``), or from ``name_datasets`` with the configuration's patterns.

Parsing is plain YAML/JSON (``yaml.safe_load``); nothing from Energon is imported, so the service
reads these datasets with or without it installed.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field

from braceexpand import braceexpand

log = logging.getLogger(__name__)
META = ".nv-meta"
SUPPORTED = ("CaptioningSample", "VQASample", "CrudeWebdataset")


@dataclass(frozen=True, slots=True)
class SampleSchema:
    sample_type: str  # "CaptioningSample", "VQASample", "CrudeWebdataset" (read as plain parts)
    field_map: dict = field(default_factory=dict)


def is_dataset(path: str) -> bool:
    return os.path.isdir(os.path.join(path, META))


def _load(path: str):
    import json

    import yaml

    with open(path) as f:
        return json.load(f) if path.endswith(".json") else yaml.safe_load(f)


def split_shards(spec: str) -> list[str] | None:
    """``DIR`` or ``DIR:SPLIT`` of a prepared dataset -> its split's shard paths; None when ``spec``
    is not a prepared dataset (then it is an ordinary path, glob or pattern)."""
    root, split = spec, "train"
    if not is_dataset(root):
        head, colon, tail = spec.rpartition(":")
        if not colon or not is_dataset(head):
            return None
        root, split = head, tail
    meta = os.path.join(root, META)
    split_file = os.path.join(meta, "split.yaml")
    if not os.path.isfile(split_file) and os.path.isfile(os.path.join(meta, "split.json")):
        split_file = os.path.join(meta, "split.json")
    splits = _load(split_file) or {}
    parts = splits.get("split_parts") or {}
    if split not in parts:
        raise ValueError(f"{root}: no split {split!r} in {os.path.basename(split_file)} "
                         f"(it has {sorted(parts)}): pass {root}:SPLIT")
    excluded = {name for pattern in splits.get("exclude") or [] for name in braceexpand(pattern)}
    names = [n for pattern in parts[split] or [] for n in braceexpand(pattern) if n not in excluded]
    missing = [n for n in names if not os.path.isfile(os.path.join(root, n))]
    if missing:
        raise ValueError(f"{root}: split {split!r} names {len(missing)} shards that are not there "
                         f"(first: {missing[0]}): re-run energon prepare, or fix split.yaml")
    schema_for_root(root)  # fail fast on a sample type that cannot be read
    shards = [os.path.join(root, n) for n in names]
    _name(root, split, shards)
    return shards


@functools.lru_cache(maxsize=256)
def schema_for_root(root: str) -> SampleSchema | None:
    path = os.path.join(root, META, "dataset.yaml")
    if not os.path.isfile(path):
        return None
    doc = _load(path) or {}
    if "sample_loader" in doc:
        log.warning("%s: dataset.yaml uses a sample_loader (Python code), which is never run here; its "
                    "samples are read by the plain WebDataset rules (image parts, txt, json)", root)
        return None
    kind = (doc.get("sample_type") or {}).get("__class__") or doc.get("__class__", "")
    if kind not in SUPPORTED:
        raise ValueError(f"{root}: Energon sample type {kind!r} is not read here (supported: "
                         f"{', '.join(SUPPORTED)}); convert it, or prepare it as CrudeWebdataset")
    return SampleSchema(kind, dict(doc.get("field_map") or {}))


_NAMED_SHARDS: dict[str, str] = {}  # absolute path of a shard -> the dataset root it was named through


def _name(root: str, split: str, shards: list[str]) -> None:
    """Record that ``shards`` were named as a dataset's split, and say once which schema reads them."""
    fresh = [p for p in map(os.path.abspath, shards) if p not in _NAMED_SHARDS]
    for path in fresh:
        _NAMED_SHARDS[path] = root
    if fresh:
        schema = schema_for_root(root)
        what = (f"{schema.sample_type} with field_map {schema.field_map}" if schema else
                "no schema (the plain WebDataset rules)")
        log.info("Energon dataset %s, split %r: %d shards read as %s", root, split, len(fresh), what)


def name_datasets(patterns) -> None:
    """Learn which of ``patterns`` (a configuration's shards) name a prepared dataset, so that this
    process applies their schemas; a process that only reads samples calls this first."""
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        split_shards(pattern)


def schema_for_shard(shard: str) -> SampleSchema | None:
    """The sample schema of the dataset ``shard`` was named through (``DIR`` or ``DIR:SPLIT``); None
    for a shard named by its own path or a glob, whatever ``.nv-meta`` lies above it."""
    root = _NAMED_SHARDS.get(os.path.abspath(shard))
    return schema_for_root(root) if root is not None else None


def _access(doc, field_desc: str, text: str | None):
    """One field_map value against a sample: the ``txt`` part, or a path into its JSON."""
    for option in field_desc.split(","):
        name, _, rest = option.strip().partition("[")
        if name == "txt" and not rest:
            if text is not None:
                return text
            continue
        if name != "json":
            continue
        value = doc
        for key in filter(None, rest.rstrip("]").split("][")) if rest else []:
            if isinstance(value, dict) and key in value:
                value = value[key]
            elif isinstance(value, list) and key.lstrip("-").isdigit() and -len(value) <= int(key) < len(value):
                value = value[int(key)]
            else:
                value = None
                break
        if value is not None:
            return value
    return None


def apply_schema(raw, schema: SampleSchema, doc) -> bool:
    """Read a sample of a prepared dataset by its field_map; False: the plain rules apply."""
    fm = schema.field_map
    if schema.sample_type == "CaptioningSample" and "caption" in fm:
        caption = _access(doc, fm["caption"], raw.text)
        raw.conversation, raw.metadata = None, doc if isinstance(doc, dict) else {}
        raw.text = caption if isinstance(caption, str) else None
        return True
    if schema.sample_type == "VQASample" and "context" in fm:
        context = _access(doc, fm["context"], raw.text)
        answers = _access(doc, fm.get("answers", ""), raw.text) if "answers" in fm else None
        answer = answers[0] if isinstance(answers, list) and answers else answers
        raw.metadata = doc if isinstance(doc, dict) else {}
        if not isinstance(context, str) or not isinstance(answer, str):
            raw.conversation = {"messages": []}  # counted as bad_conversation
            return True
        # The images go first in the user turn (a conversation without image parts gets them there).
        raw.conversation = {"messages": [{"role": "user", "content": [{"type": "text", "text": context}]},
                                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}
        raw.text = None
        return True
    return False
