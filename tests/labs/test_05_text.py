"""Lab 05's prose against the code it describes: the rules `labkit.trace.diagnose` applies (section 4), and
the FLOP count behind the MFU it prints (section 2, Chowdhery et al. 2022, PaLM, Appendix B)."""

from __future__ import annotations

import importlib
import json

import pytest
from torch import nn

from labkit.course.experiments.unprofiled_run import Params
from labkit.models import GPT, GPTConfig
from labkit.planner import forward_flops_per_token

LAB = "05_unprofiled_run"
rules = importlib.import_module("labkit.trace.diagnose")  # the module: labkit.trace.diagnose is the function


def _cell(repo, index: int) -> str:
    nb = json.loads((repo / "solutions" / f"{LAB}.ipynb").read_text(encoding="utf-8"))
    return " ".join("".join(nb["cells"][index]["source"]).split())  # one line: the markdown wraps anywhere


def test_section_4_states_diagnoses_thresholds(repo):
    text = _cell(repo, 14)
    assert text.startswith("## 4 · Let the trace name it")
    shares = ("DATA_SHARE", "HOST_SYNC_SHARE", "WAIT_SHARE")
    pct = {name: f"{100 * getattr(rules, name):.0f} %" for name in shares}
    assert f"at least {pct['DATA_SHARE']} of its step loading data" in text
    assert f"at least {pct['HOST_SYNC_SHARE']} of its step in host synchronisations" in text
    assert f"at least {rules.STRAGGLER_RATIO:g}x the median of the other ranks'" in text
    assert f"at least {pct['WAIT_SHARE']} of their step for it" in text
    assert f"at least {rules.MANY_COLLECTIVES} collectives per step" in text
    assert f"at least {100 * rules.EXPOSED_SHARE:.0f} % of them with no compute beside them" in text
    early, late = f"{100 * rules.EARLY:.0f} %", f"{100 * rules.LATE:.0f} %"
    assert f"at most {early} of its compute done, at least {late} still to do" in text
    assert "at most 4 collectives" in text and "fewer than 16 parameter tensors" in text
    # the learner's rule is not diagnose's, and the text says how
    assert rules.STRAGGLER_RATIO != 1.25 and "(1.25x), on compute alone" in text
    # the lab's GPT has as many parameter tensors as the text says (each one all-reduced when per tensor)
    assert f"the lab's 2-block GPT has {len(list(GPT(Params().config()).parameters()))})" in text
    assert Params().n_layers == 2


@pytest.mark.parametrize(
    "config",
    [
        Params().config(),  # the lab's GPT
        GPTConfig(n_layers=4, d_model=256, n_heads=8, vocab_size=1000, seq_len=128, n_kv_heads=2),
        GPTConfig(n_layers=3, d_model=96, n_heads=4, vocab_size=500, seq_len=32, tie_embeddings=True),
    ],
)
def test_the_mfu_flop_count_is_6n_plus_the_attention_term(config):
    """3 x labkit's forward count = 6N + 12·L·s·d (PaLM, Appendix B), N the weights the model's matmuls use."""
    model = GPT(config)
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    block, head = forward_flops_per_token(config)
    train = 3 * (config.n_layers * block + head)
    assert train == 6 * matmul_weights + 12 * config.n_layers * config.seq_len * config.d_model


def test_section_2_computes_mfu_from_the_measured_step(repo):
    code = _cell(repo, 6)
    assert "forward_flops_per_token(config)" in code and "3 * (config.n_layers * block + head)" in code
    # no extra runs; the peak is the Machine's (this CPU's calibrated rate where the ranks compute on it)
    assert "step_ms(run)" in code and "machine.fp32_peak()" in code
