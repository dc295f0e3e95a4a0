"""The report as one self-contained HTML page: plotly.js inlined (from the plotly package on PyPI), so it
opens anywhere with no network; the same charts as the PNGs, and the summary table."""

from __future__ import annotations

import html
import json
from pathlib import Path

from p2pdiloco.ops.report.charts import COLUMNS, Chart, cell

# Script errors on the page are kept where a reader (or a headless browser's test) can see them.
ERROR_TRAP = """window.reportErrors = [];
window.addEventListener("error", function (e) {
  window.reportErrors.push(String(e.message));
  document.documentElement.setAttribute("data-script-errors", window.reportErrors.join(" | "));
});"""

STYLE = """body { font-family: system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 16px; margin: 0 0 4px; }
table { border-collapse: collapse; font-size: 13px; margin-bottom: 24px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; } th { background: #f3f3f3; }
td:first-child, td:nth-child(2) { text-align: left; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 16px; }
.chart { border: 1px solid #e3e3e3; padding: 8px; } .plot { height: 400px; }"""


def _figure(chart: Chart) -> dict:
    mode = "markers" if chart.markers_only else "lines+markers"
    traces = [dict(type="scatter", mode=mode, name=s.label, x=s.x, y=s.y, marker=dict(size=5 if chart.markers_only else 3))
              for s in chart.series]
    layout = dict(margin=dict(l=60, r=10, t=10, b=40), xaxis=dict(title=dict(text=chart.xlabel)),
                  yaxis=dict(title=dict(text=chart.ylabel)),
                  legend=dict(font=dict(size=10), orientation="h", y=-0.2), template="plotly_white")
    if not chart.series:
        layout["annotations"] = [dict(text="no data in these logs", showarrow=False, xref="paper", yref="paper",
                                      x=0.5, y=0.5)]
    return dict(data=traces, layout=layout)


def _table(rows: list[dict]) -> str:
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title, _ in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell(row, key, fmt))}</td>" for key, _, fmt in COLUMNS)
                   + "</tr>" for row in rows)
    return f"<table id='summary'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render(charts: list[Chart], rows: list[dict], title: str) -> str:
    from plotly.offline import get_plotlyjs

    sections, calls = [], []
    for chart in charts:
        sections.append(f"<section class='chart' data-chart='{chart.key}'><h2>{html.escape(chart.title)}</h2>"
                        f"<div class='plot' id='chart-{chart.key}'></div></section>")
        figure = json.dumps(_figure(chart)).replace("</", "<\\/")  # labels cannot end the script element
        calls.append(f"Plotly.newPlot('chart-{chart.key}', {figure}.data, {figure}.layout, "
                     "{displaylogo: false, responsive: true});")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<script>{ERROR_TRAP}</script>
<style>{STYLE}</style>
<script>{get_plotlyjs()}</script>
</head><body>
<h1>{html.escape(title)}</h1>
{_table(rows)}
<div class="charts">{"".join(sections)}</div>
<script>{"".join(calls)}</script>
</body></html>
"""


def write_html(charts: list[Chart], rows: list[dict], path: Path, title: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(charts, rows, title), encoding="utf-8")
    return path
