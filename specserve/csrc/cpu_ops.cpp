// CPU ops of the bfloat16 decoding step (built on first use by specserve/layers/cpu_ops.py).
//
// attention: each output row (batch b, query i, head h) is computed in one fixed order that depends only
// on that query, its head and the keys it sees (in cache order), never on how many other rows share the
// call or where its keys sit in the cache. Two kernels: float64 (attn_task; float32 rows, builds without
// AVX-512 BF16, and set_float64_attention(True)): scores in float64 (products of bfloat16 or float32 values
// are exact in float64) summed over the head dimension in 8 lanes (d mod 8) then a fixed tree, softmax in
// float64 with the keys summed in order, the weighted value sum in float64 over the keys in order, and one
// rounding to the output dtype (through float32, as torch's double -> bfloat16 copy rounds); float32
// (attn_task_bf16; bfloat16 rows, head size 64 or 128): float32 scores and values over a row's keys in
// parts of 128 it sees, the parts joined in float64 (see there): half the vector width per product, no
// conversion of the keys, a row's parts computed on several threads; on random data the same bits as
// float64 in >99.9% of the outputs.
//
// add_rms_norm / rms_norm: bfloat16 rows; the residual add is torch's (float32 sum rounded once), the
// norm reproduces F.rms_norm on a bfloat16 input bit for bit: float32 squares summed in the order of
// torch's vectorized CPU sum (cascade_sum: 4 interleaved vector accumulators of ``vec`` lanes, then the
// scalar tail, then the lanes in order), mean = sum / N, r = 1 / sqrt(mean + eps), bfloat16(x * r), then
// the weight multiplied as torch multiplies two bfloat16 tensors.
//
// decoder_layer: a Llama (or Qwen3: q/k normed per head) layer of a quantized model (group kernel,
// quant_gemm.cpp) in one call, built from the ops above, rotary as torch's rotate_ rounds it, and torch's
// own silu_ / mul: the same bits as the layer op by op (LlamaDecoderLayer.forward_fused).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
// the float32 attention kernel: vdpbf16ps on AVX-512 BF16, the same operations as float32 FMAs on AVX2
#define SPECSERVE_F32_ATTN 1
#endif

namespace {

typedef double v8d __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

inline v8d load8(const at::BFloat16* p) {
  v8h h;
  std::memcpy(&h, p, sizeof(h));
  v8u u = __builtin_convertvector(h, v8u) << 16;
  v8f f;
  std::memcpy(&f, &u, sizeof(f));
  return __builtin_convertvector(f, v8d);
}

inline v8d load8(const float* p) {
  v8f f;
  std::memcpy(&f, p, sizeof(f));
  return __builtin_convertvector(f, v8d);
}

typedef int64_t v8l __attribute__((vector_size(64)));

// exp(x) for 8 values x <= 0 (relative error ~1e-16): x = n ln2 + r, |r| <= ln2 / 2, a degree-12 Taylor
// polynomial of e^r, times 2^n; x < -708 gives 0. Branch-free, so it vectorizes; a pure function, so a
// key's weight is the same whichever lanes it shares.
inline v8d exp8(v8d x) {
  const v8d magic = v8d{} + 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer
  const v8d t = x * 1.4426950408889634 + magic;
  const v8d n = t - magic;
  const v8d r = (x - n * 0.6931471805598903) - n * 5.497923018708371e-14;
  v8d p = v8d{} + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  v8l bits;
  std::memcpy(&bits, &t, sizeof(bits));
  bits = (bits + 1023) << 52;
  v8d scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const v8d y = p * scale;
  return x < -708.0 ? v8d{} : y;
}

// the sums of 8 vectors, each ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)) over its own lanes: lane t
// of the result is x[t]'s sum (pairs of lanes added in three rounds of even/odd shuffles)
inline v8d hsum8(const v8d* x) {
  typedef int64_t v8i __attribute__((vector_size(64)));
  const v8i ev = {0, 2, 4, 6, 8, 10, 12, 14}, od = {1, 3, 5, 7, 9, 11, 13, 15};
  auto pair = [&](v8d a, v8d b) { return __builtin_shuffle(a, b, ev) + __builtin_shuffle(a, b, od); };
  const v8d y01 = pair(x[0], x[1]), y23 = pair(x[2], x[3]), y45 = pair(x[4], x[5]), y67 = pair(x[6], x[7]);
  return pair(pair(y01, y23), pair(y45, y67));
}

inline void store_out(at::BFloat16* p, double x) { *p = at::BFloat16(static_cast<float>(x)); }
inline void store_out(float* p, double x) { *p = static_cast<float>(x); }

constexpr int64_t KEY_BLOCK = 64;   // keys converted to float64 at a time (stay in L1/L2)
constexpr int64_t ROW_CHUNK = 32;   // query rows of one kv head per task
constexpr double NEG_INF = -std::numeric_limits<double>::infinity();

// a row's scores s[0, n) (n a multiple of 8) -> its softmax weights in place: exp(s - max) (float64 exp8,
// rounded to T) for a score, ``hidden`` for a -inf score (every entry when all are -inf); returns the max
template <typename T>
inline T row_weights(T* s, int64_t n, double hidden) {
  typedef T v8t __attribute__((vector_size(8 * sizeof(T))));
  constexpr T ninf = -std::numeric_limits<T>::infinity();
  v8t mv = v8t{} + ninf;
  for (int64_t j = 0; j < n; j += 8) {
    v8t v;
    std::memcpy(&v, s + j, sizeof(v));
    mv = v > mv ? v : mv;
  }
  T m = ninf;
  for (int k = 0; k < 8; ++k) m = std::max(m, mv[k]);
  const double mx = m;
  for (int64_t j = 0; j < n; j += 8) {
    v8t v;
    std::memcpy(&v, s + j, sizeof(v));
    const v8d x = __builtin_convertvector(v, v8d);
    v8d p = mx == NEG_INF ? v8d{} + hidden : exp8(x - mx);
    p = x == NEG_INF ? v8d{} + hidden : p;
    v = __builtin_convertvector(p, v8t);
    std::memcpy(s + j, &v, sizeof(v));
  }
  return m;
}

struct AttnArgs {
  int64_t B, Q, H, Hkv, G, D, L, BS, bs_shift;  // BS = 1 << bs_shift: positions per cache block
  const int64_t* tables;              // [B, NB]: each row's block table
  int64_t NB;
  int64_t qs0, qs1, qs2;  // q strides (last dim contiguous)
  const uint8_t* mask;     // nullptr or bool [B, 1, Q, L]
  int64_t ms0, ms2, ms3;
  bool causal;
  double scale;
};

// rows [r0, r1) of kv head ``kvh`` of sequence ``b``: row r is query i = r / G, head h = kvh * G + r % G
template <typename T, int NC>
void attn_task(const AttnArgs& a, const T* q, const T* cache, T* out, int64_t b, int64_t kvh, int64_t r0,
               int64_t r1) {
  const int64_t D = a.D, L = a.L, G = a.G, nr = r1 - r0;
  const int64_t nc = NC > 0 ? NC : D / 8;
  const int64_t i_max = (r1 - 1) / G;
  const int64_t jend = a.causal ? std::min(L, i_max + 1) : L;
  // position p of this row and kv head: block tables[b][p / BS], offset p % BS of the pool
  // [blocks, 2, Hkv, BS, D]; kv 0 keys, 1 values
  const int64_t* tab = a.tables + b * a.NB;
  const int64_t BS = a.BS, shift = a.bs_shift, low = BS - 1;  // BS a power of two: no division per key
  auto at = [&](int64_t kv, int64_t p) -> const T* {
    return cache + (((tab[p >> shift] * 2 + kv) * a.Hkv + kvh) * BS + (p & low)) * D;
  };

  std::vector<v8d> qd(nr * nc), acc(nr * nc), buf(KEY_BLOCK * nc);
  std::vector<double> s(nr * std::max<int64_t>((jend + 7) / 8 * 8, 8));
  const int64_t sstride = std::max<int64_t>((jend + 7) / 8 * 8, 8);
  std::vector<int64_t> qi(nr);
  std::vector<const uint8_t*> mrow(nr);
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t i = (r0 + r) / G, h = kvh * G + (r0 + r) % G;
    qi[r] = i;
    const T* qp = q + b * a.qs0 + i * a.qs1 + h * a.qs2;
    for (int64_t c = 0; c < nc; ++c) qd[r * nc + c] = load8(qp + 8 * c);
    mrow[r] = a.mask ? a.mask + b * a.ms0 + i * a.ms2 : nullptr;
  }
  const int64_t ms3 = a.ms3;

  // scores
  for (int64_t jb = 0; jb < jend; jb += KEY_BLOCK) {
    const int64_t jn = std::min(KEY_BLOCK, jend - jb);
    const T* row = nullptr;
    for (int64_t j = 0; j < jn; ++j) {
      row = (j == 0 || ((jb + j) & low) == 0) ? at(0, jb + j) : row + D;  // a block's rows are adjacent
      for (int64_t c = 0; c < nc; ++c) buf[j * nc + c] = load8(row + 8 * c);
    }
    for (int64_t j = jn; j < (jn + 7) / 8 * 8; ++j)  // the last group's missing keys: finite scores
      for (int64_t c = 0; c < nc; ++c) buf[j * nc + c] = v8d{};
    for (int64_t r = 0; r < nr; ++r) {
      const v8d* qv = &qd[r * nc];
      double* sr = &s[r * sstride + jb];
      // 8 keys at a time: 8 independent chains of products, their 8 sums in one go (hsum8); the
      // scores past jn (zero keys) land in the row's padding and are overwritten below
      for (int64_t j0 = 0; j0 < jn; j0 += 8) {
        const v8d* kv = &buf[j0 * nc];
        v8d x[8];
        for (int t = 0; t < 8; ++t) x[t] = qv[0] * kv[t * nc];
        for (int64_t c = 1; c < nc; ++c)
          for (int t = 0; t < 8; ++t) x[t] += qv[c] * kv[t * nc + c];
        const v8d sc = hsum8(x) * a.scale;
        std::memcpy(sr + j0, &sc, sizeof(sc));
      }
      const uint8_t* m = mrow[r];
      const int64_t i = qi[r];
      if (m) {
        for (int64_t j = 0; j < jn; ++j)
          if (!m[(jb + j) * ms3]) sr[j] = NEG_INF;
      } else if (a.causal) {
        for (int64_t j = std::max<int64_t>(0, i + 1 - jb); j < jn; ++j) sr[j] = NEG_INF;
      }
    }
  }
  // softmax: p = exp(s - max) for a visible key, -1 for a hidden one (-inf score); the sum of the p in
  // key order is taken in the value pass
  const int64_t jpad = (jend + 7) / 8 * 8;
  std::vector<double> total(nr, 0.0);
  for (int64_t r = 0; r < nr; ++r) {
    double* sr = &s[r * sstride];
    for (int64_t j = jend; j < jpad; ++j) sr[j] = NEG_INF;
    row_weights(sr, jpad, -1.0);
    for (int64_t c = 0; c < nc; ++c) acc[r * nc + c] = v8d{0, 0, 0, 0, 0, 0, 0, 0};
  }
  // weighted values (keys in order)
  for (int64_t jb = 0; jb < jend; jb += KEY_BLOCK) {
    const int64_t jn = std::min(KEY_BLOCK, jend - jb);
    const T* row = nullptr;
    for (int64_t j = 0; j < jn; ++j) {
      row = (j == 0 || ((jb + j) & low) == 0) ? at(1, jb + j) : row + D;  // a block's rows are adjacent
      for (int64_t c = 0; c < nc; ++c) buf[j * nc + c] = load8(row + 8 * c);
    }
    for (int64_t r = 0; r < nr; ++r) {
      const double* pr = &s[r * sstride + jb];
      double tot = total[r];
      v8d* ar = &acc[r * nc];
      if (NC > 0) {
        v8d reg[NC > 0 ? NC : 1];
        for (int c = 0; c < NC; ++c) reg[c] = ar[c];
        for (int64_t j = 0; j < jn; ++j) {
          const double p = pr[j];
          if (!(p >= 0.0)) continue;
          tot += p;
          const v8d* vv = &buf[j * nc];
          for (int c = 0; c < NC; ++c) reg[c] += p * vv[c];
        }
        for (int c = 0; c < NC; ++c) ar[c] = reg[c];
      } else {
        for (int64_t j = 0; j < jn; ++j) {
          const double p = pr[j];
          if (!(p >= 0.0)) continue;
          tot += p;
          const v8d* vv = &buf[j * nc];
          for (int64_t c = 0; c < nc; ++c) ar[c] += p * vv[c];
        }
      }
      total[r] = tot;
    }
  }
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t i = qi[r], h = kvh * G + (r0 + r) % G;
    T* op = out + ((b * a.Q + i) * a.H + h) * D;
    const double sum = total[r];
    for (int64_t c = 0; c < nc; ++c) {
      const v8d x = acc[r * nc + c];
      for (int k = 0; k < 8; ++k) store_out(op + 8 * c + k, sum > 0.0 ? x[k] / sum : 0.0);
    }
  }
}

#if defined(SPECSERVE_F32_ATTN)
typedef float v16f __attribute__((vector_size(64)));

#if defined(__AVX512BF16__)
// the sums of 16 vectors, each over its own 16 lanes in one fixed tree (pairs, then pairs of pairs, ..):
// lane t of the result is x[t]'s sum (AVX2: key_scores16)
inline v16f hsum16(const v16f* x) {
  typedef int32_t v16i __attribute__((vector_size(64)));
  const v16i ev = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const v16i od = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  auto pair = [&](v16f a, v16f b) { return __builtin_shuffle(a, b, ev) + __builtin_shuffle(a, b, od); };
  v16f y[8], z[4];
  for (int t = 0; t < 8; ++t) y[t] = pair(x[2 * t], x[2 * t + 1]);
  for (int t = 0; t < 4; ++t) z[t] = pair(y[2 * t], y[2 * t + 1]);
  return pair(pair(z[0], z[1]), pair(z[2], z[3]));
}

inline __m512 widen16(__m256i b) {  // 16 bfloat16 (bits) -> float32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

inline __m512 load16f(const at::BFloat16* p) {  // 16 bfloat16 -> float32 (exact)
  return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// a row of 32 * NC bfloat16 -> float32 (exact) in pairs of vectors: out[2c] its elements 32c + 2l, out[2c + 1]
// its elements 32c + 2l + 1 (l < 16): one load and one instruction a vector
template <int NC>
inline void widen_pairs(const at::BFloat16* p, v16f* out) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int c = 0; c < NC; ++c) {
    const __m512i u = _mm512_loadu_si512(p + 32 * c);
    out[2 * c] = reinterpret_cast<v16f>(_mm512_slli_epi32(u, 16));
    out[2 * c + 1] = reinterpret_cast<v16f>(_mm512_and_si512(u, high));
  }
}

// float32 -> bfloat16 as c10::BFloat16 rounds (to nearest even, denormals kept; NaN -> 0x7fc0)
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0)));
}

inline void store16(at::BFloat16* p, __m256i b) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b); }

inline void store_bf16(at::BFloat16* p, v16f v) { store16(p, to_bf16(reinterpret_cast<__m512>(v))); }

// a query row as the scores read it: NC chunks of 32 bfloat16
typedef __m512bh QChunk;
template <int NC>
inline void load_query(const at::BFloat16* p, QChunk* q) {
  for (int c = 0; c < NC; ++c) q[c] = (__m512bh)_mm512_loadu_si512(p + 32 * c);
}

// one key's score lanes: lane l sums the products of elements 32c + 2l + 1, then 32c + 2l, chunk by chunk
template <int NC>
inline v16f key_lanes(const QChunk* q, const at::BFloat16* k) {
  __m512 d = _mm512_setzero_ps();
  for (int c = 0; c < NC; ++c) d = _mm512_dpbf16_ps(d, q[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
  return reinterpret_cast<v16f>(d);
}
#else
// AVX2 + FMA: the same operations on two halves of 8 lanes. A row of 32 * NC bfloat16 -> float32 in pairs
// of vectors, as the AVX-512 widen_pairs above
// 16 bfloat16 -> their even and odd elements as float32 (exact)
inline void widen8(const at::BFloat16* p, __m256& even, __m256& odd) {
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

template <int NC>
inline void widen_pairs(const at::BFloat16* p, v16f* out) {
  for (int c = 0; c < NC; ++c)
    for (int h = 0; h < 2; ++h)
      widen8(p + 32 * c + 16 * h, reinterpret_cast<__m256*>(&out[2 * c])[h],
             reinterpret_cast<__m256*>(&out[2 * c + 1])[h]);
}

// float32 -> bfloat16 as c10::BFloat16 rounds (to nearest even, denormals kept; NaN -> 0x7fc0), 8 values
inline __m128i to_bf16(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline __m256 widen8(__m128i b) {  // 8 bfloat16 (bits) -> float32 (exact)
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

// 16 values
inline void store_bf16(at::BFloat16* p, v16f v) {
  for (int h = 0; h < 2; ++h)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8 * h), to_bf16(reinterpret_cast<const __m256*>(&v)[h]));
}

// a query row as the scores read it: per chunk its even and odd elements as float32 (widen_pairs)
struct QChunk {
  v16f even, odd;
};
template <int NC>
inline void load_query(const at::BFloat16* p, QChunk* q) {
  v16f w[2 * NC];
  widen_pairs<NC>(p, w);
  for (int c = 0; c < NC; ++c) q[c] = QChunk{w[2 * c], w[2 * c + 1]};
}

// one key's score lanes (the key widened by widen_pairs) as vdpbf16ps defines them: each lane adds its
// odd element's exact product, rounds, then its even one's, chunk by chunk; the two halves of 8 lanes in
// registers (lanes as v16f went through the stack between the FMAs and the sums)
struct Lanes16 {
  __m256 lo, hi;
};

template <int NC>
inline Lanes16 widened_lanes(const QChunk* q, const v16f* w) {
  __m256 d[2];
  for (int h = 0; h < 2; ++h) {
    d[h] = _mm256_setzero_ps();
    for (int c = 0; c < NC; ++c) {
      auto half = [h](const v16f& v) { return reinterpret_cast<const __m256*>(&v)[h]; };
      d[h] = _mm256_fmadd_ps(half(q[c].even), half(w[2 * c]),
                             _mm256_fmadd_ps(half(q[c].odd), half(w[2 * c + 1]), d[h]));
    }
  }
  return {d[0], d[1]};
}

// hsum16's tree on lanes in registers: pair(a, b) holds a's neighbours' sums, then b's
inline Lanes16 lane_pairs(Lanes16 a, Lanes16 b) {
  auto sums = [](__m256 lo, __m256 hi) {  // lo0 + lo1, lo2 + lo3, .., hi6 + hi7
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(lo, hi)), 0xD8));
  };
  return {sums(a.lo, a.hi), sums(b.lo, b.hi)};
}

// the scaled scores of 16 widened keys kw for one query row (hsum16 of their widened_lanes, times scale)
template <int NC>
inline void key_scores16(const QChunk* q, const v16f (*kw)[2 * NC], float scale, float* out) {
  Lanes16 z[4];
  for (int g = 0; g < 4; ++g) {
    const Lanes16 y0 = lane_pairs(widened_lanes<NC>(q, kw[4 * g]), widened_lanes<NC>(q, kw[4 * g + 1]));
    const Lanes16 y1 = lane_pairs(widened_lanes<NC>(q, kw[4 * g + 2]), widened_lanes<NC>(q, kw[4 * g + 3]));
    z[g] = lane_pairs(y0, y1);
  }
  const Lanes16 t = lane_pairs(lane_pairs(z[0], z[1]), lane_pairs(z[2], z[3]));
  _mm256_storeu_ps(out, _mm256_mul_ps(t.lo, _mm256_set1_ps(scale)));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(t.hi, _mm256_set1_ps(scale)));
}
#endif

// attn_task for bfloat16 q and cache (AVX-512 BF16 and AVX2 builds, D a multiple of 32): the same fixed-order
// rule in float32, over a row's visible keys in parts of KEY_PART (the visible keys [k * KEY_PART, (k + 1) *
// KEY_PART) in cache order: a rule on the keys a row sees, never on where they sit in the cache). A score is
// one key's ``vdpbf16ps`` lanes (exact bfloat16 products, float32 sums; on AVX2 the same operations as FMAs)
// added in one tree (hsum16) and scaled;
// in each part, weights exp(s - the part's max) in float64 rounded to float32, 0 for a hidden key; the
// weighted values summed in float32 and the weights in float64, both over the part's keys in cache order (a
// hidden key adds nothing). The parts are then joined in order in float64 (combine_parts), one division and
// one rounding: a row of one part (up to KEY_PART keys) gets the bits of the one-pass rule. Nothing
// depends on the other rows of the call, nor on which task computed which part.
constexpr int64_t KEY_PART = 128;   // visible keys a part
constexpr int64_t SPLIT_ROWS = 10;  // a kv head's rows up to which a step's tasks are parts of keys (attn_bf16)

template <typename V>
void grow(V& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

// rows' parts: each part's max score, sum of weights and weighted values (NV vectors, widen_pairs' order)
struct PartSums {
  std::vector<float> m;
  std::vector<double> total;
  std::vector<v16f> acc;
  void fit(int64_t n, int NV) {
    grow(m, n);
    grow(total, n);
    grow(acc, n * NV);
  }
};

// a thread's attention buffers, grown as needed (a task allocates nothing)
struct AttnScratch {
  std::vector<QChunk> qb;
  std::vector<int64_t> qi, start;
  std::vector<const uint8_t*> mrow;
  std::vector<float> s;
  PartSums parts, shared;
};
thread_local AttnScratch attn_scratch;

// parts [0, np) of one row (m, total, acc at part k: m[k], total[k], acc[k * NV ..]) -> its output row:
// sum_k acc_k * exp(m_k - max) / sum_k total_k * exp(m_k - max) in float64, parts in order
template <int NV>
void combine_parts(const float* m, const double* total, const v16f* acc, int64_t np, at::BFloat16* op) {
  typedef float v8f __attribute__((vector_size(32)));
  constexpr float ninf = -std::numeric_limits<float>::infinity();
  float mx = ninf;
  for (int64_t k = 0; k < np; ++k) mx = std::max(mx, m[k]);
  v8d x[2 * NV] = {};
  double sum = 0.0;
  for (int64_t k0 = 0; mx != ninf && k0 < np; k0 += 8) {
    v8d d = v8d{} + NEG_INF;  // the parts' factors exp(m - max), 8 at a time (exp8(0) is exactly 1)
    for (int64_t k = k0; k < std::min(np, k0 + 8); ++k)
      if (m[k] != ninf) d[k - k0] = static_cast<double>(m[k]) - static_cast<double>(mx);
    const v8d f = exp8(d);
    for (int64_t k = k0; k < std::min(np, k0 + 8); ++k) {
      if (m[k] == ninf) continue;
      sum += total[k] * f[k - k0];
      for (int c = 0; c < NV; c += 2) {  // the pairs (widen_pairs) interleaved back: elements 32c/2 + 0..31
        const v16f e = acc[k * NV + c], o = acc[k * NV + c + 1];
        const v8f q0 = __builtin_shufflevector(e, o, 0, 16, 1, 17, 2, 18, 3, 19);
        const v8f q1 = __builtin_shufflevector(e, o, 4, 20, 5, 21, 6, 22, 7, 23);
        const v8f q2 = __builtin_shufflevector(e, o, 8, 24, 9, 25, 10, 26, 11, 27);
        const v8f q3 = __builtin_shufflevector(e, o, 12, 28, 13, 29, 14, 30, 15, 31);
        x[2 * c] += __builtin_convertvector(q0, v8d) * f[k - k0];
        x[2 * c + 1] += __builtin_convertvector(q1, v8d) * f[k - k0];
        x[2 * c + 2] += __builtin_convertvector(q2, v8d) * f[k - k0];
        x[2 * c + 3] += __builtin_convertvector(q3, v8d) * f[k - k0];
      }
    }
  }
  for (int c = 0; c < NV; ++c) {  // x / sum rounded to float32, then to bfloat16 as c10 rounds
    const v8f lo = __builtin_convertvector(sum > 0.0 ? x[2 * c] / sum : v8d{}, v8f);
    const v8f hi = __builtin_convertvector(sum > 0.0 ? x[2 * c + 1] / sum : v8d{}, v8f);
    const v16f y = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    store_bf16(op + 16 * c, y);
  }
}

// where a masked row's parts start: st[k] (k in [0, nparts]) is the position of its visible key
// k * KEY_PART, or L past its last one (the mask's bytes counted 8 at a time where contiguous)
void mask_part_starts(const uint8_t* m, int64_t stride, int64_t L, int64_t nparts, int64_t* st) {
  int64_t k = 0, seen = 0, j = 0;
  for (; j < L && k <= nparts; ++j) {
    if (stride == 1 && (j & 7) == 0 && j + 8 <= L) {
      uint64_t w;
      std::memcpy(&w, m + j, 8);  // bools: bytes of 0 or 1
      const int64_t cnt = static_cast<int64_t>((w * 0x0101010101010101ULL) >> 56);
      if (seen + cnt <= k * KEY_PART) {
        seen += cnt;
        j += 7;
        continue;
      }
    }
    if (!m[j * stride]) continue;
    if (seen == k * KEY_PART) st[k++] = j;
    ++seen;
  }
  for (; k <= nparts; ++k) st[k] = L;
}

// rows [r0, r1) of kv head ``kvh`` of sequence ``b``, parts [p0, p1) of their keys (of ``nparts``; a
// masked row's starts in ``mask_starts``, (b * Q + i) * (nparts + 1) + k): the rows' outputs when that is
// all parts; else their part sums into ``shared`` (rows (b * Q + i) * H + h, ``nparts`` entries each)
template <int NC>
void attn_task_bf16(const AttnArgs& a, const at::BFloat16* q, const at::BFloat16* cache, at::BFloat16* out,
                    int64_t b, int64_t kvh, int64_t r0, int64_t r1, int64_t p0, int64_t p1, int64_t nparts,
                    const int64_t* mask_starts, PartSums* shared) {
  constexpr int NV = 2 * NC;  // float32 vectors of a value row
  const int64_t D = a.D, L = a.L, G = a.G, nr = r1 - r0, np = p1 - p0;
  const int64_t i_max = (r1 - 1) / G;
  const int64_t jend = a.causal ? std::min(L, i_max + 1) : L;
  const int64_t* tab = a.tables + b * a.NB;
  const int64_t BS = a.BS, shift = a.bs_shift, low = BS - 1;
  auto at = [&](int64_t kv, int64_t p) -> const at::BFloat16* {
    return cache + (((tab[p >> shift] * 2 + kv) * a.Hkv + kvh) * BS + (p & low)) * D;
  };
  AttnScratch& sc = attn_scratch;
  grow(sc.qb, nr * NC);
  grow(sc.qi, nr);
  grow(sc.start, nr * (np + 1));  // row r's part k starts at start[r * (np + 1) + k]
  grow(sc.mrow, nr);
  QChunk* qb = sc.qb.data();
  int64_t *qi = sc.qi.data(), *start = sc.start.data();
  const uint8_t** mrow = sc.mrow.data();
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t i = (r0 + r) / G, h = kvh * G + (r0 + r) % G;
    qi[r] = i;
    const at::BFloat16* qp = q + b * a.qs0 + i * a.qs1 + h * a.qs2;
    load_query<NC>(qp, &qb[r * NC]);
    const uint8_t* m = a.mask ? a.mask + b * a.ms0 + i * a.ms2 : nullptr;
    mrow[r] = m;
    int64_t* st = &start[r * (np + 1)];
    if (m) {
      std::memcpy(st, mask_starts + (b * a.Q + i) * (nparts + 1) + p0, (np + 1) * sizeof(int64_t));
    } else {
      const int64_t n = a.causal ? std::min(L, i + 1) : L;
      for (int64_t k = 0; k <= np; ++k) st[k] = std::min((p0 + k) * KEY_PART, n);
    }
  }
  sc.parts.fit(nr * np, NV);
  float* pmax = sc.parts.m.data();  // part k of row r: pmax[r * np + k], ptotal[..], pacc[(r * np + k) * NV ..]
  double* ptotal = sc.parts.total.data();
  v16f* pacc = sc.parts.acc.data();
  const float scale = static_cast<float>(a.scale), ninf = -std::numeric_limits<float>::infinity();
  const at::BFloat16* kp[KEY_BLOCK];
  for (int64_t k = 0; k < np; ++k) {
    int64_t lo = jend, hi = 0;
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t* st = &start[r * (np + 1) + k];
      if (st[1] > st[0]) lo = std::min(lo, st[0]), hi = std::max(hi, st[1]);
    }
    const int64_t sstride = hi > lo ? (hi - lo + 15) / 16 * 16 : 0;
    grow(sc.s, nr * sstride);
    float* s = sc.s.data();
    // scores, 16 keys at a time (the last group's missing keys repeat a key; their scores land in the
    // row's padding, set to -inf below), -inf outside the row's part and for a hidden key
    for (int64_t jb = lo; jb < hi; jb += KEY_BLOCK) {
      const int64_t jn = std::min(KEY_BLOCK, hi - jb);
      for (int64_t j = 0; j < jn; ++j) kp[j] = (j == 0 || ((jb + j) & low) == 0) ? at(0, jb + j) : kp[j - 1] + D;
      for (int64_t j = jn; j < (jn + 15) / 16 * 16; ++j) kp[j] = kp[jn - 1];
      {  // the next block's keys and this block's values, on their way while the scores are computed
        const int64_t nn = std::min(KEY_BLOCK, hi - jb - KEY_BLOCK);
        for (int64_t j = 0; j < nn; j += BS - ((jb + KEY_BLOCK + j) & low)) {
          const char* p = reinterpret_cast<const char*>(at(0, jb + KEY_BLOCK + j));
          const int64_t run = std::min(BS - ((jb + KEY_BLOCK + j) & low), nn - j) * D * 2;
          for (int64_t o = 0; o < run; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
        }
        for (int64_t j = 0; j < jn; j += BS - ((jb + j) & low)) {
          const char* p = reinterpret_cast<const char*>(at(1, jb + j));
          const int64_t run = std::min(BS - ((jb + j) & low), jn - j) * D * 2;
          for (int64_t o = 0; o < run; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
        }
      }
#if !defined(__AVX512BF16__)
      // AVX2: each 16 keys widened once for all the rows (vdpbf16ps reads them as stored, row by row below)
      for (int64_t j0 = 0; j0 < jn; j0 += 16) {
        v16f kw[16][2 * NC];
        for (int t = 0; t < 16; ++t) widen_pairs<NC>(kp[j0 + t], kw[t]);
        for (int64_t r = 0; r < nr; ++r) key_scores16<NC>(&qb[r * NC], kw, scale, s + r * sstride + (jb - lo) + j0);
      }
#endif
      for (int64_t r = 0; r < nr; ++r) {
        float* sr = s + r * sstride + (jb - lo);
#if defined(__AVX512BF16__)
        const QChunk* qv = &qb[r * NC];
        for (int64_t j0 = 0; j0 < jn; j0 += 16) {
          v16f x[16];
          for (int t = 0; t < 16; ++t) x[t] = key_lanes<NC>(qv, kp[j0 + t]);
          const v16f sc = hsum16(x) * scale;
          std::memcpy(sr + j0, &sc, sizeof(sc));
        }
#endif
        const int64_t* st = &start[r * (np + 1) + k];
        const int64_t a0 = std::clamp(st[0] - jb, int64_t{0}, jn), a1 = std::clamp(st[1] - jb, a0, jn);
        for (int64_t j = 0; j < a0; ++j) sr[j] = ninf;
        for (int64_t j = a1; j < jn; ++j) sr[j] = ninf;
        if (const uint8_t* m = mrow[r])
          for (int64_t j = a0; j < a1; ++j)
            if (!m[(jb + j) * a.ms3]) sr[j] = ninf;
      }
    }
    // weights
    for (int64_t r = 0; r < nr; ++r) {
      float* sr = s + r * sstride;
      for (int64_t j = std::max<int64_t>(hi - lo, 0); j < sstride; ++j) sr[j] = ninf;
      pmax[r * np + k] = sstride ? row_weights(sr, sstride, 0.0) : ninf;
      ptotal[r * np + k] = 0.0;
      for (int c = 0; c < NV; ++c) pacc[(r * np + k) * NV + c] = v16f{};
    }
    // weighted values, rows in tiles that share each value widened from the cache (a row's sums are its
    // own: tiling changes no order; every row once), a value row as pairs of vectors (widen_pairs)
    auto value_tile = [&](auto rows, int64_t r, int64_t jb, int64_t jn) {
      constexpr int RT = decltype(rows)::value;
      const float* p[RT];
      v16f acc[RT][NV];
      double t[RT];
      for (int e = 0; e < RT; ++e) {
        p[e] = s + (r + e) * sstride + (jb - lo);
        for (int c = 0; c < NV; ++c) acc[e][c] = pacc[((r + e) * np + k) * NV + c];
        t[e] = ptotal[(r + e) * np + k];
      }
      const at::BFloat16* row = nullptr;
#if defined(__AVX512BF16__)
      for (int64_t j = 0; j < jn; ++j) {  // a key a row does not see is never read for it
        row = (j == 0 || ((jb + j) & low) == 0) ? at(1, jb + j) : row + D;
        v16f vv[NV];
        widen_pairs<NC>(row, vv);
        for (int e = 0; e < RT; ++e) {
          const float w = p[e][j];
          if (w != 0.0f) {
            t[e] += w;
            for (int c = 0; c < NV; ++c) acc[e][c] += w * vv[c];
          }
        }
      }
#else
      // AVX2: the same sums as FMAs on halves of the vectors, each 16 values widened as they are used
      for (int64_t j = 0; j < jn; ++j) {
        row = (j == 0 || ((jb + j) & low) == 0) ? at(1, jb + j) : row + D;
        __m256 wv[RT];
        bool any = false;
        for (int e = 0; e < RT; ++e) {
          wv[e] = _mm256_set1_ps(p[e][j]);
          any |= p[e][j] != 0.0f;
          if (p[e][j] != 0.0f) t[e] += p[e][j];
        }
        if (!any) continue;
        for (int c = 0; c < NC; ++c)
          for (int h = 0; h < 2; ++h) {
            __m256 ev, od;
            widen8(row + 32 * c + 16 * h, ev, od);
            for (int e = 0; e < RT; ++e) {
              if (p[e][j] == 0.0f) continue;
              __m256* ae = reinterpret_cast<__m256*>(&acc[e][2 * c]);
              ae[h] = _mm256_fmadd_ps(wv[e], ev, ae[h]);
              ae[2 + h] = _mm256_fmadd_ps(wv[e], od, ae[2 + h]);
            }
          }
      }
#endif
      for (int e = 0; e < RT; ++e) {
        for (int c = 0; c < NV; ++c) pacc[((r + e) * np + k) * NV + c] = acc[e][c];
        ptotal[(r + e) * np + k] = t[e];
      }
    };
#if defined(__AVX512BF16__)
    constexpr int TILE = NV <= 4 ? 4 : 2;  // accumulators in registers
#else
    constexpr int TILE = 1;  // accumulators in registers (16 ymm)
#endif
    for (int64_t jb = lo; jb < hi; jb += KEY_BLOCK) {
      const int64_t jn = std::min(KEY_BLOCK, hi - jb);
      int64_t r = 0;
      for (; r + TILE <= nr; r += TILE) value_tile(std::integral_constant<int, TILE>{}, r, jb, jn);
      switch (nr - r) {
        case 3: value_tile(std::integral_constant<int, 3>{}, r, jb, jn); break;
        case 2: value_tile(std::integral_constant<int, 2>{}, r, jb, jn); break;
        case 1: value_tile(std::integral_constant<int, 1>{}, r, jb, jn); break;
        default: break;
      }
    }
  }
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t i = qi[r], h = kvh * G + (r0 + r) % G, g = (b * a.Q + i) * a.H + h;
    if (shared == nullptr) {
      combine_parts<NV>(pmax + r * np, ptotal + r * np, pacc + r * np * NV, np, out + g * D);
      continue;
    }
    for (int64_t k = 0; k < np; ++k) {
      shared->m[g * nparts + p0 + k] = pmax[r * np + k];
      shared->total[g * nparts + p0 + k] = ptotal[r * np + k];
      for (int c = 0; c < NV; ++c) shared->acc[(g * nparts + p0 + k) * NV + c] = pacc[(r * np + k) * NV + c];
    }
  }
}
#endif

// Rows of one kv head per task: ROW_CHUNK, or fewer where that gives under two tasks a thread. A
// verification of a few tokens has one task per kv head (3 for 2 threads: 2 + 1 kv heads, the attention's
// time that of 2); cut in two (an even number of rows first: rows go in pairs) they make 6 tasks. Each task
// reads its kv head's keys and values, so chunks of under 4 rows (a one-token step's 3) stay whole. A
// row's result does not depend on its task.
int64_t attn_chunk_rows(int64_t R, int64_t heads, bool parallel) {
  const int64_t want = 2 * at::get_num_threads();
  if (!parallel || heads * ((R + ROW_CHUNK - 1) / ROW_CHUNK) >= want) return ROW_CHUNK;
  const int64_t per = (want + heads - 1) / heads;  // chunks a kv head
  const int64_t rows = ((R + per - 1) / per + 1) / 2 * 2;
  return rows < 4 ? ROW_CHUNK : std::min(ROW_CHUNK, rows);
}

// the tasks: (sequence, kv head, chunk of rows), on the intra-op threads when ``parallel``
template <typename F>
void attn_run_tasks(const AttnArgs& a, bool parallel, F task) {
  const int64_t R = a.Q * a.G;
  const int64_t rows = attn_chunk_rows(R, a.B * a.Hkv, parallel);
  const int64_t chunks = (R + rows - 1) / rows;
  const int64_t ntasks = a.B * a.Hkv * chunks;
  auto run = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t ch = t % chunks, kvh = (t / chunks) % a.Hkv, b = t / (chunks * a.Hkv);
      task(b, kvh, ch * rows, std::min(R, (ch + 1) * rows));
    }
  };
  if (parallel && ntasks > 1) {
    at::parallel_for(0, ntasks, 1, run);
  } else {
    run(0, ntasks);
  }
}

template <typename T, int NC>
void attn_run(const AttnArgs& a, const T* q, const T* cache, T* out, bool parallel) {
  attn_run_tasks(a, parallel, [&](int64_t b, int64_t kvh, int64_t r0, int64_t r1) {
    attn_task<T, NC>(a, q, cache, out, b, kvh, r0, r1);
  });
}

#if defined(SPECSERVE_F32_ATTN)
// tasks [0, n) on the intra-op threads when ``parallel``, each thread taking the next task as it frees up
// (a busy core of a shared machine takes fewer)
template <typename F>
void run_tasks_dynamic(int64_t n, bool parallel, F task) {
  const int64_t workers = parallel ? std::min<int64_t>(at::get_num_threads(), n) : 1;
  if (workers < 2) {
    for (int64_t t = 0; t < n; ++t) task(t);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < n;) task(t);
  });
}

// the float32 kernel's tasks. A step of few rows (up to SPLIT_ROWS a kv head, fewer tasks of whole rows
// than two a thread) over more than one part of keys: a task per part (and per chunk of rows where parts
// alone make under four tasks a thread), the full parts first, each row's parts joined by the task that
// finishes its rows' last part; else attn_run_tasks' tasks, each over all parts of its rows.
template <int NC>
void attn_bf16(const AttnArgs& a, const at::BFloat16* q, const at::BFloat16* cache, at::BFloat16* out,
               bool parallel) {
  constexpr int NV = 2 * NC;
  const int64_t R = a.Q * a.G, heads = a.B * a.Hkv, threads = at::get_num_threads();
  const int64_t nparts = std::max<int64_t>(1, (a.L + KEY_PART - 1) / KEY_PART);
  std::vector<int64_t> mask_starts;
  if (a.mask) {
    mask_starts.resize(a.B * a.Q * (nparts + 1));
    for (int64_t b = 0; b < a.B; ++b)
      for (int64_t i = 0; i < a.Q; ++i)
        mask_part_starts(a.mask + b * a.ms0 + i * a.ms2, a.ms3, a.L, nparts,
                         &mask_starts[(b * a.Q + i) * (nparts + 1)]);
  }
  if (!parallel || nparts == 1 || R > SPLIT_ROWS || heads * ((R + ROW_CHUNK - 1) / ROW_CHUNK) >= 2 * threads)
    return attn_run_tasks(a, parallel, [&](int64_t b, int64_t kvh, int64_t r0, int64_t r1) {
      attn_task_bf16<NC>(a, q, cache, out, b, kvh, r0, r1, 0, nparts, nparts, mask_starts.data(), nullptr);
    });
  const int64_t rows = heads * nparts >= 4 * threads ? ROW_CHUNK : attn_chunk_rows(R, heads, true);
  const int64_t chunks = (R + rows - 1) / rows, groups = heads * chunks;
  PartSums& shared = attn_scratch.shared;  // the calling thread's
  shared.fit(a.B * a.Q * a.H * nparts, NV);
  std::unique_ptr<std::atomic<int64_t>[]> done(new std::atomic<int64_t>[groups]);
  for (int64_t g = 0; g < groups; ++g) done[g].store(0, std::memory_order_relaxed);
  run_tasks_dynamic(groups * nparts, true, [&](int64_t t) {
    const int64_t p = t / groups, grp = t % groups;
    const int64_t ch = grp % chunks, kvh = (grp / chunks) % a.Hkv, b = grp / (chunks * a.Hkv);
    const int64_t r0 = ch * rows, r1 = std::min(R, r0 + rows);
    attn_task_bf16<NC>(a, q, cache, out, b, kvh, r0, r1, p, p + 1, nparts, mask_starts.data(), &shared);
    if (done[grp].fetch_add(1, std::memory_order_acq_rel) + 1 != nparts) return;
    for (int64_t r = r0; r < r1; ++r) {  // the group's last part: its rows' outputs
      const int64_t g = (b * a.Q + r / a.G) * a.H + kvh * a.G + r % a.G;
      combine_parts<NV>(&shared.m[g * nparts], &shared.total[g * nparts], &shared.acc[g * nparts * NV], nparts,
                        out + g * a.D);
    }
  });
}
#endif

bool g_float64_attention = false;  // bfloat16 rows too through the float64 kernel (set_float64_attention)

template <typename T>
void attn_dispatch(const AttnArgs& a, const T* q, const T* cache, T* out, bool parallel) {
#if defined(SPECSERVE_F32_ATTN)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (!g_float64_attention && (a.D == 64 || a.D == 128))
      return a.D == 64 ? attn_bf16<2>(a, q, cache, out, parallel) : attn_bf16<4>(a, q, cache, out, parallel);
  }
#endif
  switch (a.D / 8) {
    case 2: return attn_run<T, 2>(a, q, cache, out, parallel);
    case 4: return attn_run<T, 4>(a, q, cache, out, parallel);
    case 8: return attn_run<T, 8>(a, q, cache, out, parallel);
    case 16: return attn_run<T, 16>(a, q, cache, out, parallel);
    default: return attn_run<T, 0>(a, q, cache, out, parallel);
  }
}

}  // namespace

// q [B, Q, H, D] (last dim contiguous), cache: the block pool [blocks, 2, Hkv, BS, D] contiguous, tables
// int64 [B, NB] (each row's blocks, NB * BS >= kv_len), mask bool [B, 1, Q, L] or None -> [B, Q, H * D].
// Work above ``parallel_work`` multiply-adds runs on the intra-op threads.
at::Tensor attention(at::Tensor q, at::Tensor cache, at::Tensor tables, int64_t kv_len,
                     c10::optional<at::Tensor> mask, bool causal, double scale, int64_t parallel_work) {
  TORCH_CHECK(q.dim() == 4 && cache.dim() == 5, "attention: q [B, Q, H, D], cache [blocks, 2, Hkv, BS, D]");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "attention: q and cache dtypes differ");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, "attention: bf16 or f32");
  if (q.stride(3) != 1) q = q.contiguous();
  cache = cache.contiguous();  // a no-op for the KV cache
  AttnArgs a{};
  a.B = q.size(0);
  a.Q = q.size(1);
  a.H = q.size(2);
  a.D = q.size(3);
  a.Hkv = cache.size(2);
  a.BS = cache.size(3);
  TORCH_CHECK(a.BS > 0 && (a.BS & (a.BS - 1)) == 0, "attention: the block size must be a power of two");
  a.bs_shift = 0;
  while ((int64_t{1} << a.bs_shift) < a.BS) ++a.bs_shift;
  a.L = kv_len;
  TORCH_CHECK(a.D % 8 == 0 && cache.size(4) == a.D && a.H % a.Hkv == 0, "attention: shapes");
  tables = tables.contiguous();
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.size(0) == a.B &&
                  tables.size(1) * a.BS >= kv_len && kv_len >= 0, "attention: tables [B, NB] int64 cover kv_len");
  a.tables = tables.data_ptr<int64_t>();
  a.NB = tables.size(1);
  {
    const int64_t nb_used = (kv_len + a.BS - 1) / a.BS, nblocks = cache.size(0);
    for (int64_t b = 0; b < a.B; ++b)
      for (int64_t i = 0; i < nb_used; ++i)
        TORCH_CHECK(a.tables[b * a.NB + i] >= 0 && a.tables[b * a.NB + i] < nblocks, "attention: block id");
  }
  a.G = a.H / a.Hkv;
  a.qs0 = q.stride(0);
  a.qs1 = q.stride(1);
  a.qs2 = q.stride(2);
  a.causal = causal;
  a.scale = scale;
  at::Tensor m;
  a.mask = nullptr;
  if (mask.has_value() && mask->defined()) {
    m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(-1) == kv_len, "attention: mask");
    m = m.expand({a.B, 1, a.Q, kv_len});
    a.mask = reinterpret_cast<const uint8_t*>(m.data_ptr<bool>());
    a.ms0 = m.stride(0);
    a.ms2 = m.stride(2);
    a.ms3 = m.stride(3);
    a.causal = false;
  }
  auto out = at::empty({a.B, a.Q, a.H * a.D}, q.options());
  const bool parallel = at::get_num_threads() > 1 && a.B * a.Q * a.H * a.L * a.D >= parallel_work;
  if (q.scalar_type() == at::kBFloat16) {
    attn_dispatch(a, q.data_ptr<at::BFloat16>(), cache.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                  parallel);
  } else {
    attn_dispatch(a, q.data_ptr<float>(), cache.data_ptr<float>(), out.data_ptr<float>(), parallel);
  }
  return out;
}

namespace {

// torch's float32 sum of a contiguous row (aten/src/ATen/native/cpu/SumKernel.cpp: vectorized_inner_sum,
// row_sum, multi_row_sum) with Vectorized<float> of ``W`` lanes
template <int W>
float torch_row_sum(const float* x, int64_t n) {
  using Vec = std::array<float, W>;
  constexpr int64_t ilp = 4, levels = 4;
  const int64_t vec_size = n / W;
  const int64_t size = vec_size / ilp;  // rows of ilp vectors
  auto add = [](Vec& acc, const float* p) {
    for (int k = 0; k < W; ++k) acc[k] += p[k];
  };
  auto addv = [](Vec& acc, const Vec& v) {
    for (int k = 0; k < W; ++k) acc[k] += v[k];
  };
  Vec zero{};
  std::array<std::array<Vec, ilp>, levels> acc;
  for (auto& l : acc)
    for (auto& v : l) v = zero;
  int64_t ceil_log2 = 1;
  if (size > 2) {
    ceil_log2 = 64 - __builtin_clzll(static_cast<uint64_t>(size - 1));
  }
  const int64_t level_power = std::max<int64_t>(4, ceil_log2 / levels);
  const int64_t level_step = int64_t(1) << level_power;
  const int64_t level_mask = level_step - 1;
  int64_t i = 0;
  for (; i + level_step <= size;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int64_t k = 0; k < ilp; ++k) add(acc[0][k], x + (i * ilp + k) * W);
    for (int64_t j = 1; j < levels; ++j) {
      for (int64_t k = 0; k < ilp; ++k) {
        addv(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = zero;
      }
      const int64_t mask = level_mask << (j * level_power);
      if ((i & mask) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int64_t k = 0; k < ilp; ++k) add(acc[0][k], x + (i * ilp + k) * W);
  for (int64_t j = 1; j < levels; ++j)
    for (int64_t k = 0; k < ilp; ++k) addv(acc[0][k], acc[j][k]);
  Vec part = acc[0][0];
  for (int64_t v = size * ilp; v < vec_size; ++v) add(part, x + v * W);
  for (int64_t k = 1; k < ilp; ++k) addv(part, acc[0][k]);
  float final_acc = 0.f;
  for (int64_t t = vec_size * W; t < n; ++t) final_acc += x[t];
  for (int k = 0; k < W; ++k) final_acc += part[k];
  return final_acc;
}

inline float bf(at::BFloat16 v) { return static_cast<float>(v); }

// The row ops' vectors (norm_row, add_row, widen_row, rotate, silu_mul): float32 lanes of the build's
// width; each lane computes what the scalar code computes (a product or sum rounded once to bfloat16, as
// c10 rounds: to_bf16), so the vector and scalar paths give the same bits.
#if defined(__AVX512BF16__)
#define SPECSERVE_ROW_VEC 1
constexpr int64_t kRowLanes = 16;
typedef __m512 RowVec;
inline RowVec row_load(const at::BFloat16* p) { return load16f(p); }
inline void row_store(at::BFloat16* p, RowVec v) { store16(p, to_bf16(v)); }
inline RowVec row_round(RowVec v) { return widen16(to_bf16(v)); }  // bfloat16(v) as float32
// libtorch_cpu's, what Vectorized<float>::exp() calls; weak: a torch without it takes torch's ops
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));
inline bool row_exp_available() { return Sleef_expf16_u10 != nullptr; }
inline RowVec row_exp(RowVec x) { return Sleef_expf16_u10(x); }
#elif defined(__AVX2__) && defined(__FMA__)
#define SPECSERVE_ROW_VEC 1
constexpr int64_t kRowLanes = 8;
typedef __m256 RowVec;
inline RowVec row_load(const at::BFloat16* p) { return widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void row_store(at::BFloat16* p, RowVec v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(v)); }
inline RowVec row_round(RowVec v) { return widen8(to_bf16(v)); }
// the AVX2 build of torch's Vectorized<float>::exp() calls this one (libtorch_cpu's sleef)
extern "C" __m256 Sleef_expf8_u10(__m256) __attribute__((weak));
inline bool row_exp_available() { return Sleef_expf8_u10 != nullptr; }
inline RowVec row_exp(RowVec x) { return Sleef_expf8_u10(x); }
#endif
#if defined(SPECSERVE_ROW_VEC)
inline RowVec row_load(const float* p) {
  RowVec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void row_store(float* p, RowVec v) { std::memcpy(p, &v, sizeof(v)); }
inline RowVec row_set(float x) { return RowVec{} + x; }
#endif

// one row: ``src`` (bfloat16 values as float32) -> normed (bfloat16)
void norm_row(const float* xf, float* sq, const at::BFloat16* w, at::BFloat16* out, int64_t n, float eps,
              int64_t vec) {
  int64_t k = 0;
#if defined(SPECSERVE_ROW_VEC)
  for (; k + kRowLanes <= n; k += kRowLanes) {
    const RowVec v = row_load(xf + k);
    row_store(sq + k, v * v);
  }
#endif
  for (; k < n; ++k) sq[k] = xf[k] * xf[k];
  const float sum = vec == 16 ? torch_row_sum<16>(sq, n) : torch_row_sum<8>(sq, n);
  const float mean = sum / static_cast<float>(n);
  const float r = 1.0f / std::sqrt(mean + eps);
  k = 0;
#if defined(SPECSERVE_ROW_VEC)
  const RowVec rv = row_set(r);
  for (; k + kRowLanes <= n; k += kRowLanes) row_store(out + k, row_load(w + k) * row_round(row_load(xf + k) * rv));
#endif
  for (; k < n; ++k) {
    const float y = bf(at::BFloat16(xf[k] * r));
    out[k] = at::BFloat16(bf(w[k]) * y);
  }
}

// row i of residual + x, rounded to bfloat16, into out and (as float32) xf
void add_row(const at::BFloat16* pr, const at::BFloat16* px, at::BFloat16* out, float* xf, int64_t n) {
  int64_t k = 0;
#if defined(SPECSERVE_ROW_VEC)
  for (; k + kRowLanes <= n; k += kRowLanes) {
    const RowVec s = row_round(row_load(pr + k) + row_load(px + k));
    row_store(out + k, s);  // exact: s is a bfloat16 value
    row_store(xf + k, s);
  }
#endif
  for (; k < n; ++k) {
    const at::BFloat16 s(bf(pr[k]) + bf(px[k]));
    out[k] = s;
    xf[k] = bf(s);
  }
}

// row of bfloat16 -> float32
void widen_row(const at::BFloat16* p, float* xf, int64_t n) {
  int64_t k = 0;
#if defined(SPECSERVE_ROW_VEC)
  for (; k + kRowLanes <= n; k += kRowLanes) row_store(xf + k, row_load(p + k));
#endif
  for (; k < n; ++k) xf[k] = bf(p[k]);
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "rms_norm: bfloat16 only");
  TORCH_CHECK(w.dim() == 1 && x.size(-1) == w.size(0), "rms_norm: weight size");
}

void check_head_rows(const at::Tensor& x, const at::Tensor& w) {  // a weight [n] or [m, n] per row of x [.., m, n]
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "rms_norm: bfloat16 only");
  TORCH_CHECK((w.dim() == 1 && x.size(-1) == w.size(0)) ||
                  (w.dim() == 2 && x.dim() >= 2 && x.size(-2) == w.size(0) && x.size(-1) == w.size(1)),
              "rms_norm: weight size");
}

}  // namespace

std::vector<at::Tensor> add_rms_norm(at::Tensor residual, at::Tensor x, at::Tensor weight, double eps,
                                     int64_t vec) {
  check_rows(residual, weight);
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(), "add_rms_norm: shapes");
  residual = residual.contiguous();
  x = x.contiguous();
  weight = weight.contiguous();
  auto new_res = at::empty_like(residual, at::MemoryFormat::Contiguous);
  auto normed = at::empty_like(residual, at::MemoryFormat::Contiguous);
  const int64_t n = weight.size(0), rows = residual.numel() / std::max<int64_t>(n, 1);
  const auto* pr = residual.data_ptr<at::BFloat16>();
  const auto* px = x.data_ptr<at::BFloat16>();
  const auto* pw = weight.data_ptr<at::BFloat16>();
  auto* po = new_res.data_ptr<at::BFloat16>();
  auto* pn = normed.data_ptr<at::BFloat16>();
  std::vector<float> xf(n), sq(n);
  for (int64_t row = 0; row < rows; ++row) {
    add_row(pr + row * n, px + row * n, po + row * n, xf.data(), n);
    norm_row(xf.data(), sq.data(), pw, pn + row * n, n, static_cast<float>(eps), vec);
  }
  return {new_res, normed};
}

// weight [n], or [m, n]: a weight row per row of x's last two dims [.., m, n] (heads normed by their own)
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps, int64_t vec) {
  check_head_rows(x, weight);
  x = x.contiguous();
  weight = weight.contiguous();
  auto normed = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t n = weight.size(-1), m = weight.dim() == 2 ? weight.size(0) : 1;
  const int64_t rows = x.numel() / std::max<int64_t>(n, 1);
  const auto* px = x.data_ptr<at::BFloat16>();
  const auto* pw = weight.data_ptr<at::BFloat16>();
  auto* pn = normed.data_ptr<at::BFloat16>();
  std::vector<float> xf(n), sq(n);
  for (int64_t row = 0; row < rows; ++row) {
    widen_row(px + row * n, xf.data(), n);
    norm_row(xf.data(), sq.data(), pw + (row % m) * n, pn + row * n, n, static_cast<float>(eps), vec);
  }
  return normed;
}

// quant_gemm.cpp
at::Tensor group_gemm(at::Tensor x, at::Tensor packed, int64_t bits, int64_t grain, int64_t max_tile);
bool group_gemm_available();
// quant_gemm_a8.cpp
at::Tensor group_gemm_a8(at::Tensor x, at::Tensor packed, int64_t bits, int64_t grain, int64_t max_tile);
bool group_gemm_a8_available();

namespace {

constexpr int64_t kInt8Activations = 16;  // a linear's ``bits`` with this flag: group_gemm_a8's layout

// x [rows, K] -> [rows, n] through a group-quantized weight (its padded output columns dropped)
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t n, int64_t grain,
                  int64_t tile) {
  auto y = bits & kInt8Activations ? group_gemm_a8(x, packed, bits & ~kInt8Activations, grain, tile)
                                   : group_gemm(x, packed, bits, grain, tile);
  return y.size(1) == n ? y : y.narrow(1, 0, n);
}

// rotate_ (layers/rotary.py) on the q and k heads of qkv [T, heads, D] in place, bit for bit:
// x * cos + roll(x, D / 2) * signed_sin, each product and the sum rounded to bfloat16 as torch's
// bfloat16 mul_ / add_ do; cos, sin: [T, D], position t's row at t * cs
void rotate(at::BFloat16* qkv, int64_t T, int64_t heads_total, int64_t heads, int64_t D, const at::BFloat16* cos,
            const at::BFloat16* sin, int64_t cs) {
#if defined(SPECSERVE_ROW_VEC)
  constexpr int64_t kMaxVecs = 256 / kRowLanes;
  if (D % (2 * kRowLanes) == 0 && D <= 256) {  // a vector of lanes at a time: roll(x, D / 2) is whole vectors
    const int64_t C = D / kRowLanes;
    RowVec cv[kMaxVecs], sv[kMaxVecs], xv[kMaxVecs];
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t c = 0; c < C; ++c) {
        cv[c] = row_load(cos + t * cs + kRowLanes * c);
        sv[c] = row_load(sin + t * cs + kRowLanes * c);
      }
      for (int64_t hh = 0; hh < heads; ++hh) {
        at::BFloat16* x = qkv + (t * heads_total + hh) * D;
        for (int64_t c = 0; c < C; ++c) xv[c] = row_load(x + kRowLanes * c);
        for (int64_t c = 0; c < C; ++c)
          row_store(x + kRowLanes * c, row_round(xv[c] * cv[c]) + row_round(xv[(c + C / 2) % C] * sv[c]));
      }
    }
    return;
  }
#endif
  std::vector<float> row(D);
  for (int64_t t = 0; t < T; ++t) {
    const at::BFloat16* c = cos + t * cs;
    const at::BFloat16* s = sin + t * cs;
    for (int64_t hh = 0; hh < heads; ++hh) {
      at::BFloat16* x = qkv + (t * heads_total + hh) * D;
      for (int64_t d = 0; d < D; ++d) row[d] = bf(x[d]);
      for (int64_t d = 0; d < D; ++d) {
        const at::BFloat16 swapped(row[(d + D / 2) % D] * bf(s[d]));
        const at::BFloat16 scaled(row[d] * bf(c[d]));
        x[d] = at::BFloat16(bf(scaled) + bf(swapped));
      }
    }
  }
}

// silu(gate) * up for gu [T, 2 n] = (gate | up), bfloat16, as at::silu_ then at::mul compute it: silu in
// float32, x / (1 + exp(-x)) with torch's vectorised exp, rounded to bfloat16; the product of the two
// bfloat16 values (exact in float32) rounded once. The vector path (AVX-512 or AVX2, libtorch's exp found)
// takes n a multiple of its lanes (the group kernel's inputs are multiples of 32; torch's ops otherwise);
// rows split over the intra-op threads from 4 rows.
at::Tensor silu_mul(const at::Tensor& gu, int64_t n) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) == 2 * n && gu.scalar_type() == at::kBFloat16,
              "silu_mul: gu must be [T, 2 n] bfloat16");
  const int64_t T = gu.size(0);
#if defined(SPECSERVE_ROW_VEC)
  if (row_exp_available() && n % kRowLanes == 0 && gu.is_contiguous()) {
    auto m = at::empty({T, n}, gu.options());
    const auto* pg = gu.data_ptr<at::BFloat16>();
    auto* pm = m.data_ptr<at::BFloat16>();
    const RowVec one = row_set(1.f);
    auto rows = [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t j = 0; j < n; j += kRowLanes) {
          const RowVec x = row_load(pg + t * 2 * n + j);
          const RowVec silu = row_round(x / (one + row_exp(RowVec{} - x)));
          row_store(pm + t * n + j, silu * row_load(pg + t * 2 * n + n + j));
        }
    };
    if (T >= 4)
      at::parallel_for(0, T, 1, rows);
    else
      rows(0, T);
    return m;
  }
#endif
  auto gate = gu.narrow(1, 0, n).clone();
  at::silu_(gate);
  return at::mul(gate, gu.narrow(1, n, n));
}

}  // namespace

// One Llama decoder layer in bfloat16 with group-quantized linears (``GroupKernel``) and the float64
// attention above: ``LlamaDecoderLayer.forward_fused`` in one call, the same bits. h: the residual stream
// [B, Q, d]; x: the previous layer's MLP output not yet added (None for the first layer); ln: the two norm
// weights; w / bits / n: packed qkv, o, gate_up, down with their code bits and output features; heads:
// (H, Hkv, D); cos, sin [B or 1, Q, 1, D] (``RotaryEmbedding.rotation``); cache, tables: the block pool and
// the rows' block tables (``attention``); widx [B, Q]: the cache position each new token is written to (-1:
// the scratch entry, block 0 offset 0); qk_norm: None, or the per-head norm weights of the q heads stacked over
// those of the k heads, [H + Hkv, D] (Qwen3's q_norm / k_norm, as ``rms_norm`` norms them, before the
// rotation). Returns (h, mlp output).
std::vector<at::Tensor> decoder_layer(at::Tensor h, c10::optional<at::Tensor> x, std::vector<at::Tensor> ln,
                                      double eps, int64_t vec, std::vector<at::Tensor> w, std::vector<int64_t> bits,
                                      std::vector<int64_t> n, std::vector<int64_t> heads, at::Tensor cos,
                                      at::Tensor sin, at::Tensor cache, at::Tensor tables, at::Tensor widx,
                                      int64_t kv_len, c10::optional<at::Tensor> mask, bool causal, double scale,
                                      int64_t parallel_work, int64_t grain, int64_t tile,
                                      c10::optional<at::Tensor> qk_norm) {
  TORCH_CHECK(ln.size() == 2 && w.size() == 4 && bits.size() == 4 && n.size() == 4 && heads.size() == 3,
              "decoder_layer: 2 norms, 4 linears, 3 head sizes");
  TORCH_CHECK(h.dim() == 3 && h.scalar_type() == at::kBFloat16, "decoder_layer: h must be [B, Q, d] bfloat16");
  const int64_t B = h.size(0), Q = h.size(1), d = h.size(2), T = B * Q;
  const int64_t H = heads[0], Hkv = heads[1], D = heads[2], inter = n[2] / 2;
  TORCH_CHECK(n[0] == (H + 2 * Hkv) * D && n[1] == d && n[3] == d, "decoder_layer: linear sizes");
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() && cache.size(2) == Hkv && cache.size(4) == D &&
                  cache.scalar_type() == at::kBFloat16, "decoder_layer: cache [blocks, 2, Hkv, BS, D] bfloat16");
  tables = tables.contiguous();
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.size(0) == B,
              "decoder_layer: tables [B, NB] int64");
  TORCH_CHECK(widx.scalar_type() == at::kLong && widx.numel() == T, "decoder_layer: widx [B, Q] int64");
  std::vector<at::Tensor> hn = x.has_value() ? add_rms_norm(h, *x, ln[0], eps, vec)
                                             : std::vector<at::Tensor>{h, rms_norm(h, ln[0], eps, vec)};
  auto qkv = linear(hn[1].view({T, d}), w[0], bits[0], n[0], grain, tile).contiguous();
  auto* pq = qkv.data_ptr<at::BFloat16>();
  if (qk_norm.has_value() && qk_norm->defined()) {  // each q and k head normed in place by its own weight row
    const at::Tensor wn = qk_norm->contiguous();
    TORCH_CHECK(wn.scalar_type() == at::kBFloat16 && wn.dim() == 2 && wn.size(0) == H + Hkv && wn.size(1) == D,
                "decoder_layer: qk_norm [H + Hkv, D] bfloat16");
    const auto* pn = wn.data_ptr<at::BFloat16>();
    std::vector<float> xf(D), sq(D);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t hh = 0; hh < H + Hkv; ++hh) {
        at::BFloat16* row = pq + (t * (H + 2 * Hkv) + hh) * D;
        widen_row(row, xf.data(), D);
        norm_row(xf.data(), sq.data(), pn + hh * D, row, D, static_cast<float>(eps), vec);
      }
  }
  TORCH_CHECK(cos.dim() == 4 && cos.sizes() == sin.sizes() && cos.size(-1) == D &&
                  (cos.size(0) == 1 || cos.size(0) == B) && cos.size(1) == Q,
              "decoder_layer: cos, sin [B or 1, Q, 1, D]");
  if (cos.stride(3) != 1 || cos.strides() != sin.strides()) {  // rows read in place (the rotary table's views)
    cos = cos.contiguous();
    sin = sin.contiguous();
  }
  const bool shared_rows = cos.size(0) == 1 && B > 1;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t off = shared_rows ? 0 : b * cos.stride(0);
    rotate(pq + b * Q * (H + 2 * Hkv) * D, Q, H + 2 * Hkv, H + Hkv, D, cos.data_ptr<at::BFloat16>() + off,
           sin.data_ptr<at::BFloat16>() + off, cos.stride(1));
  }
  // keys and values into the cache: block tables[b][pos / BS], offset pos % BS of [blocks, 2, Hkv, BS, D]
  auto* pc = cache.data_ptr<at::BFloat16>();
  const auto* pw = widx.contiguous().data_ptr<int64_t>();
  const auto* pt = tables.data_ptr<int64_t>();
  const int64_t BS = cache.size(3), NB = tables.size(1), nblocks = cache.size(0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t b = t / Q, pos = pw[t];
    TORCH_CHECK(pos >= -1 && pos < NB * BS, "decoder_layer: cache position out of range");
    const int64_t blk = pos < 0 ? 0 : pt[b * NB + pos / BS], off = pos < 0 ? 0 : pos % BS;
    TORCH_CHECK(blk >= 0 && blk < nblocks, "decoder_layer: block id");
    for (int64_t kv = 0; kv < 2; ++kv)
      for (int64_t g = 0; g < Hkv; ++g)
        std::memcpy(pc + (((blk * 2 + kv) * Hkv + g) * BS + off) * D,
                    pq + (t * (H + 2 * Hkv) + H + kv * Hkv + g) * D, D * sizeof(at::BFloat16));
  }
  auto q = qkv.view({B, Q, H + 2 * Hkv, D}).narrow(2, 0, H);
  auto a = attention(q, cache, tables, kv_len, mask, causal, scale, parallel_work);
  auto o = linear(a.view({T, H * D}), w[1], bits[1], n[1], grain, tile);
  auto hn2 = add_rms_norm(hn[0], o.view({B, Q, d}), ln[1], eps, vec);
  auto gu = linear(hn2[1].view({T, d}), w[2], bits[2], n[2], grain, tile);
  auto down = linear(silu_mul(gu, inter), w[3], bits[3], n[3], grain, tile);
  return {hn2[0], down.view({B, Q, d})};
}

namespace {

typedef float v16s __attribute__((vector_size(64)));
typedef int32_t v16n __attribute__((vector_size(64)));

// exp(x) for 16 values x <= 0 (relative error ~2e-7): x = n ln2 + r, |r| <= ln2 / 2, a degree-6
// polynomial of e^r times 2^n; x < -87 gives 0
inline v16s exp16(v16s x) {
  const v16s n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f + (x < 0 ? -0.5f : 0.5f), v16n), v16s);
  const v16s r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  v16s p = v16s{} + 1.0f / 720.0f;  // Horner, 1/6! down to 1/0!
  for (const float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f}) p = p * r + c;
  const v16n e = (__builtin_convertvector(n, v16n) + 127) << 23;
  v16s scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return x < -87.0f ? v16s{} : p * scale;
}

// whether any lane of a comparison's result is set (one mask test where AVX-512 is built; AVX2 builds have
// their own loops where it is needed)
inline bool any_lane(v16n m) {
#if defined(__AVX512BF16__)
  return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0;
#else
  bool any = false;
  for (int j = 0; j < 16; ++j) any |= m[j] != 0;
  return any;
#endif
}

// l (index idx) into the k best so far, topv / topi (best first): after every entry >= l, so a tie keeps
// the entry that came first
inline void insert_top(float* topv, int64_t* topi, int64_t k, float l, int64_t idx) {
  if (!(l > topv[k - 1])) return;
  int64_t pos = k - 1;
  while (pos > 0 && topv[pos - 1] < l) {
    topv[pos] = topv[pos - 1];
    topi[pos] = topi[pos - 1];
    --pos;
  }
  topv[pos] = l;
  topi[pos] = idx;
}

// one pass over n logits l (n a multiple of 16; indices idx0 ..): each merged into the k best so far
// (insert_top, in index order), and the sum of exp(l - m) (m >= every l) returned
#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
// AVX2: exp16's steps on 8 float32 lanes (the generic 16-lane code moved lanes through the stack here;
// not the float64 exp8 above)
inline __m256 exp8f(__m256 x) {
  const __m256 half = _mm256_blendv_ps(_mm256_set1_ps(0.5f), _mm256_set1_ps(-0.5f),
                                       _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
  const __m256i ni = _mm256_cvttps_epi32(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), half));
  const __m256 n = _mm256_cvtepi32_ps(ni);
  const __m256 r =
      _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  for (const float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ), _mm256_mul_ps(p, scale));
}

double exp_sum_top(const float* l, int64_t n, float m, int64_t k, float* topv, int64_t* topi, int64_t idx0) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  for (int64_t v = 0; v < n; v += 16) {
    const __m256 x0 = _mm256_loadu_ps(l + v), x1 = _mm256_loadu_ps(l + v + 8);
    s0 = _mm256_add_ps(s0, exp8f(_mm256_sub_ps(x0, mv)));
    s1 = _mm256_add_ps(s1, exp8f(_mm256_sub_ps(x1, mv)));
    const __m256 low = _mm256_set1_ps(topv[k - 1]);
    if (!_mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(x0, low, _CMP_GT_OQ), _mm256_cmp_ps(x1, low, _CMP_GT_OQ))))
      continue;
    for (int j = 0; j < 16; ++j) insert_top(topv, topi, k, l[v + j], idx0 + v + j);
  }
  float lanes[16];
  _mm256_storeu_ps(lanes, s0);
  _mm256_storeu_ps(lanes + 8, s1);
  double total = 0.0;
  for (int j = 0; j < 16; ++j) total += lanes[j];
  return total;
}
#else
double exp_sum_top(const float* l, int64_t n, float m, int64_t k, float* topv, int64_t* topi, int64_t idx0) {
  v16s sum = v16s{};
  for (int64_t v = 0; v < n; v += 16) {
    v16s x;
    std::memcpy(&x, l + v, sizeof(x));
    sum += exp16(x - m);
    if (!any_lane(x > topv[k - 1])) continue;
    for (int j = 0; j < 16; ++j) insert_top(topv, topi, k, x[j], idx0 + v + j);
  }
  double total = 0.0;
  for (int j = 0; j < 16; ++j) total += sum[j];
  return total;
}
#endif

// one row: logits l = (base + bias) / t over V -> the k largest (ties: the lower index first) as softmax
// probabilities, and their indices. buf: room for V rounded up to 16 floats.
template <typename B>
void softmax_topk_row(const float* base, const B* bias, float t, int64_t V, int64_t k, float* buf, float* q_out,
                      int64_t* i_out) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t V16 = V / 16 * 16, Vp = (V + 15) / 16 * 16;
  for (int64_t v = V16; v < Vp; ++v) {  // the tail, padded with -inf (weight 0, never chosen)
    float l = ninf;
    if (v < V) {
      l = base[v] + (bias ? static_cast<float>(bias[v]) : 0.0f);
      if (t != 1.0f) l = l / t;
    }
    buf[v] = l;
  }
  v16s mx = v16s{} + ninf;
  for (int64_t v = V16; v < Vp; v += 16) {
    v16s l;
    std::memcpy(&l, buf + v, sizeof(l));
    mx = l > mx ? l : mx;
  }
  for (int64_t v = 0; v < V16; v += 16) {
    v16s l;
    std::memcpy(&l, base + v, sizeof(l));
    if (bias) {
      v16s b;
      for (int j = 0; j < 16; ++j) b[j] = static_cast<float>(bias[v + j]);
      l = l + b;
    }
    if (t != 1.0f) l = l / t;
    std::memcpy(buf + v, &l, sizeof(l));
    mx = l > mx ? l : mx;
  }
  float m = mx[0];
  for (int j = 1; j < 16; ++j) m = std::max(m, mx[j]);
  std::vector<float> topv(k, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> topi(k, -1);
  const double total = exp_sum_top(buf, Vp, m, k, topv.data(), topi.data(), 0);
  for (int64_t j = 0; j < k; ++j) {
    q_out[j] = static_cast<float>(std::exp(static_cast<double>(topv[j]) - m) / total);
    i_out[j] = topi[j];
  }
}

}  // namespace

// The k most probable entries of softmax((base[b] + bias[b, w]) / t[b]) for every row (b, w): base [B, V]
// float32 (rows may be strided), bias None or [B, W, V] float32 / bfloat16, t None or [B] float32
// -> (probabilities [B, W, k] float32, indices [B, W, k] int64), best first, ties to the
// lower index. A drafter's candidate scores (drafting.draft_trees), not an exact softmax.
std::vector<at::Tensor> softmax_topk(at::Tensor base, c10::optional<at::Tensor> bias, c10::optional<at::Tensor> t,
                                     int64_t k) {
  TORCH_CHECK(base.dim() == 2 && base.scalar_type() == at::kFloat, "softmax_topk: base must be [B, V] float32");
  if (base.stride(1) != 1) base = base.contiguous();
  const int64_t B = base.size(0), V = base.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "softmax_topk: 1 <= k <= V");
  at::Tensor bs;
  int64_t W = 1;
  if (bias.has_value() && bias->defined()) {
    bs = bias->contiguous();
    TORCH_CHECK(bs.dim() == 3 && bs.size(0) == B && bs.size(2) == V, "softmax_topk: bias must be [B, W, V]");
    TORCH_CHECK(bs.scalar_type() == at::kFloat || bs.scalar_type() == at::kBFloat16, "softmax_topk: bias dtype");
    W = bs.size(1);
  }
  std::vector<float> temps(B, 1.0f);
  if (t.has_value() && t->defined()) {
    at::Tensor tt = t->to(at::kFloat).contiguous();
    TORCH_CHECK(tt.numel() == B, "softmax_topk: t must have B values");
    std::memcpy(temps.data(), tt.data_ptr<float>(), B * sizeof(float));
  }
  auto q = at::empty({B, W, k}, base.options());
  auto idx = at::empty({B, W, k}, base.options().dtype(at::kLong));
  const float* pb = base.data_ptr<float>();
  const int64_t bstride = base.stride(0);
  float* pq = q.data_ptr<float>();
  int64_t* pi = idx.data_ptr<int64_t>();
  auto run = [&](int64_t r0, int64_t r1) {
    std::vector<float> buf((V + 15) / 16 * 16);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / W;
      if (!bs.defined())
        softmax_topk_row<float>(pb + b * bstride, nullptr, temps[b], V, k, buf.data(), pq + r * k, pi + r * k);
      else if (bs.scalar_type() == at::kFloat)
        softmax_topk_row(pb + b * bstride, bs.data_ptr<float>() + r * V, temps[b], V, k, buf.data(), pq + r * k,
                         pi + r * k);
      else
        softmax_topk_row(pb + b * bstride, bs.data_ptr<at::BFloat16>() + r * V, temps[b], V, k, buf.data(),
                         pq + r * k, pi + r * k);
    }
  };
  if (B * W > 1 && at::get_num_threads() > 1)
    at::parallel_for(0, B * W, 1, run);
  else
    run(0, B * W);
  return {q, idx};
}

namespace {

// the weights exp(l / t - m) of a row's 16 entries from v (m: the row's largest l / t, so the largest weighs
// exp(0) = 1; exp16: below e^-87 they weigh 0); entries past V weigh 0, as do those below min_p (a
// probability under min_p x the largest)
inline v16s draw_weights(const float* row, int64_t v, int64_t V, float t, float m, float min_p) {
  v16s x;
  if (v + 16 <= V) {
    std::memcpy(&x, row + v, sizeof(x));
  } else {
    for (int j = 0; j < 16; ++j) x[j] = v + j < V ? row[v + j] : -std::numeric_limits<float>::infinity();
  }
  const v16s e = exp16(x / t - m);
  return min_p > 0.0f ? (e < min_p ? v16s{} : e) : e;
}

constexpr int64_t kDrawBlock = 64;  // entries a block of the draw's float64 sums (a multiple of 16)

// one row's draw: the first index whose running float64 sum of weights exceeds u x their total. The total
// goes block by block (each block's sum in float64 lanes, then across them); the block where the running
// total passes u x total is read again, its entries added one by one (the block's last positive entry where
// rounding leaves that sum short of it).
int64_t draw_row(const float* row, int64_t V, float t, float min_p, double u, std::vector<double>& blocks) {
  const float ninf = -std::numeric_limits<float>::infinity();
  v16s mx16 = v16s{} + ninf;
  int64_t v = 0;
  for (; v + 16 <= V; v += 16) {
    v16s x;
    std::memcpy(&x, row + v, sizeof(x));
    mx16 = x > mx16 ? x : mx16;
  }
  float mx = ninf;
  for (int j = 0; j < 16; ++j) mx = std::max(mx, mx16[j]);
  for (; v < V; ++v) mx = std::max(mx, row[v]);
  const float m = mx / t;
  const int64_t nb = (V + kDrawBlock - 1) / kDrawBlock;
  blocks.resize(nb);
  double total = 0.0;
  int64_t lastb = -1;
  for (int64_t b = 0; b < nb; ++b) {
    v8d acc = v8d{};
    for (int64_t k = b * kDrawBlock; k < std::min((b + 1) * kDrawBlock, V); k += 16) {
      const v16s e = draw_weights(row, k, V, t, m, min_p);
      v8f lo, hi;
      std::memcpy(&lo, &e, sizeof(lo));
      std::memcpy(&hi, reinterpret_cast<const float*>(&e) + 8, sizeof(hi));
      acc += __builtin_convertvector(lo, v8d) + __builtin_convertvector(hi, v8d);
    }
    const double s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    blocks[b] = s;
    total += s;
    if (s > 0.0) lastb = b;
  }
  if (lastb < 0) return 0;
  const double x = u * total;
  double before = 0.0;
  int64_t b = 0;
  while (b < lastb && !(before + blocks[b] > x)) before += blocks[b++];  // lastb: u x total rounded up to it
  int64_t last = b * kDrawBlock;
  double c = before;
  for (int64_t k = b * kDrawBlock; k < std::min((b + 1) * kDrawBlock, V); k += 16) {
    const v16s e = draw_weights(row, k, V, t, m, min_p);
    for (int j = 0; j < 16; ++j) {
      if (!(e[j] > 0.0f)) continue;
      c += static_cast<double>(e[j]);
      last = k + j;
      if (c > x) return last;
    }
  }
  return last;
}

}  // namespace

// Inverse-CDF draws (sample.sampler.draw): logits [n, V] float32 with contiguous rows, t [n] (> 0), min_p [n]
// float32 and u [n] float64 in [0, 1) -> [n] int64: for each row the first index whose running float64 sum of
// the weights exp(l / t - max) (0 where that is below min_p) exceeds u x their total; never a weightless index.
at::Tensor inverse_cdf_draws(const at::Tensor& logits, const at::Tensor& t, const at::Tensor& min_p,
                             const at::Tensor& u) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) >= 1 &&
                  logits.stride(1) == 1, "inverse_cdf_draws: logits must be [n, V] float32 with contiguous rows");
  const int64_t n = logits.size(0), V = logits.size(1);
  TORCH_CHECK(t.numel() == n && min_p.numel() == n && u.numel() == n, "inverse_cdf_draws: one t, min_p, u a row");
  const at::Tensor tt = t.to(at::kFloat).contiguous(), mp = min_p.to(at::kFloat).contiguous();
  const at::Tensor uu = u.to(at::kDouble).contiguous();
  auto out = at::empty({n}, logits.options().dtype(at::kLong));
  const float* pl = logits.data_ptr<float>();
  const float *pt = tt.data_ptr<float>(), *pm = mp.data_ptr<float>();
  const double* pu = uu.data_ptr<double>();
  int64_t* po = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(pt[r] > 0.0f, "inverse_cdf_draws: temperatures must be > 0");
  std::vector<double> blocks;  // rows one after another: a few a call, each ~V / 16 vector steps
  for (int64_t r = 0; r < n; ++r) po[r] = draw_row(pl + r * logits.stride(0), V, pt[r], pm[r], pu[r], blocks);
  return out;
}

namespace {

constexpr int64_t kSearchChunk = 1024;  // draft-vocabulary entries per parallel chunk (a multiple of 16)

inline v16s lanes16(const float* p) {
  v16s x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline v16s lanes16(const at::BFloat16* p) {  // bfloat16 -> float32: the bits moved to the high half
  typedef uint16_t v16h __attribute__((vector_size(32)));
  typedef uint32_t v16u __attribute__((vector_size(64)));
  v16h h;
  std::memcpy(&h, p, sizeof(h));
  const v16u u = __builtin_convertvector(h, v16u) << 16;
  v16s x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// one chunk's share of a node's children: its largest logit, the sum of exp(logit - that), and its
// k best (value, index), best first, ties to the lower index
struct ChunkTop {
  float mx;
  double sum;
  std::vector<float> v;
  std::vector<int64_t> i;
};

// base logits v .. v + 15 (0 past V)
inline v16s base16(const float* base, int64_t v, int64_t V) {
  v16s b;
  if (v + 16 <= V) {
    std::memcpy(&b, base + v, sizeof(b));
  } else {
    for (int j = 0; j < 16; ++j) b[j] = v + j < V ? base[v + j] : 0.0f;
  }
  return b;
}

// the logits l = (b + bias) / t of one node at draft ids v .. v + 15 into o (-inf past V: weight 0, never
// chosen), and its running max
inline void put_logits16(v16s l, int64_t v, int64_t V, float t, float* o, v16s* mx) {
  if (t != 1.0f) l = l / t;
  if (v + 16 > V)
    for (int j = 0; j < 16; ++j) l[j] = v + j < V ? l[j] : -std::numeric_limits<float>::infinity();
  std::memcpy(o, &l, sizeof(l));
  *mx = l > *mx ? l : *mx;
}

// the logits (base + W2 emb_w) / t of WT nodes (emb: theirs, r each) at draft ids v .. v + 15 into
// buf[w * n + (v - v0)], and their running maxima mx[w]: W2 read once for the WT nodes, whose sums stay
// in registers (each node's products added in the order of j)
template <int WT, typename T>
inline void node_logits16(v16s b, const T* blk, const float* emb, int64_t r, int64_t v, int64_t V, int64_t v0,
                          float t, float* buf, int64_t n, v16s* mx) {
  v16s acc[WT];
  for (int w = 0; w < WT; ++w) acc[w] = v16s{};
  for (int64_t j = 0; j < r; ++j) {
    const v16s x = lanes16(blk + j * 16);
    for (int w = 0; w < WT; ++w) acc[w] += x * emb[w * r + j];
  }
  for (int w = 0; w < WT; ++w) put_logits16(b + acc[w], v, V, t, buf + w * n + (v - v0), mx + w);
}

typedef uint32_t v16u32 __attribute__((vector_size(64)));

// acc + the products of 16 lanes of bfloat16 pairs x (lane: W2[v, 2 j], W2[v, 2 j + 1]) with one pair e (two
// bfloat16 values of a node's W1 row): one ``vdpbf16ps`` where AVX-512 BF16 is built (exact products,
// float32 sums), else the same products in float32
inline v16s dot_pairs16(v16s acc, v16u32 x, uint32_t e) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<v16s>(
      _mm512_dpbf16_ps(reinterpret_cast<__m512>(acc), reinterpret_cast<__m512bh>(x),
                       reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(e)))));
#else
  const v16u32 lo = x << 16, hi = x & 0xffff0000u;
  v16s a, b;
  std::memcpy(&a, &lo, sizeof(a));
  std::memcpy(&b, &hi, sizeof(b));
  uint32_t e0 = e << 16, e1 = e & 0xffff0000u;
  float f0, f1;
  std::memcpy(&f0, &e0, sizeof(f0));
  std::memcpy(&f1, &e1, sizeof(f1));
  return acc + a * f0 + b * f1;
#endif
}

// W2 v .. v + 16 NB - 1 times WT nodes' W1 rows over W2 packed in pairs of its columns, [Vp / 16, r / 2, 16]
// pairs (``w2q``), the rows as pairs (``embp``, r / 2 each) -> sums[b * WT + w]: NB * WT independent sums hide
// the product's latency. Not inlined: inside the chunk loop the compiler kept the sums in memory.
#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
// AVX2: dot_pairs16's portable products and sums (a lane adds its even column's product, then its odd one's),
// written for ymm registers: the generic 16-lane code built each node's broadcast pair through the stack for
// every column pair and spilled its sums. Each block is two halves of 8 lanes; a pass takes HP halves for the
// WT nodes (at most 8 sums in registers), each node's pair broadcast once a pass and column pair.
template <int WT, int NB>
__attribute__((noinline)) void pair_sums16(const uint32_t* w2q, const uint32_t* embp, int64_t rp, int64_t v,
                                           v16s* sums) {
  constexpr int HP = std::min(2 * NB, 8 / WT);  // halves a pass: 2 * NB is a multiple of it
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const uint32_t* blk = w2q + (v / 16) * rp * 16;
  for (int h0 = 0; h0 < 2 * NB; h0 += HP) {
    __m256 acc[HP][WT];
    for (int h = 0; h < HP; ++h)
      for (int w = 0; w < WT; ++w) acc[h][w] = _mm256_setzero_ps();
    for (int64_t j = 0; j < rp; ++j) {
      __m256 f0[WT], f1[WT];
      for (int w = 0; w < WT; ++w) {
        const uint32_t e = embp[w * rp + j];
        f0[w] = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(e << 16)));
        f1[w] = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(e & 0xffff0000u)));
      }
      for (int h = 0; h < HP; ++h) {
        const int hh = h0 + h;  // block hh / 2, lanes 8 (hh % 2) ..
        const uint32_t* xp = blk + ((hh / 2) * rp + j) * 16 + 8 * (hh % 2);
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
        const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        const __m256 b = _mm256_castsi256_ps(_mm256_and_si256(x, high));
        for (int w = 0; w < WT; ++w) acc[h][w] = _mm256_fmadd_ps(b, f1[w], _mm256_fmadd_ps(a, f0[w], acc[h][w]));
      }
    }
    for (int h = 0; h < HP; ++h) {
      const int hh = h0 + h;
      for (int w = 0; w < WT; ++w)
        std::memcpy(reinterpret_cast<float*>(sums + (hh / 2) * WT + w) + 8 * (hh % 2), &acc[h][w], 32);
    }
  }
}
#else
template <int WT, int NB>
__attribute__((noinline)) void pair_sums16(const uint32_t* w2q, const uint32_t* embp, int64_t rp, int64_t v,
                                           v16s* sums) {
  v16s acc[NB][WT];
  for (int b = 0; b < NB; ++b)
    for (int w = 0; w < WT; ++w) acc[b][w] = v16s{};
  const uint32_t* blk = w2q + (v / 16) * rp * 16;
  for (int64_t j = 0; j < rp; ++j) {
    uint32_t e[WT];
    for (int w = 0; w < WT; ++w) e[w] = embp[w * rp + j];
    for (int b = 0; b < NB; ++b) {
      v16u32 x;
      std::memcpy(&x, blk + (b * rp + j) * 16, sizeof(x));
      for (int w = 0; w < WT; ++w) acc[b][w] = dot_pairs16(acc[b][w], x, e[w]);
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int w = 0; w < WT; ++w) sums[b * WT + w] = acc[b][w];
}
#endif

// node_logits16 over the pair layout for NB blocks of 16 draft ids from v at once (pair_sums16)
template <int WT, int NB>
inline void pair_logits16(const float* base, const uint32_t* w2q, const uint32_t* embp, int64_t rp, int64_t v,
                          int64_t V, int64_t v0, float t, float* buf, int64_t n, v16s* mx) {
  v16s sums[NB * WT];
  pair_sums16<WT, NB>(w2q, embp, rp, v, sums);
  for (int b = 0; b < NB; ++b) {
    const int64_t vb = v + 16 * b;
    const v16s bb = base16(base, vb, V);
    for (int w = 0; w < WT; ++w) put_logits16(bb + sums[b * WT + w], vb, V, t, buf + w * n + (vb - v0), mx + w);
  }
}

// the pair kernel's blocks v0 .. v1 for WT nodes: NB blocks at a time (more for fewer nodes), then one
template <int WT>
inline void pair_logits_range(const float* base, const uint32_t* w2q, const uint32_t* embp, int64_t rp, int64_t v0,
                              int64_t v1, int64_t V, int64_t c0, float t, float* buf, int64_t n, v16s* mx) {
  constexpr int NB = WT <= 2 ? 4 : 2;
  int64_t v = v0;
  for (; v + 16 * NB <= v1; v += 16 * NB) pair_logits16<WT, NB>(base, w2q, embp, rp, v, V, c0, t, buf, n, mx);
  for (; v < v1; v += 16) pair_logits16<WT, 1>(base, w2q, embp, rp, v, V, c0, t, buf, n, mx);
}

// chunk [v0, v1) of the logits of W nodes: (base + W2 emb_w) / t, W2 packed in blocks of 16 rows
// [Vp / 16, r, 16] (``w2p``), or in pairs of columns (``w2q``, bfloat16 rows with ``embp``: the nodes' W1
// rows as bfloat16 pairs); out[w] gets the chunk's max, exp-sum and top k. Nodes go four at a time.
template <typename T>
void search_chunk(const float* base, const T* w2p, const uint32_t* w2q, const float* emb, const uint32_t* embp,
                  int64_t W, int64_t r, int64_t V, int64_t v0, int64_t v1, float t, int64_t k, ChunkTop* out) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t n = v1 - v0;
  std::vector<float> buf(W * n);
  for (int64_t w = 0; w < W; ++w)
    out[w] = ChunkTop{ninf, 0.0, std::vector<float>(k, ninf), std::vector<int64_t>(k, -1)};
  std::vector<v16s> mx(W, v16s{} + ninf);
  if (w2q != nullptr) {  // the pair layout: all of the chunk for up to four nodes at a time
    const int64_t rp = r / 2;
    for (int64_t w0 = 0; w0 < W; w0 += 4) {
      const uint32_t* e = embp + w0 * rp;
      float* o = buf.data() + w0 * n;
      v16s* m = mx.data() + w0;
      switch (std::min<int64_t>(4, W - w0)) {
        case 1: pair_logits_range<1>(base, w2q, e, rp, v0, v1, V, v0, t, o, n, m); break;
        case 2: pair_logits_range<2>(base, w2q, e, rp, v0, v1, V, v0, t, o, n, m); break;
        case 3: pair_logits_range<3>(base, w2q, e, rp, v0, v1, V, v0, t, o, n, m); break;
        default: pair_logits_range<4>(base, w2q, e, rp, v0, v1, V, v0, t, o, n, m); break;
      }
    }
  }
  for (int64_t v = v0; v < v1 && w2q == nullptr; v += 16) {  // whole columns: a block of 16 ids at a time
    const v16s b = base16(base, v, V);
    const T* blk = w2p + (v / 16) * r * 16;
    for (int64_t w0 = 0; w0 < W; w0 += 4) {
      const float* e = emb + w0 * r;
      float* o = buf.data() + w0 * n;
      switch (std::min<int64_t>(4, W - w0)) {
        case 1: node_logits16<1>(b, blk, e, r, v, V, v0, t, o, n, mx.data() + w0); break;
        case 2: node_logits16<2>(b, blk, e, r, v, V, v0, t, o, n, mx.data() + w0); break;
        case 3: node_logits16<3>(b, blk, e, r, v, V, v0, t, o, n, mx.data() + w0); break;
        default: node_logits16<4>(b, blk, e, r, v, V, v0, t, o, n, mx.data() + w0); break;
      }
    }
  }
  for (int64_t w = 0; w < W; ++w)
    for (int j = 0; j < 16; ++j) out[w].mx = std::max(out[w].mx, mx[w][j]);
  for (int64_t w = 0; w < W; ++w)
    out[w].sum = exp_sum_top(buf.data() + w * n, n, out[w].mx, k, out[w].v.data(), out[w].i.data(), v0);
}

template <typename T>
void search_row(const float* base, const float* anchor_emb, const T* w1, const T* w2p, const uint32_t* w2q,
                int64_t r, int64_t V, int64_t g, float t, const float* conf_a, const float* conf_we,
                const float* ctemps, int64_t topk, int64_t beam, float min_score, int64_t* tok_out,
                int64_t* par_out, float* score_out) {
  const int64_t kk = std::min(topk, V), Vp = (V + 15) / 16 * 16;
  const int64_t nchunks = (Vp + kSearchChunk - 1) / kSearchChunk;
  std::vector<int64_t> prev{-1}, fidx{-1};  // -1: the anchor (its W1 row given)
  std::vector<float> fscore{1.0f};
  int64_t offset = 0, slots = 1;  // slots: the depth's nodes in the layout (``W`` of them expanded)
  for (int64_t d = 0; d < g; ++d) {
    const int64_t W = static_cast<int64_t>(prev.size());
    for (int64_t j = offset + W * kk; j < offset + slots * kk; ++j) {  // the nodes not expanded
      tok_out[j] = par_out[j] = -1;
      score_out[j] = -1.0f;
    }
    if (W == 0) {
      offset += slots * kk;
      slots = std::min(beam, slots * kk);
      continue;
    }
    std::vector<float> emb(W * r);
    for (int64_t w = 0; w < W; ++w)
      for (int64_t j = 0; j < r; ++j)
        emb[w * r + j] = prev[w] < 0 ? anchor_emb[j] : static_cast<float>(w1[prev[w] * r + j]);
    std::vector<uint32_t> embp(w2q != nullptr ? W * r / 2 : 0);  // the pair kernel's W1 rows, bfloat16 pairs
    for (size_t i = 0; i < embp.size(); ++i)
      embp[i] = static_cast<uint32_t>(c10::BFloat16(emb[2 * i]).x) |
                (static_cast<uint32_t>(c10::BFloat16(emb[2 * i + 1]).x) << 16);
    std::vector<ChunkTop> parts(nchunks * W);
    auto run = [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c)
        search_chunk(base + d * V, w2p, w2q, emb.data(), embp.data(), W, r, V, c * kSearchChunk,
                     std::min(Vp, (c + 1) * kSearchChunk), t, kk, parts.data() + c * W);
    };
    if (nchunks > 1 && at::get_num_threads() > 1 && !at::in_parallel_region())
      at::parallel_for(0, nchunks, 1, run);
    else
      run(0, nchunks);
    const int64_t C = W * kk;
    std::vector<float> child(C);
    for (int64_t w = 0; w < W; ++w) {
      const float ninf = -std::numeric_limits<float>::infinity();
      float m = ninf;
      for (int64_t c = 0; c < nchunks; ++c) m = std::max(m, parts[c * W + w].mx);
      double total = 0.0;
      ChunkTop best{m, 0.0, std::vector<float>(kk, ninf), std::vector<int64_t>(kk, -1)};
      for (int64_t c = 0; c < nchunks; ++c) {  // chunks in index order: a tie keeps the lower index
        const ChunkTop& p = parts[c * W + w];
        if (p.mx > ninf) total += p.sum * std::exp(static_cast<double>(p.mx) - m);
        for (int64_t j = 0; j < kk; ++j)
          if (p.i[j] >= 0) insert_top(best.v.data(), best.i.data(), kk, p.v[j], p.i[j]);
      }
      std::vector<float> q(kk);
      for (int64_t j = 0; j < kk; ++j) q[j] = static_cast<float>(std::exp(static_cast<double>(best.v[j]) - m) / total);
      std::vector<float> factor(q);
      if (conf_a != nullptr) {  // the calibrated confidence for the rank-0 child, the rest of the mass shared
        double logit = conf_a[d];
        for (int64_t j = 0; j < r; ++j) logit += static_cast<double>(conf_we[j]) * emb[w * r + j];
        const float c = 1.0f / (1.0f + std::exp(-static_cast<float>(logit) / ctemps[d]));
        factor[0] = c;
        for (int64_t j = 1; j < kk; ++j)
          factor[j] = std::min(1.0f, (1.0f - c) * q[j] / std::max(1.0f - q[0], 1e-6f));
      }
      for (int64_t j = 0; j < kk; ++j) {
        const int64_t at_ = offset + w * kk + j;
        child[w * kk + j] = fscore[w] * factor[j];
        tok_out[at_] = best.i[j];
        par_out[at_] = fidx[w];
        score_out[at_] = child[w * kk + j];
      }
    }
    if (d + 1 < g) {  // the next depth expands this depth's best nodes of min_score or more (ties: the lower index)
      std::vector<int64_t> order(C);
      for (int64_t j = 0; j < C; ++j) order[j] = j;
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return child[a] > child[b]; });
      int64_t nb = 0;
      while (nb < std::min(beam, C) && child[order[nb]] >= min_score) ++nb;
      prev.assign(nb, 0);
      fidx.assign(nb, 0);
      fscore.assign(nb, 0.0f);
      for (int64_t j = 0; j < nb; ++j) {
        prev[j] = tok_out[offset + order[j]];  // a draft id: w1 holds the draft vocabulary's W1 rows
        fidx[j] = offset + order[j];
        fscore[j] = child[order[j]];
      }
    }
    offset += slots * kk;
    slots = std::min(beam, slots * kk);
  }
}

}  // namespace

// A whole draft-tree search (drafting.draft_trees) for a vanilla Markov head in one call: base [B, g, V]
// float32 logits of each depth; anchor_emb [B, r] float32: W1 of each row's anchor; w1 [V, r]: the W1
// rows of the draft vocabulary (indexed by draft id), w2p [ceil(V / 16), r, 16]: W2 in blocks of 16
// draft ids (zero padded), both float32 or bfloat16, or (bfloat16, r even) w2p [ceil(V / 16), r / 2, 16, 2]:
// W2's columns in pairs, read by ``vdpbf16ps`` where AVX-512 BF16 is built (the products exact, summed
// two at a time in float32); t [B] float32 temperatures (1 for greedy rows);
// conf_a [B, g] (the confidence logit's hidden part, its bias included) and conf_we [r] (its W1 part),
// or undefined; conf_rows [B] bool: the rows scored by the confidence head; ctemps [g]; min_score: a depth
// expands only those of its ``beam`` best nodes that score at least this (0: all of them), and the layout's
// nodes below the others get id, parent and score -1 -> (draft ids, parents, scores), each [B, C], in
// draft_trees' layout.
std::vector<at::Tensor> tree_search(at::Tensor base, at::Tensor anchor_emb, at::Tensor w1, at::Tensor w2p,
                                    at::Tensor t, c10::optional<at::Tensor> conf_a,
                                    c10::optional<at::Tensor> conf_we, at::Tensor conf_rows, at::Tensor ctemps,
                                    int64_t topk, int64_t beam, double min_score) {
  TORCH_CHECK(base.dim() == 3 && base.scalar_type() == at::kFloat, "tree_search: base must be [B, g, V] float32");
  base = base.contiguous();
  const int64_t B = base.size(0), g = base.size(1), V = base.size(2), r = w1.size(1);
  TORCH_CHECK(topk >= 1 && beam >= 1, "tree_search: topk and beam must be >= 1");
  TORCH_CHECK(w1.scalar_type() == w2p.scalar_type() &&
                  (w1.scalar_type() == at::kFloat || w1.scalar_type() == at::kBFloat16),
              "tree_search: w1 and w2p must both be float32 or bfloat16");
  const bool pairs = w2p.dim() == 4;
  TORCH_CHECK(pairs ? w2p.scalar_type() == at::kBFloat16 && r % 2 == 0 && w2p.size(0) * 16 >= V &&
                          w2p.size(1) * 2 == r && w2p.size(2) == 16 && w2p.size(3) == 2
                    : w2p.dim() == 3 && w2p.size(0) * 16 >= V && w2p.size(1) == r && w2p.size(2) == 16,
              "tree_search: w2p must be [ceil(V / 16), r, 16] or (bfloat16) [ceil(V / 16), r / 2, 16, 2]");
  w1 = w1.contiguous();
  w2p = w2p.contiguous();
  auto an = anchor_emb.to(at::kFloat).contiguous();
  TORCH_CHECK(w1.dim() == 2 && w1.size(0) == V, "tree_search: w1 must be [V, r]");
  auto tt = t.to(at::kFloat).contiguous();
  auto rows = conf_rows.to(at::kBool).contiguous();
  auto ct = ctemps.to(at::kFloat).contiguous();
  TORCH_CHECK(an.numel() == B * r && tt.numel() == B && rows.numel() == B && ct.numel() >= g,
              "tree_search: per-row sizes");
  at::Tensor ca, cw;
  if (conf_a.has_value() && conf_a->defined()) {
    ca = conf_a->to(at::kFloat).contiguous();
    cw = conf_we->to(at::kFloat).contiguous();
    TORCH_CHECK(ca.size(0) == B && ca.size(1) >= g && cw.numel() == r, "tree_search: confidence sizes");
  }
  const int64_t kk = std::min(topk, V);
  int64_t C = 0;
  for (int64_t d = 0, W = 1; d < g; ++d) {
    C += W * kk;
    W = std::min(beam, W * kk);
  }
  auto tok = at::empty({B, C}, base.options().dtype(at::kLong));
  auto par = at::empty({B, C}, base.options().dtype(at::kLong));
  auto score = at::empty({B, C}, base.options());
  const float ms = static_cast<float>(min_score);
  for (int64_t b = 0; b < B; ++b) {
    const bool conf = ca.defined() && rows.data_ptr<bool>()[b];
    const float* pa = conf ? ca.data_ptr<float>() + b * ca.size(1) : nullptr;
    const float* pw = conf ? cw.data_ptr<float>() : nullptr;
    const float* pb = base.data_ptr<float>() + b * g * V;
    const float* pe = an.data_ptr<float>() + b * r;
    const float tb = tt.data_ptr<float>()[b];
    int64_t* po = tok.data_ptr<int64_t>() + b * C;
    int64_t* pp = par.data_ptr<int64_t>() + b * C;
    float* ps = score.data_ptr<float>() + b * C;
    const float* cts = ct.data_ptr<float>();
    if (w1.scalar_type() == at::kFloat) {
      search_row(pb, pe, w1.data_ptr<float>(), w2p.data_ptr<float>(), nullptr, r, V, g, tb, pa, pw, cts, topk, beam,
                 ms, po, pp, ps);
    } else {
      const at::BFloat16* w2 = w2p.data_ptr<at::BFloat16>();
      search_row(pb, pe, w1.data_ptr<at::BFloat16>(), w2, pairs ? reinterpret_cast<const uint32_t*>(w2) : nullptr, r,
                 V, g, tb, pa, pw, cts, topk, beam, ms, po, pp, ps);
    }
  }
  return {tok, par, score};
}

namespace {

// argmax_row's lanes: lane t holds the largest of the values at offset t of the blocks of B it saw, bv[t],
// and the start of the first block where it came, fi[t] -> their largest m and the first index holding it
template <int B>
int64_t first_of_max(const float* bv, const int32_t* fi, int64_t n, float& m) {
  for (int t = 0; t < B; ++t) m = bv[t] > m ? bv[t] : m;
  int64_t idx = n;
  for (int t = 0; t < B; ++t)
    if (bv[t] == m) idx = std::min<int64_t>(idx, fi[t] + t);
  return idx;
}

// the first index of the largest of x[0 .. n) (n >= 1), or of its first NaN (torch.argmax's rule): four
// independent 16-lane maxima (AVX2: 8-lane), each lane keeping the block where its maximum first came
// (strict >)
#if !defined(__AVX512BF16__) && defined(__AVX2__)
// AVX2: in ymm registers (the generic 16-lane selects compiled lane by lane there)
int64_t argmax_row(const float* x, int64_t n) {
  const int64_t nv = n / 32 * 32;
  __m256 best[4], nan = _mm256_setzero_ps();
  __m256i first[4];
  for (int a = 0; a < 4; ++a) {
    best[a] = _mm256_set1_ps(-__builtin_inff());
    first[a] = _mm256_setzero_si256();
  }
  for (int64_t i = 0; i < nv; i += 32) {
    const __m256i at = _mm256_set1_epi32(static_cast<int32_t>(i));
    for (int a = 0; a < 4; ++a) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * a);
      const __m256 gt = _mm256_cmp_ps(v, best[a], _CMP_GT_OQ);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      best[a] = _mm256_blendv_ps(best[a], v, gt);
      first[a] = _mm256_blendv_epi8(first[a], at, _mm256_castps_si256(gt));
    }
  }
  float m = -__builtin_inff();
  int64_t idx = 0;
  bool any_nan = !_mm256_testz_si256(_mm256_castps_si256(nan), _mm256_castps_si256(nan));
  if (nv > 0) {
    alignas(32) float bv[32];
    alignas(32) int32_t fi[32];
    for (int a = 0; a < 4; ++a) {
      _mm256_store_ps(bv + 8 * a, best[a]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(fi + 8 * a), first[a]);
    }
    idx = first_of_max<32>(bv, fi, n, m);
  }
#else
int64_t argmax_row(const float* x, int64_t n) {
  const int64_t nv = n / 64 * 64;
  v16s best[4];
  v16n first[4] = {}, nan = v16n{};
  for (int a = 0; a < 4; ++a) best[a] = v16s{} - __builtin_inff();
  for (int64_t i = 0; i < nv; i += 64) {
    for (int a = 0; a < 4; ++a) {
      const v16s v = lanes16(x + i + 16 * a);
      const v16n gt = v > best[a];
      nan |= v != v;
      best[a] = gt ? v : best[a];
      first[a] = gt ? v16n{} + static_cast<int32_t>(i) : first[a];
    }
  }
  float m = -__builtin_inff();
  int64_t idx = 0;
  bool any_nan = any_lane(nan);
  if (nv > 0) {
    float bv[64];
    int32_t fi[64];
    std::memcpy(bv, best, sizeof(bv));
    std::memcpy(fi, first, sizeof(fi));
    idx = first_of_max<64>(bv, fi, n, m);
  }
#endif
  for (int64_t i = nv; i < n; ++i) {
    if (x[i] != x[i]) {
      any_nan = true;
      break;
    }
    if (x[i] > m) {
      m = x[i];
      idx = i;
    }
  }
  if (any_nan) {
    for (int64_t i = 0; i < n; ++i)
      if (x[i] != x[i]) return i;
  }
  return idx;
}

}  // namespace

// torch.argmax(x, -1) of float32 x [A, R, n] whose rows are contiguous (any other strides) -> [A, R] int64
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.size(2) >= 1 && x.stride(2) == 1,
              "argmax_rows: x must be [A, R, n >= 1] float32 with contiguous rows");
  const int64_t A = x.size(0), R = x.size(1), n = x.size(2);
  auto out = at::empty({A, R}, x.options().dtype(at::kLong));
  const float* px = x.data_ptr<float>();
  int64_t* po = out.data_ptr<int64_t>();
  for (int64_t a = 0; a < A; ++a)
    for (int64_t r = 0; r < R; ++r) po[a * R + r] = argmax_row(px + a * x.stride(0) + r * x.stride(1), n);
  return out;
}

namespace {

// rank_nodes for one row: v gets each score calibrated and cut at the limit, idx the ranking's order
void rank_row(const float* row, const int64_t* pd, int64_t N, const float* fr, int64_t S, int64_t lb, float* v,
              int64_t* idx) {
  for (int64_t j = 0; j < N; ++j) {
    float s = row[j];
    if (fr && s >= 0.0f) s = std::min(s * fr[std::min(std::max<int64_t>(pd[j], 0), S - 1)], 1.0f);
    v[j] = pd[j] > lb ? -1.0f : s;
    idx[j] = j;
  }
  std::stable_sort(idx, idx + N, [&](int64_t a, int64_t c) {
    const float va = v[a], vc = v[c];
    return va > vc || (va != va && vc == vc);
  });
}

}  // namespace

// The ranking of a step's scored draft nodes (spec_decode/cost_model.py, ranked_scores): scores [B, N] float32,
// depth [N] int64 (1-based), scale None or [B, S] float32 (each row's calibration factor by depth, the depth
// clamped to [0, S - 1]), limit [B] int64 -> (the scores by decreasing value [B, N], their indices [B, N]
// int64). A score s >= 0 becomes min(s * scale, 1) (float32, as torch multiplies and clamps), a node deeper
// than its row's limit -1; equal scores keep index order, NaN first (torch's stable descending sort).
std::vector<at::Tensor> rank_nodes(const at::Tensor& scores, const at::Tensor& depth, const c10::optional<at::Tensor>& scale,
                                   const at::Tensor& limit) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat, "rank_nodes: scores must be [B, N] float32");
  const int64_t B = scores.size(0), N = scores.size(1);
  TORCH_CHECK(depth.dim() == 1 && depth.size(0) == N && depth.scalar_type() == at::kLong, "rank_nodes: depth must be [N] int64");
  TORCH_CHECK(limit.dim() == 1 && limit.size(0) == B && limit.scalar_type() == at::kLong, "rank_nodes: limit must be [B] int64");
  at::Tensor f;
  int64_t S = 0;
  if (scale.has_value() && scale->defined()) {
    f = scale->contiguous();
    TORCH_CHECK(f.dim() == 2 && f.size(0) == B && f.size(1) >= 1 && f.scalar_type() == at::kFloat,
                "rank_nodes: scale must be [B, S >= 1] float32");
    S = f.size(1);
  }
  const at::Tensor x = scores.contiguous(), d = depth.contiguous(), lim = limit.contiguous();
  auto ranked = at::empty({B, N}, x.options());
  auto order = at::empty({B, N}, x.options().dtype(at::kLong));
  const int64_t* pd = d.data_ptr<int64_t>();
  float* pr = ranked.data_ptr<float>();
  int64_t* po = order.data_ptr<int64_t>();
  std::vector<float> v(N);
  for (int64_t b = 0; b < B; ++b) {
    rank_row(x.data_ptr<float>() + b * N, pd, N, S ? f.data_ptr<float>() + b * S : nullptr, S,
             lim.data_ptr<int64_t>()[b], v.data(), po + b * N);
    for (int64_t j = 0; j < N; ++j) pr[b * N + j] = v[po[b * N + j]];
  }
  return {ranked, order};
}

// Medusa's dynamic trees in one call (spec_decode/medusa/proposer.py, ``MedusaProposer.ranked_paths``): logits
// [B, H, V] float32 (the heads' logits, rows contiguous; the first D heads are read), t [B, >= D] float32 (what
// each head's logits are divided by), k, token_map None or [V] int64 (draft id -> target id), flat [P, D] int64
// (each candidate path's entry at each depth in a row's table of its D heads' top-k probabilities followed by
// a 1), depth [P] int64 (1-based), scale None or each row's calibration factors by depth, limit [B] -> per row,
// as lists: the heads' top-k tokens [D * k] (target ids, rank order); each path's probability, the product of
// its entries depth by depth [P]; their ranking [P] and its order [P]. Each head's top k as softmax_topk, the
// products as torch multiplies float32 tensors, the ranking as rank_nodes (scale taken to float32): the
// same values as those ops.
std::tuple<std::vector<std::vector<int64_t>>, std::vector<std::vector<double>>, std::vector<std::vector<double>>,
           std::vector<std::vector<int64_t>>>
medusa_paths(const at::Tensor& logits, const at::Tensor& t, int64_t k, const c10::optional<at::Tensor>& token_map,
             const at::Tensor& flat, const at::Tensor& depth, const c10::optional<std::vector<std::vector<double>>>& scale,
             const std::vector<int64_t>& limit) {
  TORCH_CHECK(logits.dim() == 3 && logits.scalar_type() == at::kFloat && logits.stride(2) == 1,
              "medusa_paths: logits must be [B, H, V] float32 with contiguous rows");
  TORCH_CHECK(flat.dim() == 2 && flat.scalar_type() == at::kLong && flat.is_contiguous(), "medusa_paths: flat [P, D] int64");
  const int64_t B = logits.size(0), V = logits.size(2), P = flat.size(0), D = flat.size(1);
  TORCH_CHECK(D >= 1 && D <= logits.size(1) && k >= 1 && k <= V, "medusa_paths: D <= H heads, 1 <= k <= V");
  TORCH_CHECK(depth.dim() == 1 && depth.size(0) == P && depth.scalar_type() == at::kLong && depth.is_contiguous(),
              "medusa_paths: depth [P] int64");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == B && t.size(1) >= D && t.scalar_type() == at::kFloat,
              "medusa_paths: t [B, >= D] float32");
  TORCH_CHECK(static_cast<int64_t>(limit.size()) == B, "medusa_paths: one limit a row");
  TORCH_CHECK(!scale.has_value() || static_cast<int64_t>(scale->size()) == B, "medusa_paths: one scale row a row");
  const int64_t* pmap = nullptr;
  at::Tensor tmap;
  if (token_map.has_value() && token_map->defined()) {
    tmap = token_map->contiguous();
    TORCH_CHECK(tmap.scalar_type() == at::kLong && tmap.numel() == V, "medusa_paths: token_map [V] int64");
    pmap = tmap.data_ptr<int64_t>();
  }
  const int64_t* pf = flat.data_ptr<int64_t>();
  const int64_t* pd = depth.data_ptr<int64_t>();
  const int64_t Tn = D * k + 1;
  for (int64_t j = 0; j < P * D; ++j) TORCH_CHECK(pf[j] >= 0 && pf[j] < Tn, "medusa_paths: flat entry out of range");
  std::vector<float> probs(B * Tn);  // per row: the D heads' top-k probabilities, then a 1
  std::vector<int64_t> ids(B * D * k);
  const float* pl = logits.data_ptr<float>();
  const at::Tensor tc = t.contiguous();
  const float* pt = tc.data_ptr<float>();
  const int64_t ts = tc.size(1);
  auto run = [&](int64_t r0, int64_t r1) {
    std::vector<float> buf((V + 15) / 16 * 16);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / D, h = r % D;
      softmax_topk_row<float>(pl + b * logits.stride(0) + h * logits.stride(1), nullptr, pt[b * ts + h], V, k, buf.data(),
                              probs.data() + b * Tn + h * k, ids.data() + (b * D + h) * k);
    }
  };
  if (B * D > 1 && at::get_num_threads() > 1)
    at::parallel_for(0, B * D, 1, run);
  else
    run(0, B * D);
  std::vector<std::vector<int64_t>> top(B, std::vector<int64_t>(D * k)), order(B, std::vector<int64_t>(P));
  std::vector<std::vector<double>> raw(B, std::vector<double>(P)), ranked(B, std::vector<double>(P));
  std::vector<float> prod(P), v(P), f;
  for (int64_t b = 0; b < B; ++b) {
    probs[b * Tn + Tn - 1] = 1.0f;
    for (int64_t j = 0; j < D * k; ++j) {
      const int64_t id = ids[b * D * k + j];
      top[b][j] = pmap ? pmap[id] : id;
    }
    const float* tb = probs.data() + b * Tn;
    for (int64_t p = 0; p < P; ++p) {
      float x = tb[pf[p * D]];
      for (int64_t dd = 1; dd < D; ++dd) x = x * tb[pf[p * D + dd]];
      prod[p] = x;
      raw[b][p] = x;
    }
    int64_t S = 0;
    if (scale.has_value()) {
      const auto& row = (*scale)[b];
      S = static_cast<int64_t>(row.size());
      TORCH_CHECK(S >= 1, "medusa_paths: an empty scale row");
      f.assign(row.begin(), row.end());
    }
    rank_row(prod.data(), pd, P, S ? f.data() : nullptr, S, limit[b], v.data(), order[b].data());
    for (int64_t j = 0; j < P; ++j) ranked[b][j] = v[order[b][j]];
  }
  return {top, raw, ranked, order};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_float64_attention", [](bool on) { g_float64_attention = on; },
        "bfloat16 attention through the float64 kernel (True) or the float32 one where built (False)");
  m.def("softmax_topk", &softmax_topk, "the k most probable entries of softmax((base + bias) / t), per row");
  m.def("inverse_cdf_draws", &inverse_cdf_draws, "one inverse-CDF draw a row of softmax(logits / t), min-p applied");
  m.def("medusa_paths", &medusa_paths, "Medusa's dynamic-tree candidates: heads' top k, path products, ranking");
  m.def("rank_nodes", &rank_nodes, "draft nodes' scores calibrated by depth, cut at a depth, sorted (cost_model.ranked_scores)");
  m.def("tree_search", &tree_search, "a whole draft-tree search for a vanilla Markov head (drafting.draft_trees)");
  m.def("attention", &attention, "batch-invariant attention over a paged KV cache");
  m.def("add_rms_norm", &add_rms_norm, "(residual + x, rms_norm(residual + x) * weight), bfloat16");
  m.def("rms_norm", &rms_norm, "rms_norm(x) * weight, bfloat16");
  m.def("group_gemm", &group_gemm, "x W^T for W in 4- or 8-bit groups of 32 (layers.quant.pack_groups), bfloat16");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [T, 2 n] bfloat16 (gate | up), as torch computes it");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, -1) of float32 [A, R, n] with contiguous rows");
  m.def("decoder_layer", &decoder_layer,
        "a Llama / Qwen3 decoder layer, bfloat16, group-quantized linears, batch-invariant attention");
  m.def("group_gemm_available", &group_gemm_available, "whether this build has group_gemm");
  m.def("group_gemm_a8", &group_gemm_a8,
        "x W^T as group_gemm with x in 8-bit groups of 32 (layers.quant.pack_groups with int8_activations), bfloat16");
  m.def("group_gemm_a8_available", &group_gemm_a8_available, "whether this build has group_gemm_a8");
}
