// Weight-only quantized GEMM with 8-bit activations, on CPUs with AVX-512 VNNI and, below, on AVX2 + FMA ones
// (built with cpu_ops.cpp by specserve/layers/cpu_ops.py): what llama.cpp does for its quantized types (x in
// 8-bit blocks of 32, as its Q8_0 / Q8_1), as a kernel of its own beside the bfloat16-activation one in
// quant_gemm.cpp (``LLM(activations="int8")``).
//
// y[M, N] = x[M, K] W^T for W in groups of 32 input columns: 4-bit codes c (0..15) with w = c * d + m (GGUF
// Q4_0 / Q4_1, specserve's int4) or 8-bit codes q (-128..127) with w = q * d (GGUF Q8_0), d and m float16.
//
// Each row of x, per group of 32 values (float32 arithmetic, round half to even):
//   a = max |x_k|;  a == 0: every q_k = 0 and dx = 0;  else q_k = rint(x_k * (127 / a)), dx = a / 127;
//   s = sum q_k (an integer), sx = dx * s.
// Per group and output row, the integer dot product i = sum_k c_k q_k is exact (vpdpbusd: unsigned codes
// times signed x bytes, four at a time into 32-bit sums; AVX2: see its block_tile), and the output
// accumulates, group after group:
//   4-bit: y = fma(float(i), d * dx, y); y = fma(m, sx, y)      8-bit: y = fma(float(i), d * dx, y)
// then one rounding to bfloat16. Every output is one fixed sequence of operations on its own row of x and
// the weight, so a row gets the same bits whatever rows share the call (a verification forward reproduces
// one-token steps). ``layers.quant.reference_gemm_a8`` computes the same in PyTorch (the tests).
//
// Layout (``layers.quant.pack_groups`` with ``int8_activations``), per 16 output rows x 32 inputs: 4-bit,
// 320 bytes: four 64-byte vectors, vector j byte 4 r + b = code[r, 8 j + b] | code[r, 8 j + 4 + b] << 4; then
// 16 float16 d and 16 float16 m. 8-bit, 544 bytes: eight 64-byte vectors, vector j byte 4 r + b = code[r, 4 j + b] + 128 (as an
// unsigned byte: the kernel takes 128 x s back out of each sum); then 16 float16 d.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "quant_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define SPECSERVE_A8_GEMM 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECSERVE_A8_GEMM 1
#include <immintrin.h>
#endif

#if defined(SPECSERVE_A8_GEMM)
namespace {

using specserve_quant::kGroup, specserve_quant::kRows, specserve_quant::kQ4Block, specserve_quant::kQ8Block;
constexpr int64_t kPrefetchGroups = 4;

// x's rows in 8-bit groups (see the top of the file): q [M, K]; per group [M, G] dx, the integer sum s of
// its q (8-bit weights: the kernel takes 128 s out of each sum) and sx = dx * s (4-bit: the offset term)
struct QuantRows {
  std::vector<int8_t> q;
  std::vector<float> dx, sx;
  std::vector<int32_t> s;
  QuantRows(int64_t M, int64_t K) : q(M * K), dx(M * K / kGroup), sx(M * K / kGroup), s(M * K / kGroup) {}
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)

// one group of 32 values of x: its codes into qo; returns (max |x|, sum of the codes)
inline std::pair<float, int32_t> quantize_group(const at::BFloat16* r, int8_t* qo) {
  const auto widen = [](const at::BFloat16* p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  };
  const __m512 v0 = widen(r), v1 = widen(r + 16);
  const float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float inv = a > 0.0f ? 127.0f / a : 0.0f;
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));  // round half to even
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qo), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qo + 16), _mm512_cvtsepi32_epi8(q1));
  return {a, _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1))};
}

// One block of 16 output rows over all groups, for MT rows of x.
template <bool Q8, int MT>
inline void block_tile(const uint8_t* wb, int64_t G, const int8_t* q, int64_t K, const float* dx, const float* sx,
                       const int32_t* s, at::BFloat16* y, int64_t ldy) {
  constexpr int64_t B = Q8 ? kQ8Block : kQ4Block;
  __m512 tot[MT];
  for (int r = 0; r < MT; ++r) tot[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b = wb + g * B;
    if constexpr (MT >= 2) {
      const char* ahead = reinterpret_cast<const char*>(b + kPrefetchGroups * B);
      for (int64_t l = 0; l < B; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
    }
    __m512i w[8];
    if constexpr (Q8) {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(b + 64 * j);
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(b + 64 * j);
        w[2 * j] = _mm512_and_si512(v, low);
        w[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (Q8 ? 512 : 256))));
    const __m512 m = Q8 ? d : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 288)));
    for (int r = 0; r < MT; ++r) {
      const int32_t* xq = reinterpret_cast<const int32_t*>(q + r * K + g * kGroup);
      __m512i a0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(xq[0]));
      __m512i a1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(xq[1]));
      for (int j = 2; j < 8; j += 2) {
        a0 = _mm512_dpbusd_epi32(a0, w[j], _mm512_set1_epi32(xq[j]));
        a1 = _mm512_dpbusd_epi32(a1, w[j + 1], _mm512_set1_epi32(xq[j + 1]));
      }
      __m512i i32 = _mm512_add_epi32(a0, a1);
      if constexpr (Q8) i32 = _mm512_sub_epi32(i32, _mm512_set1_epi32(128 * s[r * G + g]));
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * G + g]));
      tot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32), scale, tot[r]);
      if constexpr (!Q8) tot[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * G + g]), tot[r]);
    }
  }
  for (int r = 0; r < MT; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(tot[r]));
}

#else  // AVX2 + FMA: the same values (integer sums exact, the same float32 operations per lane)

constexpr int kTileAvx2 = 4;  // rows of x a pass takes (16 ymm registers)

// one group of 32 values of x: its codes into qo; returns (max |x|, sum of the codes)
inline std::pair<float, int32_t> quantize_group(const at::BFloat16* r, int8_t* qo) {
  float a = 0.0f;
  for (int64_t k = 0; k < kGroup; ++k) a = std::max(a, std::fabs(static_cast<float>(r[k])));
  const float inv = a > 0.0f ? 127.0f / a : 0.0f;
  int32_t s = 0;
  for (int64_t k = 0; k < kGroup; ++k) {
    const int32_t q = static_cast<int32_t>(std::nearbyint(static_cast<float>(r[k]) * inv));
    qo[k] = static_cast<int8_t>(q);
    s += q;
  }
  return {a, s};
}

using specserve_quant::to_bf16x8;

// One block of 16 output rows, as two halves of 8 (the low and high 32 bytes of each 64-byte vector), over
// all groups, for MT rows of x. The unsigned x signed byte products come in pairs of 16-bit sums
// (vpmaddubsw: 4-bit codes, or |code| of 8-bit ones against x carrying the code's sign, never saturate),
// widened to 32-bit sums of four (vpmaddwd with ones); 4-bit groups add their eight 16-bit vectors first
// (at most 8 x 2 x 15 x 127 = 30480).
template <bool Q8, int MT>
inline void block_tile(const uint8_t* wb, int64_t G, const int8_t* q, int64_t K, const float* dx, const float* sx,
                       const int32_t*, at::BFloat16* y, int64_t ldy) {
  constexpr int64_t B = Q8 ? kQ8Block : kQ4Block;
  const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 tot[MT];
    for (int r = 0; r < MT; ++r) tot[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* b = wb + g * B;
      const char* ahead = reinterpret_cast<const char*>(b + kPrefetchGroups * B);
      for (int64_t l = 0; l < B; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
      __m256i w[8];
      if constexpr (Q8) {
        for (int j = 0; j < 8; ++j)
          w[j] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * j + 32 * h)), flip);
      } else {
        for (int j = 0; j < 4; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * j + 32 * h));
          w[2 * j] = _mm256_and_si256(v, low);
          w[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (Q8 ? 512 : 256) + 16 * h)));
      const __m256 m = Q8 ? d : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 288 + 16 * h)));
      for (int r = 0; r < MT; ++r) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(q + r * K + g * kGroup);
        __m256i i32;
        if constexpr (Q8) {
          i32 = _mm256_setzero_si256();
          for (int j = 0; j < 8; ++j) {
            const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w[j]), _mm256_sign_epi8(_mm256_set1_epi32(xq[j]), w[j]));
            i32 = _mm256_add_epi32(i32, _mm256_madd_epi16(p, ones));
          }
        } else {
          __m256i p = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(xq[0]));
          for (int j = 1; j < 8; ++j) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(xq[j])));
          i32 = _mm256_madd_epi16(p, ones);
        }
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * G + g]));
        tot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), scale, tot[r]);
        if constexpr (!Q8) tot[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * G + g]), tot[r]);
      }
    }
    for (int r = 0; r < MT; ++r)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * ldy + 8 * h), to_bf16x8(tot[r]));
  }
}

#endif

QuantRows quantize_rows(const at::BFloat16* x, int64_t M, int64_t K) {
  const int64_t G = K / kGroup;
  QuantRows out(M, K);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const auto [a, s] = quantize_group(x + i * K + g * kGroup, out.q.data() + i * K + g * kGroup);
      const float dx = a > 0.0f ? a / 127.0f : 0.0f;
      out.dx[i * G + g] = dx;
      out.s[i * G + g] = s;
      out.sx[i * G + g] = dx * static_cast<float>(s);
    }
  return out;
}

template <bool Q8>
void block_rows(const uint8_t* wb, int64_t G, const QuantRows& xr, int64_t M, int64_t K, at::BFloat16* y,
                int64_t N, int64_t max_tile) {
#if !defined(__AVX512VNNI__)
  max_tile = std::min<int64_t>(max_tile, kTileAvx2);
#endif
  const int64_t tiles = (M + max_tile - 1) / max_tile;  // tiles of near-equal size
  for (int64_t t = 0, i = 0; t < tiles; ++t) {
    const int64_t mt = M / tiles + (t < M % tiles ? 1 : 0);
    const int8_t* q = xr.q.data() + i * K;
    const float* dx = xr.dx.data() + i * G;
    const float* sx = xr.sx.data() + i * G;
    const int32_t* s = xr.s.data() + i * G;
    at::BFloat16* yt = y + i * N;
    switch (mt) {
#define SPECSERVE_TILE(n) \
  case n: block_tile<Q8, n>(wb, G, q, K, dx, sx, s, yt, N); break;
      SPECSERVE_TILE(1) SPECSERVE_TILE(2) SPECSERVE_TILE(3) SPECSERVE_TILE(4)
#if defined(__AVX512VNNI__)
      SPECSERVE_TILE(5) SPECSERVE_TILE(6) SPECSERVE_TILE(7) SPECSERVE_TILE(8)
#endif
#undef SPECSERVE_TILE
      default: break;
    }
    i += mt;
  }
}

}  // namespace

// x [M, K] bfloat16, packed [N / 16, K / 32, block] uint8 (``pack_groups(qt, True)``; block 320: 4-bit,
// 544: 8-bit) -> y [M, N] bfloat16. Row blocks are split over the intra-op threads when the call has at least ``grain``
// of them per thread.
at::Tensor group_gemm_a8(at::Tensor x, at::Tensor packed, int64_t bits, int64_t grain, int64_t max_tile) {
  const bool q8 = specserve_quant::check_call("group_gemm_a8", x, packed, bits, max_tile);
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), G = packed.size(1), N = NB * kRows;
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const QuantRows xr = quantize_rows(x.data_ptr<at::BFloat16>(), M, K);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  at::BFloat16* py = y.data_ptr<at::BFloat16>();
  const int64_t bstride = G * (q8 ? kQ8Block : kQ4Block);
  const auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb) {
      if (q8)
        block_rows<true>(w + nb * bstride, G, xr, M, K, py + nb * kRows, N, max_tile);
      else
        block_rows<false>(w + nb * bstride, G, xr, M, K, py + nb * kRows, N, max_tile);
    }
  };
  specserve_quant::over_row_blocks(NB, grain, run);
  return y;
}

bool group_gemm_a8_available() { return true; }

#else

at::Tensor group_gemm_a8(at::Tensor, at::Tensor, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "group_gemm_a8 needs a CPU with AVX-512 VNNI or AVX2 + FMA (this build has neither)");
}

bool group_gemm_a8_available() { return false; }

#endif
