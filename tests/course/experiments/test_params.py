"""labkit.course.experiments.params: each lab's typed `Params`. A value of the wrong type or out of range is a
`ParamError` (a ValueError) naming the field and a value that works, written as the user would type it
(`--set`, `-p`, the parameters cell, a call); `from_text` reads JSON with bare words as strings; every lab
resolves its rank-dependent defaults on 2, 4 and 8 ranks, and refuses 1 where it needs two."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from labkit.course.experiments import registry
from labkit.course.experiments.params import FORMS, LabParams, ParamError
from labkit.validate import ParamError as ValidateParamError

LAB03 = registry.params_of("03")

FIX = {
    "set": "set it with --set n_layers 6",
    "p": "set it with -p n_layers 6",
    "cell": "write n_layers = 6 in the parameters cell (or -p n_layers 6 with labkit run / papermill)",
    "python": "pass n_layers=6",
}


def test_the_error_is_a_value_error_from_labkit_validate():
    assert ParamError is ValidateParamError and issubclass(ParamError, ValueError)
    assert set(FORMS) == set(FIX)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "value, constraint",
    [
        ("six", "must be a whole number"),
        (0, "must be a whole number with >= 1"),
        (2.5, "must be a whole number"),
    ],
)
def test_a_bad_value_names_the_field_and_the_fix_in_the_form_it_was_typed(form, value, constraint):
    with pytest.raises(ParamError) as info:
        LAB03.make({"n_layers": value}, form)
    err = info.value
    assert (err.name, err.value, err.form) == ("n_layers", value, form)
    assert str(err) == f"n_layers={value!r} {constraint}; {FIX[form]}"


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"bucket_cap_mb": 0},
            "bucket_cap_mb=0 must be a number with > 0; set it with --set bucket_cap_mb 0.5",
        ),
        (
            {"sweep_caps_mb": [1, -1]},
            "sweep_caps_mb=[1, -1] must be a list of numbers with each element > 0; set it with --set "
            "sweep_caps_mb '[1e-06, 0.125, 0.5, 2.0]'",
        ),
        (
            {"cluster": "tpu"},
            "cluster='tpu' must be one of 'auto', 'cpu', 'gpu', 'sim:dgx-a100-80gb', 'sim:dgx-h100', "
            "'sim:dgx-h200'; set it with --set cluster auto",
        ),
        ({"trace_dir": 3}, "trace_dir=3 must be a string; set it with --set trace_dir 'traces_03'"),
        ({"steps": True}, "steps=True must be a whole number; set it with --set steps 5"),
        (
            {"d_model": 30},
            "d_model=30 must be a multiple of 4 (the lab's GPT has 4 attention heads); set it with --set "
            "d_model 32",
        ),
    ],
)
def test_ranges_choices_lists_and_the_labs_own_checks(values, message):
    with pytest.raises(ParamError) as info:
        LAB03.make(values, "set")
    assert str(info.value) == message and info.value.name == next(iter(values))


def test_an_unknown_name_lists_the_labs_parameters():
    with pytest.raises(
        ParamError,
        match=r"^nope=1 must be a parameter of lab 03_unoverlapped_comms; its "
        r"parameters: cluster='auto', timeout_s=120, world_size=2, n_layers=6",
    ):
        LAB03.make({"nope": 1}, "p")


def test_from_text_reads_json_and_bare_words():
    p = LAB03.from_text(
        [("n_layers", "4"), ("sweep_caps_mb", "[0.5, 1]"), ("trace_dir", "mine"), ("bucket_cap_mb", "2.5")],
        base={"steps": 2},
    )
    assert (p.n_layers, p.sweep_caps_mb, p.trace_dir, p.bucket_cap_mb, p.steps) == (
        4,
        [0.5, 1],
        "mine",
        2.5,
        2,
    )
    assert LAB03.from_text([("trace_dir", '"4"')]).trace_dir == "4"  # a JSON string stays a string
    with pytest.raises(
        ParamError, match=r"^n_layers='four' must be a whole number; set it with --set n_layers 6"
    ):
        LAB03.from_text([("n_layers", "four")])
    with pytest.raises(ParamError, match=r"set it with -p n_layers 6$"):
        LAB03.from_text([("n_layers", "0")], form="p")
    lab01 = registry.params_of("01")
    assert lab01.from_text([("memory_mib", "null")]).memory_mib is None  # JSON null is None


def test_from_cell_checks_the_cell_and_resolves_it():
    p = LAB03.from_cell({"n_layers": 2, "cluster": "cpu", "unrelated": object()}, on_gpu=False)
    assert p.n_layers == 2 and p.cluster == "cpu"
    with pytest.raises(ParamError, match=r"write n_layers = 6 in the parameters cell"):
        LAB03.from_cell({"n_layers": 0}, on_gpu=False)
    lab02 = registry.params_of("02")
    with pytest.raises(
        ParamError,
        match=r"^micro_batch=5 must be a divisor of the 32 sequences per rank.*"
        r"write micro_batch = 4 in the parameters cell",
    ):
        lab02.from_cell({"micro_batch": 5, "cluster": "cpu"}, on_gpu=False)


def test_docs_defaults_and_values_come_from_the_fields():
    docs, defaults = LAB03.field_docs(), LAB03.defaults()
    assert list(docs) == list(defaults) == [f.name for f in dataclasses.fields(LAB03)]
    assert next(iter(docs)) == "cluster" and all(docs.values())
    assert LAB03().as_dict() == defaults and defaults["n_layers"] == 6
    assert LAB03().sweep_caps_mb is not LAB03().sweep_caps_mb  # a list default is each instance's own


# each lab: (module key, what resolve fills in on n ranks)
RESOLVED = {
    "00_cluster_tour": lambda p, n: p.sizes_kib == [4, 64, 1024, 4096],
    "01_parallelism_choice": lambda p, n: (
        p.n_heads % n == 0 and p.d_model % p.n_heads == 0 and p.memory_mib > 0
    ),
    "02_oom_batch": lambda p, n: p.global_batch == 32 * n,
    "03_unoverlapped_comms": lambda p, n: True,
    "04_imbalanced_pipeline": lambda p, n: p.few_micro_batches == n and p.global_batch % n == 0,
    "05_unprofiled_run": lambda p, n: True,
    "06_capstone": lambda p, n: True,
}
NEEDS_TWO = {
    "00_cluster_tour",
    "03_unoverlapped_comms",
    "04_imbalanced_pipeline",
    "05_unprofiled_run",
    "06_capstone",
}


def _on(params: type[LabParams], n: int) -> LabParams:
    p = params().with_ranks(n).resolve(on_gpu=False)
    return p.for_nodes(p.nodes) if hasattr(p, "for_nodes") else p  # lab 01: its nodes (2 by default)


@pytest.mark.parametrize("lab", list(registry.LABS))
@pytest.mark.parametrize("n", [2, 4, 8])
def test_every_lab_resolves_on_2_4_and_8_ranks(lab, n):
    params = registry.params_of(lab)
    assert params.LAB == lab and set(RESOLVED) == set(registry.LABS)
    p = _on(params, n)
    assert p.ranks == n and getattr(p, params.RANKS) == n  # lab 04's ranks are its stages
    assert RESOLVED[lab](p, n), p
    assert p.resolve(on_gpu=False) == p  # resolving twice changes nothing


@pytest.mark.parametrize("lab", list(registry.LABS))
def test_one_rank_is_refused_where_a_lab_needs_two(lab):
    params = registry.params_of(lab)
    if lab in NEEDS_TWO:
        with pytest.raises(ParamError, match=rf"^{params.RANKS}=1 must be a whole number with >= 2"):
            _on(params, 1)
    elif lab == "01_parallelism_choice":  # 8 GPUs over its 2 nodes: one rank cannot be shared by two
        with pytest.raises(ParamError, match=r"^world_size=1 must be a multiple of nodes=2"):
            _on(params, 1)
    else:
        assert _on(params, 1).ranks == 1


@pytest.mark.parametrize("lab", list(registry.LABS))
def test_each_labs_test_and_smoke_runs_are_its_own_parameters(lab):
    params = registry.params_of(lab)
    assert set(params.TEST) <= set(params.field_docs()) and set(params.SMOKE) <= set(params.field_docs())
    params.make(dict(params.TEST)).resolve(on_gpu=False)
    smoke = params.make(dict(params.SMOKE)).with_ranks(2).resolve(on_gpu=False)
    assert smoke.ranks == 2


# Each lab's default ranks on a machine with N GPUs (0: none, the emulated cluster's defaults): the labs whose
# lesson is about several ranks take every GPU from two; lab 01 keeps its 8 emulated ranks (2 nodes x 4); lab
# 02 one rank on one GPU, else its 2; lab 04 the stages its forecast shows the lesson on (8, else 4)
MACHINE_RANKS = {
    "00_cluster_tour": {0: 2, 1: 2, 2: 2, 3: 3, 4: 4, 8: 8},
    "01_parallelism_choice": {0: 8, 1: 8, 2: 8, 3: 8, 4: 8, 8: 8},
    "02_oom_batch": {0: 2, 1: 1, 2: 2, 3: 2, 4: 2, 8: 2},
    "03_unoverlapped_comms": {0: 2, 1: 2, 2: 2, 3: 3, 4: 4, 8: 8},
    "04_imbalanced_pipeline": {0: 4, 1: 4, 2: 4, 3: 4, 4: 4, 8: 8},
    "05_unprofiled_run": {0: 2, 1: 2, 2: 2, 3: 3, 4: 4, 8: 8},
    "06_capstone": {0: 2, 1: 2, 2: 2, 3: 3, 4: 4, 8: 8},
}


@pytest.mark.parametrize("gpus", [0, 1, 2, 3, 4, 8])
@pytest.mark.parametrize("lab", list(registry.LABS))
def test_each_labs_default_ranks_follow_its_rule_on_a_machine_with_n_gpus(lab, gpus):
    params = registry.params_of(lab)
    assert set(MACHINE_RANKS) == set(registry.LABS) and params.RANKS_WHY  # doctor prints the why
    p = params().for_machine(gpus)
    assert p.ranks == MACHINE_RANKS[lab][gpus]
    # the defaults that depend on the ranks still hold there, on GPUs where it runs on them (its GPU sizes)
    on_gpu = p.cluster in ("auto", "gpu") and 1 <= p.ranks <= gpus
    resolved = p.resolve(on_gpu=on_gpu)
    if hasattr(resolved, "for_nodes"):  # lab 01: its 8 ranks shared by its 2 emulated nodes
        resolved.for_nodes(resolved.nodes)
    if lab == "02_oom_batch":
        assert resolved.global_batch == (64 if on_gpu else 32) * p.ranks
    if lab == "04_imbalanced_pipeline":
        assert resolved.few_micro_batches == p.ranks and resolved.global_batch % p.ranks == 0
        assert resolved.n_layers >= p.ranks


def test_on_a_preset_of_two_nodes_a_lab_takes_the_ranks_of_one_node():
    # labkit run starts a notebook's ranks on one machine: a node of the preset (torchrun spans the nodes)
    from labkit.cluster import Cluster

    two = Cluster.preset("dgx-h100", nodes=2)
    assert (two.nodes, two.gpus_per_node) == (2, 8)
    for lab in registry.LABS:
        assert registry.params_of(lab)().for_machine(two.gpus_per_node).ranks == MACHINE_RANKS[lab][8]


def test_the_rule_changes_only_ranks_left_at_their_default_on_a_cluster_that_may_be_a_gpu(monkeypatch):
    from labkit.cluster import GPU, Cluster
    from labkit.course.experiments.imbalanced_pipeline import Params as Lab04
    from labkit.course.experiments.oom_batch import Params as Lab02
    from labkit.course.experiments.unoverlapped_comms import Params as Lab03
    from labkit.links import Link

    # a value the user set is kept (one equal to the default reads as unset, as GPU sizes do)
    assert Lab02(world_size=3).for_machine(1).world_size == 3
    assert Lab03(world_size=4).for_machine(8).world_size == 4
    assert Lab04(stages=2).for_machine(8).stages == 2
    assert Lab03(world_size=2).for_machine(8).world_size == 8  # the default's value: read as unset
    # the emulated cluster (or a simulated machine) asked for: its ranks stay
    assert Lab02(cluster="cpu").for_machine(1).world_size == 2
    assert Lab03(cluster="cpu").for_machine(8).world_size == 2
    assert Lab03(cluster="sim:dgx-h100").for_machine(8).world_size == 2
    assert Lab03(cluster="gpu").for_machine(8).world_size == 8
    # by default it counts this machine's GPUs
    link = Link(450.0, 5.0, "NVLink")
    eight = Cluster("gpu", 1, 8, link, link, gpus=tuple(GPU(i, "NVIDIA H100", 80.0) for i in range(8)))
    monkeypatch.setattr(Cluster, "detect", classmethod(lambda cls: eight))
    assert Lab03().for_machine().world_size == 8 and Lab04().for_machine().stages == 8


def test_lab_04s_rule_is_the_stage_counts_its_forecast_shows_the_lesson_on():
    # on a DGX H100 at its GPU sizes: 4 and 8 stages show the imbalance and its fix, 8 the most; 2 too
    # little, 16 not at all; so 8 from 8 GPUs, 4 from 4, and 4 emulated stages below
    from labkit.cluster import Cluster
    from labkit.course.experiments.imbalanced_pipeline import Params as Lab04
    from labkit.course.forecast import fp32_flops_per_s, pipeline_forecast

    dgx = Cluster.preset("dgx-h100")

    def forecast(stages: int):
        p = Lab04(stages=stages).resolve(on_gpu=True)
        rate = fp32_flops_per_s(dgx.gpu_name)
        config, batch, few = p.config(), p.global_batch, p.few_micro_batches
        return pipeline_forecast(config, stages, batch, few, dgx.intra_node, rate)

    four, eight = forecast(4), forecast(8)
    assert four.shows() and eight.shows(), (str(four), str(eight))
    assert eight.after / eight.before < four.after / four.before
    assert not forecast(2).shows() and not forecast(16).shows()
    assert [Lab04.ranks_on(n) for n in (1, 2, 3, 4, 7, 8, 16)] == [None, None, None, 4, 4, 8, 8]


def _wrong_type(kind) -> object:
    """A value no field of type `kind` takes: a number for a list or a string, a word for a number, a
    number for True/False."""
    text = str(kind)
    if "list" in text or kind is str:
        return 64
    if kind is bool:
        return 3
    return "lots"


_FIX_SAYS = {"set": "set it with --set {name} ", "p": "set it with -p {name} ", "cell": "write {name} = "}


@pytest.mark.parametrize("form", ["set", "p", "cell"])
@pytest.mark.parametrize("lab", list(registry.LABS))
def test_every_parameter_of_every_lab_refuses_a_wrong_type_naming_it_and_the_fix_as_typed(lab, form):
    """issue 28, point 2: `-p sizes_kib 64`, `-p memory_mib '"lots"'`, `--set steps 0`: the parameter as the
    user typed it, what it must be, and a value that works in the form they used (the notebook's cell checks
    what papermill injected with `from_cell`, which writes its fix for the cell)."""
    params = registry.params_of(lab)
    hints = typing.get_type_hints(params)
    for f in dataclasses.fields(params):
        value = _wrong_type(hints[f.name])
        with pytest.raises(ParamError) as info:
            if form == "cell":
                params.from_cell({f.name: value})
            else:
                params.make({f.name: value}, form)
        message = str(info.value)
        assert message.startswith(f"{f.name}={value!r} must be "), message
        assert _FIX_SAYS[form].format(name=f.name) in message, message


def test_papermill_with_a_wrong_type_fails_in_the_cell_that_checks_it_with_the_fix_for_the_cell(
    tmp_path, repo, kernel_finds_labkit
):
    from labkit.course.execute import execute

    done = execute(
        repo / "solutions" / "04_imbalanced_pipeline.ipynb",
        tmp_path / "04.ipynb",
        parameters={"stages": "four"},
        cwd=tmp_path,
    )
    assert not done.ok and done.ename == "ParamError", done.error
    assert done.evalue == (
        "stages='four' must be a whole number; write stages = 4 in the parameters cell (or -p stages 4 with "
        "labkit run / papermill)"
    )


def test_a_notebook_that_needs_numerics_refuses_a_simulated_machine_naming_the_script():
    """A lab whose notebook compares values with a single process where it runs (NOTEBOOK_SIMULATED False)
    refuses a simulated machine in its cell, naming the script that measures there. None of labs 00-06 does
    today: each checks its values on the emulated cluster and runs the rest on the simulated machine, so
    labkit run -p cluster sim:dgx-h100 takes every lab."""
    from labkit.course.parameters import lab_parameters

    base = registry.params_of("01_parallelism_choice")
    numeric = type("Numeric", (base,), {"NOTEBOOK_SIMULATED": False, "__module__": base.__module__})
    assert numeric.make({"cluster": "sim:dgx-h100"}, "set").cluster == "sim:dgx-h100"  # the script's
    script = rf"python -m {base.__module__} --cluster sim:dgx-h100.*cluster = 'cpu'"
    with pytest.raises(ParamError, match=script):
        numeric.from_cell({"cluster": "sim:dgx-h100"})
    given = lab_parameters(list(registry.LABS), {"cluster": "sim:dgx-h100"})
    assert all(values == {"cluster": "sim:dgx-h100"} for values in given.values()), given


def test_lab_00s_notebook_takes_a_simulated_node_at_its_gpu_sizes():
    params = registry.params_of("00_cluster_tour")
    made = params.from_cell({"cluster": "sim:dgx-h100", "world_size": 8})
    assert made.sizes_kib[-1] == 2**20  # 1 GiB, as on GPUs
    assert params.from_cell({"cluster": "cpu"}).sizes_kib[-1] == 4096


def test_lab_01_refuses_a_global_batch_its_first_run_cannot_split_naming_the_fix():
    """Two simulated DGX H100 nodes of 8 (`-p world_size 16`) at the default 32 sequences: plain data
    parallelism, the lesson's first run, cannot give 16 replicas micro-batches of 4. Said before any rank
    starts, with the value that works, not as a rank's error inside the run."""
    params = registry.params_of("01_parallelism_choice")
    with pytest.raises(ParamError) as info:
        params.make({"cluster": "sim:dgx-h100", "world_size": 16}, "set").resolve()
    assert info.value.name == "global_batch" and str(info.value).endswith("global_batch=64")
    assert params.make({"world_size": 16, "global_batch": 64}).resolve().global_batch == 64
