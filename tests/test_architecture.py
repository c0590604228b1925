"""The package's import graph is the design: imports run one way, from the API down to the ground.

Read with ``ast`` from the source (every import statement, also those inside functions), so
a lazy import that reaches back up is caught as surely as a top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "torchtrace"

# Lowest first. A module may import modules of its own layer's package and of lower layers.
LAYERS: list[tuple[str, ...]] = [
    ("torchtrace._version", "torchtrace.semconv", "torchtrace.levels", "torchtrace.errors", "torchtrace.config",
     "torchtrace.current", "torchtrace.files"),
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
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
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


MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def oversized(root: Path) -> list[str]:
    """Modules over MAX_MODULE_LINES lines and functions (nested ones included) over MAX_FUNCTION_LINES."""
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"{path.relative_to(root)}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(root)}: {node.name} {length} lines")
    return found


def test_modules_and_functions_stay_small():
    """One concept per module (under 400 lines), one job per function (under 60)."""
    assert oversized(PACKAGE) == []


def test_the_size_check_sees_a_long_function(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text("def long():\n" + body)
    (tmp_path / "short.py").write_text("def short():\n" + body[: -len(f"    x{MAX_FUNCTION_LINES - 1} = 59\n")])
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert oversized(tmp_path) == ["big.py: 401 lines", "long.py: long 61 lines"]
