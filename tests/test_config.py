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
    ({"peak_flops": 0}, "peak_flops", "finite number of FLOP/s >= 1"),
    ({"peak_flops": "fast"}, "peak_flops", "finite number"),
    # Too large for a float: the same ValueError, never an OverflowError from float().
    ({"peak_flops": 10**400}, "peak_flops", "finite number"),
    ({"grad_explosion_threshold": 10**400}, "grad_explosion_threshold", "positive finite number"),
    ({"export_timeout_s": 10**400}, "export_timeout_s", "positive finite number"),
    # A peak below 1 FLOP/s (a subnormal 1e-320 made every MFU infinite) is no device's.
    ({"peak_flops": 1e-320}, "peak_flops", "a finite number of FLOP/s >= 1"),
    ({"peak_flops": 0.5}, "peak_flops", "a finite number of FLOP/s >= 1"),
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
    assert Settings.resolve({}, environ={"TORCHTRACE_PEAK_FLOPS": "1e-320"}).peak_flops is None
    assert Settings.resolve({"peak_flops": 1}, environ={}).peak_flops == 1.0  # the least accepted


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


# ---------------------------------------------------------------- endpoints (issue 22, item 3)
def _clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("env_name", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                                      "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"])
@pytest.mark.parametrize("raw", ["http://[::1", "http://127.0.0.1:notaport", "http://127.0.0.1:99999",
                                 "http://:4318", "http://host name:4318", "https://[1.2.3]:1"])
def test_malformed_endpoint_in_the_environment_is_logged_and_replaced(tmp_path, monkeypatch, caplog, env_name, raw):
    _clean_env(monkeypatch)
    monkeypatch.setenv(env_name, raw)
    with caplog.at_level(logging.WARNING):
        result = tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    try:
        assert result.enabled
        assert result.settings.otlp_endpoint is None and result.settings.otlp_metrics_endpoint is None
        assert env_name in caplog.text
    finally:
        tt.shutdown()
    assert result.report_path.exists()


def test_malformed_endpoint_in_the_environment_does_not_turn_auto_configuration_off(tmp_path, monkeypatch):
    from torchtrace import current
    from torchtrace.api import get_runtime

    _clean_env(monkeypatch)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://[::1")
    monkeypatch.setenv("TORCHTRACE_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHTRACE_PROMETHEUS_PORT", "off")
    tt.shutdown()
    current.set_disabled(False)
    with tt.debug_context("train_step") as step:
        step.record_loss(1.0)
    rt = get_runtime(create=False)
    assert rt is not None and rt.history.totals["steps"] == 1


@pytest.mark.parametrize("setting", ["otlp_endpoint", "otlp_metrics_endpoint"])
@pytest.mark.parametrize("bad", ["http://127.0.0.1:notaport", "http://[::1", "http://127.0.0.1:70000", "http://",
                                 "http://a b:1", "http://127.0.0.1:4318\n", "ftp://127.0.0.1", 4318])
def test_malformed_endpoint_argument_raises_naming_it_and_leaves_no_run_directory(tmp_path, monkeypatch, setting,
                                                                                  bad):
    _clean_env(monkeypatch)
    runs = tmp_path / "runs"
    with pytest.raises(ValueError) as err:
        tt.configure(prometheus_port="off", run_dir=str(runs), register_atexit=False, **{setting: bad})
    assert setting in str(err.value) and "http://" in str(err.value)
    assert not runs.exists()


@pytest.mark.parametrize("good", ["http://127.0.0.1:4318", "https://collector.example:443/otlp", "http://[::1]:4317",
                                  "http://localhost", "HTTP://Collector.Example:4318/"])
def test_well_formed_endpoints_are_kept_with_the_scheme_in_lower_case(good):
    s = Settings.resolve({"otlp_endpoint": good, "otlp_metrics_endpoint": good}, environ={})
    expected = good.replace("HTTP://", "http://")
    assert s.otlp_endpoint == expected and s.otlp_metrics_endpoint == expected


def test_summary_and_report_work_with_every_accepted_endpoint(tmp_path, monkeypatch):
    from torchtrace.api import get_runtime

    _clean_env(monkeypatch)
    result = tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True,
                          otlp_endpoint="http://[::1]:9", export_timeout_s=0.2)
    assert "::1" in get_runtime().summary()["telemetry"]["otlp_endpoint"]
    tt.shutdown()
    assert result.report_path.exists()


# ---------------------------------------------------------------- strict types (issue 22, item 7)
@pytest.mark.parametrize("setting, bad", [
    ("span_queue_size", True), ("span_queue_size", False), ("span_queue_size", 2.5), ("span_queue_size", "many"),
    ("history_size", True), ("max_file_bytes", True), ("param_check_interval", True),
    ("update_ratio_interval", True), ("forensics_max_replays", True), ("leak_window", True),
    ("max_consecutive_bad_steps", True), ("rank_skew_interval", True),
    ("export_timeout_s", True), ("shutdown_timeout_s", False), ("grad_explosion_threshold", True),
    ("metrics_export_interval_s", True), ("prometheus_port", True),
    ("write_files", 1), ("write_files", "maybe"), ("strict", 0), ("debug_api", "sometimes"),
    ("prometheus_host", "not a host"), ("prometheus_host", "127.0.0.1:9464"), ("prometheus_host", "http://x"),
    ("prometheus_host", "-bad-.example"), ("prometheus_host", 127), ("prometheus_host", "a" * 300),
])
def test_wrongly_typed_argument_is_refused_at_configure(tmp_path, setting, bad):
    with pytest.raises(ValueError) as err:
        Settings.resolve({setting: bad}, environ={})
    assert setting in str(err.value) and "accepted values" in str(err.value)


@pytest.mark.parametrize("setting, given, expected", [
    ("span_queue_size", 8, 8), ("span_queue_size", "16", 16), ("write_files", "off", False),
    ("write_files", True, True), ("prometheus_host", "0.0.0.0", "0.0.0.0"), ("prometheus_host", "::1", "::1"),
    ("prometheus_host", "localhost", "localhost"), ("prometheus_host", "node-3.cluster.local", "node-3.cluster.local"),
    ("prometheus_host", "[::1]", "::1"), ("export_timeout_s", 2, 2.0),
])
def test_well_typed_argument_is_kept(setting, given, expected):
    assert getattr(Settings.resolve({setting: given}, environ={}), setting) == expected


@pytest.mark.parametrize("bad", [0, 1, 2, 0.0, "maybe"])
def test_a_switch_names_what_it_accepts_when_it_refuses(bad):
    """An integer is not a switch: the error says what is (it once listed 1 and 0 as accepted
    values when refusing the integers 1 and 0)."""
    with pytest.raises(ValueError) as err:
        Settings.resolve({"throughput": bad}, environ={})
    assert str(err.value) == (f"throughput={bad!r} is not valid; accepted values: True or False, or a string: "
                              "true, false, yes, no, on, off, 1, 0")


def test_numpy_numbers_are_typed_like_python_ones():
    np = pytest.importorskip("numpy")
    assert Settings.resolve({"span_queue_size": np.int64(8)}, environ={}).span_queue_size == 8
    for setting in ("span_queue_size", "export_timeout_s"):
        with pytest.raises(ValueError, match=setting):
            Settings.resolve({setting: np.True_}, environ={})
    # A numpy bool is a switch's value like Python's.
    assert Settings.resolve({"throughput": np.False_}, environ={}).throughput is False
    assert Settings.resolve({"write_files": np.True_}, environ={}).write_files is True


def test_bad_host_in_the_environment_is_logged_and_replaced(caplog):
    with caplog.at_level(logging.WARNING):
        s = Settings.resolve({}, environ={"TORCHTRACE_PROMETHEUS_HOST": "not a host"})
    assert s.prometheus_host == "127.0.0.1" and "TORCHTRACE_PROMETHEUS_HOST" in caplog.text


def test_a_bad_host_argument_is_refused_before_anything_is_created(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    with pytest.raises(ValueError, match="prometheus_host"):
        tt.configure(prometheus_host="not a host", prometheus_port=0, run_dir=str(tmp_path / "r"),
                     register_atexit=False)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("exporter, expected", [
    ("none", None),
    (" None ", None),
    ("otlp", "http://collector:4318"),
    ("console", "http://collector:4318"),
])
def test_otel_traces_exporter_none_turns_the_environment_endpoint_off(exporter, expected):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_TRACES_EXPORTER": exporter}
    assert Settings.resolve({}, env).otlp_endpoint == expected


def test_otel_traces_exporter_none_leaves_an_endpoint_argument_alone():
    env = {"OTEL_TRACES_EXPORTER": "none"}
    assert Settings.resolve({"otlp_endpoint": "http://collector:4318"}, env).otlp_endpoint == "http://collector:4318"


def test_a_misspelt_environment_variable_is_named_with_the_one_meant(caplog):
    """``TORCHTRACE_GAURD=skip`` set no guard at all, silently: now a warning names the variable
    torchtrace reads. Variables of other tools (this project's scripts' own among them) and
    torchtrace's own bookkeeping are not mistaken for misspellings."""
    env = {"TORCHTRACE_GAURD": "skip", "TORCHTRACE_PROMETHEUS_PORTS": "9000", "TORCHTRACE_HANG_TIMEOUT": "60",
           "TORCHTRACE_SKIP_LINT": "1", "TORCHTRACE_TEST_WORKERS": "3", "TORCHTRACE_REQUIRE_SERVERS": "1",
           "TORCHTRACE_TORCH_VERSION": "2.13.0", "TORCHTRACE_SETUP_FORCE": "1", "TORCHTRACE_ARTIFACTS_DIR": "/a",
           "TORCHTRACE_LAUNCHER_RUN": "1 run", "TORCHTRACE_PARENT_SETTINGS": "{}", "TORCHTRACE_LEVEL": "basic"}
    with caplog.at_level(logging.WARNING):
        s = Settings.resolve({}, environ=env)
    assert s.guard == "warn"
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring TORCHTRACE_GAURD: torchtrace reads no such variable; did you mean TORCHTRACE_GUARD?",
        "ignoring TORCHTRACE_HANG_TIMEOUT: torchtrace reads no such variable; did you mean TORCHTRACE_HANG_TIMEOUT_S?",
        "ignoring TORCHTRACE_PROMETHEUS_PORTS: torchtrace reads no such variable; did you mean "
        "TORCHTRACE_PROMETHEUS_PORT?"]


def test_an_unwritable_run_dir_is_one_warning_line_naming_it_and_training_goes_on(caplog):
    """configure(run_dir=<unwritable>) logged "torchtrace internal error in files" with three
    chained tracebacks. It is the user's setting, not torchtrace's failure: one line naming
    it and what it accepts, no traceback; the run goes on without files, as docs/reliability.md
    says of a run directory torchtrace cannot use."""
    with caplog.at_level(logging.WARNING):
        result = tt.configure(prometheus_port="off", run_dir="/dev/null/runs", register_atexit=False)
    try:
        with tt.debug_context("train_step", step=0):
            pass
    finally:
        tt.shutdown()
    assert result.run_dir is None
    (record,) = [r for r in caplog.records if "run_dir" in r.getMessage()]
    message = record.getMessage()
    assert "run_dir='/dev/null/runs' cannot be used" in message and "accepted values: a directory" in message
    assert record.exc_info is None and "\n" not in message
    assert "internal error" not in caplog.text
