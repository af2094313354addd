"""In a real browser: JupyterLab on localhost, driven in Debian's Chromium by Playwright.

The notebook is made of lab 02's own cells, taken from `labs/02_oom_batch.ipynb` as they are (the memory
calculator, then the quiz), after one import cell: the whole lab would stop at its first exercise stub. The
test runs them with Run All Cells and sees the calculator render, every control's description whole and its
sliders on llama2-7b's shape (32 layers of 4096); moves the layers slider and sees the model become "custom"
and the estimate change, chooses llama2-7b again and sees its values back, moves the dp slider and sees the
estimate change, then answers a quiz question and sees the feedback. Skipped, with the reason, where Chromium
or Playwright is missing (`.ci/run` installs both)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TOKEN = "labkit-browser-test"


def _why_not() -> str | None:
    if CHROMIUM is None:
        return "Debian's chromium is not installed (apt-get install -y chromium; .ci/run tries it)"
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (pip install -e '.[test]')"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))


def _lab_cells(*needles: str) -> list[dict]:
    nb = json.loads((ROOT / "labs" / "02_oom_batch.ipynb").read_text())
    cells = [
        c for c in nb["cells"] if c["cell_type"] == "code" and any(n in "".join(c["source"]) for n in needles)
    ]
    assert len(cells) == len(needles), f"lab 02 should hold one cell for each of {needles}"
    return cells


def _notebook(path: Path) -> None:
    cells = [
        {
            "cell_type": "code",
            "metadata": {},
            "execution_count": None,
            "outputs": [],
            "source": ["import labkit\n", "from labkit.course import lab02"],
        }
    ]
    cells += _lab_cells("lab02.widgets.memory_calculator(", "lab02.quiz.show(")
    for i, c in enumerate(cells):
        c["id"] = f"cell{i}"
        c["outputs"], c["execution_count"] = [], None
    nb = {
        "cells": cells,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path):
    """JupyterLab serving `tmp_path` on localhost; yields its URL; stopped with its kernels afterwards."""
    _notebook(tmp_path / "browser_check.ipynb")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "LABKIT_TEXT_ONLY"}  # a browser looks at this kernel
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["JUPYTER_CONFIG_DIR"] = str(tmp_path / "config")  # no user settings, no "what's new" pop-ups
    log = open(tmp_path / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            f"--port={port}",
            "--ip=127.0.0.1",
            f"--IdentityProvider.token={TOKEN}",
            f"--ServerApp.root_dir={tmp_path}",
            "--allow-root",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail(
                        f"JupyterLab did not start: {(tmp_path / 'jupyterlab.log').read_text()[-2000:]}"
                    )
                time.sleep(0.3)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the kernels it started
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_a_lab_runs_its_calculator_and_quiz_in_chromium(jupyterlab):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(90_000)
            expect.set_options(timeout=90_000)  # the kernel imports torch first: seconds on a busy runner
            page.goto(f"{jupyterlab}/lab/tree/browser_check.ipynb?token={TOKEN}")
            expect(page.locator(".jp-Notebook .jp-Cell").first).to_be_visible()
            # the status bar says when the kernel is connected and idle; Run All before that runs nothing
            expect(
                page.get_by_role("button", name=re.compile(r"Python 3 \(ipykernel\) \| Idle"))
            ).to_be_visible()
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_role("menuitem", name=re.compile("^Run All Cells")).click()

            message = page.locator(".widget-html-content", has_text="per GPU").first
            expect(message).to_contain_text("fits")  # the calculator rendered, with its estimate
            expect(page.locator(".jupyter-widgets .widget-output img").first).to_be_visible()  # and its bar
            calculator = page.locator(".widget-hbox", has=page.locator(".widget-slider")).first
            labels = calculator.locator("label.widget-label")
            # issue 28: "micro-bat…": every description is whole (no ellipsis: its text fits its box)
            cut = labels.evaluate_all(
                "els => els.filter(e => e.scrollWidth > e.clientWidth).map(e => e.textContent)"
            )
            assert cut == [], f"descriptions cut off: {cut}"
            assert {"micro-batches", "sequence length"} <= set(labels.all_inner_texts())

            def slider(name: str):
                return calculator.locator(
                    ".widget-slider", has=page.locator("label", has_text=re.compile(f"^{name}$"))
                )

            model = calculator.locator(
                ".widget-dropdown", has=page.locator("label", has_text="model")
            ).locator("select")
            # issue 28: llama2-7b's sliders showed 24 layers and 2048 wide, and moving them changed nothing
            expect(model).to_have_value("llama2-7b")
            expect(slider("layers").locator(".widget-readout")).to_have_text("32")
            expect(slider("hidden").locator(".widget-readout")).to_have_text("4096")
            before = message.inner_text()
            handle = slider("layers").locator(".noUi-handle").first
            handle.focus()
            handle.press("ArrowRight")  # 32 -> 33 layers: a custom model from llama2-7b
            expect(model).to_have_value("custom")
            expect(message).to_contain_text("custom (33 layers, hidden 4096")
            model.select_option("llama2-7b")  # the preset again: its values back on the sliders
            expect(slider("layers").locator(".widget-readout")).to_have_text("32")
            expect(message).to_have_text(before)

            handle = slider("dp").locator(".noUi-handle").first
            handle.focus()
            handle.press("ArrowLeft")  # dp 8 -> 4: with ZeRO-1 each GPU holds more optimizer state
            expect(message).not_to_have_text(before)

            question = page.locator(".widget-vbox:has(> .widget-radio)").first  # one question's box
            question.locator(".widget-radio-box input").first.check()
            question.get_by_role("button", name="Check").click()
            expect(
                question.locator(".widget-html-content", has_text=re.compile("Right|Not quite"))
            ).to_be_visible()
        finally:
            browser.close()
