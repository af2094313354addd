"""Lab 05 on real runs of the emulated cluster: diagnose names every planted bottleneck (and the straggler's
rank, on either rank), finds nothing in the clean job, and holds for two model sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from labkit import Cluster, launch
from labkit.experiments.unprofiled_run import mystery_runs
from labkit.models import GPTConfig
from labkit.trace import diagnose

PLANTED = [
    (None, "none"),
    ("straggler", "straggler"),
    ("data_loading", "data_loading"),
    ("small_collectives", "small_collectives"),
    ("sync_collective", "sync_collective"),
    ("host_sync", "none"),
]  # compute is synchronous on the emulated cluster: a host sync costs nothing


def _table(found) -> str:
    return "; ".join(
        f"rank {b.rank} ({b.source}): step {b.step_ms:.1f} compute {b.compute_ms:.1f} data {b.data_ms:.1f} "
        f"wait {b.wait_ms:.1f} ms, {b.collectives:.0f} collectives"
        for b in found.breakdown
    )


def _runs(config, plan, tmp_path, **kw):
    per_rank = launch(
        mystery_runs,
        config,
        plan,
        str(tmp_path),
        steps=2,
        trace_steps=3,
        world_size=2,
        cluster=Cluster.emulated(gpus_per_node=2),
        timeout_s=120,
        deadline_s=300,
        **kw,
    )
    return [[rank[i] for rank in per_rank] for i in range(len(plan))]


@pytest.mark.parametrize("n_layers,d_model", [(2, 64), (4, 128)])
def test_diagnose_names_every_planted_bottleneck(n_layers, d_model, tmp_path):
    config = GPTConfig(n_layers=n_layers, d_model=d_model, n_heads=4, vocab_size=2048, seq_len=64)
    plan = [(b, False) for b, _ in PLANTED]
    for (planted, expected), run in zip(PLANTED, _runs(config, plan, tmp_path)):
        found = diagnose(Path(run[0]["traces"]))
        assert found.kind == expected, f"{planted}: diagnosed {found}; {_table(found)}"
        if expected == "straggler":
            assert found.rank == 1 and "rank 1 computes" in found.evidence
        assert len(found.breakdown) == 2 and found.breakdown[0].source == "emulated device timeline"


def test_a_straggler_on_rank_0_and_the_fixes(tmp_path):
    config = GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=2048, seq_len=64)
    kinds = ["straggler", "data_loading", "small_collectives", "sync_collective"]
    plan = [(k, False) for k in kinds] + [(k, True) for k in kinds]
    runs = _runs(config, plan, tmp_path, straggler_rank=0)
    found = diagnose(Path(runs[0][0]["traces"]))
    assert (found.kind, found.rank) == ("straggler", 0), str(found)
    for i, kind in enumerate(kinds):  # virtual time: the fixed job is faster than the planted one
        before = max(r["median_ms"] for r in runs[i])
        after = max(r["median_ms"] for r in runs[len(kinds) + i])
        assert after < before, f"{kind}: fixed {after:.1f} ms, planted {before:.1f} ms"
        fixed = diagnose(Path(runs[len(kinds) + i][0]["traces"]))
        assert fixed.kind == "none", f"{kind} fixed: {fixed}; {_table(fixed)}"
    with pytest.raises(ValueError, match="bottleneck"):
        mystery_runs(config, [("slow_disk", False)], str(tmp_path))
