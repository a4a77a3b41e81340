"""The CPU kernels, in C++, built once on first use with torch's cpp_extension and cached.

- ``paged_decode``: decode attention read straight from the paged KV pool, and ``store_kv``: the step's
  K/V written into it (both used by ``batchery.engine.attention.cpu_paged``);
- ``argmax_rows``: torch.argmax over the rows of a float or bf16 matrix, vectorized (the sampler's greedy rows);
- ``linear_t``: an fp32 linear over a pre-transposed weight, and ``linear_bf16`` (with
  ``pack_bf16``): a bf16 linear for CPUs with AVX512-BF16 (both used by ``batchery.engine.fast_linear``).

Other modules add their own kernels as parts (``PARTS``: modules with a C++ ``SOURCE`` and the
``FUNCTIONS`` it exports), compiled into the same extension so one build and one load serve all.

If the build fails (no compiler, no ninja) every caller falls back to torch; set
``BATCHERY_CPU_KERNELS=0`` to skip the build and use torch everywhere."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import sys
import threading
import types
from pathlib import Path

log = logging.getLogger("batchery.engine.kernels")

NAME = "batchery_cpu_kernels_v35"  # bump when the source changes (the build cache is keyed by it)

_SOURCE = r"""
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

// ---- paged decode attention ----------------------------------------------------------------
// Decode attention straight from the paged pool [num_blocks, block_size, Hkv, D].
// A task is one sequence and a group of its KV heads; with enough sequences every task takes all
// heads, so each block (all heads of block_size tokens, contiguous) is read front to back once for
// K and once for V, in one pass with an online softmax, while the next block is prefetched. head_dim is a
// compile-time constant for the common sizes, so the per-head accumulators live in registers.

static inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;  // bf16 -> f32 is exact
}

static inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

// Rows of one block as float: in place for float, converted into buf for bfloat16.
template <typename T>
static inline const float* block_rows(const T* src, float* buf, int64_t n);
template <>
inline const float* block_rows<float>(const float* src, float* buf, int64_t n) { (void)buf; (void)n; return src; }
template <>
inline const float* block_rows<c10::BFloat16>(const c10::BFloat16* src, float* buf, int64_t n) {
  to_float(src, buf, n);
  return buf;
}

// What both decode kernels share: the arguments as pointers and sizes, and the split of the work
// into tasks of one sequence and a group of its KV heads (all of them when there are at least 4
// sequences per thread, so each block, all heads of block_size tokens, is read front to back once).
template <typename T>
struct DecodeArgs {
  int64_t B, H, D, bs, Hkv, G, maxb, groups, hper, window;
  int64_t tok_stride, blk_stride;  // one token of a block (all its KV heads); one block
  const T *qp, *kp, *vp;
  const int64_t *btp, *cp;
  T* op;
  float fscale, cap;
  DecodeArgs(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& bt,
             const at::Tensor& ctx, at::Tensor& out, double scale, int64_t window_, double softcap)
      : B(q.size(0)), H(q.size(1)), D(q.size(2)), bs(kc.size(1)), Hkv(kc.size(2)), G(H / Hkv), maxb(bt.size(1)),
        groups(B >= 4 * at::get_num_threads() ? 1 : Hkv), hper(Hkv / groups), window(window_),
        tok_stride(Hkv * D), blk_stride(bs * Hkv * D),
        qp(q.data_ptr<T>()), kp(kc.data_ptr<T>()), vp(vc.data_ptr<T>()),
        btp(bt.data_ptr<int64_t>()), cp(ctx.data_ptr<int64_t>()), op(out.data_ptr<T>()),
        fscale(static_cast<float>(scale)), cap(static_cast<float>(softcap)) {}
  int64_t num_tasks() const { return B * groups; }
};

struct DecodeTask {
  int64_t b, h0, nq, start, len;  // sequence, its first KV head, query heads, first attended token, tokens
};

// The first token a sequence of n tokens attends to (its sliding window's start, or 0).
template <typename T>
static inline int64_t attend_start(const DecodeArgs<T>& a, int64_t n) {
  return (a.window > 0 && n - a.window > 0) ? n - a.window : 0;
}

// Task idx; false when its sequence attends to nothing (its output rows are zeroed here).
template <typename T>
static inline bool decode_task(const DecodeArgs<T>& a, int64_t idx, DecodeTask& t) {
  t.b = idx / a.groups;
  t.h0 = (idx % a.groups) * a.hper;
  t.nq = a.hper * a.G;
  const int64_t n = a.cp[t.b];
  t.start = attend_start(a, n);
  t.len = n - t.start;
  if (t.len > 0) return true;
  T* dst = a.op + (t.b * a.H + t.h0 * a.G) * a.D;
  for (int64_t i = 0; i < t.nq * a.D; ++i) dst[i] = static_cast<T>(0.f);
  return false;
}

template <typename T, int DT>
static void decode_impl(const DecodeArgs<T>& a) {
  const int64_t H = a.H, G = a.G, bs = a.bs, maxb = a.maxb;
  const int64_t D = DT > 0 ? DT : a.D;
  const T* kp = a.kp;
  const T* vp = a.vp;
  const int64_t tok_stride = a.tok_stride, blk_stride = a.blk_stride;
  const int64_t row_bytes = tok_stride * static_cast<int64_t>(sizeof(T));
  const float cap = a.cap;
  at::parallel_for(0, a.num_tasks(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), buf(blk_stride), scores(H * bs), inv(H), mx(H);
    DecodeTask t;
    for (int64_t idx = begin; idx < end; ++idx) {
      if (!decode_task(a, idx, t)) continue;
      const int64_t b = t.b, h0 = t.h0, nq = t.nq, start = t.start, n = t.start + t.len;
      const int64_t hq0 = h0 * G;  // this task's query heads: hq0 .. hq0 + nq
      T* dst = a.op + (b * H + hq0) * D;
      const T* src = a.qp + (b * H + hq0) * D;
      for (int64_t i = 0; i < nq * D; ++i) qf[i] = static_cast<float>(src[i]) * a.fscale;
      // One pass over the blocks with an online softmax: scores for a block's tokens, then that
      // block's V rows, K and V of the next block prefetched a row at a time meanwhile.
      float* sc = scores.data();
      const int64_t* table = a.btp + b * maxb;
      const int64_t first = start / bs, last = (n - 1) / bs;
      for (int64_t qi = 0; qi < nq; ++qi) {
        mx[qi] = -INFINITY;
        inv[qi] = 0.f;  // running sum of exp(score - max)
      }
      std::fill(acc.begin(), acc.begin() + nq * D, 0.f);
      for (int64_t bi = first; bi <= last; ++bi) {
        const int64_t lo = bi == first ? start - bi * bs : 0;
        const int64_t hi = bi == last ? n - bi * bs : bs;
        const int64_t nj = hi - lo;
        const T* knext = bi < last ? kp + table[bi + 1] * blk_stride : nullptr;
        const T* vnext = bi < last ? vp + table[bi + 1] * blk_stride : nullptr;
        const float* rows = block_rows<T>(kp + table[bi] * blk_stride + lo * tok_stride, buf.data(), nj * tok_stride);
        for (int64_t j = 0; j < nj; ++j) {
          if (knext) {
            prefetch_block(knext + j * tok_stride, row_bytes);
            prefetch_block(vnext + j * tok_stride, row_bytes);
          }
          const float* row = rows + j * tok_stride;
          for (int64_t qi = 0; qi < nq; ++qi) {
            const float* __restrict k = row + (h0 + qi / G) * D;
            const float* __restrict qq = &qf[qi * D];
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) s += qq[d] * k[d];
            sc[qi * bs + j] = s;
          }
        }
        for (int64_t qi = 0; qi < nq; ++qi) {
          float* s = sc + qi * bs;
          if (cap > 0.f)
            for (int64_t j = 0; j < nj; ++j) s[j] = cap * std::tanh(s[j] / cap);
          float bm = mx[qi];
          for (int64_t j = 0; j < nj; ++j) bm = s[j] > bm ? s[j] : bm;
          float sum = 0.f;
          for (int64_t j = 0; j < nj; ++j) {
            s[j] = std::exp(s[j] - bm);
            sum += s[j];
          }
          if (bm > mx[qi]) {  // a new maximum: rescale what was accumulated so far
            const float r = std::exp(mx[qi] - bm);
            inv[qi] *= r;
            for (int64_t d = 0; d < D; ++d) acc[qi * D + d] *= r;
            mx[qi] = bm;
          }
          inv[qi] += sum;
        }
        rows = block_rows<T>(vp + table[bi] * blk_stride + lo * tok_stride, buf.data(), nj * tok_stride);
        for (int64_t qi = 0; qi < nq; ++qi) {
          const float* pr = sc + qi * bs;
          const float* vh = rows + (h0 + qi / G) * D;
          float a[DT > 0 ? DT : 1];
          float* __restrict ap = DT > 0 ? a : &acc[qi * D];
          if (DT > 0)
            for (int64_t d = 0; d < D; ++d) ap[d] = acc[qi * D + d];
          for (int64_t j = 0; j < nj; ++j) {
            const float pj = pr[j];
            const float* __restrict v = vh + j * tok_stride;
            for (int64_t d = 0; d < D; ++d) ap[d] += pj * v[d];
          }
          if (DT > 0)
            for (int64_t d = 0; d < D; ++d) acc[qi * D + d] = ap[d];
        }
      }
      for (int64_t qi = 0; qi < nq; ++qi) {
        const float r = inv[qi] > 0.f ? 1.f / inv[qi] : 0.f;
        for (int64_t d = 0; d < D; ++d) dst[qi * D + d] = static_cast<T>(acc[qi * D + d] * r);
      }
    }
  });
}

#ifdef __AVX512F__
// ---- paged decode attention, AVX512 (head_dim 64 / 128) ------------------------------------------
// The same one-pass online softmax, vectorised over 16 tokens at a time: for each query head, the
// 16 dot products accumulate in 16 vectors and are summed across lanes together (hsum16), the
// probabilities come from a vector exp. bf16 caches on CPUs with AVX512-BF16 take the dot products by
// vdpbf16ps on the query as stored (exact products, fp32 sums; the scale is applied to the scores), two
// instructions a row at head_dim 64 instead of ten. The V rows of a chunk are loaded (and widened) once per
// KV head and added to all of its query heads' accumulators at once (up to 4 heads, held in registers).
// The tokens are walked in the sequence's own order across its blocks, so any block size works; the next
// task's first rows are prefetched while a task runs. On the 2-core Zen 5 EPYC, 80 sequences of 230 tokens,
// SmolLM2's 9 query and 3 KV heads of 64, bf16, one layer's 14 MB timed again and again (from L3): 0.72-0.87 ms
// before, 0.20-0.25 ms now; a layer's attention in an engine step (from DRAM, the K/V store included): 1.16 ms
// before, 0.68 ms now, memory-bound.

// 32 elements of a row as two float vectors, in the kernel's element order. float: as they are.
// bf16: one load, split without shuffles into the even elements (shifted up 16 bits) and the odd ones
// (low half masked off), so within each 32 the order is 0, 2, .., 30, 1, 3, .., 31; q is permuted into
// the same order, which leaves dot products unchanged, and the output is permuted back.
static inline void load32(const float* p, __m512& a, __m512& b) {
  a = _mm512_loadu_ps(p);
  b = _mm512_loadu_ps(p + 16);
}
static inline void load32(const c10::BFloat16* p, __m512& a, __m512& b) {
  const __m512i x = _mm512_loadu_si512(p);
  a = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  b = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
static inline int64_t lane_of(const float*, int64_t d) { return d; }
static inline int64_t lane_of(const c10::BFloat16*, int64_t d) {
  const int64_t i = d & 31;
  return (d & ~int64_t{31}) + (i & 1) * 16 + (i >> 1);
}

// out lane j = sum of the 16 lanes of v[j]
static inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sum of 4 consecutive inputs
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // pairs of 128-bit lanes summed: [0-3 lo, 0-3 hi, 4-7 lo, 4-7 hi]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// exp(x) for x in [-104, 100] (Cephes' polynomial on [-ln2/2, ln2/2], scaled by 2^n); about 1 ulp. The one
// polynomial of the extension: the decode and prefill attention (exp16) and the fused SiLU (its parts) call it.
static inline __m512 exp_poly(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// exp(x) for x <= 0 (softmax terms): about 1 ulp, 0 below -87.
static inline __m512 exp16(__m512 x) { return exp_poly(_mm512_max_ps(x, _mm512_set1_ps(-87.f))); }

// q . k for one row: the dot product's 16 partial sums (summed across lanes later, 16 rows at once)
template <typename T, int NV>
static inline __m512 dot_row(const __m512* qv, const T* __restrict k) {
  __m512 k0, k1;
  load32(k, k0, k1);
  __m512 a = _mm512_fmadd_ps(qv[1], k1, _mm512_mul_ps(qv[0], k0));
#pragma GCC unroll 8
  for (int v = 2; v < NV; v += 2) {
    load32(k + 16 * v, k0, k1);
    a = _mm512_fmadd_ps(qv[v + 1], k1, _mm512_fmadd_ps(qv[v], k0, a));
  }
  return a;
}

template <typename T>
static inline void prefetch_rows(const T* base, const int64_t* rows, int64_t n, int64_t bytes) {
  for (int64_t j = 0; j < n; ++j) prefetch_block(base + rows[j], bytes);
}

// The K and V lines of a later chunk of token rows, into L2, a few at a time between the dot products of the current
// one. Issued in one burst at a chunk's start (16 rows: 384 lines in fp32), the prefetches waited for free miss
// buffers while the chunk's arithmetic waited behind them: memory and compute took turns. Into L1, two chunks ahead
// (48 KB in fp32) did not fit it. On the Zen 4 EPYC, 80 sequences of 244 tokens, 30 layers, blocks in random order,
// builds alternated 9 times: 65.3 against 95.4 ms (median) in fp32, 37.1 against 61.6 in bf16; a decode step of
// SmolLM2 in bf16 at 80 sequences, 96-98 against 117-127 ms.
template <typename T>
struct RowPrefetch {
  const char *k = nullptr, *v = nullptr;  // the caches
  const int64_t* rows = nullptr;          // the rows to fetch (element offsets)
  int nrows = 0, lines = 0;               // rows, and 64-byte lines of one row (K and V each)
  int r = 0, o = 0;                       // the next line: row r, line o of its K (o < lines) then of its V
  inline void step(int n) {
    for (int i = 0; i < n && r < nrows; ++i) {
      const int64_t off = rows[r] * static_cast<int64_t>(sizeof(T));
      __builtin_prefetch(o < lines ? k + off + o * 64 : v + off + (o - lines) * 64, 0, 2);  // into L2
      if (++o == 2 * lines) o = 0, ++r;
    }
  }
};

#ifdef __AVX512BF16__
// q . k for one bf16 row by vdpbf16ps: the query as stored (bf16 pairs) against the row as stored, the products
// exact in fp32 and summed in fp32; the 16 partial sums as dot_row's
template <int NB>
static inline __m512 dot_row_bh(const __m512i* qb, const c10::BFloat16* __restrict k) {
  __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qb[0], (__m512bh)_mm512_loadu_si512(k));
#pragma GCC unroll 4
  for (int v = 1; v < NB; ++v) a = _mm512_dpbf16_ps(a, (__m512bh)qb[v], (__m512bh)_mm512_loadu_si512(k + 32 * v));
  return a;
}
#endif

// acc[g] += sum_j pr[g][j] * V row j, for the GN query heads of one KV head: each V row is loaded (and, for bf16,
// widened) once for all of them, their accumulators held in registers across the chunk's rows
template <typename T, int NV, int GN>
static inline void add_v_rows(float* __restrict acc, const float (*pr)[16], const T* __restrict vp,
                              const int64_t* row, int64_t hoff, int nj) {
  constexpr int D = NV * 16;
  __m512 o[GN][NV];
#pragma GCC unroll 4
  for (int g = 0; g < GN; ++g)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) o[g][v] = _mm512_loadu_ps(acc + g * D + 16 * v);
#pragma GCC unroll 2
  for (int j = 0; j < nj; ++j) {
    const T* __restrict vv = vp + row[j] + hoff;
    __m512 x[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; v += 2) load32(vv + 16 * v, x[v], x[v + 1]);
#pragma GCC unroll 4
    for (int g = 0; g < GN; ++g) {
      const __m512 pj = _mm512_set1_ps(pr[g][j]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) o[g][v] = _mm512_fmadd_ps(pj, x[v], o[g][v]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GN; ++g)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + g * D + 16 * v, o[g][v]);
}

// The first n token rows of task idx into L2 (K and V), so that a task does not begin on cold misses: issued while the
// task before it runs (at 230 tokens a sequence, its first rows were a large part of the time from DRAM)
template <typename T>
static inline void prefetch_task_start(const DecodeArgs<T>& a, int64_t idx, int64_t n, int64_t row_bytes) {
  const int64_t b = idx / a.groups, h0 = (idx % a.groups) * a.hper, ctx = a.cp[b];
  const int64_t start = attend_start(a, ctx);
  const int64_t stop = std::min(ctx, start + n);
  const int64_t* table = a.btp + b * a.maxb;
  for (int64_t p = start; p < stop; ++p) {
    const int64_t off = table[p / a.bs] * a.blk_stride + (p % a.bs) * a.tok_stride + h0 * a.D;
    const char* kc = reinterpret_cast<const char*>(a.kp + off);
    const char* vc = reinterpret_cast<const char*>(a.vp + off);
    for (int64_t o = 0; o < row_bytes; o += 64) {
      __builtin_prefetch(kc + o, 0, 2);
      __builtin_prefetch(vc + o, 0, 2);
    }
  }
}

template <typename T, int D>
static void decode_avx512(const DecodeArgs<T>& args) {
  constexpr int NV = D / 16, CH = 16, PF = 32;  // PF: rows are prefetched this many tokens ahead
  constexpr int GB = NV <= 4 ? 4 : 2;  // query heads whose V accumulators are held in registers together
#ifdef __AVX512BF16__
  constexpr bool kBh = std::is_same<T, c10::BFloat16>::value;  // scores by vdpbf16ps on the bf16 query
#else
  constexpr bool kBh = false;
#endif
  // locals only in the loops, so the vector stores (which may alias anything) force no reloads
  const DecodeArgs<T> a = args;
  const int64_t H = a.H, G = a.G, bs = a.bs, maxb = a.maxb, tok_stride = a.tok_stride, blk_stride = a.blk_stride;
  const T* kp = a.kp;
  const T* vp = a.vp;
  const float cap = a.cap;
  const int64_t row_bytes = a.hper * D * static_cast<int64_t>(sizeof(T));
  // Tasks are claimed one at a time, each thread holding the next one it will run (whose first rows it prefetches):
  // sequences differ in length, so a static split of the tasks left one thread waiting for the other. On the Zen 5
  // EPYC, 57 sequences of 100-300 tokens, 30 layers, the two builds alternated 15 times in one process: 20.3 / 23.3 ms
  // (best / median) against 23.4 / 25.7 ms.
  const int64_t ntasks = a.num_tasks();
  std::atomic<int64_t> counter{0};
  std::atomic<int64_t>* claim = &counter;
  at::parallel_for(0, std::min<int64_t>(ntasks, at::get_num_threads()), 1, [=](int64_t, int64_t) {
    std::vector<float> qbuf(H * D), accbuf(H * D), mxbuf(H), sumbuf(H);
    std::vector<int64_t> rowbuf(maxb * bs);
    float* __restrict qf = qbuf.data();
    float* __restrict acc = accbuf.data();
    float* __restrict mx = mxbuf.data();
    float* __restrict sum = sumbuf.data();
    int64_t* __restrict rows = rowbuf.data();
    alignas(64) float pr[GB][CH];
    DecodeTask t;
    for (int64_t idx = claim->fetch_add(1), nxt; idx < ntasks; idx = nxt) {
      nxt = claim->fetch_add(1);
      if (!decode_task(a, idx, t)) continue;
      const int64_t b = t.b, h0 = t.h0, nq = t.nq, start = t.start, len = t.len;
      const int64_t hq0 = h0 * G;
      T* dst = a.op + (b * H + hq0) * D;
      const T* src = a.qp + (b * H + hq0) * D;
      if (!kBh)
        for (int64_t qi = 0; qi < nq; ++qi)
          for (int64_t d = 0; d < D; ++d)
            qf[qi * D + lane_of(kp, d)] = static_cast<float>(src[qi * D + d]) * a.fscale;
      std::fill(acc, acc + nq * D, 0.f);
      const int64_t* table = a.btp + b * maxb;
      for (int64_t p = 0, bi = start / bs, off = start % bs; p < len; ++p) {  // token rows, in order
        rows[p] = table[bi] * blk_stride + off * tok_stride + h0 * D;
        if (++off == bs) off = 0, ++bi;
      }
      prefetch_rows(kp, rows, len < PF ? len : PF, row_bytes);
      prefetch_rows(vp, rows, len < PF ? len : PF, row_bytes);
      if (nxt < ntasks) prefetch_task_start(a, nxt, PF, row_bytes);
      for (int64_t c = 0; c < len; c += CH) {
        const int nj = len - c < CH ? static_cast<int>(len - c) : CH;
        const int64_t* row = rows + c;
        const int64_t ahead = len - c - PF;  // rows left beyond the prefetch distance
        RowPrefetch<T> pf;
        if (ahead > 0) {
          pf.k = reinterpret_cast<const char*>(kp);
          pf.v = reinterpret_cast<const char*>(vp);
          pf.rows = row + PF;
          pf.nrows = static_cast<int>(ahead < CH ? ahead : CH);
          pf.lines = static_cast<int>(row_bytes / 64);
        }
        // spread over the chunk's nq * CH dot products
        const int pf_per_dot = static_cast<int>((2 * CH * (row_bytes / 64) + nq * CH - 1) / (nq * CH));
        const __mmask16 valid = nj == CH ? 0xFFFF : static_cast<__mmask16>((1u << nj) - 1);
        // the query heads of each KV head in groups of up to GB: their scores and softmax terms, then one pass
        // over the chunk's V rows for the whole group
        for (int64_t qg = 0, gn = 0; qg < nq; qg += gn) {
          gn = std::min<int64_t>({GB, nq - qg, (qg / G + 1) * G - qg});  // a group stays within one KV head
          const int64_t hoff = (qg / G) * D;  // this group's KV head, within the task's rows
          for (int g = 0; g < gn; ++g) {
            const int64_t qi = qg + g;
            __m512 s[CH];
#ifdef __AVX512BF16__
            if constexpr (kBh) {
              constexpr int NB = D / 32;
              __m512i qb[NB];
#pragma GCC unroll 4
              for (int v = 0; v < NB; ++v) qb[v] = _mm512_loadu_si512(src + qi * D + 32 * v);
              const c10::BFloat16* kb = reinterpret_cast<const c10::BFloat16*>(kp) + hoff;
              if (nj == CH) {
#pragma GCC unroll 16
                for (int j = 0; j < CH; ++j) {
                  s[j] = dot_row_bh<NB>(qb, kb + row[j]);
                  pf.step(pf_per_dot);
                }
              } else {
                for (int j = 0; j < CH; ++j) s[j] = j < nj ? dot_row_bh<NB>(qb, kb + row[j]) : _mm512_setzero_ps();
              }
            } else
#endif
            {
              __m512 qv[NV];
#pragma GCC unroll 8
              for (int v = 0; v < NV; ++v) qv[v] = _mm512_loadu_ps(qf + qi * D + 16 * v);
              if (nj == CH) {
#pragma GCC unroll 16
                for (int j = 0; j < CH; ++j) {
                  s[j] = dot_row<T, NV>(qv, kp + row[j] + hoff);
                  pf.step(pf_per_dot);
                }
              } else {
                for (int j = 0; j < CH; ++j)
                  s[j] = j < nj ? dot_row<T, NV>(qv, kp + row[j] + hoff) : _mm512_setzero_ps();
              }
            }
            __m512 sc = hsum16(s);
            if (kBh) sc = _mm512_mul_ps(sc, _mm512_set1_ps(a.fscale));
            if (cap > 0.f) {
              _mm512_store_ps(pr[g], sc);
              for (int j = 0; j < nj; ++j) pr[g][j] = cap * std::tanh(pr[g][j] / cap);
              sc = _mm512_load_ps(pr[g]);
            }
            float* __restrict ai = acc + qi * D;
            const float cmax = _mm512_mask_reduce_max_ps(valid, sc);
            float m = cmax;
            if (c == 0) {
              sum[qi] = 0.f;
            } else if (cmax > mx[qi]) {  // a new maximum: rescale what was accumulated so far
              const float r = std::exp(mx[qi] - cmax);
              sum[qi] *= r;
#pragma GCC unroll 8
              for (int v = 0; v < NV; ++v)
                _mm512_storeu_ps(ai + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(ai + 16 * v), _mm512_set1_ps(r)));
            } else {
              m = mx[qi];
            }
            mx[qi] = m;
            const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m))));
            sum[qi] += _mm512_reduce_add_ps(p);
            _mm512_store_ps(pr[g], p);
          }
          float* ag = acc + qg * D;
          switch (gn) {
            case 1: add_v_rows<T, NV, 1>(ag, pr, vp, row, hoff, nj); break;
            case 2: add_v_rows<T, NV, 2>(ag, pr, vp, row, hoff, nj); break;
            case 3: if constexpr (GB >= 3) add_v_rows<T, NV, 3>(ag, pr, vp, row, hoff, nj); break;
            default: if constexpr (GB >= 4) add_v_rows<T, NV, 4>(ag, pr, vp, row, hoff, nj); break;
          }
        }
      }
      for (int64_t qi = 0; qi < nq; ++qi) {
        const float r = 1.f / sum[qi];
        for (int64_t d = 0; d < D; ++d) dst[qi * D + d] = static_cast<T>(acc[qi * D + lane_of(kp, d)] * r);
      }
    }
  });
}
#endif

template <typename T>
static void decode_dispatch(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& bt,
                            const at::Tensor& ctx, at::Tensor& out, double scale, int64_t window, double softcap) {
  const DecodeArgs<T> a(q, kc, vc, bt, ctx, out, scale, window, softcap);
  switch (a.D) {
#ifdef __AVX512F__
    case 64: decode_avx512<T, 64>(a); break;
    case 128: decode_avx512<T, 128>(a); break;
#else
    case 64: decode_impl<T, 64>(a); break;
    case 128: decode_impl<T, 128>(a); break;
#endif
    default: decode_impl<T, 0>(a);
  }
}

at::Tensor paged_decode(at::Tensor q, at::Tensor kc, at::Tensor vc, at::Tensor bt, at::Tensor ctx,
                        double scale, int64_t window, double softcap) {
  q = q.contiguous();
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous(), "paged_decode: caches must be contiguous");
  TORCH_CHECK(bt.scalar_type() == at::kLong && ctx.scalar_type() == at::kLong, "paged_decode: tables must be int64");
  bt = bt.contiguous();
  ctx = ctx.contiguous();
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    decode_dispatch<float>(q, kc, vc, bt, ctx, out, scale, window, softcap);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_dispatch<c10::BFloat16>(q, kc, vc, bt, ctx, out, scale, window, softcap);
  } else {
    TORCH_CHECK(false, "paged_decode: unsupported dtype");
  }
  return out;
}

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
  static inline void run(const float* __restrict x, const float* __restrict w, float* __restrict out,
                         int64_t K, int64_t ldw, int64_t N, int64_t n0, const float* /*bias*/, NextPanel next) {
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
static inline void tile_rows(int64_t mb, const typename Tile::X* x, const typename Tile::W* w,
                             typename Tile::O* out, int64_t kl, int64_t ldw, int64_t N, int64_t n0,
                             const float* bias, const NextPanel& next) {
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
static inline void tile_cols(int64_t mb, const typename Tile::X* x, const typename Tile::W* w,
                             typename Tile::O* out, int64_t kl, int64_t ldw, int64_t N, int64_t n0,
                             const float* bias, const NextPanel& next) {
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

// ---- argmax over rows ---------------------------------------------------------------------------
// out[i] = torch.argmax(x[i]) for x [B, V] float or bf16 (contiguous): the first index of the row's maximum, or of
// its first NaN when it has one (torch counts NaN above everything). torch's CPU argmax compares one element at a
// time: on the 2-core Zen 5 EPYC, SmolLM2's greedy rows at 80 x 49,152 took 1.35 ms in fp32 (3.0 ms with the bf16
// logits' conversion), this kernel 0.17 ms on the bf16 logits. Here: a vector max (and NaN test, on the bits:
// -ffast-math folds float NaN tests away), then the first index equal to it. Rows in parallel.
static inline uint32_t argmax_bits(float v) { uint32_t u; std::memcpy(&u, &v, 4); return u; }
static inline uint32_t argmax_bits(c10::BFloat16 v) { return static_cast<uint32_t>(v.x) << 16; }
static inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline bool bits_nan(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }
#ifdef __AVX512F__
// 16 elements as fp32 bits (bf16 widened: exact)
static inline __m512i bits16(const float* p) { return _mm512_loadu_si512(p); }
static inline __m512i bits16(const c10::BFloat16* p) {
  return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
}
#endif

template <typename T>
static int64_t argmax_row(const T* x, int64_t V) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
#ifdef __AVX512F__
  __m512 mv = _mm512_set1_ps(m);
  __mmask16 nanm = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512i u = bits16(x + i);
    nanm |= _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
    mv = _mm512_max_ps(mv, _mm512_castsi512_ps(u));
  }
  nan = nanm != 0;
  m = _mm512_reduce_max_ps(mv);
#endif
  for (int64_t j = i; j < V; ++j) {
    const uint32_t u = argmax_bits(x[j]);
    nan |= bits_nan(u);
    m = bits_float(u) > m ? bits_float(u) : m;
  }
  int64_t j = 0;
#ifdef __AVX512F__
  if (!nan) {  // the first lane equal to the max, 16 at a time (+0 and -0 are one max, as torch's > sees them)
    const __m512 mm = _mm512_set1_ps(m);
    for (; j + 16 <= V; j += 16) {
      const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_castsi512_ps(bits16(x + j)), mm, _CMP_EQ_OQ);
      if (eq) return j + __builtin_ctz(static_cast<unsigned>(eq));
    }
  }
#endif
  for (; j < V; ++j) {
    const uint32_t u = argmax_bits(x[j]);
    if (nan ? bits_nan(u) : bits_float(u) == m) return j;
  }
  return 0;  // a row of -inf only: torch returns 0 too
}

at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "argmax_rows: x must be a contiguous float or bf16 [B, V] tensor with V > 0");
  const int64_t B = x.size(0), V = x.size(1);
  auto out = at::empty({B}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const bool f32 = x.scalar_type() == at::kFloat;
  const void* base = x.data_ptr();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      o[b] = f32 ? argmax_row(static_cast<const float*>(base) + b * V, V)
                 : argmax_row(static_cast<const c10::BFloat16*>(base) + b * V, V);
  });
  return out;
}

// ---- K/V store ----------------------------------------------------------------------------------
// k_cache/v_cache [num_blocks, block_size, Hkv, D] (contiguous) <- key/value [T, Hkv, D] at slots [T] (long;
// a negative slot is padding, skipped). One contiguous row (Hkv * D elements) per token, copied in parallel:
// index_copy_ on a bf16 pool took 0.1-0.7 ms per layer and call on a 1024-token step (2-core AMD EPYC).
void store_kv(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 4,
              "store_kv: the caches must be contiguous [num_blocks, block_size, Hkv, D] tensors of one shape");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.size(1) == k_cache.size(2) &&
                  key.size(2) == k_cache.size(3),
              "store_kv: key and value must be [T, Hkv, D] with the caches' Hkv and D");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "store_kv: key, value and the caches must have one dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.size(0) == key.size(0) &&
                  slots.is_contiguous(),
              "store_kv: slots must be a contiguous long [T] tensor");
  const int64_t row = key.size(1) * key.size(2), T = key.size(0);
  const int64_t nslots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2),
              "store_kv: each token's [Hkv, D] rows of key and value must be contiguous");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] < nslots, "store_kv: slot ", sl[t], " is beyond the pool's ", nslots, " slots");
  const int64_t es = key.element_size(), bytes = row * es;
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = key.stride(0) * es, vs = value.stride(0) * es;
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (sl[t] < 0) continue;
      std::memcpy(kc + sl[t] * bytes, kp + t * ks, bytes);
      std::memcpy(vc + sl[t] * bytes, vp + t * vs, bytes);
    }
  });
}

// ---- bf16 linear ---------------------------------------------------------------------------------
// On CPUs with AVX512-BF16 (and a compiler that targets it, -march=native): vdpbf16ps. Elsewhere with AVX2 or
// AVX-512 (the second TileBF16): each weight pair is widened to two fp32 vectors by shifts, exact, and multiplied
// in fp32 with FMAs; the weight is still read as bf16, half the bytes of fp32, which is what decode steps wait
// for. Without either, has_bf16_linear() is false and torch keeps every bf16 linear.

#ifdef __AVX512BF16__
// y[i, n] = sum_k x[i, k] w[n, k]; wp is the weight packed as uint32 [K/2, N]: (w[n][2k], w[n][2k+1]).
// Same 6 x 64 register tile as the fp32 kernel; vdpbf16ps multiplies a pair of k per lane.
// fp32 -> bf16 as torch's vectorized CPU conversion rounds (to nearest, ties to even; a NaN becomes 0xFFFF), 16 lanes;
// NaN_BITS 0x7FC0: as cpu_fused rounds (its vbf16_bits; its vbf16_pack calls this). One vcvtneps2bf16 rounds every
// lane alike except a NaN (it keeps the payload) and an fp32 denormal (flushed to zero): a vector holding one of
// those, or a zero (fpclass 0xA7: under DAZ the class test calls a denormal zero), takes the integer rounding
// (checked on all 2^32 floats with and without DAZ). The gate/up passes round four times per output, the AMX one on
// sums its tiles make fast.
template <int NaN_BITS = 0xFFFF>
static inline __m256i bf16_round16(__m512 v) {
#ifdef __AVX512DQ__
  if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0xA7) == 0, 1)) return (__m256i)_mm512_cvtneps_pbh(v);
#endif
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(NaN_BITS));
  return _mm512_cvtepi32_epi16(r);
}

// SiLU(gate) * up as the fused MLP computes it from the two projections' bf16 outputs (cpu_fused's silu_mul):
// gate and up each rounded to bf16 as linear_bf16 and linear_amx store them, SiLU by an exact division rounded to
// bf16 (a NaN as cpu_fused rounds it, 0x7FC0), the product rounded once more. Returns the product's bf16 bits.
static inline __m512 bf16_as_float16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
static inline __m256i silu_mul16(__m512 gate_sum, __m512 up_sum) {
  const __m512 g = bf16_as_float16(bf16_round16(gate_sum)), u = bf16_as_float16(bf16_round16(up_sum));
  const __m512 e = exp_poly(_mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(-104.f)),
                                          _mm512_set1_ps(100.f)));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), e);
  __m512 q;
  __asm__("vdivps %2, %1, %0" : "=v"(q) : "v"(g), "v"(d));  // exact (-ffast-math may not turn it into rcp)
  return bf16_round16<0x7FC0>(_mm512_mul_ps(bf16_as_float16(bf16_round16<0x7FC0>(q)), u));
}

// SILU: the weight is an MLP's gate and up interleaved by 32 columns (pack_bf16_gate_up), so a 64-column panel holds
// 32 of each and the tile writes SiLU(gate) * up to 32 columns of an output with N / 2 (as silu_mul16 computes it)
template <bool SILU>
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
  static inline void run(const float* __restrict x, const uint32_t* __restrict w, uint16_t* __restrict out,
                         int64_t K2, int64_t ldw, int64_t N, int64_t n0, const float* bias, NextPanel next) {
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
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == 64 && wp.is_contiguous() && wp.scalar_type() == at::kInt &&
                  n % 16 == 0 && n <= wp.size(0) * 64 && n > (wp.size(0) - 1) * 64,
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

// gate, up [I, K] (checked by the caller: one shape, I a multiple of by) -> [2 I, K]: by rows of gate, the same by rows
// of up, and so on (what the gate/up passes pack, so that a block of the output has both halves of its columns)
static at::Tensor interleave_gate_up(const at::Tensor& gate, const at::Tensor& up, int64_t by) {
  const int64_t I = gate.size(0), K = gate.size(1);
  return at::stack({gate.contiguous().view({I / by, by, K}), up.contiguous().view({I / by, by, K})}, 1)
      .view({2 * I, K});
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
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.size(-1) == K,
              "linear_bf16_silu: the input must be bf16 [..., K]");
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

// ---- bf16 linear on AMX tiles ------------------------------------------------------------------
// On CPUs with AMX-BF16 (and a compiler that targets it): a tile multiply (tdpbf16ps) takes a 16 x 32 bf16 block of
// x, a 16-column block of the weight (32 k as 16 rows of pairs) and adds the 16 x 16 fp32 products, 8192
// multiply-adds in one instruction (about 16 cycles). On the 2-core Xeon (model 167) a loop of them ran at 2.0 TFLOPS,
// where oneDNN's bf16 matmul reached 0.6 (torch, 2048^3) and vdpbf16ps would reach about a sixth of it.
// Four accumulators (2 row blocks x 2 column blocks), two x blocks, two weight blocks: the eight tile registers.
// The weight is packed (pack_amx) as int32 [N/16, K/32, 16, 16]: each 16-column block's tiles of 1 KB in k order,
// so a column pair streams 2 K/32 KB from memory; x tiles are read in place (its rows K bf16 apart).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define BATCHERY_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out the tile state only on request (once per process); false where the kernel refuses it
static bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

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
  return w.contiguous().view({N / 16, 16, K / 32, 16, 2}).permute({0, 2, 3, 1, 4}).contiguous()
      .view(at::kInt).view({N / 16, K / 32, 16, 16});
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
"""

_FUNCTIONS = [
    "paged_decode",
    "store_kv",
    "argmax_rows",
    "linear_t",
    "pack_panels",
    "linear_panels",
    "pack_bf16",
    "linear_bf16",
    "has_bf16_linear",
    "pack_bf16_gate_up",
    "linear_bf16_silu",
    "has_bf16_silu",
    "pack_amx",
    "linear_amx",
    "has_amx_linear",
    "pack_amx_gate_up",
    "linear_amx_silu",
]

# Modules whose C++ ``SOURCE`` (exporting ``FUNCTIONS``) is compiled into this extension, in order.
PARTS: tuple[str, ...] = ("batchery.engine.cpu_fused", "batchery.engine.attention.cpu_prefill")


def _parts() -> list[types.ModuleType]:
    return [importlib.import_module(name) for name in PARTS]


def full_source() -> str:
    """Everything compiled: this module's kernels, then each part's."""
    return "\n".join([_SOURCE, *(part.SOURCE for part in _parts())])


def functions() -> list[str]:
    """The names the built module exports."""
    return [*_FUNCTIONS, *(name for part in _parts() for name in part.FUNCTIONS)]


_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]  # without it at::parallel_for runs on one thread

_lock = threading.Lock()
_module: types.ModuleType | None = None
_failed = False


def _built_marker() -> Path:
    """Where the path of the extension built from exactly this source, these flags and this torch is noted.

    Loading the built ``.so`` through ``load_inline`` imports ``torch.utils.cpp_extension`` (setuptools) and
    runs ninja to find it up to date, a few hundred ms of every worker's start; with the note the ``.so`` is
    imported directly. Keyed by everything the build depends on, and the note holds the file's size and mtime,
    so a rebuild in place (another source under the same name) is never taken for this one."""
    import torch

    key = json.dumps(
        [
            NAME,
            full_source(),
            functions(),
            _CFLAGS,
            _LDFLAGS,
            torch.__version__,
            sys.version,
            sys.platform,
            os.environ.get("TORCH_EXTENSIONS_DIR", ""),
        ]
    )
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchery" / "kernels"
    return base / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _load_built(marker: Path) -> types.ModuleType | None:
    try:
        note = json.loads(marker.read_text())
        so = Path(note["so"])
        st = so.stat()
        if [st.st_size, st.st_mtime_ns] != note["stat"] or note["name"] != so.name.split(".")[0]:
            return None
        spec = importlib.util.spec_from_file_location(note["name"], so)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not all(hasattr(module, f) for f in functions()):
            return None
        return module
    except Exception:  # noqa: BLE001 - no note, a stale one, an unloadable file: build as before
        return None


def _note_built(marker: Path, module: types.ModuleType) -> None:
    try:
        so = Path(str(module.__file__))
        st = so.stat()
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"so": str(so), "name": module.__name__, "stat": [st.st_size, st.st_mtime_ns]}))
        os.replace(tmp, marker)
    except (OSError, TypeError, ValueError) as e:  # a read-only home: load through load_inline next time too
        log.debug("could not note the built CPU kernels: %s", e)


def load() -> types.ModuleType | None:
    """The compiled module, or None when it cannot be built here (callers then use torch)."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            if os.environ.get("BATCHERY_CPU_KERNELS", "1") == "0":
                _failed = True
                return None
            marker = _built_marker()
            _module = _load_built(marker)
            if _module is not None:
                return _module
            try:
                from torch.utils.cpp_extension import load_inline

                log.info("building the CPU kernels (first use only, cached afterwards)")
                _module = load_inline(
                    name=NAME,
                    cpp_sources=full_source(),
                    functions=functions(),
                    extra_cflags=list(_CFLAGS),  # load_inline appends to the lists it is given
                    extra_ldflags=list(_LDFLAGS),
                    verbose=False,
                )
                _note_built(marker, _module)
            except Exception as e:  # no compiler, no ninja, ...: the torch paths still work
                _failed = True
                log.warning(
                    "CPU kernels unavailable (%s); using torch", str(e).splitlines()[0] if str(e) else type(e).__name__
                )
    return _module
