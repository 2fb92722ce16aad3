"""The HTML shell of the report: inline CSS, the transcript viewer (inline JS), embedded data."""

from __future__ import annotations

import json
from html import escape
from typing import Any

from tracer.readers.svg import CSS as SVG_CSS

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;background:#f8fafc;color:#111}
main{max-width:1180px;margin:0 auto;padding:16px 24px}
h1{font-size:22px;margin:8px 0} h2{font-size:17px;margin:0 0 8px}
section{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:14px;margin:14px 0}
.meta{color:#444} .charts{display:flex;flex-wrap:wrap;gap:8px}
.chart{border:1px solid #f1f5f9;border-radius:6px}
table{border-collapse:collapse;font-size:13px;margin-top:6px}
th,td{border:1px solid #e5e7eb;padding:3px 7px;text-align:right}
th{background:#f1f5f9} td.prompt{text-align:left;max-width:420px;color:#333}
table.groups td.cell{cursor:pointer;min-width:38px;text-align:center}
table.groups td.cell:hover{outline:2px solid #2563eb}
tr.zero td.flag{color:#b45309;font-weight:600;text-align:left}
details{margin:4px 0} summary{cursor:pointer;font-weight:600}
#transcript .msg{border-left:4px solid #cbd5e1;margin:6px 0;padding:4px 10px;background:#f8fafc}
#transcript .role{font-weight:600;font-size:12px;color:#475569}
#transcript .assistant{border-color:#2563eb} #transcript .tool{border-color:#16a34a}
#transcript .err{border-color:#dc2626;background:#fef2f2} #transcript .user{border-color:#9333ea}
#transcript pre{white-space:pre-wrap;word-break:break-word;margin:2px 0;font:12px monospace}
#transcript .reward{font-size:15px;font-weight:600;margin-top:8px}
select{font-size:13px;max-width:100%}
#transcript .toks{white-space:pre-wrap;word-break:break-word;font:12px/1.7 monospace;margin:2px 0}
#transcript .tok{border-radius:2px;cursor:default} #transcript .tok:hover{outline:1px solid #111}
#transcript .tok.none{background:#e5e7eb}
.top{margin-right:18px} .top td:first-child{text-align:left} .top a{color:#1d4ed8}
svg.heatmap{display:block;margin:6px 0 12px} .kl-map{overflow-x:auto}
h3{font-size:15px;margin:12px 0 4px} td.prompt code{white-space:pre-wrap;word-break:break-word}
.label{background:#fee2e2;color:#991b1b;border-radius:4px;padding:0 5px;font-size:12px}
.label{white-space:nowrap}
"""

JS = """
const DATA = JSON.parse(document.getElementById('transcripts').textContent);
const byId = new Map(DATA.map(t => [t.id, t]));
const sel = document.getElementById('pick');
for (const t of DATA) {
  const o = document.createElement('option');
  o.value = t.id;
  o.textContent = `step ${t.step} · sample ${t.sample} · rollout ${t.n} · reward ${t.reward}`
    + (t.validate ? ' · validation' : '');
  sel.appendChild(o);
}
function el(tag, cls, text) {
  const e = document.createElement(tag); if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text; return e;
}
// chat-template tokens (<|im_end|>, <|eot_id|>...) are hidden unless asked for
const SPECIAL = /<\\|[A-Za-z0-9_.:-]{1,40}\\|>/g;
const special = document.getElementById('show-special');
function clean(text) {
  if (text == null) return '';
  const s = String(text);
  return special && special.checked ? s : s.replace(SPECIAL, '');
}
function block(cls, role, text) {
  const d = el('div', 'msg ' + cls); d.appendChild(el('div', 'role', role));
  d.appendChild(el('pre', '', clean(text))); return d;
}
const META = JSON.parse(document.getElementById('token-meta').textContent);
const STOPS = [[255,255,255],[254,230,140],[253,141,60],[227,26,28],[128,0,38]];
function heat(t) {  // the same scale as the heatmap (svg.heat_color)
  t = Math.max(0, Math.min(1, t)) * (STOPS.length - 1);
  const i = Math.min(Math.floor(t), STOPS.length - 2), f = t - i;
  return 'rgb(' + STOPS[i].map((a, k) => Math.round(a + (STOPS[i + 1][k] - a) * f)) + ')';
}
function tokenBlock(head, toks) {
  const metric = tokSel.value, m = META.metrics[metric];
  const col = 1 + META.fields.indexOf(metric);
  const d = el('div', 'msg assistant');
  d.appendChild(el('div', 'role', `${head} · coloured by ${m.label}`));
  const line = el('div', 'toks');
  for (const t of toks) {
    if (!(special && special.checked) && typeof t[0] === 'string' && t[0].match(SPECIAL)
        && t[0].replace(SPECIAL, '') === '') continue;
    const v = t[col];
    const s = el('span', v == null ? 'tok none' : 'tok', t[0]);
    if (v != null) {
      const x = v * m.sign / m.vmax;
      s.style.background = heat(x); if (x > 0.6) s.style.color = '#fff';
    }
    s.title = META.fields.map((f, k) => `${f}: ${t[k + 1] ?? '-'}`).join('\\n');
    line.appendChild(s);
  }
  d.appendChild(line); return d;
}
function show(id) {
  const t = byId.get(id); const box = document.getElementById('transcript');
  box.innerHTML = ''; if (!t) { box.textContent = 'not in this report'; return; }
  sel.value = id;
  box.appendChild(el('div', 'meta', `trace ${t.id} · step ${t.step} · sample ${t.sample}`
    + ` · rollout ${t.n} · finish ${t.finish}`));
  for (const m of t.messages) {
    const c = typeof m.content === 'string' ? m.content : JSON.stringify(m.content);
    box.appendChild(block(m.role || 'user', m.role || 'message', c));
  }
  for (const e of t.events) {
    if (e.type === 'assistant') {
      const head = `assistant (${e.tokens ?? '?'} tokens, ${e.finish})`;
      box.appendChild(e.toks && tokSel ? tokenBlock(head, e.toks) : block('assistant', head,
        e.text));
    } else {
      const err = e.error != null;
      box.appendChild(block(err ? 'tool err' : 'tool', `tool ${e.name}(${e.args ?? ''})`,
        err ? 'error: ' + e.error : e.result));
    }
  }
  box.appendChild(el('div', 'reward', `reward: ${t.reward}`));
}
sel.addEventListener('change', () => show(sel.value));
if (special) special.addEventListener('change', () => show(sel.value));
document.querySelectorAll('[data-trace]').forEach(node => node.addEventListener('click', ev => {
  ev.preventDefault();
  show(node.dataset.trace);
  document.getElementById('viewer').scrollIntoView({behavior: 'smooth'});
}));
document.querySelectorAll('a.flag-link').forEach(a => a.addEventListener('click', () => {
  history.replaceState(null, '', '#t-' + a.dataset.trace);  // shown by the handler above
}));
const kl = document.getElementById('kl-metric');
if (kl) kl.addEventListener('change', () => document.querySelectorAll('.kl-map').forEach(
  d => { d.hidden = d.dataset.metric !== kl.value; }));
const tokSel = document.getElementById('tok-metric');
if (tokSel) tokSel.addEventListener('change', () => show(sel.value));
const linked = location.hash.startsWith('#t-') ? location.hash.slice(3) : null;
if (linked && byId.has(linked)) show(linked); else if (DATA.length) show(DATA[0].id);
"""


def _script_json(data: Any) -> str:
    # "</" would end the <script> element early
    return json.dumps(data, ensure_ascii=False, default=str).replace("</", "<\\/")


def page(
    title: str, body: str, transcripts: list[dict[str, Any]],
    token_meta: dict[str, Any] | None = None,
) -> str:  # fmt: skip
    """The whole page. ``token_meta`` (:func:`tracer.readers.token_report.token_panels`): the
    metrics the transcript can colour tokens by; none, no token colouring."""
    meta = token_meta or {"fields": [], "metrics": {}}
    options = "".join(
        f'<option value="{escape(k)}">{escape(v["label"])}</option>'
        for k, v in meta["metrics"].items()
    )
    colour = f' Colour tokens by <select id="tok-metric">{options}</select>' if options else ""
    viewer = (
        f'<section id="viewer"><h2>Transcript</h2><select id="pick"></select>{colour}'
        ' <label><input type="checkbox" id="show-special"> show special tokens '
        "(<code>&lt;|im_end|&gt;</code>...)</label>"
        f"<p class=meta>{len(transcripts)} trajectories embedded.</p>"
        '<div id="transcript"></div></section>'
    )
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{escape(title)}</title><style>{CSS}{SVG_CSS}</style></head><body><main>"
        f"<h1>{escape(title)}</h1>{body}{viewer}</main>"
        f'<script type="application/json" id="transcripts">{_script_json(transcripts)}</script>'
        f'<script type="application/json" id="token-meta">{_script_json(meta)}</script>'
        f"<script>{JS}</script></body></html>"
    )
