"""Fused elementwise CPU kernels for the decoder layers (a part of ``batchery.engine.cpu_kernels``' extension).

``SOURCE`` is C++ compiled into that one extension; ``FUNCTIONS`` are the names it exports."""

from __future__ import annotations

SOURCE = ""
FUNCTIONS: list[str] = []
