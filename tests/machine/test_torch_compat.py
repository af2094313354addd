"""labkit.machine._torch_compat: every private torch internal labkit uses is there and looks as expected,
and no other module of labkit reaches into torch's private names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import labkit
from labkit.machine import _torch_compat as compat

PACKAGE = Path(labkit.__file__).resolve().parent  # every module of labkit, the machine's and the others
PRIVATE = re.compile(r"\btorch\.(?:_(?!_)\w|utils\._|distributed\._)|\._plugins\b|_world\.pg_map")


def test_every_internal_is_present_on_this_torch():
    problems = compat.problems()
    assert problems == [], f"torch {torch.__version__}:\n" + "\n".join(problems)


def test_a_missing_internal_is_named_with_the_torch_version(monkeypatch):
    gone = compat.Internal("torch.utils._pytree", "tree_map_that_never_was", "a test")
    moved = compat.Internal("torch._no_such_module", "thing", "a test")
    monkeypatch.setattr(compat, "INTERNALS", (gone, moved))
    problems = compat.problems()
    assert len(problems) == 2
    assert "torch.utils._pytree.tree_map_that_never_was" in problems[0] and torch.__version__ in problems[0]
    assert "AttributeError" in problems[0] and "a test" in problems[0]
    assert "torch._no_such_module.thing" in problems[1] and "ModuleNotFoundError" in problems[1]


def test_a_changed_signature_is_reported(monkeypatch):
    changed = compat.Internal("torch.utils._pytree", "tree_map", "a test", ("tree", "func"))
    monkeypatch.setattr(compat, "INTERNALS", (changed,))
    (problem,) = compat.problems()
    assert "changed" in problem and "('func', 'tree')" in problem and "('tree', 'func')" in problem


def test_the_emulated_group_overrides_only_listed_private_methods():
    from labkit.machine.emulate import EmulatedProcessGroup

    overridden = {
        n
        for n in vars(EmulatedProcessGroup)
        if n.startswith("_") and not n.startswith("__") and hasattr(torch.distributed.ProcessGroup, n)
    }
    assert overridden == set(compat.PROCESS_GROUP_OVERRIDES)
    listed = {i.attr.split(".", 1)[1] for i in compat.INTERNALS if i.attr.startswith("ProcessGroup.")}
    assert listed == set(compat.PROCESS_GROUP_OVERRIDES)


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_torch_name_outside_the_compat_module(path: Path):
    if path.name == "_torch_compat.py":
        return
    hits = [
        f"{path.name}:{n}: {line.strip()}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE.search(line) and not line.lstrip().startswith("#")
    ]
    assert not hits, "private torch names belong in labkit/machine/_torch_compat.py:\n" + "\n".join(hits)


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_the_cheaper_cache_key_gives_what_torchs_dispatch_gives_on_every_cache_hit(block):
    """A training step of the lab GPT, twice, in `fake_tensor_mode()` with torch's cross-check on: every
    output served from the cache under the cheaper key is compared with the operator run afresh (torch
    raises on a mismatch), and the second step is served from the cache."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from labkit.models import GPT, GPTConfig, synthetic_batch

    config = GPTConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=16, block=block)
    mode = compat.fake_tensor_mode()
    mode.cache_crosscheck_enabled = True
    with mode:
        model = GPT(config)
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        x, y = synthetic_batch(config, 2)
        hits = []
        for _ in range(2):
            before = FakeTensorMode.cache_hits
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            hits.append(FakeTensorMode.cache_hits - before)
    assert hits[1] > 100, hits


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(4, 6),
        lambda: torch.empty(6, 4).t(),  # the same shape, other strides
        lambda: torch.empty(4, 6, dtype=torch.int32),  # the same bytes, another dtype
        lambda: torch.empty(5, 6)[1:],  # a storage offset
        lambda: torch.empty(4, 6)[:, :3],  # another shape, the same strides and bytes
    ],
    ids=["plain", "strides", "dtype", "offset", "shape"],
)
def test_tensors_that_differ_in_one_fact_get_their_own_cache_entries(make):
    """A key that missed one of these facts would hand one tensor's cached output to the next: run each
    after all the others, and its output's metadata is still what real tensors give."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def op(t: torch.Tensor) -> torch.Tensor:
        return t + t  # two FakeTensors: a cached operator (a Python number would be a real tensor)

    real = op(make())
    mode = compat.fake_tensor_mode()
    with mode:
        for other in (torch.empty(4, 6), torch.empty(6, 4).t(), torch.empty(4, 6, dtype=torch.int32)):
            op(other)
        hits = FakeTensorMode.cache_hits
        fake = op(make())
        op(make())
    assert FakeTensorMode.cache_hits > hits  # the last one at least came from the cache
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
