"""Every private torch internal that labkit touches, and nothing else.

torch keeps no promise about names that start with an underscore, so they are fenced
here: each is listed in `INTERNALS` with what labkit uses it for and the torch releases it
is known to work on, and `problems()` says, naming the internal and the running torch
version, which of them is missing or has changed. `tests/machine/test_torch_compat.py` runs it, so
a torch upgrade that breaks one fails a test with that name instead of somewhere deep
inside a lab. The rest of the package imports the wrappers below, never `torch._*`,
`torch.utils._*` or `torch.distributed._*` directly.

Neighbours: `labkit.machine.emulate` (dispatch mode, process-group hooks, the group registry),
`labkit.measured_memory` (MemTracker, FakeTensor), `labkit.machine.launcher` (pytree).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

# Imported by torch itself at start-up, so these cost nothing here.
from torch.utils._pytree import tree_leaves, tree_map

__all__ = [
    "INTERNALS",
    "OBJECT_COLLECTIVES",
    "PROCESS_GROUP_OVERRIDES",
    "TorchDispatchMode",
    "allgather_base",
    "backend_registered",
    "cuda_spin",
    "default_store",
    "dispatch_mode_stack",
    "fake_constant",
    "fake_tensor_mode",
    "graph_task_id",
    "in_backward",
    "is_fake",
    "is_wrapper_subclass",
    "problems",
    "process_groups",
    "queue_backward_callback",
    "real_object_collectives",
    "real_tensors",
    "real_warmup_vote",
    "reduce_scatter_base",
    "removing_module_grad_hooks",
    "report_storage_resizes",
    "set_cuda_allocator_settings",
    "step_mem_tracker",
    "tree_leaves",
    "tree_map",
    "unshard_asynchronously",
    "unwrapped",
]

KNOWN_GOOD = "2.13.0, 2.14.1"


@dataclass(frozen=True)
class Internal:
    """One private torch name: where it lives, what labkit needs it for, what it looks like."""

    module: str
    attr: str  # a dotted path inside the module, e.g. "MemTracker._pre_fw_hook"
    used_for: str
    params: tuple[str, ...] = ()  # leading parameter names labkit relies on (Python functions)

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.attr}"


INTERNALS: tuple[Internal, ...] = (
    Internal(
        "torch.utils._pytree",
        "tree_map",
        "launch: move the tensors in a rank's result to the CPU",
        ("func", "tree"),
    ),
    Internal(
        "torch.utils._pytree", "tree_leaves", "emulate.budget: every tensor an operator returned", ("tree",)
    ),
    Internal(
        "torch.utils._python_dispatch",
        "TorchDispatchMode",
        "emulate.budget: see the outputs of every operator to count their bytes",
    ),
    Internal(
        "torch.utils._python_dispatch",
        "_get_current_dispatch_mode_stack",
        "emulate.budget: find the memory budget active on this thread",
    ),
    Internal(
        "torch._subclasses.fake_tensor",
        "FakeTensorMode",
        "measure.estimate_fake and the simulated cluster: run a step of a model too large to allocate",
    ),
    Internal(
        "torch._subclasses.fake_tensor",
        "FakeTensorMode._prep_args_for_hash",
        "the simulated cluster: a cheaper key for FakeTensorMode's cache of operators' outputs",
        ("self", "result", "args", "state", "id_hashed_objects"),
    ),
    Internal(
        "torch._subclasses.fake_tensor",
        "unset_fake_temporarily",
        "training.trainer: a DataLoader draws its base seed with .item(), which a FakeTensor cannot give",
    ),
    Internal(
        "torch.distributed.fsdp",
        "FSDPModule._set_unshard_async_op",
        "parallel.fsdp on CPU ranks: the all-gathers of FSDP2's prefetching are issued asynchronously, as a "
        "GPU's all-gather stream runs them, so that they overlap the current block on the virtual clock",
        ("self", "async_op"),
    ),
    Internal(
        "torch.distributed.pipelining.schedules",
        "_PipelineSchedule._warmup_p2p",
        "parallel.pipeline on a simulated machine: the warm-up vote's tensors decide the schedule's mode by "
        ".item(), so they are made real there",
        ("self", "stages", "has_backward", "p2p_done"),
    ),
    Internal(
        "torch._subclasses.fake_tensor",
        "FakeTensor",
        "emulate.process_group: a collective on tensors without storage moves no data (simulated cluster)",
    ),
    Internal(
        "torch.distributed._tools.mem_tracker",
        "MemTracker",
        "measure.measure: bytes per category (parameters, gradients, optimizer, activations)",
    ),
    Internal(
        "torch.distributed._tools.mem_tracker", "_TOTAL_KEY", "measure.measure: the total of a snapshot"
    ),
    Internal(
        "torch.distributed._tools.mem_tracker",
        "MemTracker._pre_fw_hook",
        "measure.measure: allow several forwards in one step (gradient accumulation)",
        ("self", "module", "inputs"),
    ),
    Internal(
        "torch.distributed._tools.mem_tracker",
        "MemTracker._update_peak_stats",
        "measure.measure: update only the global peak (per-module peaks make big models slow)",
        ("self", "peak_state"),
    ),
    Internal(
        "torch.distributed._tools.mem_tracker",
        "MemTracker.reset_mod_stats",
        "measure.measure: clear per-module stats before a second forward",
        ("self",),
    ),
    Internal(
        "torch.distributed._tools.mod_tracker",
        "register_multi_grad_hook",
        "measure.measure: remove the hooks ModTracker leaves on module inputs (they leak)",
        ("tensors", "fn"),
    ),
    Internal(
        "torch.cuda",
        "_sleep",
        "bandwidth: keep the GPU busy while the host enqueues the timed collectives",
        ("cycles",),
    ),
    Internal(
        "torch.distributed.distributed_c10d",
        "_get_default_store",
        "torchrun.run: ranks report their outcome through the rendezvous store, which a peer blocked in a "
        "collective cannot hold up",
    ),
    Internal(
        "torch.distributed.distributed_c10d",
        "_world.pg_map",
        "emulate: find this process's emulated groups to close them before exit",
    ),
    Internal("torch.distributed", "Backend._plugins", "emulate: register the emulated backend once"),
    Internal(
        "torch._C",
        "_current_graph_task_id",
        "emulate.timing: is this thread inside backward (where DDP's reducer waits in C++)?",
    ),
    Internal(
        "torch.autograd",
        "Variable._execution_engine.queue_callback",
        "emulate.timing: run a callback when the current backward ends",
    ),
    Internal(
        "torch.distributed",
        "ProcessGroupGloo._allgather_base",
        "emulate: all_gather_into_tensor on the wrapped gloo group",
    ),
    Internal(
        "torch.distributed",
        "ProcessGroupGloo._reduce_scatter_base",
        "emulate: reduce_scatter_tensor on the wrapped gloo group",
    ),
    Internal(
        "torch.cuda.memory",
        "_set_allocator_settings",
        "experiments.fragmentation: PYTORCH_CUDA_ALLOC_CONF options after CUDA has started",
        ("env",),
    ),
    *(
        Internal(
            "torch.distributed", f"ProcessGroup.{name}", f"emulate: EmulatedProcessGroup overrides {name}"
        )
        for name in ("_allgather_base", "_reduce_scatter_base", "_set_group_name", "_get_backend")
    ),
)

# ProcessGroup methods with a leading underscore that `EmulatedProcessGroup` overrides:
# torch calls them on a Python subclass (all_gather_into_tensor, reduce_scatter_tensor,
# group naming and, from torch 2.14, batch_isend_irecv's backend lookup).
PROCESS_GROUP_OVERRIDES = ("_allgather_base", "_reduce_scatter_base", "_set_group_name", "_get_backend")


def _resolve(item: Internal) -> Any:
    obj: Any = importlib.import_module(item.module)
    for part in item.attr.split("."):
        obj = getattr(obj, part)
    return obj


def problems() -> list[str]:
    """One line per internal that is missing or no longer looks as labkit expects; [] if all fine."""
    found = []
    for item in INTERNALS:
        where = f"{item.qualname} (labkit uses it in {item.used_for}; known to work on torch {KNOWN_GOOD})"
        try:
            obj = _resolve(item)
        except (ImportError, AttributeError) as exc:
            found.append(f"{where} is missing on torch {torch.__version__}: {type(exc).__name__}: {exc}")
            continue
        if item.params:
            try:
                names = tuple(inspect.signature(obj).parameters)[: len(item.params)]
            except (TypeError, ValueError):
                names = ()
            if names != item.params:
                found.append(
                    f"{where} changed on torch {torch.__version__}: parameters start {names}, "
                    f"labkit expects {item.params}"
                )
    return found


# ------------------------------------------------------------------ pytree, dispatch


def dispatch_mode_stack() -> list[Any]:
    """The TorchDispatchModes active on this thread, outermost first."""
    return list(_get_current_dispatch_mode_stack())


def fake_tensor_mode() -> Any:
    """A `FakeTensorMode`: tensors made inside have shapes and dtypes but no storage.

    Its cache of operators' outputs is keyed more cheaply than torch's own (`_cheaper_cache_key_mode`)."""
    return _cheaper_cache_key_mode()()


@functools.cache
def _cheaper_cache_key_mode() -> type:
    """FakeTensorMode with a cheaper key for its cache of operators' outputs, the same cache otherwise.

    A FakeTensorMode caches each operator's output metadata under a key made from its arguments
    (`FakeTensorMode._prep_args_for_hash`). torch turns every FakeTensor argument into a `TensorMetadata`
    and flattens that field by field, recursing into its shape and strides; on a simulated rank that was
    the most expensive part of an operator (py-spy: 18 % of lab 03's simulated ranks). Here a strided
    FakeTensor of this mode, without symbolic shapes, becomes one tuple of the same facts, read from the
    tensor in a few calls: dtype, shape, strides, device, storage offset and bytes, requires_grad,
    quantized, conj, neg, inference. The layout is strided on this path, and torch's memory format is left
    out: it is a function of the shape and strides. Anything else (another mode's tensor, a constant, a
    sparse tensor, a symbolic size, a non-tensor) goes through torch's own method, which also decides when
    the cache is bypassed.
    `tests/machine/test_torch_compat.py` runs a training step with torch's cross-check of every cache hit."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    class CheaperCacheKeyMode(FakeTensorMode):
        def _prep_args_for_hash(
            self, result: list, args: Any, state: Any, id_hashed_objects: list
        ) -> None:
            if self.shape_env is not None or isinstance(args, dict):
                super()._prep_args_for_hash(result, args, state, id_hashed_objects)
                return
            if isinstance(args, (list, tuple)):
                result.append(type(args))
                result.append(len(args))
            for arg in args:
                if (
                    isinstance(arg, FakeTensor)
                    and arg.fake_mode is self
                    and arg.constant is None
                    and arg.layout == torch.strided
                ):
                    result.append(_CHEAPER_KEY)
                    result.append(
                        (
                            arg.dtype,
                            tuple(arg.shape),
                            arg.stride(),
                            arg.device,
                            arg.storage_offset(),
                            arg.untyped_storage().nbytes(),
                            arg.requires_grad,
                            arg.is_quantized,
                            arg.is_conj(),
                            arg.is_neg(),
                            arg.is_inference(),
                        )
                    )
                elif isinstance(arg, (list, tuple)):
                    self._prep_args_for_hash(result, arg, state, id_hashed_objects)
                else:
                    super()._prep_args_for_hash(result, (arg,), state, id_hashed_objects)

    return CheaperCacheKeyMode


class _CheaperKey:
    """Marks a tensor's entry in a `_cheaper_cache_key_mode` key: torch's cache is shared by every
    FakeTensorMode, and no key torch makes holds this object, so the two kinds of key never meet."""


_CHEAPER_KEY = _CheaperKey()


def real_tensors() -> Any:
    """A context in which tensors are real again, inside a FakeTensorMode (a no-op outside one)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def report_storage_resizes(report: Callable[[Any, int], None]) -> None:
    """In this process, call `report(storage, nbytes)` after every `UntypedStorage.resize_`: a resize changes
    the memory a storage holds without any operator that a TorchDispatchMode sees (FSDP2 frees and refills its
    unsharded parameters so). Once per process; a later call replaces `report`."""
    current = torch.UntypedStorage.resize_
    original = getattr(current, "_labkit_original", current)

    def resize_and_report(self: Any, nbytes: int) -> Any:
        out = original(self, nbytes)
        report(self, self.nbytes())
        return out

    resize_and_report._labkit_original = original  # type: ignore[attr-defined]
    torch.UntypedStorage.resize_ = resize_and_report  # type: ignore[method-assign]


def unshard_asynchronously(module: Any) -> None:
    """Make FSDP2 issue `module`'s (and its FSDP submodules') all-gathers with `async_op=True`: a rank
    without CUDA streams then runs on while they complete, which explicit prefetching needs to overlap them
    (torch's docstring of `FSDPModule._set_unshard_async_op`)."""
    module._set_unshard_async_op(True)


def real_warmup_vote(schedule: Any) -> None:
    """Make `schedule`'s P2P warm-up (torch.distributed.pipelining: each stage votes with a one-element tensor
    sent to the next, and the result's `.item()` picks the schedule's inference mode) run on real tensors,
    inside a FakeTensorMode; the stages' own work stays fake. Nothing where the schedule has no such
    warm-up."""
    original = getattr(schedule, "_warmup_p2p", None)
    if original is None:
        return

    def on_real_tensors(*args: Any, **kwargs: Any) -> Any:
        with real_tensors():
            return original(*args, **kwargs)

    schedule._warmup_p2p = on_real_tensors


# torch.distributed's collectives of Python objects: they pickle into byte tensors and read sizes back with
# .item(), so inside a FakeTensorMode their tensors must be real
OBJECT_COLLECTIVES = (
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
)


def real_object_collectives() -> None:
    """In this process, make torch.distributed's object collectives run on real tensors inside a
    FakeTensorMode (a simulated rank: its objects, e.g. pipelining's stage metadata, still travel through
    the process group). Called once per simulated rank process."""
    for name in OBJECT_COLLECTIVES:
        original = getattr(dist, name)
        if getattr(original, "_labkit_real", False):
            continue

        def on_real_tensors(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            with real_tensors():
                return _original(*args, **kwargs)

        on_real_tensors._labkit_real = True  # type: ignore[attr-defined]
        setattr(dist, name, on_real_tensors)


@functools.cache
def _fake_tensor_type() -> type:
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor


def is_fake(t: Any) -> bool:
    """Is `t` a FakeTensor (shape and dtype, no storage)? Asked around most operators of a simulated rank:
    the class is looked up once."""
    return isinstance(t, _fake_tensor_type())


def fake_constant(t: Any) -> torch.Tensor | None:
    """The real value a FakeTensor carries (`FakeTensor.constant`: a one-element tensor made from a real one,
    such as an optimizer's step count, whose `.item()` FakeTensorMode answers from it), None otherwise."""
    return getattr(t, "constant", None) if is_fake(t) else None


def is_wrapper_subclass(t: Any) -> bool:
    """Is `t` a tensor subclass that wraps other tensors (a DTensor: FSDP2's sharded parameters and their
    gradients)? Its storage holds no memory of its own (its size is the global shape's), and its operators run
    as operators on the tensors inside. Such subclasses declare `__tensor_flatten__` (torch's protocol for
    traceable wrapper subclasses)."""
    return isinstance(t, torch.Tensor) and hasattr(type(t), "__tensor_flatten__")


def unwrapped(tree: Any) -> Any:
    """`tree` with each wrapper subclass (`is_wrapper_subclass`) replaced by the tensor inside it (a tuple
    of them when it holds several), by the subclass protocol's `__tensor_flatten__`."""

    def inner(t: Any) -> Any:
        if not is_wrapper_subclass(t):
            return t
        names, _ = t.__tensor_flatten__()
        tensors = tuple(getattr(t, name) for name in names)
        return tensors[0] if len(tensors) == 1 else tensors

    return tree_map(inner, tree)


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor `t` is a view of (`Tensor._base`), None if it is not a view: autograd saves a weight
    as a view of the parameter (`W.t()` for a linear layer), which owns the storage."""
    return t._base


# ------------------------------------------------------------------- MemTracker


def step_mem_tracker() -> Any:
    """A torch `MemTracker` adjusted for one training step (checked on torch 2.13 and 2.14).

    * MemTracker refuses a second forward of the root module ("multiple iterative calls"),
      which gradient accumulation does inside one step: clear its per-module stats (not the
      peak) before such a call;
    * after every op it updates a peak for every module, which dominates the run time of big
      models (27 s instead of a few for a fake Llama-2 7B step); labkit reads only the
      global peak, so only that is updated.
    """
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class _StepMemTracker(MemTracker):
        def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
            tracker = self._mod_tracker
            if module in self.memory_tracking and not tracker.is_bw:
                name = tracker.get_known_fqn(module)
                if set(tracker.parents) - {name} == {"Global"}:
                    self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(dev_snap)

    return _StepMemTracker()


@contextlib.contextmanager
def removing_module_grad_hooks() -> Iterator[None]:
    """Remove, when the block ends, the backward hooks MemTracker's ModTracker registered in it.

    Each such hook's closure holds the autograd nodes of the tensors it is registered on: a
    cycle through C++ that Python's collector cannot free, so every tracked step leaked its
    parameters and gradients (torch 2.13: all but 5 of 29 parameters of a small GPT stayed
    alive). ModTracker keeps no handles, so `register_multi_grad_hook` in its module is
    replaced by a recording one only while the block runs.
    """
    from torch.distributed._tools import mod_tracker

    handles: list[Any] = []
    original = mod_tracker.register_multi_grad_hook

    def recording(*args: Any, **kwargs: Any) -> Any:
        handle = original(*args, **kwargs)
        handles.append(handle)
        return handle

    mod_tracker.register_multi_grad_hook = recording
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = original
        for handle in handles:
            handle.remove()


# ------------------------------------------------------------------- autograd


def graph_task_id() -> int:
    """The id of the backward running on this thread, -1 outside backward."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    return graph_task_id() != -1


def queue_backward_callback(fn: Any) -> None:
    """Run `fn()` when the current backward ends (after callbacks queued before it)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


# ------------------------------------------------------------- process groups


def backend_registered(name: str) -> bool:
    """Whether a third-party backend of this name is registered with torch.distributed."""
    return name.upper() in dist.Backend._plugins


def cuda_spin(seconds: float, cycles_per_s: float = 2.0e9) -> None:
    """Enqueue a kernel that keeps the current GPU stream busy for at least `seconds` (it spins `cycles`
    clock cycles: at 2 GHz, above an H100's or H200's boost clock, so a slower clock only spins longer)."""
    torch.cuda._sleep(int(seconds * cycles_per_s))


def default_store() -> dist.Store:
    """The store of the default process group (under torchrun: its rendezvous store, behind a prefix)."""
    return dist.distributed_c10d._get_default_store()


def process_groups() -> list[dist.ProcessGroup]:
    """Every process group this process has created (the world group included)."""
    return list(dist.distributed_c10d._world.pg_map)


def allgather_base(pg: dist.ProcessGroup, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
    """`pg`'s all-gather into one tensor (what `dist.all_gather_into_tensor` calls)."""
    return pg._allgather_base(output, input, opts)


def reduce_scatter_base(pg: dist.ProcessGroup, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
    """`pg`'s reduce-scatter from one tensor (what `dist.reduce_scatter_tensor` calls)."""
    return pg._reduce_scatter_base(output, input, opts)


def set_cuda_allocator_settings(settings: str) -> None:
    """Apply PYTORCH_CUDA_ALLOC_CONF options (e.g. "expandable_segments:True") in a running process.

    The environment variable is read once, when CUDA's allocator starts; this changes the options
    later, for segments created from then on (torch/cuda/memory.py, `_set_allocator_settings`).
    """
    torch.cuda.memory._set_allocator_settings(settings)
