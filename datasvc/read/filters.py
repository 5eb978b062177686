"""Sample filters a user applies: rules of the run, counted as ``skipped_by_rule`` under the rule's text.

A rule is ``FIELD OP VALUE`` with OP one of ``>= <= > < == !=``, parsed by a regular expression (never
evaluated). FIELD is one of the measures below, else a key of the sample's metadata (the
img2dataset JSON: ``similarity``, ``status``, ``width``, ...; dotted keys reach nested objects):

- ``image_min_side`` / ``image_max_side``: the shortest / longest side in pixels over the sample's
  images, read from their headers (no decode);
- ``image_aspect``: the largest long-side / short-side ratio over its images;
- ``caption_chars``: characters of the caption, or of a conversation's assistant replies;
- ``images``: how many images the sample has.

VALUE is a number, or a string (quotes optional: ``status==success`` and ``status == "success"``
are the same rule). Numbers compare as numbers, strings only with ``==`` / ``!=``. A sample that
lacks the field, or whose value does not compare, fails the rule (it is skipped, not kept). A
sample without images passes the image rules. Images whose header cannot be read pass the rules
here and are rejected with their own reason when decoded.
"""
from __future__ import annotations

import io
import math
import operator
import re
import warnings
from dataclasses import dataclass

from PIL import Image

from datasvc.read.formats import caption_chars
from datasvc.rejects import RULE_PREFIX

_OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne, ">": operator.gt,
        "<": operator.lt}
_RULE = re.compile(r"^\s*([A-Za-z_][\w.\-]*)\s*(>=|<=|==|!=|>|<)\s*(.*?)\s*$")
IMAGE_FIELDS = ("image_min_side", "image_max_side", "image_aspect")
MEASURES = IMAGE_FIELDS + ("caption_chars", "images")


def _number(value) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


@dataclass(frozen=True, slots=True)
class Rule:
    field: str
    op: str
    value: object  # float or str
    text: str  # as written, normalized: "similarity>=0.28"

    @classmethod
    def parse(cls, spec: str) -> "Rule":
        m = _RULE.match(spec)
        if not m or not m.group(3):
            raise ValueError(f"filter {spec!r} is not FIELD OP VALUE (OP one of >= <= > < == !=), "
                             "e.g. 'similarity>=0.28' or 'status==success'")
        field_, op, raw = m.groups()
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
            value: object = raw[1:-1]
        else:
            number = _number(raw)
            value = raw if number is None else number
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"filter {spec!r}: {raw!r} is not a finite number, so no sample could pass or fail it "
                             "as meant; give a number such as 0.28")
        if isinstance(value, str) and op not in ("==", "!="):
            raise ValueError(f"filter {spec!r}: {op} needs a number, not {raw!r}")
        if field_ in MEASURES and not isinstance(value, float):
            raise ValueError(f"filter {spec!r}: {field_} is a number")
        shown = raw if isinstance(value, float) else value
        return cls(field_, op, value, f"{field_}{op}{shown}")

    def holds(self, actual) -> bool:
        if isinstance(self.value, float):
            number = _number(actual)
            return number is not None and _OPS[self.op](number, self.value)
        if actual is None or isinstance(actual, (dict, list)):
            return False
        return _OPS[self.op](str(actual), self.value)


def _lookup(metadata: dict, dotted: str):
    value = metadata.get(dotted) if isinstance(metadata, dict) else None
    if value is None and "." in dotted:
        value = metadata
        for key in dotted.split("."):
            value = value.get(key) if isinstance(value, dict) else None
    return value


def _image_sides(data: bytes) -> tuple[int, int] | None:
    """(short side, long side) from the image header alone (PIL opens lazily: no pixel is read)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            w, h = Image.open(io.BytesIO(data)).size
    except Exception:  # not readable here: the decode stage names the reason
        return None
    return (min(w, h), max(w, h)) if w > 0 and h > 0 else None


def _image_measures(images) -> dict | None:
    sides = []
    for _ext, data in images:
        s = _image_sides(data)
        if s is None:
            return None
        sides.append(s)
    if not sides:
        return None
    return {"image_min_side": float(min(s for s, _ in sides)), "image_max_side": float(max(l for _, l in sides)),
            "image_aspect": max(l / s for s, l in sides)}


@dataclass(frozen=True, slots=True)
class SampleRules:
    """The user's filters, checked in order; the first that fails names the skip."""

    rules: tuple[Rule, ...] = ()

    @classmethod
    def parse(cls, specs) -> "SampleRules":
        return cls(tuple(Rule.parse(s) for s in specs))

    def __bool__(self) -> bool:
        return bool(self.rules)

    def check(self, raw) -> str | None:
        """The counted reason (``RULE_PREFIX`` + the rule) when ``raw`` fails a rule, else None."""
        measures: dict = {}
        for rule in self.rules:
            if rule.field in IMAGE_FIELDS:
                if "image_min_side" not in measures:
                    measures.update(_image_measures(raw.images) or dict.fromkeys(IMAGE_FIELDS))
                actual = measures[rule.field]
                if actual is None:
                    continue  # no images, or none readable here: not this rule's to judge
            elif rule.field == "caption_chars":
                actual = caption_chars(raw)
            elif rule.field == "images":
                actual = len(raw.images)
            else:
                actual = _lookup(raw.metadata, rule.field)
            if not rule.holds(actual):
                return RULE_PREFIX + rule.text
        return None


_SHORTHANDS = (("min_image_side", "image_min_side>={}", int), ("max_image_side", "image_max_side<={}", int),
               ("max_aspect", "image_aspect<={}", float), ("min_caption_chars", "caption_chars>={}", int),
               ("max_caption_chars", "caption_chars<={}", int))


def rules_from_flags(filters=(), **shorthands) -> tuple[str, ...]:
    """Rule strings and the shorthands (``min_image_side=64`` -> ``image_min_side>=64``) -> what
    ``ServiceConfig.filters`` holds, each rule checked (a bad one fails here, named)."""
    unknown = set(shorthands) - {name for name, _, _ in _SHORTHANDS}
    if unknown:
        raise ValueError(f"unknown filter shorthands {sorted(unknown)}")
    out = list(filters or ())
    for name, rule, _kind in _SHORTHANDS:
        if shorthands.get(name) is not None:
            out.append(rule.format(shorthands[name]))
    for spec in out:
        Rule.parse(spec)
    return tuple(out)


def _checked_rule(spec: str) -> str:
    """An argparse type: a rule that does not parse is named in one line as the options are read."""
    import argparse

    try:
        Rule.parse(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


def add_filter_flags(parser) -> None:
    """``--filter RULE`` (repeatable) and the shorthands, on an argparse parser or group."""
    parser.add_argument("--filter", action="append", default=[], metavar="RULE", dest="filters", type=_checked_rule,
                        help="keep samples where RULE holds, e.g. 'similarity>=0.28', 'status==success' "
                             "(repeatable; fields: metadata keys, image_min_side, image_max_side, image_aspect, "
                             "caption_chars, images); the others count as skipped_by_rule")
    for name, rule, kind in _SHORTHANDS:
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                            help=f"shorthand for --filter '{rule.format(name.upper())}'")


def filters_from_flags(args) -> tuple[str, ...]:
    """The rules that ``add_filter_flags``' flags ask for (``args``: the parsed namespace)."""
    return rules_from_flags(getattr(args, "filters", ()), **{name: getattr(args, name, None)
                                                            for name, _, _ in _SHORTHANDS})
