"""The package's import graph is the design: imports run one way, from the API down to the ground.

Read with ``ast`` from the source (every import statement, also those inside functions), so
a lazy import that reaches back up is caught as surely as a top-level one. Imports under
``if TYPE_CHECKING:`` are left out: they name types for annotations and never run, so a
probe may annotate its argument as ``StepScope`` without depending on the step pipeline.

Sizes are guidance, not a wall: the largest modules and functions are printed with the test
output (``pytest -rP tests/test_architecture.py``), and one past the guidance must be on the
reviewed list below, with the reason it is as big as it is.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "torchtrace"

# Lowest first. A module may import modules of its own layer's package and of lower layers.
LAYERS: list[tuple[str, ...]] = [
    ("torchtrace._version", "torchtrace.semconv", "torchtrace.levels", "torchtrace.errors", "torchtrace.config",
     "torchtrace.current", "torchtrace.files", "torchtrace.patches"),
    ("torchtrace.distributed", "torchtrace.job"),
    ("torchtrace.measure",),
    ("torchtrace.record",),
    ("torchtrace.forensics", "torchtrace.reporting"),
    ("torchtrace.probes", "torchtrace.export"),
    ("torchtrace.step",),
    ("torchtrace.api", "torchtrace.tools", "torchtrace.optimize"),
    ("torchtrace.compat", "torchtrace.integrations"),
    ("torchtrace",),  # the facade: public names only
    ("torchtrace.cli",),  # the command line, a user of the facade
]
GROUND = LAYERS[0]
# Third-party packages a layer must not import: measuring and recording know nothing of telemetry.
FORBIDDEN = {
    "torchtrace.measure": ("opentelemetry", "prometheus_client"),
    "torchtrace.record": ("opentelemetry", "prometheus_client"),
}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, package: Path = PACKAGE) -> set[str]:
    """Every module ``path`` imports, anywhere in the file, as absolute dotted names.

    ``from a import b`` counts as importing ``a.b`` when that is a module, else ``a``.
    """
    name = module_name(path, package)
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = {f"{mod}.{alias.name}" for alias in node.names}
            known = {m for m in subs if _is_module(m, package)}
            out.update(known if known else {mod})
    return out


def _type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but the bodies of ``if TYPE_CHECKING:`` blocks (their ``else`` runs)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if _type_checking(node):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _is_module(dotted: str, package: Path) -> bool:
    rel = Path(*dotted.split(".")[1:]) if "." in dotted else Path()
    base = package / rel
    return dotted.split(".")[0] == package.name and (base.with_suffix(".py").exists() or (base / "__init__.py").exists())


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def owner(module: str) -> tuple[int, str] | None:
    """(layer index, owning unit) of a torchtrace module; the longest matching prefix wins."""
    best = None
    for i, units in enumerate(LAYERS):
        for unit in units:
            if module == unit or module.startswith(unit + "."):
                if best is None or len(unit) > len(best[1]):
                    best = (i, unit)
    return best


def internal_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for imp in imports_of(path):
            if imp in mods and imp != name:
                targets.add(imp)
        graph[name] = targets
    return graph


def test_every_module_has_a_layer():
    missing = [m for m in modules() if owner(m) is None]
    assert missing == [], f"add these modules to LAYERS: {missing}"


def test_imports_run_down_the_layers():
    graph = internal_graph()
    wrong = []
    for src, targets in graph.items():
        s_layer, s_unit = owner(src)
        for dst in targets:
            d_layer, d_unit = owner(dst)
            if d_layer > s_layer or (d_layer == s_layer and d_unit != s_unit and s_unit not in GROUND):
                wrong.append(f"{src} (layer {s_layer}) -> {dst} (layer {d_layer})")
    assert wrong == [], "imports that run up or sideways:\n" + "\n".join(sorted(wrong))


def test_no_import_circles():
    graph = internal_graph()
    # Strongly connected components (Tarjan); a component of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert circles == [], f"import circles: {circles}"


@pytest.mark.parametrize("unit", sorted(FORBIDDEN))
def test_lower_layers_know_nothing_of_telemetry(unit):
    bad = []
    for name, path in modules().items():
        if name == unit or name.startswith(unit + "."):
            for imp in imports_of(path):
                if imp.split(".")[0] in FORBIDDEN[unit]:
                    bad.append(f"{name} imports {imp}")
    assert bad == []


def test_the_checker_sees_a_violation(tmp_path):
    """The checks can fail: function-level imports reaching up, absolute or relative, are found."""
    path = tmp_path / "torchtrace" / "record" / "history.py"
    path.parent.mkdir(parents=True)
    path.write_text("def f():\n    from torchtrace.api import configure\n    from ..export import metrics\n")
    (tmp_path / "torchtrace" / "export").mkdir()
    (tmp_path / "torchtrace" / "export" / "metrics.py").write_text("")
    found = imports_of(path, tmp_path / "torchtrace")
    assert {"torchtrace.api", "torchtrace.export.metrics"} <= found
    assert owner("torchtrace.record.history")[0] < owner("torchtrace.export.metrics")[0]


def test_the_checker_leaves_out_type_only_imports(tmp_path):
    """An import under ``if TYPE_CHECKING:`` never runs: it is no dependency. Its ``else`` runs."""
    path = tmp_path / "torchtrace" / "record" / "history.py"
    path.parent.mkdir(parents=True)
    path.write_text("from typing import TYPE_CHECKING\nimport typing\nif TYPE_CHECKING:\n"
                    "    from torchtrace.api import configure\nelse:\n    import torchtrace.cli\n"
                    "if typing.TYPE_CHECKING:\n    import torchtrace.step\n")
    assert imports_of(path, tmp_path / "torchtrace") == {"typing", "torchtrace.cli"}


# Guidance: one concept per module (about 400 lines), one job per function (about 60). Past it,
# a module or function is split where that reads better, or reviewed and listed here with why
# it is whole. (Squeezing code under a line cap, or moving it where it does not belong to fit,
# is what this list replaces.)
MODULE_LINES = 400
FUNCTION_LINES = 60
REVIEWED = {
    "step/throughput.py": "a step's throughput, start to end: FLOP key, phase marks, FLOP counter, goodput booking",
    "step/scope.py": "the user's step and the pipeline's walk through it, top to bottom",
    "step/runtime.py": "what configure() builds, the runtime's per-step services and shutdown's ordered close",
    "step/phases.py": "the phase clock and every place that marks it (the model's seam, hooks, the optimizer's step)",
    "step/gradients.py": "one step's gradient check: each moment it measures (an update, a clip, another network's "
                         "update after its backward) and the guard's decision there",
    "config/parsers.py": "one small parser per kind of setting, and the table naming each setting's parser",
    "job/watchdog.py": "the hang watchdog: its tick, the adaptive timeout, the finding and what it writes",
    "measure/batch.py": "the batch's samples and tokens from a step's arguments, every shape the rules know",
    "export/server.py": "the telemetry server: its connection limits, the request head's budget, the pacing "
                        "and the typed request handler",
    "export/spans.py": "a step's span: the object the user's code sees inside the step, its ids drawn when first "
                       "read, and the one place a finished record becomes its attributes",
    "api.py": "the public entry points (configure, shutdown, debug_context, debug_operation) with their examples",
    "step/throughput.py: finish_step": "the step's figures in the order they are decided; its first lines end "
                                       "the usual step",
    "step/runtime.py: __init__": "what configure() builds, one line a part, in the order the parts need each other",
    "step/job.py": "the runtime's side of the job: the black box's life, signals, the exception hook, checkpoints "
                   "and how the process ended, each a short function",
    "job/identity.py": "the job's identity: its job id and attempt, whether a writer still runs, and the run id "
                       "the ranks one launcher started agree on without talking (multiprocessing, torchrun, srun)",
    "record/goodput.py": "the goodput ledger, one class: booking a step's interval, its pauses (level off, "
                         "tt.idle()), forensic time, per-operation windows and its state for checkpoints",
}
SHOWN = 8  # the largest modules and functions printed with the test output


def sizes(root: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``(modules, functions)``: each as (lines, name), largest first; nested functions included."""
    modules_, functions = [], []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        rel = path.relative_to(root).as_posix()
        modules_.append((len(source.splitlines()), rel))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{rel}: {node.name}"))
    return sorted(modules_, reverse=True), sorted(functions, reverse=True)


def oversized(root: Path, reviewed: dict[str, str]) -> list[str]:
    """Modules over MODULE_LINES and functions over FUNCTION_LINES that no review listed."""
    modules_, functions = sizes(root)
    return ([f"{name}: {n} lines" for n, name in modules_ if n > MODULE_LINES and name not in reviewed]
            + [f"{name} {n} lines" for n, name in functions if n > FUNCTION_LINES and name not in reviewed])


def test_the_largest_modules_and_functions_are_reviewed():
    modules_, functions = sizes(PACKAGE)
    print(f"largest modules (guidance {MODULE_LINES} lines):")
    for n, name in modules_[:SHOWN]:
        print(f"  {n:5d}  {name}" + (f"  (reviewed: {REVIEWED[name]})" if name in REVIEWED else ""))
    print(f"largest functions (guidance {FUNCTION_LINES} lines):")
    for n, name in functions[:SHOWN]:
        print(f"  {n:5d}  {name}" + (f"  (reviewed: {REVIEWED[name]})" if name in REVIEWED else ""))
    assert oversized(PACKAGE, REVIEWED) == [], "split these, or review them and list them in REVIEWED"


def test_the_size_check_sees_a_long_function_that_no_review_listed(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LINES))
    (tmp_path / "long.py").write_text("def long():\n" + body)
    (tmp_path / "short.py").write_text("def short():\n" + body[: -len(f"    x{FUNCTION_LINES - 1} = 59\n")])
    (tmp_path / "big.py").write_text("x = 1\n" * (MODULE_LINES + 1))
    assert oversized(tmp_path, {}) == ["big.py: 401 lines", "long.py: long 61 lines"]
    assert oversized(tmp_path, {"big.py": "reviewed", "long.py: long": "reviewed"}) == []
