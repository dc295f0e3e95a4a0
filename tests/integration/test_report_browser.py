"""The report page opened in a real browser (headless Chromium, no network): every chart is drawn and no
script fails. A page that cannot draw (its chart library cut out) is caught by the same check."""

import pytest

from p2pdiloco.ops.report import write_report
from tests.harness import browser
from tests.unit.test_report import CHARTS, RECORDED

pytestmark = pytest.mark.skipif(browser.chromium() is None,
                                reason="Debian's chromium is not installed (scripts/setup.sh installs it as root)")


def test_every_chart_renders_in_headless_chromium(tmp_path):
    page = write_report([RECORDED], tmp_path / "report").html
    shown = browser.render(page, tmp_path / "profile")
    assert shown.script_errors() == []
    charts = browser.sections(shown.dom, "chart")
    assert set(charts) == CHARTS
    for key, inner in charts.items():
        assert "main-svg" in inner, f"{key}: no SVG drawn"  # plotly draws each chart as SVG
        assert inner.count('class="scatterlayer') >= 1 and inner.count("trace scatter") >= 3, key  # 3 peers


def test_a_page_whose_charts_cannot_draw_fails_the_check(tmp_path):
    page = write_report([RECORDED], tmp_path / "report").html
    html = page.read_text()
    start = html.index("<script>", html.index("</style>"))
    broken = tmp_path / "broken.html"
    broken.write_text(html[:start] + html[html.index("</script>", start) + len("</script>"):])  # no plotly.js
    shown = browser.render(broken, tmp_path / "profile")
    assert any("Plotly is not defined" in e for e in shown.script_errors()), shown.console[-2000:]
    assert not any("main-svg" in inner for inner in browser.sections(shown.dom, "chart").values())
