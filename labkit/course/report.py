"""Write a run's report: ``report.json`` for machines, ``report.md`` for people.

``labkit run`` executes each lab into a run directory and passes one result dict per lab:

    {"lab": "02_oom_batch",            # required
     "status": "passed",               # required: passed | failed | error | ...
     "seconds": 41.2,                  # optional
     "notebook": "runs/x/02_oom_batch.ipynb",  # optional: the executed notebook
     "error": "...",                   # optional: why it did not pass
     "records": {...},                 # optional: else read from the notebook
     "figures": ["..."]}               # optional: else *.png under run_dir/<lab>/

The headline metric of a lab is its records ``before``, ``after``, ``limit`` and ``unit``
(and optionally ``metric``, its name). With ``html=True`` each executed notebook is also
converted to HTML next to it (nbconvert), figures included.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from labkit.course.records import read_records

HEADLINE_KEYS = ("metric", "before", "after", "limit", "unit")


def _rel(path: Path, run_dir: Path) -> str:
    """Path as written in the report: relative to run_dir, with forward slashes."""
    return Path(os.path.relpath(path.resolve(), run_dir.resolve())).as_posix()


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _figures(run_dir: Path, result: dict[str, Any]) -> list[Path]:
    if "figures" in result:
        return [Path(f) if Path(f).is_absolute() else run_dir / f for f in result["figures"]]
    lab_dir = run_dir / result["lab"]
    return sorted(lab_dir.rglob("*.png")) if lab_dir.is_dir() else []


def _html(notebook: Path) -> tuple[Path | None, str | None]:
    """Convert an executed notebook to HTML next to it; return (path, error)."""
    try:
        import nbconvert
        import nbformat

        body, _ = nbconvert.HTMLExporter().from_notebook_node(nbformat.read(str(notebook), as_version=4))
    except Exception as exc:  # a report without HTML is still a report
        return None, f"{type(exc).__name__}: {exc}"
    target = notebook.with_suffix(".html")
    target.write_text(body, encoding="utf-8")
    return target, None


def _lab_entry(run_dir: Path, result: dict[str, Any], html: bool) -> dict[str, Any]:
    for key in ("lab", "status"):
        if key not in result:
            raise ValueError(f"result {result!r} has no {key!r}; each result needs 'lab' and 'status'")
    entry: dict[str, Any] = {
        "lab": result["lab"],
        "status": result["status"],
        "seconds": result.get("seconds"),
        "notebook": None,
        "html": None,
        "error": result.get("error"),
        "records": dict(result.get("records") or {}),
        "figures": [],
    }
    notebook = Path(result["notebook"]) if result.get("notebook") else None
    if notebook is not None and not notebook.is_absolute() and not notebook.exists():
        notebook = run_dir / notebook
    if notebook is not None and notebook.is_file():
        entry["notebook"] = _rel(notebook, run_dir)
        if "records" not in result:
            entry["records"] = read_records(notebook)
        if html:
            html_path, html_error = _html(notebook)
            entry["html"] = _rel(html_path, run_dir) if html_path else None
            if html_error:
                entry["html_error"] = html_error
    elif notebook is not None:
        entry["notebook_missing"] = str(notebook)
    entry["figures"] = [_rel(f, run_dir) for f in _figures(run_dir, result)]
    return entry


def _markdown(entries: list[dict[str, Any]], calibration: dict[str, Any] | None = None) -> str:
    counts: dict[str, int] = {}
    for entry in entries:
        counts[entry["status"]] = counts.get(entry["status"], 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "no labs"
    lines = [
        "# Multi-GPU Mistakes Lab: run report",
        "",
        f"{summary}.",
        "",
        *([f"Emulated links scaled to this CPU's {calibration['gflops']:.1f} GFLOP/s per core "
           f"({calibration['source']}; {calibration['machine']}).", ""] if calibration else []),
        "| lab | metric | before | after | limit | unit | measured on | status | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for e in entries:
        r = e["records"]
        # Numbers from the emulated cluster are labelled so wherever they are shown.
        world = {True: "emulated cluster", False: "GPUs"}.get(r.get("emulated"), "")
        cells = [e["lab"], *(_fmt(r.get(k)) for k in HEADLINE_KEYS), world, e["status"], _fmt(e["seconds"])]
        lines.append("| " + " | ".join(cells) + " |")
    for e in entries:
        lines += ["", f"## {e['lab']}: {e['status']}", ""]
        if e["error"]:
            lines += ["```", str(e["error"]).strip(), "```", ""]
        links = []
        if e["notebook"]:
            links.append(f"[executed notebook]({e['notebook']})")
        elif e.get("notebook_missing"):
            links.append(f"executed notebook not found: `{e['notebook_missing']}`")
        if e["html"]:
            links.append(f"[HTML]({e['html']})")
        elif e.get("html_error"):
            links.append(f"no HTML ({e['html_error']})")
        if links:
            lines += [" | ".join(links), ""]
        if e["records"]:
            lines += ["| record | value |", "| --- | --- |"]
            lines += [f"| {_fmt(k)} | {_fmt(v)} |" for k, v in e["records"].items()]
            lines.append("")
        else:
            lines += ["No records.", ""]
        for fig in e["figures"]:
            lines.append(f"![{Path(fig).stem}]({fig})")
        if e["figures"]:
            lines.append("")
    text = "\n".join(lines)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.rstrip("\n") + "\n"


def write_report(run_dir: str | Path, results: list[dict[str, Any]], html: bool = True,
                 calibration: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """Write ``run_dir/report.json`` and ``run_dir/report.md``; return their paths.

    ``calibration`` (``labkit.calibrate.Calibration.to_dict()``) is the CPU figure the
    emulated links were scaled to; it is written into both. Raises ValueError if a result
    lacks ``lab`` or ``status``.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    entries = [_lab_entry(run_dir, result, html) for result in results]
    json_path = run_dir / "report.json"
    md_path = run_dir / "report.md"
    data: dict[str, Any] = {"labs": entries}
    if calibration:
        data["calibration"] = calibration
    json_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    md_path.write_text(_markdown(entries, calibration), encoding="utf-8")
    return json_path, md_path
