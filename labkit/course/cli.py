"""`labkit doctor | run | build | report | quiz | grade`: the course from a terminal or CI.

labkit doctor [--as PRESET[:NODES]]
                                   what this machine is, a 2-rank smoke test and where each lab runs;
                                   --as: where each lab would run on a preset machine (nothing runs)
labkit run [--lab 00] [--cluster auto|cpu|gpu|sim:dgx-h100] [--out runs] [-p KEY VALUE]
                                   execute the solution notebooks, write the report
labkit build [--check]             write labs/ from solutions/ (or check it is current)
labkit report RUN_DIR              rewrite the report of an earlier run
labkit quiz [--topic T] [--exam N]  practice questions, or a timed mock exam
labkit grade SUBMISSIONS [--csv F] run learners' notebooks and report each check
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_USAGE", "main"]

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped


def _root(arg: str | None) -> Path:
    """The course folder: --root, else the current folder if it holds solutions/, else the checkout."""
    if arg:
        return Path(arg).resolve()
    cwd = Path.cwd()
    if (cwd / "solutions").is_dir():
        return cwd
    return Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------- doctor


def doctor(args: argparse.Namespace) -> int:
    from labkit.course.doctor import describe_machine, machine_named
    from labkit.course.doctor import doctor as check_machine

    if args.machine is None:
        return check_machine(args.cluster, args.recalibrate)
    try:
        machine = machine_named(args.machine)
    except ValueError as exc:  # the value, the known presets and the fix
        print(f"labkit doctor: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return describe_machine(machine)


# ---------------------------------------------------------------------- run


def _parse_params(pairs: list[list[str]] | None) -> dict:
    params = {}
    for key, raw in pairs or []:
        try:
            params[key] = json.loads(raw)
        except json.JSONDecodeError:
            params[key] = raw  # a bare word stays a string
    return params


def _select(solutions: Path, lab: str | None) -> list[Path]:
    notebooks = sorted(solutions.glob("[0-9][0-9]_*.ipynb"))
    if lab is not None:
        chosen = [nb for nb in notebooks if nb.name.startswith(f"{int(lab):02d}_")] if lab.isdigit() else []
        if not chosen:
            names = ", ".join(nb.name[:2] for nb in notebooks) or "none"
            raise SystemExit(f"labkit run: no lab {lab!r} in {solutions}; labs present: {names}")
        return chosen
    return notebooks


def _lab_params(notebooks: list[Path], given: dict) -> dict[str, dict]:
    """Per lab, the `-p` values that are its parameters, checked before any kernel starts
    (`labkit.course.parameters.lab_parameters`, which `labkit grade` uses too)."""
    from labkit.course.parameters import lab_parameters

    return lab_parameters([nb.stem for nb in notebooks], given, "run")


def run(args: argparse.Namespace) -> int:
    from labkit.course.execute import Interrupted
    from labkit.course.experiments.params import ParamError
    from labkit.course.report import write_report
    from labkit.course.runs import complete, new_run_dir, point_latest, run_context
    from labkit.machine import rank_server

    root = _root(args.root)
    solutions = root / "solutions"
    if not solutions.is_dir():
        print(
            f"labkit run: no solutions/ folder in {root}; run from the course checkout or pass --root.",
            file=sys.stderr,
        )
        return EXIT_USAGE
    notebooks = _select(solutions, args.lab)
    given = {"cluster": args.cluster, **_parse_params(args.param)}
    try:
        per_lab = _lab_params(notebooks, given)
    except ParamError as err:
        print(f"labkit run: {err}", file=sys.stderr)
        return EXIT_USAGE
    base = Path(args.out)
    out = new_run_dir(base)  # a folder of its own: never mixed with an earlier run
    # the kernels papermill starts: quizzes as text (labkit.course.quiz.show)
    os.environ["LABKIT_TEXT_ONLY"] = "1"
    results: list[dict] = []
    try:
        with rank_server.serving():  # one fork server for every lab's ranks, not one per kernel
            for i, nb in enumerate(notebooks, 1):
                lab_params = per_lab.get(nb.stem, given)
                results.append(_run_lab(nb, f"[{i}/{len(notebooks)}]", lab_params, out, args))
    except Interrupted as stop:
        results.append(_interrupted_entry(stop, given, per_lab))
        write_report(out, results, context=run_context(root, given["cluster"]))
        print(f"\nlabkit run: {_interrupted_line(stop, results, out, base)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    json_path, md_path = write_report(out, results, context=run_context(root, given["cluster"]))
    every_lab = len(notebooks) == len(sorted(solutions.glob("[0-9][0-9]_*.ipynb")))
    if complete(results, every_lab):
        print(f"report: {md_path} (and {json_path.name}); {point_latest(base, out)} points to it")
    else:
        print(f"report: {md_path} (and {json_path.name}); {_latest_kept(base)}")
    failed = [f"{e['lab']} {e['error']}" for e in results if e["status"] != "passed"]
    if failed:
        print("labkit run: failed: " + "; ".join(failed), file=sys.stderr)
        return EXIT_FAILED
    return 0


def _run_lab(nb: Path, counter: str, params: dict, out: Path, args: argparse.Namespace) -> dict:
    """One solution notebook run into `out` (figures it saves land in `out/<lab>/`, the report links them);
    its report entry."""
    from labkit.course.execute import execute
    from labkit.course.figures import FIGURES_ENV
    from labkit.course.records import read_records

    lab, target = nb.stem, out / nb.name
    workdir = out / lab
    workdir.mkdir(exist_ok=True)
    os.environ[FIGURES_ENV] = str(workdir)  # the kernel's labkit.save_figure writes the report's PNGs here
    print(f"{counter} {lab}: running with {params} ...", flush=True)
    run_ = execute(
        nb,
        target,
        parameters=params,
        cwd=workdir,
        kernel=args.kernel,
        cell_timeout=args.cell_timeout,
        progress=not args.quiet,
    )
    entry: dict = {
        "lab": lab,
        "notebook": str(target),
        "parameters": params,
        "status": "passed" if run_.ok else "failed",
        "seconds": round(run_.seconds, 1),
        "records": read_records(target) if target.exists() else {},
    }
    if not run_.ok:
        entry["error"] = run_.error
    verdict = "passed" if run_.ok else f"FAILED at {run_.error}"
    print(f"{counter} {lab}: {verdict} in {entry['seconds']} s", flush=True)
    return entry


def _interrupted_entry(stop: Any, given: dict, per_lab: dict) -> dict:
    """The report's entry for the lab Ctrl-C stopped (`stop`: a `labkit.course.execute.Interrupted`)."""
    lab = stop.notebook.stem
    where = "before its first cell" if stop.cell is None else f"in cell {stop.cell} of {stop.cells}"
    return {
        "lab": lab,
        "notebook": str(stop.notebook),
        "parameters": per_lab.get(lab, given),
        "status": "interrupted",
        "seconds": None,
        "records": {},
        "error": f"interrupted (Ctrl-C) {where}",
    }


def _interrupted_line(stop: Any, results: list[dict], out: Path, base: Path) -> str:
    """One line: where Ctrl-C stopped the run and what was kept."""
    done = [e["lab"][:2] for e in results if e["status"] != "interrupted"]
    kept = f"the report of lab(s) {', '.join(done)}" if done else "its report"
    partial = f", the partly run {stop.notebook.name}" if stop.notebook.exists() else ""
    return (
        f"{results[-1]['error']} in {stop.notebook.stem}; kept {out} ({kept}{partial}); {_latest_kept(base)}"
    )


def _latest_kept(base: Path) -> str:
    """What `base/latest` points to, when this run did not move it (only a complete run does)."""
    link = base / "latest"
    if link.is_symlink():
        return f"{link} still points to {os.readlink(link)}, the last run of every lab that passed"
    return f"{link} is made by the first run of every lab that passes"


def report(args: argparse.Namespace) -> int:
    from labkit.course.report import write_report

    run_dir = Path(args.run_dir)
    previous = run_dir / "report.json"
    if not previous.exists():
        print(
            f"labkit report: {previous} not found; run `labkit run --out {run_dir}` first.", file=sys.stderr
        )
        return EXIT_USAGE
    data = json.loads(previous.read_text())
    results = data.get("labs", data) if isinstance(data, dict) else data
    _json_path, md_path = write_report(
        run_dir, results, context=data.get("context") if isinstance(data, dict) else None
    )
    print(f"report: {md_path}")
    return 0


# -------------------------------------------------------------------- build


def build(args: argparse.Namespace) -> int:
    from labkit.course import notebooks

    root = _root(args.root)
    solutions, labs = root / "solutions", root / "labs"
    if args.check:
        problems = notebooks.check(solutions, labs)
        for p in problems:
            print(p)
        if problems:
            print("labs/ is out of date: run `labkit build`.", file=sys.stderr)
            return EXIT_FAILED
        print("labs/ is up to date.")
        return 0
    written = notebooks.build(solutions, labs)
    for path in written:
        print(f"wrote {path}")
    return 0


def quiz(args: argparse.Namespace) -> int:
    from labkit.course import quiz as q
    from labkit.course.quiz.terminal import EXAM_MINUTES, command_questions

    try:  # errors say the option, its value and the command that works (--exam 0 is an error, not "all")
        questions = command_questions(args.topic, args.exam, args.seed, args.minutes)
    except ValueError as exc:
        print(f"labkit quiz: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.print:
        print(q.text_form(questions))
        return 0
    try:
        minutes = EXAM_MINUTES if args.minutes is None else args.minutes
        q.run_terminal(questions, minutes=minutes if args.exam is not None else None)
    except (EOFError, KeyboardInterrupt):
        print("\nlabkit quiz: stopped", file=sys.stderr)
        return 1
    return 0


def grade(args: argparse.Namespace) -> int:
    from labkit.course.experiments.capstone import EXAM_SECRET_ENV, exam_secret
    from labkit.course.grade import grade_folder, table, write_csv
    from labkit.machine import rank_server

    os.environ["LABKIT_TEXT_ONLY"] = "1"
    if args.exam_secret:  # the kernels inherit it: each capstone is dealt again as its learner's was
        os.environ[EXAM_SECRET_ENV] = str(Path(args.exam_secret).resolve())
    params = {"cluster": args.cluster, **_parse_params(args.param)}
    try:  # a folder without labs, a -p key no lab graded takes or a value one refuses: before any kernel
        exam_secret()  # an unreadable or empty secret file: said before any kernel starts
        with rank_server.serving():  # one fork server for every notebook's ranks, not one per kernel
            grades = grade_folder(args.folder, params, args.cell_timeout)
    except ValueError as exc:
        print(f"labkit grade: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(table(grades, args.csv))
    if args.csv:
        write_csv(grades, args.csv)
        print(f"wrote {args.csv}")
    return 0


_CLUSTER_HELP = (
    "auto: NCCL when this machine has enough GPUs, else the emulated cluster; cpu: emulated; gpu: NCCL; "
    "sim:dgx-h100 (or sim:<preset>:<nodes>): a simulated machine at GPU sizes, no GPU needed"
)
_CLUSTERS = ("auto", "cpu", "gpu")


def _cluster_spec(text: str) -> str:
    """--cluster's value for the commands that run notebooks: auto, cpu, gpu or sim:<preset>[:<nodes>], the
    same values as a notebook's `cluster` parameter (argparse prints the error, exit status 2)."""
    if text in _CLUSTERS:
        return text
    if text.startswith("sim:"):
        from labkit.cluster import Cluster

        try:
            Cluster.resolve(text, 1)  # the preset and node count, checked
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a cluster: use auto, cpu, gpu or sim:<preset>[:<nodes>], "
        "e.g. --cluster sim:dgx-h100"
    )


def _doctor_cluster(text: str) -> str:
    """--cluster's value for doctor, which checks this machine: a simulated one is `--as`'s."""
    if text.startswith("sim:"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a machine you do not have: labkit doctor --as {text.removeprefix('sim:')} says "
            "where each lab would run on it; --cluster takes auto, cpu or gpu"
        )
    if text not in _CLUSTERS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a cluster: use auto, cpu or gpu")
    return text


def _notebook_options(p: argparse.ArgumentParser, cluster: str, param_help: str) -> None:
    """The options of the commands that execute notebooks (run, grade): the cluster, -p, the cell timeout."""
    p.add_argument("--cluster", default=cluster, type=_cluster_spec, metavar="CLUSTER", help=_CLUSTER_HELP)
    p.add_argument(
        "-p",
        "--param",
        nargs=2,
        action="append",
        metavar=("KEY", "VALUE"),
        help=f"{param_help} (JSON value or a bare word), repeatable",
    )
    # grade called it --timeout before run and grade shared these options: the old name stays.
    p.add_argument(
        "--cell-timeout",
        "--timeout",
        dest="cell_timeout",
        type=int,
        default=600,
        help="seconds one cell may run",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="labkit", description="Multi-GPU Mistakes Lab tools")
    fmt = argparse.ArgumentDefaultsHelpFormatter
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "doctor", help="hardware, backend, versions and a 2-rank smoke test", formatter_class=fmt
    )
    p.add_argument(
        "--cluster",
        default="auto",
        type=_doctor_cluster,
        metavar="{auto,cpu,gpu}",
        help="auto: NCCL when this machine has enough GPUs, else the emulated cluster; cpu: emulated; "
        "gpu: NCCL (a simulated machine: --as)",
    )
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="measure this CPU's GFLOP/s again (the emulated links' scale) and update the cache",
    )
    p.add_argument(
        "--as",
        dest="machine",
        metavar="PRESET[:NODES]",
        help="instead, where each lab would run by default on a machine you do not have, a cluster preset "
        "(dgx-h100, dgx-h200, dgx-a100-80gb; dgx-h100:2 for two nodes), and why: no GPU needed, nothing runs",
    )
    p.set_defaults(func=doctor)

    p = sub.add_parser(
        "run", help="execute the solution notebooks with papermill and write a report", formatter_class=fmt
    )
    p.add_argument("--lab", help="only this lab, by number (e.g. 00)")
    _notebook_options(p, "auto", "notebook parameter")
    p.add_argument(
        "--out",
        default="runs",
        help="each run writes OUT/<date-time>/ (notebooks, figures, report); OUT/latest points to the newest",
    )
    p.add_argument("--kernel", default="python3", help="the Jupyter kernel papermill starts")
    p.add_argument("--root", help="course folder holding solutions/ (default: here or the checkout)")
    p.add_argument("--quiet", action="store_true", help="no per-cell progress bar")
    p.set_defaults(func=run)

    p = sub.add_parser("build", help="write labs/ from solutions/", formatter_class=fmt)
    p.add_argument("--check", action="store_true", help="fail when labs/ is stale instead of writing")
    p.add_argument(
        "--root", help="course folder holding solutions/ and labs/ (default: here or the checkout)"
    )
    p.set_defaults(func=build)

    p = sub.add_parser(
        "quiz", help="practice questions in the terminal (certification prep)", formatter_class=fmt
    )
    p.add_argument(
        "--topic",
        help="one topic: cluster, parallelism, memory, precision, communication, pipeline, "
        "profiling (default: all)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="draws the numeric questions; the same seed, the same paper"
    )
    p.add_argument(
        "--exam",
        type=int,
        metavar="N",
        help="a timed mock exam of N questions over every topic; answers and explanations at the end",
    )
    p.add_argument("--minutes", type=float, help="the mock exam's time limit (with --exam; default 30)")
    p.add_argument("--print", action="store_true", help="print the questions and the key instead of asking")
    p.set_defaults(func=quiz)

    p = sub.add_parser(
        "grade", help="run learners' lab notebooks and report which checks pass", formatter_class=fmt
    )
    p.add_argument("folder", help="learners' notebooks: FOLDER/<learner>/<NN_lab>.ipynb")
    _notebook_options(p, "cpu", "notebook parameter, passed to the labs that have it (checked first)")
    p.add_argument(
        "--csv", help="also write the grades to this CSV file (learner, lab, check, status: each one whole)"
    )
    p.add_argument(
        "--exam-secret",
        metavar="FILE",
        help="exam mode: the instructor's secret file the capstones were dealt with "
        "($LABKIT_EXAM_SECRET_FILE)",
    )
    p.set_defaults(func=grade)

    p = sub.add_parser("report", help="rewrite the report of a run folder")
    p.add_argument("run_dir", help="a folder `labkit run --out` wrote (it holds report.json)")
    p.set_defaults(func=report)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C anywhere else: one line, no traceback (run says more itself)
        print(f"\nlabkit {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
