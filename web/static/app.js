// Draws the dashboard's charts from the JSON that each page embeds in <script type="application/json">.
// Plotly is served by this app (no CDN), only on pages with charts. Strings from traces are escaped:
// Plotly renders a subset of HTML in labels and tooltips.
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

function fmtUs(us) {
  const a = Math.abs(us);
  if (a >= 1e6) return (us / 1e6).toFixed(2) + " s";
  if (a >= 1e3) return (us / 1e3).toFixed(2) + " ms";
  return us.toFixed(1) + " µs";
}

const baseLayout = {
  margin: {l: 60, r: 20, t: 10, b: 40},
  font: {family: "system-ui, sans-serif", size: 12},
  paper_bgcolor: "rgba(0,0,0,0)",
  plot_bgcolor: "rgba(0,0,0,0)",
};
const config = {displaylogo: false, responsive: true};

// Plotly.newPlot, then a performance mark "chart drawn <id>" (benchmarks/run_page.py reads them).
function plot(element, traces, layout) {
  return Plotly.newPlot(element, traces, layout, config).then(() => performance.mark(`chart drawn ${element.id}`));
}

// A chart on the first screen is drawn at once (before the load event); one further down when it scrolls near:
// Plotly takes 20-100 ms a chart, which a reader who never scrolls there should not wait for.
function drawWhenNear(element, draw) {
  const margin = 200;  // px: drawn a little before it shows
  if (typeof IntersectionObserver === "undefined" || element.getBoundingClientRect().top < window.innerHeight + margin) {
    draw();
    return;
  }
  const observer = new IntersectionObserver(entries => {
    if (entries.some(e => e.isIntersecting)) {
      observer.disconnect();
      draw();
    }
  }, {rootMargin: `${margin}px 0px`});
  observer.observe(element);
}

// The left margin that fits tick labels (in the layout's font), measured on a canvas: Plotly's `automargin` measures
// them in the SVG and then lays the chart out a second time, which doubled the waterfall's drawing time.
let measureContext = null;
function labelMargin(labels, least) {
  measureContext = measureContext || document.createElement("canvas").getContext("2d");
  measureContext.font = `${baseLayout.font.size}px ${baseLayout.font.family}`;
  const widest = Math.max(0, ...labels.map(l => measureContext.measureText(l).width));
  return Math.max(least, Math.ceil(widest) + 16);  // tick labels stand 6 px off the axis; some slack for the font
}

// The step now, what each fix buys on top of the ones before it (the analyser's replay), the step after all.
// A waterfall drawn with floating bars (a bar's `base`) and connector lines: the vendored Plotly has no waterfall
// trace (web/pages.py PLOTLY_JS).
function drawWaterfall() {
  const prediction = pageData("waterfall-data");
  const element = document.getElementById("waterfall-chart");
  if (!prediction || !element || typeof Plotly === "undefined") return;
  const steps = prediction.waterfall;
  // each bar numbered as its finding is in the list below (the replay's order is not the list's)
  const causes = pageData("finding-causes") || [];
  const number = s => (causes.indexOf(s.finding) + 1) || "·";
  const labels = ["step now"].concat(steps.map(s => `${number(s)}. ${escapeText(shorten(s.title, 60))}`), ["after all fixes"]);
  const y = labels.map((l, i) => i);
  // the step time (µs) before each bar and after it: a fix's bar spans the two, the first and last start at 0
  const before = [0, prediction.step_us].concat(steps.map(s => s.step_us_after));
  const after = [prediction.step_us].concat(steps.map(s => s.step_us_after), [prediction.step_us_after]);
  before[before.length - 1] = 0;
  const colors = after.map((a, i) => i === 0 || i === labels.length - 1 ? "#3b6ea8" : a <= before[i] ? "#2ca02c" : "#d62728");
  const hover = [`step now: ${fmtUs(prediction.step_us)}`].concat(
    steps.map(s => `${escapeText(shorten(s.title, 120))}<br>saves ${fmtUs(s.saving_us_per_step)} per step → ${fmtUs(s.step_us_after)}`),
    [`after all fixes: ${fmtUs(prediction.step_us_after)} (${prediction.saving_pct.toFixed(1)} % faster)`]);
  const gap = 0.2, half = (1 - gap) / 2;
  // a line from each bar's end to the next bar
  const connectors = after.slice(0, -1).map((x, i) => ({type: "line", xref: "x", yref: "y", x0: x / 1000, x1: x / 1000,
    y0: i + half, y1: i + 1 - half, line: {color: "#bbb", width: 2}, layer: "below"}));
  const margin = labelMargin(["step now", "after all fixes"].concat(steps.map(s => `${number(s)}. ${shorten(s.title, 60)}`)), 380);
  plot(element, [{
    type: "bar", orientation: "h", y,
    base: before.map(b => b / 1000), x: after.map((a, i) => (a - before[i]) / 1000), marker: {color: colors, line: {color: colors, width: 2}},
    text: labels.map((l, i) => i === 0 ? fmtUs(prediction.step_us) : i === labels.length - 1 ? fmtUs(prediction.step_us_after)
                                : "−" + fmtUs(steps[i - 1].saving_us_per_step)),
    textposition: "outside", hovertext: hover, hoverinfo: "text", cliponaxis: false, showlegend: false,
  }], {...baseLayout, margin: {...baseLayout.margin, l: margin, r: 80}, height: 70 + 28 * labels.length, bargap: gap,
       shapes: connectors, xaxis: {title: {text: "step time (ms)"}, rangemode: "tozero"},
       yaxis: {tickvals: y, ticktext: labels, range: [labels.length - 0.5, -0.5], fixedrange: true}});
}

// One stacked bar: the step's GPU time by kind of kernel, then its idle time by cause.
function drawBreakdown() {
  const data = pageData("breakdown-data");
  const element = document.getElementById("breakdown-chart");
  if (!data || !element || typeof Plotly === "undefined") return;
  const b = data.breakdown, idle = data.idle || {};
  const parts = [["compute-bound kernels", b.compute_kernels, "#3b6ea8"], ["memory-bound kernels", b.memory_kernels, "#9ecae1"],
                 ["memcpy / memset", b.memcpy_memset, "#bcbd22"], ["communication", b.communication, "#9467bd"]];
  const causes = [["host wait idle", "host_wait", "#ff7f0e"], ["own-code idle", "own_code", "#8c564b"],
                  ["sync idle", "sync", "#d62728"],
                  ["collective wait idle", "collective", "#e377c2"], ["kernel-to-kernel idle", "kernel_to_kernel", "#c7c7c7"],
                  ["short gaps", "short", "#eeeeee"]];
  for (const [label, key, color] of causes) if (idle[key]) parts.push([label, idle[key].idle_us_per_step, color]);
  drawWhenNear(element, () => plot(element, parts.filter(p => p[1] > 0).map(([label, us, color]) => ({
    type: "bar", orientation: "h", name: label, y: ["per step"], x: [us / 1000], marker: {color},
    hovertext: [`${label}: ${fmtUs(us)} per step`], hoverinfo: "text",
  })), {...baseLayout, barmode: "stack", height: 150, margin: {...baseLayout.margin, l: 70},
       xaxis: {title: {text: "ms per step"}}, yaxis: {fixedrange: true}, legend: {orientation: "h", y: -0.6}}));
}

// One row of the timeline: its segments as rectangles from y = row - half to row + half, separated by nulls,
// filled. Plotly draws a trace's fill as one SVG path however many segments (as lines it draws a path per
// segment: 3000 for a big trace, half of the page's time); hover is on the segments' corners, with their text.
function segmentsTrace(name, row, half, lane, color, hover) {
  const x = [], y = [], text = [];
  const low = row - half, high = row + half;
  for (let i = 0; i < lane.start.length; i++) {
    const s = lane.start[i] / 1000, e = lane.end[i] / 1000, label = hover(lane, i);
    x.push(s, e, e, s, null);
    y.push(low, low, high, high, null);
    text.push(label, label, label, label, null);
  }
  return {type: "scatter", mode: "none", fill: "toself", fillcolor: color, hoveron: "points", x, y, text,
          hoverinfo: "text", name, showlegend: false};
}

// A lane (segments by start: start, end, count, busy_us) with the segments less than `minGap` µs apart joined: the
// joined segment spans the first's start to the last's end, its count and busy time are theirs added up. At the
// first zoom a gap under a pixel draws nothing; on the benchmark's 1M-event trace (benchmarks/run_page.py) 1,500
// segments a lane join into some 15, and Plotly's time grows with the segments.
function mergeSegments(lane, minGap) {
  const out = {start: [], end: [], count: [], busy_us: []};
  for (let i = 0; i < lane.start.length; i++) {
    const last = out.start.length - 1;
    if (last >= 0 && lane.start[i] - out.end[last] < minGap) {
      out.end[last] = Math.max(out.end[last], lane.end[i]);
      out.count[last] += lane.count[i];
      out.busy_us[last] += lane.busy_us[i];
    } else {
      out.start.push(lane.start[i]);
      out.end.push(lane.end[i]);
      out.count.push(lane.count[i]);
      out.busy_us.push(lane.busy_us[i]);
    }
  }
  return out;
}

// The analyser's explanation of a gap (cause, next op, host ops), matched by where the gap starts.
function gapExplanation(causes, start, end) {
  const found = (causes || []).find(c => c.start_us !== null && Math.abs(c.start_us - start) <= 1.0 + 0.01 * (end - start));
  if (!found) return "";
  return `<br>cause: ${escapeText(String(found.cause || "?").replace(/_/g, " "))}` +
         (found.next_op ? `<br>next op: ${escapeText(found.next_op)}` : "") +
         (found.host_ops && found.host_ops.length ? `<br>host ran: ${escapeText(found.host_ops.join(", "))}` : "");
}

function drawTimeline() {
  const timeline = pageData("timeline-data");
  const element = document.getElementById("timeline-chart");
  if (!timeline || !element || typeof Plotly === "undefined") return;
  const span = (lane, i) => `${(lane.start[i] / 1000).toFixed(3)}–${(lane.end[i] / 1000).toFixed(3)} ms`;
  // kernel and launch lanes are joined where a gap is under a pixel; the idle lane is drawn as it is (50 gaps, each
  // with its cause)
  const rows = timeline.streams.map(s => ({name: `dev ${s.device} · stream ${s.stream}`, lane: s, color: "#3b6ea8", join: true,
    hover: (l, i) => `${l.count[i]} kernel(s), busy ${fmtUs(l.busy_us[i])}<br>${span(l, i)}`}));
  const launches = timeline.launches;
  if (launches && launches.start.length) {
    rows.unshift({name: "CPU launches", lane: launches, color: "#8c8c8c", join: true,
      hover: (l, i) => `${l.count[i]} launch call(s), ${fmtUs(l.busy_us[i])} on the CPU<br>${span(l, i)}`});
  }
  const gaps = timeline.gaps || {start: [], end: []};
  if (gaps.start.length) {
    rows.push({name: "GPU idle", lane: gaps, color: "#d62728", join: false,
      hover: (l, i) => `GPU idle ${fmtUs(l.end[i] - l.start[i])} at ${(l.start[i] / 1000).toFixed(3)} ms` +
                       gapExplanation(timeline.causes, l.start[i], l.end[i])});
  }
  const height = 80 + 40 * rows.length, plotHeight = height - baseLayout.margin.t - baseLayout.margin.b;
  const half = 7 * rows.length / plotHeight;  // rows 14 px high
  const margin = {...baseLayout.margin, l: 140};
  // the x range, set rather than Plotly's autorange over every corner: the first start to the last end
  let first = Infinity, last = -Infinity;
  for (const {lane} of rows) {
    for (let i = 0; i < lane.start.length; i++) {
      first = Math.min(first, lane.start[i]);
      last = Math.max(last, lane.end[i]);
    }
  }
  const traces = usPerPixel => rows.map(({name, lane, color, join, hover}, row) =>
    segmentsTrace(name, row, half, join ? mergeSegments(lane, usPerPixel) : lane, color, hover));
  const spans = last > first;  // else (one empty lane, say) Plotly's autorange and nothing joined
  let usPerPixel = spans ? (last - first) / Math.max(100, element.clientWidth - margin.l - margin.r) : 0;
  plot(element, traces(usPerPixel), {
    ...baseLayout, margin, height,
    xaxis: {title: {text: "time (ms)"}, zeroline: false, ...(spans ? {range: [first / 1000, last / 1000]} : {})},
    yaxis: {tickvals: rows.map((r, i) => i), ticktext: rows.map(r => r.name), range: [rows.length - 0.5, -0.5],
            fixedrange: true, zeroline: false},
    dragmode: "zoom", hovermode: "closest",
  }).then(() => element.on("plotly_relayout", () => {
    // zoomed (or reset, or resized): the lanes joined again at the new scale, so a gap shows once it is a pixel wide
    const [from, to] = element.layout.xaxis.range;
    const now = (to - from) * 1000 / element._fullLayout.xaxis._length;
    if (!(now > 0) || Math.abs(now - usPerPixel) <= 1e-6 * usPerPixel) return;
    usPerPixel = now;
    const joined = rows.map((r, i) => i).filter(i => rows[i].join), redrawn = traces(usPerPixel);
    Plotly.restyle(element, {x: joined.map(i => redrawn[i].x), y: joined.map(i => redrawn[i].y),
                             text: joined.map(i => redrawn[i].text)}, joined);
  }));
}

function drawABTimes() {
  const timing = pageData("ab-times-data");
  const element = document.getElementById("ab-times-chart");
  if (!timing || !element || typeof Plotly === "undefined") return;
  const box = (name, values, color) => ({type: "violin", name, y: values, box: {visible: true},
    points: "all", meanline: {visible: true}, marker: {color}, hoverinfo: "y"});
  plot(element, [box("A (eager)", timing.a_ms, "#7f7f7f"), box("B (swapped)", timing.b_ms, "#2ca02c")],
    {...baseLayout, height: 360, yaxis: {title: {text: "step time (ms)"}}, showlegend: false});
}

function drawCompare() {
  const data = pageData("compare-data");
  const element = document.getElementById("compare-chart");
  if (!data || !element || typeof Plotly === "undefined" || !data.length) return;
  const rows = data.slice(0, 20).reverse();
  const labels = rows.map(k => shorten(k.short_name || k.name, 60));
  plot(element, [{
    type: "bar", orientation: "h",
    x: rows.map(k => k.delta_us / 1000),
    y: rows.map((k, i) => i),  // positions, labelled below: shortened names may collide
    hovertext: rows.map(k => `${escapeText(shorten(k.name, 120))}<br>A ${fmtUs(k.a_us)}, B ${fmtUs(k.b_us)}`),
    hoverinfo: "text", marker: {color: rows.map(k => k.delta_us > 0 ? "#d62728" : "#2ca02c")},
  }], {...baseLayout, margin: {...baseLayout.margin, l: labelMargin(labels, 360)}, height: 60 + 24 * rows.length,
       xaxis: {title: {text: "B − A (ms)"}},
       yaxis: {tickvals: rows.map((k, i) => i), ticktext: labels.map(escapeText), range: [-0.5, rows.length - 0.5],
               fixedrange: true}});
}

document.addEventListener("DOMContentLoaded", () => {
  drawWaterfall();
  drawBreakdown();
  drawTimeline();
  drawABTimes();
  drawCompare();
});
