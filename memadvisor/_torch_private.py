"""The one place memadvisor touches private torch APIs.

Each function names the private API it wraps and falls back (or raises a clear error) when a
torch release moves it, so a torch upgrade breaks one file, not the whole package. Add-only:
other modules import from here, never from ``torch._*`` directly.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "TorchPrivateAPIError",
    "CACHED_RNG_ENV",
    "GRAPH_MODES",
    "autocast_registrations",
    "backend_patches",
    "below_cpu_autocast",
    "clear_cublas_workspaces",
    "compile_modes",
    "cuda_counter_reader",
    "cuda_memory_counters",
    "dtensor_local",
    "dynamo_counters",
    "fake_copy",
    "fake_mode_active",
    "fake_module_conversion",
    "fake_tensor_mode",
    "flop_formulas",
    "import_compiler",
    "inductor_backend",
    "inductor_cache_dir",
    "is_fake",
    "memory_snapshot",
    "memory_snapshot_html",
    "record_memory_history",
    "tensor_version",
]


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``FakeTensor`` (``torch._subclasses.fake_tensor``)."""
    try:
        from torch._subclasses.fake_tensor import is_fake as _is_fake
    except ImportError:  # pragma: no cover - moved in a future torch: fall back to the class
        return type(tensor).__name__ == "FakeTensor"
    return bool(_is_fake(tensor))


def tensor_version(tensor: torch.Tensor) -> int | None:
    """How many times ``tensor`` was written in place (``Tensor._version``); None for a
    tensor that keeps no count (an inference tensor) or a torch that dropped the attribute."""
    try:
        return int(tensor._version)
    except (RuntimeError, AttributeError):
        return None


def fake_mode_active() -> bool:
    """Whether a ``FakeTensorMode`` is on the dispatch-mode stack right now."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    except ImportError:  # pragma: no cover - moved in a future torch
        return False
    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


def clear_cublas_workspaces() -> bool:
    """Free cuBLAS's per-handle workspaces (``torch._C._cuda_clearCublasWorkspaces``).

    The next matmul on each thread allocates its workspace again, through the caching
    allocator, as in a fresh process. Returns False where this torch has no such call.
    """
    clear: Any = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or not torch.cuda.is_available():
        return False
    clear()
    return True


class TorchPrivateAPIError(ImportError):
    """A private torch API memadvisor relies on is missing from this torch build."""


def _missing(what: str, error: Exception) -> TorchPrivateAPIError:
    return TorchPrivateAPIError(
        f"memadvisor needs {what}, which this torch ({torch.__version__}) does not provide "
        f"({type(error).__name__}: {error}). Install a torch from 2.11 on, or report the "
        "version so memadvisor/_torch_private.py can follow the move."
    )


def fake_tensor_mode(**kwargs: Any) -> Any:
    """A new ``torch._subclasses.fake_tensor.FakeTensorMode(**kwargs)``.

    Raises:
        TorchPrivateAPIError: this torch has no FakeTensorMode there.
    """
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError as e:  # pragma: no cover - moved in a future torch
        raise _missing("torch._subclasses.fake_tensor.FakeTensorMode", e) from e
    return FakeTensorMode(**kwargs)


def autocast_registrations(device_type: str) -> set[str]:
    """Names of the aten ops with an autocast kernel for ``device_type`` ('cpu' or 'cuda').

    Read from the dispatcher (``torch._C._dispatch_get_registrations_for_dispatch_key``),
    so it follows the installed torch. CUDA's registrations are compiled into CPU-only
    builds too, which is what lets a CPU emulate CUDA's autocast policy.

    Raises:
        TorchPrivateAPIError: the dispatcher introspection API is gone.
    """
    key = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}[device_type]
    try:
        return set(torch._C._dispatch_get_registrations_for_dispatch_key(key))
    except AttributeError as e:  # pragma: no cover - moved in a future torch
        raise _missing("torch._C._dispatch_get_registrations_for_dispatch_key", e) from e


@contextmanager
def below_cpu_autocast() -> Iterator[None]:
    """Run ops with CPU autocast's kernels skipped, as autocast's own kernels call through.

    Wraps ``torch._C._ExcludeDispatchKeyGuard(DispatchKeySet(DispatchKey.AutocastCPU))``.

    Raises:
        TorchPrivateAPIError: the guard or the dispatch key is gone.
    """
    try:
        keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
        guard = torch._C._ExcludeDispatchKeyGuard(keys)
    except AttributeError as e:  # pragma: no cover - moved in a future torch
        raise _missing("torch._C._ExcludeDispatchKeyGuard (AutocastCPU)", e) from e
    with guard:
        yield


def fake_copy(obj: Any, mode: Any) -> Any:
    """``copy.deepcopy(obj)`` with every tensor in it made a fake tensor of ``mode``.

    Real tensors become fake (no memory); fake ones get fresh fake storages of ``mode``
    (a plain deepcopy of a fake tensor lands in a new mode, which no op can mix with the
    old one). Shared tensors (tied weights) stay shared. Wraps
    ``torch._subclasses.fake_tensor.FakeCopyMode``.

    Raises:
        TorchPrivateAPIError: this torch has no FakeCopyMode.
    """
    import copy

    try:
        from torch._subclasses.fake_tensor import FakeCopyMode
    except ImportError as e:  # pragma: no cover - moved in a future torch
        raise _missing("torch._subclasses.fake_tensor.FakeCopyMode", e) from e
    with FakeCopyMode(mode):
        return copy.deepcopy(obj)


class _FakeSwap:
    """Wraps ``torch.utils.swap_tensors`` while any :func:`fake_module_conversion` is open."""

    def __init__(self) -> None:
        self.depth = 0
        self.original: Any = None
        self.lock = threading.Lock()

    def enter(self) -> None:
        with self.lock:
            if self.depth == 0:
                self.original = original = torch.utils.swap_tensors

                def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
                    _forget_fake_memo(t1)
                    _forget_fake_memo(t2)
                    original(t1, t2)

                torch.utils.swap_tensors = swap_tensors
            self.depth += 1

    def exit(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                torch.utils.swap_tensors = self.original
                self.original = None


_FAKE_SWAP = _FakeSwap()


def _forget_fake_memo(tensor: Any) -> None:
    """Drop ``tensor`` from its FakeTensorMode's conversion memo, a cache
    (``fake_tensor_converter.meta_converter.tensor_memo``, a ``WeakValueDictionary``) whose
    weak reference to it is the only one; a tensor not in one is left alone."""
    if not isinstance(tensor, torch.Tensor) or not is_fake(tensor):
        return
    try:
        memo = tensor.fake_mode.fake_tensor_converter.meta_converter.tensor_memo
    except AttributeError:  # pragma: no cover - moved in a future torch: swap as torch does
        return
    for key in [k for k, v in list(memo.items()) if v is tensor]:
        memo.pop(key, None)


@contextmanager
def fake_module_conversion() -> Iterator[None]:
    """Let ``nn.Module.to(dtype)`` / ``.to(device)`` convert fake parameters.

    ``Module._apply`` swaps a fake parameter with its converted copy
    (``torch.utils.swap_tensors``), which refuses any tensor with a weak reference; every
    fake tensor an op makes is held weakly by its mode's conversion memo (``Parameter()``
    makes one through ``detach``), so the swap always fails ("_apply(): Couldn't swap
    Embedding.weight"; pytorch/pytorch#148977, #170781). Inside this context the swap first
    drops both tensors from that memo (a cache: a miss only makes a new fake), then swaps
    as torch does; any other weak reference still refuses the swap.

    Patches the ``torch.utils.swap_tensors`` attribute while open (nested and threaded uses
    share one patch); torch's own function is back when the last one closes.
    """
    _FAKE_SWAP.enter()
    try:
        yield
    finally:
        _FAKE_SWAP.exit()


def record_memory_history(enabled: bool, *, max_entries: int = 100_000) -> None:
    """Start (or stop) the CUDA allocator's history of every alloc and free, with stacks.

    Wraps ``torch.cuda.memory._record_memory_history``.

    Raises:
        ImportError: this torch has no such call.
    """
    try:
        record = torch.cuda.memory._record_memory_history
    except AttributeError as e:  # pragma: no cover - moved in a future torch
        raise _gone("torch.cuda.memory._record_memory_history", e) from e
    if enabled:
        record(enabled="all", max_entries=max_entries)
    else:
        record(enabled=None)


def set_allocator_settings(settings: str) -> None:
    """Set the caching allocator's settings for this process, as ``PYTORCH_CUDA_ALLOC_CONF``
    spells them (``"expandable_segments:True"``), also after CUDA started: new segments
    follow them, reserved ones stay as they are.

    Wraps ``torch._C._accelerator_setAllocatorSettings`` (torch 2.9 and later; before it,
    ``torch.cuda.memory._set_allocator_settings``, which now warns and calls it).

    Raises:
        ImportError: this torch has neither call.
    """
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:  # pragma: no cover - moved in a future torch
        raise _gone("torch._C._accelerator_setAllocatorSettings", AttributeError(settings))
    setter(settings)


def allocator_settings() -> str:
    """The caching allocator's settings as this process last set them ('' where none was:
    torch's defaults, or only the environment's variable, which this does not read back).

    Wraps ``torch._C._accelerator_getAllocatorSettings``.

    Raises:
        ImportError: this torch has no such call.
    """
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is None:  # pragma: no cover - moved in a future torch
        raise _gone("torch._C._accelerator_getAllocatorSettings", AttributeError("get"))
    return str(getter())


def memory_snapshot() -> dict:
    """The CUDA allocator's snapshot: segments, blocks and the recorded history.

    Wraps ``torch.cuda.memory._snapshot``; the dict pickles to the file that
    https://pytorch.org/memory_viz loads.

    Raises:
        ImportError: this torch has no such call.
    """
    try:
        return torch.cuda.memory._snapshot()
    except AttributeError as e:  # pragma: no cover - moved in a future torch
        raise _gone("torch.cuda.memory._snapshot", e) from e


def memory_snapshot_html(snapshot: dict) -> str:
    """torch's own viewer page for ``snapshot`` (``torch.cuda._memory_viz.trace_plot``).

    The page embeds the snapshot but loads torch's viewer script from a CDN, so it needs a
    network connection to open (torch ships no copy of the script).

    Raises:
        ImportError: this torch has no such module.
    """
    try:
        from torch.cuda._memory_viz import trace_plot
    except ImportError as e:  # pragma: no cover - moved in a future torch
        raise _gone("torch.cuda._memory_viz.trace_plot", e) from e
    return trace_plot(snapshot)


def cuda_memory_counters(device: torch.device | str | int | None = None) -> dict[str, int]:
    """The CUDA caching allocator's counters from one stats call.

    ``torch.cuda.memory_allocated``, ``max_memory_allocated``, ``memory_reserved`` ... each
    build and flatten the whole ``memory_stats`` dict (tens of microseconds apiece); this reads
    the nested dict of ``torch._C._cuda_memoryStats`` once. Falls back to the public
    ``torch.cuda.memory_stats`` where that call is gone.

    Returns:
        ``allocated``, ``allocated_peak``, ``reserved``, ``reserved_peak`` (bytes) and
        ``allocations`` (cumulative count of allocations) and ``alloc_retries`` (cumulative
        count of allocations that failed, made the allocator free its cache, and were
        tried again: a step that fits only so is slow).
    """
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, int):
        index = device
    else:
        d = torch.device(device)
        index = d.index if d.index is not None else torch.cuda.current_device()
    stats_fn: Any = getattr(torch._C, "_cuda_memoryStats", None)
    if stats_fn is not None:
        s = stats_fn(index)
        allocated, reserved = s["allocated_bytes"]["all"], s["reserved_bytes"]["all"]
        return {
            "allocated": allocated["current"],
            "allocated_peak": allocated["peak"],
            "reserved": reserved["current"],
            "reserved_peak": reserved["peak"],
            "allocations": s["allocation"]["all"]["allocated"],
            "alloc_retries": int(s.get("num_alloc_retries", 0)),
        }
    flat = torch.cuda.memory_stats(index)  # pragma: no cover - moved in a future torch
    return {  # pragma: no cover
        "allocated": flat.get("allocated_bytes.all.current", 0),
        "allocated_peak": flat.get("allocated_bytes.all.peak", 0),
        "reserved": flat.get("reserved_bytes.all.current", 0),
        "reserved_peak": flat.get("reserved_bytes.all.peak", 0),
        "allocations": flat.get("allocation.all.allocated", 0),
        "alloc_retries": flat.get("num_alloc_retries", 0),
    }


def cuda_counter_reader(index: int, *, reset_peaks: bool = False) -> Callable[[], tuple]:
    """A zero-argument reader of card ``index``'s allocator counters, for per-event hot paths.

    Binds ``torch._C._cuda_memoryStats`` (and ``torch._C._cuda_resetPeakMemoryStats``) once,
    so a reading is one stats call (and one reset), without the device lookup and dict that
    :func:`cuda_memory_counters` builds around it. Falls back to that function and the public
    ``torch.cuda.reset_peak_memory_stats`` where the private calls are gone.

    Args:
        index: the card's index.
        reset_peaks: reset the allocator's peak counters after each reading, so the next
            reading's peaks cover only the time since this one.

    Returns:
        ``() -> (allocated, reserved, allocated_peak, reserved_peak, allocations)``.
    """
    stats_fn: Any = getattr(torch._C, "_cuda_memoryStats", None)
    reset_fn: Any = getattr(torch._C, "_cuda_resetPeakMemoryStats", None)
    if stats_fn is None or reset_fn is None:  # pragma: no cover - moved in a future torch

        def read_public() -> tuple:
            c = cuda_memory_counters(index)
            if reset_peaks:
                torch.cuda.reset_peak_memory_stats(index)
            return (c["allocated"], c["reserved"], c["allocated_peak"], c["reserved_peak"],
                    c["allocations"])  # fmt: skip

        return read_public

    def read() -> tuple:
        s = stats_fn(index)
        allocated, reserved = s["allocated_bytes"]["all"], s["reserved_bytes"]["all"]
        if reset_peaks:
            reset_fn(index)
        return (allocated["current"], reserved["current"], allocated["peak"], reserved["peak"],
                s["allocation"]["all"]["allocated"])  # fmt: skip

    return read


def _gone(what: str, error: Exception) -> ImportError:
    return ImportError(
        f"memadvisor needs {what}, which this torch ({torch.__version__}) does not provide "
        f"({type(error).__name__}: {error}). Install a torch from 2.11 on."
    )


# -- what torch's compile writes into its own process's environment ------------------------

#: Variables inductor and triton set in ``os.environ`` of the process that compiles, for
#: themselves and their workers (torch 2.11-2.13: triton's cache directory, derived from
#: inductor's; the compile pool's warm-up switch; the toolchain's paths; a pointer for loaded
#: C++ kernels). A process that compiles later derives the same values itself.
COMPILE_SET_ENVIRONMENT = frozenset(
    {
        "TRITON_CACHE_DIR",
        "TORCH_WARM_POOL",
        "TRITON_PTXAS_PATH",
        "TRITON_LIBDEVICE_PATH",
        "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
        "KMP_DUPLICATE_LIB_OK",
        "CUDA_HOME",
    }
)


# -- fp32 matmul precision: read and restored exactly ----------------------------------------

# The per-backend settings of torch's newer precision API that the legacy
# torch.set_float32_matmul_precision writes (torch 2.9 on); (object path, attribute).
_PRECISION_FIELDS = (("backends", "fp32_precision"), ("backends.cuda.matmul", "fp32_precision"))


def _field_owner(path: str) -> Any:
    """``torch.<path>`` (``"backends.cuda.matmul"``), or None where this torch lacks it."""
    owner: Any = torch
    for name in path.split("."):
        owner = getattr(owner, name, None)
        if owner is None:
            return None
    return owner


def matmul_precision_state() -> tuple[str, tuple[str | None, ...]]:
    """The process's fp32 matmul precision, as :func:`restore_matmul_precision` puts it back:
    the legacy setting and the newer API's per-backend fields.

    Why both: ``torch.set_float32_matmul_precision("highest")`` after "high" leaves
    ``torch.backends.cuda.matmul.fp32_precision`` at "ieee" where a fresh process has "none"
    (torch 2.13), and inductor keys its on-disk FX graph cache on that field, so a process
    that restored the legacy setting alone compiles graphs no fresh process finds.
    """
    fields = tuple(
        getattr(owner, attr, None) if (owner := _field_owner(path)) is not None else None
        for path, attr in _PRECISION_FIELDS
    )
    return torch.get_float32_matmul_precision(), fields


def restore_matmul_precision(state: tuple[str, tuple[str | None, ...]]) -> None:
    """Put back what :func:`matmul_precision_state` read."""
    legacy, fields = state
    torch.set_float32_matmul_precision(legacy)
    for (path, attr), value in zip(_PRECISION_FIELDS, fields, strict=True):
        owner = _field_owner(path)
        if value is not None and owner is not None and getattr(owner, attr, value) != value:
            setattr(owner, attr, value)


# -- torch.compile: modes, the inductor backend, dynamo's counters, the on-disk cache ------


def compile_modes() -> dict[str, dict[str, Any]]:
    """Each ``torch.compile`` mode and the inductor options it sets.

    Wraps ``torch._inductor.list_mode_options()``, so it follows the installed torch.

    Raises:
        TorchPrivateAPIError: this torch has no such call.
    """
    try:
        from torch._inductor import list_mode_options
    except ImportError as e:  # pragma: no cover - moved in a future torch
        raise _missing("torch._inductor.list_mode_options", e) from e
    return dict(list_mode_options())


class _PatchedInductor:
    """Inductor with ``torch._functorch.config`` settings patched while it runs.

    The partitioner reads them (the activation memory budget, how a recomputed random op
    gets its random state) when AOTAutograd splits the joint graph, which happens inside the
    backend call at the forward's compile; patching there scopes them to this backend's
    graphs instead of setting them for the whole process, and AOTAutograd's cache key, made
    in the same call, sees them.
    """

    def __init__(self, inner: Any, patches: dict[str, Any]) -> None:
        self.inner = inner
        self.patches = patches

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        import torch._functorch.config as functorch_config

        with functorch_config.patch(**self.patches):
            return self.inner(gm, example_inputs)

    def __getattr__(self, name: str) -> Any:
        # dynamo asks a backend for compiler_name, get_compiler_config(), reset(): inductor's.
        return getattr(self.inner, name)


_BACKENDS: dict[tuple[str, float | None], Any] = {}

#: torch.compile's modes that replay steps as CUDA graphs: a recomputed random op there
#: needs AOTAutograd's CUDA-graph-safe random state (torch's default).
GRAPH_MODES = frozenset({"reduce-overhead", "max-autotune"})
#: Set to ``1``, compiles in a mode without CUDA graphs recompute random ops from a saved seed
#: and offset instead of the CUDA-graph-safe random state (:func:`backend_patches`). Off
#: unless set: a bench's A/B and the measurements it still needs (docs/design.md, session
#: 33); the probes' processes inherit it.
CACHED_RNG_ENV = "MEMADVISOR_CACHED_RNG"


def backend_patches(mode: str, activation_memory_budget: float | None = None) -> dict[str, Any]:
    """The ``torch._functorch.config`` settings :func:`inductor_backend` patches around each
    graph's compile for ``mode`` and a budget.

    * ``activation_memory_budget``, where given.
    * ``graphsafe_rng_functionalization`` off, only where :data:`CACHED_RNG_ENV` is ``1``,
      in a mode that replays no CUDA graphs (not :data:`GRAPH_MODES`), where this torch has
      the setting. Why it exists: a checkpointed block's random ops (dropout) are recomputed
      in backward from a saved random state; torch's default keeps it in a CUDA-graph-safe
      form whose operator torch 2.11's FX graph cache will not take ("Can't cache
      HigherOrderOperator: graphsafe_run_with_rng_state"), so each process compiles such a
      block afresh. The other form (a saved seed and offset) is cached: on an H200 the GPT
      example's two checkpointed blocks with a dynamic batch loaded all 6 graphs in a second
      process (first step 6.6 s, 24.7 s cold) where the default bypassed the cache for 2
      (13.5 s; docs/design.md, session 33).

    Known limitations: not on by default. Plans on a card with and without it took the same
    time (the search's later runs are static compiles at new batches, which no cache
    serves), and a small checkpointed model with dropout and a dynamic batch failed to
    compile with it ("Node mm was invalid, but is output", torch 2.11) where it was not
    run without it, so whether it costs a model its compile is not known.
    """
    patches: dict[str, Any] = {}
    if activation_memory_budget is not None:
        patches["activation_memory_budget"] = activation_memory_budget
    if mode not in GRAPH_MODES and os.environ.get(CACHED_RNG_ENV) == "1":
        import torch._functorch.config as functorch_config

        if hasattr(functorch_config, "graphsafe_rng_functionalization"):
            patches["graphsafe_rng_functionalization"] = False
    return patches


def inductor_backend(mode: str, activation_memory_budget: float | None = None) -> Any:
    """The inductor backend ``torch.compile(mode=mode)`` uses, for ``backend=``.

    One object per ``(mode, activation_memory_budget)`` for the life of the process: dynamo
    tells backends apart by identity, so a compiled function reuses its graphs across model
    copies with the same settings and recompiles for different ones. Wraps
    ``torch._TorchCompileInductorWrapper``, patching :func:`backend_patches`' settings of
    ``torch._functorch.config`` around each graph's compile.

    Raises:
        TorchPrivateAPIError: this torch has no such wrapper.
    """
    key = (mode, activation_memory_budget)
    if key not in _BACKENDS:
        wrapper: Any = getattr(torch, "_TorchCompileInductorWrapper", None)
        if wrapper is None:  # pragma: no cover - moved in a future torch
            raise _missing("torch._TorchCompileInductorWrapper", AttributeError(key))
        inner = wrapper(mode, None, None)
        patches = backend_patches(mode, activation_memory_budget)
        _BACKENDS[key] = _PatchedInductor(inner, patches) if patches else inner
    return _BACKENDS[key]


def import_compiler() -> bool:
    """Import what a process's first ``torch.compile`` imports when its inductor backend is
    first called (``torch._dynamo.backends.inductor`` imports ``torch._inductor.compile_fx``
    then: 585 modules, 1.1-2.6 s on an H200's host from bytecode, 4.1-4.5 s from source), so that
    a process forked after this finds them imported. Imports only: no compile worker pool is
    started (that is ``maybe_warm_pool``, called at the backend's first call), and nothing
    here asks CUDA for anything. False where this torch has no such module.
    """
    try:
        import torch._inductor.compile_fx  # noqa: F401 - imported for the processes forked after
    except ImportError:  # pragma: no cover - moved in a future torch
        return False
    return True


def maybe_mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """``torch._dynamo.maybe_mark_dynamic``: compile ``tensor``'s ``dim`` symbolic unless
    dynamo must specialise it (no error then, unlike ``mark_dynamic``).

    Raises:
        TorchPrivateAPIError: this torch has no such call.
    """
    try:
        from torch._dynamo import maybe_mark_dynamic as mark
    except ImportError as e:  # pragma: no cover - moved in a future torch
        raise _missing("torch._dynamo.maybe_mark_dynamic", e) from e
    mark(tensor, dim)


def compile_cache_counts(
    counters: dict[str, dict[str, int]] | None = None,
) -> tuple[int, int, int]:
    """(hits, misses, bypasses) of inductor's FX graph cache and AOTAutograd's cache so far in
    this process (dynamo's counters, or ``counters``, a :func:`dynamo_counters` reading;
    cumulative: compare two readings). A bypass is a graph the cache would not take (neither
    looked up nor saved). Zeros where this torch counts none of them. The one definition a
    compile trial and a compiled run both report."""
    counters = dynamo_counters() if counters is None else counters
    inductor, aot = counters.get("inductor", {}), counters.get("aot_autograd", {})

    def both(what: str) -> int:
        return inductor.get(f"fxgraph_cache_{what}", 0) + aot.get(f"autograd_cache_{what}", 0)

    return both("hit"), both("miss"), both("bypass")


def dynamo_counters() -> dict[str, dict[str, int]]:
    """A copy of ``torch._dynamo.utils.counters`` (graphs, graph breaks, cache hits so far).

    Process-wide and cumulative: compare two copies to see what one compile did. Empty
    where this torch has no such counters.
    """
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - moved in a future torch
        return {}
    return {group: dict(counts) for group, counts in counters.items()}


def is_compiler_failure(error: BaseException) -> bool:
    """Whether ``error`` is dynamo's ``BackendCompilerFailed``: the compiler (inductor, its
    partitioner) failed on a graph dynamo captured, not the user's code or the device."""
    try:
        from torch._dynamo.exc import BackendCompilerFailed
    except ImportError:  # pragma: no cover - moved in a future torch: nothing is one
        return False
    return isinstance(error, BackendCompilerFailed)


def inductor_default_cache_dir() -> str:
    """Inductor's cache directory where ``$TORCHINDUCTOR_CACHE_DIR`` is not set (what a
    process derives, and what inductor writes into the variable when it first asks)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # pragma: no cover - moved in a future torch: its documented default
        import getpass
        import tempfile

        return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    return os.path.abspath(default_cache_dir())


def inductor_cache_dir() -> str:
    """Where inductor keeps its on-disk caches: ``$TORCHINDUCTOR_CACHE_DIR``, else its default.

    Unlike ``torch._inductor.runtime.cache_dir_utils.cache_dir()``, creates nothing and sets
    no environment variable.
    """
    configured = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if configured:
        return os.path.abspath(configured)
    return inductor_default_cache_dir()


def flop_formulas() -> dict[Any, Callable[..., int]]:
    """FLOP formulas by op (``OpOverloadPacket``): ``formula(*args, **kwargs, out_val=out)``.

    Wraps ``torch.utils.flop_counter.flop_registry`` (what ``FlopCounterMode`` counts:
    matmuls, convolutions, attention). The CPU's flash attention ops, which fake tensors
    on the CPU dispatch to and the registry lacks, get the CUDA flash kernels' formulas
    (their arguments start the same: query, key, value; grad_out first in backward).

    Raises:
        TorchPrivateAPIError: this torch has no such registry.
    """
    try:
        from torch.utils.flop_counter import flop_registry
    except ImportError as e:  # pragma: no cover - moved in a future torch
        raise _missing("torch.utils.flop_counter.flop_registry", e) from e
    aten = torch.ops.aten
    formulas = dict(flop_registry)
    aliases = {
        "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu_backward": (
            "_scaled_dot_product_flash_attention_backward"
        ),
    }
    for cpu_op, card_op in aliases.items():
        cpu, card = getattr(aten, cpu_op, None), getattr(aten, card_op, None)
        if cpu is not None and card in formulas:
            formulas.setdefault(cpu, formulas[card])
    return formulas


def dtensor_local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard behind a ``DTensor`` (its private ``_local_tensor``), else ``tensor``.

    A DTensor is a wrapper: its own storage holds nothing, its shard's does. The public
    ``to_local()`` is an autograd function, which a dispatch mode must not call.
    """
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor
