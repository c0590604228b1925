"""A setting the seed APIs cannot honour is refused when it is given, with a message naming
the setting and the values accepted, as ``TrainingMonitor`` refuses its own; never silently
replaced by a default, never a raw error later inside the training loop."""

from __future__ import annotations

import logging

import pytest
import torch

from torchtrace import TrainingMonitor
from torchtrace.compat import (
    AsyncTrainingLogger,
    DiffusionModelDebugger,
    TrainingDebugger,
    detect_model_anomalies,
    validate_model_input,
)


@pytest.mark.parametrize("kwargs, setting", [
    ({"explosion_threshold": 0}, "explosion_threshold=0"),
    ({"vanishing_threshold": 0.0}, "vanishing_threshold=0.0"),
    ({"window": 0}, "window=0"),
])
def test_training_debugger_refuses_the_values_training_monitor_refuses(kwargs, setting):
    """Before, ``TrainingDebugger(explosion_threshold=0)`` became 1000.0 and
    ``vanishing_threshold=0.0`` became 1e-7 (``or``-defaulting); now both raise the error
    ``TrainingMonitor`` raises for the same keywords."""
    with pytest.raises(ValueError, match="is not valid") as monitor:
        TrainingMonitor(**kwargs)
    with pytest.raises(ValueError, match=f"{setting} is not valid; accepted values") as debugger:
        TrainingDebugger(**kwargs)
    assert str(debugger.value) == str(monitor.value)


def test_a_window_of_zero_given_first_is_refused_not_replaced():
    """Before, ``TrainingDebugger(0)`` got the default window 50; now it is refused."""
    with pytest.raises(ValueError, match="window=0 is not valid; accepted values: a positive integer"):
        TrainingDebugger(0)


@pytest.mark.parametrize("make", [lambda: TrainingDebugger(max_events="x"),
                                  lambda: DiffusionModelDebugger(max_events=-1),
                                  lambda: TrainingDebugger(max_events=0)])
def test_max_events_must_be_a_positive_integer(make):
    """Before: ``TypeError: an integer is required`` and ``ValueError: maxlen must be
    non-negative``, neither naming the setting."""
    with pytest.raises(ValueError, match="max_events=.* is not valid; accepted values: a positive integer"):
        make()


@pytest.mark.parametrize("logger", ["x", logging.LoggerAdapter(logging.getLogger("t"), {})])
def test_async_training_logger_refuses_what_is_not_a_logger_at_construction(logger):
    """Before, ``AsyncTrainingLogger(logger="x")`` or a LoggerAdapter was accepted and
    ``update_progress`` raised AttributeError inside the loop; now the constructor refuses it."""
    with pytest.raises(TypeError, match="logger= must be a logging.Logger"):
        AsyncTrainingLogger(logger=logger)


@pytest.mark.parametrize("kwargs, message", [
    ({"expected_dims": 2.0}, "expected_dims=2.0 is not valid"),
    ({"expected_dims": "2"}, "expected_dims='2' is not valid"),
    ({"expected_dims": True}, "expected_dims=True is not valid"),
    ({"min_value": 1.0, "max_value": 0.0}, "min_value=1.0 is above max_value=0.0"),
    ({"min_value": "0"}, "min_value='0' is not valid"),
])
def test_validate_model_input_refuses_a_bad_setting_by_name(kwargs, message):
    """Before: ``TypeError: 'float' object is not iterable`` for 2.0; "2" was compared
    character by character; min_value > max_value refused every input. Now each names the
    setting and the accepted values."""
    with pytest.raises(ValueError, match=message):
        validate_model_input(torch.zeros(4, 3), **kwargs)
    assert validate_model_input(torch.zeros(4, 3), expected_dims=[1, 2])["numel"] == 12


@pytest.mark.parametrize("kwargs, message", [
    ({"value_range": 5}, "value_range=5 is not valid"),
    ({"value_range": (1, 0)}, r"value_range=\(1, 0\) is not valid"),
    ({"value_range": ("a", "b")}, "value_range=.* is not valid"),
    ({"uniform_tolerance": -1}, "uniform_tolerance=-1 is not valid"),
    ({"uniform_tolerance": float("nan")}, "uniform_tolerance=nan is not valid"),
])
def test_detect_model_anomalies_refuses_a_bad_setting_by_name(kwargs, message):
    """Before: ``TypeError: 'int' object is not subscriptable`` for value_range=5, and
    ``uniform_tolerance=-1`` silently never found a collapsed model. Now each is refused by name."""
    model = torch.nn.Linear(3, 1)
    with pytest.raises(ValueError, match=message):
        detect_model_anomalies(model, torch.zeros(4, 3), **kwargs)
