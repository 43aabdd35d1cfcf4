// What the two group kernels share (quant_gemm.cpp: bfloat16 activations; quant_gemm_a8.cpp: 8-bit ones):
// the packed block sizes, the checks of a call's arguments, how a call's row blocks meet the threads, and
// bfloat16 rounding on AVX2.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace specserve_quant {

constexpr int64_t kGroup = 32;             // input columns a scale covers
constexpr int64_t kRows = 16;              // output rows of a packed block
constexpr int64_t kQ4Block = 256 + 64;     // 4-bit: 256 bytes of codes, 16 fp16 d, 16 fp16 m
constexpr int64_t kQ8Block = 512 + 32;     // 8-bit: 512 bytes of codes, 16 fp16 d
constexpr int kMaxTile = 8;                // rows of x one pass over the weight takes at most

// A call's x [M, K] bfloat16 and packed [N / 16, K / 32, block] uint8 checked (``name`` in the messages),
// made contiguous; returns whether the codes are 8-bit.
inline bool check_call(const char* name, at::Tensor& x, at::Tensor& packed, int64_t bits, int64_t max_tile) {
  TORCH_CHECK(max_tile >= 1 && max_tile <= kMaxTile, name, ": max_tile must be 1..", kMaxTile);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, name, ": x must be [M, K] bfloat16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte, name, ": packed must be uint8 [N/16, K/32, B]");
  TORCH_CHECK(bits == 4 || bits == 8, name, ": bits must be 4 or 8");
  const bool q8 = bits == 8;
  TORCH_CHECK(packed.size(2) == (q8 ? kQ8Block : kQ4Block), name, ": packed block size does not match bits");
  x = x.contiguous();
  packed = packed.contiguous();
  TORCH_CHECK(packed.size(1) * kGroup == x.size(1), name, ": x has ", x.size(1), " columns, the weight ",
              packed.size(1) * kGroup);
  return q8;
}

// run(b0, b1) over a call's NB row blocks, split over the intra-op threads where the call has at least
// ``grain`` of them per thread (fewer: on this thread, no pool wake-up)
template <class F>
inline void over_row_blocks(int64_t NB, int64_t grain, const F& run) {
  if (NB >= 2 * grain)
    at::parallel_for(0, NB, grain, run);
  else
    run(0, NB);
}

#if defined(__AVX2__)
inline __m128i to_bf16x8(__m256 v) {  // round to nearest even (NaN stays NaN), as vcvtneps2bf16
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
#endif

}  // namespace specserve_quant
