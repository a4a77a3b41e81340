#include "kernels.h"
#include "vec_math.h"

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
inline const float* block_rows<float>(const float* src, float* buf, int64_t n) {
  (void)buf;
  (void)n;
  return src;
}
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
        groups(B >= 4 * at::get_num_threads() ? 1 : Hkv), hper(Hkv / groups), window(window_), tok_stride(Hkv * D),
        blk_stride(bs * Hkv * D), qp(q.data_ptr<T>()), kp(kc.data_ptr<T>()), vp(vc.data_ptr<T>()),
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
static inline void add_v_rows(float* __restrict acc, const float (*pr)[16], const T* __restrict vp, const int64_t* row,
                              int64_t hoff, int nj) {
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
          for (int64_t d = 0; d < D; ++d) qf[qi * D + lane_of(kp, d)] = static_cast<float>(src[qi * D + d]) * a.fscale;
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
            case 3:
              if constexpr (GB >= 3) add_v_rows<T, NV, 3>(ag, pr, vp, row, hoff, nj);
              break;
            default:
              if constexpr (GB >= 4) add_v_rows<T, NV, 4>(ag, pr, vp, row, hoff, nj);
              break;
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

at::Tensor paged_decode(at::Tensor q, at::Tensor kc, at::Tensor vc, at::Tensor bt, at::Tensor ctx, double scale,
                        int64_t window, double softcap) {
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
