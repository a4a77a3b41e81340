"""fp32 linear layers on the CPU through our C++ kernel (``engine.cpu_kernels.linear_t``).

torch's CPU matmul goes to MKL, whose sgemm takes a generic, slow path on some CPUs (we measured
1.3-2x slower than our kernel on AMD EPYC at every row count from 1 to 256, and worst at the small
row counts of decode steps). ``install`` stores each eligible ``nn.Linear`` weight transposed
([in, out] contiguous; ``weight`` stays a [out, in] view of it, so anything calling ``F.linear`` on
it still works) and routes the module's forward through the kernel. A weight tied to an embedding
gets its own transposed copy so embedding lookups keep reading rows.

Where MKL is good (Intel CPUs) it may beat the kernel, so ``install`` first times both on the
model's widest layer at a few row counts and routes only the row counts where the kernel won.
It is installed on the loaded model itself, so everything that runs the model (the engine, and the
HF baselines in our benchmarks) uses the same kernels. Set ``BATCHERY_CPU_KERNELS=0`` to keep torch."""

from __future__ import annotations

import logging
import time
import types

import torch
import torch.nn.functional as F

from engine import cpu_kernels

log = logging.getLogger("batchery.engine.kernels")


CALIBRATION_ROWS = (8, 64, 512)


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if (x.dtype == torch.float32 and not x.requires_grad and x.device.type == "cpu"
            and x.numel() <= self._batchery_max_rows * x.shape[-1]):
        return self._batchery_kernel.linear_t(x, self.weight.t(), self.bias)
    return F.linear(x, self.weight, self.bias)


def _best_time(fn, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate(kernel, in_features: int, out_features: int) -> int:
    """The largest row count (0: none, -1: any) up to which the kernel beats ``F.linear`` here,
    timed on random data of one layer's shape."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g)
    wt = w.t().contiguous()
    limit = 0
    with torch.inference_mode():
        for rows in CALIBRATION_ROWS:
            x = torch.randn(rows, in_features, generator=g)
            if _best_time(lambda: kernel.linear_t(x, wt, None)) >= _best_time(lambda: F.linear(x, w)):
                return limit
            limit = rows
    return -1


def install(model: torch.nn.Module, max_rows: int | None = None) -> int:
    """Route the model's fp32 CPU ``nn.Linear`` layers through the kernel, for inputs of up to
    ``max_rows`` rows (None: calibrate here; -1: any). Returns how many layers were routed (0 when
    the kernels cannot be built here or never win)."""
    kernel = cpu_kernels.load()
    if kernel is None:
        return 0
    if max_rows is None:
        widest = max((m for m in model.modules() if isinstance(m, torch.nn.Linear)
                      and m.weight.dtype == torch.float32 and m.out_features % 16 == 0),
                     key=lambda m: m.in_features * m.out_features if m.out_features < 8 * m.in_features else 0,
                     default=None)
        if widest is None:
            return 0
        max_rows = calibrate(kernel, widest.in_features, widest.out_features)
        log.info("CPU linear kernel calibration: it beats torch up to %s rows",
                 "any number of" if max_rows < 0 else max_rows)
        if max_rows == 0:
            return 0
    if max_rows < 0:
        max_rows = 1 << 62
    embedding_ptrs = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    count = 0
    for lin in model.modules():
        if not isinstance(lin, torch.nn.Linear) or getattr(lin, "_batchery_kernel", None) is not None:
            continue
        w = lin.weight
        if w.dtype != torch.float32 or w.device.type != "cpu" or lin.out_features % 16:
            continue
        with torch.no_grad():
            wt = w.detach().t().contiguous()  # [in, out]
        if w.data_ptr() in embedding_ptrs:  # tied to the embedding: untie, the embedding keeps its rows
            lin.weight = torch.nn.Parameter(wt.t(), requires_grad=False)
        else:
            lin.weight.data = wt.t()
        lin._batchery_kernel = kernel
        lin._batchery_max_rows = max_rows
        lin.forward = types.MethodType(_forward, lin)
        count += 1
    if count:
        log.info("%d fp32 linear layers run on the C++ CPU kernel", count)
    return count
