"""Every seed name is importable where docs/seed-api.md says, and the facade stays small."""

from __future__ import annotations

import torchtrace as tt
import torchtrace.compat as compat

TOP_LEVEL = ["PyTorchDebugger", "create_pytorch_debugger", "debug_training_session", "TrainingDebugger",
             "DebugLevel", "DebugMode", "OptimizationMode", "PyTorchOptimizer", "debug_context"]
SEED_NAMES = TOP_LEVEL + [
    "AsyncTrainingLogger", "TrainingPhase", "DiffusionModelDebugger", "AutogradAnomalyDetector", "GradientDebugger",
    "PyTorchMemoryDebugger", "ModelDebugger", "PyTorchDebugManager", "PyTorchDebugConfig",
    "create_enhanced_training_optimizer", "debug_operation", "optimize_model", "monitor_resources"]


def test_every_seed_name_is_in_compat_and_the_top_level_ones_are_the_same_objects():
    for name in SEED_NAMES:
        assert name in compat.__all__ and getattr(compat, name) is not None, name
    for name in TOP_LEVEL:
        assert getattr(tt, name) is getattr(compat, name), name


def test_the_root_debugger_module_is_gone():
    from pathlib import Path

    assert not (Path(tt.__file__).parent / "debugger.py").exists()
    assert tt.PyTorchDebugger.__module__ == "torchtrace.compat.debugger"
