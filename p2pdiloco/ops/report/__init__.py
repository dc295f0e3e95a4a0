"""`p2pdiloco report`: a run's peer logs → one PNG per chart and a self-contained report.html."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from p2pdiloco.ops.report.charts import Chart, ReportError, charts, load_runs, summary_rows

__all__ = ["Report", "ReportError", "write_report"]


@dataclass
class Report:
    html: Path
    pngs: list[Path]
    charts: list[Chart]
    rows: list[dict]


def write_report(run_dirs: Sequence[Path], out: Path) -> Report:
    from p2pdiloco.ops.report.html import write_html
    from p2pdiloco.ops.report.png import write_pngs

    peers = load_runs(run_dirs)
    made, rows = charts(peers), summary_rows(peers)
    runs = ", ".join(dict.fromkeys(p.run for p in peers))
    title = f"p2pdiloco run report: {runs} ({len(peers)} peers)"
    return Report(write_html(made, rows, out / "report.html", title), write_pngs(made, out), made, rows)
