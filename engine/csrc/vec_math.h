// Vector math the kernels share (AVX-512): the extension's one exp polynomial.
#pragma once

#include <immintrin.h>

#ifdef __AVX512F__
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

// GELU, erf form (torch's default, BERT's "gelu"): x / 2 (1 + erf(x / sqrt 2)). erf is Abramowitz and Stegun's 7.1.26
// (absolute error below 1.5e-7, far below a bf16 step): cpu_fused's fused_gelu and the bf16 linear's GELU epilogue.
static inline __m512 gelu16(__m512 x) {
  const __m512 z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(0.70710678118654752f));
  // t = 1 / (1 + 0.3275911 z): vrcp14ps and one Newton step (relative error about 1e-8, beside the formula's 1.5e-7)
  // instead of a vdivps: the division was half the cost of the bf16 linear's GELU epilogue on the Zen 4 EPYC (1,024
  // rows, 384 -> 1,536: 3.79 ms with it, 3.21-3.45 ms without, 2.94-3.03 ms with no GELU)
  const __m512 den = _mm512_fmadd_ps(z, _mm512_set1_ps(0.3275911f), _mm512_set1_ps(1.f));
  const __m512 r0 = _mm512_rcp14_ps(den);
  const __m512 t = _mm512_mul_ps(r0, _mm512_fnmadd_ps(den, r0, _mm512_set1_ps(2.f)));
  __m512 p = _mm512_set1_ps(1.061405429f);
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
  p = _mm512_mul_ps(p, t);
  // erfc(|x| / sqrt 2) = p e; 1 + erf(x / sqrt 2) is 2 - erfc for x >= 0 and erfc itself below (no cancellation)
  const __m512 erfc = _mm512_mul_ps(p, exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(z, z))));
  const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 one_plus = _mm512_mask_mov_ps(_mm512_sub_ps(_mm512_set1_ps(2.f), erfc), neg, erfc);
  return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), one_plus);
}
#endif
