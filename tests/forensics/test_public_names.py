import torchtrace as tt

NEW = ["TrainingMonitor", "TrainingDebugger", "validate_model_input", "detect_model_anomalies", "analyze_pipeline",
       "monitor_loop_step", "anomaly_detection", "replay_step"]


def test_new_public_names_are_exported():
    for name in NEW:
        assert name in tt.__all__ and getattr(tt, name) is not None
    assert issubclass(tt.TrainingDebugger, tt.TrainingMonitor)  # the seeds' monitor: steps are torchtrace steps
