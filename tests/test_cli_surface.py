"""One knob, one definition, and a ratchet on the command-line surface.

The data-geometry flags (``datasvc.training.DATA_FLAGS``) are declared only there; every command
that takes one takes that definition, so ``--max-pixels`` means and defaults to the same thing
everywhere (the benchmarks pin their own settings and are left out). Every command's options are
recorded in ``tests/data/cli_options.json``: an option added or removed fails here until the record
is updated with it (``VLMFEED_RECORD_CLI=1 pytest tests/test_cli_surface.py``), so the surface
grows only on purpose."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from datasvc.training import DATA_FLAGS

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "data" / "cli_options.json"
COMMANDS = {
    "trainer.run": ["trainer.run", "qwen3vl", "--help"], "plan": ["trainer.plan", "--help"],
    "inspect": ["datasvc.tools.inspect", "--help"], "info": ["datasvc.tools.info", "--help"],
    "profile": ["datasvc.tools.profile", "--help"], "sizes": ["datasvc.tools.sizes", "--help"],
    "synth": ["datasvc.tools.synth", "--help"], "convert": ["datasvc.tools.convert", "--help"],
    "samples": ["datasvc.tools.samples", "--help"],
}
# Benchmarks pin the settings their questions are answered at; they are not user knobs.
PINNED = ("datasvc/tools/bench/", "trainer/bench/")


def declarations(flag: str) -> list[str]:
    """Every ``add_argument(flag, ...)`` in the product, the tools and the examples, as file:line."""
    found = []
    for path in [*ROOT.glob("datasvc/**/*.py"), *ROOT.glob("trainer/**/*.py"), *ROOT.glob("pipelines/**/*.py"),
                 *ROOT.glob("docs/examples/*.py")]:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(PINNED):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
                    and any(isinstance(a, ast.Constant) and a.value == flag for a in node.args)):
                found.append(f"{rel}:{node.lineno}")
    return found


@pytest.mark.parametrize("flag", sorted(DATA_FLAGS))
def test_a_geometry_flag_is_declared_once(flag):
    assert declarations(flag) == [], f"{flag} declared again; use datasvc.training.add_data_flags"


def options_of(argv: list[str]) -> list[str]:
    out = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr[-2000:]
    return sorted(set(re.findall(r"^\s+(--[a-z0-9][a-z0-9-]*)", out.stdout, re.M)) - {"--help"})


def test_the_command_line_surface_grows_only_on_purpose():
    surface = {name: options_of(argv) for name, argv in COMMANDS.items()}
    if os.environ.get("VLMFEED_RECORD_CLI"):
        RECORD.write_text(json.dumps(surface, indent=1) + "\n")
    recorded = json.loads(RECORD.read_text())
    changes = {name: {"added": sorted(set(now) - set(recorded.get(name, []))),
                      "removed": sorted(set(recorded.get(name, [])) - set(now))}
               for name, now in surface.items() if set(now) != set(recorded.get(name, []))}
    assert not changes, (f"options changed: {changes}; if on purpose, record them with "
                         "VLMFEED_RECORD_CLI=1 pytest tests/test_cli_surface.py")


def test_every_command_that_takes_a_geometry_flag_means_the_same_by_it():
    recorded = json.loads(RECORD.read_text())
    takers = {flag: [name for name, opts in recorded.items() if flag in opts] for flag in DATA_FLAGS}
    assert {"inspect", "info", "profile"} <= set(takers["--device"])
    assert {"trainer.run", "inspect", "info", "profile", "sizes"} <= set(takers["--max-pixels"])


def _other_value(section, f, default):
    """A value of field ``f`` that is not its default, as a flag takes it."""
    import typing

    from datasvc.flags import base_type as _base

    base = _base(typing.get_type_hints(section)[f.name])
    if base is bool:
        return not default
    if typing.get_origin(base) is typing.Literal:
        return next(c for c in typing.get_args(base) if c != default)
    if typing.get_origin(base) is list:
        return ["core_attn", "mlp"]
    if base is float:
        return (default or 1.0) * 3
    if base is int:
        return (default or 1) + 2
    return "given-value"


def test_every_training_setting_is_a_flag_on_its_field_and_fills_it():
    """The trainer's options are generated from its config sections: each flagged field round-trips
    through its flag, and a field without one is a known exception, so no setting is written twice."""
    import argparse
    import dataclasses

    from trainer.config import TrainerConfig, add_cli_args, from_args
    from datasvc.flags import field_flag as _flag, flag_name

    unflagged, parser = [], add_cli_args(argparse.ArgumentParser())
    for owner in dataclasses.fields(TrainerConfig):
        section = type(getattr(TrainerConfig(), owner.name))
        for f in dataclasses.fields(section):
            if _flag(f) is None:
                unflagged.append(f"{owner.name}.{f.name}")
                continue
            value = _other_value(section, f, getattr(section(), f.name))
            argv = [flag_name(f)] if value is True else [f"--no-{flag_name(f)[2:]}"] if value is False \
                else [flag_name(f), *map(str, value if isinstance(value, list) else [value])]
            if value is False and _flag(f).action == "store_true":
                continue  # a store_true flag is off unless given
            cfg = from_args(parser.parse_args(argv))
            assert getattr(getattr(cfg, owner.name), f.name) == value, argv
    assert unflagged == ["model.pipeline"]  # the positional pipeline argument


def test_every_data_section_flag_fills_its_field():
    """The data service's sections that carry flags (decode, balance) are built from them: each flag
    given to trainer.run lands in its field of the job's data config, so it is written once, there."""
    import argparse
    import dataclasses

    from datasvc.config import BalanceConfig, DecodeConfig
    from datasvc.flags import field_flag, flag_name, section_from_args
    from trainer.job import add_job_args

    parser = argparse.ArgumentParser()
    add_job_args(parser)
    flagged = 0
    for section in (DecodeConfig, BalanceConfig):
        for f in dataclasses.fields(section):
            if field_flag(f) is None:
                continue
            value = _other_value(section, f, getattr(section(), f.name))
            argv = [flag_name(f)] if value is True else [flag_name(f), str(value)]
            assert getattr(section_from_args(section, parser.parse_args(argv)), f.name) == value, argv
            flagged += 1
    assert flagged == 6  # device, threads, cpu_jpeg_decoder, resize_on; enabled, sizes_index
