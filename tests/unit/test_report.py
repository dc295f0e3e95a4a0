"""`p2pdiloco report`: a recorded run (tests/data/recorded-run: 3 peers, 5 rounds, written by the launcher) in,
every chart as a PNG and one self-contained HTML page out."""

import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from p2pdiloco.cli import cli
from p2pdiloco.ops.report import ReportError, write_report
from p2pdiloco.ops.report.charts import PeerLog, load_runs
from p2pdiloco.runtime import schema

RECORDED = Path(__file__).resolve().parents[1] / "data" / "recorded-run"
CHARTS = {"train_loss_time", "train_loss_tokens", "val_loss_time", "val_loss_tokens", "tokens_per_s",
          "bytes_per_round", "island_size", "utilization", "consensus_distance", "goodput"}


def test_a_recorded_run_gives_every_png_and_the_html(tmp_path):
    made = write_report([RECORDED], tmp_path)
    assert {c.key for c in made.charts} == CHARTS
    assert sorted(p.name for p in made.pngs) == sorted(f"{key}.png" for key in CHARTS)
    for png in made.pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, png
    for chart in made.charts:  # every chart has every peer's data, not an empty frame
        assert sorted(s.label for s in chart.series) == ["peer0", "peer1", "peer2"], chart.key
    rows = {r["peer"]: r for r in made.rows}
    assert all(r["rounds"] == 5 and r["val_last"] < r["val_first"] - 2.0 and r["left_cleanly"] for r in rows.values())
    assert all(0.3 < r["goodput"] <= 1.0 and 0.5 < r["utilization"] <= 1.0 for r in rows.values()), rows
    page = made.html.read_text()
    assert page.count("<section class='chart'") == len(CHARTS)
    assert "<table id='summary'>" in page and "peer2" in page


def test_the_page_needs_no_network(tmp_path):
    page = write_report([RECORDED], tmp_path).html.read_text()
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", page)  # nothing is fetched: all inlined
    assert "plotly.js v" in page and len(page) > 1_000_000  # the chart library itself is in the page


def test_runs_side_by_side_are_told_apart(tmp_path):
    other = tmp_path / "hostile"
    shutil.copytree(RECORDED, other)
    made = write_report([RECORDED, other], tmp_path / "out")
    labels = {s.label for c in made.charts for s in c.series}
    assert labels == {f"{run}/peer{i}" for run in ("recorded-run", "hostile") for i in range(3)}


def test_goodput_carries_merged_time_over_a_restart():
    records = [schema.Start(peer="a", time=0.0),
               schema.Round(peer="a", time=10.0, round=1, merged_seconds=8.0),
               schema.Start(peer="a", time=20.0),  # killed at ~10 s, restarted at 20 s: a new process
               schema.Round(peer="a", time=30.0, round=1, merged_seconds=6.0)]
    goodput = list(PeerLog("run", "a", records).goodput())
    assert goodput == [(10.0, pytest.approx(0.8)), (30.0, pytest.approx((8.0 + 6.0) / 30.0))]


def test_folders_without_peer_logs_are_refused_clearly(tmp_path):
    with pytest.raises(ReportError, match="no such folder"):
        load_runs([tmp_path / "missing"])
    (tmp_path / "chaos-events.jsonl").write_text("{}\n")
    with pytest.raises(ReportError, match="no peer metrics"):
        load_runs([tmp_path])


def test_the_cli_writes_the_report_and_says_where(tmp_path):
    result = CliRunner().invoke(cli, ["report", str(RECORDED), "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert f"report: {tmp_path / 'r' / 'report.html'}" in result.output
    bad = CliRunner().invoke(cli, ["report", str(tmp_path / "nope")])
    assert bad.exit_code == 1 and "no such folder" in bad.output


def test_the_launcher_writes_the_report_at_the_end_of_a_run_and_prints_where(tmp_path, capsys):
    from p2pdiloco.ops.launcher import print_report

    shutil.copytree(RECORDED, tmp_path / "run")
    print_report(tmp_path / "run")
    assert f"report: {tmp_path / 'run' / 'report' / 'report.html'}" in capsys.readouterr().out
    assert len(list((tmp_path / "run" / "report").glob("*.png"))) == len(CHARTS)
    print_report(tmp_path / "empty-run")  # a run that wrote nothing still ends, saying why there is no report
    assert "no report: " in capsys.readouterr().out
