#include "amx.h"
#include "bf16.h"
#include "kernels.h"
#include "linear_tiles.h"

// ---- bf16 linear on AMX tiles ------------------------------------------------------------------
// On CPUs with AMX-BF16 (and a compiler that targets it): a tile multiply (tdpbf16ps) takes a 16 x 32 bf16 block of
// x, a 16-column block of the weight (32 k as 16 rows of pairs) and adds the 16 x 16 fp32 products, 8192
// multiply-adds in one instruction (about 16 cycles). On the 2-core Xeon (model 167) a loop of them ran at 2.0 TFLOPS,
// where oneDNN's bf16 matmul reached 0.6 (torch, 2048^3) and vdpbf16ps would reach about a sixth of it.
// Four accumulators (2 row blocks x 2 column blocks), two x blocks, two weight blocks: the eight tile registers.
// The weight is packed (pack_amx) as int32 [N/16, K/32, 16, 16]: each 16-column block's tiles of 1 KB in k order,
// so a column pair streams 2 K/32 KB from memory; x tiles are read in place (its rows K bf16 apart).
#ifdef BATCHERY_AMX

// tiles 0, 1: rows block 0 x column blocks 0, 1 (r0 rows); 2, 3: rows block 1 (r1 rows, none when 0);
// 4, 5: x of the two row blocks; 6, 7: the two weight blocks
static inline void amx_configure(int r0, int r1) {
  AmxConfig c;
  const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows[t]);
    c.colsb[t] = rows[t] ? 64 : 0;
  }
  // the whole struct as the operand: _tile_loadconfig's own asm names 8 bytes of it, and GCC 12 then drops the
  // stores to the rest as dead (the tiles' rows stay 0: an illegal instruction at the first tile load)
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// the products of rows m0 .. m0 + 31 (r0 + r1 of them) with one column pair into cbuf [32, 32] fp32;
// x [*, K] bf16 at row m0, w0 the pair's first tile
template <bool TWO>
static inline void amx_block(const uint16_t* x, int64_t K, const char* w0, int64_t ktiles, float* cbuf) {
  const char* w1 = w0 + ktiles * 1024;
  const int64_t ldx = K * 2;
  _tile_zero(0);
  _tile_zero(1);
  if (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kt = 0; kt < ktiles; ++kt) {
    _tile_loadd(4, x + kt * 32, ldx);
    _tile_loadd(6, w0 + kt * 1024, 64);
    _tile_loadd(7, w1 + kt * 1024, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (TWO) {
      _tile_loadd(5, x + 16 * K + kt * 32, ldx);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, cbuf, 128);
  _tile_stored(1, cbuf + 16, 128);
  if (TWO) {
    _tile_stored(2, cbuf + 16 * 32, 128);
    _tile_stored(3, cbuf + 16 * 32 + 16, 128);
  }
}

// Tasks are (row chunk of up to kChunk rows, column pair): a chunk's x (up to 256 x K bf16) stays in L2 while
// the column pairs stream past it; decode steps (one chunk) read every weight once. A task's sums go to a buffer
// and are rounded to bf16 after its last tile multiply: read back right after each block's tile stores, they
// stalled every block (the rounding's cost doubled: 550-740 GFLOPS at 64-955 rows with it there, 800-900 without).
// SILU: the weight is gate and up interleaved by 16-column blocks (pack_amx_gate_up), so a column pair holds a
// block of each and the output [M, N / 2] is SiLU(gate) * up, written without the two projections' outputs
template <bool SILU>
static void amx_linear(const uint16_t* x, const char* wp, uint16_t* out, int64_t M, int64_t K, int64_t N,
                       const float* bias) {
  constexpr int64_t kChunk = 256;
  const int64_t pairs = N / 32, chunks = (M + kChunk - 1) / kChunk, ktiles = K / 32;
  at::parallel_for(0, chunks * pairs, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(kChunk * 32 + 16);
    float* cbuf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
    int configured = -1;  // the r0 * 32 + r1 of the tiles' current configuration
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c = t / pairs, p = t % pairs;
      const int64_t n0 = p * 32, m_begin = c * kChunk, m_end = std::min(M, m_begin + kChunk);
      const char* w0 = wp + p * 2 * ktiles * 1024;
      for (int64_t m0 = m_begin; m0 < m_end; m0 += 32) {
        const int r0 = static_cast<int>(std::min<int64_t>(16, m_end - m0));
        const int r1 = static_cast<int>(std::min<int64_t>(16, std::max<int64_t>(0, m_end - m0 - 16)));
        if (configured != r0 * 32 + r1) {
          amx_configure(r0, r1);
          configured = r0 * 32 + r1;
        }
        if (r1)
          amx_block<true>(x + m0 * K, K, w0, ktiles, cbuf + (m0 - m_begin) * 32);
        else
          amx_block<false>(x + m0 * K, K, w0, ktiles, cbuf + (m0 - m_begin) * 32);
      }
      if (SILU) {  // no bias: the MLPs this serves have none
        for (int64_t i = 0; i < m_end - m_begin; ++i)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m_begin + i) * (N / 2) + p * 16),
                              silu_mul16(_mm512_load_ps(cbuf + i * 32), _mm512_load_ps(cbuf + i * 32 + 16)));
        continue;
      }
      const __m512 b0 = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
      const __m512 b1 = bias ? _mm512_loadu_ps(bias + n0 + 16) : _mm512_setzero_ps();
      for (int64_t i = 0; i < m_end - m_begin; ++i) {
        const __m512 lo = _mm512_add_ps(_mm512_load_ps(cbuf + i * 32), b0);
        const __m512 hi = _mm512_add_ps(_mm512_load_ps(cbuf + i * 32 + 16), b1);
        uint16_t* o = out + (m_begin + i) * N + n0;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), bf16_round16(lo));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), bf16_round16(hi));
      }
    }
    if (configured >= 0) _tile_release();
  });
}
#endif

// whether linear_amx runs here: built for AMX-BF16 and the tiles granted by the OS
bool has_amx_linear() {
#ifdef BATCHERY_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// w [N, K] bf16 -> int32 [N/16, K/32, 16, 16]: tile (j, t) holds columns 16j.. of k 32t.., as 16 rows of 16 pairs
// (w[n][k], w[n][k + 1]); N and K multiples of 32
at::Tensor pack_amx(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(0) % 32 == 0 && w.size(1) % 32 == 0,
              "pack_amx: bf16 [N, K], N and K multiples of 32");
  const int64_t N = w.size(0), K = w.size(1);
  return w.contiguous()
      .view({N / 16, 16, K / 32, 16, 2})
      .permute({0, 2, 3, 1, 4})
      .contiguous()
      .view(at::kInt)
      .view({N / 16, K / 32, 16, 16});
}

#ifdef BATCHERY_AMX
// What linear_amx and linear_amx_silu share: the checks (``what`` names the caller in errors) and the call.
// SILU: the tiles come from pack_amx_gate_up and the output has half their columns.
template <bool SILU>
static at::Tensor amx_call(const char* what, const at::Tensor& x, const at::Tensor& wp,
                           c10::optional<at::Tensor> bias) {
  TORCH_CHECK(amx_permitted(), what, ": the OS did not grant the AMX tile state");
  TORCH_CHECK(wp.dim() == 4 && wp.size(2) == 16 && wp.size(3) == 16 && wp.size(0) % 2 == 0 && wp.is_contiguous() &&
                  wp.scalar_type() == at::kInt,
              what, ": the weight must come from ", SILU ? "pack_amx_gate_up" : "pack_amx");
  const int64_t N = wp.size(0) * 16, K = wp.size(1) * 32, n_out = SILU ? N / 2 : N;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.size(-1) == K, what, ": the input must be bf16 [..., K]");
  auto xs = x.sizes().vec();
  auto xf = x.reshape({-1, K}).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, what, ": the bias must have out_features elements");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  auto out = at::empty({M, n_out}, xf.options());
  if (M > 0)
    amx_linear<SILU>(reinterpret_cast<const uint16_t*>(xf.data_ptr()), reinterpret_cast<const char*>(wp.data_ptr()),
                     reinterpret_cast<uint16_t*>(out.data_ptr()), M, K, N,
                     bias_f.defined() ? bias_f.data_ptr<float>() : nullptr);
  xs.back() = n_out;
  return out.view(xs);
}
#endif

// y = x @ w.T (+ bias) with w from pack_amx: bf16 in and out, fp32 sums rounded once (as linear_bf16)
at::Tensor linear_amx(at::Tensor x, at::Tensor wp, c10::optional<at::Tensor> bias) {
#ifdef BATCHERY_AMX
  return amx_call<false>("linear_amx", x, wp, bias);
#else
  TORCH_CHECK(false, "linear_amx: built without AMX-BF16");
  return x;
#endif
}

// gate, up [I, K] bf16 (an MLP's two projections) -> pack_amx of their rows interleaved by 16: column pair p holds
// gate columns 16p.. and up columns 16p.. (I a multiple of 16, K of 32)
at::Tensor pack_amx_gate_up(at::Tensor gate, at::Tensor up) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.scalar_type() == at::kBFloat16 &&
                  up.scalar_type() == at::kBFloat16 && gate.size(0) % 16 == 0 && gate.size(1) % 32 == 0,
              "pack_amx_gate_up: gate and up must be bf16 [I, K] of one shape, I a multiple of 16 and K of 32");
  return pack_amx(interleave_gate_up(gate, up, 16));
}

// SiLU(x @ gate.T) * (x @ up.T) with the weight from pack_amx_gate_up: [..., I] bf16, bit for bit what the two
// projections through linear_amx and cpu_fused's fused_silu_mul give
at::Tensor linear_amx_silu(at::Tensor x, at::Tensor wp) {
#ifdef BATCHERY_AMX
  return amx_call<true>("linear_amx_silu", x, wp, c10::nullopt);
#else
  TORCH_CHECK(false, "linear_amx_silu: built without AMX-BF16");
  return x;
#endif
}
