#include "kernels.h"
#include "linear_tiles.h"

// y = x @ wt (+ bias): x [..., K] float, wt [K, N] float contiguous (the transposed weight), N % 16 == 0
at::Tensor linear_t(at::Tensor x, at::Tensor wt, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(wt.dim() == 2 && wt.is_contiguous() && wt.scalar_type() == at::kFloat,
              "linear_t: the weight must be a contiguous float [K, N] tensor");
  const int64_t K = wt.size(0), N = wt.size(1);
  TORCH_CHECK(N % 16 == 0, "linear_t: out_features must be a multiple of 16");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) == K, "linear_t: the input must be float [..., K]");
  auto xs = x.sizes().vec();
  auto xf = x.reshape({-1, K}).contiguous();
  const int64_t M = xf.size(0);
  auto out = at::empty({M, N}, xf.options());
  tiled_linear<TileF32>(xf.data_ptr<float>(), wt.data_ptr<float>(), out.data_ptr<float>(), M, K, N);
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  xs.back() = N;
  return out.view(xs);
}

// w [N, K] float -> [ceil(N / 64), K, 64]: 64-column panels of the transposed weight, zero-padded
at::Tensor pack_panels(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.size(0) % 16 == 0,
              "pack_panels: float [N, K], N % 16 == 0");
  const int64_t N = w.size(0), K = w.size(1), P = (N + 63) / 64;
  auto padded = at::zeros({P * 64, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, 64, K}).transpose(1, 2).contiguous();
}

// y = x @ w.T (+ bias) with w from pack_panels; n: w's out_features
at::Tensor linear_panels(at::Tensor x, at::Tensor wp, int64_t n, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == 64 && wp.is_contiguous() && wp.scalar_type() == at::kFloat &&
                  n % 16 == 0 && n <= wp.size(0) * 64 && n > (wp.size(0) - 1) * 64,
              "linear_panels: the weight must come from pack_panels");
  const int64_t K = wp.size(1), N = n;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) == K, "linear_panels: the input must be float [..., K]");
  auto xs = x.sizes().vec();
  auto xf = x.reshape({-1, K}).contiguous();
  const int64_t M = xf.size(0);
  auto out = at::empty({M, N}, xf.options());
  tiled_linear<TileF32>(xf.data_ptr<float>(), wp.data_ptr<float>(), out.data_ptr<float>(), M, K, N, true);
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  xs.back() = N;
  return out.view(xs);
}

bool has_bf16_linear() {
#if defined(__AVX512BF16__) || defined(BATCHERY_BF16_WIDEN)
  return true;
#else
  return false;
#endif
}

// w [N, K] bf16 -> int32 [ceil(N / 64), K/2, 64]: 64-column panels of bf16 pairs (w[n][2k], w[n][2k+1]),
// zero-padded (the panel layout of tiled_linear)
at::Tensor pack_bf16(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0 && w.size(0) % 16 == 0,
              "pack_bf16: bf16 [N, K], K even, N % 16 == 0");
  const int64_t N = w.size(0), K = w.size(1), P = (N + 63) / 64;
  auto padded = at::zeros({P * 64, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, 64, K / 2, 2}).view(at::kInt).view({P, 64, K / 2}).transpose(1, 2).contiguous();
}

// y = x @ w.T (+ bias) with w from pack_bf16; n: w's out_features
at::Tensor linear_bf16(at::Tensor x, at::Tensor wp, int64_t n, c10::optional<at::Tensor> bias) {
#if defined(__AVX512BF16__) || defined(BATCHERY_BF16_WIDEN)
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == 64 && wp.is_contiguous() && wp.scalar_type() == at::kInt && n % 16 == 0 &&
                  n <= wp.size(0) * 64 && n > (wp.size(0) - 1) * 64,
              "linear_bf16: the weight must come from pack_bf16");
  const int64_t K2 = wp.size(1), N = n, K = 2 * K2;
  TORCH_CHECK(N % 16 == 0, "linear_bf16: out_features must be a multiple of 16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.size(-1) == K, "linear_bf16: the input must be bf16 [..., K]");
  auto xs = x.sizes().vec();
  auto xf = x.reshape({-1, K}).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor bias_f;  // fp32, added to the sums before they are rounded (as out.add_(bias) on fp32 sums did)
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear_bf16: the bias must have out_features elements");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  auto out = at::empty({M, N}, xf.options());  // bf16, written by the tiles
#ifdef __AVX512BF16__
  const auto* xp = reinterpret_cast<const uint32_t*>(xf.data_ptr());
#else
  const auto xw = xf.to(at::kFloat);  // exact; M x K, read by every column panel
  const float* xp = xw.data_ptr<float>();
#endif
  tiled_linear<TileBF16>(xp, reinterpret_cast<const uint32_t*>(wp.data_ptr()),
                         reinterpret_cast<uint16_t*>(out.data_ptr()), M, K2, N, true,
                         bias_f.defined() ? bias_f.data_ptr<float>() : nullptr);
  xs.back() = N;
  return out.view(xs);
#else
  TORCH_CHECK(false, "linear_bf16: built without AVX2, AVX-512 or AVX512-BF16");
  return x;
#endif
}

// out = x @ w.T + bias, or GELU of it (erf form) with gelu, written into out (bf16 [rows of x, n], contiguous: a
// caller's workspace, so that a step's activations are not mapped and page-faulted in anew on every call); w from
// pack_bf16, n its out_features. The sums are linear_bf16's; with gelu, the bits of linear_bf16 then cpu_fused's
// fused_gelu (but a NaN, 0x7FC0 as fused_gelu rounds it) in one pass (an encoder's intermediate block). Returns out.
at::Tensor linear_bf16_into(at::Tensor x, at::Tensor wp, int64_t n, c10::optional<at::Tensor> bias, at::Tensor out,
                            bool gelu) {
#ifdef __AVX512BF16__
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == 64 && wp.is_contiguous() && wp.scalar_type() == at::kInt && n % 16 == 0 &&
                  n <= wp.size(0) * 64 && n > (wp.size(0) - 1) * 64,
              "linear_bf16_into: the weight must come from pack_bf16");
  const int64_t K2 = wp.size(1), N = n, K = 2 * K2;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.size(-1) == K, "linear_bf16_into: the input must be bf16 [..., K]");
  auto xf = x.reshape({-1, K}).contiguous();
  const int64_t M = xf.size(0);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.numel() == M * N && out.size(-1) == N &&
                  out.data_ptr() != xf.data_ptr(),
              "linear_bf16_into: out must be a contiguous bf16 [rows, out_features] tensor apart from x");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear_bf16_into: the bias must have out_features elements");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const auto* xp = reinterpret_cast<const uint32_t*>(xf.data_ptr());
  const auto* w = reinterpret_cast<const uint32_t*>(wp.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  if (gelu)
    tiled_linear<TileBF16T<false, true>>(xp, w, o, M, K2, N, true, bp);
  else
    tiled_linear<TileBF16>(xp, w, o, M, K2, N, true, bp);
  return out;
#else
  TORCH_CHECK(false, "linear_bf16_into: built without AVX512-BF16");
  return out;
#endif
}

// gate, up [I, K] bf16 (an MLP's two projections) -> pack_bf16 of their rows interleaved by 32: each 64-column panel
// holds 32 gate columns and the same 32 up columns (I a multiple of 32), for linear_bf16_silu
at::Tensor pack_bf16_gate_up(at::Tensor gate, at::Tensor up) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.scalar_type() == at::kBFloat16 &&
                  up.scalar_type() == at::kBFloat16 && gate.size(0) % 32 == 0 && gate.size(1) % 2 == 0,
              "pack_bf16_gate_up: gate and up must be bf16 [I, K] of one shape, I a multiple of 32 and K even");
  return pack_bf16(interleave_gate_up(gate, up, 32));
}

// SiLU(x @ gate.T) * (x @ up.T) with the weight from pack_bf16_gate_up: [..., I] bf16, bit for bit what the two
// projections through linear_bf16 and cpu_fused's fused_silu_mul give, without writing either projection
at::Tensor linear_bf16_silu(at::Tensor x, at::Tensor wp) {
#ifdef __AVX512BF16__
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == 64 && wp.is_contiguous() && wp.scalar_type() == at::kInt,
              "linear_bf16_silu: the weight must come from pack_bf16_gate_up");
  const int64_t K2 = wp.size(1), N = wp.size(0) * 64, K = 2 * K2;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.size(-1) == K, "linear_bf16_silu: the input must be bf16 [..., K]");
  auto xs = x.sizes().vec();
  auto xf = x.reshape({-1, K}).contiguous();
  const int64_t M = xf.size(0);
  auto out = at::empty({M, N / 2}, xf.options());
  tiled_linear<TileBF16T<true>>(reinterpret_cast<const uint32_t*>(xf.data_ptr()),
                                reinterpret_cast<const uint32_t*>(wp.data_ptr()),
                                reinterpret_cast<uint16_t*>(out.data_ptr()), M, K2, N, true, nullptr);
  xs.back() = N / 2;
  return out.view(xs);
#else
  TORCH_CHECK(false, "linear_bf16_silu: built without AVX512-BF16");
  return x;
#endif
}

bool has_bf16_silu() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}
