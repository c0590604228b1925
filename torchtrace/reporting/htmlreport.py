"""``torchtrace report RUN_DIR --html out.html``: one self-contained HTML file for a run (its
header says how the run stands: finished, running, or how it ended)."""

from __future__ import annotations

from html import escape
from pathlib import Path

from torchtrace.reporting.assets import embed_json, page
from torchtrace.reporting.jobview import attempt_status, job_of, job_timeline_html
from torchtrace.reporting.runfiles import chart_steps, load_run
from torchtrace.reporting.summary import training_summary_from_steps

_SCRIPT = """
(function () {
  var data = JSON.parse(document.getElementById("tt-data").textContent);
  window.ttRender(data);
})();
"""


def html_report(run_dir: str | Path, rank: int | None = None) -> str:
    """The report as an HTML string: the live page's charts, the anomalies, one entry per
    forensic replay, the summary and the configuration (folded), with the data embedded as JSON.

    Raises:
        FileNotFoundError: ``run_dir`` is not a torchtrace run directory.
    """
    run = load_run(run_dir, rank)
    charted = chart_steps(run.steps)
    data = {
        "summary": run.summary,
        "training": training_summary_from_steps(run.steps),
        "steps": charted,
        "events": run.events,
        "settings": run.settings,
        "problems": run.problems,
        "notes": run.notes,
    }
    notes = ""
    if run.problems:
        notes = "<p class=\"kind\">" + "; ".join(escape(p) for p in run.problems) + "</p>"
    n_settings = len(run.settings or {})
    job, attempt = job_of(run.run_dir)
    extra = (job_timeline_html(job)
             + f"<section class=\"card wide\">{notes}<details class=\"config\" id=\"tt-config\">"
             f"<summary>Configuration: <span id=\"tt-settings-count\">{n_settings}</span> settings "
             f"<span class=\"muted\">({escape(str(run.run_dir))})</span></summary>"
             f"<div id=\"tt-settings\"></div></details></section>"
             f"<script type=\"application/json\" id=\"tt-data\">{embed_json(data)}</script>")
    status = f"{attempt_status(job, attempt, run.finished)} · {run.total_steps} steps"
    if len(charted) < run.total_steps:
        status += f" ({len(charted)} charted)"
    return page(f"torchtrace report {run.summary.get('run_id', '')}", status, extra, _SCRIPT)


def write_html_report(run_dir: str | Path, out: str | Path, rank: int | None = None) -> Path:
    """Write :func:`html_report` to ``out`` (mode 0600 through an atomic rename)."""
    import os
    import tempfile

    target = Path(out)
    text = html_report(run_dir, rank)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=str(target.parent))
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return target
