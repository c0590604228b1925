"""Files under attack and on a full disk: no symlink followed, a private run directory, one
writer per file name, whole lines and exact loss counts when the disk fills up."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import torchtrace as tt
from torchtrace import files
from torchtrace.api import get_runtime

REPO = Path(__file__).resolve().parents[2]


def _clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("TORCHTRACE_", "OTEL_")):
            monkeypatch.delenv(name, raising=False)


def _configure(run_dir: Path, **extra):
    settings = dict(prometheus_port="off", run_dir=str(run_dir), run_id="job", register_atexit=False)
    settings.update(extra)
    return tt.configure(**settings)


def _steps(n: int, name: str = "train_step") -> None:
    for i in range(n):
        with tt.debug_context(name) as step:
            step.record_loss(float(i))


# ---------------------------------------------------------------- symlinks
def test_a_symlink_at_spans_jsonl_is_refused_not_written_through(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    run = tmp_path / "runs" / "job"
    run.mkdir(parents=True, mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run / "spans.jsonl").symlink_to(victim)
    _configure(tmp_path / "runs")
    rt = get_runtime()
    _steps(5)
    tt.shutdown()
    assert victim.read_text() == "precious\n"
    assert (run / "spans.jsonl").is_symlink()
    books = rt.processors[0].accounting()
    assert books["emitted"] == 5 and books["exported"] == 0 and books["dropped"] == {"export_failed": 5}


def test_a_symlink_at_report_json_is_replaced_not_followed(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    run = tmp_path / "runs" / "job"
    run.mkdir(parents=True, mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run / "report.json").symlink_to(victim)
    result = _configure(tmp_path / "runs")
    _steps(2)
    tt.shutdown()
    assert victim.read_text() == "precious\n"
    assert not result.report_path.is_symlink() and json.loads(result.report_path.read_text())["totals"]["steps"] == 2


def test_atomic_writes_never_open_a_planted_temp_name(tmp_path, monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    monkeypatch.setattr(secrets, "token_hex", lambda n: "fixed")
    (tmp_path / ".report.json.fixed.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        files.write_json_atomic(tmp_path / "report.json", {"a": 1})
    assert victim.read_text() == "precious\n" and not (tmp_path / "report.json").exists()


@pytest.mark.parametrize("flags", [{}, {"append": True}, {"exclusive": True}])
def test_open_private_refuses_a_symlink(tmp_path, flags):
    victim = tmp_path / "victim.txt"
    victim.write_text("x")
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(OSError) as err:
        files.open_private(tmp_path / "link", **flags)
    assert err.value.errno in (errno.ELOOP, errno.EEXIST)


# ---------------------------------------------------------------- the run directory
def test_an_existing_run_directory_with_loose_permissions_is_tightened_with_a_warning(tmp_path, monkeypatch,
                                                                                      caplog):
    _clean_env(monkeypatch)
    run = tmp_path / "runs" / "job"
    run.mkdir(parents=True)
    os.chmod(run, 0o777)
    with caplog.at_level(logging.WARNING):
        result = _configure(tmp_path / "runs", strict=True)
    tt.shutdown()
    assert result.run_dir == run
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert "0o777" in caplog.text and str(run) in caplog.text


def test_a_run_directory_that_is_a_symlink_is_refused(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o777)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "job").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(PermissionError, match="symlink"):
        _configure(tmp_path / "runs", strict=True)
    result = _configure(tmp_path / "runs", strict=False)
    _steps(2)
    rt = get_runtime()
    tt.shutdown()
    assert result.run_dir is None and rt.errors.by_component.get("files") == 1
    assert list(elsewhere.iterdir()) == []


def test_a_run_directory_of_another_user_is_refused(tmp_path):
    from tests.conftest import servers_required

    if os.geteuid() != 0:  # CI runs as root
        if servers_required():
            pytest.fail("needs root to chown (TORCHTRACE_REQUIRE_SERVERS=1)")
        pytest.skip("needs root to chown")
    run = tmp_path / "job"
    run.mkdir()
    os.chmod(run, 0o777)
    os.chown(run, 65534, 65534)
    with pytest.raises(PermissionError, match="uid 65534"):
        files.ensure_private_dir(run)
    assert stat.S_IMODE(run.stat().st_mode) == 0o777


def test_a_shared_or_working_directory_is_never_tightened(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    files.ensure_private_dir(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    cwd = tmp_path / "cwd"
    cwd.mkdir(mode=0o755)
    os.chmod(cwd, 0o755)
    monkeypatch.chdir(cwd)
    files.ensure_private_dir(Path("."))
    assert stat.S_IMODE(cwd.stat().st_mode) == 0o755


# ---------------------------------------------------------------- two processes, one run id
_WRITER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from torchtrace import files
    run, tag = Path(sys.argv[1]), sys.argv[2]
    files.ensure_private_dir(run)
    report = files.claim_file(run / "report.json")
    spans = files.claim_file(run / "spans.jsonl")
    out = files.JsonLinesFile(spans, 1 << 20)
    print(json.dumps({"report": report.name, "spans": spans.name}), flush=True)
    for i in range(200):
        out.write_many([{"tag": tag, "i": i}])
    sys.stdin.readline()  # both processes hold their claims at the same time
    files.write_json_atomic(report, {"tag": tag})
    out.close()
""")


def test_two_processes_with_the_same_run_id_get_their_own_file_names(tmp_path):
    run = tmp_path / "runs" / "job"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(run), tag], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for tag in ("first", "second")]
    try:
        names = [json.loads(p.stdout.readline()) for p in procs]
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
        errs = [p.communicate(timeout=60)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), errs
    # Whichever claimed first keeps the plain names; the other writes under its own pid.
    plain = {"report": "report.json", "spans": "spans.jsonl"}
    assert plain in names
    later = 1 - names.index(plain)
    pid = procs[later].pid
    assert names[later] == {"report": f"report.pid{pid}.json", "spans": f"spans.pid{pid}.jsonl"}
    assert "another process" in errs[later] and "report.json" in errs[later]
    for tag, name in zip(("first", "second"), names):
        assert json.loads((run / name["report"]).read_text()) == {"tag": tag}
        lines = files.read_json_lines(run / name["spans"])
        assert lines == [{"tag": tag, "i": i} for i in range(200)]


def test_a_claim_is_released_by_either_name(tmp_path):
    first = files.claim_file(tmp_path / "report.json")
    assert files.claim_file(tmp_path / "report.json") == first  # a second claim in one process
    files.release_file(first)
    script = "import sys; from torchtrace import files; print(files.claim_file(sys.argv[1]).name)"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    other = subprocess.run([sys.executable, "-c", script, str(tmp_path / "report.json")], env=env,
                           capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    assert other == "report.json"  # released: another process gets the plain name


def test_a_claim_is_freed_when_its_process_ends(tmp_path):
    """A job restarted with the same run id (torchrun's restarts) writes the plain names again."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    code = "import sys; from torchtrace import files; print(files.claim_file(sys.argv[1]).name)"
    names = [subprocess.run([sys.executable, "-c", code, str(tmp_path / "report.json")], env=env,
                            capture_output=True, text=True, check=True, timeout=60).stdout.strip() for _ in range(2)]
    assert names == ["report.json", "report.json"]


def test_two_configured_processes_with_the_same_run_id_keep_both_reports(tmp_path):
    code = textwrap.dedent("""
        import sys, torchtrace as tt
        tt.configure(prometheus_port="off", run_dir=sys.argv[1], run_id="job", register_atexit=False)
        print("ready", flush=True)
        sys.stdin.readline()
        for i in range(int(sys.argv[2])):
            with tt.debug_context("train_step"):
                pass
        tt.shutdown()
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTRACE_", "OTEL_"))}
    env["PYTHONPATH"] = str(REPO)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(n)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env) for n in (3, 5)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.communicate("\n", timeout=60)
    steps = sorted(json.loads(p.read_text())["totals"]["steps"] for p in (tmp_path / "job").glob("report*.json"))
    assert steps == [3, 5]


# ---------------------------------------------------------------- a full disk
@contextlib.contextmanager
def _small_disk(path: Path, size: int = 256 * 1024):
    """A real 256 KB tmpfs at ``path`` where mounting is allowed (root); else skip, or fail
    when TORCHTRACE_REQUIRE_SERVERS=1."""
    from tests.conftest import servers_required

    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          text=True, check=False) if os.geteuid() == 0 else None
    if done is None or done.returncode != 0:
        message = f"mounting a tmpfs is not permitted here ({done.stderr.strip() if done else 'not root'})"
        if servers_required():
            pytest.fail(message)
        pytest.skip(message + "; the simulated ENOSPC test covers the logic")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(path: Path, leave: int) -> Path:
    """Write a filler file until about ``leave`` bytes are free."""
    filler = path / "filler"
    free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
    with open(filler, "wb") as fh:
        try:
            fh.write(b"\0" * max(0, free - leave))
        except OSError:
            pass
    return filler


def _check_whole_lines(path: Path) -> int:
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), f"torn last line: {data[-80:]!r}"
    lines = data.splitlines()
    for line in lines:
        json.loads(line)
    return len(lines)


def test_a_full_disk_tears_no_line_counts_exactly_what_was_lost_and_recovers(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    with _small_disk(tmp_path / "disk") as disk:
        result = _configure(disk / "runs", strict=False)
        rt = get_runtime()
        proc = rt.processors[0]
        filler = _fill(disk, leave=12 * 1024)
        for _ in range(12):  # about 1 KB per step span: the disk fills up during these
            _steps(5)
            tt.flush()
        full = proc.accounting()
        in_file = _check_whole_lines(result.spans_path)
        assert full["dropped"].get("export_failed", 0) > 0, full
        assert full["exported"] == in_file
        assert full["emitted"] == full["exported"] + full["dropped"]["export_failed"] + full["queued"] + full[
            "in_flight"]
        filler.unlink()  # space returns
        _steps(10, "after")
        tt.flush()
        tt.shutdown()
        print(f"\nfull disk: {full}\nspace back: {proc.accounting()}")
        after = proc.accounting()
        in_file = _check_whole_lines(result.spans_path)
        names = [doc["name"] for doc in files.read_json_lines(result.spans_path)]
        report = json.loads(result.report_path.read_text())
    assert names.count("after") == 10
    assert after["exported"] == in_file == full["exported"] + 10
    assert after["dropped"] == full["dropped"]
    assert report["telemetry"]["spans_dropped"]["export_failed"] == full["dropped"]["export_failed"]


def test_a_simulated_full_disk_keeps_whole_lines(tmp_path, monkeypatch):
    """The same logic where no tmpfs can be mounted: ``os.write`` accepts only a byte budget,
    then cuts a write short, then fails with ENOSPC, as a filling file system does."""
    budget = {"left": 1000}
    real_write = os.write

    def write(fd, data):
        if budget["left"] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = min(len(data), budget["left"])
        budget["left"] -= n
        return real_write(fd, bytes(data[:n]))

    out = files.JsonLinesFile(tmp_path / "spans.jsonl", 1 << 20)
    lines = [(json.dumps({"i": i, "pad": "x" * 80}) + "\n").encode() for i in range(30)]
    monkeypatch.setattr(os, "write", write)
    written = out.write_lines(lines)
    assert written == 1000 // len(lines[0]) and out.lost == 30 - written
    assert out.write_lines(lines[:3]) == 0 and out.lost == 33 - written
    budget["left"] = 10 ** 6
    assert out.write_lines(lines[:3]) == 3
    out.close()
    monkeypatch.setattr(os, "write", real_write)
    assert _check_whole_lines(tmp_path / "spans.jsonl") == written + 3


def test_a_released_claim_leaves_no_lock_file_and_the_name_can_be_claimed_again(tmp_path):
    first = files.claim_file(tmp_path / "report.json")
    assert first.name == "report.json" and (tmp_path / ".report.json.lock").exists()
    files.release_file(first)
    assert list(tmp_path.iterdir()) == []
    again = files.claim_file(tmp_path / "report.json")
    assert again.name == "report.json"
    files.release_file(again)
