#include "amx.h"
#include "bf16.h"
#include "kernels.h"
#include "vec_math.h"

// ---- prefill attention over the paged pool ---------------------------------------------------
// Flash-style causal attention for all of a step's prefill chunks in one call. Two passes:
//  1. pack: each (sequence, KV head) context is copied once, in tiles of 64 keys, into the layouts
//     the register tiles read: K transposed ([D][64], keys in the vector lanes) and V by rows
//     ([64][D]); for bf16 with AVX512-BF16 both hold pairs of bf16 in each 32-bit lane, pairs along
//     the dot product's k (K: two dims of one key, V: one dim of two keys), as vdpbf16ps reads them.
//  2. attend: a task is (sequence, KV head, a tile of query tokens); its rows are every query head
//     of that KV head at every token of the tile (GQA: one K/V tile serves them all). For each block
//     of 6 rows and each 64-key tile: S = Q K^T in a 6 x 64 register tile, an online softmax with
//     fp32 running max / sum, then O += P V in 6 x 64 register tiles, fp32 accumulators. Keys are
//     visited in chunks of 8 tiles (all row blocks pass over a chunk while it is in L2).
// Tasks differ in cost (causal), so they run largest first from a shared counter.
// Not causal (an encoder's packed inputs, each a chunk of its own with nothing cached): every query of a chunk
// sees all of its keys; a query row's sums are the same whatever else shares the call (rows never mix, keys are
// visited in the same order), so an input gives the same bits alone and in a full step.

namespace batchery_prefill {

std::atomic<bool> g_use_amx{true};  // tests turn the AMX attend pass off to compare it with the vdpbf16ps one

bool available() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

bool native_bf16() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#ifdef __AVX512F__
constexpr int TK = 64;     // keys per tile
constexpr int MR = 6;      // query rows per register tile
constexpr int CHUNK = 8;   // tiles per key chunk

// r[i] lane j <- r[j] lane i (16 x 16 of 32-bit elements)
static inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c], 128-bit lane L: column 4L + c of rows 4i .. 4i + 3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i x2 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE), x3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, x1, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x0, x1, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x2, x3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x2, x3, 0xDD);
  }
}

// 16 32-bit units of a row from unit c: BF (bf16 pairs): the raw pairs; else floats (bf16 widened).
template <typename T, bool BF>
static inline __m512i load_units(const T* row, int64_t c);
template <>
inline __m512i load_units<float, false>(const float* row, int64_t c) {
  return _mm512_loadu_si512(row + c);
}
template <>
inline __m512i load_units<c10::BFloat16, false>(const c10::BFloat16* row, int64_t c) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
  return _mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16);
}
template <>
inline __m512i load_units<c10::BFloat16, true>(const c10::BFloat16* row, int64_t c) {
  return _mm512_loadu_si512(row + 2 * c);
}

template <typename T>
struct Args {
  int64_t S, H, Hkv, G, D, bs, maxb, window;
  bool causal;
  int64_t qs_t, qs_h, ks_t, ks_h, vs_t, vs_h, os_t, os_h;
  const T *q, *k, *v, *kc, *vc;
  T* out;
  const int64_t *seqs, *tables;  // seqs [S, 4]: q_start, q_len, context_len, table row (-1: keys are k, v)
  float scale;
};

// where a sequence's packed tiles start, and the first tile it needs
struct SeqPack {
  int64_t base, t0, nt;  // in tiles; its KV head h's tile t sits at base + h * nt + (t - t0)
};

// Pack tile t of (s, h): kt [C][64] (K transposed), vp: BF [32][D] pairs of keys, else [64][D] floats.
// kr, vr: the tile's key rows of head h (null past the context).
template <typename T, bool BF>
static void pack_tile(const Args<T>& a, const T* const* kr, const T* const* vr, uint32_t* kt, uint32_t* vp) {
  const int64_t D = a.D, C = BF ? D / 2 : D;
  __m512i r[16];
  for (int j0 = 0; j0 < TK; j0 += 16) {
    for (int64_t c0 = 0; c0 < C; c0 += 16) {
      for (int i = 0; i < 16; ++i) r[i] = kr[j0 + i] ? load_units<T, BF>(kr[j0 + i], c0) : _mm512_setzero_si512();
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kt + (c0 + i) * TK + j0, r[i]);
    }
  }
  if (BF) {
    // element 2d of a pair row is key 2j's dim d, element 2d + 1 key 2j + 1's
    alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i ilo = _mm512_load_si512(lo_idx), ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
    for (int j2 = 0; j2 < TK / 2; ++j2) {
      const T* ra = vr[2 * j2];
      const T* rb = vr[2 * j2 + 1];
      for (int64_t d0 = 0; d0 < D; d0 += 32) {
        const __m512i x = ra ? _mm512_loadu_si512(ra + d0) : _mm512_setzero_si512();
        const __m512i y = rb ? _mm512_loadu_si512(rb + d0) : _mm512_setzero_si512();
        _mm512_storeu_si512(vp + j2 * D + d0, _mm512_permutex2var_epi16(x, ilo, y));
        _mm512_storeu_si512(vp + j2 * D + d0 + 16, _mm512_permutex2var_epi16(x, ihi, y));
      }
    }
  } else {
    for (int j = 0; j < TK; ++j)
      for (int64_t d0 = 0; d0 < D; d0 += 16)
        _mm512_storeu_si512(vp + j * D + d0, vr[j] ? load_units<T, false>(vr[j], d0) : _mm512_setzero_si512());
  }
}

// S [6][64] = Q [6][C] . KT [C][64] for the first 16 * NVK keys
template <bool BF, int NVK>
static inline void qk_tile(const uint32_t* __restrict q, const uint32_t* __restrict kt, float* __restrict s,
                           int64_t C) {
  __m512 acc[MR][NVK];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NVK; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    __m512i kv[NVK];
#pragma GCC unroll 4
    for (int v = 0; v < NVK; ++v) kv[v] = _mm512_loadu_si512(kt + c * TK + 16 * v);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512i qb = _mm512_set1_epi32(static_cast<int>(q[i * C + c]));
#pragma GCC unroll 4
      for (int v = 0; v < NVK; ++v) {
#ifdef __AVX512BF16__
        if (BF) {
          acc[i][v] = _mm512_dpbf16_ps(acc[i][v], (__m512bh)qb, (__m512bh)kv[v]);
          continue;
        }
#endif
        acc[i][v] = _mm512_fmadd_ps(_mm512_castsi512_ps(qb), _mm512_castsi512_ps(kv[v]), acc[i][v]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NVK; ++v) _mm512_storeu_ps(s + i * TK + 16 * v, acc[i][v]);
}

// O [6][16 * NV] (row stride D) = O * alpha + P [6][keys] . V [keys][16 * NV], keys = 2 * npairs (BF) or npairs
template <bool BF, int NV>
static inline void pv_tile(const uint32_t* __restrict p, const uint32_t* __restrict vp, float* __restrict o,
                           const float* alpha, int64_t D, int64_t n) {
  constexpr int PS = BF ? TK / 2 : TK;  // P row stride in 32-bit units
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m512 al = _mm512_set1_ps(alpha[i]);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_mul_ps(_mm512_loadu_ps(o + i * D + 16 * v), al);
  }
  for (int64_t j = 0; j < n; ++j) {
    __m512i vv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vv[v] = _mm512_loadu_si512(vp + j * D + 16 * v);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512i pb = _mm512_set1_epi32(static_cast<int>(p[i * PS + j]));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
#ifdef __AVX512BF16__
        if (BF) {
          acc[i][v] = _mm512_dpbf16_ps(acc[i][v], (__m512bh)pb, (__m512bh)vv[v]);
          continue;
        }
#endif
        acc[i][v] = _mm512_fmadd_ps(_mm512_castsi512_ps(pb), _mm512_castsi512_ps(vv[v]), acc[i][v]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o + i * D + 16 * v, acc[i][v]);
}

template <bool BF>
static inline void qk_dispatch(int nvk, const uint32_t* q, const uint32_t* kt, float* s, int64_t C) {
  switch (nvk) {
    case 4: qk_tile<BF, 4>(q, kt, s, C); break;
    case 3: qk_tile<BF, 3>(q, kt, s, C); break;
    case 2: qk_tile<BF, 2>(q, kt, s, C); break;
    default: qk_tile<BF, 1>(q, kt, s, C);
  }
}

struct Task {
  int64_t s, h, i0, i1;  // sequence, KV head, its query tokens i0 .. i1 (of the chunk)
  double cost;
};

// A task's query rows (token-major, then the query heads of its KV head) into qbuf, padded with zero rows to Rp;
// each row's position (-1: padding) and the first key its window lets it see; o, m, l reset.
template <typename T, bool BF>
static void task_rows(const Args<T>& a, const Task& task, int64_t R, int64_t Rp, uint32_t* qbuf, int64_t* qpos,
                      int64_t* wlo, float* o, float* m, float* l) {
  const int64_t D = a.D, C = BF ? D / 2 : D, G = a.G;
  const int64_t* sq = a.seqs + 4 * task.s;
  const int64_t q_start = sq[0], q_len = sq[1], ctx = sq[2];
  for (int64_t r = 0; r < Rp; ++r) {
    uint32_t* qr = qbuf + r * C;
    if (r >= R) {
      std::fill(qr, qr + C, 0u);
      qpos[r] = -1;
      wlo[r] = 0;
      continue;
    }
    const int64_t i = task.i0 + r / G, hq = task.h * G + r % G;
    const T* src = a.q + (q_start + i) * a.qs_t + hq * a.qs_h;
    if (BF) {
      std::memcpy(qr, src, C * sizeof(uint32_t));
    } else {
      float* f = reinterpret_cast<float*>(qr);
      for (int64_t d = 0; d < D; ++d) f[d] = static_cast<float>(src[d]);
    }
    const int64_t pos = a.causal ? ctx - q_len + i : ctx - 1;  // not causal: it sees every key
    qpos[r] = pos;
    wlo[r] = a.window > 0 && pos - a.window + 1 > 0 ? pos - a.window + 1 : 0;
  }
  std::fill(o, o + Rp * D, 0.f);
  std::fill(m, m + Rp, -INFINITY);
  std::fill(l, l + Rp, 0.f);
}

// One row's online-softmax step over a key tile: its scores srow (the tile's first 16 * nvk keys from kbase) scaled,
// masked to the keys the row sees (up to qp, from wl), folded into its running max m and sum l; the probabilities go
// to prow (BF: bf16 pairs, the 32-key halves the tile touches; else floats) and alpha is the factor by which the
// row's accumulated output must be scaled.
template <bool BF>
static inline void softmax_row(const float* srow, uint32_t* prow, int64_t kbase, int nvk, int64_t qp, int64_t wl,
                               float scale, float& m, float& l, float& alpha) {
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 sv[4];
  __mmask16 valid[4];
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (int v = 0; v < nvk; ++v) {
    const __m512i kp = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int>(kbase + 16 * v)));
    valid[v] = _mm512_cmple_epi32_mask(kp, _mm512_set1_epi32(static_cast<int>(qp))) &
               _mm512_cmpge_epi32_mask(kp, _mm512_set1_epi32(static_cast<int>(wl)));
    sv[v] = _mm512_mul_ps(_mm512_loadu_ps(srow + 16 * v), _mm512_set1_ps(scale));
    vm = _mm512_mask_max_ps(vm, valid[v], vm, sv[v]);
  }
  const float m_old = m, m_new = std::max(m_old, _mm512_reduce_max_ps(vm));
  if (m_new == -INFINITY) {  // nothing to attend in this tile (a padding row, or before its window)
    alpha = 1.f;
    std::memset(prow, 0, (BF ? TK / 2 : TK) * sizeof(uint32_t));
    return;
  }
  alpha = std::exp(m_old - m_new);
  m = m_new;
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  __m512 pv[4];
  for (int v = 0; v < nvk; ++v) {
    pv[v] = _mm512_maskz_mov_ps(valid[v], ::exp16(_mm512_sub_ps(sv[v], mv)));
    sum = _mm512_add_ps(sum, pv[v]);
  }
  l = l * alpha + _mm512_reduce_add_ps(sum);
  if (BF) {
#ifdef __AVX512BF16__
    for (int v = 0; v < nvk; v += 2) {  // a half's second 16 keys are 0 where the tile ends inside it
      const __m512 hi2 = v + 1 < nvk ? pv[v + 1] : _mm512_setzero_ps();
      _mm512_storeu_si512(prow + 8 * v, (__m512i)_mm512_cvtne2ps_pbh(hi2, pv[v]));
    }
#endif
  } else {
    for (int v = 0; v < nvk; ++v) _mm512_storeu_ps(reinterpret_cast<float*>(prow) + 16 * v, pv[v]);
  }
}

// Not causal, all of a chunk's n keys at once (at most FULL_TILES tiles): one row's exact softmax, two passes over its
// scores (the max, then exp and the sum) instead of a running max and rescale per key tile. s: the row's scores, tile t
// at s + t * s_tile; p: its probabilities (BF: bf16 pairs, else floats) in the layout softmax_row writes, tile t at
// p + t * p_tile, zero past the n keys in the last tile's 16-key vectors. Returns the row's sum of probabilities.
constexpr int64_t FULL_TILES = 16;  // up to 1,024 keys: longer chunks keep the online softmax
template <bool BF>
static inline float softmax_full_row(const float* s, uint32_t* p, int64_t s_tile, int64_t p_tile, int64_t n,
                                     float scale) {
  const int64_t nv = (n + 15) / 16;
  const auto mask_of = [&](int64_t v) -> __mmask16 {
    const int64_t left = n - 16 * v;
    return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
  };
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (int64_t v = 0; v < nv; ++v)
    vm = _mm512_mask_max_ps(vm, mask_of(v), vm, _mm512_loadu_ps(s + (v / 4) * s_tile + 16 * (v % 4)));
  const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(vm) * scale), sc = _mm512_set1_ps(scale);  // scale > 0
  __m512 sum = _mm512_setzero_ps();
  for (int64_t v = 0; v < nv; v += 2) {  // two 16-key vectors: one zmm of bf16 pairs
    const float* src = s + (v / 4) * s_tile + 16 * (v % 4);
    const __m512 e0 = _mm512_maskz_mov_ps(mask_of(v), ::exp16(_mm512_fmsub_ps(_mm512_loadu_ps(src), sc, mv)));
    const __m512 e1 =
        v + 1 < nv ? _mm512_maskz_mov_ps(mask_of(v + 1), ::exp16(_mm512_fmsub_ps(_mm512_loadu_ps(src + 16), sc, mv)))
                   : _mm512_setzero_ps();
    sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
    uint32_t* dst = p + (v / 4) * p_tile;
    if (BF) {
#ifdef __AVX512BF16__
      _mm512_storeu_si512(dst + 8 * (v % 4), (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
#endif
    } else {
      _mm512_storeu_ps(reinterpret_cast<float*>(dst) + 16 * (v % 4), e0);
      _mm512_storeu_ps(reinterpret_cast<float*>(dst) + 16 * (v % 4) + 16, e1);
    }
  }
  return _mm512_reduce_add_ps(sum);
}

// The key tiles t0 .. t1 - 1 of the chunk [c0, c1) that a block of n rows sees (a padding row's qpos is -1), and
// hi, one past the last key any of them sees
static inline void block_tiles(const int64_t* qpos, const int64_t* wlo, int n, int64_t c0, int64_t c1, int64_t& t0,
                               int64_t& t1, int64_t& hi) {
  int64_t lo = INT64_MAX;
  hi = -1;
  for (int i = 0; i < n; ++i)
    if (qpos[i] >= 0) {
      hi = std::max(hi, qpos[i] + 1);
      lo = std::min(lo, wlo[i]);
    }
  t0 = std::max(c0, lo / TK);
  t1 = std::min(c1, (hi - 1) / TK + 1);
}

// A task's R output rows: o / l in the model dtype
template <typename T>
static void write_rows(const Args<T>& a, const Task& task, int64_t R, const float* obuf, const float* lbuf) {
  const int64_t D = a.D, G = a.G, q_start = a.seqs[4 * task.s];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = task.i0 + r / G, hq = task.h * G + r % G;
    T* dst = a.out + (q_start + i) * a.os_t + hq * a.os_h;
    const float inv = lbuf[r] > 0.f ? 1.f / lbuf[r] : 0.f;
    const float* o = obuf + r * D;
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(inv)));
    } else {
#ifdef __AVX512BF16__
      for (int64_t d = 0; d < D; d += 16)  // c10::BFloat16's rounding (to nearest even, a NaN 0x7FC0), 16 lanes
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                            bf16_round16<0x7FC0>(_mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(inv))));
#else
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d] * inv);
#endif
    }
  }
}

#ifdef BATCHERY_AMX
// On AMX tiles (bf16 on CPUs with AMX-BF16) the attend pass takes blocks of 16 query rows and both products run
// on tiles. S = Q K^T: A tiles are 16 rows of q (32 dims each, read in place from the task's rows), B tiles 16
// pairs of dims x 16 keys straight from the packed K tile ([D/2][64] pairs: its rows are 256 bytes apart); the
// four 16 x 16 sums of a 64-key tile go to sbuf. O += P V: A tiles are P (bf16, 32 keys a row), B tiles 16 key
// pairs x 16 dims of the packed V tile ([32][D] pairs); the products go to a buffer and O = O * alpha + P V is
// one vector pass. Every tile is 16 rows of 64 bytes: one configuration for the whole pass.
static inline void amx_configure_16() {
  AmxConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// S [16][64] = 16 query rows qr (C pairs each) . the first 16 * nvk keys of a packed K tile: tiles 0-3 the four
// 16-key blocks, 4 the q rows, 5 the keys
static inline void amx_qk(const uint32_t* qr, const uint32_t* kt, float* sbuf, int64_t C, int nvk) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kc = 0; kc < C; kc += 16) {
    _tile_loadd(4, qr + kc, C * 4);
    _tile_loadd(5, kt + kc * TK, TK * 4);
    _tile_dpbf16ps(0, 4, 5);
    if (nvk > 1) {
      _tile_loadd(5, kt + kc * TK + 16, TK * 4);
      _tile_dpbf16ps(1, 4, 5);
    }
    if (nvk > 2) {
      _tile_loadd(5, kt + kc * TK + 32, TK * 4);
      _tile_dpbf16ps(2, 4, 5);
    }
    if (nvk > 3) {
      _tile_loadd(5, kt + kc * TK + 48, TK * 4);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, sbuf, TK * 4);
  _tile_stored(1, sbuf + 16, TK * 4);
  _tile_stored(2, sbuf + 32, TK * 4);
  _tile_stored(3, sbuf + 48, TK * 4);
}

// dims 16B .. 16B + 15 of P V (P in tiles 4 and 6; halves: 1 or 2 blocks of 32 keys) into pv [16][64] at 16B.
// A macro: the tile intrinsics take their tile numbers as literal text.
#define BATCHERY_PV_BLOCK(B, vp, D, halves, pv)            \
  do {                                                     \
    _tile_zero(B);                                         \
    _tile_loadd(5, (vp) + 16 * (B), (D) * 4);              \
    _tile_dpbf16ps(B, 4, 5);                               \
    if ((halves) > 1) {                                    \
      _tile_loadd(7, (vp) + 16 * (D) + 16 * (B), (D) * 4); \
      _tile_dpbf16ps(B, 6, 7);                             \
    }                                                      \
    _tile_stored(B, (pv) + 16 * (B), 64 * 4);              \
  } while (0)

// O [16][D] (row stride D) = O * alpha + P [16][keys] . V, the keys the first 16 * nvk of a packed V tile;
// pv: a 64-byte aligned [16][64] float buffer
static inline void amx_pv(const uint32_t* pbuf, const uint32_t* vp, float* o, const float* alpha, float* pv, int64_t D,
                          int nvk) {
  const int halves = nvk > 2 ? 2 : 1;  // 32 keys each
  _tile_loadd(4, pbuf, TK * 2);
  if (halves > 1) _tile_loadd(6, pbuf + 16, TK * 2);
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int nd = static_cast<int>(std::min<int64_t>(64, D - d0) / 16);
    BATCHERY_PV_BLOCK(0, vp + d0, D, halves, pv);
    if (nd > 1) BATCHERY_PV_BLOCK(1, vp + d0, D, halves, pv);
    if (nd > 2) BATCHERY_PV_BLOCK(2, vp + d0, D, halves, pv);
    if (nd > 3) BATCHERY_PV_BLOCK(3, vp + d0, D, halves, pv);
    for (int i = 0; i < 16; ++i) {
      const __m512 al = _mm512_set1_ps(alpha[i]);
      float* orow = o + i * D + d0;
      const float* prow = pv + i * 64;
      for (int b = 0; b < nd; ++b)
        _mm512_storeu_ps(orow + 16 * b,
                         _mm512_fmadd_ps(_mm512_loadu_ps(orow + 16 * b), al, _mm512_load_ps(prow + 16 * b)));
    }
  }
}
#endif

// S [RB][64] = a row block's queries qr . the first 16 * nvk keys of a packed K tile: on AMX tiles (RB 16) or in
// vector registers (RB MR)
template <bool BF, bool AMX>
static inline void qk_block(const uint32_t* qr, const uint32_t* kt, float* s, int64_t C, int nvk) {
#ifdef BATCHERY_AMX
  if constexpr (AMX) amx_qk(qr, kt, s, C, nvk);
#endif
  if constexpr (!AMX) qk_dispatch<BF>(nvk, qr, kt, s, C);
}

// O [RB][D] = O * alpha + P [RB][keys] . V, the keys the first 16 * nvk of a packed V tile; pv: amx_pv's buffer
template <bool BF, bool AMX>
static inline void pv_block(const uint32_t* p, const uint32_t* vp, float* o, const float* alpha, float* pv, int64_t D,
                            int nvk) {
#ifdef BATCHERY_AMX
  if constexpr (AMX) amx_pv(p, vp, o, alpha, pv, D, nvk);
#endif
  if constexpr (!AMX) {
    (void)pv;
    const int64_t nk = BF ? nvk * 8 : nvk * 16;
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) pv_tile<BF, 4>(p, vp + d0, o + d0, alpha, D, nk);
    if (d0 < D) pv_tile<BF, 2>(p, vp + d0, o + d0, alpha, D, nk);
  }
}

// AMX: the products on tiles, 16 query rows a block (BF only, where BATCHERY_AMX is built); else MR rows a block
// in vector registers
template <typename T, bool BF, bool AMX>
static void attend(const Args<T>& a, const std::vector<SeqPack>& packs, const uint32_t* kbuf, const uint32_t* vbuf,
                   const std::vector<Task>& tasks, int64_t max_rows) {
  constexpr int RB = AMX ? 16 : MR;  // query rows per block
  const int64_t D = a.D, C = BF ? D / 2 : D, G = a.G, tile_units = TK * C;
  std::atomic<int64_t> next{0};
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  const int nthreads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), ntasks));
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
#ifdef BATCHERY_AMX
    if constexpr (AMX) amx_configure_16();
#endif
    const int64_t rpad = (max_rows + RB - 1) / RB * RB;
    std::vector<uint32_t> qbuf(rpad * C);
    std::vector<float> obuf(rpad * D), mbuf(rpad), lbuf(rpad), pvbuf(AMX ? 16 * 64 + 16 : 0);
    std::vector<int64_t> qposbuf(rpad), wlobuf(rpad);
    alignas(64) float sbuf[RB * TK];
    alignas(64) uint32_t pbuf[RB * TK];
    float alpha[RB], ones[RB];
    std::fill(ones, ones + RB, 1.f);
    constexpr int64_t PS = BF ? TK / 2 : TK;  // a probability row of a key tile, in 32-bit units
    // not causal: a row block's scores and probabilities over every key tile of its chunk (softmax_full_row)
    std::vector<float> sfull(a.causal ? 0 : FULL_TILES * RB * TK + 16);
    std::vector<uint32_t> pfull(a.causal ? 0 : FULL_TILES * RB * PS + 16);
    float* sf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sfull.data()) + 63) & ~uintptr_t(63));
    uint32_t* pf = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(pfull.data()) + 63) & ~uintptr_t(63));
    float* pv = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(pvbuf.data()) + 63) & ~uintptr_t(63));
    for (int64_t ti; (ti = next.fetch_add(1)) < ntasks;) {
      const Task& task = tasks[ti];
      const int64_t* sq = a.seqs + 4 * task.s;
      const int64_t q_len = sq[1], ctx = sq[2];
      const int64_t R = (task.i1 - task.i0) * G, Rp = (R + RB - 1) / RB * RB;
      const SeqPack& sp = packs[task.s];
      const uint32_t* kt0 = kbuf + (sp.base + task.h * sp.nt) * tile_units;
      const uint32_t* vp0 = vbuf + (sp.base + task.h * sp.nt) * tile_units;
      task_rows<T, BF>(a, task, R, Rp, qbuf.data(), qposbuf.data(), wlobuf.data(), obuf.data(), mbuf.data(),
                       lbuf.data());
      if (!a.causal && (ctx + TK - 1) / TK <= FULL_TILES) {  // every row sees all ctx keys: exact softmax
        const int64_t nt = (ctx + TK - 1) / TK;
        const auto tile_nvk = [&](int64_t t) {
          return static_cast<int>(std::min<int64_t>(TK, ctx - t * TK) + 15) / 16;
        };
        for (int64_t r0 = 0; r0 < R; r0 += RB) {
          const uint32_t* qr = qbuf.data() + r0 * C;
          float* o = obuf.data() + r0 * D;
          for (int64_t t = 0; t < nt; ++t)
            qk_block<BF, AMX>(qr, kt0 + t * tile_units, sf + t * RB * TK, C, tile_nvk(t));
          for (int i = 0; i < RB; ++i)
            lbuf[r0 + i] = softmax_full_row<BF>(sf + i * TK, pf + i * PS, RB * TK, RB * PS, ctx, a.scale);
          for (int64_t t = 0; t < nt; ++t)
            pv_block<BF, AMX>(pf + t * RB * PS, vp0 + t * tile_units, o, ones, pv, D, tile_nvk(t));
        }
        write_rows(a, task, R, obuf.data(), lbuf.data());
        continue;
      }
      // keys this task needs: tiles tlo .. thi - 1
      const int64_t first_lo = wlobuf[0], last_pos = a.causal ? ctx - q_len + task.i1 - 1 : ctx - 1;
      const int64_t tlo = first_lo / TK, thi = last_pos / TK + 1;
      for (int64_t c0 = tlo; c0 < thi; c0 += CHUNK) {
        const int64_t c1 = std::min(thi, c0 + CHUNK);
        for (int64_t r0 = 0; r0 < R; r0 += RB) {
          int64_t t0, t1, hi;
          block_tiles(qposbuf.data() + r0, wlobuf.data() + r0, RB, c0, c1, t0, t1, hi);
          const uint32_t* qr = qbuf.data() + r0 * C;
          for (int64_t t = t0; t < t1; ++t) {
            const int64_t kbase = t * TK;
            const int nvk = static_cast<int>(std::min<int64_t>(TK, hi - kbase) + 15) / 16;
            const uint32_t* kt = kt0 + (t - sp.t0) * tile_units;
            const uint32_t* vp = vp0 + (t - sp.t0) * tile_units;
            qk_block<BF, AMX>(qr, kt, sbuf, C, nvk);
            for (int i = 0; i < RB; ++i)  // online softmax, row by row
              softmax_row<BF>(sbuf + i * TK, pbuf + i * PS, kbase, nvk, qposbuf[r0 + i], wlobuf[r0 + i], a.scale,
                              mbuf[r0 + i], lbuf[r0 + i], alpha[i]);
            pv_block<BF, AMX>(pbuf, vp, obuf.data() + r0 * D, alpha, pv, D, nvk);
          }
        }
      }
      write_rows(a, task, R, obuf.data(), lbuf.data());
    }
#ifdef BATCHERY_AMX
    if constexpr (AMX) _tile_release();
#endif
  });
}

template <typename T, bool BF>
static void run(const Args<T>& a) {
  // pass 1: pack every (sequence, KV head)'s tiles from the first one its chunk's queries can see
  std::vector<SeqPack> packs(a.S);
  int64_t total = 0;
  for (int64_t s = 0; s < a.S; ++s) {
    const int64_t* sq = a.seqs + 4 * s;
    const int64_t ctx = sq[2], first = ctx - sq[1];
    const int64_t lo = a.window > 0 && first - a.window + 1 > 0 ? first - a.window + 1 : 0;
    packs[s].t0 = lo / TK;
    packs[s].nt = (ctx + TK - 1) / TK - packs[s].t0;
    packs[s].base = total;
    total += packs[s].nt * a.Hkv;
  }
  const int64_t C = BF ? a.D / 2 : a.D, tile_units = TK * C;
  // the packed tiles, in buffers kept per calling thread and grown to the largest step: a fresh allocation of this size
  // is mapped anew and page-faulted in on every layer's call (several MB a call; a sixth of an encoder layer's time)
  thread_local std::vector<uint32_t> kbuf, vbuf;
  if (kbuf.size() < static_cast<size_t>(total * tile_units)) {
    kbuf.assign(total * tile_units, 0u);
    vbuf.assign(total * tile_units, 0u);
  }
  uint32_t* kb = kbuf.data();
  uint32_t* vb = vbuf.data();
  // one pack task per (sequence, tile), all its KV heads: the rows of a tile are read front to back
  std::vector<int64_t> seq_of, tile_of;
  for (int64_t s = 0; s < a.S; ++s)
    for (int64_t t = 0; t < packs[s].nt; ++t) seq_of.push_back(s), tile_of.push_back(packs[s].t0 + t);
  at::parallel_for(0, static_cast<int64_t>(seq_of.size()), 1, [&](int64_t b, int64_t e) {
    const T* kr[TK];
    const T* vr[TK];
    int64_t koff[TK], voff[TK];
    for (int64_t x = b; x < e; ++x) {
      const int64_t s = seq_of[x], t = tile_of[x];
      const int64_t* sq = a.seqs + 4 * s;
      const int64_t n = std::min<int64_t>(TK, sq[2] - t * TK);  // keys of this tile in the context
      if (sq[3] < 0) {  // nothing cached: the chunk's own new K/V
        for (int64_t j = 0; j < n; ++j) {
          koff[j] = (sq[0] + t * TK + j) * a.ks_t;
          voff[j] = (sq[0] + t * TK + j) * a.vs_t;
        }
      } else {
        const int64_t* table = a.tables + sq[3] * a.maxb;
        for (int64_t j = 0, p = t * TK, blk = p / a.bs, off = p % a.bs; j < n; ++j) {
          koff[j] = voff[j] = (table[blk] * a.bs + off) * a.Hkv * a.D;
          if (++off == a.bs) off = 0, ++blk;
        }
      }
      for (int64_t h = 0; h < a.Hkv; ++h) {
        const T* kbase = sq[3] < 0 ? a.k + h * a.ks_h : a.kc + h * a.D;
        const T* vbase = sq[3] < 0 ? a.v + h * a.vs_h : a.vc + h * a.D;
        for (int64_t j = 0; j < TK; ++j) {
          kr[j] = j < n ? kbase + koff[j] : nullptr;
          vr[j] = j < n ? vbase + voff[j] : nullptr;
        }
        const int64_t idx = packs[s].base + h * packs[s].nt + (t - packs[s].t0);
        pack_tile<T, BF>(a, kr, vr, kb + idx * tile_units, vb + idx * tile_units);
      }
    }
  });
  // pass 2: tasks of (sequence, KV head, query tile), small enough tiles that all threads have work. A tile is a
  // whole number of the attend pass's row blocks (AMX: 2 x 16 rows; vdpbf16ps / fp32: 6 x 6), so only a sequence's
  // last tile pads rows: with 32-row tiles of 6-row blocks every tile computed 36 rows for 32 (encoder inputs of
  // 10-200 words: 1-6 tiles each)
  bool amx = false;
#ifdef BATCHERY_AMX
  amx = BF && g_use_amx.load(std::memory_order_relaxed) && amx_permitted();
#endif
  const int64_t nthreads = at::get_num_threads();
  int64_t qt = amx ? 32 : 6 * MR;
  auto count = [&](int64_t m) {
    int64_t n = 0;
    for (int64_t s = 0; s < a.S; ++s) n += (a.seqs[4 * s + 1] + m - 1) / m * a.Hkv;
    return n;
  };
  while (qt > 8 && count(qt) < 4 * nthreads) qt /= 2;
  std::vector<Task> tasks;
  for (int64_t s = 0; s < a.S; ++s) {
    const int64_t q_len = a.seqs[4 * s + 1], ctx = a.seqs[4 * s + 2];
    for (int64_t i0 = 0; i0 < q_len; i0 += qt) {
      const int64_t i1 = std::min(q_len, i0 + qt);
      const double last = static_cast<double>(a.causal ? ctx - q_len + i1 : ctx);
      const double keys = a.window > 0 ? std::min<double>(last, a.window) : last;
      for (int64_t h = 0; h < a.Hkv; ++h) tasks.push_back({s, h, i0, i1, keys * (i1 - i0)});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
#ifdef BATCHERY_AMX
  if constexpr (BF) {
    if (amx) {
      attend<T, BF, true>(a, packs, kb, vb, tasks, qt * a.G);
      return;
    }
  }
#endif
  attend<T, BF, false>(a, packs, kb, vb, tasks, qt * a.G);
}
#endif

}  // namespace batchery_prefill

bool has_prefill_attention() { return batchery_prefill::available(); }

// Tests: whether bf16 prefill may take the AMX tiles (where the CPU has them); returns the previous setting.
bool prefill_set_amx(bool on) { return batchery_prefill::g_use_amx.exchange(on); }

// Whether bf16 prefill takes the AMX tiles here now (built for AMX-BF16, granted by the OS, not turned off).
bool prefill_amx() {
#ifdef BATCHERY_AMX
  return batchery_prefill::g_use_amx.load() && amx_permitted();
#else
  return false;
#endif
}

// out[t, h] = attention of q[t, h] for every prefill chunk in seqs; see batchery.engine.attention.cpu_prefill.
// Not causal: each chunk attends all of its own keys (chunks with nothing cached only, no window).
void prefill_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor kc, at::Tensor vc, at::Tensor out,
                       at::Tensor seqs, at::Tensor tables, double scale, int64_t window, bool causal) {
#ifdef __AVX512F__
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.sizes() == q.sizes(), "prefill_attention: shapes");
  TORCH_CHECK(kc.dim() == 4 && kc.is_contiguous() && vc.is_contiguous() && vc.sizes() == kc.sizes(),
              "prefill_attention: caches must be contiguous [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1,
              "prefill_attention: the last dimension must be contiguous");
  TORCH_CHECK(seqs.scalar_type() == at::kLong && seqs.is_contiguous() && seqs.dim() == 2 && seqs.size(1) == 4,
              "prefill_attention: seqs must be contiguous int64 [S, 4]");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2,
              "prefill_attention: tables must be contiguous int64 [N, max_blocks]");
  const int64_t H = q.size(1), D = q.size(2), Hkv = kc.size(2);
  TORCH_CHECK(kc.size(3) == D && k.size(1) == Hkv && k.size(2) == D && H % Hkv == 0 && D % 32 == 0,
              "prefill_attention: head_dim must be a multiple of 32 and heads a multiple of KV heads");
  auto dt = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt && kc.scalar_type() == dt && vc.scalar_type() == dt &&
                  out.scalar_type() == dt,
              "prefill_attention: one dtype for all");
  const int64_t S = seqs.size(0);
  const int64_t* sp = seqs.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(sp[4 * s + 1] > 0 && sp[4 * s + 1] <= sp[4 * s + 2] && sp[4 * s] + sp[4 * s + 1] <= q.size(0),
                "prefill_attention: bad chunk");
    TORCH_CHECK(sp[4 * s + 3] < 0
                    ? sp[4 * s + 1] == sp[4 * s + 2]
                    : sp[4 * s + 3] < tables.size(0) && (sp[4 * s + 2] + kc.size(1) - 1) / kc.size(1) <= tables.size(1),
                "prefill_attention: bad block table");
  }
  TORCH_CHECK(causal || window <= 0, "prefill_attention: a window needs causal attention");
  for (int64_t s = 0; s < S && !causal; ++s)
    TORCH_CHECK(sp[4 * s + 3] < 0, "prefill_attention: non-causal chunks attend their own keys only");
  if (S == 0) return;
  auto fill = [&](auto* ptr) {
    using T = std::remove_pointer_t<decltype(ptr)>;
    batchery_prefill::Args<T> a;
    a.S = S, a.H = H, a.Hkv = Hkv, a.G = H / Hkv, a.D = D, a.bs = kc.size(1), a.maxb = tables.size(1);
    a.window = window, a.causal = causal;
    a.qs_t = q.stride(0), a.qs_h = q.stride(1), a.ks_t = k.stride(0), a.ks_h = k.stride(1);
    a.vs_t = v.stride(0), a.vs_h = v.stride(1), a.os_t = out.stride(0), a.os_h = out.stride(1);
    a.q = q.data_ptr<T>(), a.k = k.data_ptr<T>(), a.v = v.data_ptr<T>(), a.kc = kc.data_ptr<T>();
    a.vc = vc.data_ptr<T>(), a.out = out.data_ptr<T>(), a.seqs = sp, a.tables = tables.data_ptr<int64_t>();
    a.scale = static_cast<float>(scale);
    return a;
  };
  if (dt == at::kFloat) {
    batchery_prefill::run<float, false>(fill(static_cast<float*>(nullptr)));
  } else if (dt == at::kBFloat16) {
    auto a = fill(static_cast<c10::BFloat16*>(nullptr));
#ifdef __AVX512BF16__
    batchery_prefill::run<c10::BFloat16, true>(a);
#else
    batchery_prefill::run<c10::BFloat16, false>(a);
#endif
  } else {
    TORCH_CHECK(false, "prefill_attention: float32 or bfloat16");
  }
#else
  TORCH_CHECK(false, "prefill_attention: built without AVX-512");
#endif
}
