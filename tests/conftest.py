"""Fixtures shared by several test modules."""

from __future__ import annotations

import os

import pytest
import torch

# The kernels papermill starts in the tests print quizzes as text (labkit.quiz.show), as `labkit run` does.
os.environ.setdefault("LABKIT_TEXT_ONLY", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; without it they are skipped and the summary (-ra) says why."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU (none here); tests/gpu_check.sh runs these on a GPU node"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module: its models are tiny, and on a busy 2-core runner thread
    hand-offs cost more than the math. Byte counts and numerics do not depend on the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
