"""The shape of the package's code, as issue 46 measures it: how typed, how private, how big.

    python benchmarks/code_shape.py           # the numbers
    python benchmarks/code_shape.py --list    # and what each number counts

- ``: Any`` annotations: parameters, returns and variables annotated ``Any`` (the AST's count,
  next to a plain text count of ``: Any``);
- ``StepScope``: its slots, and the writes of those attributes on a scope from other modules
  (``scope.x = ...``, ``parent.x = ...``: a scope reached under the names the code gives it);
- private attributes across modules: ``obj._name`` read or written where ``obj`` is not
  ``self``/``cls`` and ``_name`` is defined by another torchtrace module only;
- the lines of the five largest modules.

The scope-writes count goes by names (``scope``, ``parent``, ``step``, ``s``), not by types: it
is a reviewer's heuristic, and ``--list`` shows every line it counted.
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torchtrace")
SCOPE_NAMES = {"scope", "parent", "s", "step_scope", "outer", "sc"}


def modules() -> dict[str, ast.Module]:
    """Every module of the package, parsed, by its path relative to the package's parent."""
    out = {}
    for folder, _, names in os.walk(ROOT):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    out[os.path.relpath(path, os.path.dirname(ROOT))] = ast.parse(f.read(), path)
    return out


def any_annotations(trees: dict[str, ast.Module]) -> list[tuple[str, int]]:
    """Where a parameter, return or variable is annotated exactly ``Any``."""
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            notes: list[ast.expr | None] = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                notes += [arg.annotation for arg in a.posonlyargs + a.args + a.kwonlyargs]
                notes += [a.vararg.annotation if a.vararg else None, a.kwarg.annotation if a.kwarg else None]
                notes.append(node.returns)
            elif isinstance(node, ast.AnnAssign):
                notes.append(node.annotation)
            for note in notes:
                if isinstance(note, ast.Name) and note.id == "Any" or \
                        isinstance(note, ast.Constant) and note.value == "Any":
                    found.append((path, note.lineno))
    return found


def text_any_count() -> int:
    count = 0
    for folder, _, names in os.walk(ROOT):
        for name in names:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    count += len(re.findall(r": Any\b", f.read()))
    return count


def scope_slots() -> tuple[str, ...]:
    sys.path.insert(0, os.path.dirname(ROOT))
    from torchtrace.step.scope import StepScope
    return tuple(s for s in StepScope.__slots__ if s != "__weakref__")


def scope_writes(trees: dict[str, ast.Module], slots: tuple[str, ...]) -> list[tuple[str, int, str]]:
    """Stores of a scope's attribute from a module other than the one defining StepScope."""
    found = []
    owner = os.path.join("torchtrace", "step", "scope.py")
    for path, tree in trees.items():
        if path == owner:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr in slots:
                base = node.value
                name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
                if name in SCOPE_NAMES:
                    found.append((path, node.lineno, f"{name}.{node.attr}"))
    return found


def private_crossings(trees: dict[str, ast.Module]) -> tuple[list[tuple[str, int, str]], list[tuple[str, int, str]]]:
    """``(reads, writes)`` of ``obj._name`` where ``_name`` belongs to another torchtrace module."""
    defined: dict[str, set[str]] = collections.defaultdict(set)
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name.startswith("_"):
                defined[node.name].add(path)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                defined[node.attr].add(path)
            elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List)):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id == "__slots__":
                        for elt in node.value.elts:
                            if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                                defined[elt.value].add(path)
    reads, writes = [], []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__") or attr not in defined:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if path in defined[attr]:
                continue
            (writes if isinstance(node.ctx, ast.Store) else reads).append((path, node.lineno, attr))
    return reads, writes


def largest(n: int = 5) -> list[tuple[int, str]]:
    sizes = []
    for folder, _, names in os.walk(ROOT):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    sizes.append((sum(1 for _ in f), os.path.relpath(path, os.path.dirname(ROOT))))
    return sorted(sizes, reverse=True)[:n]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="show what each number counts")
    args = p.parse_args(argv)
    trees = modules()
    anys = any_annotations(trees)
    slots = scope_slots()
    writes = scope_writes(trees, slots)
    reads, private_writes = private_crossings(trees)
    print(f"': Any' annotations: {len(anys)} (AST), {text_any_count()} (text)")
    print(f"StepScope: {len(slots)} slots, {len(writes)} writes from "
          f"{len({w[0] for w in writes})} other modules")
    print(f"private attributes of other modules: {len(reads)} reads, {len(private_writes)} writes")
    print("largest modules: " + ", ".join(f"{path} {lines}" for lines, path in largest()))
    if args.list:
        for title, rows in (("scope writes", writes), ("private reads", reads), ("private writes", private_writes)):
            print(f"\n{title}:")
            for path, line, what in sorted(rows):
                print(f"  {path}:{line} {what}")
        counts = collections.Counter(path for path, _ in anys)
        print("\n': Any' by module:")
        for path, n in counts.most_common():
            print(f"  {path} {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
