"""What a bench result records of where it came from: the question it answers, the command, the
checkout's commit, the date, the hardware and the defaults it holds for."""
from __future__ import annotations

import dataclasses
import os
import time

from datasvc.host import commit, cpu_model


def hardware() -> str:
    """The CPU model and core count, and the GPU where torch sees one."""
    desc = f"{cpu_model()}, {os.cpu_count()} cores"
    try:
        import torch

        if torch.cuda.is_available():
            desc += f", {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return desc


def _plain(value):
    """``value`` as JSON holds it: dataclasses as dicts, tuples as lists, anything else by its repr."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def service_defaults() -> dict:
    """The data service's defaults at this checkout: the training geometry of each device and every
    ``ServiceConfig`` field's default. A result holds for these; two stamps' diff shows what moved."""
    from datasvc.config import ServiceConfig
    from datasvc.training import BLOCK_MICRO_BATCHES, CHAIN_BLOCKS, DEVICE_DEFAULTS

    service = {}
    for f in dataclasses.fields(ServiceConfig):
        if f.default is not dataclasses.MISSING:
            service[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            service[f.name] = f.default_factory()
    geometry = {"devices": DEVICE_DEFAULTS, "block_micro_batches": BLOCK_MICRO_BATCHES, "chain_blocks": CHAIN_BLOCKS}
    return _plain({"training_geometry": geometry, "service": service})


def stamp(rep: dict, question: str, command: str, defaults: dict | None = None) -> dict:
    """``rep`` led by its provenance. ``defaults``: what else the result holds for (the trainer's
    defaults, a bench's pinned settings), recorded beside the data service's own."""
    held = {**service_defaults(), **_plain(defaults or {})}
    return {"question": question, "command": command, "commit": commit(),
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "hardware": hardware(), "defaults": held, **rep}
