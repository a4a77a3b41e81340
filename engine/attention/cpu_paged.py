"""Paged decode attention for the CPU, as a small C++ kernel built on first use.

The torch reference has to gather every sequence's KV blocks into a padded copy before SDPA can
read them; at decode time that copy is most of the memory traffic of a step. This kernel reads
K and V straight from the block pool, once, in parallel over (sequence, KV head). It is compiled
with torch's cpp_extension the first time it is needed and cached; if the build fails, the torch
reference path is used instead."""

from __future__ import annotations

import logging
import os
import threading

import torch

log = logging.getLogger("batchery.engine.attention")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <vector>

// Decode attention straight from the paged pool [num_blocks, block_size, Hkv, D].
// A task is one sequence and a group of its KV heads; with enough sequences every task takes all
// heads, so each block (all heads of block_size tokens, contiguous) is read front to back once for
// K and once for V, and the next block is prefetched while this one is used. head_dim is a
// compile-time constant for the common sizes, so the per-head accumulators live in registers.

static inline void to_float(const float* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

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

template <typename T, int DT>
static void decode_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                        const at::Tensor& bt, const at::Tensor& ctx, at::Tensor& out,
                        double scale, int64_t window, double softcap) {
  const int64_t B = q.size(0), H = q.size(1);
  const int64_t D = DT > 0 ? DT : q.size(2);
  const int64_t bs = kc.size(1), Hkv = kc.size(2);
  const int64_t G = H / Hkv, maxb = bt.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t tok_stride = Hkv * D;  // one token of one block: all its KV heads
  const int64_t blk_stride = bs * tok_stride;
  const int64_t blk_bytes = blk_stride * static_cast<int64_t>(sizeof(T));
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const int64_t nthreads = at::get_num_threads();
  const int64_t groups = B >= 4 * nthreads ? 1 : Hkv;
  const int64_t hper = Hkv / groups;
  at::parallel_for(0, B * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), buf(blk_stride), scores, inv(H);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / groups, h0 = (idx % groups) * hper;
      const int64_t hq0 = h0 * G, nq = hper * G;  // this task's query heads
      const int64_t n = cp[b];
      const int64_t start = (window > 0 && n - window > 0) ? n - window : 0;
      const int64_t len = n - start;
      T* dst = op + (b * H + hq0) * D;
      if (len <= 0) {
        for (int64_t i = 0; i < nq * D; ++i) dst[i] = static_cast<T>(0.f);
        continue;
      }
      const T* src = qp + (b * H + hq0) * D;
      for (int64_t i = 0; i < nq * D; ++i) qf[i] = static_cast<float>(src[i]) * fscale;
      scores.resize(nq * len);
      float* sc = scores.data();
      const int64_t* table = btp + b * maxb;
      const int64_t first = start / bs, last = (n - 1) / bs;
      // pass 1: scores[query head][token]
      for (int64_t bi = first, t0 = 0; bi <= last; ++bi) {
        const int64_t lo = bi == first ? start - bi * bs : 0;
        const int64_t hi = bi == last ? n - bi * bs : bs;
        if (bi < last) prefetch_block(kp + table[bi + 1] * blk_stride, blk_bytes);
        const float* rows = block_rows<T>(kp + table[bi] * blk_stride + lo * tok_stride, buf.data(),
                                          (hi - lo) * tok_stride);
        for (int64_t j = 0; j < hi - lo; ++j) {
          const float* row = rows + j * tok_stride;
          for (int64_t qi = 0; qi < nq; ++qi) {
            const float* __restrict k = row + (h0 + qi / G) * D;
            const float* __restrict qq = &qf[qi * D];
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) s += qq[d] * k[d];
            sc[qi * len + t0 + j] = s;
          }
        }
        t0 += hi - lo;
      }
      // softmax per query head, over contiguous scores
      for (int64_t qi = 0; qi < nq; ++qi) {
        float* s = sc + qi * len;
        if (cap > 0.f)
          for (int64_t i = 0; i < len; ++i) s[i] = cap * std::tanh(s[i] / cap);
        float mx = -INFINITY;
        for (int64_t i = 0; i < len; ++i) mx = s[i] > mx ? s[i] : mx;
        float sum = 0.f;
        for (int64_t i = 0; i < len; ++i) {
          s[i] = std::exp(s[i] - mx);
          sum += s[i];
        }
        inv[qi] = sum > 0.f ? 1.f / sum : 0.f;
      }
      // pass 2: out[query head] = sum over tokens of p * V, a block at a time
      std::fill(acc.begin(), acc.begin() + nq * D, 0.f);
      for (int64_t bi = first, t0 = 0; bi <= last; ++bi) {
        const int64_t lo = bi == first ? start - bi * bs : 0;
        const int64_t hi = bi == last ? n - bi * bs : bs;
        if (bi < last) prefetch_block(vp + table[bi + 1] * blk_stride, blk_bytes);
        const float* rows = block_rows<T>(vp + table[bi] * blk_stride + lo * tok_stride, buf.data(),
                                          (hi - lo) * tok_stride);
        for (int64_t qi = 0; qi < nq; ++qi) {
          const float* p = sc + qi * len + t0;
          const float* vh = rows + (h0 + qi / G) * D;
          float a[DT > 0 ? DT : 1];
          float* __restrict ap = DT > 0 ? a : &acc[qi * D];
          if (DT > 0)
            for (int64_t d = 0; d < D; ++d) ap[d] = acc[qi * D + d];
          for (int64_t j = 0; j < hi - lo; ++j) {
            const float pj = p[j];
            const float* __restrict v = vh + j * tok_stride;
            for (int64_t d = 0; d < D; ++d) ap[d] += pj * v[d];
          }
          if (DT > 0)
            for (int64_t d = 0; d < D; ++d) acc[qi * D + d] = ap[d];
        }
        t0 += hi - lo;
      }
      for (int64_t qi = 0; qi < nq; ++qi)
        for (int64_t d = 0; d < D; ++d) dst[qi * D + d] = static_cast<T>(acc[qi * D + d] * inv[qi]);
    }
  });
}

template <typename T>
static void decode_dispatch(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& bt,
                            const at::Tensor& ctx, at::Tensor& out, double scale, int64_t window, double softcap) {
  switch (q.size(2)) {
    case 64: decode_impl<T, 64>(q, kc, vc, bt, ctx, out, scale, window, softcap); break;
    case 128: decode_impl<T, 128>(q, kc, vc, bt, ctx, out, scale, window, softcap); break;
    default: decode_impl<T, 0>(q, kc, vc, bt, ctx, out, scale, window, softcap);
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
"""

_lock = threading.Lock()
_module = None
_failed = False


def load():
    """The compiled module, or None when it cannot be built here (then the torch path is used)."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            if os.environ.get("BATCHERY_CPU_KERNELS", "1") == "0":
                _failed = True
                return None
            try:
                from torch.utils.cpp_extension import load_inline

                log.info("building the CPU paged-attention kernel (first use only, cached afterwards)")
                _module = load_inline(
                    name="batchery_cpu_paged_v5",
                    cpp_sources=_SOURCE,
                    functions=["paged_decode"],
                    extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
            except Exception as e:  # no compiler, no ninja, ...: the torch reference still works
                _failed = True
                log.warning("CPU paged-attention kernel unavailable (%s); using the torch gather path",
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
    return _module


def supports_dtype(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.bfloat16)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, sliding_window: int | None,
                 softcap: float | None) -> torch.Tensor:
    """q: [B, H, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] long;
    context_lens [B] long. Returns [B, H, D]."""
    return load().paged_decode(q, k_cache, v_cache, block_tables, context_lens, float(scale),
                               int(sliding_window or 0), float(softcap or 0.0))
