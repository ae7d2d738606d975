"""The rollout viewer: one rollout dump → one self-contained HTML page, token by token.

Shows what nanorl/dump.py wrote about links 1-4 of the chain (rollout, reward, logprob recompute,
advantage), sample by sample:

    python train.py --dump-rollouts 10
    python -m nanorl.viewer runs/nanorl/rollouts/step_000010.jsonl -o view.html

The page groups the samples by prompt, sorts them by reward or length, and draws each response as its
tokens, coloured by a per-token field you choose (entropy, advantage, |trainer − rollout logprob|, either
logprob); hovering a token shows all its values; tokens outside the loss mask are dimmed. When the run's
metrics.jsonl lies beside the rollouts folder, its curves (nanorl/logger.py plot) are embedded as a PNG.
Start at `render`; a dump cut mid-line (a run killed while writing it) opens without that line
(nanorl/dump.py `read`). Key choices: one file, no server, no network, no external script; rollout text is
untrusted, so the page is built to be safe against it (how: `render`'s docstring).

Test (headless Chromium): python -m pytest tests/test_viewer.py -q
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os

from nanorl.dump import DumpError, read

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;background:#f6f6f4;color:#222}
header{position:sticky;top:0;background:#fff;border-bottom:1px solid #ddd;padding:8px 16px;z-index:2}
header h1{font-size:16px;margin:0 0 4px}
header label{margin-right:14px}
main{padding:8px 16px}
.group{background:#fff;border:1px solid #ddd;border-radius:6px;margin:10px 0;padding:8px 12px}
.prompt{white-space:pre-wrap;font-family:ui-monospace,monospace;background:#eef2f7;padding:4px 8px;
 border-radius:4px}
.meta{color:#666;font-size:12px;margin:4px 0}
.sample{border-top:1px dashed #e3e3e3;padding:3px 0;display:flex;gap:12px;align-items:baseline}
.badge{min-width:250px;font-size:12px;color:#555}
.badge b{font-size:14px}
.resp{font:15px ui-monospace,monospace;white-space:pre-wrap;word-break:break-all;flex:1}
.tok{border-radius:2px;padding:0 1px;margin:0 1px 0 0;cursor:default}
.tok.off{opacity:.45;text-decoration:underline dotted}
#tip{position:fixed;display:none;background:#222;color:#fff;font:12px ui-monospace,monospace;
 padding:6px 8px;border-radius:4px;white-space:pre;pointer-events:none;z-index:3}
.legend{display:inline-block;width:160px;height:10px;vertical-align:middle;margin:0 6px}
img.curves{max-width:100%;border:1px solid #ddd;background:#fff}
"""

SCRIPT = """
const D = JSON.parse(document.getElementById('data').textContent);
const FIELDS = {entropy: 'entropy', advantage: 'advantage', gap: '|trainer - rollout logprob|',
                rollout_logprob: 'rollout logprob', trainer_logprob: 'trainer logprob'};
const $ = (tag, cls, text) => { const e = document.createElement(tag); if (cls) e.className = cls;
  if (text !== undefined) e.textContent = String(text); return e; };
const fmt = v => v === null || v === undefined ? 'n/a'
  : (Math.abs(v) >= 100 ? v.toFixed(0) : v.toPrecision(3));
function values(s, f) {
  const t = s.tokens;
  if (f === 'gap') return t.id.map((_, i) => t.trainer_logprob && t.rollout_logprob &&
      t.trainer_logprob[i] !== null && t.rollout_logprob[i] !== null
      ? Math.abs(t.trainer_logprob[i] - t.rollout_logprob[i]) : null);
  return t[f] || t.id.map(() => null);
}
function scale(f) {  // colour of one value: diverging for advantage, sequential for the rest
  const all = D.samples.flatMap(s => values(s, f)).filter(v => v !== null);
  const hi = Math.max(1e-12, ...all.map(Math.abs));
  if (f === 'advantage') return v => v === null ? '' : (v >= 0
    ? `rgba(46,140,60,${Math.min(1, v / hi) * .75})`
    : `rgba(200,40,40,${Math.min(1, -v / hi) * .75})`);
  const lo = Math.min(...all), top = Math.max(...all), span = Math.max(1e-12, top - lo);
  return v => v === null ? '' : `rgba(230,120,0,${((v - lo) / span) * .8})`;
}
const tip = document.getElementById('tip');
function hover(e, s, i) {
  const t = s.tokens, lines = [`token ${i}: ${JSON.stringify(t.text[i])} (id ${t.id[i]})`];
  for (const k of ['rollout_logprob', 'trainer_logprob', 'entropy', 'advantage'])
    lines.push(`${k.padEnd(16)} ${t[k] ? fmt(t[k][i]) : 'n/a'}`);
  lines.push(`${'loss_mask'.padEnd(16)} ${t.loss_mask[i]}`);
  lines.push(`${'|gap|'.padEnd(16)} ${fmt(values(s, 'gap')[i])}`);
  tip.textContent = lines.join('\\n'); tip.style.display = 'block';
  tip.style.left = Math.min(e.clientX + 12, innerWidth - 320) + 'px'; tip.style.top = (e.clientY + 14) + 'px';
}
function render() {
  const f = document.getElementById('field').value, order = document.getElementById('sort').value;
  const color = scale(f), main = document.getElementById('samples');
  const key = s => order.startsWith('reward') ? (s.reward ?? -Infinity) : s.tokens.id.length;
  const sign = order.endsWith('desc') ? -1 : 1, by = (a, b) => sign * (a - b);
  const groups = new Map();
  for (const s of D.samples) {
    if (!groups.has(s.group)) groups.set(s.group, []);
    groups.get(s.group).push(s);
  }
  let list = [...groups.values()];
  const mean = g => g.reduce((a, s) => a + key(s), 0) / g.length;
  if (order !== 'index') {
    list.forEach(g => g.sort((a, b) => by(key(a), key(b))));
    list.sort((a, b) => by(mean(a), mean(b)));
  }
  main.replaceChildren();
  for (const g of list) {
    const box = $('section', 'group'), rs = g.map(s => s.reward ?? 0);
    box.append($('div', 'meta', `group ${g[0].group} · ${g.length} samples · mean reward ` +
                                `${fmt(rs.reduce((a, b) => a + b, 0) / g.length)}`),
               $('div', 'prompt', g[0].prompt));
    for (const s of g) {
      const row = $('div', 'sample'), badge = $('div', 'badge'), resp = $('div', 'resp'), v = values(s, f);
      badge.append($('b', '', `reward ${fmt(s.reward)}`),
                   $('span', '', ` · ${s.status} · ${s.tokens.id.length} tokens · v${s.weight_version}`));
      for (const [k, x] of Object.entries(s.reward_components || {}))
        badge.append($('br'), $('span', '', `${k}: ${fmt(x)}`));
      s.tokens.text.forEach((piece, i) => {
        const t = $('span', 'tok' + (s.tokens.loss_mask[i] ? '' : ' off'), piece);
        t.style.backgroundColor = color(v[i]);
        t.addEventListener('mousemove', e => hover(e, s, i));
        t.addEventListener('mouseleave', () => { tip.style.display = 'none'; });
        resp.append(t);
      });
      row.append(badge, resp); box.append(row);
    }
    main.append(box);
  }
  document.getElementById('legend-lo').textContent = f === 'advantage' ? 'negative' : 'low';
  document.getElementById('legend-hi').textContent = f === 'advantage' ? 'positive' : 'high';
  document.getElementById('legend').style.background = f === 'advantage'
    ? 'linear-gradient(90deg, rgba(200,40,40,.75), #fff, rgba(46,140,60,.75))'
    : 'linear-gradient(90deg, #fff, rgba(230,120,0,.8))';
}
const sel = document.getElementById('field');
for (const [k, label] of Object.entries(FIELDS)) {
  const o = $('option', '', label); o.value = k; sel.append(o);
}
sel.value = D.samples.some(s => s.tokens.entropy) ? 'entropy' : 'rollout_logprob';
sel.addEventListener('change', render);
document.getElementById('sort').addEventListener('change', render);
const n = D.samples.length, tok = D.samples.reduce((a, s) => a + s.tokens.id.length, 0);
const r = D.samples.reduce((a, s) => a + (s.reward ?? 0), 0) / Math.max(1, n);
document.getElementById('summary').textContent =
  `${D.source} · step ${D.step} · ${n} samples · ${tok} tokens · mean reward ${fmt(r)}`;
render();
"""

PAGE = """<!doctype html>
<html><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy"
 content="default-src 'none'; img-src data:; style-src 'sha256-{style_hash}';
 script-src 'sha256-{script_hash}'">
<title>nanorl rollouts</title><style>{style}</style></head>
<body><header><h1>nanorl rollouts</h1><div id="summary" class="meta"></div>
<label>colour by <select id="field"></select></label>
<label>sort <select id="sort"><option value="index">as sampled</option>
<option value="reward-desc">reward, high first</option>
<option value="reward-asc">reward, low first</option><option value="length-desc">length, long first</option>
<option value="length-asc">length, short first</option></select></label>
<span id="legend-lo"></span><span id="legend" class="legend"></span><span id="legend-hi"></span>
<span class="meta"> · dimmed: outside the loss mask · hover a token for its values</span></header>
<main>{curves}<div id="samples"></div></main><div id="tip"></div>
<script type="application/json" id="data">{data}</script>
<script>{script}</script></body></html>
"""


def _sha256(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode()


def safe_json(obj) -> str:
    """JSON that cannot end a <script> block or open a tag: <, >, & and the JS line separators escaped."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    for ch, esc in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"), ("\u2028", "\\u2028"),
                    ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text


def render(records: list[dict], source: str = "", curves_png: bytes | None = None) -> str:
    """The whole page for these dump records (nanorl/dump.py format); curves_png: PNG bytes or None.

    Tokens outside the loss mask (environment output, filtered rows) are dimmed; the curves PNG is written
    beside the page and embedded. One file, no server, no network, no external script: inline CSS and JS,
    the data in a `<script type="application/json">` block. Rollout text is untrusted (model output, user
    data): the JSON has `<`, `>`, `&`, U+2028/2029 escaped as \\u003c etc. (no string can close the block or
    open a tag), the page builds every element with createElement and writes every string with textContent
    (never innerHTML), and a Content-Security-Policy admits only the page's own script and style by hash, so
    even an injected element could not run. Hand-written (~100 lines of JS): the dashboards that exist
    (TensorBoard, W&B tables) need a server or an account, and none colours tokens.
    """
    if not records:
        raise DumpError(f"{source or 'records'}: no samples to show")
    steps = sorted({r.get("step") for r in records}, key=str)
    data = {"source": os.path.basename(source), "step": ", ".join(map(str, steps)), "samples": records}
    curves = ""
    # the PNG's own bytes: base64 only, nothing from the data
    if curves_png is not None:
        curves = ('<details><summary>training curves (metrics.jsonl)</summary><img class="curves" '
                  'alt="training curves" '
                  f'src="data:image/png;base64,{base64.b64encode(curves_png).decode()}"></details>')
    return PAGE.format(style=STYLE, script=SCRIPT, style_hash=_sha256(STYLE), script_hash=_sha256(SCRIPT),
                       curves=curves, data=safe_json(data))


def write(jsonl: str, out: str, curves: bool = True) -> tuple[str, str | None]:
    """Read a dump, write the page (and the run's curves PNG beside it when its metrics.jsonl is found
    next to the rollouts folder). Returns (page path, PNG path or None)."""
    metrics = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(jsonl))), "metrics.jsonl")
    png = None
    if curves and os.path.exists(metrics):
        # only when there is something to plot
        import matplotlib.pyplot as plt

        from nanorl.logger import plot
        png = os.path.splitext(out)[0] + "_curves.png"
        plt.close(plot(metrics, png))
    page = render(read(jsonl), jsonl, open(png, "rb").read() if png else None)
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    return out, png


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Rollout dump (nanorl/dump.py) → one self-contained HTML page.")
    ap.add_argument("dump", help="a rollouts/step_NNNNNN.jsonl written by train.py --dump-rollouts")
    ap.add_argument("-o", "--out", default="view.html", help="the HTML file to write (default view.html)")
    ap.add_argument("--no-curves", action="store_true",
                    help="skip the curves PNG even if metrics.jsonl is found")
    a = ap.parse_args(argv)
    try:
        page, png = write(a.dump, a.out, curves=not a.no_curves)
    # a missing or damaged dump is the user's input: one line, exit status 2 (argparse's convention)
    except (DumpError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    print(f"wrote {page}" + (f" and {png}" if png
                             else " (no metrics.jsonl beside the rollouts folder: no curves)"))


if __name__ == "__main__":
    main()
