"""The repository's packaging stays consistent: conda env = pyproject, notebooks stripped, labs fresh."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml
from packaging.requirements import Requirement

from labkit.course.notebooks import check, lint, list_notebooks, outputs_present

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = REPO / "solutions"
LABS = REPO / "labs"

# conda-forge name -> PyPI name, where they differ.
CONDA_TO_PYPI = {"pytorch": "torch"}
# Entries of environment.yml that are not package dependencies of labkit.
CONDA_ONLY = {"python", "pip"}


def _normalise(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. become one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _specifier(spec: str) -> str:
    return ",".join(sorted(part.strip() for part in spec.replace(" ", "").split(",") if part.strip()))


def _pyproject_dependencies() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    deps = {}
    for line in project["dependencies"]:
        req = Requirement(line)
        deps[_normalise(req.name)] = _specifier(str(req.specifier))
    return deps


def _environment() -> tuple[dict[str, str], list[str]]:
    """Return (conda dependencies by PyPI name, pip section) of environment.yml."""
    env = yaml.safe_load((REPO / "environment.yml").read_text(encoding="utf-8"))
    conda: dict[str, str] = {}
    pip: list[str] = []
    for entry in env["dependencies"]:
        if isinstance(entry, dict):
            pip.extend(entry.get("pip", []))
            continue
        match = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", str(entry).strip())
        assert match, f"environment.yml: cannot read dependency {entry!r}"
        name = _normalise(match.group(1))
        if name in CONDA_ONLY:
            continue
        conda[_normalise(CONDA_TO_PYPI.get(name, name))] = _specifier(match.group(2))
    return conda, pip


def test_environment_yml_matches_pyproject_dependencies() -> None:
    wanted = _pyproject_dependencies()
    conda, pip = _environment()
    missing = sorted(set(wanted) - set(conda))
    extra = sorted(set(conda) - set(wanted))
    assert not missing and not extra, (
        f"environment.yml lacks {missing} and has extra {extra} compared with pyproject.toml "
        "[project].dependencies; keep the two lists the same (conda-forge calls torch 'pytorch')"
    )
    differ = {name: (wanted[name], conda[name]) for name in wanted if wanted[name] != conda[name]}
    assert not differ, f"version constraints differ (pyproject, environment.yml): {differ}"
    assert "-e ." in pip, f"environment.yml's pip section must install the package itself ('-e .'), got {pip}"


def test_environment_yml_pins_python_and_pip() -> None:
    env = yaml.safe_load((REPO / "environment.yml").read_text(encoding="utf-8"))
    plain = [str(e).replace(" ", "") for e in env["dependencies"] if not isinstance(e, dict)]
    assert "python>=3.10" in plain and "pip" in plain, plain


def test_committed_notebooks_have_no_outputs() -> None:
    dirty = outputs_present(list_notebooks(SOLUTIONS) + list_notebooks(LABS))
    assert not dirty, (
        f"notebooks with outputs (run labkit.course.notebooks.strip on them): {[str(p) for p in dirty]}"
    )


def test_labs_are_up_to_date() -> None:
    problems = check(SOLUTIONS, LABS)
    assert not problems, "labs/ is out of date:\n" + "\n".join(problems)


def test_notebooks_have_parameters_cell_and_python3_kernel() -> None:
    problems = [p for path in list_notebooks(SOLUTIONS) + list_notebooks(LABS) for p in lint(path)]
    assert not problems, "\n".join(problems)


def _ci_test_command() -> str:
    match = re.search(
        r'^TEST_CMD="([^"]+)"$', (REPO / ".ci" / "run").read_text(encoding="utf-8"), re.MULTILINE
    )
    assert match, '.ci/run must define the test command on one line: TEST_CMD="..."'
    return match.group(1)


def test_ci_installs_pinned_torch_before_the_package() -> None:
    text = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    torch = text.find("python3 -m pip install torch==")
    package = text.find('python3 -m pip install -e ".[test]"')
    assert 0 <= torch < package, (
        ".ci/run must install a pinned torch before the package (else pip pulls a CUDA build)"
    )


def test_readme_shows_the_ci_test_command() -> None:
    command = _ci_test_command()
    readme = REPO / "README.md"
    assert readme.is_file(), "README.md is missing (pyproject.toml names it as the readme)"
    assert command in readme.read_text(encoding="utf-8"), (
        f"README.md must show the same test command as .ci/run: {command!r}"
    )


def test_the_wheel_holds_every_subpackage(tmp_path):
    """A regular (non-editable) install gets labkit/machine/emulate, parallel, trace, ... too."""
    import subprocess
    import sys
    import zipfile

    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(REPO),
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("labkit-*.whl")
    packaged = {n.rsplit("/", 1)[0] for n in zipfile.ZipFile(wheel).namelist() if n.endswith("/__init__.py")}
    on_disk = {str(p.parent.relative_to(REPO)) for p in (REPO / "labkit").rglob("__init__.py")}
    assert on_disk <= packaged, f"missing from the wheel: {sorted(on_disk - packaged)}"


def test_help_and_import_do_not_import_torch() -> None:
    # `labkit --help` must answer at once: the package imports its names on first use.
    import subprocess

    code = (
        "import sys, labkit, labkit.course.cli\ntry:\n    labkit.course.cli.main(['--help'])\n"
        "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch was imported'\n"
        "from labkit import launch, "
        "measure\nimport labkit.machine.launcher, labkit.measured_memory\nassert callable(labkit.launch) and "
        "callable(labkit.measure), (labkit.launch, labkit.measure)\nassert labkit.memory.estimate is "
        "labkit.estimate\nassert set(labkit.__all__) <= set(dir(labkit))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_an_unknown_name_is_an_attribute_error() -> None:
    import labkit

    try:
        labkit.no_such_name  # noqa: B018 - the lookup is what is tested
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("labkit.no_such_name did not raise")


def _workflow(name: str) -> dict:
    wf = yaml.safe_load((REPO / ".github" / "workflows" / name).read_text(encoding="utf-8"))
    wf["on"] = wf.pop(True, wf.get("on"))  # YAML 1.1 reads the key `on` as True
    return wf


def test_the_cpu_workflow_runs_the_readme_test_command_on_every_pull_request() -> None:
    wf = _workflow("cpu.yml")
    assert "pull_request" in wf["on"] and "push" in wf["on"]
    runs = " ".join(step.get("run", "") for step in wf["jobs"]["tests"]["steps"])
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    command = next(
        line for line in readme.splitlines() if line.endswith(_ci_test_command()) and "pip" in line
    )
    assert command in runs, f"cpu.yml must run the README's test command: {command!r}"


def test_the_gpu_workflow_is_nightly_label_gated_and_never_runs_untrusted_code() -> None:
    wf = _workflow("gpu.yml")
    assert (
        set(wf["on"]) == {"schedule", "workflow_dispatch", "pull_request"}
        and "pull_request_target" not in wf["on"]
    )
    job = wf["jobs"]["labs"]
    assert {"self-hosted", "gpu"} <= set(job["runs-on"])
    # on a pull request only on the label's own event (a new commit pushed after it does not run), and the
    # commit checked out is the labelled one
    assert (
        "github.event.label.name == 'run-gpu'" in job["if"]
        and "github.event.action == 'labeled'" in job["if"]
    )
    assert "github.event_name != 'pull_request'" in job["if"] and wf["on"]["pull_request"]["types"] == [
        "labeled",
        "synchronize",
    ]
    checkout = next(s for s in job["steps"] if "actions/checkout" in s.get("uses", ""))
    assert "github.event.pull_request.head.sha" in checkout["with"]["ref"]
    unlabel = wf["jobs"]["unlabel"]
    assert "synchronize" in unlabel["if"] and "--remove-label run-gpu" in unlabel["steps"][0]["run"]
    assert not any("checkout" in s.get("uses", "") for s in unlabel["steps"])
    runs = " ".join(step.get("run", "") for step in job["steps"])
    # what fits the runner: NCCL where it has a GPU per rank, the emulated cluster (said so) elsewhere
    assert "nvidia-smi" in runs and "labkit doctor" in runs and "labkit run --cluster auto" in runs
    assert "tests/gpu_check.sh" in runs and any("upload-artifact" in s.get("uses", "") for s in job["steps"])


def test_the_readmes_jupyterlab_serves_the_checkout_so_every_link_in_a_lab_opens() -> None:
    """The README's `jupyter lab` command must keep the checkout as the server's root (given only a notebook,
    JupyterLab serves that notebook's folder), and every relative link in a lab, read from the learner's
    copy `my-labs/` beside `labs/`, must name a file of the checkout (issue 44: links to ../labkit were
    404s)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    (command,) = [line for line in readme.splitlines() if line.startswith("jupyter lab ")]
    assert "--ServerApp.root_dir=." in command.split(), command
    my_labs = REPO / "my-labs"  # where `cp -r labs my-labs` puts the copy: the same depth as labs/
    broken = []
    for nb_path in sorted((REPO / "labs").glob("*.ipynb")):
        nb = json.loads(nb_path.read_text(encoding="utf-8"))
        for cell in nb["cells"]:
            if cell["cell_type"] != "markdown":
                continue
            for target in re.findall(r"\]\((?!https?:|#|mailto:)([^)\s#]+)", "".join(cell["source"])):
                path = (my_labs / target).resolve()
                if REPO.resolve() not in path.parents or not path.exists():
                    broken.append(f"{nb_path.name}: {target}")
    assert not broken, f"links that would not open from my-labs/: {broken}"
