// The Python module: every kernel by name (batchery.engine.cpu_kernels.functions()).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode), "paged_decode");
  m.def("store_kv", torch::wrap_pybind_function(store_kv), "store_kv");
  m.def("argmax_rows", torch::wrap_pybind_function(argmax_rows), "argmax_rows");
  m.def("linear_t", torch::wrap_pybind_function(linear_t), "linear_t");
  m.def("pack_panels", torch::wrap_pybind_function(pack_panels), "pack_panels");
  m.def("linear_panels", torch::wrap_pybind_function(linear_panels), "linear_panels");
  m.def("pack_bf16", torch::wrap_pybind_function(pack_bf16), "pack_bf16");
  m.def("linear_bf16", torch::wrap_pybind_function(linear_bf16), "linear_bf16");
  m.def("linear_bf16_into", torch::wrap_pybind_function(linear_bf16_into), "linear_bf16_into");
  m.def("has_bf16_linear", torch::wrap_pybind_function(has_bf16_linear), "has_bf16_linear");
  m.def("pack_bf16_gate_up", torch::wrap_pybind_function(pack_bf16_gate_up), "pack_bf16_gate_up");
  m.def("linear_bf16_silu", torch::wrap_pybind_function(linear_bf16_silu), "linear_bf16_silu");
  m.def("has_bf16_silu", torch::wrap_pybind_function(has_bf16_silu), "has_bf16_silu");
  m.def("pack_amx", torch::wrap_pybind_function(pack_amx), "pack_amx");
  m.def("linear_amx", torch::wrap_pybind_function(linear_amx), "linear_amx");
  m.def("has_amx_linear", torch::wrap_pybind_function(has_amx_linear), "has_amx_linear");
  m.def("pack_amx_gate_up", torch::wrap_pybind_function(pack_amx_gate_up), "pack_amx_gate_up");
  m.def("linear_amx_silu", torch::wrap_pybind_function(linear_amx_silu), "linear_amx_silu");
  m.def("fused_rms_norm", torch::wrap_pybind_function(fused_rms_norm), "fused_rms_norm");
  m.def("fused_add_rms_norm", torch::wrap_pybind_function(fused_add_rms_norm), "fused_add_rms_norm");
  m.def("fused_rope", torch::wrap_pybind_function(fused_rope), "fused_rope");
  m.def("fused_silu_mul", torch::wrap_pybind_function(fused_silu_mul), "fused_silu_mul");
  m.def("fused_gelu", torch::wrap_pybind_function(fused_gelu), "fused_gelu");
  m.def("fused_add_layer_norm", torch::wrap_pybind_function(fused_add_layer_norm), "fused_add_layer_norm");
  m.def("fused_set_scalar", torch::wrap_pybind_function(fused_set_scalar), "fused_set_scalar");
  m.def("fused_vectorized", torch::wrap_pybind_function(fused_vectorized), "fused_vectorized");
  m.def("prefill_attention", torch::wrap_pybind_function(prefill_attention), "prefill_attention");
  m.def("has_prefill_attention", torch::wrap_pybind_function(has_prefill_attention), "has_prefill_attention");
  m.def("prefill_set_amx", torch::wrap_pybind_function(prefill_set_amx), "prefill_set_amx");
  m.def("prefill_amx", torch::wrap_pybind_function(prefill_amx), "prefill_amx");
}
