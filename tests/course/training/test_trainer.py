"""labkit.course.training.trainer: one rank's run of a `TrainingJob` on 2 emulated ranks. After one optimizer
step every gradient sync that averages ("ddp", "overlapped", "per_tensor") gives the single-process
reference's gradients, loss and updated weights (`labkit.course.training.reference`), with and without
gradient accumulation (the micro-steps but the last under `no_sync`: one round of collectives per step); a
learner's `accumulate` runs the micro-batches instead, and one that skips a micro-batch is told so."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labkit import launch
from labkit.course.training.job import TrainingJob
from labkit.course.training.reference import max_abs_diff, reference_backward, reference_gradients
from labkit.course.training.trainer import Trainer
from labkit.models import GPTConfig, seeded_model

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = GPTConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=64, seq_len=16)
GLOBAL_BATCH, LR = 8, 0.1
N_TENSORS = 2 * 12 + 5  # 12 per block; tok_emb, pos_emb, ln_f (2), lm_head
SYNCS = ("ddp", "overlapped", "per_tensor")


def _job(grad_sync: str, micro_batch: int) -> TrainingJob:
    return TrainingJob(
        global_batch=GLOBAL_BATCH,
        micro_batch=micro_batch,
        optimizer="sgd",
        lr=LR,
        grad_sync=grad_sync,
        bucket_cap_mb=0.01,  # several buckets for ddp and overlapped
    )


def _my_accumulate(module, batches) -> None:
    """Lab 02's exercise, done right: every micro-step but the last under no_sync, each loss / n."""
    n = len(batches)
    for x, y in batches[:-1]:
        with module.no_sync():
            (module(x, y) / n).backward()
    x, y = batches[-1]
    (module(x, y) / n).backward()


def _skips_one(module, batches) -> None:
    for x, y in batches[1:]:
        module(x, y).backward()


def _one_step(trainer: Trainer, accumulate=None) -> dict:
    loss = trainer.forward_backward(accumulate)
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    counts = (trainer.sync.collectives, trainer.sync.in_backward)
    trainer.update()
    return {
        "loss": loss.item(),
        "grads": grads,
        "params": [p.detach().clone() for p in trainer.model.parameters()],
        "counts": counts,
        "acc": trainer.acc,
    }


def worker() -> dict:
    out = {}
    for sync in SYNCS:
        for micro_batch in (4, 2):  # all of the rank's share at once; two micro-batches accumulated
            out[sync, micro_batch] = _one_step(Trainer(_job(sync, micro_batch), CONFIG, steps=1))
    out["mine"] = _one_step(Trainer(_job("ddp", 2), CONFIG, steps=1), _my_accumulate)
    try:
        Trainer(_job("ddp", 2), CONFIG, steps=1).forward_backward(_skips_one)
        out["skipped"] = ""
    except ValueError as exc:
        out["skipped"] = str(exc)
    dist.barrier()  # the failed step left DDP's reducer mid-step on both ranks alike
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return launch(worker, world_size=2, cluster="cpu", timeout_s=120)


@pytest.fixture(scope="module")
def reference() -> tuple:
    ref = reference_gradients(CONFIG, GLOBAL_BATCH)
    model = seeded_model(CONFIG, 0)
    reference_backward(model, CONFIG, GLOBAL_BATCH)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return ref, model


def _check(per_rank: list[dict], reference: tuple, what: str) -> None:
    ref, stepped = reference
    for rank, r in enumerate(per_rank):
        assert r["grads"].keys() == ref.grads.keys(), what
        worst = max((r["grads"][n] - g).abs().max().item() for n, g in ref.grads.items())
        assert worst < 1e-5, f"{what}: rank {rank}'s gradients differ from one process's by {worst:.2e}"
        model = seeded_model(CONFIG, 0)
        with torch.no_grad():
            for p, q in zip(model.parameters(), r["params"]):
                p.copy_(q)
        assert max_abs_diff(model, stepped) < 1e-6, f"{what}: rank {rank}'s updated weights"
    # equal shares: the mean of the ranks' mean losses is the whole batch's
    assert sum(r["loss"] for r in per_rank) / len(per_rank) == pytest.approx(ref.loss, abs=1e-5), what


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("micro_batch", [4, 2], ids=["one micro-batch", "two accumulated"])
def test_one_step_matches_one_process(results, reference, sync, micro_batch):
    per_rank = [r[sync, micro_batch] for r in results]
    assert all(r["acc"] == GLOBAL_BATCH // 2 // micro_batch for r in per_rank)
    _check(per_rank, reference, f"{sync}, micro_batch {micro_batch}")


def test_accumulation_sends_one_round_of_collectives_per_step(results):
    for r in results:
        for sync in SYNCS:
            assert r[sync, 2]["counts"] == r[sync, 4]["counts"], sync  # no_sync: nothing sent early
        collectives, in_backward = r["per_tensor", 2]["counts"]
        assert (collectives, in_backward) == (N_TENSORS, 0)  # the mistake: one per gradient, after backward
        collectives, in_backward = r["overlapped", 2]["counts"]
        assert 1 < collectives < N_TENSORS and in_backward == collectives  # buckets, launched in backward
        # torch DDP's first step runs with one bucket of everything (it rebuilds them in gradient order after
        # it), all-reduced from its hook during backward
        collectives, in_backward = r["ddp", 2]["counts"]
        assert 1 <= collectives < N_TENSORS and in_backward == collectives


def test_a_learners_accumulate_runs_the_micro_batches(results, reference):
    _check([r["mine"] for r in results], reference, "accumulate")
    # the same all-reduces as the Trainer's own loop (a learner's backward is not marked as the step's last,
    # so only the count is compared)
    assert all(r["mine"]["counts"][0] == r["ddp", 2]["counts"][0] for r in results)
    for r in results:
        assert "accumulate ran 1 forward passes for 2 micro-batches" in r["skipped"]


def test_a_trainer_holds_data_for_its_steps_and_checks_its_job():
    def run() -> tuple[str, str]:
        trainer = Trainer(_job("per_tensor", 4), CONFIG, steps=1)
        trainer.step()
        try:
            trainer.step()
            ran_out = ""
        except RuntimeError as exc:
            ran_out = str(exc)
        try:
            Trainer(TrainingJob(global_batch=6, micro_batch=4), CONFIG, steps=1)
            refused = ""
        except ValueError as exc:
            refused = str(exc)
        return ran_out, refused

    for ran_out, refused in launch(run, world_size=2, cluster="cpu", timeout_s=60):
        assert "holds data for steps=1 optimizer steps" in ran_out
        assert "global_batch(6)" in refused
