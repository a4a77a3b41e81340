"""Fused elementwise CPU kernels for the decoder layers (a part of ``batchery.engine.cpu_kernels``' extension).

Between its linear layers a HF Llama decoder layer runs a chain of small torch ops: RMSNorm is six
(cast, pow, mean, add, rsqrt, two muls), the rotary embedding ten (four muls, two negs, two cats, two
adds), the MLP's activation two, and the residual adds two more; each reads and writes whole
activations and each costs a dispatch (about 10% of a step in fp32 on SmolLM2-135M, more in bf16).
These kernels do each group in one pass over contiguous rows (used by ``batchery.engine.fused_llama``):

- ``fused_rms_norm(x, weight, eps)``: LlamaRMSNorm, into a new tensor;
- ``fused_add_rms_norm(residual, x, weight, eps)``: in place, ``residual += x`` then ``x = norm(residual)``;
- ``fused_rope(q, k, cos, sin)``: the rotary embedding (rotate_half convention) in place on [T, heads * D]
  rows, with HF's own cos/sin [T, D] for the step's positions (so every rope scaling variant stays exact);
- ``fused_silu_mul(gate, up)``: ``gate = silu(gate) * up`` in place;
- ``fused_gelu(x)``: GELU (erf form) in place, for the pooling runner's bf16 encoders (``encoder_runner``): torch's
  bf16 GELU took 7% of a bf16 all-MiniLM-L6-v2 pass on the Zen 4 EPYC; its erf is a polynomial within 1.5e-7, so a
  result may sit one bf16 step from torch's;
- ``fused_set_scalar(on)`` / ``fused_vectorized()``: tests force and check the scalar path.

Each rounds to the model dtype where the torch reference does, so in bf16 the results are torch's bit
for bit except a norm row's sum of squares (summed in another order) and in fp32 within an ulp or two.
AVX-512 where the compiler targets it, scalar code elsewhere. With AVX512-BF16 the bf16 rounding is one
``vcvtneps2bf16`` a vector (``vbf16_pack``), the integer rounding only for vectors holding a NaN, zero or
denormal, where that instruction's result differs from c10's: on the Zen 4 EPYC (2026-12-05, 2 threads, bf16,
64-1024 rows of SmolLM2's widths) add + RMSNorm 1.24-1.33x, RMSNorm 1.2-1.25x, RoPE 1.26-1.41x and
SiLU(gate) * up 1.13-1.21x as fast as with the integer rounding everywhere, with the same bits.

``SOURCES`` are its C++ files in ``engine/csrc/``, compiled into that one extension; ``FUNCTIONS`` are the
names it exports."""

from __future__ import annotations

SOURCES: tuple[str, ...] = ("fused.cpp",)

FUNCTIONS: list[str] = [
    "fused_rms_norm",
    "fused_add_rms_norm",
    "fused_rope",
    "fused_silu_mul",
    "fused_gelu",
    "fused_add_layer_norm",
    "fused_set_scalar",
    "fused_vectorized",
]
