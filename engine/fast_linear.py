"""fp32 linear layers on the CPU through our C++ kernel (``engine.cpu_kernels.linear_t``).

torch's CPU matmul goes to MKL, whose sgemm takes a generic, slow path on some CPUs (we measured
1.3-2x slower than our kernel on AMD EPYC at every row count from 1 to 256, and worst at the small
row counts of decode steps). ``install`` stores each eligible ``nn.Linear`` weight transposed
([in, out] contiguous; ``weight`` stays a [out, in] view of it, so anything calling ``F.linear`` on
it still works) and routes the module's forward through the kernel. A weight tied to an embedding
gets its own transposed copy so embedding lookups keep reading rows.

It is installed on the loaded model itself, so everything that runs the model (the engine, and the
HF baselines in our benchmarks) uses the same kernels. Set ``BATCHERY_CPU_KERNELS=0`` to keep torch."""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

from engine import cpu_kernels

log = logging.getLogger("batchery.engine.kernels")


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32 and not x.requires_grad and x.device.type == "cpu":
        return self._batchery_kernel.linear_t(x, self.weight.t(), self.bias)
    return F.linear(x, self.weight, self.bias)


def install(model: torch.nn.Module) -> int:
    """Route the model's fp32 CPU ``nn.Linear`` layers through the kernel. Returns how many were
    routed (0 when the kernels cannot be built here)."""
    kernel = cpu_kernels.load()
    if kernel is None:
        return 0
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
        lin.forward = types.MethodType(_forward, lin)
        count += 1
    if count:
        log.info("%d fp32 linear layers run on the C++ CPU kernel", count)
    return count
