"""Linear layers on the CPU through our C++ kernels (``batchery.engine.cpu_kernels``).

torch's CPU matmuls go to MKL (fp32) and oneDNN (bf16). On the machines we measured (AMD EPYC) MKL's
sgemm takes a generic, slow path, and both libraries leave memory bandwidth unused at the small row
counts of decode steps; our kernels (a 6 x 64 register tile; ``vdpbf16ps`` for bf16) ran 1.1-2x
faster there (``benchmarks/cpu_kernels.py``). Where a library is better (MKL on Intel, oneDNN's LM
head at many rows) it should keep the work, so ``install`` times both on each distinct layer shape
at a few row counts and routes a layer's inputs to the kernel only up to the row count where the
kernel stopped winning.

- fp32: the weight is stored transposed ([in, out] contiguous); ``weight`` stays a [out, in] view
  of it, so ``F.linear`` still works on it at no extra memory. A weight tied to an embedding gets
  its own copy, so embedding lookups keep reading rows.
- bf16 (CPUs with AVX512-BF16): the kernel reads a packed copy of the weight (pairs along ``in``);
  ``weight`` is kept for the row counts torch handles, so routed bf16 layers hold their weights twice.

It is installed on the loaded model itself, so everything that runs the model (the engine, and the
HF baselines in our benchmarks) uses the same kernels. Set ``BATCHERY_CPU_KERNELS=0`` to keep torch."""

from __future__ import annotations

import functools
import logging
import time
import types
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F

from batchery.engine import cpu_kernels

log = logging.getLogger("batchery.engine.kernels")

CALIBRATION_ROWS = (8, 64, 512)
ANY = 1 << 62


KernelLinear = Callable[..., torch.Tensor]  # (x [..., in], bias [out] | None) -> [..., out] through the kernel


class _RoutedLinear(torch.nn.Linear):
    """Typing only, never instantiated: the attributes ``install`` sets on an ``nn.Linear`` it routes."""

    _batchery_linear: KernelLinear
    _batchery_kernel: types.ModuleType  # the compiled kernels (``cpu_kernels.load()``)
    _batchery_max_rows: int  # inputs of up to this many rows go to the kernel


def _forward(self: _RoutedLinear, x: torch.Tensor) -> torch.Tensor:
    if (
        x.dtype == self.weight.dtype
        and not x.requires_grad
        and x.device.type == "cpu"
        and x.numel() <= self._batchery_max_rows * x.shape[-1]
    ):
        return self._batchery_linear(x, self.bias)
    return F.linear(x, self.weight, self.bias)


def _best_time(fn: Callable[[], object], reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _kernel_fn(kernel: types.ModuleType, w: torch.Tensor) -> tuple[KernelLinear, torch.Tensor]:
    """(callable (x, bias) -> y through the kernel, the tensor that callable reads: for fp32 the
    transposed weight, for bf16 the packed copy)"""
    if w.dtype == torch.float32:
        wt = w.t().contiguous()
        return (lambda x, bias=None: kernel.linear_t(x, wt, bias)), wt
    packed = kernel.pack_bf16(w)
    return (lambda x, bias=None: kernel.linear_bf16(x, packed, bias)), packed


def calibrate(kernel: types.ModuleType, in_features: int, out_features: int, dtype: torch.dtype = torch.float32) -> int:
    """The largest row count (0: none; ``ANY``: every one tried) up to which the kernel beats
    ``F.linear`` here, timed on random data of one layer's shape."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    fn, _ = _kernel_fn(kernel, w)
    limit = 0
    with torch.inference_mode():
        for rows in CALIBRATION_ROWS:
            x = torch.randn(rows, in_features, generator=g).to(dtype)
            if _best_time(functools.partial(fn, x)) >= _best_time(functools.partial(F.linear, x, w)):
                return limit
            limit = rows
    return ANY


def _eligible(lin: torch.nn.Module, kernel: types.ModuleType) -> bool:
    if not isinstance(lin, torch.nn.Linear) or getattr(lin, "_batchery_kernel", None) is not None:
        return False
    w = lin.weight
    if w.device.type != "cpu" or lin.out_features % 16:
        return False
    if w.dtype == torch.float32:
        return True
    return w.dtype == torch.bfloat16 and lin.in_features % 2 == 0 and bool(kernel.has_bf16_linear())


def install(model: torch.nn.Module, max_rows: int | None = None) -> int:
    """Route the model's fp32 and bf16 CPU ``nn.Linear`` layers through the kernels, for inputs of
    up to ``max_rows`` rows (None: calibrate each layer shape here; -1: any). Returns how many
    layers were routed (0 when the kernels cannot be built here or never win)."""
    kernel = cpu_kernels.load()
    if kernel is None:
        return 0
    embedding_ptrs = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    limits: dict[tuple[int, int, torch.dtype], int] = {}
    count = 0
    for module in model.modules():
        if not _eligible(module, kernel):
            continue
        lin = cast(_RoutedLinear, module)  # an nn.Linear (``_eligible``), about to get the routed attributes
        w = lin.weight
        key = (lin.in_features, lin.out_features, w.dtype)
        if max_rows is not None:
            limit = ANY if max_rows < 0 else max_rows
        elif key not in limits:
            limit = limits[key] = calibrate(kernel, *key)
            log.info(
                "CPU linear kernel, %s %dx%d: faster than torch up to %s rows",
                str(w.dtype)[6:],
                lin.in_features,
                lin.out_features,
                "any number of" if limit == ANY else limit,
            )
        else:
            limit = limits[key]
        if limit == 0:
            continue
        with torch.no_grad():
            lin._batchery_linear, kernel_weight = _kernel_fn(kernel, w.detach())
            if w.dtype == torch.float32:  # the kernel's [in, out] copy becomes the weight's storage
                if w.data_ptr() in embedding_ptrs:  # tied to the embedding: untie, the embedding keeps its rows
                    lin.weight = torch.nn.Parameter(kernel_weight.t(), requires_grad=False)
                else:
                    lin.weight.data = kernel_weight.t()
        # a per-instance forward is how a torch module is rerouted without swapping its class
        lin.forward = types.MethodType(_forward, lin)  # type: ignore[method-assign]  # nn.Module declares forward a method
        lin._batchery_kernel = kernel
        lin._batchery_max_rows = limit
        count += 1
    if count:
        log.info("%d linear layers run on the C++ CPU kernels", count)
    return count
