"""The report's charts as PNG files (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path

from p2pdiloco.ops.report.charts import Chart


def write_pngs(charts: list[Chart], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for chart in charts:
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        for s in chart.series:
            if chart.markers_only:
                ax.plot(s.x, s.y, "o", markersize=4, label=s.label, alpha=0.8)
            else:
                ax.plot(s.x, s.y, marker=".", markersize=3, linewidth=1.2, label=s.label)
        if not chart.series:
            ax.text(0.5, 0.5, "no data in these logs", ha="center", va="center", transform=ax.transAxes)
        ax.set(title=chart.title, xlabel=chart.xlabel, ylabel=chart.ylabel)
        ax.grid(alpha=0.3)
        if chart.series:
            ax.legend(fontsize=8, ncol=2 if len(chart.series) > 6 else 1)
        fig.tight_layout()
        path = out / f"{chart.key}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
