// Weight-only quantized GEMM on AVX-512 BF16 CPUs and, below, on AVX2 + FMA ones (built with cpu_ops.cpp by
// specserve/layers/cpu_ops.py).
//
// y[M, N] = x[M, K] W^T for W in groups of 32 input columns: 4-bit codes c (0..15) with w = c * d + m
// (GGUF Q4_0 / Q4_1, specserve's int4) or 8-bit codes q (-128..127) with w = q * d (GGUF Q8_0), d and m
// float16. x is bfloat16. The weight is re-laid out once (``layers.quant.pack_groups``) in blocks of 16
// output rows x 32 inputs; a 32-byte chunk of codes becomes 32 bfloat16 words = 16 lanes (one per output
// row) x 2 inputs (4-bit: widened bytes through a vpermw table, low and high nibbles; 8-bit: through
// float32), which vdpbf16ps multiplies with a broadcast pair of x values. Codes are exact in bfloat16, so
// every product of a code and an x value is exact in float32.
//
// Exactness across row counts: every output y[i, n] is computed by one fixed sequence of operations
// that depends only on row i of x and the weight (per group: two partial sums over the chunks in order,
// added, times d, plus m times the group's sum of x; groups in order; one rounding to bfloat16), never on
// how many rows share the call or which tile a row falls in. So verifying k tokens at once reproduces k
// one-token steps bit for bit, and the weight is read from memory once for all k rows (tiles of up to 8
// rows share each unpacked chunk).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "quant_gemm.h"

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SPECSERVE_GROUP_GEMM 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECSERVE_GROUP_GEMM 1
#include <immintrin.h>
#endif

#if defined(SPECSERVE_GROUP_GEMM)
namespace {

using specserve_quant::kGroup, specserve_quant::kRows, specserve_quant::kQ4Block, specserve_quant::kQ8Block,
    specserve_quant::kMaxTile;

// one call: x [M, K], the packed weight w (groups of 32 columns), xs each group's sum of x, y [M, N]
struct GemmCall {
  const at::BFloat16* x;
  int64_t M, K, groups;
  const uint8_t* w;
  bool q8;
  const float* xs;
  at::BFloat16* y;
  int64_t N, max_tile;
};

// brings one group of a packed block (``bytes``: kQ4Block or kQ8Block, from ``g``) towards the core
inline void prefetch_group(const uint8_t* g, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(g);
  for (int64_t l = 0; l <= bytes / 64; ++l) _mm_prefetch(p + 64 * l, _MM_HINT_T0);
}

}  // namespace
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

namespace {

// Tiles of at least kPrefetchTile rows prefetch the group kPrefetchGroups ahead (into the next block at a
// block's end): from two rows the hardware's prefetch alone left the weight stream stalling them (the
// distance, 4 to 12 groups, made no difference); one-row tiles were no faster with it. The same bits
// either way.
constexpr int kPrefetchTile = 2;
constexpr int64_t kPrefetchGroups = 4;

inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);  // small integers: exact
}

// the vpermw table of 4-bit codes: word e (the low 5 bits of an index word) = bfloat16(e & 15)
__m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int e = 0; e < 32; ++e) t[e] = bf16_bits(static_cast<float>(e & 15));
  return _mm512_load_si512(t);
}

// One block of 16 output rows over all groups, for MT rows of x (tile). xs: the rows' group sums.
template <bool Q8, int MT>
inline void block_tile(const uint8_t* wb, int64_t groups, const at::BFloat16* x, int64_t ldx, const float* xs,
                       at::BFloat16* y, int64_t ldy, __m512i lut) {
  __m512 tot[MT];
  for (int r = 0; r < MT; ++r) tot[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* b = wb + g * (Q8 ? kQ8Block : kQ4Block);
    if constexpr (MT >= kPrefetchTile)
      prefetch_group(b + kPrefetchGroups * (Q8 ? kQ8Block : kQ4Block), Q8 ? kQ8Block : kQ4Block);
    const int32_t* xp[MT];
    for (int r = 0; r < MT; ++r) xp[r] = reinterpret_cast<const int32_t*>(x + r * ldx + g * kGroup);
    __m512 a0[MT], a1[MT];
    for (int r = 0; r < MT; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    if constexpr (!Q8) {
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * c)));
        const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(w, lut);
        const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), lut);
        for (int r = 0; r < MT; ++r) {
          a0[r] = _mm512_dpbf16_ps(a0[r], lo, (__m512bh)_mm512_set1_epi32(xp[r][c]));
          a1[r] = _mm512_dpbf16_ps(a1[r], hi, (__m512bh)_mm512_set1_epi32(xp[r][c + 8]));
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 256)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 288)));
      for (int r = 0; r < MT; ++r) {
        tot[r] = _mm512_fmadd_ps(_mm512_add_ps(a0[r], a1[r]), d, tot[r]);
        tot[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * groups + g]), tot[r]);
      }
    } else {
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) {
        const __m128i* q = reinterpret_cast<const __m128i*>(b + 32 * c);
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
        const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
        const __m512bh w = _mm512_cvtne2ps_pbh(f1, f0);  // codes -128..127: exact in bfloat16
        for (int r = 0; r < MT; ++r) {
          if (c & 1)
            a1[r] = _mm512_dpbf16_ps(a1[r], w, (__m512bh)_mm512_set1_epi32(xp[r][c]));
          else
            a0[r] = _mm512_dpbf16_ps(a0[r], w, (__m512bh)_mm512_set1_epi32(xp[r][c]));
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 512)));
      for (int r = 0; r < MT; ++r) tot[r] = _mm512_fmadd_ps(_mm512_add_ps(a0[r], a1[r]), d, tot[r]);
    }
  }
  for (int r = 0; r < MT; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(tot[r]));
}

// xs[i, g] = x[i, 32 g] + x[i, 32 g + 1] + ... + x[i, 32 g + 31], added one by one in that order in
// float32. Sixteen groups at a time, one per lane (a gather of 32-bit words brings each lane's next
// two values), so the 32 dependent adds of one group overlap those of the other fifteen.
void group_sums(const at::BFloat16* x, int64_t M, int64_t K, float* xs) {
  const int64_t groups = K / kGroup;
  const __m512i lane_at =  // byte offset of each lane's group
      _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                         _mm512_set1_epi32(kGroup * 2));
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t i = 0; i < M; ++i) {
    const at::BFloat16* row = x + i * K;
    int64_t g = 0;
    for (; g + 16 <= groups; g += 16) {
      const char* base = reinterpret_cast<const char*>(row + g * kGroup);
      __m512 s = _mm512_setzero_ps();
      for (int64_t k = 0; k < kGroup; k += 2) {
        const __m512i w = _mm512_i32gather_epi32(lane_at, base + 2 * k, 1);  // values k (low half), k + 1 (high)
        s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_and_si512(w, high)));
      }
      _mm512_storeu_ps(xs + i * groups + g, s);
    }
    for (; g < groups; ++g) {
      float s = 0.f;
      for (int64_t k = 0; k < kGroup; ++k) s += static_cast<float>(row[g * kGroup + k]);
      xs[i * groups + g] = s;
    }
  }
}

template <bool Q8>
void block_rows(const uint8_t* wb, int64_t groups, const at::BFloat16* x, int64_t M, int64_t K, const float* xs,
                at::BFloat16* y, int64_t N, __m512i lut, int64_t max_tile) {
  // tiles of near-equal size (8 rows: 4 + 4, not 6 + 2): fewer rows than ~4 leave vdpbf16ps waiting
  const int64_t tiles = (M + max_tile - 1) / max_tile;
  for (int64_t t = 0, i = 0; t < tiles; ++t) {
    const int64_t mt = M / tiles + (t < M % tiles ? 1 : 0);
    const at::BFloat16* xt = x + i * K;
    const float* st = xs + i * groups;
    at::BFloat16* yt = y + i * N;
    switch (mt) {
#define SPECSERVE_TILE(n) \
  case n: block_tile<Q8, n>(wb, groups, xt, K, st, yt, N, lut); break;
      SPECSERVE_TILE(1) SPECSERVE_TILE(2) SPECSERVE_TILE(3) SPECSERVE_TILE(4)
      SPECSERVE_TILE(5) SPECSERVE_TILE(6) SPECSERVE_TILE(7) SPECSERVE_TILE(8)
#undef SPECSERVE_TILE
      default: break;
    }
    i += mt;
  }
}

// a call's row blocks [b0, b1), each against every tile of rows
struct BlockRun : GemmCall {
  __m512i lut = nibble_table();
  void operator()(int64_t b0, int64_t b1) const {
    const int64_t bstride = groups * (q8 ? kQ8Block : kQ4Block);
    for (int64_t nb = b0; nb < b1; ++nb) {
      if (q8)
        block_rows<true>(w + nb * bstride, groups, x, M, K, xs, y + nb * kRows, N, lut, max_tile);
      else
        block_rows<false>(w + nb * bstride, groups, x, M, K, xs, y + nb * kRows, N, lut, max_tile);
    }
  }
};

}  // namespace

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The same kernel for CPUs with AVX2 and FMA but no AVX-512 BF16 (most laptops): the same packed layout
// and the same operations in the same order as vdpbf16ps defines them (each lane: the odd input's exact
// product added, rounded, then the even one's; inputs below float32's normal range read as zero), as
// float32 FMAs on 8 output rows at a time. A 16-byte half chunk widens to 8 lanes of 16-bit words that
// hold 4 codes each (4-bit: even input low / high nibble in bits 0-3 / 4-7, odd input in bits 8-11 /
// 12-15); each code is masked where it sits and converted to float32 (its value times 1, 16, 256 or
// 4096), and meets x scaled by the inverse power of two (``scaled_rows``): the product, and so every
// rounding after it, is that of the code and x.

namespace {

constexpr int64_t kHalf = 8;  // output rows a pass computes (float32 lanes of a ymm register)
constexpr int kTile = 4;     // rows of x that share each unpacked chunk (16 ymm registers)
// Every tile prefetches the group kPrefetchGroups ahead (into the next block at a block's end): without it
// a one-row forward waited on the weight stream about half as long as it computed. The same bits either way.
constexpr int64_t kPrefetchGroups = 12;

inline float bf16_in(at::BFloat16 v) {  // as vdpbf16ps reads an input: a subnormal is zero
  const float f = static_cast<float>(v);
  return (reinterpret_cast<const uint16_t&>(v) & 0x7F80) == 0 ? 0.0f * f : f;
}

// x [M, K] as float32, each value divided by the power of two its code is multiplied by in the packed
// word: 4-bit, inputs k < 16 of a group: even 1, odd 256; k >= 16: even 16, odd 4096; 8-bit: even 1,
// odd 256. Exact: x's 8 significant bits stay above float32's smallest subnormal after the division.
std::vector<float> scaled_rows(const at::BFloat16* x, int64_t M, int64_t K, bool q8) {
  float inv[kGroup];
  for (int64_t k = 0; k < kGroup; ++k)
    inv[k] = q8 ? (k & 1 ? 1.0f / 256 : 1.0f) : (k < 16 ? (k & 1 ? 1.0f / 256 : 1.0f) : (k & 1 ? 1.0f / 4096 : 1.0f / 16));
  std::vector<float> out(M * K);
  for (int64_t i = 0; i < M * K; ++i) out[i] = bf16_in(x[i]) * inv[i % kGroup];
  return out;
}

// xs[i, g]: x[i, 32 g] + ... + x[i, 32 g + 31] added in order in float32 (as the AVX-512 kernel),
// eight groups at a time so that their chains overlap
void group_sums(const at::BFloat16* x, int64_t M, int64_t K, float* xs) {
  const int64_t groups = K / kGroup;
  for (int64_t i = 0; i < M; ++i) {
    const at::BFloat16* row = x + i * K;
    for (int64_t g0 = 0; g0 < groups; g0 += 8) {
      const int64_t n = std::min<int64_t>(8, groups - g0);
      float s[8] = {};
      for (int64_t k = 0; k < kGroup; ++k)
        for (int64_t e = 0; e < n; ++e) s[e] += static_cast<float>(row[(g0 + e) * kGroup + k]);
      for (int64_t e = 0; e < n; ++e) xs[i * groups + g0 + e] = s[e];
    }
  }
}

using specserve_quant::to_bf16x8;

// NH sets of 8 output rows (w[j]: a block's start + 16 bytes for its second half; y[j]: their first
// output column) over all groups, for MT rows of x (xq: scaled_rows). Each lane's sums form two chains
// of 16 dependent FMAs a group: a pass of one row keeps two halves (4 chains) in flight, of two rows 8, of
// three rows 12.
// Not inlined: each (rows, halves) variant is compiled on its own (inlined into one function with the
// others, the compiler's choices for one tile size slowed another by 5-20%).
template <bool Q8, int MT, int NH>
__attribute__((noinline)) void halves_tile(const uint8_t* const* w, int64_t groups, const float* xq, int64_t ldx,
                                           const float* xs, at::BFloat16* const* y, int64_t ldy) {
  constexpr int64_t kBlock = Q8 ? kQ8Block : kQ4Block;
  __m256 tot[NH][MT];
  for (int j = 0; j < NH; ++j)
    for (int r = 0; r < MT; ++r) tot[j][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_group(w[0] + (g + kPrefetchGroups) * kBlock, kBlock);
    const float* xg[MT];
    for (int r = 0; r < MT; ++r) xg[r] = xq + r * ldx + g * kGroup;
    __m256 a0[NH][MT], a1[NH][MT];
    for (int j = 0; j < NH; ++j)
      for (int r = 0; r < MT; ++r) a0[j][r] = a1[j][r] = _mm256_setzero_ps();
    if constexpr (!Q8) {
      // one code vector of each half converted at a time, then each row's x broadcast once for both halves,
      // so that two or three rows of two halves (8 or 12 accumulators, as many chains of FMAs) fit the 16
      // registers (three rows spill the totals, touched once a group); each accumulator adds its products
      // in vdpbf16ps' order whatever the tile (per chunk: the odd input, then the even)
      constexpr int kMask[4] = {0x0F00, 0x000F, 0xF000, 0x00F0};
      constexpr int kOff[4] = {1, 0, 17, 16};
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        __m256i v[NH];
        for (int j = 0; j < NH; ++j)
          v[j] = _mm256_cvtepu16_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[j] + g * kBlock + 32 * c)));
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
          __m256 code[NH];
          for (int j = 0; j < NH; ++j)
            code[j] = _mm256_cvtepi32_ps(_mm256_and_si256(v[j], _mm256_set1_epi32(kMask[q])));
          for (int r = 0; r < MT; ++r) {
            const __m256 xb = _mm256_broadcast_ss(xg[r] + kOff[q] + 2 * c);
            for (int j = 0; j < NH; ++j) {
              __m256& acc = q < 2 ? a0[j][r] : a1[j][r];
              acc = _mm256_fmadd_ps(code[j], xb, acc);
            }
          }
        }
      }
      for (int j = 0; j < NH; ++j) {
        const uint8_t* b = w[j] + g * kBlock;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 256)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 288)));
        for (int r = 0; r < MT; ++r) {
          tot[j][r] = _mm256_fmadd_ps(_mm256_add_ps(a0[j][r], a1[j][r]), d, tot[j][r]);
          tot[j][r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * groups + g]), tot[j][r]);
        }
      }
    } else {
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c)
        for (int j = 0; j < NH; ++j) {
          const uint8_t* b = w[j] + g * kBlock + 32 * c;
          const __m256i v = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
          const __m256 ev = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24));
          const __m256 od = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(~0xFF)));
          for (int r = 0; r < MT; ++r) {
            __m256& acc = (c & 1) ? a1[j][r] : a0[j][r];
            acc = _mm256_fmadd_ps(od, _mm256_broadcast_ss(xg[r] + 2 * c + 1), acc);
            acc = _mm256_fmadd_ps(ev, _mm256_broadcast_ss(xg[r] + 2 * c), acc);
          }
        }
      for (int j = 0; j < NH; ++j) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[j] + g * kBlock + 512)));
        for (int r = 0; r < MT; ++r) tot[j][r] = _mm256_fmadd_ps(_mm256_add_ps(a0[j][r], a1[j][r]), d, tot[j][r]);
      }
    }
  }
  for (int j = 0; j < NH; ++j)
    for (int r = 0; r < MT; ++r)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y[j] + r * ldy), to_bf16x8(tot[j][r]));
}

// MT rows of x against the halves of blocks [nb0, nb1) (at most 2 blocks), NH halves a pass
template <bool Q8, int MT>
inline void tile_blocks(const uint8_t* pw, int64_t bstride, int64_t nb0, int64_t nb1, int64_t groups,
                        const float* xq, int64_t K, const float* xs, at::BFloat16* y, int64_t N) {
  // two halves a pass for one to three rows: two rows of one half would keep only 4 chains of dependent FMAs
  // in flight, three rows 6; from four rows one half has 8, and two would not fit the registers
  constexpr int NH = MT <= 3 ? 2 : 1;
  const uint8_t* w[4];
  at::BFloat16* yo[4];
  const int64_t nh = 2 * (nb1 - nb0);
  for (int64_t j = 0; j < nh; ++j) {
    w[j] = pw + (nb0 + j / 2) * bstride + 16 * (j % 2);
    yo[j] = y + (nb0 + j / 2) * kRows + kHalf * (j % 2);
  }
  for (int64_t j = 0; j < nh; j += NH) halves_tile<Q8, MT, NH>(w + j, groups, xq, K, xs, yo + j, N);
}

// blocks [b0, b1) two at a time, each pair against every tile of rows (tiles of near-equal size), so that
// a pair's weights are read from memory once
template <bool Q8>
void block_rows(const uint8_t* pw, int64_t bstride, int64_t b0, int64_t b1, int64_t groups, const float* xq,
                int64_t M, int64_t K, const float* xs, at::BFloat16* y, int64_t N, int64_t max_tile) {
  const int64_t tiles = (M + max_tile - 1) / max_tile;
  for (int64_t nb = b0; nb < b1; nb += 2) {
    const int64_t ne = std::min(nb + 2, b1);
    for (int64_t t = 0, i = 0; t < tiles; ++t) {
      const int64_t mt = M / tiles + (t < M % tiles ? 1 : 0);
      switch (mt) {
#define SPECSERVE_TILE(n) \
  case n: tile_blocks<Q8, n>(pw, bstride, nb, ne, groups, xq + i * K, K, xs + i * groups, y + i * N, N); break;
        SPECSERVE_TILE(1) SPECSERVE_TILE(2) SPECSERVE_TILE(3) SPECSERVE_TILE(4)
#undef SPECSERVE_TILE
        default: break;
      }
      i += mt;
    }
  }
}

// a call's row blocks [b0, b1), pairs of them against every tile of rows
struct BlockRun : GemmCall {
  std::vector<float> xq = scaled_rows(x, M, K, q8);
  void operator()(int64_t b0, int64_t b1) const {
    const int64_t bstride = groups * (q8 ? kQ8Block : kQ4Block), tile = std::min<int64_t>(max_tile, kTile);
    if (q8)
      block_rows<true>(w, bstride, b0, b1, groups, xq.data(), M, K, xs, y, N, tile);
    else
      block_rows<false>(w, bstride, b0, b1, groups, xq.data(), M, K, xs, y, N, tile);
  }
};

}  // namespace

#endif

#if defined(SPECSERVE_GROUP_GEMM)

// x [M, K] bfloat16, packed [N / 16, K / 32, block] uint8 (block 320: 4-bit, 544: 8-bit) -> y [M, N] bfloat16.
// Row blocks are split over the intra-op threads when the call has at least ``grain`` of them per thread.
at::Tensor group_gemm(at::Tensor x, at::Tensor packed, int64_t bits, int64_t grain, int64_t max_tile) {
  const bool q8 = specserve_quant::check_call("group_gemm", x, packed, bits, max_tile);
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), groups = packed.size(1), N = NB * kRows;
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto* px = x.data_ptr<at::BFloat16>();
  std::vector<float> xs(M * groups);  // each group's sum of x, in order (the offset term)
  if (!q8) group_sums(px, M, K, xs.data());
  const BlockRun run{{px, M, K, groups, packed.data_ptr<uint8_t>(), q8, xs.data(), y.data_ptr<at::BFloat16>(), N,
                      max_tile}};
  specserve_quant::over_row_blocks(NB, grain, [&](int64_t b0, int64_t b1) { run(b0, b1); });
  return y;
}

bool group_gemm_available() { return true; }

#else

at::Tensor group_gemm(at::Tensor, at::Tensor, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "group_gemm needs a CPU with AVX-512 BF16 or AVX2 + FMA (this build has neither)");
}

bool group_gemm_available() { return false; }

#endif
