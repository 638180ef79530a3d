"""bench/report.py: a benchmark's JSON lands in $OUT (made if missing) when set."""

from __future__ import annotations

import json

from bench.report import write_report


def test_write_report_goes_to_out_and_makes_the_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path / "device-out"))
    path = write_report("probe", {"rows": [1, 2]})
    assert path == tmp_path / "device-out" / "probe.json"
    assert json.loads(path.read_text()) == {"rows": [1, 2]}
    assert capsys.readouterr().out == f"wrote {path}\n"
