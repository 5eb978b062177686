"""Command-line flags generated from config fields: a field that carries ``flag(...)`` metadata is an
option of every command that adds its section, named after the field (``--min-lr`` for ``min_lr``)
unless it says otherwise, typed from its annotation and defaulted to its default, so a setting is
written once, on its owner. The data service's sections (``datasvc.config``) and the trainer's
(``trainer.config``) both carry them."""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal

from datasvc.usage import positive_int

_KEY = "flag"
_UNSET: Any = object()


@dataclass(frozen=True)
class Flag:
    help: str = ""
    name: str | None = None  # default: --FIELD-NAME
    type: Callable | None = None  # default: positive_int for int, float, str; choices for a Literal
    nargs: str | None = None  # a list field: "+" unless given
    metavar: str | None = None
    action: str | None = None  # a bool field: --X/--no-X unless given (e.g. "store_true")
    default: Any = _UNSET  # the flag's default where it is not the field's; None: resolved to the field's
    data: bool = False  # the data service's own flag (datasvc.training.DATA_FLAGS), shared with its tools


def flag(help: str = "", **options) -> dict:
    """Field metadata that makes the field a command-line option."""
    return {_KEY: Flag(help, **options)}


def field_flag(f: dataclasses.Field) -> Flag | None:
    return f.metadata.get(_KEY)


def flag_name(f: dataclasses.Field) -> str:
    return field_flag(f).name or "--" + f.name.replace("_", "-")


def _dest(f: dataclasses.Field) -> str:
    return flag_name(f)[2:].replace("-", "_")


def base_type(hint):
    """``X`` of ``X | None``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1 else hint


def argument(section: type, f: dataclasses.Field) -> dict:
    """``add_argument``'s keywords for field ``f`` of ``section``."""
    spec = field_flag(f)
    kw: dict = {"default": getattr(section(), f.name) if spec.default is _UNSET else spec.default, "help": spec.help}
    base = base_type(typing.get_type_hints(section)[f.name])
    if base is bool:
        kw["action"] = spec.action or argparse.BooleanOptionalAction
    elif typing.get_origin(base) is Literal:
        kw["choices"] = typing.get_args(base)
    elif typing.get_origin(base) is list:
        kw["nargs"] = spec.nargs or "+"
    else:
        kw["type"] = spec.type or {int: positive_int, float: float, str: str}[base]
    if spec.metavar:
        kw["metavar"] = spec.metavar
    return kw


def section_arguments(section: type) -> dict[str, dict]:
    """Flag name -> ``add_argument`` keywords, for each flagged field of ``section``."""
    return {flag_name(f): argument(section, f) for f in dataclasses.fields(section) if field_flag(f)}


def section_from_args(section: type, args: argparse.Namespace, **given):
    """``section`` from parsed flags: each flagged field from its flag (a flag left at None takes the
    field's default), the rest at their defaults; ``given`` fields as given."""
    values = {}
    for f in dataclasses.fields(section):
        if f.name in given or field_flag(f) is None:
            continue
        value = getattr(args, _dest(f))
        if value is not None:
            values[f.name] = list(value) if isinstance(value, tuple) else value
    return section(**values, **given)
