// The explorer's Time tab (loaded by explore.html, which defines $, api, go, view, fmt, VIEWS):
// across steps, the tail ratio and the tool share as curves; for one step, its trajectories as
// bars on one time axis, slowest first, cut into generate calls and tool calls. A click on a bar
// opens the trajectory's transcript at the span that made it slow.
"use strict";
const TIME_COLORS = {generate: "#6366f1", tool: "#10b981", gap: "#e5e7eb"};

function timeCurve(label, key, curves, step, onPick) {
  const pts = curves.filter(c => c[key] !== null && c[key] !== undefined);
  const w = 420, h = 150, l = 44, b = 22, t = 18;
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", w); svg.setAttribute("height", h); svg.setAttribute("class", "time-curve");
  svg.dataset.key = key;
  const add = (tag, attrs, text) => { const el = document.createElementNS(svg.namespaceURI, tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v); if (text !== undefined) el.textContent = text; svg.append(el); return el; };
  add("text", {x: l, y: 12}, label);
  if (!pts.length) return svg;
  const xs = pts.map(c => c.step), ys = pts.map(c => c[key]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y1 = Math.max(...ys, 1e-9);
  const X = s => l + (x1 > x0 ? (s - x0) / (x1 - x0) : 0.5) * (w - l - 10), Y = v => h - b - (v / y1) * (h - b - t);
  add("line", {x1: l, y1: h - b, x2: w - 10, y2: h - b, stroke: "#9ca3af"});
  add("text", {x: 2, y: t + 4}, fmt(y1)); add("text", {x: 2, y: h - b}, "0");
  add("text", {x: l, y: h - 6}, `step ${x0}`); add("text", {x: w - 60, y: h - 6}, `step ${x1}`);
  add("polyline", {points: pts.map(c => `${X(c.step).toFixed(1)},${Y(c[key]).toFixed(1)}`).join(" "), fill: "none", stroke: "#6366f1", "stroke-width": 2});
  for (const c of pts) {
    const dot = add("circle", {cx: X(c.step), cy: Y(c[key]), r: c.step === step ? 5 : 3, fill: c.step === step ? "#ef4444" : "#6366f1", class: "pt", "data-step": c.step});
    const tip = document.createElementNS(svg.namespaceURI, "title"); tip.textContent = `step ${c.step}: ${fmt(c[key])}`; dot.append(tip);
    dot.addEventListener("click", () => onPick(c.step));
  }
  return svg;
}

function gantt(data) {
  const rows = data.trajectories, w = 1100, label = 150, rh = 16, top = 20;
  const t0 = data.t0_us, t1 = Math.max(data.t1_us, t0 + 1), X = us => label + (us - t0) / (t1 - t0) * (w - label - 10);
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", w); svg.setAttribute("height", top + rows.length * rh + 4); svg.setAttribute("id", "gantt");
  const add = (parent, tag, attrs, text) => { const el = document.createElementNS(svg.namespaceURI, tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v); if (text !== undefined) el.textContent = text; parent.append(el); return el; };
  add(svg, "text", {x: label, y: 12}, "0 s"); add(svg, "text", {x: w - 70, y: 12}, `${((t1 - t0) / 1e6).toFixed(2)} s`);
  const byTrace = {};
  for (const s of data.spans) (byTrace[s.trace_id] = byTrace[s.trace_id] || []).push(s);
  rows.forEach((r, i) => {
    const y = top + i * rh, g = add(svg, "g", {class: "gantt-row", "data-trace": r.trace_id, "data-span": r.slow_span_id || "", style: "cursor:pointer"});
    add(g, "text", {x: 2, y: y + 11}, `${r.sample_key}/${r.rollout_n} · ${(r.latency_ms / 1e3).toFixed(2)} s`);
    add(g, "rect", {x: X(r.start_us), y: y + 2, width: Math.max(1, r.latency_ms * 1e3 / (t1 - t0) * (w - label - 10)), height: rh - 4, fill: TIME_COLORS.gap});
    for (const s of byTrace[r.trace_id] || []) {
      const slow = s.span_id === r.slow_span_id;
      const seg = add(g, "rect", {x: X(s.start_us), y: y + 2, width: Math.max(1, s.latency_ms * 1e3 / (t1 - t0) * (w - label - 10)), height: rh - 4,
        fill: TIME_COLORS[s.kind], class: "seg seg-" + s.kind + (slow ? " slow" : ""), stroke: slow ? "#dc2626" : "none", "stroke-width": slow ? 2 : 0});
      const tip = document.createElementNS(svg.namespaceURI, "title"); tip.textContent = `${s.kind} ${s.name} · ${(s.latency_ms / 1e3).toFixed(3)} s`; seg.append(tip);
    }
    const tip = document.createElementNS(svg.namespaceURI, "title");
    tip.textContent = `${(r.latency_ms / 1e3).toFixed(3)} s; slowest span: ${r.slow_span_kind || ""} ${r.slow_span_name || ""} ${r.slow_span_detail || ""}`; g.append(tip);
    g.addEventListener("click", () => {
      const s = (byTrace[r.trace_id] || []).find(x => x.span_id === r.slow_span_id);
      go("trajectory", {id: r.trace_id, step: data.step, ...(s ? {span: s.span_id} : {})});
    });
  });
  return svg;
}

async function timeView(p) {
  const validate = p.get("validate") === "true";
  const data = await api("timing", {validate, ...(p.get("step") ? {step: p.get("step")} : {}), top: p.get("top") || "100"});
  const curves = data.curves.filter(c => !!c.validate === validate), s = data.summary;
  const pick = step => go("time", {step, ...(validate ? {validate: "true"} : {})});
  const sel = $("select", {id: "time-step", on: {change: e => pick(e.target.value)}},
    curves.map(c => $("option", {value: c.step, ...(c.step === data.step ? {selected: ""} : {})}, `step ${c.step}`)));
  const pct = v => v === null || v === undefined ? "-" : `${Math.round(100 * v)}%`, sec = v => v === null || v === undefined ? "-" : `${(v / 1e3).toFixed(2)} s`;
  const facts = $("p", {id: "time-summary"}, `${data.count} trajectories; wall p50 ${sec(s.wall_p50_ms)}, p99 ${sec(s.wall_p99_ms)}; tail ratio p99/p50 `,
    $("b", {id: "tail-ratio"}, fmt(s.tail_ratio)), `; waited ${sec(s.tail_wait_ms)} for the last after p90; time in generate ${pct(s.generate_share)}, tools `,
    $("b", {id: "tool-share"}, pct(s.tool_share)), `, gaps ${pct(s.gap_share)}`,
    s.top_straggler_cause ? [`; top straggler cause: `, $("b", {id: "top-cause"}, s.top_straggler_cause)] : "");
  const legend = $("p", {class: "meta"}, $("span", {style: `background:${TIME_COLORS.generate};color:#fff;padding:0 4px`}, "generate"), " ",
    $("span", {style: `background:${TIME_COLORS.tool};color:#fff;padding:0 4px`}, "tool call"), " ",
    $("span", {style: `background:${TIME_COLORS.gap};padding:0 4px`}, "no span (gap)"), " · the slow span is outlined in red; ",
    `the ${data.trajectories.length} slowest of ${data.count}, on the step's time axis; click a bar to read its transcript at the slow span`);
  view.replaceChildren($("h2", {}, "Where the time went"), $("p", {}, $("label", {}, "step ", sel)),
    $("div", {class: "charts"}, timeCurve("tail ratio p99/p50", "tail_ratio", curves, data.step, pick), timeCurve("tool share", "tool_share", curves, data.step, pick)),
    facts, legend, gantt(data));
}

VIEWS.time = timeView;
