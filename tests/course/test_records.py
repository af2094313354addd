"""labkit.course.records: record() inside an executed notebook, and read_records() reading it back (also from
lines a worker printed); what it refuses. The run report that reads them: tests/course/test_report.py."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from labkit.course.records import LINE_PREFIX, RECORD_MIME, read_records, record


def _notebook(*sources: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


def test_records_round_trip_through_an_executed_notebook(tmp_path: Path, kernel_finds_labkit: None) -> None:
    nb = _notebook(
        "from labkit.course.records import record",
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
