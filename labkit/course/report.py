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

from labkit.course.experiments import registry
from labkit.course.records import read_records

__all__ = ["HEADLINE_KEYS", "write_report"]

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

        nb = nbformat.read(str(notebook), as_version=4)
        body, _ = nbconvert.HTMLExporter().from_notebook_node(
            nb, resources={"metadata": {"name": notebook.stem}}
        )
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


def _header(context: dict[str, Any] | None) -> list[str]:
    """Where and with what the run was made (``labkit.course.runs.run_context``)."""
    if not context:
        return []
    facts = [f"{k} {context[k]}" for k in ("python", "torch", "labkit") if context.get(k)]
    lines = [
        f"Run on {context.get('date', '?')}, {context.get('machine', '?')}; {', '.join(facts)}; "
        f"commit {context.get('commit') or 'unknown (not a git checkout)'}.",
        "",
    ]
    if context.get("cluster"):
        lines += [
            "Cluster (the run's `cluster`, as `labkit.Cluster.resolve` sees it for 2 ranks; each lab's own "
            "ranks and machine are in its \"measured on\" column):",
            "",
            "```",
            str(context["cluster"]).rstrip(),
            "```",
            "",
        ]
    cal = context.get("calibration")
    if cal:
        lines += [
            f"Emulated links scaled to this CPU's {cal['gflops']:.1f} GFLOP/s per core "
            f"({cal['source']}; {cal['machine']}).",
            "",
        ]
    return lines


def _table(rows: list[dict[str, Any]]) -> list[str]:
    """A list of records (a sweep) as a markdown table; GB/s columns below 1 read in MB/s."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    heads, scale = [], {}
    for k in keys:
        values = [row.get(k) for row in rows if isinstance(row.get(k), (int, float))]
        if k.endswith("_GBps") and values and max(values) < 1:
            heads.append(k[: -len("_GBps")] + " (MB/s)")
            scale[k] = 1e3
        elif k.endswith("_GBps"):
            heads.append(k[: -len("_GBps")] + " (GB/s)")
        else:
            heads.append(k)
    lines = ["| " + " | ".join(heads) + " |", "| " + " | ".join("---" for _ in heads) + " |"]
    for row in rows:
        cells = [
            _fmt(row.get(k) * scale[k] if k in scale and isinstance(row.get(k), (int, float)) else row.get(k))
            for k in keys
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _is_table(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _links(e: dict[str, Any]) -> list[str]:
    links = []
    if e["notebook"]:
        links.append(f"[executed notebook]({e['notebook']})")
    elif e.get("notebook_missing"):
        links.append(f"executed notebook not found: `{e['notebook_missing']}`")
    if e["html"]:
        links.append(f"[HTML]({e['html']})")
    elif e.get("html_error"):
        links.append(f"no HTML ({e['html_error']})")
    return [" | ".join(links), ""] if links else []


def _parameters(lab: str, values: Any) -> list[str]:
    """The lab's parameters as run, each with its doc (from the lab's `Params`)."""
    if not isinstance(values, dict):
        return []
    docs = registry.params_of(lab).field_docs() if lab in registry.LABS else {}
    rows = [f"| {_fmt(k)} | {_fmt(v)} | {_fmt(docs.get(k, ''))} |" for k, v in values.items()]
    return ["| parameter | value | what it is |", "| --- | --- | --- |", *rows, ""]


def _lab_section(e: dict[str, Any]) -> list[str]:
    """One lab's section: its status, error, links, the meaning of its numbers, its records and figures."""
    lines = ["", f"## {e['lab']}: {e['status']}", ""]
    if e["error"]:
        lines += ["```", str(e["error"]).strip(), "```", ""]
    lines += _links(e)
    records = e["records"]
    meaning = records.get("meaning")
    if isinstance(meaning, dict):  # what before, after and limit are in this lab
        order = [k for k in ("before", "after", "limit") if k in meaning]
        order += sorted(set(meaning) - {"before", "after", "limit"})
        lines += [*(f"- **{k}**: {_fmt(meaning[k])}" for k in order), ""]
    plain = {k: v for k, v in records.items() if k not in ("meaning", "params") and not _is_table(v)}
    if plain:
        lines += [
            "| record | value |",
            "| --- | --- |",
            *(f"| {_fmt(k)} | {_fmt(v)} |" for k, v in plain.items()),
        ]
        lines.append("")
    elif not records:
        lines += ["No records.", ""]
    lines += _parameters(e["lab"], records.get("params"))
    for k, v in records.items():
        if _is_table(v):
            lines += [f"**{k}**", "", *_table(v)]
    lines += [f"![{Path(fig).stem}]({fig})" for fig in e["figures"]]
    return lines + ([""] if e["figures"] else [])


def _measured_on(records: dict[str, Any]) -> str:
    """Where a lab's numbers were measured, as its records say: a simulated machine (its `cluster` parameter,
    "sim:<preset>"; the emulated cluster in all but compute, so it also records `emulated`), the emulated
    cluster, or GPUs; the label its `Machine` recorded ("where") where it has one. Numbers that are not a
    GPU's are labelled so wherever they are shown."""
    where = records.get("where")  # the lab's Machine label (labkit.machine.machine.Machine.records)
    if isinstance(where, str) and where:
        return where
    cluster = (records.get("params") or {}).get("cluster")
    if isinstance(cluster, str) and cluster.startswith("sim:"):
        return f"simulated {cluster.removeprefix('sim:')}"
    return {True: "emulated cluster", False: "GPUs"}.get(records.get("emulated"), "")


def _markdown(entries: list[dict[str, Any]], context: dict[str, Any] | None = None) -> str:
    counts: dict[str, int] = {}
    for entry in entries:
        counts[entry["status"]] = counts.get(entry["status"], 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "no labs"
    lines = [
        "# Multi-GPU Mistakes Lab: run report",
        "",
        f"{summary}.",
        "",
        *_header(context),
        "| lab | metric | before | after | limit | unit | measured on | status | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for e in entries:
        r = e["records"]
        numbers = [_fmt(r.get(k)) for k in HEADLINE_KEYS]
        cells = [e["lab"], *numbers, _measured_on(r), e["status"], _fmt(e["seconds"])]
        lines.append("| " + " | ".join(cells) + " |")
    for e in entries:
        lines += _lab_section(e)
    text = "\n".join(lines)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.rstrip("\n") + "\n"


def write_report(
    run_dir: str | Path,
    results: list[dict[str, Any]],
    html: bool = True,
    context: dict[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write ``run_dir/report.json`` and ``run_dir/report.md``; return their paths.

    ``context`` (``labkit.course.runs.run_context``: machine, cluster, calibration, versions,
    commit, date) is written into both, as the report's header. Raises ValueError if a result
    lacks ``lab`` or ``status``.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    entries = [_lab_entry(run_dir, result, html) for result in results]
    json_path = run_dir / "report.json"
    md_path = run_dir / "report.md"
    data: dict[str, Any] = {"labs": entries}
    if context:
        data["context"] = context
    json_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    md_path.write_text(_markdown(entries, context), encoding="utf-8")
    return json_path, md_path
