"""CUDA's autocast policy, emulated on the CPU: plan a card's bf16/fp16 step from a CPU.

CPU and CUDA autocast disagree about which ops run in fp32. On CUDA, ``layer_norm``,
``softmax``, ``log_softmax``, ``sum``, ``exp``, ``pow``, ``rsqrt`` and the norms run in fp32
(and save fp32 tensors for backward); CPU autocast runs them in whatever dtype arrives,
usually bf16. An activation estimate made under CPU autocast would therefore undercount a
card's by every fp32 tensor those ops keep (``docs/design.md``, "Autocast keeps some
tensors in fp32").

:func:`cuda_autocast_policy` fixes that where autocast itself decides, in the dispatcher: it
registers kernels under CPU autocast's dispatch key (``AutocastCPU``) that cast as CUDA's
autocast kernels do, for every op whose CUDA policy differs from the CPU's. The casts are
ordinary ops above autograd, so autograd saves exactly the tensors a card would, and ops
nested inside composite ops (``cross_entropy`` -> ``log_softmax``) follow the policy too.
The op set is read from the dispatcher (CUDA's autocast registrations are compiled into
CPU-only builds); each op's policy comes from the tables below, copied from
``aten/src/ATen/autocast_mode.cpp``.

Only active while CPU autocast is on (``torch.autocast("cpu", ...)``, which the precision
strategy installs); without it nothing changes. Works on real and fake CPU tensors.

Known limitations:
    * Registrations are process-wide while the context is open (the dispatcher has no
      thread-local kernels): CPU autocast in another thread sees CUDA's policy meanwhile.
    * Casts made here are not cached the way autocast caches weight casts; only rare ops
      (``mv``, ``addr``, RNN cells, ``einsum`` on a weight) cast weights here, each use
      then keeps its own copy. Linear, matmul and convolutions keep CPU autocast's own
      (cached) kernels, which CUDA's match.
    * ``prod`` and ``grid_sampler`` keep CPU's policy (fp32 casts; CUDA sets an fp32 output
      dtype or promotes): the same dtype, one input copy more.
    * An op CUDA autocast registers but that is missing from the tables (a newer torch)
      keeps CPU's behaviour; :func:`unmodelled_cuda_ops` lists such ops.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_map

from memadvisor._torch_private import autocast_registrations, below_cpu_autocast

__all__ = [
    "CUDA_FP32",
    "CUDA_FP32_OUTPUT",
    "CUDA_LOWER_PRECISION",
    "CUDA_PROMOTE",
    "cuda_autocast_policy",
    "unmodelled_cuda_ops",
]

# Run in the autocast dtype (bf16/fp16): every eligible float input is cast down.
CUDA_LOWER_PRECISION = frozenset(
    {
        "_convolution",
        "_convolution.deprecated",
        "_scaled_dot_product_flash_attention",
        "_thnn_fused_gru_cell",
        "_thnn_fused_lstm_cell",
        "addbmm",
        "addmm",
        "addmv",
        "addr",
        "baddbmm",
        "bmm",
        "chain_matmul",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_tbc",
        "conv_transpose1d",
        "conv_transpose2d.input",
        "conv_transpose3d.input",
        "convolution",
        "cudnn_convolution",
        "cudnn_convolution_transpose",
        "einsum",
        "gru_cell",
        "linalg_multi_dot",
        "linalg_vecdot",
        "linear",
        "lstm_cell",
        "matmul",
        "mm",
        "mv",
        "prelu",
        "rnn_relu_cell",
        "rnn_tanh_cell",
        "scaled_dot_product_attention",
    }
)

# Run in fp32: every eligible low-precision input is cast up (a real copy, as on CUDA).
CUDA_FP32 = frozenset(
    {
        "_upsample_bicubic2d_aa",
        "_upsample_bilinear2d_aa",
        "_upsample_nearest_exact1d",
        "_upsample_nearest_exact2d",
        "_upsample_nearest_exact3d",
        "acos",
        "asin",
        "binary_cross_entropy_with_logits",
        "cdist",
        "cosh",
        "cosine_embedding_loss",
        "cosine_similarity",
        "dist",
        "erfinv",
        "exp",
        "expm1",
        "frobenius_norm.dim",
        "group_norm",
        "hinge_embedding_loss",
        "huber_loss",
        "kl_div",
        "l1_loss",
        "layer_norm",
        "log",
        "log10",
        "log1p",
        "log2",
        "logsumexp",
        "margin_ranking_loss",
        "mse_loss",
        "multi_margin_loss",
        "multilabel_margin_loss",
        "native_layer_norm",
        "nll_loss",
        "nll_loss2d",
        "norm.Scalar",
        "norm.ScalarOpt_dim",
        "nuclear_norm",
        "nuclear_norm.dim",
        "pdist",
        "poisson_nll_loss",
        "pow.Scalar",
        "pow.Tensor_Scalar",
        "pow.Tensor_Tensor",
        "reciprocal",
        "renorm",
        "rms_norm",
        "rsqrt",
        "sinh",
        "smooth_l1_loss",
        "soft_margin_loss",
        "softplus",
        "tan",
        "triplet_margin_loss",
        "upsample_bicubic2d",
        "upsample_bilinear2d",
        "upsample_linear1d",
        "upsample_nearest1d",
        "upsample_nearest2d",
        "upsample_nearest3d",
        "upsample_trilinear3d",
    }
)

# Computed in fp32 without copying the input: CUDA passes dtype=float32 when none is given
# (``fp32_set_opt_dtype``), so the output (and what backward saves of it) is fp32.
CUDA_FP32_OUTPUT = frozenset(
    {
        "cumprod",
        "cumsum",
        "linalg_matrix_norm",
        "linalg_matrix_norm.str_ord",
        "linalg_vector_norm",
        "log_softmax.int",
        "prod",
        "prod.dim_int",
        "softmax.int",
        "sum",
        "sum.dim_IntList",
    }
)

# Run in the widest float dtype among the inputs.
CUDA_PROMOTE = frozenset(
    {
        "addcdiv",
        "addcmul",
        "atan2",
        "bilinear",
        "cross",
        "dot",
        "grid_sampler",
        "index_put",
        "scatter_add",
        "tensordot",
        "vdot",
    }
)

_LOW = (torch.bfloat16, torch.float16)
_lock = threading.Lock()
_active = 0
_library: torch.library.Library | None = None


def _strip(name: str) -> str:
    return name.removeprefix("aten::")


def unmodelled_cuda_ops() -> set[str]:
    """Ops CUDA autocast registers that the tables here do not cover (newer torch)."""
    known = CUDA_LOWER_PRECISION | CUDA_FP32 | CUDA_FP32_OUTPUT | CUDA_PROMOTE
    return {_strip(n) for n in autocast_registrations("cuda")} - known


def _op(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _eligible(x: Any) -> bool:
    # Autocast's is_eligible: a floating tensor on the autocast device, float64 left alone.
    return (
        isinstance(x, torch.Tensor)
        and x.is_floating_point()
        and x.dtype != torch.float64
        and x.device.type == "cpu"
    )


def _cast_all(args: Any, kwargs: dict, dtype: torch.dtype) -> tuple[Any, dict]:
    def cast(x: Any) -> Any:
        return x.to(dtype) if _eligible(x) and x.dtype != dtype else x

    return tree_map(cast, args), tree_map(cast, kwargs)


def _lower_kernel(op: Callable) -> Callable:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        dtype = torch.get_autocast_dtype("cpu")
        args, kwargs = _cast_all(args, kwargs, dtype)
        with below_cpu_autocast():
            return op(*args, **kwargs)

    return kernel


def _fp32_kernel(op: Callable) -> Callable:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _cast_all(args, kwargs, torch.float32)
        with below_cpu_autocast():
            return op(*args, **kwargs)

    return kernel


def _fp32_output_kernel(op: torch._ops.OpOverload) -> Callable:
    names = [a.name for a in op._schema.arguments]
    position = names.index("dtype")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        given = args[position] if len(args) > position else kwargs.get("dtype")
        if given is None and args and _eligible(args[0]):
            if len(args) > position:
                args = (*args[:position], torch.float32, *args[position + 1 :])
            else:
                kwargs = {**kwargs, "dtype": torch.float32}
        with below_cpu_autocast():
            return op(*args, **kwargs)

    return kernel


def _promote_kernel(op: Callable) -> Callable:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        widest: torch.dtype | None = None

        def visit(x: Any) -> Any:
            nonlocal widest
            if _eligible(x) and (widest is None or x.dtype == torch.float32):
                widest = x.dtype
            return x

        tree_map(visit, (args, kwargs))
        if widest is not None:
            args, kwargs = _cast_all(args, kwargs, widest)
        with below_cpu_autocast():
            return op(*args, **kwargs)

    return kernel


def _passthrough_kernel(op: torch._ops.OpOverload) -> Callable:
    # CUDA autocast has no kernel for this op: it runs as if autocast were not there, and
    # composite ops decompose into ops that autocast then sees one by one. Redispatching
    # below the autocast key does both (the guard is not held while the inner ops run).
    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        below = keyset.remove(torch._C.DispatchKey.AutocastCPU)
        return op.redispatch(below, *args, **kwargs)

    return kernel


def _register(lib: torch.library.Library) -> None:
    cpu = {_strip(n) for n in autocast_registrations("cpu")}
    cuda = {_strip(n) for n in autocast_registrations("cuda")}
    for name in sorted(cuda):
        if name in CUDA_LOWER_PRECISION:
            if name in cpu:
                continue  # CPU autocast casts the same way (with its weight-cast cache)
            kernel, keyset = _lower_kernel(_op(name)), False
        elif name in CUDA_FP32:
            if name in cpu:
                continue  # CPU's fp32 list already casts these up
            kernel, keyset = _fp32_kernel(_op(name)), False
        elif name in CUDA_FP32_OUTPUT:
            if name in cpu:
                continue  # prod: CPU casts its input to fp32; the output dtype is the same
            kernel, keyset = _fp32_output_kernel(_op(name)), False
        elif name in CUDA_PROMOTE:
            if name in cpu:
                continue
            kernel, keyset = _promote_kernel(_op(name)), False
        else:
            continue  # unmodelled: see unmodelled_cuda_ops()
        lib.impl(name, kernel, "AutocastCPU", with_keyset=keyset)
    for name in sorted(cpu - cuda):
        lib.impl(name, _passthrough_kernel(_op(name)), "AutocastCPU", with_keyset=True)


@contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """While open, CPU autocast casts each op as CUDA autocast would.

    Nests and may be entered from several places; the kernels are registered once and
    removed when the outermost context closes.

    Example::

        with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer_norm(linear(x))  # linear saves bf16, layer_norm saves fp32, as on CUDA
    """
    global _active, _library
    with _lock:
        if _active == 0:
            lib = torch.library.Library("aten", "IMPL")  # removed on exit
            with warnings.catch_warnings():
                # Replacing CPU autocast's kernels for CPU-only ops warns ("Overriding a
                # previously registered kernel"): that replacement is the point.
                warnings.simplefilter("ignore", UserWarning)
                _register(lib)
            _library = lib
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0 and _library is not None:
                _library._destroy()
                _library = None
