"""The CSS and JavaScript shared by the live page and the HTML report.

Everything is inline: no CDN, no fonts, no images, so a page opened on an air-gapped
machine (or from a file) draws the same. ``ttRender(data)`` draws a whole dashboard from
one object ``{summary, training, steps, events, settings, live}``; after each render it
writes what it drew into ``#tt-state`` (a hidden JSON element) and into ``data-points`` on
each chart, so a headless browser test can check that the charts hold the run's steps.
"""

from __future__ import annotations

import json
from typing import Any

CSS = """
:root { --fg:#1d2330; --muted:#6b7280; --bg:#f6f7f9; --card:#fff; --line:#2563eb; --bad:#dc2626; --grid:#e5e7eb; }
* { box-sizing: border-box; }
body { margin:0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; color:var(--fg); background:var(--bg); }
header { padding:12px 20px; background:#111827; color:#f9fafb; display:flex; gap:24px; align-items:baseline; flex-wrap:wrap; }
header h1 { font-size:18px; margin:0; }
header .meta { color:#cbd5e1; font-size:13px; }
.badge { display:inline-block; padding:1px 8px; border-radius:10px; background:#374151; color:#fff; font-size:12px; }
.badge.ok { background:#15803d; } .badge.bad { background:var(--bad); }
main { padding:16px 20px; display:grid; grid-template-columns: repeat(2, minmax(0, 1fr)); gap:14px; }
.card { background:var(--card); border-radius:8px; padding:10px 14px; box-shadow:0 1px 2px rgba(0,0,0,.08); min-width:0; }
.card h2 { font-size:14px; margin:0 0 6px 0; display:flex; justify-content:space-between; }
.card h2 span { color:var(--muted); font-weight:normal; font-size:12px; }
.wide { grid-column: 1 / -1; }
.scroll { max-height:300px; overflow:auto; }
canvas { width:100%; height:190px; display:block; }
table { border-collapse:collapse; width:100%; font-size:13px; }
th, td { text-align:left; padding:3px 8px 3px 0; border-bottom:1px solid var(--grid); vertical-align:top; }
td.num { font-variant-numeric: tabular-nums; }
.kind { color:var(--bad); font-weight:600; }
details pre { background:#f3f4f6; padding:6px; overflow:auto; max-height:260px; font-size:12px; margin:4px 0; }
.stats { display:grid; grid-template-columns: repeat(auto-fill, minmax(150px, 1fr)); gap:6px 14px; }
.stat b { display:block; font-size:18px; } .stat span { color:var(--muted); font-size:12px; }
.muted { color:var(--muted); }
code { background:#f3f4f6; padding:0 4px; border-radius:3px; }
"""

JS = r"""
(function () {
  "use strict";
  function num(v) {
    if (typeof v === "number") return v;
    if (v === "NaN") return NaN;
    if (v === "Infinity") return Infinity;
    if (v === "-Infinity") return -Infinity;
    return null;
  }
  function fmt(v, digits) {
    if (v === null || v === undefined) return "–";
    if (typeof v === "string") return v;
    if (!isFinite(v)) return String(v);
    var a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(digits || 3);
    return v.toFixed(digits === undefined ? 4 : digits).replace(/\.?0+$/, "") || "0";
  }
  function bytes(v) {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    var u = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
    while (Math.abs(v) >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return v.toFixed(1) + " " + u[i];
  }
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  }
  var SERIES = [
    {id: "loss", title: "Loss", get: function (s) { return num(s.loss); }, unit: ""},
    {id: "grad_norm", title: "Gradient norm", get: function (s) { return num(s.grad_norm); }, unit: "", log: true},
    {id: "step_time", title: "Step time", get: function (s) { var d = num(s.duration_s); return d === null ? null : d * 1000; }, unit: " ms"},
    {id: "memory", title: "Memory", get: function (s) {
      var m = s.memory || {};
      var v = num(m.cuda_allocated_bytes); if (v === null) v = num(m.rss_bytes);
      return v === null ? null : v / 1048576; }, unit: " MiB"}
  ];

  function drawChart(canvas, steps, spec) {
    var dpr = window.devicePixelRatio || 1;
    var w = canvas.clientWidth || 560, h = canvas.clientHeight || 190;
    canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
    var ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    var L = 62, R = 10, T = 10, B = 24, pw = w - L - R, ph = h - T - B;
    var pts = [], bad = [], anomalies = [];
    for (var i = 0; i < steps.length; i++) {
      var v = spec.get(steps[i]);
      if (v === null) continue;
      if (!isFinite(v) || (spec.log && v <= 0 && v !== 0)) bad.push(i);
      else pts.push([i, v]);
      if (steps[i].anomalies && steps[i].anomalies.length) anomalies.push(i);
    }
    ctx.font = "11px system-ui, sans-serif"; ctx.fillStyle = "#6b7280"; ctx.strokeStyle = "#e5e7eb";
    ctx.strokeRect(L, T, pw, ph);
    if (!pts.length && !bad.length) {
      ctx.fillText("no data", L + pw / 2 - 20, T + ph / 2);
      canvas.setAttribute("data-points", "0"); canvas.setAttribute("data-nonfinite", "0");
      return {points: 0, nonfinite: 0};
    }
    var useLog = false;
    if (spec.log && pts.length) {
      var pos = pts.every(function (p) { return p[1] > 0; });
      var lo0 = Infinity, hi0 = -Infinity;
      pts.forEach(function (p) { lo0 = Math.min(lo0, p[1]); hi0 = Math.max(hi0, p[1]); });
      useLog = pos && hi0 / lo0 > 100;
    }
    var tf = useLog ? function (v) { return Math.log10(v); } : function (v) { return v; };
    var lo = Infinity, hi = -Infinity;
    pts.forEach(function (p) { var t = tf(p[1]); lo = Math.min(lo, t); hi = Math.max(hi, t); });
    if (!isFinite(lo)) { lo = 0; hi = 1; }
    if (hi === lo) { hi = hi + (Math.abs(hi) || 1) * 0.05; lo = lo - (Math.abs(lo) || 1) * 0.05; }
    var pad = (hi - lo) * 0.06, lo0v = lo; hi += pad; lo -= pad;
    if (!useLog && lo0v >= 0 && lo < 0) lo = 0;
    var n = Math.max(steps.length - 1, 1);
    function X(i) { return L + (i / n) * pw; }
    function Y(v) { return T + ph - ((tf(v) - lo) / (hi - lo)) * ph; }
    // grid and labels
    for (var g = 0; g <= 4; g++) {
      var gy = T + (g / 4) * ph, gv = hi - (g / 4) * (hi - lo);
      ctx.beginPath(); ctx.moveTo(L, gy); ctx.lineTo(L + pw, gy); ctx.stroke();
      ctx.fillText(fmt(useLog ? Math.pow(10, gv) : gv, 3) + spec.unit, 2, gy + 4);
    }
    if (steps.length) {
      ctx.fillText("step " + steps[0].step, L, h - 6);
      var last = "step " + steps[steps.length - 1].step;
      ctx.fillText(last, L + pw - ctx.measureText(last).width, h - 6);
    }
    // anomaly markers: a red band at each anomalous step
    ctx.fillStyle = "rgba(220,38,38,0.18)";
    anomalies.forEach(function (i) { ctx.fillRect(X(i) - 1.5, T, 3, ph); });
    // the line, broken at missing / non-finite values
    ctx.strokeStyle = "#2563eb"; ctx.lineWidth = 1.6; ctx.beginPath();
    var prev = -2;
    pts.forEach(function (p) {
      if (p[0] !== prev + 1) ctx.moveTo(X(p[0]), Y(p[1])); else ctx.lineTo(X(p[0]), Y(p[1]));
      prev = p[0];
    });
    ctx.stroke();
    if (pts.length < 60) {
      ctx.fillStyle = "#2563eb";
      pts.forEach(function (p) { ctx.beginPath(); ctx.arc(X(p[0]), Y(p[1]), 2, 0, 7); ctx.fill(); });
    }
    // non-finite values: a red triangle at the top edge
    ctx.fillStyle = "#dc2626";
    bad.forEach(function (i) {
      var x = X(i); ctx.beginPath(); ctx.moveTo(x - 5, T + 1); ctx.lineTo(x + 5, T + 1); ctx.lineTo(x, T + 9); ctx.fill();
    });
    canvas.setAttribute("data-points", String(pts.length));
    canvas.setAttribute("data-nonfinite", String(bad.length));
    return {points: pts.length, nonfinite: bad.length};
  }

  function anomalyRows(events) {
    var rows = [], forensic = {};
    events.forEach(function (e) {
      var t = String(e.type || "");
      if (t.indexOf("forensic") >= 0) {
        var d = e.data || {}, key = d.step !== undefined ? String(d.step) : "?";
        (forensic[key] = forensic[key] || []).push(e);
      }
    });
    events.forEach(function (e) {
      if (e.type !== "anomaly") return;
      var d = e.data || {};
      rows.push({step: d.step, operation: d.operation, kind: d.kind, detail: d.detail || e.message,
                 data: d.data || {}, forensics: forensic[String(d.step)] || []});
    });
    return rows;
  }

  function renderAnomalies(box, rows) {
    box.textContent = "";
    if (!rows.length) { box.appendChild(el("p", {"class": "muted"}, "No anomalies.")); return; }
    var t = el("table"), hr = el("tr");
    ["step", "operation", "kind", "detail"].forEach(function (c) { hr.appendChild(el("th", null, c)); });
    t.appendChild(hr);
    rows.slice(-200).forEach(function (r) {
      var tr = el("tr", {"class": "anomaly", "data-kind": r.kind || "", "data-step": String(r.step)});
      tr.appendChild(el("td", {"class": "num"}, String(r.step)));
      tr.appendChild(el("td", null, r.operation || ""));
      tr.appendChild(el("td", {"class": "kind"}, r.kind || ""));
      var td = el("td", null, r.detail || "");
      var extra = Object.keys(r.data).length ? [{title: "data", body: r.data}] : [];
      r.forensics.forEach(function (f) { extra.push({title: "forensic report: " + (f.message || f.type), body: f.data}); });
      extra.forEach(function (x) {
        var det = el("details", {"class": "forensics"}); det.appendChild(el("summary", null, x.title));
        det.appendChild(el("pre", null, JSON.stringify(x.body, null, 2))); td.appendChild(det);
      });
      tr.appendChild(td); t.appendChild(tr);
    });
    box.appendChild(t);
    if (rows.length > 200) box.appendChild(el("p", {"class": "muted"}, "showing the last 200 of " + rows.length));
  }

  function stat(label, value) {
    var d = el("div", {"class": "stat"}); d.appendChild(el("b", null, value)); d.appendChild(el("span", null, label));
    return d;
  }

  function renderSummary(box, data) {
    var s = data.summary || {}, tr = data.training || {}, tot = s.totals || {};
    box.textContent = "";
    var g = el("div", {"class": "stats"});
    g.appendChild(stat("steps", String(tot.steps !== undefined ? tot.steps : (data.steps || []).length)));
    g.appendChild(stat("anomalous steps", String(tot.anomaly_steps || 0)));
    g.appendChild(stat("anomaly rate", tr.anomaly_rate !== undefined ? (100 * tr.anomaly_rate).toFixed(2) + " %" : "–"));
    g.appendChild(stat("non-finite steps", String(tot.nonfinite_steps || 0)));
    g.appendChild(stat("skipped updates", String(tot.skipped_steps || 0)));
    var last = s.last_step || {};
    g.appendChild(stat("last loss", fmt(num(last.loss))));
    g.appendChild(stat("last grad norm", fmt(num(last.grad_norm))));
    var tel = s.telemetry || {};
    var dropped = 0; for (var k in (tel.spans_dropped || {})) dropped += tel.spans_dropped[k];
    g.appendChild(stat("spans exported / dropped", (tel.spans_exported || 0) + " / " + dropped));
    var errs = 0; for (var k2 in (tel.internal_errors || {})) errs += tel.internal_errors[k2];
    g.appendChild(stat("internal errors", String(errs)));
    box.appendChild(g);
    var kinds = s.anomalies_by_kind || {};
    if (Object.keys(kinds).length) {
      var p = el("p", null, "By kind: ");
      Object.keys(kinds).sort().forEach(function (k) { p.appendChild(el("span", {"class": "badge bad"}, k + " " + kinds[k])); p.appendChild(document.createTextNode(" ")); });
      box.appendChild(p);
    }
  }

  function renderSettings(box, settings) {
    if (!box) return;
    box.textContent = "";
    if (!settings) { box.appendChild(el("p", {"class": "muted"}, "No settings recorded.")); return; }
    var t = el("table");
    Object.keys(settings).sort().forEach(function (k) {
      var tr = el("tr"); tr.appendChild(el("th", null, k));
      var v = settings[k]; tr.appendChild(el("td", null, typeof v === "object" && v !== null ? JSON.stringify(v) : String(v)));
      t.appendChild(tr);
    });
    box.appendChild(t);
  }

  window.ttRender = function (data) {
    var s = data.summary || {};
    var steps = data.steps || [];
    document.getElementById("tt-run").textContent = s.run_id || "?";
    document.getElementById("tt-service").textContent = (s.service_name || "") + " · rank " + (s.rank || 0) + "/" + (s.world_size || 1);
    var lv = document.getElementById("tt-level"); lv.textContent = "level " + (s.level || "?");
    var counts = {};
    SERIES.forEach(function (spec) {
      var c = document.getElementById("chart-" + spec.id);
      var r = drawChart(c, steps, spec);
      counts[spec.id] = r.points;
      var lastv = null;
      for (var i = steps.length - 1; i >= 0 && lastv === null; i--) lastv = spec.get(steps[i]);
      document.getElementById("last-" + spec.id).textContent = "last " + fmt(lastv) + spec.unit;
    });
    var rows = anomalyRows(data.events || []);
    renderAnomalies(document.getElementById("tt-anomalies"), rows);
    renderSummary(document.getElementById("tt-summary"), data);
    renderSettings(document.getElementById("tt-settings"), data.settings);
    var state = document.getElementById("tt-state");
    var prev = {}; try { prev = JSON.parse(state.textContent || "{}"); } catch (e) { prev = {}; }
    state.textContent = JSON.stringify({
      renders: (prev.renders || 0) + 1, steps: steps.length, charts: counts, level: s.level,
      anomalies: rows.map(function (r) { return {step: r.step, kind: r.kind}; })
    });
    document.body.setAttribute("data-tt-ready", "1");
  };
})();
"""

BODY = """
<header>
  <h1>torchtrace · <span id="tt-run">…</span></h1>
  <span class="meta" id="tt-service"></span>
  <span class="badge" id="tt-level"></span>
  <span class="badge" id="tt-status">{status}</span>
</header>
<main>
  <section class="card wide"><h2>Summary</h2><div id="tt-summary"></div></section>
  <section class="card wide"><h2>Anomalies <span>red bands in the charts; red triangles: non-finite values</span></h2><div id="tt-anomalies" class="scroll"></div></section>
  <section class="card"><h2>Loss <span id="last-loss"></span></h2><canvas id="chart-loss"></canvas></section>
  <section class="card"><h2>Gradient norm <span id="last-grad_norm"></span></h2><canvas id="chart-grad_norm"></canvas></section>
  <section class="card"><h2>Step time <span id="last-step_time"></span></h2><canvas id="chart-step_time"></canvas></section>
  <section class="card"><h2>Memory <span id="last-memory"></span></h2><canvas id="chart-memory"></canvas></section>
  {extra}
</main>
<pre id="tt-state" hidden>{{}}</pre>
"""


def page(title: str, status: str, extra_sections: str, script: str) -> str:
    """A complete HTML document with the shared style, body and script, plus ``script``."""
    from html import escape

    body = BODY.format(status=escape(status), extra=extra_sections)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width\"><title>{escape(title)}</title>"
            f"<style>{CSS}</style></head><body>{body}<script>{JS}</script><script>{script}</script></body></html>\n")


def embed_json(value: Any) -> str:
    """JSON safe inside a ``<script type="application/json">`` element (no ``</script>`` break-out)."""
    from torchtrace.files import to_strict

    text = json.dumps(to_strict(value), allow_nan=False, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
