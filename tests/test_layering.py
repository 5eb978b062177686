"""The house rules, as a ratchet: import directions, no cycles, small product files and functions,
model facts in the model's package only, narrow actors.

The checker reads source with ``ast`` (nothing is imported), so it runs in milliseconds and on a
fixture tree as well as on the repository.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("datasvc", "pipelines", "trainer")

# The modules of datasvc.service that hold a feeder's decisions (its queue, its scaling) without Ray.
RAY_FREE_SERVICE = ("datasvc.service.ready", "datasvc.service.scaling")
# (importer prefix, imported prefix, why it must never happen). The most specific importer wins:
# the tools and the benches are users of the product, so they may reach what the product may not.
FORBIDDEN = [
    ("datasvc", "datasvc.tools", "the product never imports a user tool"),
    ("datasvc", "trainer", "the data service does not know the trainer"),
    ("datasvc", "megatron", "the data service does not depend on Megatron"),
    ("datasvc", "pipelines", "the data service finds model pipelines by name, through datasvc.registry"),
    ("datasvc.tools", "trainer", "tools measure the data service; the trainer is not theirs to import"),
    ("pipelines", "trainer", "a pipeline is built from the data service's parts, not the trainer's"),
    ("pipelines", "datasvc.tools", "a pipeline does not depend on a user tool"),
    ("trainer", "datasvc.tools", "the trainer uses the product, not the tools"),
    ("trainer", "trainer.bench", "the trainer does not depend on its benchmarks"),
    ("trainer", "pipelines", "the trainer reaches a model's facts by pipeline name (datasvc.registry.pipeline_part)"),
    ("datasvc.stream", "ray", "a rank's stream runs in one process too (inspect, the benches, the soak)"),
    *((module, "ray", "the feeder's logic stays out of the actor, tested without Ray") for module in RAY_FREE_SERVICE),
]
ALLOWED = [  # importer prefix -> imported prefixes it may use despite FORBIDDEN above
    ("datasvc.registry", ("pipelines",)),
    ("datasvc.tools", ("datasvc.tools",)),
    ("trainer.bench", ("trainer.bench", "datasvc.tools", "pipelines")),
]
# Model facts the trainer imports from one family, each a leak to move behind the registry (none left:
# the trainer reaches every model fact through datasvc.registry); a new one fails the test.
KNOWN_LEAKS: set[str] = set()
# Files that are not the product: their size is not ratcheted.
NOT_PRODUCT = ("datasvc/tools/", "trainer/bench/")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
# Each family's special token ids and vocabulary size, and the package that alone may spell them:
# Qwen3-VL's (151643-151656, 151936) and Qwen3.5-VL's (248044-248076, 248320).
MODEL_NUMBERS = {
    "pipelines/qwen3vl/": re.compile(r"\b1516(4[3-9]|5[0-6])\b|\b151936\b"),
    "pipelines/qwen35vl/": re.compile(r"\b2480([4-6]\d|7[0-6])\b|\b248320\b"),
}
MAX_ACTOR_METHODS = 5
# The data flows one way through datasvc's stages: shards are read, their media decoded, samples
# tokenized and packed, a rank's stream produced, the Ray service carries it. A module imports its own
# floor and those below, never a later stage; every product module of datasvc has a floor.
DATA_FLOORS = {
    "datasvc.usage": 0, "datasvc.flags": 0, "datasvc.rejects": 0, "datasvc.batch": 0, "datasvc.stats": 0,  # the types stages share
    "datasvc.host": 0,  # where a process runs
    "datasvc.members": 0, "datasvc.remainder": 0, "datasvc.samples": 0,
    "datasvc.read": 1,
    "datasvc.media": 2,
    "datasvc.config": 3, "datasvc.registry": 3, "datasvc.wire": 3,  # the data config, the model, a work item
    "datasvc.pack": 4,
    "datasvc.stream": 5,
    "datasvc.service": 6,
    "datasvc.training": 7,  # the training geometry: every stage's settings for one trainer
}


@dataclass
class House:
    modules: dict[str, Path] = field(default_factory=dict)
    imports: dict[str, set[str]] = field(default_factory=dict)  # every import, lazy ones too


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path, tree: ast.Module) -> set[str]:
    every = set()
    is_package = path.name == "__init__.py"

    def names(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = _resolve(module, is_package, node)
        # ``from pkg import sub`` imports pkg.sub when sub is a module; keep both spellings.
        return [base] + [f"{base}.{a.name}" for a in node.names]

    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            every.update(names(node))
    return every


def read_house(root: Path, packages=PACKAGES) -> House:
    house = House()
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            name = _module_name(root, path)
            tree = ast.parse(path.read_text(), filename=str(path))
            house.modules[name] = path
            house.imports[name] = _imports(name, path, tree)
    return house


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def wrong_directions(house: House) -> list[str]:
    found = []
    for importer, imported in house.imports.items():
        for target in sorted(imported):
            for src, dst, why in FORBIDDEN:
                if not (_within(importer, src) and _within(target, dst)):
                    continue
                if any(_within(importer, a) and any(_within(target, t) for t in ok) for a, ok in ALLOWED):
                    continue
                found.append(f"{importer} imports {target}: {why}")
    return sorted(set(found))


def data_floor(module: str) -> int | None:
    found = [(len(prefix), floor) for prefix, floor in DATA_FLOORS.items() if _within(module, prefix)]
    return max(found)[1] if found else None


def uphill_stages(house: House) -> list[str]:
    """Imports from a stage of datasvc to a later one, and datasvc modules placed on no floor."""
    found = []
    for importer, imported in house.imports.items():
        if not _within(importer, "datasvc") or _within(importer, "datasvc.tools") or importer == "datasvc":
            continue
        floor = data_floor(importer)
        if floor is None:
            found.append(f"{importer}: on no floor of DATA_FLOORS")
            continue
        for target in sorted(t for t in imported if t in house.modules and data_floor(t) is not None):
            if data_floor(target) > floor:
                found.append(f"{importer} (floor {floor}) imports {target} (floor {data_floor(target)})")
    return found


def cycles(house: House) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan). Lazy imports count: an
    import moved into a function to dodge a loop leaves the two modules depending on each other."""
    # Importing a module runs its packages' __init__ first; that edge to an ancestor is how Python
    # loads packages, not a dependency of the code, so it is left out.
    graph = {m: {t for t in ts if t in house.modules and not _within(m, t)} for m, ts in house.imports.items()}
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_product(root: Path, path: Path) -> bool:
    rel = path.relative_to(root).as_posix()
    return not rel.startswith(NOT_PRODUCT)


def oversized(root: Path, house: House) -> list[str]:
    found = []
    for name, path in house.modules.items():
        if not _is_product(root, path):
            continue
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            found.append(f"{path.relative_to(root)}: {lines} lines (max {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {n} lines "
                                 f"(max {MAX_FUNCTION_LINES})")
    return found


def model_numbers_outside_model(root: Path, house: House) -> list[str]:
    found = []
    for path in house.modules.values():
        rel = path.relative_to(root).as_posix()
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if any(number.search(line) and not rel.startswith(package) for package, number in MODEL_NUMBERS.items()):
                found.append(f"{rel}:{i}: {line.strip()}")
    return found


def _remote_classes(tree: ast.Module) -> list[ast.ClassDef]:
    remote_names = set()
    for node in ast.walk(tree):  # ray.remote(Cls) or ray.remote(...)(Cls)
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Name):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "remote") or (
                    isinstance(f, ast.Call) and isinstance(f.func, ast.Attribute) and f.func.attr == "remote"):
                remote_names.add(node.args[0].id)
    out = []
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        decorated = any("remote" in ast.unparse(d) for d in node.decorator_list)
        if decorated or node.name in remote_names:
            out.append(node)
    return out


def wide_actors(root: Path, house: House) -> list[str]:
    found = []
    for path in house.modules.values():
        if not _is_product(root, path):
            continue
        for cls in _remote_classes(ast.parse(path.read_text())):
            public = [n.name for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
            if len(public) > MAX_ACTOR_METHODS:
                found.append(f"{path.relative_to(root)} {cls.name}: {len(public)} public methods {public}")
    return found


# ------------------------------------------------------------------------------------------------
# The repository
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def house() -> House:
    return read_house(ROOT)


def test_imports_point_one_way(house):
    found = wrong_directions(house)
    leaks = {f.split(" imports ")[0] for f in found if " imports pipelines." in f} & KNOWN_LEAKS
    assert [f for f in found if f.split(" imports ")[0] not in KNOWN_LEAKS or " imports pipelines." not in f] == []
    assert leaks == KNOWN_LEAKS, f"fixed, so drop from KNOWN_LEAKS: {sorted(KNOWN_LEAKS - leaks)}"


def test_data_stages_import_only_earlier_stages(house):
    assert uphill_stages(house) == []
    assert {m.split(".")[1] for m in house.modules if m.count(".") >= 2 and _within(m, "datasvc")} >= {
        "read", "media", "pack", "stream", "service"}, "the stages are packages"


def test_no_import_cycles(house):
    assert cycles(house) == []


def test_product_files_and_functions_are_small(house):
    assert oversized(ROOT, house) == []


def test_model_numbers_live_in_the_model_package(house):
    assert model_numbers_outside_model(ROOT, house) == []


def test_actors_have_few_public_methods(house):
    assert wide_actors(ROOT, house) == []
    assert any(_remote_classes(ast.parse(p.read_text())) for p in house.modules.values()), \
        "no Ray actor class found: the actor check would pass vacuously"


# ------------------------------------------------------------------------------------------------
# The checker itself, on a small tree that breaks each rule once
# ------------------------------------------------------------------------------------------------
def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def broken_tree(tmp_path) -> Path:
    for pkg in ("datasvc", "datasvc/tools", "pipelines", "pipelines/qwen3vl", "pipelines/qwen35vl", "trainer"):
        _write(tmp_path, f"{pkg}/__init__.py", "")
    _write(tmp_path, "datasvc/read/shards.py", "from trainer.run import main\n")  # wrong direction
    _write(tmp_path, "datasvc/a.py", "from datasvc import b\n")  # a <-> b
    _write(tmp_path, "datasvc/b.py", "import datasvc.a\n")
    _write(tmp_path, "datasvc/lazy.py", "def f():\n    from datasvc import tools\n")  # lazy, still wrong
    _write(tmp_path, "datasvc/tools/inspect.py", "from datasvc.read import shards\nfrom datasvc.tools import x\n")
    _write(tmp_path, "datasvc/tools/x.py", "")
    _write(tmp_path, "datasvc/media/decode.py", "from datasvc.stream.process import WorkItem\n")  # a later stage
    _write(tmp_path, "datasvc/stream/process.py", "from datasvc.media import decode\n")
    _write(tmp_path, "datasvc/stray.py", "")  # on no floor
    _write(tmp_path, "datasvc/service/ready.py", "import ray\n")  # Ray where the logic is kept free of it
    _write(tmp_path, "pipelines/qwen3vl/data.py", "PAD = 151643\nfrom datasvc.read import shards\n")
    _write(tmp_path, "trainer/cpu.py", "from pipelines.qwen35vl.data import TOKENS\n")  # a model fact, leaked
    _write(tmp_path, "pipelines/qwen35vl/data.py", "PAD = 248044\n")
    _write(tmp_path, "pipelines/qwen3vl/arch.py", "VOCAB = 248320\n")  # another family's number
    _write(tmp_path, "trainer/run.py", "import datasvc.a\nIMAGE_PAD = 151655\n"
           "def long():\n" + "    x = 1\n" * 90)
    return tmp_path


def test_checker_flags_a_wrong_direction(broken_tree):
    found = wrong_directions(read_house(broken_tree))
    assert any(f.startswith("datasvc.read.shards imports trainer.run") for f in found), found
    assert any(f.startswith("datasvc.lazy imports datasvc.tools") for f in found), found
    assert any(f.startswith("trainer.cpu imports pipelines.qwen35vl.data") for f in found), found
    assert any(f.startswith("datasvc.service.ready imports ray") for f in found), found
    # The allowed directions stay quiet: tools -> product, pipeline -> product, trainer -> product.
    assert not any(f.startswith(("datasvc.tools.", "pipelines.", "trainer.run")) for f in found), found


def test_checker_flags_an_uphill_stage(broken_tree):
    found = uphill_stages(read_house(broken_tree))
    assert "datasvc.media.decode (floor 2) imports datasvc.stream.process (floor 5)" in found, found
    assert "datasvc.stray: on no floor of DATA_FLOORS" in found, found
    assert not any(f.startswith("datasvc.stream.process ") for f in found), found  # downhill is fine


def test_checker_flags_a_cycle(broken_tree):
    assert cycles(read_house(broken_tree)) == [["datasvc.a", "datasvc.b"],
                                               ["datasvc.media.decode", "datasvc.stream.process"]]


def test_checker_flags_size_and_model_numbers(broken_tree):
    house = read_house(broken_tree)
    assert [f.split(":")[0] for f in oversized(broken_tree, house)] == ["trainer/run.py"]
    assert sorted(model_numbers_outside_model(broken_tree, house)) == [
        "pipelines/qwen3vl/arch.py:1: VOCAB = 248320", "trainer/run.py:2: IMAGE_PAD = 151655"]
