"""The package's import graph: no cycles between modules or stages; planning never needs torch.

Every ``import``/``from … import`` of a dpfy module anywhere in a file counts (module level,
inside functions, and under ``TYPE_CHECKING``), so a cycle cannot hide behind a local import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import dpfy

SOURCE = Path(dpfy.__file__).parent
STAGES = ("plan", "data", "train", "audit", "access", "tune", "federated", "report", "jobs", "cli")
#: Each layer may import only the layers before it (the order the README states).
LAYERS = (
    ("_lazy",),  # the lazy-export helper every package __init__ uses
    ("dpfy", "_validate", "_safe_io"),  # the root package imports only _lazy (lazy names)
    ("plan",),
    ("data",),
    ("train",),
    ("audit", "access"),
    ("report",),
    ("jobs",),
    ("tune", "federated"),
    ("cli",),
    ("__main__",),
)


def modules() -> dict[str, Path]:
    """Every dpfy module by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in SOURCE.rglob("*.py"):
        parts = list(path.relative_to(SOURCE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module → the dpfy modules it imports (``from pkg import mod`` resolves to ``pkg.mod``)."""
    known = modules()

    def resolve(name: str) -> str:
        while name not in known:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dpfy"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    edges.add(full if full in known else resolve(node.module))
            elif isinstance(node, ast.Import):
                edges |= {resolve(a.name) for a in node.names if a.name.startswith("dpfy")}
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def stage_of(module: str) -> str:
    """``dpfy.train.grads.fast`` → ``train``; top-level modules are their own stage."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else module


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_the_stages_form_a_layered_graph():
    stages: dict[str, set[str]] = {}
    for module, edges in import_graph().items():
        stages.setdefault(stage_of(module), set()).update(
            stage_of(e) for e in edges if stage_of(e) != stage_of(module)
        )
    assert cycles(stages) == []
    for later, stage in enumerate(LAYERS):
        allowed = {s for layer in LAYERS[:later] for s in layer}
        for name in stage:
            assert stages[name] <= allowed, (name, stages[name] - allowed)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_stage_is_a_package():
    for stage in STAGES:
        assert (SOURCE / stage / "__init__.py").is_file(), stage


def test_planning_a_run_imports_no_torch():
    code = (
        "import sys, pkgutil, importlib, dpfy.plan\n"
        "for m in pkgutil.walk_packages(dpfy.plan.__path__, 'dpfy.plan.'):\n"
        "    importlib.import_module(m.name)\n"
        "from dpfy.plan.variants import PlanRequest, make_plan\n"
        "make_plan(PlanRequest(records=1000, batch_size=50, delta=1e-5, max_grad_norm=1.0,\n"
        "    epochs=2, target_epsilon=3.0))\n"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_the_command_line_starts_without_torch():
    """``dpfy --help``, ``plan`` and ``account`` answer in a second: torch loads only for a job."""
    code = "import sys, dpfy.cli.app\nprint('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


#: Modules named in a string and imported late, against the layer order, on purpose: the
#: session's ``report()`` reaches the report stage, which reads the session.
LATE_BOUND_SEAMS = {("dpfy.train.report_seam", "dpfy.report.session_report")}


def _import_strings(tree: ast.AST) -> list[ast.expr]:
    """Where a module name may hide: lazy-export dict values, assigned constants, call args."""
    found: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            found += node.values
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            found.append(node.value)
        elif isinstance(node, ast.Call):
            found += node.args
    return found


def named_modules() -> dict[str, set[str]]:
    """Module → the dpfy modules it names in strings it may import (lazy exports, seams)."""
    known = modules()
    named: dict[str, set[str]] = {}
    for name, path in known.items():
        for node in _import_strings(ast.parse(path.read_text())):
            value = node.value if isinstance(node, ast.Constant) else None
            if isinstance(value, str) and value in known and value not in {name, "dpfy"}:
                named.setdefault(name, set()).add(value)
    return named


def test_modules_named_in_strings_keep_the_layer_order_but_for_declared_seams():
    rank = {stage: i for i, layer in enumerate(LAYERS) for stage in layer}
    upward = {
        (module, target)
        for module, targets in named_modules().items()
        for target in targets
        if stage_of(module) != "dpfy"  # the root package's lazy names reach every stage
        and rank[stage_of(target)] > rank[stage_of(module)]
    }
    assert upward == LATE_BOUND_SEAMS


def test_the_declared_seam_loads_the_report_writer():
    from dpfy.train.report_seam import REPORT_MODULE, report_writer

    assert (("dpfy.train.report_seam", REPORT_MODULE)) in LATE_BOUND_SEAMS
    assert report_writer().__module__ == REPORT_MODULE
