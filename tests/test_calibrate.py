"""labkit.calibrate: one CPU figure per machine, measured in CPU time, cached, overridable."""

from __future__ import annotations

import json

import pytest

from labkit import calibrate


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(calibrate.ENV, raising=False)
    calibrate._cached_calibration.cache_clear()
    yield
    calibrate._cached_calibration.cache_clear()


def test_measured_once_then_read_from_the_cache(monkeypatch):
    calls = []
    monkeypatch.setattr(calibrate, "measure_cpu_gflops", lambda: calls.append(1) or 42.0)
    first = calibrate.cpu_gflops()
    assert (first.gflops, first.source) == (42.0, "measured") and len(calls) == 1
    assert json.loads(calibrate.cache_path().read_text()) == {calibrate.machine_key(): 42.0}
    calibrate._cached_calibration.cache_clear()  # a new process on the same machine
    again = calibrate.cpu_gflops()
    assert (again.gflops, again.source) == (42.0, "cache") and len(calls) == 1
    assert "cached in" in again.describe()


def test_recalibrate_measures_again_and_rewrites_the_cache(monkeypatch):
    values = iter([10.0, 20.0])
    monkeypatch.setattr(calibrate, "measure_cpu_gflops", lambda: next(values))
    assert calibrate.cpu_gflops().gflops == 10.0
    assert calibrate.cpu_gflops(recalibrate=True).gflops == 20.0
    assert calibrate.cpu_gflops().gflops == 20.0


def test_the_environment_variable_wins_and_is_checked(monkeypatch):
    monkeypatch.setenv(calibrate.ENV, "33.5")
    cal = calibrate.cpu_gflops()
    assert (cal.gflops, cal.source) == (33.5, calibrate.ENV)
    calibrate._cached_calibration.cache_clear()
    monkeypatch.setenv(calibrate.ENV, "fast")
    with pytest.raises(ValueError, match="LABKIT_CPU_GFLOPS='fast'"):
        calibrate.cpu_gflops()


def test_a_real_measurement_is_plausible():
    assert 0.5 < calibrate.measure_cpu_gflops(size=256, repeats=3) < 10_000


def test_emulated_cluster_says_where_its_figure_came_from(monkeypatch):
    from labkit import Cluster

    monkeypatch.setenv(calibrate.ENV, "50")
    cluster = Cluster.emulated()
    assert cluster.cpu_gflops == 50.0 and "$LABKIT_CPU_GFLOPS" in cluster.describe()
    assert cluster.intra_node.bandwidth_gb_s == pytest.approx(50 / 1000)
