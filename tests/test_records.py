"""record() inside an executed notebook, and read_records() reading it back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from labkit.records import LINE_PREFIX, RECORD_MIME, read_records, record

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def kernel_sees_labkit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the kernel import this checkout's labkit even when it is not pip-installed."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def _notebook(*sources: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


def test_records_round_trip_through_an_executed_notebook(tmp_path: Path, kernel_sees_labkit: None) -> None:
    nb = _notebook(
        "from labkit.records import record",
        "record('before', 812.5)\nrecord('unit', 'ms')",
        "record('after', 2)\nrecord('after', 3)  # the last value wins",
        "record('shape', (2, 3))\nrecord('extra', {'ranks': 2, 'ok': True, 'none': None})",
    )
    NotebookClient(
        nb, timeout=60, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    path = tmp_path / "executed.ipynb"
    nbformat.write(nb, str(path))

    assert read_records(path) == {
        "before": 812.5,
        "unit": "ms",
        "after": 3,
        "shape": [2, 3],
        "extra": {"ranks": 2, "ok": True, "none": None},
    }
    # The notebook shows something readable too.
    first = nb.cells[1].outputs[0]
    assert first["data"]["text/plain"] == "recorded before = 812.5"
    assert first["data"][RECORD_MIME] == {"key": "before", "value": 812.5}


def test_outside_ipython_record_prints_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    record("limit", 1.5)
    out = capsys.readouterr().out
    assert out.startswith(LINE_PREFIX)
    assert json.loads(out[len(LINE_PREFIX) :]) == {"key": "limit", "value": 1.5}


def test_read_records_also_reads_printed_lines(tmp_path: Path) -> None:
    nb = _notebook("")
    line = LINE_PREFIX + json.dumps({"key": "from_worker", "value": [1, 2]})
    nb.cells[0].outputs = [
        nbformat.v4.new_output("stream", name="stdout", text=f"hello\n{line}\n{LINE_PREFIX}{{cut")
    ]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, str(path))
    assert read_records(path) == {"from_worker": [1, 2]}


def test_non_serialisable_value_names_key_and_type() -> None:
    with pytest.raises(TypeError, match=r"'speedup'.*object"):
        record("speedup", object())


def test_nan_is_refused_with_a_fix() -> None:
    with pytest.raises(ValueError, match=r"'after'.*None"):
        record("after", float("nan"))


def test_key_must_be_a_string() -> None:
    with pytest.raises(TypeError, match="non-empty str"):
        record("", 1)


# ------------------------------------------------------------------ the run report (reads records)


def test_write_report(tmp_path: Path) -> None:
    from labkit.course.report import write_report

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
    from labkit.course.report import write_report

    with pytest.raises(ValueError, match="'status'"):
        write_report(tmp_path, [{"lab": "01"}])


def test_report_has_a_header_meanings_and_sweeps_as_tables(tmp_path):
    from labkit.course.report import write_report

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


def test_each_run_gets_its_own_folder_and_latest_points_to_the_newest(tmp_path):
    from labkit.course.runs import new_run_dir, point_latest

    first = new_run_dir(tmp_path)
    (first / "old.png").write_text("x")
    point_latest(tmp_path, first)
    second = new_run_dir(tmp_path)
    assert second != first and not any(second.iterdir())
    link = point_latest(tmp_path, second)
    assert link.resolve() == second.resolve() and not (link / "old.png").exists()
