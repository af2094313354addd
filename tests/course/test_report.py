"""labkit.course.report: the run report (JSON, Markdown, HTML) from each lab's records: the table, the
figures, the failures, a header with the machine and the calibration, meanings and sweeps as tables."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from labkit.course.records import RECORD_MIME
from labkit.course.report import _measured_on, write_report


def _notebook(*sources: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


def test_write_report(tmp_path: Path) -> None:
    nb = _notebook("record(...)")  # outputs as record() leaves them (executed for real above)
    values = {
        "metric": "step time",
        "before": 257.123,
        "after": 190.0,
        "limit": 200,
        "unit": "ms",
        "emulated": True,
    }
    nb.cells[0].outputs = [
        nbformat.v4.new_output(
            "display_data", data={RECORD_MIME: {"key": k, "value": v}, "text/plain": "..."}
        )
        for k, v in values.items()
    ]
    executed = tmp_path / "03_comms.ipynb"
    nbformat.write(nb, str(executed))
    (tmp_path / "03_comms").mkdir()
    (tmp_path / "03_comms" / "timeline.png").write_bytes(b"\x89PNG")

    json_path, md_path = write_report(
        tmp_path,
        [
            {"lab": "03_comms", "status": "passed", "seconds": 12.5, "notebook": str(executed)},
            {"lab": "04_pipe", "status": "failed", "seconds": 3.0, "error": "ValueError: bad split"},
        ],
    )
    report = json.loads(json_path.read_text())
    first, second = report["labs"]
    assert first["records"] == values
    assert first["notebook"] == "03_comms.ipynb"
    assert first["figures"] == ["03_comms/timeline.png"]
    assert first["html"] == "03_comms.html" and (tmp_path / "03_comms.html").is_file()
    assert second["records"] == {} and second["notebook"] is None

    md = md_path.read_text()
    assert "1 failed, 1 passed." in md
    assert "| 03_comms | step time | 257.1 | 190 | 200 | ms | emulated cluster | passed | 12.5 |" in md
    assert "| 04_pipe | - | - | - | - | - |  | failed | 3 |" in md
    assert "![timeline](03_comms/timeline.png)" in md
    assert "[HTML](03_comms.html)" in md
    assert "ValueError: bad split" in md


def test_write_report_needs_lab_and_status(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'status'"):
        write_report(tmp_path, [{"lab": "01"}])


def test_report_has_a_header_meanings_and_sweeps_as_tables(tmp_path):
    records = {
        "before": 0.01,
        "after": 0.09,
        "limit": 0.1,
        "unit": "GB/s",
        "meaning": {"before": "smallest message", "after": "largest", "limit": "the link"},
        "sweep": [{"size_bytes": 4096, "busbw_GBps": 0.0082}, {"size_bytes": 65536, "busbw_GBps": 0.05}],
    }
    context = {
        "date": "2026-12-01T10:00:00+00:00",
        "machine": "m: Linux x86_64, 2 CPU cores",
        "torch": "2.13.0",
        "labkit": "0.1.0",
        "commit": "abc1234",
        "cluster": "Emulated cluster: ...",
        "calibration": {"gflops": 93.6, "source": "cache", "machine": "AMD EPYC | torch 2.13.0"},
    }
    _, md = write_report(
        tmp_path, [{"lab": "00_x", "status": "passed", "records": records}], html=False, context=context
    )
    text = md.read_text()
    assert "Run on 2026-12-01T10:00:00+00:00" in text and "commit abc1234" in text and "93.6 GFLOP/s" in text
    assert "- **before**: smallest message" in text
    assert "| size_bytes | busbw (MB/s) |" in text and "| 4096 | 8.2 |" in text
    assert "{'size_bytes'" not in text  # no raw dicts


def test_a_lab_run_on_a_simulated_machine_is_labelled_simulated_not_emulated():
    # a simulated machine is the emulated cluster in all but compute, so its notebooks record emulated=True;
    # the report's "measured on" reads the lab's cluster parameter first
    assert _measured_on({"emulated": True, "params": {"cluster": "sim:dgx-h100"}}) == "simulated dgx-h100"
    assert _measured_on({"emulated": True, "params": {"cluster": "cpu"}}) == "emulated cluster"
    assert _measured_on({"emulated": False}) == "GPUs" and _measured_on({}) == ""
