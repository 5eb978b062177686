"""``vlmfeed``: one command for the user tools (``SUBCOMMANDS`` below lists them; ``vlmfeed --help``
prints that list). Each subcommand's module is imported only when it is chosen, and gets the rest of
the command line as it is; ``vlmfeed SUBCOMMAND --help`` shows its options, and
``python -m MODULE`` runs the same. Training itself is ``python -m trainer.run PIPELINE`` (what
follows ``ray job submit --``).
"""
from __future__ import annotations

import importlib
import sys

from datasvc.usage import UserError

# subcommand -> (module with ``main(argv)``, one line of help)
SUBCOMMANDS = {
    "inspect": ("datasvc.tools.inspect", "write what a rank receives for some shards"),
    "info": ("datasvc.tools.info", "what shards hold, without decoding: samples, formats, sizes, text lengths, vision tokens"),
    "profile": ("datasvc.tools.profile.cli", "measure data throughput alone and judge it against a trainer"),
    "synth": ("datasvc.tools.synth.cli", "write realistic synthetic (or image-free mock) shards"),
    "bench": ("datasvc.tools.bench.cli", "benchmarks, one question each (vlmfeed bench --help lists them)"),
    "convert": ("datasvc.tools.convert", "convert other data formats to WebDataset shards"),
    "sizes": ("datasvc.tools.sizes", "index each shard's sample sizes ahead of a --balance-dp job"),
    "samples": ("datasvc.tools.samples", "write the bundled real photos (the default data) as shards"),
    # The one import of the trainer from the tools, by name and only when chosen: the planner sizes
    # a training job, so it lives with the trainer; the tools package never imports it statically.
    "plan": ("trainer.plan", "plan a training job (parallelism, micro-batch size) for a cluster"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = ["usage: vlmfeed [--version] SUBCOMMAND [ARGS...]", "", "subcommands:"]
    lines += [f"  {name:{width}}  {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "vlmfeed SUBCOMMAND --help shows a subcommand's options."]
    return "\n".join(lines)


def _load(name: str):
    """The subcommand's ``main``, or None with a message saying why it is not available."""
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise  # the module exists but something it imports does not: show the real error
        print(f"vlmfeed {name}: not available in this installation ({module_name} is missing)", file=sys.stderr)
        return None
    main = getattr(module, "main", None)
    if main is None and hasattr(module, "__path__"):  # a package whose command is its __main__ module
        try:
            main = getattr(importlib.import_module(f"{module_name}.__main__"), "main", None)
        except ModuleNotFoundError as exc:
            if exc.name != f"{module_name}.__main__":
                raise
    if main is None:
        print(f"vlmfeed {name}: {module_name} has no main(argv)", file=sys.stderr)
    return main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import version

        print(f"vlmfeed {version('vlmfeed')}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        import difflib

        near = difflib.get_close_matches(name, SUBCOMMANDS, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        print(f"vlmfeed: unknown subcommand {name!r}; {hint}choose one of: {', '.join(SUBCOMMANDS)} "
              "(vlmfeed --help says what each does)", file=sys.stderr)
        return 2
    run = _load(name)
    if run is None:
        return 2
    try:
        result = run(rest)
    except UserError as exc:
        print(f"vlmfeed {name}: {exc}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
