"""The CSS and JavaScript shared by the live page and the HTML report.

Everything is inline: no CDN, no fonts, no images, so a page opened on an air-gapped
machine (or from a file) draws the same. ``ttRender(data)`` draws a whole dashboard from
one object ``{summary, training, steps, events, settings, live}``; after each render it
writes what it drew into ``#tt-state`` (a hidden JSON element) and into ``data-*`` attributes
on each chart (see :mod:`torchtrace.reporting.charts`), so a headless browser test can check
that the charts hold the run's steps, their axes and their markers.
"""

from __future__ import annotations

import json

from torchtrace.reporting.charts import CHARTS_JS
from torchtrace.reporting.forensic_text import SENTENCE_JS

CSS = """
:root { --fg:#1d2330; --muted:#6b7280; --bg:#f6f7f9; --card:#fff; --line:#2563eb; --bad:#dc2626; --grid:#e5e7eb; }
* { box-sizing: border-box; }
body { margin:0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; color:var(--fg); background:var(--bg); }
header { padding:12px 20px; background:#111827; color:#f9fafb; display:flex; gap:24px; align-items:baseline; flex-wrap:wrap; }
header h1 { font-size:18px; margin:0; }
header .meta { color:#cbd5e1; font-size:13px; }
.badge { display:inline-block; padding:1px 8px; border-radius:10px; background:#374151; color:#fff; font-size:12px; }
.badge.ok { background:#15803d; } .badge.bad { background:var(--bad); } .badge.skip { background:#ea580c; }
.gbar { display:flex; height:18px; border-radius:4px; overflow:hidden; background:#e5e7eb; margin:6px 0; }
.gseg { display:block; height:100%; background:#9ca3af; } .g-productive { background:#15803d; }
.g-data_wait { background:#ca8a04; } .g-skipped_step { background:#ea580c; } .g-forensics { background:#b91c1c; }
.g-startup { background:#6b7280; } .g-checkpoint { background:#7c3aed; } .g-evaluation { background:#0891b2; }
.g-other { background:#9ca3af; }
.glegend { display:flex; flex-wrap:wrap; gap:4px 14px; margin:4px 0; font-size:13px; }
.gkey { white-space:nowrap; } .gsw { display:inline-block; width:11px; height:11px; border-radius:2px; margin-right:5px; vertical-align:-1px; }
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
.forensic p { margin:4px 0; }
details.config > summary { cursor:pointer; font-weight:600; }
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
  /* A figure on a card: 4 significant digits (407.1, 0.1903, 5.821), a whole number in
     groups of three from 1,000 up (36,224), exponent form below 0.001 (1.5e-5). */
  function fmtValue(v) {
    if (v === null || v === undefined) return "–";
    if (!isFinite(v)) return String(v);
    var a = Math.abs(v);
    if (a >= 1e15) return v.toExponential(3).replace(/\.?0+e/, "e");
    if (a >= 1000) return Math.round(v).toFixed(0).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
    if (a !== 0 && a < 1e-3) return v.toExponential(3).replace(/\.?0+e/, "e");
    return String(+v.toPrecision(4));
  }
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  }
  var MIB = 1048576;
  var SERIES = [
    {id: "loss", axis: "loss", get: function (s) { return num(s.loss); }, unit: ""},
    {id: "grad_norm", axis: "L2 norm", get: function (s) { return num(s.grad_norm); }, unit: "", log: true},
    {id: "step_time", axis: "ms", get: function (s) { var d = num(s.duration_s); return d === null ? null : d * 1000; }, unit: " ms"},
    {id: "memory", axis: "MiB", get: function (s) {
      var m = s.memory || {};
      var v = num(m.cuda_allocated_bytes); if (v === null) v = num(m.rss_bytes);
      return v === null ? null : v / MIB; }, unit: " MiB",
     /* at least 16 MiB or a tenth of the level: allocator noise stays flat */
     minSpan: function (top) { return Math.max(16, 0.1 * Math.abs(top)); }},
    /* tokens per second of the step's cycle (its time plus the wait before it) when the steps
       count tokens, else samples per second; throughputSpec names the one drawn */
    {id: "throughput", axis: "samples/s", per: "samples", get: function (s) {
      var n = num(s[this.per]);
      var d = num(s.duration_s); if (n === null || d === null) return null;
      var w = num(s.data_wait_s) || 0; return d + w > 0 ? n / (d + w) : null; }, unit: " samples/s"}
  ];
  function throughputSpec(spec, steps) {
    var per = steps.some(function (s) { return num(s.tokens) !== null; }) ? "tokens" : "samples";
    var out = {}; for (var k in spec) out[k] = spec[k];
    out.per = per; out.axis = per + "/s"; out.unit = " " + per + "/s";
    return out;
  }

  /* Seconds on the goodput bar: 3 significant digits, in ms below a second (4.3 s, 64 ms). */
  function fmtSeconds(v) {
    if (!(v > 0)) return "0 s";
    if (v >= 1) return String(+v.toPrecision(3)) + " s";
    if (v >= 1e-3) return String(+(1000 * v).toPrecision(3)) + " ms";
    return "<1 ms";
  }

  /* Where the wall time went: productive steps and each kind of badput, as one bar, and under
     it a legend: each kind's colour, name and seconds. Counted up to the end of the last step. */
  function renderGoodput(box, tp) {
    if (!box) return {parts: 0, legend: []};
    box.textContent = "";
    if (!tp) { box.appendChild(el("p", {"class": "muted"}, "No throughput accounting in this run.")); return {parts: 0, legend: []}; }
    if (!tp.wall_s) { box.appendChild(el("p", {"class": "muted"}, "Counted from the first step on.")); return {parts: 0, legend: []}; }
    var parts = [["productive", tp.productive_s || 0]], bad = tp.badput_s || {};
    Object.keys(bad).sort().forEach(function (k) { if (bad[k] > 0) parts.push([k, bad[k]]); });
    var bar = el("div", {"class": "gbar", "id": "tt-goodput-bar"});
    parts.forEach(function (p) {
      var seg = el("span", {"class": "gseg g-" + p[0], "data-kind": p[0], "title": p[0] + " " + fmtSeconds(p[1])});
      seg.style.width = (100 * p[1] / tp.wall_s).toFixed(2) + "%"; bar.appendChild(seg);
    });
    box.appendChild(bar);
    var legend = el("div", {"class": "glegend", "id": "tt-goodput-legend"});
    parts.forEach(function (p) {
      var keyEl = el("span", {"class": "gkey", "data-kind": p[0]});
      keyEl.appendChild(el("i", {"class": "gsw g-" + p[0]}));
      keyEl.appendChild(document.createTextNode(p[0] + " " + fmtSeconds(p[1])));
      legend.appendChild(keyEl);
    });
    box.appendChild(legend);
    box.appendChild(el("p", {"class": "muted"}, "goodput " + (tp.goodput_ratio === null || tp.goodput_ratio === undefined ?
      "–" : (100 * tp.goodput_ratio).toFixed(1) + " %") + " of " + fmtSeconds(tp.wall_s) +
      ", " + (tp.counted || "up to the end of the last step") +
      ": the share of wall time in training steps whose update was applied"));
    /* what the picture shows, for a headless test: each key's colour beside its segment's */
    var drawn = parts.map(function (p) {
      var seg = bar.querySelector('.gseg[data-kind="' + p[0] + '"]'), sw = legend.querySelector('.gkey[data-kind="' + p[0] + '"] .gsw');
      return {kind: p[0], segment: getComputedStyle(seg).backgroundColor, swatch: getComputedStyle(sw).backgroundColor};
    });
    return {parts: parts.length, legend: drawn};
  }

  function key(d) { return String(d.operation) + "#" + String(d.step); }

  /* One entry per replayed step, whichever sources told of it. */
  function forensicReports(events) {
    var seen = {}, out = [];
    events.forEach(function (e) {
      if (e.type !== "forensics") return;
      var d = e.data || {}, k = key(d);
      if (seen[k]) return;
      seen[k] = true; out.push(d);
    });
    return out;
  }

  function anomalyRows(events, steps) {
    var skipped = {};
    steps.forEach(function (s) { if (s.skipped) skipped[key(s)] = true; });
    var rows = [];
    events.forEach(function (e) {
      if (e.type !== "anomaly") return;
      var d = e.data || {};
      rows.push({step: d.step, operation: d.operation, kind: d.kind, detail: d.detail || e.message,
                 data: d.data || {}, skipped: !!skipped[key(d)]});
    });
    return rows;
  }

  function renderAnomalies(box, rows, reports) {
    box.textContent = "";
    if (!rows.length) { box.appendChild(el("p", {"class": "muted"}, "No anomalies.")); return; }
    var t = el("table"), hr = el("tr"), linked = {};
    var replayed = {};
    reports.forEach(function (f) { replayed[key(f)] = true; });
    ["step", "operation", "kind", "update", "detail"].forEach(function (c) { hr.appendChild(el("th", null, c)); });
    t.appendChild(hr);
    rows.slice(-200).forEach(function (r) {
      var tr = el("tr", {"class": "anomaly", "data-kind": r.kind || "", "data-step": String(r.step),
                         "data-skipped": r.skipped ? "1" : "0"});
      tr.appendChild(el("td", {"class": "num"}, String(r.step)));
      tr.appendChild(el("td", null, r.operation || ""));
      tr.appendChild(el("td", {"class": "kind"}, r.kind || ""));
      var up = el("td"); if (r.skipped) up.appendChild(el("span", {"class": "badge skip"}, "skipped"));
      tr.appendChild(up);
      var td = el("td", null, r.detail || "");
      if (replayed[key(r)] && !linked[key(r)]) {
        linked[key(r)] = true;
        td.appendChild(document.createTextNode(" "));
        td.appendChild(el("a", {"href": "#forensic-" + String(r.step), "class": "muted"}, "forensic report"));
      }
      if (Object.keys(r.data).length) {
        var det = el("details"); det.appendChild(el("summary", null, "data"));
        det.appendChild(el("pre", null, JSON.stringify(r.data, null, 2))); td.appendChild(det);
      }
      tr.appendChild(td); t.appendChild(tr);
    });
    box.appendChild(t);
    if (rows.length > 200) box.appendChild(el("p", {"class": "muted"}, "showing the last 200 of " + rows.length));
  }

  function renderForensics(box, reports) {
    if (!box) return;
    box.textContent = "";
    if (!reports.length) { box.appendChild(el("p", {"class": "muted"}, "No replays: no non-finite step, or replay off.")); return; }
    reports.forEach(function (f) {
      var d = el("div", {"class": "forensic", "id": "forensic-" + String(f.step), "data-step": String(f.step),
                         "data-module": String(f.module), "data-cause": String(f.cause)});
      var head = el("p");
      head.appendChild(el("b", null, "step " + f.step + " · " + (f.operation || "") + " · "));
      head.appendChild(document.createTextNode(window.ttForensicSentence(f)));
      d.appendChild(head);
      var det = el("details"); det.appendChild(el("summary", null, "the full report"));
      det.appendChild(el("pre", null, JSON.stringify(f, null, 2))); d.appendChild(det);
      box.appendChild(d);
    });
  }

  function stat(label, value) {
    var d = el("div", {"class": "stat"}); d.appendChild(el("b", null, value)); d.appendChild(el("span", null, label));
    return d;
  }

  function renderSummary(box, data, replays, main) {
    var s = data.summary || {}, tr = data.training || {}, tot = s.totals || {};
    box.textContent = "";
    var g = el("div", {"class": "stats"});
    g.appendChild(stat("steps", String(tot.steps !== undefined ? tot.steps : (data.steps || []).length)));
    g.appendChild(stat("anomalous steps", String(tot.anomaly_steps || 0)));
    g.appendChild(stat("anomaly rate", tr.anomaly_rate !== undefined ? (100 * tr.anomaly_rate).toFixed(2) + " %" : "–"));
    g.appendChild(stat("non-finite steps", String(tot.nonfinite_steps || 0)));
    g.appendChild(stat("skipped updates", String(tot.skipped_steps || 0)));
    /* the updates a loss scaler skipped (Inf in the scaled gradients): a run stuck there trains nothing */
    if (tot.scaler_overflow_steps) g.appendChild(stat("skipped by the loss scaler", String(tot.scaler_overflow_steps)));
    g.appendChild(stat("forensic replays", String(replays)));
    /* the charted operation's last step (a run of one operation: the run's last step) */
    var last = main.step || s.last_step || {}, of = main.several ? " (" + main.name + ")" : "";
    g.appendChild(stat("last loss" + of, fmtValue(num(last.loss))));
    g.appendChild(stat("last grad norm" + of, fmtValue(num(last.grad_norm))));
    var tel = s.telemetry || {};
    /* spans per sink: a sum over the sinks would count each span once per sink */
    (tel.span_exporters || []).forEach(function (sink) {
      var lost = 0; for (var r in (sink.dropped || {})) lost += sink.dropped[r];
      g.appendChild(stat("spans exported / dropped (" + sink.exporter + ")", (sink.exported || 0) + " / " + lost));
    });
    if (!(tel.span_exporters || []).length) {  /* a report without per-sink books: its totals */
      var dropped = 0; for (var k in (tel.spans_dropped || {})) dropped += tel.spans_dropped[k];
      g.appendChild(stat("spans exported / dropped", (tel.spans_exported || 0) + " / " + dropped));
    }
    var errs = 0; for (var k2 in (tel.internal_errors || {})) errs += tel.internal_errors[k2];
    g.appendChild(stat("internal errors", String(errs)));
    box.appendChild(g);
    (data.notes || []).forEach(function (n) { box.appendChild(el("p", {"class": "muted tt-note"}, n)); });
    var kinds = s.anomalies_by_kind || {};
    if (Object.keys(kinds).length) {
      var p = el("p", null, "By kind: ");
      Object.keys(kinds).sort().forEach(function (k) { p.appendChild(el("span", {"class": "badge bad"}, k + " " + kinds[k])); p.appendChild(document.createTextNode(" ")); });
      box.appendChild(p);
    }
  }

  /* Which operation the charts show, and the operations left out of them with their steps. */
  function renderOperations(box, main, n, others) {
    if (!main) return;
    var names = Object.keys(others).sort();
    var text = "Charts: " + main + " (" + n + " steps).";
    if (names.length) text += " Not charted: " + names.map(function (k) { return k + " (" + others[k] + ")"; }).join(", ") + ".";
    box.appendChild(el("p", {"class": "muted", "id": "tt-operations"}, text));
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
    var count = document.getElementById("tt-settings-count");
    if (count) count.textContent = String(Object.keys(settings).length);
  }

  window.ttRender = function (data) {
    var s = data.summary || {};
    var steps = data.steps || [], events = data.events || [];
    document.getElementById("tt-run").textContent = s.run_id || "?";
    document.getElementById("tt-service").textContent = (s.service_name || "") + " · rank " + (s.rank || 0) + "/" + (s.world_size || 1);
    var lv = document.getElementById("tt-level"); lv.textContent = "level " + (s.level || "?");
    var counts = {}, axes = {}, main = window.ttMainOperation(steps), others = {};
    var shown = steps.filter(function (x) { return String(x.operation) === main; });
    steps.forEach(function (x) { var op = String(x.operation); if (op !== main) others[op] = (others[op] || 0) + 1; });
    SERIES.forEach(function (spec) {
      if (spec.id === "throughput") spec = throughputSpec(spec, shown);
      var c = document.getElementById("chart-" + spec.id);
      counts[spec.id] = window.ttChart(c, shown, spec).points;
      c.setAttribute("data-operation", main || "");
      axes[spec.id] = {x: c.getAttribute("data-xlabel"), y: c.getAttribute("data-ylabel"),
                       xticks: c.getAttribute("data-xticks"), yrange: c.getAttribute("data-yrange")};
      var lastv = null;
      for (var i = shown.length - 1; i >= 0 && lastv === null; i--) lastv = spec.get(shown[i]);
      document.getElementById("last-" + spec.id).textContent = (main ? main + " · " : "") + "last " + fmtValue(lastv) + spec.unit;
    });
    var reports = forensicReports(events);
    var rows = anomalyRows(events, steps);
    renderAnomalies(document.getElementById("tt-anomalies"), rows, reports);
    renderForensics(document.getElementById("tt-forensics"), reports);
    renderSummary(document.getElementById("tt-summary"), data, reports.length,
                  {name: main, step: shown[shown.length - 1], several: Object.keys(others).length > 0});
    renderOperations(document.getElementById("tt-summary"), main, shown.length, others);
    renderSettings(document.getElementById("tt-settings"), data.settings);
    var goodput = renderGoodput(document.getElementById("tt-goodput"), s.throughput);
    var state = document.getElementById("tt-state");
    var prev = {}; try { prev = JSON.parse(state.textContent || "{}"); } catch (e) { prev = {}; }
    state.textContent = JSON.stringify({
      renders: (prev.renders || 0) + 1, steps: steps.length, charts: counts, axes: axes, level: s.level,
      operation: main, others: others,
      anomalies: rows.map(function (r) { return {step: r.step, kind: r.kind}; }),
      skipped: steps.filter(function (x) { return x.skipped; }).map(function (x) { return x.step; }),
      goodput: goodput.parts, goodput_legend: goodput.legend,
      forensics: reports.map(function (f) { return {step: f.step, operation: f.operation, cause: f.cause, module: f.module}; })
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
  <section class="card wide"><h2>Anomalies <span>in the charts: red band, an anomalous step; red triangle, a non-finite value; orange diamond, a skipped update</span></h2><div id="tt-anomalies" class="scroll"></div></section>
  <section class="card wide"><h2>Forensic replays <span>where each non-finite value came from</span></h2><div id="tt-forensics"></div></section>
  <section class="card"><h2>Loss <span id="last-loss"></span></h2><canvas id="chart-loss"></canvas></section>
  <section class="card"><h2>Gradient norm <span id="last-grad_norm"></span></h2><canvas id="chart-grad_norm"></canvas></section>
  <section class="card"><h2>Step time <span id="last-step_time"></span></h2><canvas id="chart-step_time"></canvas></section>
  <section class="card"><h2>Memory <span id="last-memory"></span></h2><canvas id="chart-memory"></canvas></section>
  <section class="card"><h2>Throughput <span id="last-throughput"></span></h2><canvas id="chart-throughput"></canvas></section>
  <section class="card"><h2>Goodput <span>where the wall time went</span></h2><div id="tt-goodput"></div></section>
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
            f"<style>{CSS}</style></head><body>{body}<script>{CHARTS_JS}</script><script>{SENTENCE_JS}</script>"
            f"<script>{JS}</script>"
            f"<script>{script}</script></body></html>\n")


def embed_json(value: object) -> str:
    """JSON safe inside a ``<script type="application/json">`` element (no ``</script>`` break-out)."""
    from torchtrace.files import to_strict

    text = json.dumps(to_strict(value), allow_nan=False, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
