"""The house has floors (docs/architecture.md): every module of course_lib imports only from its own
floor or below, the import graph has no cycle, a function-local import only keeps a heavy library off the
import path (and says so), and no file is longer than one job needs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "course_lib"

# From the bottom up; a module's floor is that of the longest prefix listed (docs/architecture.md's picture).
FLOORS = [
    (
        "infrastructure",
        [
            "course_lib",
            "course_lib.errors",
            "course_lib.validate",
            "course_lib.device",
            "course_lib.measure",
            "course_lib.models",
            "course_lib.model_config",
            "course_lib.cache",
            "course_lib.isolate",
            "course_lib.allocator_events",
            "course_lib.caching_allocator",
            "course_lib.layers",
            "course_lib.course",
        ],
    ),
    (
        "lesson topics",
        [
            "course_lib.accumulation",
            "course_lib.checkpointing",
            "course_lib.paging",
            "course_lib.sharding",
            "course_lib.toolbox",
        ],
    ),
    # the planner's stages, each on a floor of its own (docs/architecture.md): a stage imports only those below
    ("planner: config", ["course_lib.planner.config"]),
    ("planner: states", ["course_lib.planner.states"]),
    ("planner: trace", ["course_lib.planner.trace"]),
    ("planner: phases", ["course_lib.planner.phases"]),
    ("planner: allocator", ["course_lib.planner.allocator"]),
    ("planner: parallel", ["course_lib.planner.parallel"]),
    ("planner: report", ["course_lib.planner.report"]),
    ("planner: predict", ["course_lib.planner.predict"]),
    ("planner: search", ["course_lib.planner.search"]),
    ("planner: entry", ["course_lib.planner.entry", "course_lib.planner"]),
    ("capstone", ["course_lib.qlora"]),
    ("on top", ["course_lib.checks", "course_lib.grading", "course_lib.plots", "course_lib.widgets", "course_lib.cli"]),
]
# Libraries that take long to import or load native code: a function-local import may keep them off the path.
HEAVY = (
    "transformers",
    "peft",
    "bitsandbytes",
    "matplotlib",
    "accelerate",
    "huggingface_hub",
    "IPython",
    "ipykernel",
    "tqdm",
    "torch.distributed.fsdp",
    "torch.distributed.optim",
)
# Entry points kept light on purpose (`import course_lib`, `course-lib --help`, the %%gpu_only magic) and what
# they all import (validate): they may also import torch or course_lib's own heavy packages inside a function.
LIGHT_ENTRY_POINTS = {"course_lib", "course_lib.cli", "course_lib.course", "course_lib.validate"}
MAX_LINES = 500  # as ruff formats a file (120 columns)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]):
    """(imported course_lib module or other module, the import node, inside a function?) for every import."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    local = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(fn)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
        else:
            continue
        for target in targets:
            if target.startswith("course_lib"):
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
            yield target, node, id(node) in local


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {target for target, _, _ in _imports(name, path, modules) if target in modules and target != name}
        for name, path in modules.items()
    }


def _floor(name: str) -> int:
    best, floor = -1, None
    for index, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, floor = len(prefix), index
    assert floor is not None, f"{name} is on no floor: add it to FLOORS and to docs/architecture.md's picture"
    return floor


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), and modules importing themselves."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle_and_passes_a_tree():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_course_lib_has_no_import_cycle():
    assert _cycles(_graph()) == []


def test_every_module_imports_only_from_its_floor_or_below():
    upward = [
        f"{name} (floor {FLOORS[_floor(name)][0]}) imports {target} (floor {FLOORS[_floor(target)][0]})"
        for name, targets in _graph().items()
        for target in targets
        if _floor(target) > _floor(name)
    ]
    assert upward == []


def test_a_function_local_import_only_keeps_a_heavy_library_off_the_import_path_and_says_so():
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        lines = path.read_text().split("\n")
        for target, node, local in _imports(name, path, modules):
            if not local or target in modules and target.startswith(name + "."):
                continue
            heavy = any(target == h or target.startswith(h + ".") for h in HEAVY)
            light_entry = name in LIGHT_ENTRY_POINTS and (target == "torch" or target.startswith("course_lib"))
            said = "#" in lines[node.lineno - 1] or lines[node.lineno - 2].strip().startswith("#")
            if not (heavy or light_entry) or not said:
                wrong.append(
                    f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {target} in a function"
                    + ("" if heavy or light_entry else " (not a heavy library: import it at the top)")
                    + ("" if said else " without a comment saying why")
                )
    assert wrong == []


def test_the_cli_and_the_grader_start_without_torch():
    """`course-lib --help`, `course-lib grade` and its children import neither torch nor transformers (a
    grading run of one notebook took 5 s longer when validate imported torch at its top)."""
    code = (
        "import sys, course_lib.cli, course_lib.grading, course_lib.validate\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def _private_imports(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """Each name starting with `_` that this module imports from another course_lib module, or reads as an
    attribute of one it imported (`module._name`)."""
    found, aliases, seen = [], {}, set()
    for target, node, _ in _imports(name, path, modules):
        if not target.startswith("course_lib") or id(node) in seen:
            continue
        seen.add(id(node))  # an ImportFrom's first target is the module it imports from
        for alias in node.names:
            if isinstance(node, ast.Import):
                aliases[alias.asname or alias.name.split(".")[0]] = alias.name
            elif f"{target}.{alias.name}" in modules:
                aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
            elif _private(alias.name) and target != name:
                found.append(f"{name}:{node.lineno} imports {target}.{alias.name}")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name):
            module = aliases.get(node.value.id)
            if module is not None and module != name:
                found.append(f"{name}:{node.lineno} reads {module}.{node.attr}")
    return found


def test_no_module_imports_a_private_name_of_another():
    """A name starting with `_` is its module's own: another module that needs it needs a public name."""
    modules = _modules()
    assert [line for name, path in modules.items() for line in _private_imports(name, path, modules)] == []


def test_the_private_name_finder_finds_both_kinds(tmp_path):
    (tmp_path / "a.py").write_text("def _hidden():\n    pass\n")
    (tmp_path / "b.py").write_text("from course_lib.a import _hidden\nfrom course_lib import a\na._hidden()\n")
    modules = {
        "course_lib": tmp_path / "__init__.py",
        "course_lib.a": tmp_path / "a.py",
        "course_lib.b": tmp_path / "b.py",
    }
    assert _private_imports("course_lib.b", tmp_path / "b.py", modules) == [
        "course_lib.b:1 imports course_lib.a._hidden",
        "course_lib.b:3 reads course_lib.a._hidden",
    ]


def test_a_planner_stage_above_another_is_refused():
    """The stages' floors are in pipeline order: the trace below the allocator, the report below predict."""
    order = [_floor(f"course_lib.planner.{stage}.x") for stage in ("config", "states", "trace", "allocator")]
    assert order == sorted(order) and len(set(order)) == len(order)
    assert _floor("course_lib.planner.search.fit") > _floor("course_lib.planner.predict")
    assert _floor("course_lib.planner") == _floor("course_lib.planner.entry")


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_file_is_longer_than_one_job_needs(path):
    assert len(path.read_text().split("\n")) <= MAX_LINES, f"{path.name}: split it along its jobs"
