"""labkit.parallel.data: OverlappedDDP and the naive all-reduce against single-process training (2 gloo
ranks).

Each rank trains on half of the batch; the reference trains one model on the full batch. With the loss
averaged over the batch, averaged gradients equal the full-batch gradient, so parameters must match at
every step (cs336 assignment 2 style).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit.parallel.data import OverlappedDDP, allreduce_gradients_naive

STEPS = 5
BATCH, SEQ, VOCAB, DIM = 8, 4, 10, 16
TWO_BUCKET_CAP_MB = 1100 / 2**20  # hidden.bias + hidden.weight (1088 B) | emb.weight (640 B)
TINY_CAP_MB = 1e-6  # one bucket per parameter


class TiedNet(nn.Module):
    """Embedding tied to the LM head, a frozen layer, optionally a layer never used."""

    def __init__(self, with_unused: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        if with_unused:
            self.unused = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter, two uses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(torch.tanh(self.hidden(self.emb(x)))))


# name, optimizer, bucket cap, unused layer, expected buckets, expected launched in backward
CASES = [
    ("one_bucket_sgd", "sgd", 25.0, False, 1, 1),
    ("one_bucket_adam", "adam", 25.0, False, 1, 1),
    ("two_buckets_sgd", "sgd", TWO_BUCKET_CAP_MB, False, 2, 2),
    ("two_buckets_adam", "adam", TWO_BUCKET_CAP_MB, False, 2, 2),
    ("many_buckets_sgd", "sgd", TINY_CAP_MB, False, 3, 3),
    ("many_buckets_adam", "adam", TINY_CAP_MB, False, 3, 3),
    # the unused layer's bias is bucket 0 (reverse order): it holds every bucket back until
    # finish_gradient_synchronization, which flushes all five
    ("unused_param_adam", "adam", TINY_CAP_MB, True, 5, 0),
]
GROUPS = ["default", "gloo"]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(123)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    return (
        torch.optim.SGD(params, lr=0.1, momentum=0.9) if name == "sgd" else torch.optim.Adam(params, lr=1e-2)
    )


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _reference(opt_name: str, with_unused: bool) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    model = TiedNet(with_unused)
    opt = _optimizer(opt_name, model.parameters())
    history = []
    for x, y in _batches():
        opt.zero_grad(set_to_none=True)
        _loss(model, x, y).backward()
        opt.step()
        history.append(_snapshot(model))
    return history


def _my_half(t: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def worker_overlapped() -> dict:
    """Every case on this rank, on the default group (launch's emulated link over gloo) and
    on a plain gloo group passed explicitly; rank 1 starts from other weights (broadcast)."""
    groups = {"default": None, "gloo": dist.new_group(backend="gloo")}
    out = {}
    for (name, opt_name, cap, with_unused, _, _), group in itertools.product(CASES, GROUPS):
        torch.manual_seed(dist.get_rank())
        model = OverlappedDDP(TiedNet(with_unused), bucket_cap_mb=cap, process_group=groups[group])
        opt = _optimizer(opt_name, model.parameters())
        history, counts = [], []
        for x, y in _batches():
            opt.zero_grad(set_to_none=True)
            _loss(model, _my_half(x), _my_half(y)).backward()
            model.finish_gradient_synchronization()
            opt.step()
            history.append(_snapshot(model))
            counts.append((len(model.buckets), model.num_collectives, model.launched_in_backward))
        out[name, group] = {"history": history, "counts": counts, "spans": len(model.comm_log)}
    out["no_sync"] = _accumulate_with_no_sync()
    out["twice"] = _backward_twice_error()
    out["api"] = _exercise_api()
    return out


def _accumulate_with_no_sync() -> dict:
    """Two micro-batches per step: the first backward under no_sync(), the second synced."""
    torch.manual_seed(dist.get_rank())
    model = OverlappedDDP(TiedNet(), bucket_cap_mb=TWO_BUCKET_CAP_MB)
    opt = _optimizer("adam", model.parameters())
    history, counts = [], []
    for x, y in _batches():
        opt.zero_grad(set_to_none=True)
        (x0, x1), (y0, y1) = _my_half(x).chunk(2), _my_half(y).chunk(2)
        with model.no_sync():
            (_loss(model, x0, y0) / 2).backward()
        (_loss(model, x1, y1) / 2).backward()
        model.finish_gradient_synchronization()
        opt.step()
        history.append(_snapshot(model))
        counts.append(model.num_collectives)
    return {"history": history, "counts": counts}


def _backward_twice_error() -> str:
    from labkit.course.training.overlapped import CourseOverlappedDDP  # the course's check

    model = CourseOverlappedDDP(TiedNet())
    x, y = _batches()[0]
    _loss(model, x, y).backward()
    try:
        _loss(model, x, y).backward()  # forgot finish_gradient_synchronization()
    except RuntimeError as exc:
        return str(exc)
    finally:
        model.finish_gradient_synchronization()  # leave no collective behind
    return ""


def _exercise_api() -> dict:
    """The exercise's methods and attributes are public (a learner's subclass overrides them): each flush is
    seen, in index order, with `next_bucket` pointing at it; `no_sync()` clears `require_sync`."""
    from labkit.parallel.data import Bucket

    flushed = []

    class Recording(OverlappedDDP):
        def flush(self, bucket):
            flushed.append((bucket.index, self.next_bucket))
            super().flush(bucket)

    torch.manual_seed(dist.get_rank())
    model = Recording(TiedNet(), bucket_cap_mb=TINY_CAP_MB)
    with model.no_sync():
        inside = model.require_sync
    x, y = _batches()[0]
    _loss(model, _my_half(x), _my_half(y)).backward()
    model.finish_gradient_synchronization()
    return {
        "flushed": flushed,
        "inside": inside,
        "after": (model.require_sync, model.next_bucket),
        "buckets_are": {type(b) is Bucket for b in model.buckets},
        "bucket_of": all(
            any(q is p for q in model.bucket_of[id(p)].params)
            for p in model.module.parameters()
            if p.requires_grad
        ),
    }


def worker_naive() -> dict:
    torch.manual_seed(dist.get_rank())
    model = TiedNet(with_unused=True)
    with torch.no_grad():  # the naive version has no broadcast: start from rank 0's weights
        for p in model.parameters():
            dist.broadcast(p, src=0)
    opt = _optimizer("adam", model.parameters())
    history, counts = [], []
    for x, y in _batches():
        opt.zero_grad(set_to_none=True)
        _loss(model, _my_half(x), _my_half(y)).backward()
        counts.append(allreduce_gradients_naive(model))
        opt.step()
        history.append(_snapshot(model))
    return {"history": history, "counts": counts}


@pytest.fixture(scope="module")
def overlapped_results() -> list[dict]:
    from labkit.machine.launcher import launch

    return launch(worker_overlapped, world_size=2, cluster="cpu", timeout_s=120)


def _max_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_overlapped_ddp_matches_single_process(overlapped_results, case, group):
    name, opt_name, _, with_unused, buckets, in_backward = case
    ref = _reference(opt_name, with_unused)
    for rank, res in enumerate(overlapped_results):
        got = res[name, group]
        assert len(got["history"]) == STEPS
        for step, (mine, theirs) in enumerate(zip(got["history"], ref)):
            err = _max_err(mine, theirs)
            assert err < 1e-5, (
                f"{name} ({group} group): rank {rank} step {step} differs from the reference by {err:.2e}"
            )
        # one collective per bucket per step, launched during backward unless held back
        assert got["counts"] == [(buckets, buckets, in_backward)] * STEPS
        assert got["spans"] == buckets * STEPS


def test_no_sync_accumulation_matches_single_process(overlapped_results):
    ref = _reference("adam", with_unused=False)
    for rank, res in enumerate(overlapped_results):
        assert res["no_sync"]["counts"] == [2] * STEPS  # nothing launched under no_sync
        for step, (mine, theirs) in enumerate(zip(res["no_sync"]["history"], ref)):
            err = _max_err(mine, theirs)
            assert err < 1e-5, f"no_sync: rank {rank} step {step} differs by {err:.2e}"


def test_second_backward_without_finish_is_a_clear_error(overlapped_results):
    for res in overlapped_results:
        assert "finish_gradient_synchronization()" in res["twice"] and "no_sync()" in res["twice"]


def test_the_exercise_api_is_public(overlapped_results):
    for res in overlapped_results:
        api = res["api"]
        assert api["flushed"] == [
            (0, 0),
            (1, 1),
            (2, 2),
        ]  # one bucket per parameter: emb, hidden bias, weight
        assert api["inside"] is False and api["after"] == (True, 0)
        assert api["buckets_are"] == {True} and api["bucket_of"]


def test_naive_allreduce_matches_single_process():
    from labkit.machine.launcher import launch

    results = launch(worker_naive, world_size=2, cluster="cpu", timeout_s=60)
    ref = _reference("adam", with_unused=True)
    for rank, res in enumerate(results):
        # emb (tied, once), hidden weight + bias, unused weight + bias; frozen skipped
        assert res["counts"] == [5] * STEPS
        for step, (mine, theirs) in enumerate(zip(res["history"], ref)):
            err = _max_err(mine, theirs)
            assert err < 1e-5, f"naive: rank {rank} step {step} differs by {err:.2e}"


def test_bucket_cap_must_be_positive():
    with pytest.raises(ValueError, match="bucket_cap_mb=0"):
        OverlappedDDP(nn.Linear(2, 2), bucket_cap_mb=0)
