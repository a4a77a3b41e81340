// ---- fused decoder-layer elementwise kernels (batchery.engine.cpu_fused) ----------------------------
// What the HF Llama modules do between the linear layers, one pass each instead of a chain of torch ops:
// residual add + RMSNorm, rotary embedding in place, SiLU(gate) * up. Every step rounds to the model
// dtype where the torch reference does, so bf16 results equal torch's (up to the order of a row's sum
// of squares and the last bit of exp). Rows are contiguous; work is split over rows (or elements).
#include "bf16.h"
#include "kernels.h"
#include "vec_math.h"

namespace batchery_fused {

constexpr int64_t kGrain = 16384;  // elements per parallel task at least (a smaller op runs inline)

std::atomic<bool> g_scalar{false};  // tests force the scalar path through fused_set_scalar

// float -> bf16 bits, rounding to nearest even, NaN -> 0x7FC0: c10::BFloat16's conversion, with an integer
// NaN test (-ffast-math folds std::isnan away)
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}
template <typename T>
inline T from_f(float v);
template <>
inline float from_f<float>(float v) {
  return v;
}
template <>
inline c10::BFloat16 from_f<c10::BFloat16>(float v) {
  return c10::BFloat16(bf16_bits(v), c10::BFloat16::from_bits());
}
template <typename T>
inline float rnd(float v) {  // v rounded to T, as a torch op in dtype T would leave it
  return to_f(from_f<T>(v));
}

// Exact IEEE division and square root, as torch computes them: under -ffast-math GCC turns vector divisions
// and 1 / sqrt into reciprocal estimates (vrcp14ps, rsqrtss) plus a Newton step, which move results by an ulp;
// inline asm is opaque to those rewrites.
inline float div_exact(float a, float b) {
#if defined(__AVX__)
  float r;
  __asm__("vdivss %2, %1, %0" : "=x"(r) : "x"(a), "x"(b));
  return r;
#elif defined(__SSE__)
  __asm__("divss %1, %0" : "+x"(a) : "x"(b));
  return a;
#else
  volatile float va = a;
  return va / b;
#endif
}
inline float sqrt_exact(float a) {
#if defined(__AVX__)
  float r;
  __asm__("vsqrtss %1, %1, %0" : "=x"(r) : "x"(a));
  return r;
#elif defined(__SSE__)
  __asm__("sqrtss %0, %0" : "+x"(a));
  return a;
#else
  volatile float va = a;
  return std::sqrt(va);
#endif
}
// 1 / sqrt(v) as torch's rsqrt: a rounded sqrt, then a division
inline float inv_sqrt(float v) { return div_exact(1.f, sqrt_exact(v)); }

inline float silu(float g) { return div_exact(g, 1.f + std::exp(-g)); }

#ifdef __AVX512F__
inline __m512 vload(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 vload(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512i vbf16_bits(__m512 v) {  // bf16_bits per lane, in the low half of each 32-bit lane
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}
// 16 floats rounded to bf16 (bf16_bits per lane). With AVX512-BF16 the linears' bf16_round16 (NaN as 0x7FC0): one
// vcvtneps2bf16 for a vector without NaN, zero or denormal, the same integer rounding otherwise. On the Zen 4 EPYC
// the integer rounding was 40% of bf16 SiLU(gate) * up.
inline __m256i vbf16_pack(__m512 v) {
#ifdef __AVX512BF16__
  return ::bf16_round16<0x7FC0>(v);
#else
  return _mm512_cvtepi32_epi16(vbf16_bits(v));
#endif
}
inline void vstore(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void vstore(c10::BFloat16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), vbf16_pack(v)); }
inline __m512 vdiv_exact(__m512 a, __m512 b) {
  __m512 r;
  __asm__("vdivps %2, %1, %0" : "=v"(r) : "v"(a), "v"(b));
  return r;
}
template <typename T>
inline __m512 vrnd(__m512 v);
template <>
inline __m512 vrnd<float>(__m512 v) {
  return v;
}
template <>
inline __m512 vrnd<c10::BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(vbf16_pack(v)), 16));
}

// exp(x) for any x: the extension's polynomial (about 1 ulp) on x clamped to [-104, 100]; inf above ~88.7
inline __m512 vexp(__m512 x) {
  return ::exp_poly(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(100.f)));
}
#endif

inline bool vectorized() {
#ifdef __AVX512F__
  return !g_scalar.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

// One row of n: with ADD, res = T(res + x) first (written back); then out = T(w * T(res * rsqrt(mean(res^2) + eps))).
// out may be x (ADD) but not res.
template <typename T, bool ADD, bool VEC>
inline void norm_row(T* res, const T* x, const T* w, T* out, int64_t n, float eps) {
  int64_t i = 0;
  float ss = 0.f;
#ifdef __AVX512F__
  if (VEC) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (; i + 32 <= n; i += 32) {
      __m512 a = vload(res + i), b = vload(res + i + 16);
      if (ADD) {
        a = vrnd<T>(_mm512_add_ps(a, vload(x + i)));
        b = vrnd<T>(_mm512_add_ps(b, vload(x + i + 16)));
        vstore(res + i, a);
        vstore(res + i + 16, b);
      }
      acc0 = _mm512_fmadd_ps(a, a, acc0);
      acc1 = _mm512_fmadd_ps(b, b, acc1);
    }
    for (; i + 16 <= n; i += 16) {
      __m512 a = vload(res + i);
      if (ADD) {
        a = vrnd<T>(_mm512_add_ps(a, vload(x + i)));
        vstore(res + i, a);
      }
      acc0 = _mm512_fmadd_ps(a, a, acc0);
    }
    ss = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  }
#endif
  for (; i < n; ++i) {
    float a = to_f(res[i]);
    if (ADD) {
      a = rnd<T>(a + to_f(x[i]));
      res[i] = from_f<T>(a);
    }
    ss += a * a;
  }
  const float r = inv_sqrt(div_exact(ss, static_cast<float>(n)) + eps);
  i = 0;
#ifdef __AVX512F__
  if (VEC) {
    const __m512 vr = _mm512_set1_ps(r);
    for (; i + 16 <= n; i += 16)
      vstore(out + i, _mm512_mul_ps(vload(w + i), vrnd<T>(_mm512_mul_ps(vload(res + i), vr))));
  }
#endif
  for (; i < n; ++i) out[i] = from_f<T>(to_f(w[i]) * rnd<T>(to_f(res[i]) * r));
}

template <typename T, bool ADD>
void norm_rows(T* res, const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  const bool vec = vectorized();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(n, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      T* rr = res + r * n;
      const T* xr = ADD ? x + r * n : nullptr;
      if (vec)
        norm_row<T, ADD, true>(rr, xr, w, out + r * n, n, eps);
      else
        norm_row<T, ADD, false>(rr, xr, w, out + r * n, n, eps);
    }
  });
}

// One row of n in place: x = T((a - mean) * rstd * w + b) with a = T(x + res) (the residual add rounded as torch's add
// in dtype T), mean and variance over a in fp32 (two passes: the row is in L1), rstd = 1 / sqrt(var + eps):
// nn.LayerNorm of the sum, which torch computes in fp32 and rounds once. res is left as it was.
template <typename T, bool VEC>
inline void add_layer_norm_row(T* x, const T* res, const T* w, const T* b, int64_t n, float eps, float* a) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef __AVX512F__
  if (VEC) {
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m512 v = vrnd<T>(_mm512_add_ps(vload(x + i), vload(res + i)));
      _mm512_storeu_ps(a + i, v);
      acc = _mm512_add_ps(acc, v);
    }
    sum = _mm512_reduce_add_ps(acc);
  }
#endif
  for (; i < n; ++i) {
    a[i] = rnd<T>(to_f(x[i]) + to_f(res[i]));
    sum += a[i];
  }
  const float mean = div_exact(sum, static_cast<float>(n));
  float ss = 0.f;
  i = 0;
#ifdef __AVX512F__
  if (VEC) {
    const __m512 mv = _mm512_set1_ps(mean);
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(a + i), mv);
      acc = _mm512_fmadd_ps(d, d, acc);
    }
    ss = _mm512_reduce_add_ps(acc);
  }
#endif
  for (; i < n; ++i) ss += (a[i] - mean) * (a[i] - mean);
  const float rstd = inv_sqrt(div_exact(ss, static_cast<float>(n)) + eps);
  i = 0;
#ifdef __AVX512F__
  if (VEC) {
    const __m512 mv = _mm512_set1_ps(mean), rv = _mm512_set1_ps(rstd);
    for (; i + 16 <= n; i += 16) {
      const __m512 y = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(a + i), mv), rv);
      vstore(x + i, _mm512_fmadd_ps(y, vload(w + i), vload(b + i)));
    }
  }
#endif
  for (; i < n; ++i) x[i] = from_f<T>((a[i] - mean) * rstd * to_f(w[i]) + to_f(b[i]));
}

template <typename T>
void add_layer_norm_rows(T* x, const T* res, const T* w, const T* b, int64_t rows, int64_t n, float eps) {
  const bool vec = vectorized();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(n, 1)), [&](int64_t lo, int64_t hi) {
    std::vector<float> a(n);
    for (int64_t r = lo; r < hi; ++r) {
      if (vec)
        add_layer_norm_row<T, true>(x + r * n, res + r * n, w, b, n, eps, a.data());
      else
        add_layer_norm_row<T, false>(x + r * n, res + r * n, w, b, n, eps, a.data());
    }
  });
}

// Rotary embedding of one head of D in place: x1, x2 its halves; out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2,
// each product and the sum rounded to T (HF: q * cos + rotate_half(q) * sin in the model dtype).
template <typename T, bool VEC>
inline void rope_head(T* x, const T* c, const T* s, int64_t D) {
  const int64_t h = D / 2;
  int64_t i = 0;
#ifdef __AVX512F__
  if (VEC) {
    for (; i + 16 <= h; i += 16) {
      const __m512 x1 = vload(x + i), x2 = vload(x + h + i);
      const __m512 o1 =
          _mm512_sub_ps(vrnd<T>(_mm512_mul_ps(x1, vload(c + i))), vrnd<T>(_mm512_mul_ps(x2, vload(s + i))));
      const __m512 o2 =
          _mm512_add_ps(vrnd<T>(_mm512_mul_ps(x2, vload(c + h + i))), vrnd<T>(_mm512_mul_ps(x1, vload(s + h + i))));
      vstore(x + i, o1);
      vstore(x + h + i, o2);
    }
  }
#endif
  for (; i < h; ++i) {
    const float x1 = to_f(x[i]), x2 = to_f(x[h + i]);
    const float o1 = rnd<T>(x1 * to_f(c[i])) - rnd<T>(x2 * to_f(s[i]));
    const float o2 = rnd<T>(x2 * to_f(c[h + i])) + rnd<T>(x1 * to_f(s[h + i]));
    x[i] = from_f<T>(o1);
    x[h + i] = from_f<T>(o2);
  }
}

// q [T, Hq * D] and k [T, Hk * D] in place; cos, sin [T, D]
template <typename T>
void rope_rows(T* q, T* k, const T* c, const T* s, int64_t rows, int64_t hq, int64_t hk, int64_t D) {
  const bool vec = vectorized();
  const int64_t heads = hq + hk;
  at::parallel_for(0, rows * heads, std::max<int64_t>(1, kGrain / D), [&](int64_t b, int64_t e) {
    for (int64_t idx = b; idx < e; ++idx) {
      const int64_t t = idx / heads, j = idx % heads;
      T* x = j < hq ? q + (t * hq + j) * D : k + (t * hk + (j - hq)) * D;
      if (vec)
        rope_head<T, true>(x, c + t * D, s + t * D, D);
      else
        rope_head<T, false>(x, c + t * D, s + t * D, D);
    }
  });
}

// g = T(T(silu(g)) * u), n elements, in place
template <typename T>
void silu_mul(T* g, const T* u, int64_t n) {
  const bool vec = vectorized();
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    int64_t i = b;
#ifdef __AVX512F__
    if (vec) {
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= e; i += 16) {
        const __m512 x = vload(g + i);
        const __m512 sx = vrnd<T>(vdiv_exact(x, _mm512_add_ps(one, vexp(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
        vstore(g + i, _mm512_mul_ps(sx, vload(u + i)));
      }
    }
#endif
    for (; i < e; ++i) g[i] = from_f<T>(rnd<T>(silu(to_f(g[i]))) * to_f(u[i]));
  });
}

// GELU, erf form (torch's default, BERT's "gelu"): x / 2 (1 + erf(x / sqrt 2)), n elements in place, each rounded to T
// once. The vector path's erf is Abramowitz and Stegun's 7.1.26 (absolute error below 1.5e-7, far below a bf16 step;
// the result can differ from torch's by one step of the model dtype where it falls on a rounding boundary).
#ifdef __AVX512F__
inline __m512 vgelu(__m512 x) { return ::gelu16(x); }
#endif

template <typename T>
void gelu(T* x, int64_t n) {
  const bool vec = vectorized();
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    int64_t i = b;
#ifdef __AVX512F__
    if (vec)
      for (; i + 16 <= e; i += 16) vstore(x + i, vgelu(vload(x + i)));
#endif
    for (; i < e; ++i) {
      const float v = to_f(x[i]);
      x[i] = from_f<T>(0.5f * v * (1.f + std::erf(v * 0.70710678118654752f)));
    }
  });
}

inline void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, ": tensors must be contiguous CPU tensors");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what, ": float32 or bfloat16 only");
}

inline void check_norm(const at::Tensor& x, const at::Tensor& w, const char* what) {
  check_rows(x, what);
  check_rows(w, what);
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1), what, ": weight must be [hidden]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), what, ": weight and input dtypes differ");
}

}  // namespace batchery_fused

// out = RMSNorm(x) * weight (LlamaRMSNorm), x [..., hidden]
at::Tensor fused_rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  using namespace batchery_fused;
  check_norm(x, weight, "fused_rms_norm");
  auto out = at::empty_like(x);
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  if (rows == 0) return out;
  if (x.scalar_type() == at::kFloat)
    norm_rows<float, false>(x.data_ptr<float>(), nullptr, weight.data_ptr<float>(), out.data_ptr<float>(), rows, n,
                            static_cast<float>(eps));
  else
    norm_rows<c10::BFloat16, false>(x.data_ptr<c10::BFloat16>(), nullptr, weight.data_ptr<c10::BFloat16>(),
                                    out.data_ptr<c10::BFloat16>(), rows, n, static_cast<float>(eps));
  return out;
}

// In place: residual += x (in the model dtype), then x = RMSNorm(residual) * weight. Returns x.
at::Tensor fused_add_rms_norm(at::Tensor residual, at::Tensor x, at::Tensor weight, double eps) {
  using namespace batchery_fused;
  check_norm(x, weight, "fused_add_rms_norm");
  check_rows(residual, "fused_add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: residual and x must have one shape and dtype");
  TORCH_CHECK(residual.data_ptr() != x.data_ptr() || x.numel() == 0, "fused_add_rms_norm: residual and x must differ");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  if (rows == 0) return x;
  if (x.scalar_type() == at::kFloat)
    norm_rows<float, true>(residual.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(),
                           x.data_ptr<float>(), rows, n, static_cast<float>(eps));
  else
    norm_rows<c10::BFloat16, true>(residual.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(),
                                   weight.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), rows, n,
                                   static_cast<float>(eps));
  return x;
}

// In place: x = LayerNorm(x + residual) * weight + bias (BertSelfOutput / BertOutput after their dense: the sum
// rounded to the dtype, the norm in fp32). x, residual [..., hidden]; weight, bias [hidden]. Returns x.
at::Tensor fused_add_layer_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, at::Tensor bias, double eps) {
  using namespace batchery_fused;
  check_norm(x, weight, "fused_add_layer_norm");
  check_norm(x, bias, "fused_add_layer_norm");
  check_rows(residual, "fused_add_layer_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "fused_add_layer_norm: residual and x must have one shape and dtype");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  if (rows == 0) return x;
  if (x.scalar_type() == at::kFloat)
    add_layer_norm_rows<float>(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(),
                               bias.data_ptr<float>(), rows, n, static_cast<float>(eps));
  else
    add_layer_norm_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), residual.data_ptr<c10::BFloat16>(),
                                       weight.data_ptr<c10::BFloat16>(), bias.data_ptr<c10::BFloat16>(), rows, n,
                                       static_cast<float>(eps));
  return x;
}

// Rotary embedding in place (Llama's rotate_half convention): q [T, Hq * D] and k [T, Hk * D] (any leading
// shape holding T rows), cos and sin [T, D] in the same dtype (what HF's rotary module returns for the positions).
void fused_rope(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  using namespace batchery_fused;
  for (const auto* t : {&q, &k, &cos, &sin}) check_rows(*t, "fused_rope");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type(),
              "fused_rope: q, k, cos and sin must have one dtype");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes(), "fused_rope: cos and sin must be [T, head_dim]");
  const int64_t rows = cos.size(0), D = cos.size(1);
  TORCH_CHECK(D > 0 && D % 2 == 0, "fused_rope: head_dim must be even");
  if (rows == 0) return;
  TORCH_CHECK(
      q.size(-1) % D == 0 && q.numel() == rows * q.size(-1) && k.size(-1) % D == 0 && k.numel() == rows * k.size(-1),
      "fused_rope: q and k must be [T, heads * head_dim]");
  const int64_t hq = q.size(-1) / D, hk = k.size(-1) / D;
  if (q.scalar_type() == at::kFloat)
    rope_rows<float>(q.data_ptr<float>(), k.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), rows, hq,
                     hk, D);
  else
    rope_rows<c10::BFloat16>(q.data_ptr<c10::BFloat16>(), k.data_ptr<c10::BFloat16>(), cos.data_ptr<c10::BFloat16>(),
                             sin.data_ptr<c10::BFloat16>(), rows, hq, hk, D);
}

// gate = SiLU(gate) * up in place (LlamaMLP's act_fn(gate_proj(x)) * up_proj(x)). Returns gate.
at::Tensor fused_silu_mul(at::Tensor gate, at::Tensor up) {
  using namespace batchery_fused;
  check_rows(gate, "fused_silu_mul");
  check_rows(up, "fused_silu_mul");
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
              "fused_silu_mul: gate and up must have one shape and dtype");
  if (gate.scalar_type() == at::kFloat)
    silu_mul<float>(gate.data_ptr<float>(), up.data_ptr<float>(), gate.numel());
  else
    silu_mul<c10::BFloat16>(gate.data_ptr<c10::BFloat16>(), up.data_ptr<c10::BFloat16>(), gate.numel());
  return gate;
}

// x = GELU(x) in place, the erf form (BertIntermediate's act(dense(x)): the pooling runner's encoders). Returns x.
at::Tensor fused_gelu(at::Tensor x) {
  using namespace batchery_fused;
  check_rows(x, "fused_gelu");
  if (x.scalar_type() == at::kFloat)
    gelu<float>(x.data_ptr<float>(), x.numel());
  else
    gelu<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), x.numel());
  return x;
}

// Tests: force (true) or release (false) the scalar path; returns the previous setting.
bool fused_set_scalar(bool on) { return batchery_fused::g_scalar.exchange(on); }

// Whether the kernels take their AVX-512 path now (built with AVX-512 and not forced scalar).
bool fused_vectorized() { return batchery_fused::vectorized(); }
