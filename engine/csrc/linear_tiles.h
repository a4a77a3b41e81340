// The register tiles of the linears (linear.cpp, amx_linear.cpp): fp32 and bf16, and the bf16 gate/up pass.
#pragma once

#include "bf16.h"
#include "kernels.h"
#include "vec_math.h"

// ---- fp32 linear with a pre-transposed weight -------------------------------------------------
// A register tile of up to 6 input rows x 64 output columns accumulates over K: each step loads
// 64 weights from one row of the [K, N] weight and broadcasts one input value per row. On an AMD
// EPYC (where MKL takes a generic path) this ran at 1.3-2x MKL's sgemm for 1 to 256 rows; on an
// Intel Xeon MKL is faster at 64 rows and more. engine/fast_linear.py times both at load.

// Columns a register tile spans, in 16-column groups (tile_nv), and the width of its vectors. With AVX-512 a tile is
// 6 x 64: 24 of the 32 registers. With AVX2's 16 registers of 8 floats it is 6 x 16 (12 accumulators, as BLIS's
// Haswell kernel) and a 64-column panel is four of them over the same rows of x while they are in L1; its vectors
// are 32 bytes, because GCC keeps a 64-byte vector type in memory there (moved through general registers: 8 GFLOPS
// on a Zen 3 core, MKL's 100).
#ifdef __AVX512F__
#define BATCHERY_VBYTES 64
static inline int64_t tile_nv(int64_t /*mb*/) { return 4; }
#else
#define BATCHERY_VBYTES 32
// one or two rows (an LM head's single sequence): the panel in one pass, whose weight then streams in order
static inline int64_t tile_nv(int64_t mb) { return mb == 1 ? 4 : mb == 2 ? 2 : 1; }
#endif
static constexpr int kLanes = BATCHERY_VBYTES / 4;
static constexpr int kPer = 16 / kLanes;  // vectors in a 16-column group

typedef float vfn __attribute__((vector_size(BATCHERY_VBYTES)));
typedef float vfnu __attribute__((vector_size(BATCHERY_VBYTES), aligned(4), may_alias));

static inline vfn loadv(const float* p) { return *reinterpret_cast<const vfnu*>(p); }
static inline void storev(float* p, vfn v) { *reinterpret_cast<vfnu*>(p) = v; }

// The next column panel, brought into L2 a few lines per k step while a tile computes on the current one. A panel
// is read from memory by its first row tile and from cache by the rest; without this, a thread's panels went memory
// read, then compute, then memory read: at 16-64 rows (decode steps) the bf16 linears of SmolLM2 ran at about half
// of what memory or compute alone allowed (the Zen 5 EPYC: 410 GFLOPS at 32 rows from DRAM, 900 from L3).
// A panel's k rows are 256 bytes (64 columns of 4-byte elements or bf16 pairs), ld bytes apart: contiguous in
// panels, a stride of N in a transposed fp32 weight.
struct NextPanel {
  const char* base = nullptr;  // the panel's first k row
  int64_t ld = 0;              // bytes from one k row to the next
  int64_t line = 0, stop = 0;  // the lines still to fetch: line l is at base + (l / 4) * ld + (l % 4) * 64
  int per_k = 0;               // lines fetched per k step of the tile
  inline void step() {
    for (int i = 0; i < per_k && line < stop; ++i, ++line)
      __builtin_prefetch(base + (line >> 2) * ld + (line & 3) * 64, 0, 2);
  }
};

// A tile kernel computes out[i, n0 : n0 + 16 * NV] for i < MB over kl steps of k:
// struct { using X, W, O = ...; kXPerK; template <int MB, int NV, bool PF> static void run(x, w, out, kl, ldw, N,
// n0, bias, next); } with x [MB, kl * kXPerK] of X, w the tile's first weight column, its k rows ldw elements of W
// apart, out [*, N] of O; next.step() once per k step.
struct TileF32 {
  static constexpr bool kStrided = true;  // reads a transposed weight (rows a stride of N apart) unless in panels
  static constexpr int64_t kXPerK = 1;    // elements of x per k step (a row of x is kl * kXPerK elements)
  static constexpr int64_t kOutDiv = 1;   // output columns per weight column, inverted (2: a SiLU(gate) * up tile)
  using X = float;
  using W = float;
  using O = float;  // the output's element type (bias: added by the caller, never passed here)
  // PF: the panel's k rows are read from memory for the first time (the first row tile of a panel, transposed
  // weight): each is prefetched kPrefetchK rows ahead, since rows a stride of N apart defeat the hardware prefetcher
  template <int MB, int NV, bool PF>
  static inline void run(const float* __restrict x, const float* __restrict w, float* __restrict out, int64_t K,
                         int64_t ldw, int64_t N, int64_t n0, const float* /*bias*/, NextPanel next) {
    constexpr int64_t kPrefetchK = 24;
    constexpr int NVEC = NV * kPer;
    vfn acc[MB][NVEC];
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < NVEC; ++v) acc[i][v] = vfn{};
    for (int64_t k = 0; k < K; ++k, w += ldw) {
      next.step();
      if (PF && k + kPrefetchK < K)
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) __builtin_prefetch(w + kPrefetchK * ldw + 16 * v);
      vfn wv[NVEC];
#pragma GCC unroll 8
      for (int v = 0; v < NVEC; ++v) wv[v] = loadv(w + kLanes * v);
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        const float xs = x[i * K + k];
#pragma GCC unroll 8
        for (int v = 0; v < NVEC; ++v) acc[i][v] += xs * wv[v];
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < NVEC; ++v) storev(out + i * N + n0 + kLanes * v, acc[i][v]);
  }
};

template <typename Tile, int NV, bool PF>
static inline void tile_rows(int64_t mb, const typename Tile::X* x, const typename Tile::W* w, typename Tile::O* out,
                             int64_t kl, int64_t ldw, int64_t N, int64_t n0, const float* bias, const NextPanel& next) {
  switch (mb) {
    case 6: Tile::template run<6, NV, PF>(x, w, out, kl, ldw, N, n0, bias, next); break;
    case 5: Tile::template run<5, NV, PF>(x, w, out, kl, ldw, N, n0, bias, next); break;
    case 4: Tile::template run<4, NV, PF>(x, w, out, kl, ldw, N, n0, bias, next); break;
    case 3: Tile::template run<3, NV, PF>(x, w, out, kl, ldw, N, n0, bias, next); break;
    case 2: Tile::template run<2, NV, PF>(x, w, out, kl, ldw, N, n0, bias, next); break;
    default: Tile::template run<1, NV, PF>(x, w, out, kl, ldw, N, n0, bias, next);
  }
}

template <typename Tile, bool PF>
static inline void tile_cols(int64_t mb, const typename Tile::X* x, const typename Tile::W* w, typename Tile::O* out,
                             int64_t kl, int64_t ldw, int64_t N, int64_t n0, const float* bias, const NextPanel& next) {
  switch (std::min<int64_t>(tile_nv(mb), (N - n0) / 16)) {
    case 4: tile_rows<Tile, 4, PF>(mb, x, w, out, kl, ldw, N, n0, bias, next); break;
    case 3: tile_rows<Tile, 3, PF>(mb, x, w, out, kl, ldw, N, n0, bias, next); break;
    case 2: tile_rows<Tile, 2, PF>(mb, x, w, out, kl, ldw, N, n0, bias, next); break;
    default: tile_rows<Tile, 1, PF>(mb, x, w, out, kl, ldw, N, n0, bias, next);
  }
}

// out [M, N] = x [M, kl] . w in 6 x 64 tiles, in parallel over (column panel, row tile); N % 16 == 0.
// w is [kl, N] row-major, or with panels (``pack_panels``) [ceil(N / 64), kl, 64]: each 64-column panel
// contiguous, which wide layers (an LM head: N in the tens of thousands) need. Read with a stride of N, every
// k row of a panel is on its own page; contiguous, the panel streams (2-2.5x at 8-64 rows on the AMD VM).
template <typename Tile>
static void tiled_linear(const typename Tile::X* x, const typename Tile::W* w, typename Tile::O* out, int64_t M,
                         int64_t kl, int64_t N, bool panels = false, const float* bias = nullptr) {
  const int64_t npanels = (N + 63) / 64, mtiles = (M + 5) / 6;
  at::parallel_for(0, npanels * mtiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = t / mtiles, mt = t % mtiles;
      const int64_t m0 = mt * 6, mb = M - m0 < 6 ? M - m0 : 6;
      const auto* xp = x + m0 * kl * Tile::kXPerK;
      auto* op = out + m0 * (N / Tile::kOutDiv);
      const int64_t ldw = panels ? 64 : N;
      // a transposed weight's panel, first read by this thread: its rows prefetched (panels stream by themselves)
      const bool first = !panels && Tile::kStrided && (t == t0 || mt == 0);
      const int64_t step = 16 * tile_nv(mb), passes = (64 + step - 1) / step;
      // this row tile's share of the next panel, when this thread computes that one too: 1/mtiles of its lines,
      // spread over the tile's passes and k steps. Only from 4 row tiles (19 rows) on, where it is a line or so per k
      // step: with fewer, the panels' reads are most of the time and the hardware prefetcher streams them (the
      // extra prefetches made 1-16 rows 3-7% slower, 24-48 rows 10-20% faster)
      NextPanel next;
      if (mtiles >= 4 && p + 1 < npanels && (p + 1) * mtiles < t1) {
        next.base = reinterpret_cast<const char*>(panels ? w + (p + 1) * kl * 64 : w + (p + 1) * 64);
        next.ld = ldw * static_cast<int64_t>(sizeof(*w));
        next.line = 4 * kl * mt / mtiles;
        next.stop = 4 * kl * (mt + 1) / mtiles;
      }
      const int64_t share = (next.stop - next.line + passes - 1) / passes;
      for (int64_t c = 0; c < 64 && p * 64 + c < N; c += step) {  // one pass where a tile spans it
        const int64_t n0 = p * 64 + c;
        const auto* wp = panels ? w + p * kl * 64 + c : w + n0;
        NextPanel part = next;
        part.line = std::min(next.stop, next.line + (c / step) * share);
        part.stop = std::min(next.stop, part.line + share);
        part.per_k = static_cast<int>(std::min<int64_t>(8, (share + kl - 1) / kl));
        if (first)
          tile_cols<Tile, true>(mb, xp, wp, op, kl, ldw, N, n0, bias, part);
        else
          tile_cols<Tile, false>(mb, xp, wp, op, kl, ldw, N, n0, bias, part);
      }
    }
  });
}

// ---- bf16 linear ---------------------------------------------------------------------------------
// On CPUs with AVX512-BF16 (and a compiler that targets it, -march=native): vdpbf16ps. Elsewhere with AVX2 or
// AVX-512 (the second TileBF16): each weight pair is widened to two fp32 vectors by shifts, exact, and multiplied
// in fp32 with FMAs; the weight is still read as bf16, half the bytes of fp32, which is what decode steps wait
// for. Without either, has_bf16_linear() is false and torch keeps every bf16 linear.

#ifdef __AVX512BF16__
// SiLU(gate) * up as the fused MLP computes it from the two projections' bf16 outputs (cpu_fused's silu_mul):
// gate and up each rounded to bf16 as linear_bf16 and linear_amx store them, SiLU by an exact division rounded to
// bf16 (a NaN as cpu_fused rounds it, 0x7FC0), the product rounded once more. Returns the product's bf16 bits.
static inline __m256i silu_mul16(__m512 gate_sum, __m512 up_sum) {
  const __m512 g = bf16_as_float16(bf16_round16(gate_sum)), u = bf16_as_float16(bf16_round16(up_sum));
  const __m512 e = exp_poly(_mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(-104.f)),
                                          _mm512_set1_ps(100.f)));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), e);
  __m512 q;
  __asm__("vdivps %2, %1, %0" : "=v"(q) : "v"(g), "v"(d));  // exact (-ffast-math may not turn it into rcp)
  return bf16_round16<0x7FC0>(_mm512_mul_ps(bf16_as_float16(bf16_round16<0x7FC0>(q)), u));
}

// y[i, n] = sum_k x[i, k] w[n, k]; wp is the weight packed as uint32 [K/2, N]: (w[n][2k], w[n][2k+1]).
// Same 6 x 64 register tile as the fp32 kernel; vdpbf16ps multiplies a pair of k per lane.
// SILU: the weight is an MLP's gate and up interleaved by 32 columns (pack_bf16_gate_up), so a 64-column panel holds
// 32 of each and the tile writes SiLU(gate) * up to 32 columns of an output with N / 2 (as silu_mul16 computes it).
// GELU: each sum (+ bias) rounded to bf16, then GELU (gelu16) rounded again: the bits of linear_bf16 then fused_gelu,
// without writing and reading back the projection (an encoder's intermediate dense + GELU)
template <bool SILU, bool GELU = false>
struct TileBF16T {
  static constexpr bool kStrided = false;
  static constexpr int64_t kXPerK = 1;
  static constexpr int64_t kOutDiv = SILU ? 2 : 1;  // output columns per weight column, inverted
  using X = uint32_t;  // a pair of bf16
  using W = uint32_t;
  using O = uint16_t;  // bf16 bits: the fp32 sums (+ bias) are rounded once, as out.to(bf16) would round them
  template <int MB, int NV, bool /*PF: never, the weight is always in panels*/>
  static inline void run(const uint32_t* __restrict x, const uint32_t* __restrict w, uint16_t* __restrict out,
                         int64_t K2, int64_t ldw, int64_t N, int64_t n0, const float* bias, NextPanel next) {
    __m512 acc[MB][NV];
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K2; ++k, w += ldw) {
      next.step();
      __m512i wv[NV];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(w + 16 * v);
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        const __m512i xb = _mm512_set1_epi32(static_cast<int>(x[i * K2 + k]));
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], (__m512bh)xb, (__m512bh)wv[v]);
      }
    }
    if (bias != nullptr) {
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) {
        const __m512 bv = _mm512_loadu_ps(bias + n0 + 16 * v);
#pragma GCC unroll 8
        for (int i = 0; i < MB; ++i) acc[i][v] = _mm512_add_ps(acc[i][v], bv);
      }
    }
    if constexpr (SILU) {
      if constexpr (NV == 4) {  // always, since the interleaved weight has N % 64 == 0
#pragma GCC unroll 8
        for (int i = 0; i < MB; ++i)
#pragma GCC unroll 2
          for (int v = 0; v < 2; ++v)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * (N / 2) + n0 / 2 + 16 * v),
                                silu_mul16(acc[i][v], acc[i][v + 2]));
      }
    } else if constexpr (GELU) {
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * N + n0 + 16 * v),
                              bf16_round16<0x7FC0>(gelu16(bf16_as_float16(bf16_round16(acc[i][v])))));
    } else {
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * N + n0 + 16 * v), bf16_round16(acc[i][v]));
    }
  }
};
using TileBF16 = TileBF16T<false>;
#elif defined(__AVX2__) || defined(__AVX512F__)
#define BATCHERY_BF16_WIDEN 1
typedef uint32_t vun __attribute__((vector_size(BATCHERY_VBYTES)));
typedef uint32_t vunu __attribute__((vector_size(BATCHERY_VBYTES), aligned(4), may_alias));
typedef uint16_t vhnu __attribute__((vector_size(BATCHERY_VBYTES / 2), aligned(2), may_alias));

// y[i, n] = sum_k x[i, k] w[n, k] with x already fp32 ([MB, 2 * K2]) and wp packed as pack_bf16 packs it; the
// sums rounded once to bf16 as torch's conversion rounds them (to nearest, ties to even; a NaN becomes 0xFFFF).
struct TileBF16 {
  static constexpr bool kStrided = false;
  static constexpr int64_t kXPerK = 2;  // x is fp32: two elements per pair of k
  static constexpr int64_t kOutDiv = 1;
  using X = float;
  using W = uint32_t;  // a pair of bf16: w[n][2k] in the low half, w[n][2k + 1] in the high
  using O = uint16_t;
  template <int MB, int NV, bool /*PF: never, the weight is always in panels*/>
  static inline void run(const float* __restrict x, const uint32_t* __restrict w, uint16_t* __restrict out, int64_t K2,
                         int64_t ldw, int64_t N, int64_t n0, const float* bias, NextPanel next) {
    constexpr int NVEC = NV * kPer;
    const int64_t K = 2 * K2;
    vfn acc[MB][NVEC];
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < NVEC; ++v) acc[i][v] = vfn{};
    for (int64_t k = 0; k < K2; ++k, w += ldw) {
      next.step();
      vfn lo[NVEC], hi[NVEC];
#pragma GCC unroll 8
      for (int v = 0; v < NVEC; ++v) {
        const vun raw = *reinterpret_cast<const vunu*>(w + kLanes * v);
        lo[v] = reinterpret_cast<vfn>(raw << 16);  // bf16 -> fp32 is exact: the bits moved up
        hi[v] = reinterpret_cast<vfn>(raw & 0xFFFF0000u);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        const float x0 = x[i * K + 2 * k], x1 = x[i * K + 2 * k + 1];
#pragma GCC unroll 8
        for (int v = 0; v < NVEC; ++v) acc[i][v] += x0 * lo[v] + x1 * hi[v];
      }
    }
#pragma GCC unroll 8
    for (int v = 0; v < NVEC; ++v) {
      const vfn bv = bias != nullptr ? loadv(bias + n0 + kLanes * v) : vfn{};
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        const vun b = reinterpret_cast<vun>(acc[i][v] + bv);
        const vun r = (b + ((b >> 16) & 1u) + 0x7FFFu) >> 16;
        const vun nan = (b & 0x7FFFFFFFu) > 0x7F800000u;  // on the bits: -ffast-math folds float NaN tests away
        *reinterpret_cast<vhnu*>(out + i * N + n0 + kLanes * v) = __builtin_convertvector(nan ? 0xFFFFu : r, vhnu);
      }
    }
  }
};
#endif

// gate, up [I, K] (checked by the caller: one shape, I a multiple of by) -> [2 I, K]: by rows of gate, the same by rows
// of up, and so on (what the gate/up passes pack, so that a block of the output has both halves of its columns)
static inline at::Tensor interleave_gate_up(const at::Tensor& gate, const at::Tensor& up, int64_t by) {
  const int64_t I = gate.size(0), K = gate.size(1);
  return at::stack({gate.contiguous().view({I / by, by, K}), up.contiguous().view({I / by, by, K})}, 1)
      .view({2 * I, K});
}
