// fp32 -> bf16 rounding and bf16 -> fp32 widening, 16 lanes (AVX512-BF16): what the bf16 linears, the AMX linears and
// the fused elementwise kernels store.
#pragma once

#include <immintrin.h>

#include <cstdint>

#ifdef __AVX512BF16__
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

// 16 bf16 (their bits) as floats: exact
static inline __m512 bf16_as_float16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif
