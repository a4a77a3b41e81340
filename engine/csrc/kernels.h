// The CPU kernels of batchery.engine.cpu_kernels: one extension built from the .cpp files beside this header
// (cpu_kernels.SOURCES) by torch's cpp_extension on first use, with -O3 -march=native -ffast-math -fopenmp.
// What every file includes, and the functions bindings.cpp exports to Python.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <limits>
#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

// decode_attention.cpp
at::Tensor paged_decode(at::Tensor q, at::Tensor kc, at::Tensor vc, at::Tensor bt, at::Tensor ctx, double scale,
                        int64_t window, double softcap);
// store_kv.cpp
void store_kv(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots);
// argmax.cpp
at::Tensor argmax_rows(at::Tensor x);
// linear.cpp: fp32
at::Tensor linear_t(at::Tensor x, at::Tensor wt, c10::optional<at::Tensor> bias);
at::Tensor pack_panels(at::Tensor w);
at::Tensor linear_panels(at::Tensor x, at::Tensor wp, int64_t n, c10::optional<at::Tensor> bias);
// linear.cpp: bf16
at::Tensor pack_bf16(at::Tensor w);
at::Tensor linear_bf16(at::Tensor x, at::Tensor wp, int64_t n, c10::optional<at::Tensor> bias);
at::Tensor linear_bf16_into(at::Tensor x, at::Tensor wp, int64_t n, c10::optional<at::Tensor> bias, at::Tensor out,
                            bool gelu);
bool has_bf16_linear();
at::Tensor pack_bf16_gate_up(at::Tensor gate, at::Tensor up);
at::Tensor linear_bf16_silu(at::Tensor x, at::Tensor wp);
bool has_bf16_silu();
// amx_linear.cpp
at::Tensor pack_amx(at::Tensor w);
at::Tensor linear_amx(at::Tensor x, at::Tensor wp, c10::optional<at::Tensor> bias);
bool has_amx_linear();
at::Tensor pack_amx_gate_up(at::Tensor gate, at::Tensor up);
at::Tensor linear_amx_silu(at::Tensor x, at::Tensor wp);
// fused.cpp
at::Tensor fused_rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor fused_add_rms_norm(at::Tensor residual, at::Tensor x, at::Tensor weight, double eps);
void fused_rope(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin);
at::Tensor fused_silu_mul(at::Tensor gate, at::Tensor up);
at::Tensor fused_gelu(at::Tensor x);
at::Tensor fused_add_layer_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, at::Tensor bias, double eps);
bool fused_set_scalar(bool on);
bool fused_vectorized();
// prefill_attention.cpp
void prefill_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor kc, at::Tensor vc, at::Tensor out,
                       at::Tensor seqs, at::Tensor tables, double scale, int64_t window, bool causal);
bool has_prefill_attention();
bool prefill_set_amx(bool on);
bool prefill_amx();
