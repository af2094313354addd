"""A rank's training samples: its rows of each global batch (`labkit.course.training.reference.rank_rows`),
one sample at a time, tokenized once before training or, the mistake, as each is fetched.

`RankSamples(config, job, rank, world_size, steps)` holds the rank's rows of global batches 0..steps-1 in
order, so a `DataLoader` of `micro_batch` gives step s's micro-batches in turn: the same samples any split of
the same global batch sees. With `passes` > 0 each sample is written out as text and parsed back that many
times, in Python, when it is fetched, as a tokenizer run inside the training loop would; `prepare()` does
that work once, up front (the fix). `tokenizer_passes` sizes the tokenizer so that it costs a given share of
a step's compute on this machine, so that a planted data-loading bottleneck is one at any model size.
"""

from __future__ import annotations

import statistics

import torch
from torch import nn

from labkit.course.training.reference import rank_rows
from labkit.machine import _torch_compat as compat
from labkit.machine import timer
from labkit.models import GPTConfig, synthetic_batch

__all__ = ["RankSamples", "tokenizer_passes"]


class RankSamples(torch.utils.data.Dataset):
    """This rank's samples for `steps` optimizer steps (see the module docstring)."""

    def __init__(
        self,
        config: GPTConfig,
        global_batch: int,
        rank: int,
        world_size: int,
        steps: int,
        *,
        seed: int = 0,
        passes: int = 0,
    ) -> None:
        rows = [rank_rows(config, global_batch, rank, world_size, step=s, seed=seed) for s in range(steps)]
        self.x = torch.cat([x for x, _ in rows])
        self.y = torch.cat([y for _, y in rows])
        self.vocab = config.vocab_size
        self.passes = passes
        self._ready: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __len__(self) -> int:
        return len(self.x)

    def _tokenize(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.passes:  # nothing to parse: the sample as it is
            return self.x[i], self.y[i]
        if compat.is_fake(self.x):  # the Trainer refuses first, saying why (tokenize="in_loader")
            raise RuntimeError(f"a tokenizer in the loop (passes={self.passes}) needs real tokens")
        tokens = self.x[i].tolist()
        for _ in range(self.passes):  # text -> tokens, as a slow tokenizer would
            text = " ".join(f"t{t:05d}" for t in tokens)
            tokens = [int(word[1:]) % self.vocab for word in text.split()]
        return torch.tensor(tokens), self.y[i]

    def prepare(self) -> RankSamples:
        """Tokenize every sample now, before training (the fix)."""
        self._ready = [self._tokenize(i) for i in range(len(self))]
        return self

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._ready[i] if self._ready is not None else self._tokenize(i)


def tokenizer_passes(
    model: nn.Module, config: GPTConfig, samples: int, share: float, device: torch.device
) -> int:
    """Tokenizer passes per sample that cost about `share` of a forward and backward of `samples` samples,
    both on this rank's timer (`labkit.machine.timer.clock`). The forward and backward timed is the model's
    second: on a GPU the first loads each kernel (CUDA's lazy module loading) and picks cuBLAS algorithms,
    many times a warm step, which would size the tokenizer for a step the job never runs. The median of three
    timed ones: a single one varied by a fifth between calls on a busy 2-core machine."""
    x, y = synthetic_batch(config, samples, device=device)
    model(x, y).backward()  # warm, untimed
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(3):
        t0 = timer.clock()
        model(x, y).backward()
        times.append(timer.clock() - t0)
        model.zero_grad(set_to_none=True)
    step_s = statistics.median(times)
    probe = RankSamples(config, 4, 0, 1, 1, passes=20)
    probe[0]  # once untimed: the first call pays for cold caches, and would make the tokenizer look slower
    t0 = timer.clock()
    for i in range(len(probe)):
        probe[i]
    per_pass = (timer.clock() - t0) / (4 * 20)
    return max(1, round(share * step_s / (samples * per_pass)))
