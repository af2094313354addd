"""On a CUDA machine: NCCL collectives, the memory estimate against CUDA's allocator, a CUDA trace, and each
solution notebook on `cluster="gpu"` at the world size the machine has. Marked `gpu`: skipped, saying why,
where there is no GPU (conftest.py). `tests/gpu_check.sh` runs them and prints a table."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from labkit import Cluster, launch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _sum_on_gpu(offset: int) -> tuple[float, str, str]:
    from labkit import runtime

    dev = runtime.device()
    t = torch.full((1 << 20,), float(dist.get_rank() + offset), device=dev)
    dist.all_reduce(t)
    return t[0].item(), str(t.device), str(dev)


@pytest.mark.parametrize("world_size", [1, 2])
def test_nccl_all_reduce(world_size):
    if world_size > _gpus():
        pytest.skip(f"{world_size} GPUs asked, {_gpus()} here")
    results = launch(_sum_on_gpu, 1, world_size=world_size, cluster="gpu", timeout_s=120)
    want = sum(r + 1 for r in range(world_size))
    assert [r[0] for r in results] == [want] * world_size
    assert all(r[1].startswith("cuda") for r in results)


def _estimate_vs_allocator(micro_batch: int) -> dict:
    """One rank: the peak of a training step net of what the process held before it, against the estimate."""
    from labkit.experiments.common import seeded_model
    from labkit.memory import estimate
    from labkit.models import GPTConfig, synthetic_batch

    config = GPTConfig(n_layers=4, d_model=256, n_heads=8, vocab_size=8192, seq_len=256)
    dev = torch.device("cuda", torch.cuda.current_device())
    model = seeded_model(config, 0, dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = synthetic_batch(config, micro_batch, device=dev)
    model(x, y).backward()  # warm-up: cuBLAS workspaces, Adam's states, the allocator's first segments
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    baseline = (
        torch.cuda.memory_allocated(dev)
        - sum(p.numel() * p.element_size() for p in model.parameters())
        - sum(
            v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
        )
    )
    torch.cuda.reset_peak_memory_stats(dev)
    model(x, y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(dev) - baseline
    want = estimate(model=config, micro_batch=micro_batch, precision="fp32", optimizer="adam").peak
    return {"peak": peak, "estimate": want, "baseline": baseline}


def test_the_memory_estimate_is_within_10_percent_of_cuda_net_of_the_baseline():
    if _gpus() < 1:
        pytest.skip("no GPU")
    (r,) = launch(_estimate_vs_allocator, 8, world_size=1, cluster="gpu", timeout_s=300)
    assert abs(r["peak"] - r["estimate"]) <= 0.1 * r["estimate"], r


def _traced_steps(path: str) -> str:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit import runtime
    from labkit.experiments.common import seeded_model
    from labkit.models import GPTConfig, synthetic_batch
    from labkit.trace import capture

    config = GPTConfig(n_layers=2, d_model=256, n_heads=8, vocab_size=8192, seq_len=256)
    dev = runtime.device()
    model = DDP(seeded_model(config, 0, dev), device_ids=[dev.index])
    x, y = synthetic_batch(config, 8, device=dev)

    def step() -> None:
        model(x, y).backward()

    return str(capture(step, steps=2, warmup=1, path=Path(path) / "trace_rank{rank}.json"))


def test_a_cuda_trace_is_read_from_its_kernels(tmp_path):
    if _gpus() < 1:
        pytest.skip("no GPU")
    from labkit.trace import analyze, overlap, read_trace

    (path,) = launch(_traced_steps, str(tmp_path), world_size=1, cluster="gpu", timeout_s=300)
    (b,) = analyze([path])
    assert b.source == "GPU kernels" and b.compute_ms > 0 and b.step_ms > 0
    assert 0 <= overlap(read_trace(path))["overlap_pct"] <= 100


SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
# what each lab needs: labs 01 and 04 plan nodes and pipeline stages the emulated cluster holds; with fewer
# GPUs than a lab's ranks, "gpu" is refused and "auto" picks the emulated cluster, as a learner's would
NEEDS = {
    "00_cluster_tour": 2,
    "01_parallelism_choice": 8,
    "02_oom_batch": 2,
    "03_unoverlapped_comms": 2,
    "04_imbalanced_pipeline": 4,
    "05_unprofiled_run": 2,
    "06_capstone": 2,
}


@pytest.mark.parametrize("nb", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_each_solution_notebook_on_the_gpus_there_are(nb, tmp_path):
    import papermill
    from test_labs import SMALL, _check_records

    from labkit.records import read_records

    need = NEEDS.get(nb.stem, 2)
    cluster = "gpu" if _gpus() >= need else "auto"
    params = {**SMALL.get(nb.stem, {}), "cluster": cluster}
    papermill.execute_notebook(
        str(nb),
        str(tmp_path / nb.name),
        parameters=params,
        cwd=str(tmp_path),
        kernel_name="python3",
        execution_timeout=300,
        progress_bar=False,
    )
    rec = read_records(tmp_path / nb.name)
    if cluster == "auto" and Cluster.resolve("auto", need).is_emulated:
        _check_records(nb.stem, rec)  # the emulated run's own targets
    else:
        assert rec.get("emulated") is not True and all(k in rec for k in ("before", "after", "limit", "unit"))


# labs whose script runs on one rank too; the others need two (a collective, a straggler, a data-parallel job)
ONE_RANK_SCRIPTS = {"oom_batch", "unoverlapped_comms", "parallelism_choice"}


@pytest.mark.parametrize(
    "module",
    [
        "cluster_tour",
        "parallelism_choice",
        "oom_batch",
        "unoverlapped_comms",
        "imbalanced_pipeline",
        "unprofiled_run",
        "capstone",
    ],
)
def test_each_lab_script_under_torchrun_on_the_gpus_there_are(module, tmp_path):
    import json
    import subprocess
    import sys

    from test_scripts import _argv

    n = _gpus()
    if n < 2 and module not in ONE_RANK_SCRIPTS:
        pytest.skip(f"labkit.experiments.{module} needs 2 ranks, {n} GPU here")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(min(n, 4)),
            "-m",
            f"labkit.experiments.{module}",
            *_argv(module, tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rec = json.loads((tmp_path / f"{module}.json").read_text())
    assert rec["torchrun"] is True and rec["emulated"] is False and "measured on GPU" in rec["where"]
    assert all(k in rec for k in ("before", "after", "limit", "unit"))


def test_bandwidth_test_times_collectives_on_the_gpu_with_cuda_events():
    from labkit.bandwidth import bandwidth_test

    if _gpus() < 1:
        pytest.skip("no GPU")
    n = min(_gpus(), 2)
    rows = launch(bandwidth_test, [1 << 16, 1 << 26], iters=10, world_size=n, cluster="gpu", timeout_s=120)[0]
    assert all(r["time_ms"] > 0 for r in rows) and rows[1]["time_ms"] > rows[0]["time_ms"]
    if n > 1:
        assert rows[1]["busbw_GBps"] > rows[0]["busbw_GBps"]
