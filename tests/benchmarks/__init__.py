"""Tests of the scripts in benchmarks/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(script: str) -> ModuleType:
    """``benchmarks/<script>.py`` as a module (the scripts are not a package); the folder is on
    ``sys.path`` while it loads, so a script that imports its siblings (``overhead``) finds them."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(f"{script}_bench", BENCHMARKS / f"{script}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module
