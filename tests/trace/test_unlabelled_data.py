"""`diagnose` finds per-sample data work in jobs written as learners write them, with no labkit label in
them: a tokenizer in a `torch.utils.data.Dataset`'s `__getitem__` behind a DataLoader (num_workers=0), the
same work inline before the forward, and neither (clean), on 2 emulated ranks under torch DDP, at two model
sizes. The tokenizer is sized to about half of a forward and backward on this machine."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import launch
from labkit.models import GPTConfig, seeded_model, synthetic_batch
from labkit.trace import capture, diagnose

TEXT = "the quick brown fox jumps over the lazy dog " * 2


def _tokenize(config: GPTConfig, passes: int) -> list[int]:
    tokens: list[int] = []
    for _ in range(passes):  # a slow tokenizer: Python work per sample, no torch operator in it
        tokens = [ord(c) % config.vocab_size for c in TEXT]
    return (tokens * config.seq_len)[: config.seq_len + 1]


class _Texts(torch.utils.data.Dataset):
    def __init__(self, config: GPTConfig, n: int, passes: int) -> None:
        self.config, self.n, self.passes = config, n, passes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tensor(_tokenize(self.config, self.passes))
        return t[:-1], t[1:]


def _jobs(config: GPTConfig, trace_dir: str, batch: int) -> None:
    model = DDP(seeded_model(config, 0, torch.device("cpu")))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = synthetic_batch(config, batch, seed=dist.get_rank())

    def train(x, y):
        opt.zero_grad()
        model(x, y).backward()
        opt.step()

    t0 = time.thread_time()
    for _ in range(3):
        train(x, y)
    step_s = (time.thread_time() - t0) / 3
    t0 = time.thread_time()
    _tokenize(config, 20)
    # the work costs about one and a half steps' compute: at this size the emulated link's waits are half the
    # step; one step's worth read 22-23 % of the step in runs here but once below diagnose's 15 % in a busy
    # full suite (its size is timed on three steps), and half a step's 13-20 %: one and a half keeps a margin
    passes = max(1, round(1.5 * step_s / batch / ((time.thread_time() - t0) / 20)))
    passes = int(torch.tensor(passes).max())  # every rank alike (a local value is enough here)

    # three traced steps: diagnose takes each rank's median step, and a median of two is their mean, which one
    # step slowed by a busy runner pushed past the straggler ratio on the clean job
    warmup, steps = 1, 3
    texts = _Texts(config, (warmup + steps) * batch, passes)  # one batch per captured step
    loader = iter(torch.utils.data.DataLoader(texts, batch_size=batch))

    def with_loader():
        train(*next(loader))

    def inline():
        rows = [torch.tensor(_tokenize(config, passes)) for _ in range(batch)]
        t = torch.stack(rows)
        train(t[:, :-1], t[:, 1:])

    for name, step in (("clean", lambda: train(x, y)), ("dataloader", with_loader), ("inline", inline)):
        capture(step, steps=steps, warmup=warmup, path=Path(trace_dir) / name / "trace_rank{rank}.json")


@pytest.mark.parametrize("d_model", [32, 96])
def test_diagnose_names_unlabelled_data_work_in_a_dataloader_and_inline(tmp_path, d_model):
    config = GPTConfig(n_layers=2, d_model=d_model, n_heads=4, vocab_size=256, seq_len=32)
    launch(_jobs, config, str(tmp_path), 4, world_size=2, cluster="cpu", timeout_s=120)
    found = {name: diagnose(tmp_path / name) for name in ("clean", "dataloader", "inline")}
    assert found["clean"].kind == "none", str(found["clean"])
    for name in ("dataloader", "inline"):
        assert found[name].kind == "data_loading", f"{name}: {found[name]}"
    # inline, it is Python work before the forward, outside any torch operator
    assert all(b.host_python_ms > 0.5 * b.data_ms for b in found["inline"].breakdown), str(found["inline"])
    assert all(b.host_python_ms < 0.2 * b.data_ms for b in found["dataloader"].breakdown)
