"""The live page served at ``/``: polls the debug API and redraws while training runs."""

from __future__ import annotations

import functools

from torchtrace.reporting.assets import page

POLL_MS = 1000
MAX_EVENTS = 5000
LIVE_STEPS = 500  # the page draws the latest this many steps

_LIVE_JS = """
(function () {
  "use strict";
  var events = [], lastSeq = 0, lastTotal = -1;
  var status = document.getElementById("tt-status");
  function get(url) {
    return fetch(url, {cache: "no-store", credentials: "omit"}).then(function (r) {
      if (!r.ok) throw new Error(url + ": HTTP " + r.status);
      return r.json();
    });
  }
  function tick() {
    Promise.all([get("/debug/summary"), get("/debug/training/summary"), get("/debug/steps?limit=%(steps)d")])
      .then(function (res) {
        var summary = res[0];
        var total = (summary.totals || {}).events || 0;
        if (total < lastTotal) { events = []; lastSeq = 0; }  /* history was cleared */
        lastTotal = total;
        return get("/debug/events?since=" + lastSeq).then(function (ev) {
          events = events.concat(ev.events || []);
          if (events.length > %(max_events)d) events = events.slice(-%(max_events)d);
          lastSeq = ev.last_seq || lastSeq;
          window.ttRender({summary: summary, training: res[1], steps: res[2].steps || [], events: events});
          var hang = summary.hangs || {}, now = new Date().toLocaleTimeString();
          var stuck = hang.timeout_s && hang.stalled_s > hang.timeout_s;
          status.textContent = stuck ? "HUNG: no progress for " + Math.round(hang.stalled_s) + " s in " + hang.phase +
            (hang.last && hang.last.where ? " at " + hang.last.where : "") + " · " + now
            : "live · " + (hang.phase ? hang.phase + " · " : "") + now;
          status.className = stuck ? "badge bad" : "badge ok";
        });
      })
      .catch(function (err) { status.textContent = "disconnected: " + err.message; status.className = "badge bad"; })
      .then(function () { setTimeout(tick, %(poll)d); });
  }
  tick();
})();
"""

_HELP = """
<section class="card wide"><h2>Changing the run</h2>
<p class="muted">Changes need the debug API token. <code>torchtrace demo</code> prints it at start; a training job
logs it once at INFO level on the <code>torchtrace</code> logger, or you choose it with the <code>debug_token</code>
setting (<code>TORCHTRACE_DEBUG_TOKEN</code>). The training thread applies a change at its next step:
<code>curl -X POST -H "Authorization: Bearer $TOKEN" http://127.0.0.1:PORT/debug/level/advanced</code>,
<code>curl -X POST -H "Authorization: Bearer $TOKEN" http://127.0.0.1:PORT/debug/clear</code>.</p></section>
"""


@functools.lru_cache(maxsize=1)
def live_page() -> str:
    """The page's HTML: self-contained, it needs nothing but the debug API it came from."""
    script = _LIVE_JS % {"steps": LIVE_STEPS, "max_events": MAX_EVENTS, "poll": POLL_MS}
    return page("torchtrace live", "connecting…", _HELP, script)
