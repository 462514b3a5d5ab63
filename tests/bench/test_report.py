"""``python -m bench report`` (bench/report.py) rebuilds report.md and its plots from a quick/full results JSON:
here from the committed one, every plot drawn on a stand-in for pyplot (matplotlib is an extra), and its
refusals of what it cannot read. No figure is checked: the report's text is built from the JSON's."""
from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest

from bench import report

COMMITTED = Path(report.RESULTS) / "20261129-103301.json"


def test_every_plot_of_a_quick_run_is_drawn():
    res = json.loads(COMMITTED.read_text())
    plt = mock.MagicMock()
    plt.subplots.side_effect = lambda *a, **k: (mock.MagicMock(), mock.MagicMock()) if not a else \
        (mock.MagicMock(), tuple(mock.MagicMock() for _ in range(a[1])))
    for name, make in report.PLOTS.items():
        assert make(res, plt) is not None, name       # the throughput plot's list hid the bars() it draws with


def test_report_md_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "pyplot", lambda: None)          # no plots: the text alone
    report.main([str(COMMITTED), "--out", str(tmp_path)])
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("# hf_paged benchmark report") and "## Summary" in text


@pytest.mark.parametrize("content, says", [(None, "no results JSON at"), ("{", "is not JSON"),
                                           ('{"runs": []}', "is not a quick/full results JSON")])
def test_what_it_cannot_read_is_refused_by_name(tmp_path, capsys, content, says):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit):
        report.main([str(path), "--out", str(tmp_path / "out")])
    assert says in capsys.readouterr().err
