"""Record headline numbers inside a notebook and read them back after it ran.

A lab calls ``record("before", 812.0)``. Inside Jupyter this emits a display output
with the MIME type ``application/vnd.labkit.record+json``; papermill and nbclient keep
cell outputs, so ``read_records("runs/02_oom_batch.ipynb")`` returns
``{"before": 812.0, ...}`` once the notebook has executed.

Outside IPython (a script, or a worker process whose stdout reaches the notebook) the
record is printed as one line: ``labkit-record {"key": ..., "value": ...}``.
``read_records`` also reads such lines from a notebook's stream outputs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["LINE_PREFIX", "RECORD_MIME", "read_records", "record"]

RECORD_MIME = "application/vnd.labkit.record+json"
LINE_PREFIX = "labkit-record "


def _check_finite(key: str, value: Any) -> None:
    """Raise ValueError if value holds NaN or infinity (not valid JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(
            f"record({key!r}, {value!r}): NaN and infinity are not valid JSON; "
            "record None (or a string) for a missing number instead"
        )
    if isinstance(value, dict):
        for item in value.values():
            _check_finite(key, item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_finite(key, item)


def _to_json(key: str, value: Any) -> Any:
    """Return value as it will read back from JSON (tuples become lists)."""
    try:
        text = json.dumps(value)
    except TypeError as exc:
        raise TypeError(
            f"record({key!r}, ...): value of type {type(value).__name__} is not "
            f"JSON-serialisable ({exc}); record plain numbers, strings, lists or dicts, "
            "e.g. float(x) or tensor.item()"
        ) from None
    except ValueError as exc:  # circular reference
        raise TypeError(f"record({key!r}, ...): value cannot be written as JSON ({exc})") from None
    _check_finite(key, value)
    return json.loads(text)


def _ipython_shell() -> Any:
    """Return the running IPython shell, or None outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def record(key: str, value: Any) -> None:
    """Store a JSON-serialisable ``value`` under ``key`` in the running notebook's outputs.

    Raises TypeError if ``key`` is not a non-empty string or ``value`` is not
    JSON-serialisable, and ValueError if ``value`` holds NaN or infinity.
    """
    if not isinstance(key, str) or not key:
        raise TypeError(f"record key must be a non-empty str, got {key!r} ({type(key).__name__})")
    value = _to_json(key, value)
    payload = {"key": key, "value": value}
    if _ipython_shell() is not None:
        from IPython.display import display

        display({RECORD_MIME: payload, "text/plain": f"recorded {key} = {value!r}"}, raw=True)
    else:
        print(LINE_PREFIX + json.dumps(payload), flush=True)


def _records_in_output(output: Any) -> list[dict[str, Any]]:
    """Return the record payloads carried by one cell output."""
    if output.get("output_type") in ("display_data", "execute_result"):
        payload = output.get("data", {}).get(RECORD_MIME)
        if isinstance(payload, str):  # some writers keep JSON MIME data as text
            payload = json.loads(payload)
        return [payload] if isinstance(payload, dict) and "key" in payload else []
    if output.get("output_type") == "stream":
        text = output.get("text", "")
        if isinstance(text, list):
            text = "".join(text)
        found = []
        for line in text.splitlines():
            if line.startswith(LINE_PREFIX):
                try:
                    payload = json.loads(line[len(LINE_PREFIX) :])
                except json.JSONDecodeError:
                    continue  # a line cut by interleaved output from several processes
                if isinstance(payload, dict) and "key" in payload:
                    found.append(payload)
        return found
    return []


def read_records(path: str | Path) -> dict[str, Any]:
    """Return ``{key: value}`` recorded in an executed notebook; the last value of a key wins."""
    import nbformat  # imported here: it takes over a second, and workers never need it

    nb = nbformat.read(str(path), as_version=4)
    records: dict[str, Any] = {}
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            for payload in _records_in_output(output):
                records[payload["key"]] = payload.get("value")
    return records
