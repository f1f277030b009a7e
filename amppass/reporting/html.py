"""The report as one self-contained HTML page: inline CSS, JavaScript and SVG, nothing fetched.

The page has a summary, a strip of every node in graph order coloured by precision (hover for the
decision), a plot of observed value ranges against fp16's limits when the model was calibrated, and the
table of decisions, which the inline script makes sortable (click a header) and filterable (a link ending
in ``#filter=TEXT`` opens it filtered). Every row is in the HTML itself, so the page reads the same without
JavaScript.
"""

from __future__ import annotations

import math
import re
from html import escape

from ..text import shorten_names
from .rows import (
    LOCAL_ERROR,
    LOW_PRECISIONS,
    OUTPUT_ERROR,
    PRECISIONS,
    SCHEMA_VERSION,
    Row,
    Summarised,
    decision_order,
    finite,
    fp8_scales,
    summary_lines,
    target_phrase,
)

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 6.103515625e-05
COLOURS = {"fp8": "#9c36b5", "fp16": "#2f9e44", "bf16": "#1971c2", "fp32": "#e8590c", "-": "#adb5bd"}
_CELL, _PER_LINE = 14, 60  # node strip: cell size in px, cells per line
_LABEL = 34  # characters of a node name beside its bar in the range chart (220 px)

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#212529;background:#fff}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}
.muted{color:#6c757d}.cards{display:flex;flex-wrap:wrap;gap:10px;margin:14px 0}
.card{border:1px solid #dee2e6;border-radius:6px;padding:8px 12px;min-width:100px}
.card b{display:block;font-size:19px}.legend span{display:inline-block;margin-right:14px}
.sw{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:4px;vertical-align:-1px}
table{border-collapse:collapse;width:100%}th,td{border-bottom:1px solid #e9ecef;padding:4px 8px;text-align:left;vertical-align:top}
th{position:sticky;top:0;background:#f8f9fa;cursor:pointer;user-select:none;white-space:nowrap}
th[aria-sort=ascending]::after{content:" \\25B2"}th[aria-sort=descending]::after{content:" \\25BC"}
td.num{text-align:right;font-variant-numeric:tabular-nums}td.name,td.op{font-family:ui-monospace,monospace;font-size:12px}
.pill{border-radius:9px;padding:0 7px;color:#fff;font-size:12px}.controls{margin:8px 0;display:flex;gap:10px;align-items:center}
input,select{font:inherit;padding:3px 6px}svg text{font:11px system-ui,sans-serif;fill:#495057}
ul.summary{margin:6px 0;padding-left:20px}ul.terms{margin:6px 0;padding-left:20px;font-size:13px}
.card[title]{cursor:help}th[title]{text-decoration:underline dotted}
td.reason{min-width:24em}table.rollup{width:auto;margin-bottom:14px}
"""

_JS = """
(function(){
  var table=document.getElementById('rows'),body=table.tBodies[0],rows=Array.prototype.slice.call(body.rows);
  var text=document.getElementById('filter'),prec=document.getElementById('precision'),shown=document.getElementById('shown');
  function apply(){
    var q=text.value.toLowerCase(),p=prec.value,n=0;
    rows.forEach(function(r){
      var ok=(!p||r.dataset.precision===p)&&(!q||r.textContent.toLowerCase().indexOf(q)>=0);
      r.hidden=!ok;if(ok)n++;});
    shown.textContent=n+' of '+rows.length+' nodes shown';
  }
  function key(cell){var v=cell.dataset.sort;if(v===undefined)v=cell.textContent;
    var f=parseFloat(v);return (v!==''&&!isNaN(f)&&isFinite(v))?f:v.toLowerCase();}
  Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th,i){
    th.addEventListener('click',function(){
      var dir=th.getAttribute('aria-sort')==='ascending'?-1:1;
      Array.prototype.forEach.call(table.tHead.rows[0].cells,function(o){o.removeAttribute('aria-sort');});
      th.setAttribute('aria-sort',dir>0?'ascending':'descending');
      rows.sort(function(a,b){var x=key(a.cells[i]),y=key(b.cells[i]);
        if(typeof x!==typeof y){x=String(x);y=String(y);}return x<y?-dir:x>y?dir:0;});
      rows.forEach(function(r){body.appendChild(r);});
    });
  });
  var hash=/^#filter=(.*)$/.exec(location.hash);if(hash)text.value=decodeURIComponent(hash[1]);
  text.addEventListener('input',apply);prec.addEventListener('change',apply);apply();
  document.body.dataset.ready='1';
})();
"""


def render_html(report: Summarised, title: str | None = None) -> str:
    """The whole page as a string; ``title`` names the model (by default, its front end)."""
    info = report.info
    title = f"amppass report: {title or info.get('front_end', '')} to {info.get('dtype')}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f'<div class="muted" id="target">{escape(_target(report))} · amppass '
        f'{escape(str(info.get("amppass_version", "")))} · report schema {SCHEMA_VERSION}</div>',
        _cards(report),
        '<ul class="summary">' + "".join(f"<li>{escape(line)}</li>" for line in summary_lines(report)) + "</ul>",
        _terms(report),
        "<h2>Nodes in graph order</h2>",
        _legend(),
        _strip(report.rows),
        "<h2>Observed ranges against fp16's limits</h2>",
        _ranges(report),
        "<h2>By op and by reason</h2>",
        _rollups(report.rows),
        "<h2>Decisions</h2>",
        '<p class="muted">Heavy ops first (fp32 ones first, then by MACs), then the rest of the floating-point work '
        "(fp32 first), then nodes without floating-point work; sort by # for graph order.</p>",
        _table(report.rows),
        f"<script>{_JS}</script></body></html>",
    ]
    return "\n".join(parts)


def _target(report: Summarised) -> str:
    """What the plan was made for: dtype, mode, and the tolerance with the output error it reached."""
    info = report.info
    text = f"{target_phrase(info)}, {info.get('mode', 'inference')} mode"
    judged = info.get("target", {}).get("error_judged_by") if isinstance(info.get("target"), dict) else None
    limit, achieved = finite(info.get("tolerance")), finite(info.get("achieved_error"))
    if limit is not None:
        text += f", tolerance {limit:.2g} on the output error"
        if achieved is not None:
            text += f" (reached {achieved:.2g}{'' if info.get('tolerance_met', True) else ', not met'})"
        if isinstance(judged, str):
            text += f"; error judged by {judged}"
    return text


def _cards(report: Summarised) -> str:
    stats = report.stats()
    counts = stats["by_precision"]
    share = stats["macs"]["low_share"]
    before, after = stats["weight_bytes"]["before"], stats["weight_bytes"]["after"]
    cards: list[tuple[str, ...]] = [(str(report.info.get("dtype")), "target dtype")]
    cards += [(f"{counts.get(p, 0)}", f"{p} nodes") for p in PRECISIONS if p != "-" and counts.get(p)]
    cards += [
        ("-" if share is None else f"{share:.1%}",
         f"heavy compute in {report.info.get('dtype')}{' or fp8' * ('fp8' in counts)}"),
        (f"{stats['casts']}", "casts inserted"),
        ("-" if not before else f"{after / before:.2f}×", "weight bytes vs fp32"),
    ]
    limit, achieved = finite(report.info.get("tolerance")), finite(report.info.get("achieved_error"))
    if limit is not None and achieved is not None:  # a tolerance implies calibration
        met = report.info.get("tolerance_met", achieved <= limit)
        cards.append((f"{achieved:.2g}", f"output error, {'within' if met else 'over'} {limit:.2g}", OUTPUT_ERROR))
    else:
        cards.append(("yes" if stats["calibrated"] else "no", "calibrated"))
    if stats["moved_by_tolerance"] is not None:
        cards.append((f"{stats['moved_by_tolerance']}", "moved by tolerance"))
    body = "".join(
        f'<div class="card"{_title(card[2] if len(card) > 2 else "")}><b>{escape(card[0])}</b>'
        f'<span class="muted">{escape(card[1])}</span></div>' for card in cards
    )
    return f'<div class="cards">{body}</div>'


def _terms(report: Summarised) -> str:
    """The two error measures in words, where the page shows either."""
    shown = []
    if finite(report.info.get("tolerance")) is not None:
        shown.append(OUTPUT_ERROR)
    if any(row.local_error is not None for row in report.rows):
        shown.append(LOCAL_ERROR)
    if not shown:
        return ""
    return '<ul class="terms muted" id="terms">' + "".join(f"<li>{escape(text)}</li>" for text in shown) + "</ul>"


def _title(text: str) -> str:
    return f' title="{escape(text)}"' if text else ""


def _legend() -> str:
    items = "".join(
        f'<span><i class="sw" style="background:{COLOURS[p]}"></i>{escape(p if p != "-" else "no float work")}</span>'
        for p in PRECISIONS
    )
    return f'<div class="legend">{items}</div>'


def _strip(rows: list[Row]) -> str:
    """One square per node, ``_PER_LINE`` to a line, with the decision as its tooltip."""
    lines = max(1, math.ceil(len(rows) / _PER_LINE))
    width, height = _PER_LINE * _CELL, lines * _CELL
    cells = []
    for i, row in enumerate(rows):
        x, y = (i % _PER_LINE) * _CELL, (i // _PER_LINE) * _CELL
        tip = f"{row.name} · {row.op} · {row.precision} ({row.source}): {row.reason}"
        if row.local_error is not None:
            tip += f" · local error {row.local_error:.2g} (relative to the fp32 output's norm, no unit)"
        cells.append(
            f'<rect class="node" data-precision="{escape(row.precision)}" x="{x + 1}" y="{y + 1}" '
            f'width="{_CELL - 2}" height="{_CELL - 2}" rx="2" fill="{COLOURS.get(row.precision, "#000")}">'
            f"<title>{escape(tip)}</title></rect>"
        )
    return (
        f'<svg id="strip" role="img" aria-label="nodes coloured by precision" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">{"".join(cells)}</svg>'
    )


def _ranges(report: Summarised) -> str:
    """Per calibrated node, a bar from its smallest non-zero to its largest magnitude on a log axis."""
    observed = [(row, row.observed) for row in report.rows if row.observed is not None and row.observed[0] > 0]
    if not report.info.get("calibrated"):
        return '<p class="muted" id="ranges-note">Not calibrated: no observed ranges to plot. ' \
               "Convert with calibration data to see each node's range against fp16's limits.</p>"
    if not observed:
        return '<p class="muted" id="ranges-note">Calibrated, but no node recorded an observed range ' \
               "(absmax / min_nonzero evidence) to plot.</p>"
    values = [v for _, (hi, lo) in observed for v in (hi, lo) if v is not None and v > 0]
    lo_exp = math.floor(math.log10(min(values + [FP16_MIN_NORMAL]))) - 1
    hi_exp = math.ceil(math.log10(max(values + [FP16_MAX]))) + 1
    left, bar, width = 220, 12, 900
    plot_bottom = 22 + bar * len(observed)
    height = plot_bottom + 18

    def x(value: float) -> float:
        return left + (math.log10(value) - lo_exp) / (hi_exp - lo_exp) * (width - left - 10)

    # outside fp16's normal range: shaded, with the limits as dashed lines
    parts = [
        f'<rect x="{left}" y="18" width="{x(FP16_MIN_NORMAL) - left:.1f}" height="{plot_bottom - 18}" fill="#fff5f5"/>',
        f'<rect x="{x(FP16_MAX):.1f}" y="18" width="{width - 10 - x(FP16_MAX):.1f}" height="{plot_bottom - 18}" '
        'fill="#fff5f5"/>',
    ]
    step = 2 * max(1, math.ceil((hi_exp - lo_exp) / 20))  # at most about ten labels, whatever the span
    for exp in range(lo_exp, hi_exp + 1):
        parts.append(f'<line x1="{x(10**exp):.1f}" x2="{x(10**exp):.1f}" y1="18" y2="{plot_bottom}" stroke="#f1f3f5"/>')
        if exp % step == 0:
            parts.append(f'<text x="{x(10**exp):.1f}" y="12" text-anchor="middle">1e{exp}</text>')
    for limit, label in ((FP16_MIN_NORMAL, "fp16 min normal 6.1e-5"), (FP16_MAX, "fp16 max 65504")):
        parts.append(
            f'<line class="limit" x1="{x(limit):.1f}" x2="{x(limit):.1f}" y1="18" y2="{plot_bottom}" '
            f'stroke="#c92a2a" stroke-dasharray="4 3"><title>{label}</title></line>'
            f'<text x="{x(limit):.1f}" y="{plot_bottom + 13}" text-anchor="middle" style="fill:#c92a2a">{label}</text>'
        )
    labels = shorten_names([row.name for row, _ in observed], _LABEL)  # distinct, the layer index kept
    for i, ((row, (hi, lo)), label) in enumerate(zip(observed, labels, strict=False)):
        y = 22 + i * bar
        start, end = x(lo) if lo and lo > 0 else x(hi), x(hi)
        tip = f"{row.name} ({row.precision}): absmax {hi:.3g}" + (f", min non-zero {lo:.3g}" if lo else "")
        parts.append(f'<text x="{left - 6}" y="{y + bar - 3}" text-anchor="end">{escape(label)}'
                     f"<title>{escape(row.name)}</title></text>")
        parts.append(
            f'<rect class="range" x="{start:.1f}" y="{y + 2}" width="{max(end - start, 2):.1f}" height="{bar - 4}" '
            f'fill="{COLOURS.get(row.precision, "#000")}"><title>{escape(tip)}</title></rect>'
        )
    return (
        '<p class="muted">Each bar spans a node\'s smallest non-zero to largest output magnitude seen during '
        "calibration (log scale). Dashed lines: fp16's smallest normal value 6.1e-5 and its largest 65504; "
        "shaded: outside that range.</p>"
        '<div style="max-height:520px;overflow:auto">'
        f'<svg id="ranges" role="img" aria-label="observed ranges, log scale" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">{"".join(parts)}</svg></div>'
    )


def _table(rows: list[Row]) -> str:
    options = "".join(f'<option value="{escape(p)}">{escape(p)}</option>' for p in PRECISIONS)
    controls = (
        '<div class="controls"><input id="filter" type="search" placeholder="filter: node, op, reason…">'
        f'<select id="precision"><option value="">all precisions</option>{options}</select>'
        f'<span id="shown" class="muted">{len(rows)} nodes</span></div>'
    )
    with_local = any(row.local_error is not None for row in rows)
    headers = ["#", "node", "op", "precision", "source", "casts in", "MACs", "absmax"]
    headers += ["local error"] * with_local + ["reason"]
    tips = {"local error": LOCAL_ERROR, "absmax": "largest magnitude of the node's output seen during calibration"}
    head = "".join(f"<th{_title(tips.get(h, ''))}>{h}</th>" for h in headers)
    body = []
    for i in decision_order(rows):
        row = rows[i]
        macs, absmax, local = row.macs, row.observed[0] if row.observed else None, row.local_error
        colour = COLOURS.get(row.precision, "#000")
        pill = (f'<span class="pill" style="background:{colour}"{_title(fp8_scales(row))}>'
                f'{escape(row.precision)}</span>')
        low = "1" if row.precision in LOW_PRECISIONS else "0"
        numbers = _number(macs, f"{macs:,}" if macs is not None else "") + \
            _number(absmax, f"{absmax:.3g}" if absmax is not None else "")
        if with_local:
            numbers += _number(local, f"{local:.2g}", LOCAL_ERROR) if local is not None else _number(None, "")
        body.append(
            f'<tr data-precision="{escape(row.precision)}" data-low="{low}"><td class="num">{i}</td>'
            f'<td class="name">{_breakable(row.name)}</td><td class="op">{_breakable(row.op)}</td>'
            f'<td data-sort="{escape(row.precision)}">{pill}</td><td>{escape(row.source)}</td>'
            f'<td class="name">{_breakable(", ".join(row.casts))}</td>{numbers}'
            f'<td class="reason">{escape(row.reason)}</td></tr>'
        )
    return f'{controls}<table id="rows"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _rollups(rows: list[Row]) -> str:
    """Two small tables, the most MACs first, then the most nodes: per op, its nodes in each precision and its
    MACs; per reason (the precision and the rule that decided it), its nodes, MACs and the reason on one node."""
    present = [p for p in PRECISIONS if any(row.precision == p for row in rows)]
    by_op: dict[str, list[Row]] = {}
    by_reason: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        by_op.setdefault(row.op, []).append(row)
        by_reason.setdefault((row.precision, row.rule or row.source), []).append(row)
    ops = [(f'<td class="op">{_breakable(op)}</td>', "".join(_count(sum(r.precision == p for r in group))
                                                             for p in present), group)
           for op, group in by_op.items()]
    reasons = [(f"<td>{escape(precision)}</td><td>{escape(rule)}</td>",
                f'<td class="reason">{escape(group[0].reason)}</td>', group)
               for (precision, rule), group in by_reason.items()]
    return (_rollup("by-op", ["op", "nodes", "MACs", *present], ops)
            + _rollup("by-reason", ["precision", "rule", "nodes", "MACs", "a reason, on one node"], reasons))


def _rollup(ident: str, headers: list[str], groups: list[tuple[str, str, list[Row]]]) -> str:
    """A rollup table: per group its leading cells, its nodes and MACs, then its trailing cells."""
    def macs(group: list[Row]) -> int:
        return sum(row.macs or 0 for row in group)

    body = "".join(f"<tr>{lead}{_count(len(group))}{_count(macs(group))}{trail}</tr>"
                   for lead, trail, group in sorted(groups, key=lambda g: (-macs(g[2]), -len(g[2]))))
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    return f'<table id="{ident}" class="rollup"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _count(n: int) -> str:
    return _number(n, f"{n:,}" if n else "")


def _breakable(text: str) -> str:
    """``text`` escaped, with line-break opportunities after the separators of node and op names, so a
    long name wraps at "/", "." or "_" instead of in the middle of a word."""
    return re.sub(r"([/._])", r"\1<wbr>", escape(text))


def _number(value: float | None, text: str, title: str = "") -> str:
    """A right-aligned cell showing ``text`` that sorts by ``value`` (empty when None)."""
    return f'<td class="num" data-sort="{"" if value is None else value}"{_title(title)}>{escape(text)}</td>'
