// The explorer's Patterns tab (#/patterns): /api/patterns drawn as the ranked patterns of a
// step, their share over the run, and the run's flagged patterns with their evidence. Loaded
// before explore.html's own script, whose globals ($, api, view, go, fmt, ...) it uses when
// the tab is opened; explore.html's VIEWS names patternsView.
const pct = v => v === null || v === undefined ? "-" : (100 * v).toFixed(1) + " %";
async function patternsView(p) {
  let data;
  try { data = await api("patterns", p.get("step") ? {step: p.get("step")} : {}); } catch (e) {
    if (e === STALE || !/being computed/.test(e.message)) throw e;  // computed once per export: wait for it
    view.replaceChildren($("p", {id: "patterns-busy", class: "flag"}, e.message)); const seq = renderSeq;
    setTimeout(() => { if (seq === renderSeq) render(); }, 1000); return; }
  if (!data.steps.length) { view.replaceChildren($("p", {class: "meta"}, "no training steps with behaviour signatures")); return; }
  const label = $("b", {id: "step-label"}, `step ${data.step}`), last = data.steps.length - 1;
  const slider = $("input", {type: "range", id: "step-slider", min: 0, max: last, step: 1, value: data.steps.indexOf(data.step), style: "width:420px",
    on: {input: e => { label.textContent = `step ${data.steps[e.target.value]}`; }, change: e => go("patterns", {step: data.steps[e.target.value]})}});
  const list = (sig, step) => "#/list?" + new URLSearchParams({[/^[0-9a-f]{16}$/.test(sig) ? "signature" : "behaviour"]: sig, validate: "false", ...(step === undefined ? {} : {step: `${step}:${step}`})});
  const labels = xs => xs.map(x => $("span", {class: "flag label" + (x === "rising" ? "" : " hack")}, x));
  const head = ["#", "share", "n", "reward ± spread", "correct", "mean length", "tool errors", "share over steps", "pattern", "trajectories"];
  const rows = data.patterns.map(q => $("tr", {class: "pattern", "data-signature": q.signature},
    $("td", {}, q.rank), $("td", {class: "share", style: "white-space:nowrap"}, pct(q.share)), $("td", {}, q.n), $("td", {style: `background:${rewardColor(q.reward_mean)}`}, `${fmt(q.reward_mean)} ± ${fmt(q.reward_std)}`),
    $("td", {class: "correct"}, q.correct_mean === null ? "not checked" : fmt(q.correct_mean)),
    $("td", {}, q.mean_length === null ? "-" : Math.round(q.mean_length)), $("td", {}, pct(q.tool_error_rate)), $("td", {}, shareChart(q.curve, data.step, 170, 34)),
    $("td", {class: "labels"}, labels(q.labels), q.reason ? $("div", {class: "reason"}, q.reason) : "", q.why ? $("div", {class: "meta why"}, q.why) : "", $("code", {class: "sig"}, q.text),
      q.template && q.template !== q.text ? $("div", {class: "meta template"}, "e.g. ", $("code", {}, q.template)) : ""),
    $("td", {}, $("a", {class: "example", href: "#/trajectory?" + new URLSearchParams({id: q.example, step: data.step})}, "example"), " · ",
      $("a", {class: "all", href: list(q.signature, data.step)}, `these ${q.n}`), " · ", $("a", {href: list(q.signature)}, "every step"))));
  view.replaceChildren($("p", {id: "hacking-summary", class: "flag"}, data.summary), data.note ? $("p", {id: "top-note", class: "meta"}, data.note) : "",
    $("div", {class: "filters"}, label, " ", slider, $("span", {class: "meta"}, ` steps ${data.steps[0]}–${data.steps[last]}: the policy's habits at each step, by share of its trajectories`)),
    $("table", {id: "patterns"}, $("thead", {}, $("tr", {}, head.map(h => $("th", {}, h)))), $("tbody", {}, rows)), $("h3", {}, "Flagged patterns of the run"));
  if (!data.rising.length) view.append($("p", {id: "no-rising", class: "meta"}, "none"));
  const side = (name, t) => t ? $("span", {class: name}, `${name}: `, $("a", {href: "#/trajectory?" + new URLSearchParams({id: t.trace_id, step: t.step})}, t.trace_id.slice(0, 8)),
    ` (step ${t.step}, reward ${fmt(t.reward)}, correctness ${fmt(t.correct)})`) : $("span", {class: name}, "no earned trajectory of this prompt");
  const pair = p => !p ? "" : $("div", {class: "pair"}, "side by side: ", side("flagged", p.flagged), " · ", side("earned", p.earned),
    p.same_group ? [" · ", $("a", {class: "group-link", href: "#/group?" + new URLSearchParams({step: p.flagged.step, validate: "false", sample: p.flagged.sample_key})}, "their GRPO group, side by side")] : "");
  for (const r of data.rising) view.append($("div", {class: "rising", "data-signature": r.signature},
    $("div", {}, $("b", {}, `#${r.rank} `), labels(r.labels), ` flagged at steps ${r.hacking_step ?? r.first_step}–${r.last_step}; peak ${pct(r.peak_share)} at step ${r.peak_step} · `,
      $("a", {href: "#/trajectory?" + new URLSearchParams({id: r.example, step: r.last_step})}, "example"), " · ", $("a", {href: list(r.signature)}, "its trajectories")),
    shareChart(r.curve, data.step, 520, 90), r.why ? $("div", {class: "why"}, "rising: " + r.why) : "",
    r.reason ? $("div", {class: "reason"}, "possible reward hacking: " + r.reason) : "", r.note ? $("div", {class: "note meta"}, r.note) : "", pair(r.pair), $("code", {class: "sig"}, r.text)));
  view.append($("p", {class: "meta", id: "rules"}, data.rules));
}
// a pattern's share of each step's trajectories, the slider's step marked
function shareChart(curve, at, w, h) {
  const ns = "http://www.w3.org/2000/svg", svg = document.createElementNS(ns, "svg"), top = Math.max(...curve.map(c => c[1]), 0.01);
  svg.setAttribute("width", w); svg.setAttribute("height", h); svg.setAttribute("class", "share-chart");
  const x0 = curve[0][0], x1 = curve[curve.length - 1][0], X = s => 2 + (x1 > x0 ? (s - x0) / (x1 - x0) : 0.5) * (w - 4), Y = v => h - 2 - v / top * (h - 12);
  const add = (tag, a, text) => { const e = document.createElementNS(ns, tag); for (const [k, v] of Object.entries(a)) e.setAttribute(k, v); if (text) e.textContent = text; svg.append(e); return e; };
  add("line", {x1: X(at), x2: X(at), y1: 0, y2: h, stroke: "#f59e0b"});
  add("polyline", {points: curve.map(c => `${X(c[0])},${Y(c[1])}`).join(" "), fill: "none", stroke: "#4f46e5", "stroke-width": 1.5});
  add("text", {x: 2, y: 9}, `max ${pct(top)}`);
  add("title", {}, curve.map(c => `step ${c[0]}: ${pct(c[1])}`).join("\n"));
  return svg;
}
