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
#include <c10/util/BFloat16.h>
#include <cmath>
#include <vector>

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

template <typename T>
static void decode_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                        const at::Tensor& bt, const at::Tensor& ctx, at::Tensor& out,
                        double scale, int64_t window, double softcap) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = kc.size(1), Hkv = kc.size(2);
  const int64_t G = H / Hkv, maxb = bt.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t tok_stride = Hkv * D;  // one token of one block
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / Hkv, h = idx % Hkv;
      const int64_t n = cp[b];
      const int64_t start = (window > 0 && n - window > 0) ? n - window : 0;
      const int64_t len = n - start;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_f(qp[(b * H + h * G + g) * D + d]);
      scores.assign(G * (len > 0 ? len : 1), 0.f);
      std::vector<float> mx(G, -INFINITY), sum(G, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t pos = start + t;
        const int64_t blk = btp[b * maxb + pos / bs];
        const T* k = kp + (blk * bs + pos % bs) * tok_stride + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qq = &qf[g * D];
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qq[d] * to_f(k[d]);
          s *= (float)scale;
          if (softcap > 0) s = (float)softcap * std::tanh(s / (float)softcap);
          scores[g * len + t] = s;
          if (s > mx[g]) mx[g] = s;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < len; ++t) {
          float p = std::exp(scores[g * len + t] - mx[g]);
          scores[g * len + t] = p;
          sum[g] += p;
        }
      for (int64_t t = 0; t < len; ++t) {
        const int64_t pos = start + t;
        const int64_t blk = btp[b * maxb + pos / bs];
        const T* v = vp + (blk * bs + pos % bs) * tok_stride + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + t];
          float* a = &acc[g * D];
          for (int64_t d = 0; d < D; ++d) a[d] += p * to_f(v[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = sum[g] > 0.f ? 1.f / sum[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) op[(b * H + h * G + g) * D + d] = static_cast<T>(acc[g * D + d] * inv);
      }
    }
  });
}

at::Tensor paged_decode(at::Tensor q, at::Tensor kc, at::Tensor vc, at::Tensor bt, at::Tensor ctx,
                        double scale, int64_t window, double softcap) {
  q = q.contiguous();
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    decode_impl<float>(q, kc, vc, bt, ctx, out, scale, window, softcap);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_impl<c10::BFloat16>(q, kc, vc, bt, ctx, out, scale, window, softcap);
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
                    name="batchery_cpu_paged_v1",
                    cpp_sources=_SOURCE,
                    functions=["paged_decode"],
                    extra_cflags=["-O3", "-march=native", "-ffast-math"],
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
