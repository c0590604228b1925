"""The charts' JavaScript: axes with step ticks, markers for anomalies and skipped updates.

``ttMainOperation(steps)`` picks the operation the charts show (the training operation with the
most steps; other operations' step numbers, rates and losses are not training's, and drawn on
its axis they would break its ticks and its last values). ``ttChart(canvas, steps, spec)``
draws one series on a canvas and writes what it drew into
the canvas's ``data-*`` attributes (points, x ticks, y range, skipped steps), so a headless
browser test reads the same numbers the picture shows. Rules, each from a misreading:

- the x axis has ticks at round step numbers (1, 2 or 5 times a power of ten), not just the
  first and last step;
- a series with ``minSpan`` gets an axis at least that tall around its values: memory
  that moves by a few MiB draws as the flat line it is, not as a leak;
- a skipped update is an orange diamond on the x axis with a dashed line; an anomalous
  step a red band; a non-finite value a red triangle at the top.
"""

from __future__ import annotations

CHARTS_JS = r"""
(function () {
  "use strict";
  function niceStep(span, count) {
    var raw = span / Math.max(count, 1);
    var mag = Math.pow(10, Math.floor(Math.log10(raw))), r = raw / mag;
    return (r <= 1 ? 1 : r <= 2 ? 2 : r <= 5 ? 5 : 10) * mag;
  }
  function ticks(lo, hi, count, integer) {
    if (!(hi > lo)) return [lo];
    var st = niceStep(hi - lo, count);
    if (integer) st = Math.max(1, Math.round(st));
    var out = [];
    for (var t = Math.ceil(lo / st - 1e-9) * st; t <= hi + st * 1e-9; t += st) out.push(+t.toPrecision(12));
    return out;
  }
  function yRange(vals, spec, useLog) {
    var lo = Math.min.apply(null, vals), hi = Math.max.apply(null, vals);
    if (useLog) { lo = Math.floor(Math.log10(lo)); hi = Math.ceil(Math.log10(hi)); if (hi === lo) hi += 1; return [lo, hi]; }
    var floor = spec.minSpan ? spec.minSpan(hi) : 0;
    if (hi - lo < floor) {
      var mid = (hi + lo) / 2; lo = mid - floor / 2; hi = mid + floor / 2;
      if (Math.min.apply(null, vals) >= 0 && lo < 0) { hi -= lo; lo = 0; }
    }
    if (hi === lo) { var d = Math.abs(hi) * 0.05 || 1; hi += d; lo -= d; }
    var st = niceStep(hi - lo, 4);
    var nlo = Math.floor(lo / st) * st, nhi = Math.ceil(hi / st) * st;
    if (Math.min.apply(null, vals) >= 0 && nlo < 0) nlo = 0;
    return [nlo, nhi];
  }
  /* Tick labels: short, no trailing zeros; thousands and up with an SI suffix (80k, 1.5M, 2G),
     exponent form below 1e-3 and past 1e15 (1e-4). */
  var SI = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
  function tickFmt(v) {
    var a = Math.abs(v);
    if (a !== 0 && (a >= 1e15 || a < 1e-3)) return v.toExponential().replace(/\.?0+e/, "e");
    for (var i = 0; i < SI.length; i++) if (a >= SI[i][0]) return String(+(v / SI[i][0]).toPrecision(6)) + SI[i][1];
    return String(+v.toPrecision(6));
  }
  function xAxis(steps) {
    var mono = steps.length > 0;
    for (var i = 1; i < steps.length && mono; i++) mono = typeof steps[i].step === "number" && steps[i].step > steps[i - 1].step;
    if (mono && typeof steps[0].step !== "number") mono = false;
    var pos = steps.map(function (s, i) { return mono ? s.step : i; });
    var x0 = pos.length ? pos[0] : 0, x1 = pos.length ? pos[pos.length - 1] : 1;
    return {pos: pos, x0: x0, x1: x1, label: function (t) { return mono ? t : steps[Math.round(t)].step; }};
  }

  /* The operation the charts show: of the steps of kind "train" (a step without a kind is one),
     the operation with the most steps, a tie to the one seen first; with no training step, the
     operation with the most steps. The same rule as torchtrace.reporting.summary.main_operation. */
  window.ttMainOperation = function (steps) {
    var train = steps.filter(function (s) { return (s.kind || "train") === "train"; });
    var counts = Object.create(null), order = [];
    (train.length ? train : steps).forEach(function (s) {
      var op = String(s.operation);
      if (!(op in counts)) { counts[op] = 0; order.push(op); }
      counts[op] += 1;
    });
    var best = null;
    order.forEach(function (op) { if (best === null || counts[op] > counts[best]) best = op; });
    return best;
  };

  window.ttChart = function (canvas, steps, spec) {
    var dpr = window.devicePixelRatio || 1;
    var w = canvas.clientWidth || 560, h = canvas.clientHeight || 190;
    canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
    var ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    var L = 74, R = 12, T = 10, B = 34, pw = w - L - R, ph = h - T - B;
    var ax = xAxis(steps), pts = [], bad = [], anomalies = [], skipped = [];
    for (var i = 0; i < steps.length; i++) {
      var v = spec.get(steps[i]);
      if (steps[i].anomalies && steps[i].anomalies.length) anomalies.push(i);
      if (steps[i].skipped) skipped.push(i);
      if (v === null) continue;
      if (!isFinite(v) || (spec.log && v < 0)) bad.push(i); else pts.push([i, v]);
    }
    ctx.font = "11px system-ui, sans-serif"; ctx.fillStyle = "#6b7280"; ctx.strokeStyle = "#e5e7eb"; ctx.lineWidth = 1;
    ctx.strokeRect(L, T, pw, ph);
    var attrs = {"data-points": pts.length, "data-nonfinite": bad.length, "data-xlabel": "step",
                 "data-ylabel": spec.axis, "data-xticks": "", "data-yrange": "", "data-skipped": ""};
    function finish() { for (var k in attrs) canvas.setAttribute(k, String(attrs[k])); return {points: pts.length, nonfinite: bad.length}; }
    if (!pts.length && !bad.length) { ctx.fillText("no data", L + pw / 2 - 20, T + ph / 2); return finish(); }
    var vals = pts.map(function (p) { return p[1]; });
    var useLog = !!(spec.log && vals.length && vals.every(function (v) { return v > 0; })
                    && Math.max.apply(null, vals) / Math.min.apply(null, vals) > 100);
    var yr = vals.length ? yRange(vals, spec, useLog) : [0, 1], lo = yr[0], hi = yr[1];
    var tf = useLog ? function (v) { return Math.log10(v); } : function (v) { return v; };
    var span = ax.x1 - ax.x0;
    function X(i) { return span > 0 ? L + ((ax.pos[i] - ax.x0) / span) * pw : L + pw / 2; }
    function XV(t) { return span > 0 ? L + ((t - ax.x0) / span) * pw : L + pw / 2; }
    function Y(v) { return T + ph - ((tf(v) - lo) / (hi - lo)) * ph; }
    // y ticks, grid and axis title
    var yt = useLog ? ticks(lo, hi, 5, true) : ticks(lo, hi, 4, false);
    ctx.textAlign = "right";
    yt.forEach(function (t) {
      var gy = T + ph - ((t - lo) / (hi - lo)) * ph;
      ctx.beginPath(); ctx.moveTo(L, gy); ctx.lineTo(L + pw, gy); ctx.stroke();
      ctx.fillText(tickFmt(useLog ? Math.pow(10, t) : t), L - 4, gy + 4);
    });
    ctx.save(); ctx.translate(12, T + ph / 2); ctx.rotate(-Math.PI / 2); ctx.textAlign = "center";
    ctx.fillText(spec.axis + (useLog ? " (log)" : ""), 0, 0); ctx.restore();
    // x ticks at round step numbers, and the axis title
    var xt = span > 0 ? ticks(ax.x0, ax.x1, Math.max(2, Math.floor(pw / 80)), true) : [ax.x0];
    ctx.textAlign = "center";
    xt.forEach(function (t) {
      var x = XV(t);
      ctx.beginPath(); ctx.moveTo(x, T + ph); ctx.lineTo(x, T + ph + 4); ctx.stroke();
      ctx.fillText(String(ax.label(t)), x, T + ph + 15);
    });
    ctx.fillText("step", L + pw / 2, h - 3);
    ctx.textAlign = "left";
    // anomalous steps: red bands; skipped updates: orange dashed line and diamond
    ctx.fillStyle = "rgba(220,38,38,0.18)";
    anomalies.forEach(function (i) { ctx.fillRect(X(i) - 1.5, T, 3, ph); });
    ctx.strokeStyle = "#ea580c"; ctx.fillStyle = "#ea580c"; ctx.setLineDash([3, 3]);
    skipped.forEach(function (i) { ctx.beginPath(); ctx.moveTo(X(i), T); ctx.lineTo(X(i), T + ph); ctx.stroke(); });
    ctx.setLineDash([]);
    skipped.forEach(function (i) {
      var x = X(i), y = T + ph; ctx.beginPath(); ctx.moveTo(x, y - 6); ctx.lineTo(x + 5, y); ctx.lineTo(x, y + 6); ctx.lineTo(x - 5, y); ctx.fill();
    });
    // the line, broken at missing or non-finite values
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
    ctx.fillStyle = "#dc2626";
    bad.forEach(function (i) {
      var x = X(i); ctx.beginPath(); ctx.moveTo(x - 5, T + 1); ctx.lineTo(x + 5, T + 1); ctx.lineTo(x, T + 9); ctx.fill();
    });
    attrs["data-xticks"] = xt.map(function (t) { return ax.label(t); }).join(",");
    attrs["data-yrange"] = (useLog ? [Math.pow(10, lo), Math.pow(10, hi)] : [lo, hi]).join(",");
    attrs["data-yticks"] = yt.map(function (t) { return tickFmt(useLog ? Math.pow(10, t) : t); }).join(",");
    attrs["data-yscale"] = useLog ? "log" : "linear";
    attrs["data-skipped"] = skipped.map(function (i) { return steps[i].step; }).join(",");
    return finish();
  };
})();
"""
