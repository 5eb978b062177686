"""``python -m datasvc.tools.bench.results_index [DOCS]``: writes ``DOCS/results/README.md``, the index
of the raw results: one folder per question (named after its page in ``DOCS/benchmarks/``), and for
each the hardware it ran on, its files, and the dates and commits its JSON files are stamped with."""
from __future__ import annotations

import argparse
import json
import os
import re

from datasvc.usage import HelpFormatter

STAMPS = ("date", "commit")


def stamps(path: str) -> dict[str, set]:
    """The ``date`` and ``commit`` values of a JSON file's top level (none for other files)."""
    found: dict[str, set] = {k: set() for k in STAMPS}
    if not path.endswith(".json"):
        return found
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return found
    if isinstance(data, dict):
        for k in STAMPS:
            if isinstance(data.get(k), str) and data[k]:
                found[k].add(data[k][:10] if k == "date" else data[k].split()[0][:7])
    return found


def page_of(benchmarks: str, slug: str) -> str | None:
    """The page of a folder: ``benchmarks/SLUG.md``, or a page of the docs themselves (``gpu-proof``:
    ``docs/gpu_proof.md``); None where there is neither."""
    for page in (os.path.join(benchmarks, slug + ".md"),
                 os.path.join(os.path.dirname(benchmarks), slug.replace("-", "_") + ".md")):
        if os.path.exists(page):
            return page
    return None


def question(benchmarks: str, slug: str) -> str:
    """The page's title, or the folder's name where no page has it."""
    page = page_of(benchmarks, slug)
    if page:
        with open(page) as f:
            first = f.readline()
        if first.startswith("# "):
            return first[2:].strip()
    return slug


def folder_row(results: str, benchmarks: str, slug: str) -> str:
    files, hardware, found = 0, set(), {k: set() for k in STAMPS}
    for d, _, names in os.walk(os.path.join(results, slug)):
        rel = os.path.relpath(d, os.path.join(results, slug))
        if rel != ".":
            hardware.add(rel.split(os.sep)[0])
        for name in names:
            files += 1
            for k, v in stamps(os.path.join(d, name)).items():
                found[k] |= v
    found_page = page_of(benchmarks, slug)
    page = f"[page]({os.path.relpath(found_page, results)})" if found_page else ""
    dates = sorted(found["date"])
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}" if dates else ""
    return (f"| [{question(benchmarks, slug)}]({slug}/) | {page} | {', '.join(sorted(hardware))} | {files} | {when} | "
            f"{', '.join(sorted(found['commit']))} |")


def index(docs: str) -> str:
    results, benchmarks = os.path.join(docs, "results"), os.path.join(docs, "benchmarks")
    slugs = sorted(n for n in os.listdir(results) if os.path.isdir(os.path.join(results, n)))
    rows = [folder_row(results, benchmarks, s) for s in slugs]
    return "\n".join([
        "# Raw results",
        "",
        "One folder per question, named after its page in `docs/benchmarks/`; inside, one folder per",
        "hardware (defined in [the benchmarks index](../benchmarks/README.md#hardware)). Dates and commits are",
        "those the JSON files are stamped with; a page's Command section gives how each file was made.",
        "Written by `python -m datasvc.tools.bench.results_index`; do not edit by hand.",
        "",
        "| question | page | hardware | files | dates | commits |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m datasvc.tools.bench.results_index", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("docs", nargs="?", default="docs", help="the docs folder, holding benchmarks/ and results/")
    args = p.parse_args(argv)
    if not os.path.isdir(os.path.join(args.docs, "results")):
        raise SystemExit(f"{args.docs}/results does not exist: give the docs folder that holds it")
    out = os.path.join(args.docs, "results", "README.md")
    with open(out, "w") as f:
        f.write(index(args.docs))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
