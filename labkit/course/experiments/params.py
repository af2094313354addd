"""Each lab's parameters as one typed, self-validating dataclass, declared once in the lab's module.

    @dataclass(frozen=True)
    class Params(LabParams):
        n_layers: int = gpt_param("n_layers", 6)
        bucket_cap_mb: float = param(0.5, "DDP's bucket size in MiB", minimum=0, strict=True)

Everything else reads them from there: `labkit build` writes the notebook's parameters cell from the fields
(their defaults and docs), the notebook checks what papermill injected with `Params.from_cell(globals())`,
`python -m` / `torchrun -m labkit.course.experiments.<lab>` takes `--set KEY VALUE` for any field (`--help`
lists them with their docs), `labkit run -p KEY VALUE` is checked before a kernel starts, and the tests take
their small runs from `Params.TEST` and `Params.SMOKE` (torchtitan's typed config with one docstring per field
is the model).

Checks happen when an instance is made (`__post_init__`): every field by its type and range, then the lab's
own `check()` across fields. The error is a `labkit.validate.ParamError` with the value, the constraint and a
value that works; `ParamError.fix(form)` writes the fix as the user would type it (`--set n_layers 6`, `-p
n_layers 6`, `n_layers = 6` in the parameters cell). Some defaults depend on the ranks the lab runs on
(divisibility, micro-batches >= stages, the memory the mistake needs): such a field defaults to None, and
`resolve(on_gpu=...)` fills it in for the ranks at hand (`LabParams.RANKS` names the field that holds them).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar, get_args, get_origin

from labkit.cluster import PRESETS, Cluster
from labkit.machine.machine import Machine
from labkit.models import GPTConfig
from labkit.validate import ParamError

__all__ = [
    "FORMS",
    "RANK_WORDS",
    "SIMULATED_CLUSTERS",
    "LabParams",
    "ParamError",
    "gpt_param",
    "param",
    "simulable_cluster",
]

P = TypeVar("P", bound="LabParams")
FORMS = ("set", "p", "cell", "python")  # where a value was typed: --set, labkit run -p, the notebook, a call
# A lab that runs on a simulated machine takes these among its `cluster` choices (one node per 8 ranks)
SIMULATED_CLUSTERS = tuple(f"sim:{name}" for name in PRESETS)


def param(
    default: Any,
    doc: str,
    *,
    minimum: float | None = None,
    strict: bool = False,
    choices: tuple[Any, ...] | None = None,
    example: Any = None,
) -> Any:
    """A parameter field: its default, one line of doc, and its range (`minimum`, `strict` for > instead of
    >=, or `choices`). For list fields the range applies to each element. `example`: a value that works, for
    the error message (default: the default)."""
    meta = {"doc": doc, "minimum": minimum, "strict": strict, "choices": choices, "example": example}
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# One doc and one lower bound for each GPTConfig field a lab takes as a parameter (labkit.models.GPTConfig);
# that d_model divides into the heads is each lab's own check (LabParams.check_multiple).
_GPT_FIELDS = {
    "n_layers": ("GPT blocks", 1),
    "d_model": ("width", 1),
    "n_heads": ("attention heads", 1),
    "vocab_size": ("vocabulary", 2),
    "seq_len": ("tokens per sequence", 2),
}


def gpt_param(name: str, default: int, why: str = "") -> Any:
    """A GPTConfig field as a lab parameter: its one doc and lower bound, plus the lab's note on why it
    matters there (`why`, shown in brackets in --help and the report)."""
    doc, minimum = _GPT_FIELDS[name]
    return param(default, f"{doc} ({why})" if why else doc, minimum=minimum)


_NAMES = {
    int: "a whole number",
    float: "a number",
    bool: "True or False",
    str: "a string",
    type(None): "None",
}
_PLURALS = {int: "whole numbers", float: "numbers", bool: "True or False values", str: "strings"}


def _type_name(kind: Any) -> str:
    if get_origin(kind) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(k) for k in get_args(kind))
    if get_origin(kind) is list:
        (item,) = get_args(kind)
        return f"a list of {_PLURALS.get(item, str(item))}"
    return _NAMES.get(kind, str(kind))


def _conforms(value: Any, kind: Any) -> bool:
    """Does `value` have type `kind` (int for float allowed; bool is not an int here)?"""
    if get_origin(kind) in (typing.Union, types.UnionType):
        return any(_conforms(value, k) for k in get_args(kind))
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if get_origin(kind) is list:
        (item,) = get_args(kind)
        return isinstance(value, (list, tuple)) and all(_conforms(v, item) for v in value)
    return isinstance(value, kind)


def simulable_cluster(default: str = "auto") -> Any:
    """The `cluster` field of a lab that also runs on a simulated machine ("sim:dgx-h100", ...: its GPU sizes,
    each operator timed on the described GPU, no numerics)."""
    return param(
        default,
        "auto: NCCL if this machine has a GPU per rank, else the emulated cluster (cpu); sim:dgx-h100 (or "
        "another preset): a simulated node at GPU sizes, links as published",
        choices=("auto", "cpu", "gpu", *SIMULATED_CLUSTERS),
    )


# What people call the number of ranks, whatever a lab's field for them is named (`LabParams.RANKS`)
RANK_WORDS = frozenset({"world_size", "stages", "ranks", "nproc", "nproc_per_node", "gpus", "num_gpus"})


@dataclasses.dataclass(frozen=True)
class LabParams:
    """The parameters every lab has; each lab's `Params` subclasses it and adds its own."""

    cluster: str = param(
        "auto",
        "auto: NCCL if this machine has a GPU per rank, else the emulated cluster (cpu)",
        choices=("auto", "cpu", "gpu"),
    )
    timeout_s: float = param(
        120, "every collective and transfer must finish within this many seconds", minimum=0, strict=True
    )

    LAB: ClassVar[str] = ""  # "03_unoverlapped_comms"
    RANKS: ClassVar[str | None] = "world_size"  # the field that holds the ranks (None: the lab picks its own)
    TEST: ClassVar[Mapping[str, Any]] = {}  # the solution notebook's test run (small; the lesson still shows)
    SMOKE: ClassVar[Mapping[str, Any]] = {}  # the script's test runs under torchrun (tiny; any world size)
    GPT_FIXED: ClassVar[Mapping[str, Any]] = {}  # GPTConfig fields the lab fixes instead of taking them
    # On GPUs, the values that make the lesson show there (chosen on paper with `labkit.course.forecast`), for
    # the fields left at their emulated-cluster default; `gpu_sized` applies them
    GPU_SIZES: ClassVar[Mapping[str, Any]] = {}
    # One line on the ranks the lab takes on a machine with GPUs (its `ranks_on` rule) and why, its lesson's
    # reason: `labkit doctor` prints it for this machine, and `labkit doctor --as <preset>` for one described
    RANKS_WHY: ClassVar[str] = ""
    # Whether the lab's notebook runs on a simulated machine (its script does wherever `cluster` offers one):
    # a notebook whose exercises compare values with a single process needs numerics, which it does not have
    NOTEBOOK_SIMULATED: ClassVar[bool] = False
    # On a simulated machine (`cluster="sim:..."`), after GPU_SIZES, for the fields a lab has and left at
    # their default: after its first, every step of a simulated program takes the same modelled time, up to
    # float rounding (no noise, no caches; tests/machine/emulate/test_simulated_cluster.py), so one timed step
    # there is the median of any number
    SIMULATED_SIZES: ClassVar[Mapping[str, Any]] = {"steps": 1}

    # ----------------------------------------------------------------- checks

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            self._check_field(f, hints[f.name])
        self.check()

    def _check_field(self, f: dataclasses.Field, kind: Any) -> None:
        value, meta = getattr(self, f.name), f.metadata
        example = meta.get("example", None)
        example = f.default if example is None and f.default is not dataclasses.MISSING else example
        if example is None and f.default_factory is not dataclasses.MISSING:
            example = f.default_factory()
        if not _conforms(value, kind):
            raise ParamError(f.name, value, _type_name(kind), example)
        if meta.get("choices") is not None and value not in meta["choices"]:
            raise ParamError(f.name, value, "one of " + ", ".join(repr(c) for c in meta["choices"]), example)
        low = meta.get("minimum")
        if low is None or value is None:
            return
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v < low or (meta["strict"] and v == low):
                what = f"> {low:g}" if meta["strict"] else f">= {low:g}"
                each = "each element " if isinstance(value, (list, tuple)) else ""
                raise ParamError(f.name, value, f"{_type_name(kind)} with {each}{what}", example)

    def check(self) -> None:
        """The lab's checks across fields (raise `ParamError`); none by default."""

    def check_multiple(self, name: str, of: int, why: str) -> None:
        """Raise `ParamError` unless field `name` is a multiple of `of` (the nearest multiple as the fix)."""
        value = getattr(self, name)
        if value is not None and value % of:
            raise ParamError(name, value, f"a multiple of {of}", max(of, round(value / of) * of), why=why)

    def check_at_least(self, name: str, least: int, of: str, why: str) -> None:
        """Raise `ParamError` unless field `name` is at least `least`, the value of `of` (also the fix)."""
        value = getattr(self, name)
        if value is not None and value < least:
            raise ParamError(name, value, f"at least {of}={least}", least, why=why)

    # ----------------------------------------------------------- making them

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """Each field's one line of doc, in declaration order."""
        return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Each field's default, in declaration order."""
        return {f.name: getattr(cls(), f.name) for f in dataclasses.fields(cls)}

    @classmethod
    def make(cls: type[P], values: Mapping[str, Any], form: str = "python") -> P:
        """`cls(**values)`, refusing a name that is not a field; a `ParamError` says the fix in `form`."""
        unknown = [k for k in values if k not in cls.field_docs()]
        if unknown:
            known = ", ".join(f"{k}={v!r}" for k, v in cls.defaults().items())
            raise ParamError(
                unknown[0],
                values[unknown[0]],
                f"a parameter of lab {cls.LAB}{cls._ranks_hint(unknown[0], form)}; its parameters: {known}",
                None,
                form=form,
            )
        try:
            return cls(**values)
        except ParamError as err:
            raise err.in_form(form) from None

    @classmethod
    def from_text(
        cls: type[P], pairs: list[tuple[str, str]], form: str = "set", base: Mapping[str, Any] | None = None
    ) -> P:
        """From `KEY VALUE` pairs typed on a command line: each value is JSON, a bare word is a string."""
        values = dict(base or {})
        for key, raw in pairs:
            try:
                values[key] = json.loads(raw)
            except json.JSONDecodeError:
                values[key] = raw
        return cls.make(values, form)

    @classmethod
    def from_cell(cls: type[P], namespace: Mapping[str, Any], on_gpu: bool | None = None) -> P:
        """In a notebook: the parameters cell's values (after papermill's), checked and resolved."""
        values = {k: namespace[k] for k in cls.field_docs() if k in namespace}
        return cls.for_notebook(values, "cell", on_gpu)

    @classmethod
    def for_notebook(cls: type[P], values: Mapping[str, Any], form: str, on_gpu: bool | None = None) -> P:
        """`values` as the notebook will take them: checked, the ranks and sizes of the machine filled in
        and checked with them (`resolve`), a `ParamError` in `form`. `labkit run -p` calls it before any
        kernel starts, so that what a notebook would refuse is refused there, with what the user typed."""
        made = cls.make(values, form).for_machine()
        made.check_notebook_cluster(form)
        if on_gpu is None:
            on_gpu = Cluster.resolve(made.cluster, max(1, made.ranks or 1)).gpu_sized
        try:
            return made.resolve(on_gpu=on_gpu)
        except ParamError as err:
            raise err.in_form(form) from None

    def check_notebook_cluster(self, form: str) -> None:
        """Refuse a simulated machine for a notebook that needs numerics (`NOTEBOOK_SIMULATED`), naming the
        script that runs the lab's measurement there."""
        if self.cluster.startswith("sim:") and not self.NOTEBOOK_SIMULATED:
            raise ParamError(
                "cluster",
                self.cluster,
                "auto, cpu or gpu in this notebook",
                "cpu",
                form=form,
                why="its exercises and checks compare values with a single process, and a simulated "
                "machine computes none; its measurement runs there as a script: python -m "
                f"{type(self).__module__} --cluster {self.cluster} --world-size 8",
            )

    # ---------------------------------------------------------------- ranks

    @classmethod
    def _ranks_hint(cls, name: str, form: str) -> str:
        """For a name meaning the ranks that is not this lab's: which field and option set them here."""
        if name not in RANK_WORDS or name == cls.RANKS:
            return ""
        if not cls.RANKS:
            return " (it picks its own ranks)"
        if form == "set":
            return f" (its ranks are {cls.RANKS}: --world-size N sets it, or torchrun's --nproc-per-node)"
        return f" (its ranks are {cls.RANKS})"

    @property
    def ranks(self) -> int | None:
        """The ranks this lab runs on (its `RANKS` field), or None where it picks its own."""
        return getattr(self, self.RANKS) if self.RANKS else None

    def with_ranks(self: P, ranks: int) -> P:
        """The same parameters on `ranks` ranks (torchrun's WORLD_SIZE, or `--world-size`)."""
        if not self.RANKS:
            return self
        return dataclasses.replace(self, **{self.RANKS: ranks})

    @classmethod
    def ranks_on(cls, gpus: int) -> int | None:
        """The ranks this lab takes by default on a machine with `gpus` GPUs (1 or more), as its lesson asks
        (`RANKS_WHY` says why); None: it keeps its default ranks, which run on the emulated cluster where the
        GPUs are fewer. Each lab declares its own rule; here: none."""
        return None

    def for_machine(self: P, gpus: int | None = None) -> P:
        """On a machine with `gpus` GPUs (default: counted here), the lab's `ranks_on(gpus)` ranks where it
        has a rule for them, its ranks are still at their default and its cluster may be a GPU; else `self`.
        With no GPU every lab keeps its default (the emulated cluster's ranks)."""
        if not self.RANKS or self.cluster not in ("auto", "gpu"):
            return self
        count = Cluster.detect().gpu_count if gpus is None else gpus
        ranks = self.ranks_on(count) if count >= 1 else None
        if ranks is None:
            return self
        (field,) = [f for f in dataclasses.fields(self) if f.name == self.RANKS]
        # a value equal to the default reads as unset, as for the GPU sizes (`gpu_sized`)
        return self.with_ranks(ranks) if self.ranks == field.default else self

    def resolve(self: P, *, on_gpu: bool = False) -> P:
        """Fill in the defaults that depend on the ranks (and on whether they are GPUs); check what needs
        them. Labs with such defaults override it; here: the GPU sizes on GPUs (`gpu_sized`)."""
        return self.gpu_sized(on_gpu)

    def gpu_sized(self: P, on_gpu: bool) -> P:
        """On GPUs, `GPU_SIZES` for every field still at its default (a value the user set is kept, unless it
        equals the emulated default), and `SIMULATED_SIZES` on a simulated machine; elsewhere `self`."""
        sizes = dict(self.GPU_SIZES) if on_gpu else {}
        if self.cluster.startswith("sim:"):
            sizes.update((k, v) for k, v in self.SIMULATED_SIZES.items() if hasattr(self, k))
        if not sizes:
            return self
        def default(f: dataclasses.Field) -> Any:
            if f.default is dataclasses.MISSING:
                return f.default_factory()  # type: ignore[misc]
            return f.default

        defaults = {f.name: default(f) for f in dataclasses.fields(self)}
        sized = {k: v for k, v in sizes.items() if getattr(self, k) == defaults[k]}
        return dataclasses.replace(self, **sized)

    def machine(self) -> Machine:
        """Where this lab runs: its `cluster` resolved once for its ranks
        (`labkit.machine.machine.Machine`)."""
        return Machine.resolve(self.cluster, max(1, self.ranks or 1))

    def config(self) -> GPTConfig:
        """The lab's GPT (labs that train one): the GPTConfig fields among its parameters, then GPT_FIXED."""
        names = [f.name for f in dataclasses.fields(GPTConfig) if hasattr(self, f.name)]
        shape = {name: getattr(self, name) for name in names}
        return GPTConfig(**{**shape, **self.GPT_FIXED})

    def as_dict(self) -> dict[str, Any]:
        """The values, for records and reports."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
