"""Megatron-Bridge-style ``key=value`` overrides, and a YAML file of them, for a ``ConfigContainer``.

    python -m trainer.run qwen3vl --config-file opt.yaml optimizer.adam_beta2=0.95 logger.log_interval=5

The YAML file is merged first, the ``key=value`` items (Hydra syntax) after it, with Bridge's own
machinery (``megatron.bridge.training.utils.omegaconf_utils``, as Bridge's example scripts use it).
A key the container lacks fails with Bridge's message, in one line, with the nearest keys.
``trainer.run`` checks them in the driver, on a container built on CPU, before Ray starts, and each
rank applies them to its container last; what ``trainer.run`` derives the data service and the
checkpoint layout from (sequence length, batch sizes, parallel sizes, dataset, save/load) stays with
its own flags.

Plain Python at import (``trainer.run`` parses its options before Megatron is loaded); Bridge is
imported when overrides are applied.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
from dataclasses import dataclass

from datasvc.usage import UserError

# A Hydra override as Bridge's scripts take it: a dotted key, "=", a value.
_DOTTED_OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.\w+)+=")

# What trainer.run derives the data service, the planner and the checkpoint layout from, and so
# keeps with its own flags: key prefix -> where it comes from.
TRAINER_RUN_KEEPS = {path: f"trainer.run's {flag}" for path, flag in {
    "model.seq_length": "--seq-len", "train.micro_batch_size": "--mbs", "train.global_batch_size": "--gbs",
    "model.tensor_model_parallel_size": "--tp", "model.pipeline_model_parallel_size": "--pp",
    "model.virtual_pipeline_model_parallel_size": "--vpp", "model.context_parallel_size": "--cp",
    "model.expert_model_parallel_size": "--ep", "model.expert_tensor_parallel_size": "--etp",
    "checkpoint.save": "--save", "checkpoint.load": "--load",
    "dataset": "data flags (--shards, --max-pixels, ...): the dataset is vlmfeed's stream",
}.items()}


class OverrideError(ValueError, UserError):
    """An override Bridge's machinery refused, or one that would change what is fixed elsewhere."""


@dataclass(frozen=True)
class BridgeOverrides:
    """Overrides for a ``ConfigContainer``: a YAML file's text (read where the job was launched, so
    ranks on other nodes need not see the file), then ``key=value`` items."""

    items: tuple[str, ...] = ()
    config_file: str | None = None  # the path, for messages
    config_text: str | None = None

    def __bool__(self) -> bool:
        return bool(self.items or self.config_text is not None)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "BridgeOverrides":
        path = getattr(args, "config_file", None)
        text = None
        if path:
            try:
                with open(path) as f:
                    text = f.read()
            except OSError as exc:
                raise OverrideError(f"--config-file {path}: {exc.strerror}") from None
        return cls(items=tuple(getattr(args, "overrides", None) or ()), config_file=path, config_text=text)


def add_override_args(parser: argparse.ArgumentParser) -> None:
    """The positional ``key=value`` items (after the pipeline) and ``--config-file``."""
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", default=[],
                        help="Megatron-Bridge overrides of the ConfigContainer, applied last (Hydra syntax, as "
                             "Bridge's scripts take them): e.g. optimizer.adam_beta2=0.95 logger.log_interval=5")
    parser.add_argument("--config-file", default=None, metavar="YAML",
                        help="Megatron-Bridge overrides in a YAML file (the ConfigContainer's layout), applied "
                             "before the key=value items")


def check_override_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Mistakes argparse cannot see: a stray word after the pipeline, and an override swallowed by a
    flag that takes several values (``--shards a.tar optimizer.lr=1e-4``)."""
    for item in args.overrides:
        if "=" not in item:
            parser.error(f"{item!r}: after the pipeline come only Megatron-Bridge overrides, KEY=VALUE "
                         "(e.g. optimizer.adam_beta2=0.95)")
    # Only a flag that takes a list can swallow what follows it (argparse keeps its actions private).
    for action in parser._actions:
        if action.option_strings and action.nargs in ("+", "*"):
            for item in getattr(args, action.dest) or ():
                if isinstance(item, str) and _DOTTED_OVERRIDE.match(item):
                    parser.error(f"{action.option_strings[0]} took {item!r}, which reads as a Megatron-Bridge "
                                 "override: put KEY=VALUE overrides right after the pipeline, or after --")


# ------------------------------------------------------------------------------------------------
# Applying them
# ------------------------------------------------------------------------------------------------
def apply_overrides(container, overrides: BridgeOverrides, *, keeps: dict[str, str] | None = None):
    """Apply ``overrides`` to ``container`` in place (the YAML text, then the items) and return it.
    ``keeps``: key prefixes that must not change, each with where its value comes from instead."""
    if not overrides:
        return container
    from megatron.bridge.training.utils.omegaconf_utils import apply_overrides as bridge_apply

    base, final, excluded = _merged(container, overrides)
    problems = [f"{path}={after!r}: Bridge's field holds a {type(before).__name__}"
                for path, before, after in _changed_leaves(base, final)
                if isinstance(before, (bool, int, float)) and isinstance(after, str)]
    for path, _, _ in _changed_leaves(base, final):
        problems += [f"{path} comes from {source}; set that instead" for prefix, source in (keeps or {}).items()
                     if path == prefix or path.startswith(prefix + ".")]
    if problems:
        raise OverrideError("; ".join(problems))
    bridge_apply(container, final, excluded)
    return container


def _merged(container, overrides: BridgeOverrides) -> tuple[dict, dict, dict]:
    """(the container as a dict, the dict after the overrides, the fields Bridge sets aside), the steps
    of Bridge's ``process_config_with_overrides``, with the YAML merged in struct mode so that a key
    the container lacks fails there as it does on the command line."""
    from megatron.bridge.training.utils.omegaconf_utils import (
        OverridesError,
        create_omegaconf_dict_config,
        parse_hydra_overrides,
    )
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    conf, excluded = create_omegaconf_dict_config(container)
    base = OmegaConf.to_container(conf, resolve=True)
    for item in overrides.items:
        if item.startswith("+"):
            raise OverrideError(f"{item}: Bridge's ConfigContainer is made of dataclasses, which take no new keys; "
                                "set an existing one (KEY=VALUE)")
    try:
        if overrides.config_text is not None:
            OmegaConf.set_struct(conf, True)
            conf = OmegaConf.merge(conf, OmegaConf.create(overrides.config_text))
        if overrides.items:
            conf = parse_hydra_overrides(conf, list(overrides.items))
    except (OverridesError, OmegaConfBaseException, yaml.YAMLError, ValueError) as exc:
        where = f"--config-file {overrides.config_file}: " if not isinstance(exc, OverridesError) else ""
        # Hydra's advice to append the key (+key=value) cannot work: the dataclasses take no new fields.
        message = re.sub(r"\s*To append to your config use \S+", "", " ".join(str(exc).split()))
        raise OverrideError(where + message + _nearest_keys(base, overrides)) from None
    return base, OmegaConf.to_container(conf, resolve=True), excluded


def _nearest_keys(base: dict, overrides: BridgeOverrides) -> str:
    """' (did you mean ...?)' for the first item whose key the container lacks."""
    for item in overrides.items:
        *parents, leaf = item.split("=", 1)[0].lstrip("~").split(".")
        level = base
        for name in parents:
            level = level.get(name) if isinstance(level, dict) else None
        if isinstance(level, dict) and leaf not in level:
            near = difflib.get_close_matches(leaf, [str(k) for k in level], n=3, cutoff=0.6)
            if near:
                return " (did you mean " + ", ".join(".".join([*parents, k]) for k in near) + "?)"
    return ""


def _changed_leaves(before, after, path: str = ""):
    """(dotted path, old value, new value) of every leaf that differs."""
    if isinstance(before, dict) and isinstance(after, dict):
        for key in after:
            yield from _changed_leaves(before.get(key), after[key], f"{path}.{key}" if path else str(key))
    elif before != after:
        yield path, before, after


# ------------------------------------------------------------------------------------------------
# In trainer.run's driver
# ------------------------------------------------------------------------------------------------
CPU_PATH_REFUSAL = ("KEY=VALUE overrides and --config-file apply to the Megatron-Bridge backend's ConfigContainer; "
                    "the CPU development path takes trainer.run's flags only (drop them, or train on GPUs)")


def validate_overrides(cfg, overrides: BridgeOverrides, world_size: int = 1) -> None:
    """Apply ``overrides`` to the container ``cfg`` gives, built here on CPU: a key Bridge does not
    know, or one trainer.run keeps, fails now rather than on every rank after start-up."""
    if not overrides:
        return
    try:
        from trainer.megatron.container import build_config_container
    except ImportError as exc:
        raise OverrideError(f"{CPU_PATH_REFUSAL}; Megatron-Bridge does not import here ({exc})") from None
    apply_overrides(build_config_container(cfg, world_size), overrides, keeps=TRAINER_RUN_KEEPS)


def describe(overrides: BridgeOverrides) -> dict:
    """What the run summary records about them."""
    return {k: v for k, v in dataclasses.asdict(overrides).items() if k != "config_text" and v}
