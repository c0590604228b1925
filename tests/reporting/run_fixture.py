"""A small finished run directory: 20 steps of TinyNet, a NaN loss injected at step 7."""

from __future__ import annotations

import torchtrace as tt

from ..export.debug_helpers import Trainer, runtime

NAN_STEP = 7
STEPS = 20


def make_run(tmp_path, model) -> tuple[object, list[dict]]:
    """Run, shut down, and return (run directory, the history's step summaries before shutdown)."""
    result = tt.configure(service_name="report-test", prometheus_port="off", run_dir=str(tmp_path / "runs"),
                          register_atexit=False, strict=True)
    trainer = Trainer(model, nan_at=(NAN_STEP,))
    trainer.run(STEPS)
    steps = runtime().history.steps()
    tt.shutdown()
    return result.run_dir, steps
