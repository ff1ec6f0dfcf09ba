// Draws the dashboard's charts from the JSON that each page embeds in <script type="application/json">.
// Plotly is served by this app (no CDN). Strings from traces are escaped: Plotly renders a subset of HTML.
"use strict";

function pageData(id) {
  const element = document.getElementById(id);
  return element ? JSON.parse(element.textContent) : null;
}

function escapeText(text) {
  return String(text ?? "").replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

function shorten(text, length) {
  text = String(text ?? "");
  return text.length > length ? text.slice(0, length - 1) + "…" : text;
}

const baseLayout = {
  margin: {l: 60, r: 20, t: 10, b: 40},
  font: {family: "system-ui, sans-serif", size: 12},
  paper_bgcolor: "rgba(0,0,0,0)",
  plot_bgcolor: "rgba(0,0,0,0)",
};
const config = {displaylogo: false, responsive: true};

function kernelAxis(rows) {
  return {tickvals: rows.map((k, i) => i), ticktext: rows.map(k => escapeText(shorten(k.name, 60))),
          automargin: true, fixedrange: true};
}

function drawTopKernels() {
  const kernels = pageData("top-kernels-data");
  const element = document.getElementById("top-kernels-chart");
  if (!kernels || !element || !kernels.length) return;
  const rows = kernels.slice(0, 15).reverse();
  Plotly.newPlot(element, [{
    type: "bar", orientation: "h",
    x: rows.map(k => k.total_us / 1000),
    y: rows.map((k, i) => i),  // positions, labelled below: truncated names may collide
    hovertext: rows.map(k => [
      escapeText(shorten(k.name, 120)),
      "op: " + escapeText(k.op || "?"), "module: " + escapeText(k.module || "?"),
      `${k.count} calls, ${(k.total_us / 1000).toFixed(3)} ms (${k.share_pct.toFixed(1)} %)`].join("<br>")),
    hoverinfo: "text", marker: {color: "#3b6ea8"},
  }], {...baseLayout, margin: {...baseLayout.margin, l: 360}, height: 60 + 24 * rows.length,
       xaxis: {title: {text: "total time (ms)"}}, yaxis: kernelAxis(rows)}, config);
}

// One scatter line per row, segments separated by nulls: a single SVG path however many segments.
function segmentsTrace(name, starts, ends, color, width, hover) {
  const x = [], y = [], text = [];
  for (let i = 0; i < starts.length; i++) {
    x.push(starts[i] / 1000, ends[i] / 1000, null);
    y.push(name, name, null);
    text.push(hover(i), hover(i), null);
  }
  return {type: "scatter", mode: "lines", x, y, text, hoverinfo: "text", name,
          line: {color, width}, showlegend: false};
}

function drawTimeline() {
  const timeline = pageData("timeline-data");
  const element = document.getElementById("timeline-chart");
  if (!timeline || !element) return;
  const traces = timeline.streams.map(s => segmentsTrace(
    `dev ${s.device} · stream ${s.stream}`, s.start, s.end, "#3b6ea8", 14,
    i => `${s.count[i]} kernel(s), busy ${s.busy_us[i].toFixed(1)} µs<br>` +
         `${(s.start[i] / 1000).toFixed(3)}–${(s.end[i] / 1000).toFixed(3)} ms`));
  const gaps = timeline.gaps || {start: [], end: []};
  if (gaps.start.length) {
    traces.push(segmentsTrace("GPU idle", gaps.start, gaps.end, "#d62728", 14,
      i => `idle ${(gaps.end[i] - gaps.start[i]).toFixed(1)} µs at ${(gaps.start[i] / 1000).toFixed(3)} ms`));
  }
  Plotly.newPlot(element, traces, {
    ...baseLayout, margin: {...baseLayout.margin, l: 140}, height: 80 + 40 * traces.length,
    xaxis: {title: {text: "time (ms)"}, zeroline: false},
    yaxis: {fixedrange: true, autorange: "reversed"}, dragmode: "zoom", hovermode: "closest",
  }, config);
}

function drawABTimes() {
  const timing = pageData("ab-times-data");
  const element = document.getElementById("ab-times-chart");
  if (!timing || !element) return;
  const box = (name, values, color) => ({type: "violin", name, y: values, box: {visible: true},
    points: "all", meanline: {visible: true}, marker: {color}, hoverinfo: "y"});
  Plotly.newPlot(element, [box("A (eager)", timing.a_ms, "#7f7f7f"), box("B (swapped)", timing.b_ms, "#2ca02c")],
    {...baseLayout, height: 360, yaxis: {title: {text: "step time (ms)"}}, showlegend: false}, config);
}

function drawCompare() {
  const kernels = pageData("compare-data");
  const element = document.getElementById("compare-chart");
  if (!kernels || !element || !kernels.length) return;
  const rows = kernels.slice(0, 20).reverse();
  Plotly.newPlot(element, [{
    type: "bar", orientation: "h",
    x: rows.map(k => k.delta_us / 1000),
    y: rows.map((k, i) => i),
    hovertext: rows.map(k => `${escapeText(shorten(k.name, 120))}<br>A ${(k.a_us / 1000).toFixed(3)} ms, ` +
                             `B ${(k.b_us / 1000).toFixed(3)} ms`),
    hoverinfo: "text", marker: {color: rows.map(k => k.delta_us > 0 ? "#d62728" : "#2ca02c")},
  }], {...baseLayout, margin: {...baseLayout.margin, l: 360}, height: 60 + 24 * rows.length,
       xaxis: {title: {text: "B − A (ms)"}}, yaxis: kernelAxis(rows)}, config);
}

document.addEventListener("DOMContentLoaded", () => {
  drawTopKernels();
  drawTimeline();
  drawABTimes();
  drawCompare();
});
