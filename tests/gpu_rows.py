"""The one-rank rows of tests/gpu_check.sh: what a single GPU can check of the labs, in a few minutes, each
against what the course predicts for it. `python tests/gpu_rows.py` runs them in one rank (the GPU where
there is one, else the emulated cluster at the labs' emulated sizes, to try the rows themselves), prints one
table and exits 1 if a row failed.

Rows: the warm baseline; lab 02's fixed step against its estimate (uncapped) and its OOM and fix under the
cap; the batch finder; the fragmentation pattern with each allocator option; the precisions; lab 04's layer
costs at its GPU sizes (the head heavier than a block); lab 03's compute at its GPU sizes against its
forecast. A row that raises is a failed row, with the error's first line.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not an install

import torch

import labkit
from labkit import device_memory

Row = tuple[str, str, bool, float]  # check, what was measured, passed, seconds
MiB = 2**20


def _lab02(on_gpu: bool) -> tuple[str, bool]:
    from labkit.experiments.oom_batch import Params, dp_train, fixed_micro_batch

    p = Params(world_size=1).resolve(on_gpu=on_gpu)
    micro, est = fixed_micro_batch(p)
    r = dp_train(p.config(), p.global_batch, micro, precision="autocast", checkpointing=True)
    ratio = est.peak / r.peak_bytes
    return f"micro-batch {micro}: estimate {est.peak / MiB:.1f} MiB / peak {r.peak_mib:.1f} = {ratio:.3f}", (
        abs(ratio - 1) < 0.10
    )


def _lab02_capped(on_gpu: bool) -> tuple[str, bool]:
    from labkit.experiments.oom_batch import Params, dp_train, fixed_micro_batch

    p = Params(world_size=1).resolve(on_gpu=on_gpu)
    micro, _ = fixed_micro_batch(p)
    limit = int(p.memory_mib * MiB)
    try:
        with device_memory.memory_limit(limit):
            dp_train(p.config(), p.global_batch, p.global_batch)
        written = "fits"
    except torch.OutOfMemoryError:
        written = "OOM"
    with device_memory.memory_limit(limit):
        fixed = dp_train(p.config(), p.global_batch, micro, precision="autocast", checkpointing=True)
    return f"{p.memory_mib} MiB: as written {written}, fixed {fixed.peak_mib:.1f} MiB", written == "OOM"


def _finder(on_gpu: bool) -> tuple[str, bool]:
    from labkit.experiments.oom_batch import Params, max_micro_batch

    p = Params(world_size=1).resolve(on_gpu=on_gpu)
    with device_memory.memory_limit(int(p.memory_mib * MiB)):
        found = max_micro_batch(p.config(), precision="autocast", checkpointing=True, limit=256)
    measured = f"largest micro-batch {found.batch} in {len(found.trials)} trials ({p.memory_mib} MiB)"
    return measured, found.batch >= 1


def _fragmentation(fix: str | None) -> Callable[[bool], tuple[str, bool]]:
    def row(on_gpu: bool) -> tuple[str, bool]:
        from labkit.experiments.fragmentation import fragment

        r = fragment(180, fix)
        expect_oom = fix in (None, "empty_cache")
        return (
            f"{'OOM' if r['oom'] else 'fits'}, largest free block {r['largest_free_block_mib']:.0f} MiB",
            (r["oom"] is not None) == expect_oom,
        )

    return row


def _precisions(on_gpu: bool) -> tuple[str, bool]:
    from labkit.experiments.precision import compare_precisions
    from labkit.models import GPTConfig

    small = GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=32)
    r = compare_precisions(small, 4, steps=2)
    return f"ran: {', '.join(sorted(map(str, r)))[:60]}", True


def _lab04_layers(on_gpu: bool) -> tuple[str, bool]:
    from labkit.experiments.imbalanced_pipeline import Params
    from labkit.layer_profile import profile_layers
    from labkit.models import seeded_model, synthetic_batch

    p = Params().resolve(on_gpu=on_gpu)
    config = p.config()
    dev = labkit.device()
    micro = max(1, p.global_batch // p.stages)  # one micro-batch of the 1F1B split
    x, y = synthetic_batch(config, micro, device=dev)
    layers = profile_layers(seeded_model(config, device=dev), x, y, repeats=3)
    head, blocks = layers[-1].ms, [la.ms for la in layers[1:-1]]
    ratio = head / (sum(blocks) / len(blocks))
    return f"head {head:.2f} ms = {ratio:.1f} blocks of {sum(blocks) / len(blocks):.2f} ms", ratio > 1.3


def _lab03_compute(on_gpu: bool) -> tuple[str, bool]:
    from labkit import Cluster
    from labkit.experiments.unoverlapped_comms import Params
    from labkit.forecast import fp32_flops_per_s, overlap_forecast
    from labkit.models import seeded_model, synthetic_batch

    if not on_gpu:
        return "skipped: the forecast is a GPU's", True
    p = Params(world_size=2).resolve(on_gpu=True)
    config, dev = p.config(), labkit.device()
    model = seeded_model(config, device=dev)
    x, y = synthetic_batch(config, p.micro_batch, device=dev)
    times = []
    for _ in range(4):
        t0 = labkit.clock()
        model(x, y).backward()
        times.append((labkit.clock() - t0) * 1e3)
    name = torch.cuda.get_device_name(dev)
    rate = fp32_flops_per_s(name) or fp32_flops_per_s("H100")
    link = Cluster.preset("dgx-h100").intra_node
    f = overlap_forecast(config, p.micro_batch, 2, link, rate, bucket_cap_mb=p.bucket_cap_mb)
    measured = sorted(times)[len(times) // 2]
    ratio = measured / f.terms["compute"]
    return f"fwd+bwd {measured:.1f} ms, forecast {f.terms['compute']:.1f} ms ({ratio:.2f}x, {name})", (
        0.5 < ratio < 2
    )


ROWS: list[tuple[str, Callable[[bool], tuple[str, bool]]]] = [
    ("lab 02: estimate vs measured peak, fixed step, uncapped", _lab02),
    ("lab 02: under the cap, the step as written OOMs and the fix fits", _lab02_capped),
    ("lab 02: the batch finder under the cap", _finder),
    *[(f"fragmentation: {fix or 'as written'}", _fragmentation(fix)) for fix in
      (None, "empty_cache", "expandable_segments", "max_split_size")],
    ("precisions: fp32, bf16 and fp16 autocast", _precisions),
    ("lab 04: layer costs at its GPU sizes (the heavy head)", _lab04_layers),
    ("lab 03: compute at its GPU sizes vs the forecast", _lab03_compute),
]


def rows() -> list[Row]:
    """Every row, on this rank."""
    on_gpu = labkit.device().type == "cuda"
    base = device_memory.baseline_bytes()
    baseline = ("warm baseline (cuBLAS workspaces)", f"{base / MiB:.1f} MiB", base > 0 or not on_gpu, 0.0)
    out: list[Row] = [baseline]
    for name, row in ROWS:
        t0 = time.perf_counter()
        try:
            measured, ok = row(on_gpu)
        except Exception as exc:  # a failed row, not a failed table
            measured, ok = f"{type(exc).__name__}: {str(exc).splitlines()[0][:70] if str(exc) else ''}", False
        out.append((name, measured, ok, time.perf_counter() - t0))
    return out


def main() -> int:
    cluster = labkit.Cluster.resolve("auto", 1)
    (table,) = labkit.launch(rows, world_size=1, cluster=cluster, timeout_s=300)
    print(f"\none rank on {cluster.label}: {'check':62} {'result':6} {'s':>5}  measured")
    for name, measured, ok, seconds in table:
        print(f"{name[:62]:62} {'pass' if ok else 'FAIL':6} {seconds:5.1f}  {measured}")
    return 0 if all(ok for _, _, ok, _ in table) else 1


if __name__ == "__main__":
    sys.exit(main())
