"""Settings: precedence, validation at configure time, environment fallbacks."""

from __future__ import annotations

import logging

import pytest

import torchtrace as tt
from torchtrace.config import Settings


@pytest.mark.parametrize("kwargs, setting, accepted", [
    ({"level": "verbose"}, "level", "off, basic, advanced, extreme"),
    ({"prometheus_port": 70000}, "prometheus_port", "0-65535"),
    ({"prometheus_port": "abc"}, "prometheus_port", "'off'"),
    ({"otlp_protocol": "thrift"}, "otlp_protocol", "grpc, http/protobuf"),
    ({"grad_explosion_threshold": -1}, "grad_explosion_threshold", "positive finite number"),
    ({"grad_vanishing_threshold": float("nan")}, "grad_vanishing_threshold", "positive finite number"),
    ({"guard": "ignore"}, "guard", "warn, skip, raise"),
    ({"otlp_endpoint": "localhost:4317"}, "otlp_endpoint", "http://"),
    ({"run_id": "../etc"}, "run_id", "letters, digits"),
    ({"peak_flops": 0}, "peak_flops", "positive finite number"),
    ({"peak_flops": "fast"}, "peak_flops", "positive finite number"),
])
def test_bad_argument_raises_naming_setting_and_accepted_values(kwargs, setting, accepted):
    with pytest.raises(ValueError) as err:
        tt.configure(**kwargs)
    assert setting in str(err.value) and accepted in str(err.value)


def test_unknown_setting_is_a_type_error():
    with pytest.raises(TypeError, match="unknown torchtrace setting"):
        tt.configure(levle="basic")


def test_precedence_argument_over_environment_over_default():
    env = {"TORCHTRACE_LEVEL": "advanced", "TORCHTRACE_PROMETHEUS_PORT": "9999", "OTEL_SERVICE_NAME": "svc",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}
    s = Settings.resolve({"level": "extreme"}, environ=env)
    assert s.level.value == "extreme"  # argument wins
    assert s.prometheus_port == 9999 and s.service_name == "svc" and s.otlp_protocol == "grpc"
    assert s.otlp_endpoint == "http://127.0.0.1:4317"
    d = Settings.resolve({}, environ={})
    assert d.level.value == "basic" and d.prometheus_port == 9464 and d.prometheus_host == "127.0.0.1"
    assert str(d.run_dir) == "torchtrace-runs" and d.guard == "warn"


def test_traces_specific_environment_beats_generic():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:2",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    s = Settings.resolve({}, environ=env)
    assert s.otlp_endpoint == "http://b:2" and s.otlp_protocol == "http/protobuf"


def test_bad_environment_value_is_logged_and_replaced_by_default(caplog):
    with caplog.at_level(logging.WARNING):
        s = Settings.resolve({}, environ={"TORCHTRACE_LEVEL": "loud", "TORCHTRACE_PROMETHEUS_PORT": "x"})
    assert s.level.value == "basic" and s.prometheus_port == 9464
    assert "TORCHTRACE_LEVEL" in caplog.text and "TORCHTRACE_PROMETHEUS_PORT" in caplog.text


def test_peak_flops_from_argument_environment_or_none():
    assert Settings.resolve({}, environ={}).peak_flops is None  # the table of known accelerators
    assert Settings.resolve({}, environ={"TORCHTRACE_PEAK_FLOPS": "989e12"}).peak_flops == 989e12
    assert Settings.resolve({"peak_flops": 3e14}, environ={"TORCHTRACE_PEAK_FLOPS": "989e12"}).peak_flops == 3e14
    assert Settings.resolve({}, environ={"TORCHTRACE_PEAK_FLOPS": "-1"}).peak_flops is None  # logged, ignored


def test_port_off_and_run_id_from_torchrun():
    s = Settings.resolve({}, environ={"TORCHTRACE_PROMETHEUS_PORT": "off", "TORCHELASTIC_RUN_ID": "job42"})
    assert s.prometheus_port is None and s.run_id == "job42"


def test_disabled_by_otel_sdk_disabled():
    assert Settings.resolve({}, environ={"OTEL_SDK_DISABLED": "true"}).disabled


def test_configure_is_repeatable_and_idempotent(tmp_path):
    for _ in range(3):
        r = tt.configure(prometheus_port=0, run_dir=str(tmp_path), register_atexit=False)
        assert r.enabled and r.prometheus_port
    tt.shutdown()
    tt.shutdown()


def test_failed_configure_keeps_previous_setup(tmp_path):
    r = tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False)
    with pytest.raises(ValueError):
        tt.configure(level="nope")
    from torchtrace.api import get_runtime

    assert get_runtime(create=False).settings.run_id == r.run_id
