"""The trainer's command-line flags, generated from its config sections' ``flag(...)`` metadata
(``datasvc.flags``); a field marked ``data=True`` takes the data service's own flag
(``datasvc.training.DATA_FLAGS``), the one every data tool shares."""
from __future__ import annotations

import dataclasses

from datasvc.flags import argument, field_flag, flag, flag_name, section_from_args  # noqa: F401  (re-exported)
from datasvc.training import add_data_flags


def add_section_flags(group, section: type) -> None:
    """Add the flags of ``section``'s fields to ``group`` (a parser or an argument group)."""
    for f in dataclasses.fields(section):
        spec = field_flag(f)
        if spec is None:
            continue
        if spec.data:
            add_data_flags(group, flag_name(f))
        else:
            group.add_argument(flag_name(f), **argument(section, f))
