// attnkit's row-span kernel: exact attention where query row i attends the keys lo[i]..hi[i]
// (inclusive, non-decreasing in i), forward and backward, CPU (AVX2 + FMA, or AVX-512). q, k, v
// (and out, dout) are float32, bfloat16 or float16 (float16 where built with F16C): low-precision
// elements are converted to float32 as the kernel packs panels and loads rows (bf16 -> fp32 is
// a 16-bit shift, fp16 -> fp32 F16C's vcvtph2ps); everything inside is float32, lse is float32,
// and out, dq, dk, dv come back in the input dtype (rounded to nearest even, as torch rounds).
// One kernel serves every mask whose allowed keys form one run per row: causal, sliding
// windows, documents, prefix-LM, contiguous key padding and their intersections (the Python
// side, attnkit.masks.spans, turns a spec into lo/hi), with a logit soft-cap and ALiBi's bias
// applied to the scores of each row before its softmax (Mods). Grouped-query heads: q (B, H, L, Dk),
// k (B, Hkv, S, Dk), v (B, Hkv, S, Dv), H = g * Hkv; the g query heads of a group run
// against one packed K^T panel.
//
// Three builds of this file (builds.py, rowspan.py): the AVX2 one; where the CPU has AVX-512
// (F, DQ, BW, VL), one with -DRS_AVX512 whose float32 hot paths (S = Q K^T, the products with
// P, the softmax and the backward's rows without score modifiers) run in zmm registers, 16
// lanes a vector (float32, and bfloat16/float16 converted to float32 as below); and, where the
// CPU has AVX512-BF16, one with -DRS_BF16DOT (and RS_AVX512: its float32 code is the AVX-512
// one) whose bfloat16 forward and backward multiply with vdpbf16ps (operands as bf16 pairs; P
// and dS rounded to bf16 for their products, as GPU flash kernels do; sums, softmax and lse in
// float32). The packing (K^T panels, converted rows) and the score modifiers are the AVX2 code
// in every build.
//
// Structure (work item = (b, kv head, chunk of C <= 2048 query rows); threads pull items,
// the most expensive first, from a shared counter):
//   * K^T is packed incrementally (8x8 AVX transposes) into panels of 16 keys ([D][16])
//     aligned to absolute key index; spans only move forward, so each key is packed once
//     per work item and reused by every query block and every head of the group.
//   * Query block of MB=48 rows (8 micro-tiles of 6 rows; 96 rows in the AVX-512 float32
//     forward and backward, so each K panel and V row they read serves twice the rows),
//     pre-scaled by scale*log2(e) so the softmax uses exp2.
//   * Keys processed in chunks of KC <= 512 (one chunk when the block's span is narrow);
//     online softmax (running max / sum, rescale of O) across chunks.
//   * S = Q K^T via a 6x16 register-blocked FMA micro-kernel (12 ymm accumulators); only
//     tiles that intersect a tile's spans are computed, with a 6x8 kernel for half panels.
//     AVX-512: a panel is one zmm per d; four panels at a time (6x64, 24 zmm accumulators)
//     where the tile's spans cover the 64 keys (S, and dP = dO V^T in the backward), else
//     two (6x32, 12 accumulators), or one with the sum over d split in two (even / odd d);
//     whole panels only.
//   * Exact per-row softmax over the row's own span (vectorized degree-5 exp2 polynomial),
//     P written in place over S, zeros at the ragged edges; a row with an empty span gets
//     output 0 and lse -inf.
//   * O += P V via a 6x16 micro-kernel over the key range of each 6-row tile (V in place);
//     AVX-512: 6 x 64 columns at a time (24 zmm accumulators), a tail of fewer with masks.
//   * NaN / inf: every query row, and the K and V rows of the panels an item packs (the keys
//     its rows' spans reach, rounded out to whole panels), are checked where they are read;
//     attnkit_span_forward returns 2 where one was not finite (the caller applies the rule).
//   * Backward from the saved lse over the same panels (K^T and V^T): dQ per row; dK, dV
//     summed per item over the group's heads, then added per key stripe in the items' order
//     (bitwise the same on every run with the same number of threads).
// at::Tensor, at::parallel_for, at::get_num_threads: abi.h (the C ABI's views, no libtorch)
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <limits>
#include <tuple>
#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

// the AVX512-BF16 build's float32 code is the AVX-512 one
#if defined(RS_BF16DOT) && !defined(RS_AVX512)
#define RS_AVX512
#endif

namespace rowspan {

// element types, their loads and stores, exp2_ps, hsum, hmax: elements.h
using namespace attnkit_elements;

// bfloat16 bits of 8 floats, rounded to nearest even (NaN -> 0x7FC0), as torch rounds
static inline __m128i bf16_bits(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <Dt E>
static inline void store8(elem_t<E>* p, __m256 x) {
  if constexpr (E == Dt::F32) {
    _mm256_storeu_ps(p, x);
  } else if constexpr (E == Dt::BF16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits(x));
  } else {
#ifdef __F16C__
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  }
}


// dst[0..n) = src[0..n) * s as float32
template <Dt E>
static inline void load_row(const elem_t<E>* src, float* dst, int64_t n, float s = 1.0f) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(load8<E>(src + d), vs));
  for (; d < n; ++d) dst[d] = load1<E>(src + d) * s;
}

// dst[0..n) = src[0..n) * s in the element type
template <Dt E>
static inline void store_row(const float* src, elem_t<E>* dst, int64_t n, float s = 1.0f) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) store8<E>(dst + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), vs));
  for (; d < n; ++d) store1<E>(dst + d, src[d] * s);
}

constexpr int MR = 6;    // rows of a micro tile
constexpr int NR = 16;   // keys per packed K^T panel; output cols per PV tile
constexpr int MB = 48;   // query rows per block (multiple of MR)
constexpr int MBW = 96;  // the AVX-512 float32 build's: K panels and V rows read half as often

static const int32_t kMaskTbl[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                     0,  0,  0,  0,  0,  0,  0,  0};

static inline __m256 tail_mask(int rem) {  // first rem lanes set, 0<=rem<=8
  return _mm256_castsi256_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMaskTbl + 8 - rem)));
}



// tanh(y), relative error ~3e-7: an odd Taylor polynomial to y^11 below |y| = 0.3, above it
// (1 - e) / (1 + e) with e = exp(-2|y|) < 0.55 (exp2_ps), so the difference does not cancel.
static inline __m256 tanh_ps(__m256 y) {
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  const __m256 ay = _mm256_andnot_ps(sign, y);
  const __m256 e = exp2_ps(_mm256_mul_ps(ay, _mm256_set1_ps(-2.8853900817779268f)));
  __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  big = _mm256_or_ps(big, _mm256_and_ps(sign, y));
  const __m256 y2 = _mm256_mul_ps(y, y);
  __m256 p = _mm256_set1_ps(-1382.0f / 155925.0f);
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(62.0f / 2835.0f));
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(-17.0f / 315.0f));
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(2.0f / 15.0f));
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(-1.0f / 3.0f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, y2), y, y);
  return _mm256_blendv_ps(big, small, _mm256_cmp_ps(ay, _mm256_set1_ps(0.3f), _CMP_LT_OQ));
}

// What changes the scores before the softmax, in the kernel's units (a score is
// scale * log2(e) * q.k): Gemma 2's soft-cap c * tanh(s / c) (cap = c * log2(e); 0: none),
// then ALiBi's bias -slope_h * |i + d0 - j| for query row i and local key j (slopes: the H
// slopes times log2(e); nullptr: none), then the keys' own mask (keys: 0 for a key that may be
// attended, -inf for a hole in a run; one row of S + 8 floats per batch row, keys_bstride apart
// (0: one row for the batch); nullptr: none).
struct Mods {
  float cap = 0.0f;
  const float* slopes = nullptr;
  int64_t d0 = 0;
  const float* keys = nullptr;
  int64_t keys_bstride = 0;
  bool any() const { return cap > 0.0f || slopes || keys; }
  // the keys' mask from key k0 on, for batch row b (nullptr: none)
  const float* keys_at(int64_t b, int64_t k0) const {
    return keys ? keys + b * keys_bstride + k0 : nullptr;
  }
};

// f(CAP, BIAS, KEYS) with the modifiers of md as compile-time flags (std::bool_constant).
template <bool C, bool B, typename F>
static inline auto with_keys(const Mods& md, F&& f) {
  return md.keys ? f(std::bool_constant<C>{}, std::bool_constant<B>{}, std::true_type{})
                 : f(std::bool_constant<C>{}, std::bool_constant<B>{}, std::false_type{});
}
template <bool C, typename F>
static inline auto with_bias(const Mods& md, F&& f) {
  return md.slopes ? with_keys<C, true>(md, f) : with_keys<C, false>(md, f);
}
template <typename F>
static inline auto with_mods(const Mods& md, F&& f) {
  return md.cap > 0.0f ? with_bias<true>(md, f) : with_bias<false>(md, f);
}

// The modified scores of 8 keys at column j of a row whose query stands at column pos (kb: the
// keys' mask at column 0); t gets tanh(s / cap) (the soft-cap's derivative is 1 - t^2).
template <bool CAP, bool BIAS, bool KEYS>
static inline __m256 mod8(__m256 x, float cap, float slope, int64_t pos, int64_t j,
                          const float* kb, __m256& t) {
  if constexpr (CAP) {
    t = tanh_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.0f / cap)));
    x = _mm256_mul_ps(_mm256_set1_ps(cap), t);
  }
  if constexpr (BIAS) {
    const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 dist = _mm256_sub_ps(_mm256_set1_ps(static_cast<float>(pos - j)), lanes);
    dist = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), dist);
    x = _mm256_fnmadd_ps(_mm256_set1_ps(slope), dist, x);
  }
  if constexpr (KEYS) x = _mm256_add_ps(x, _mm256_loadu_ps(kb + j));
  return x;
}

// s[a..b] = the modified scores, in place (may write up to 7 floats past b, as row_exp does).
template <bool CAP, bool BIAS, bool KEYS>
static inline void mod_row(float* s, int64_t a, int64_t b, float cap, float slope, int64_t pos,
                           const float* kb) {
  __m256 t;
  for (int64_t j = a; j <= b; j += 8)
    _mm256_storeu_ps(s + j,
                     mod8<CAP, BIAS, KEYS>(_mm256_loadu_ps(s + j), cap, slope, pos, j, kb, t));
}

// One row of the backward over its columns ja..jb (inclusive): s = P = 2^(S' - m) and
// d = dS = scale * P * (dP - D) (times 1 - t^2 under a soft-cap), S' the modified scores; lanes
// past jb and holes in the keys' mask get 0. Returns the first column past the last one written.
template <bool CAP, bool BIAS, bool KEYS>
static inline int64_t bwd_row(float* s, float* d, int64_t ja, int64_t jb, float m, float D,
                              float scale, float cap, float slope, int64_t pos, const float* kb) {
  const __m256 vm = _mm256_set1_ps(m), vD = _mm256_set1_ps(D), vs = _mm256_set1_ps(scale);
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 t = one;
  int64_t j = ja;
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (; j + 8 <= jb + 1; j += 8) {
    __m256 x = mod8<CAP, BIAS, KEYS>(_mm256_loadu_ps(s + j), cap, slope, pos, j, kb, t);
    __m256 p = exp2_ps(_mm256_sub_ps(x, vm));
    if constexpr (KEYS) p = _mm256_and_ps(p, _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ));
    __m256 ds = _mm256_mul_ps(_mm256_mul_ps(p, vs), _mm256_sub_ps(_mm256_loadu_ps(d + j), vD));
    if constexpr (CAP) ds = _mm256_mul_ps(ds, _mm256_fnmadd_ps(t, t, one));
    _mm256_storeu_ps(s + j, p);
    _mm256_storeu_ps(d + j, ds);
  }
  const int64_t rem = jb + 1 - j;
  if (rem > 0) {
    __m256 msk = tail_mask((int)rem);
    __m256 x = mod8<CAP, BIAS, KEYS>(_mm256_loadu_ps(s + j), cap, slope, pos, j, kb, t);
    if constexpr (KEYS) msk = _mm256_and_ps(msk, _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ));
    __m256 p = _mm256_and_ps(exp2_ps(_mm256_sub_ps(x, vm)), msk);
    __m256 ds = _mm256_mul_ps(_mm256_mul_ps(p, vs), _mm256_sub_ps(_mm256_loadu_ps(d + j), vD));
    if constexpr (CAP) ds = _mm256_mul_ps(ds, _mm256_fnmadd_ps(t, t, one));
    _mm256_storeu_ps(s + j, p);
    _mm256_storeu_ps(d + j, _mm256_and_ps(ds, msk));
    j += 8;
  }
  return j;
}

// s[6 x 16] (row stride ss) = q[6 x D] (row stride D) * kt[D x 16]
template <int64_t DC>  // DC > 0: compile-time head dim
static inline void qk_6x16_t(const float* __restrict q, int64_t D_,
                             const float* __restrict kt, float* __restrict s,
                             int64_t ss) {
  const int64_t D = DC > 0 ? DC : D_;
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
  __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
  __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
  __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
  __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps();
  __m256 c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
  const float* q0 = q;
  const float* q1 = q + D;
  const float* q2 = q + 2 * D;
  const float* q3 = q + 3 * D;
  const float* q4 = q + 4 * D;
  const float* q5 = q + 5 * D;
#pragma GCC unroll 8
  for (int64_t d = 0; d < D; ++d) {
    __m256 k0 = _mm256_load_ps(kt + d * NR);
    __m256 k1 = _mm256_load_ps(kt + d * NR + 8);
    __m256 a;
    a = _mm256_broadcast_ss(q0 + d);
    c00 = _mm256_fmadd_ps(a, k0, c00); c01 = _mm256_fmadd_ps(a, k1, c01);
    a = _mm256_broadcast_ss(q1 + d);
    c10 = _mm256_fmadd_ps(a, k0, c10); c11 = _mm256_fmadd_ps(a, k1, c11);
    a = _mm256_broadcast_ss(q2 + d);
    c20 = _mm256_fmadd_ps(a, k0, c20); c21 = _mm256_fmadd_ps(a, k1, c21);
    a = _mm256_broadcast_ss(q3 + d);
    c30 = _mm256_fmadd_ps(a, k0, c30); c31 = _mm256_fmadd_ps(a, k1, c31);
    a = _mm256_broadcast_ss(q4 + d);
    c40 = _mm256_fmadd_ps(a, k0, c40); c41 = _mm256_fmadd_ps(a, k1, c41);
    a = _mm256_broadcast_ss(q5 + d);
    c50 = _mm256_fmadd_ps(a, k0, c50); c51 = _mm256_fmadd_ps(a, k1, c51);
  }
  _mm256_storeu_ps(s + 0 * ss, c00); _mm256_storeu_ps(s + 0 * ss + 8, c01);
  _mm256_storeu_ps(s + 1 * ss, c10); _mm256_storeu_ps(s + 1 * ss + 8, c11);
  _mm256_storeu_ps(s + 2 * ss, c20); _mm256_storeu_ps(s + 2 * ss + 8, c21);
  _mm256_storeu_ps(s + 3 * ss, c30); _mm256_storeu_ps(s + 3 * ss + 8, c31);
  _mm256_storeu_ps(s + 4 * ss, c40); _mm256_storeu_ps(s + 4 * ss + 8, c41);
  _mm256_storeu_ps(s + 5 * ss, c50); _mm256_storeu_ps(s + 5 * ss + 8, c51);
}

static inline void qk_6x16(const float* __restrict q, int64_t D,
                           const float* __restrict kt, float* __restrict s,
                           int64_t ss) {
  if (D == 64) qk_6x16_t<64>(q, D, kt, s, ss);
  else if (D == 128) qk_6x16_t<128>(q, D, kt, s, ss);
  else qk_6x16_t<0>(q, D, kt, s, ss);
}

// s[6 x 8] = q[6 x D] * kt[D x 8] (kt row stride NR): half-panel edge tiles
static inline void qk_6x8(const float* __restrict q, int64_t D,
                          const float* __restrict kt, float* __restrict s,
                          int64_t ss) {
  __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(), c2 = _mm256_setzero_ps();
  __m256 c3 = _mm256_setzero_ps(), c4 = _mm256_setzero_ps(), c5 = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t d = 0; d < D; ++d) {
    __m256 k0 = _mm256_load_ps(kt + d * NR);
    c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(q + d), k0, c0);
    c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(q + D + d), k0, c1);
    c2 = _mm256_fmadd_ps(_mm256_broadcast_ss(q + 2 * D + d), k0, c2);
    c3 = _mm256_fmadd_ps(_mm256_broadcast_ss(q + 3 * D + d), k0, c3);
    c4 = _mm256_fmadd_ps(_mm256_broadcast_ss(q + 4 * D + d), k0, c4);
    c5 = _mm256_fmadd_ps(_mm256_broadcast_ss(q + 5 * D + d), k0, c5);
  }
  _mm256_storeu_ps(s, c0); _mm256_storeu_ps(s + ss, c1);
  _mm256_storeu_ps(s + 2 * ss, c2); _mm256_storeu_ps(s + 3 * ss, c3);
  _mm256_storeu_ps(s + 4 * ss, c4); _mm256_storeu_ps(s + 5 * ss, c5);
}

// The products with P (forward O += P V; backward dQ += dS K, dV += P^T dO, dK += dS^T Q):
// o[6 x cols] (row stride os) += A[6 x n] * x[n x cols] (x row stride xs), where
// A(i, j) = p[i*ps + j] (rows of P) or, with TRANS, p[j*ps + i] (columns of P: the 6
// rows of the product are 6 consecutive keys).
template <bool TRANS>
static inline void ax_6x16(const float* __restrict p, int64_t ps,
                           const float* __restrict x, int64_t xs, int64_t n,
                           float* __restrict o, int64_t os) {
  const int64_t si = TRANS ? 1 : ps, sj = TRANS ? ps : 1;
  __m256 c0[MR], c1[MR];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    c0[r] = _mm256_loadu_ps(o + r * os);
    c1[r] = _mm256_loadu_ps(o + r * os + 8);
  }
#pragma GCC unroll 4
  for (int64_t j = 0; j < n; ++j) {
    const float* a = p + j * sj;
    __m256 x0 = _mm256_loadu_ps(x + j * xs);
    __m256 x1 = _mm256_loadu_ps(x + j * xs + 8);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      __m256 b = _mm256_broadcast_ss(a + r * si);
      c0[r] = _mm256_fmadd_ps(b, x0, c0[r]);
      c1[r] = _mm256_fmadd_ps(b, x1, c1[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(o + r * os, c0[r]);
    _mm256_storeu_ps(o + r * os + 8, c1[r]);
  }
}

// Same for an 8-column remainder.
template <bool TRANS>
static inline void ax_6x8(const float* __restrict p, int64_t ps,
                          const float* __restrict x, int64_t xs, int64_t n,
                          float* __restrict o, int64_t os) {
  const int64_t si = TRANS ? 1 : ps, sj = TRANS ? ps : 1;
  __m256 c[MR];
  for (int r = 0; r < MR; ++r) c[r] = _mm256_loadu_ps(o + r * os);
  for (int64_t j = 0; j < n; ++j) {
    __m256 x0 = _mm256_loadu_ps(x + j * xs);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r)
      c[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * si + j * sj), x0, c[r]);
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(o + r * os, c[r]);
}

// Scalar remainder (< 8 columns).
template <bool TRANS>
static inline void ax_6xr(const float* p, int64_t ps, const float* x, int64_t xs,
                          int64_t n, float* o, int64_t os, int64_t nc) {
  const int64_t si = TRANS ? 1 : ps, sj = TRANS ? ps : 1;
  for (int r = 0; r < MR; ++r)
    for (int64_t c = 0; c < nc; ++c) {
      float acc = o[r * os + c];
      for (int64_t j = 0; j < n; ++j) acc += p[r * si + j * sj] * x[j * xs + c];
      o[r * os + c] = acc;
    }
}

#ifndef RS_AVX512  // (the AVX-512 build's is below)
// o[6 x D] (row stride D) += A[6 x n] x[n x D] (row stride D), all column tiles.
template <bool TRANS>
static inline void ax_6xD(const float* p, int64_t ps, const float* x, int64_t D,
                          int64_t n, float* o) {
  int64_t c = 0;
  for (; c + NR <= D; c += NR) ax_6x16<TRANS>(p, ps, x + c, D, n, o + c, D);
  if (c + 8 <= D) { ax_6x8<TRANS>(p, ps, x + c, D, n, o + c, D); c += 8; }
  if (c < D) ax_6xr<TRANS>(p, ps, x + c, D, n, o + c, D, D - c);
}
#endif

// ---------------------------------------------------------------------------
// The AVX-512 float32 kernels (the build made with -DRS_AVX512, and the AVX512-BF16 build, whose
// float32 code is this too): the same tiles as the AVX2 kernels above, 16 lanes a zmm. A 16-key
// K^T panel is one zmm per row of D, so S = Q K^T runs two panels at a time (6 x 32: 12
// accumulators, FMA-bound), or one panel with the reduction over D split in two (even / odd d)
// to keep 12 sums in flight; no half panels (a zmm covers the panel whatever the run's edge
// reaches). The products with P take up to 64 columns at a time (6 x 4 zmm), a tail of < 16
// columns with masked loads and stores; the softmax and the backward's rows (without score
// modifiers) 16 lanes at a time with masked tails.
#ifdef RS_AVX512
constexpr bool kWide = true;

// s[6 x 16] (row stride ss) = q[6 x D] (row stride D) * kt[D x 16]
template <int64_t DC>  // DC > 0: compile-time head dim
static inline void qk_6x16z_t(const float* __restrict q, int64_t D_,
                              const float* __restrict kt, float* __restrict s, int64_t ss) {
  const int64_t D = DC > 0 ? DC : D_;
  __m512 a[MR], b[MR];  // even and odd d
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) { a[r] = _mm512_setzero_ps(); b[r] = _mm512_setzero_ps(); }
  int64_t d = 0;
#pragma GCC unroll 4
  for (; d + 2 <= D; d += 2) {
    const __m512 k0 = _mm512_load_ps(kt + d * NR);
    const __m512 k1 = _mm512_load_ps(kt + (d + 1) * NR);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      a[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d]), k0, a[r]);
      b[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d + 1]), k1, b[r]);
    }
  }
  if (d < D) {
    const __m512 k0 = _mm512_load_ps(kt + d * NR);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d]), k0, a[r]);
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(s + r * ss, _mm512_add_ps(a[r], b[r]));
}

// s[6 x 32] = q[6 x D] * [kt | kt + NR D]: two consecutive panels, one broadcast of q for both
template <int64_t DC>
static inline void qk_6x32z_t(const float* __restrict q, int64_t D_,
                              const float* __restrict kt, float* __restrict s, int64_t ss) {
  const int64_t D = DC > 0 ? DC : D_;
  const float* kt1 = kt + NR * D;
  __m512 a[MR], b[MR];  // the first panel's keys, the second's
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) { a[r] = _mm512_setzero_ps(); b[r] = _mm512_setzero_ps(); }
#pragma GCC unroll 4
  for (int64_t d = 0; d < D; ++d) {
    const __m512 k0 = _mm512_load_ps(kt + d * NR);
    const __m512 k1 = _mm512_load_ps(kt1 + d * NR);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m512 x = _mm512_set1_ps(q[r * D + d]);
      a[r] = _mm512_fmadd_ps(x, k0, a[r]);
      b[r] = _mm512_fmadd_ps(x, k1, b[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(s + r * ss, a[r]);
    _mm512_storeu_ps(s + r * ss + NR, b[r]);
  }
}

// s[6 x 64] = q[6 x D] * four consecutive panels (24 accumulators)
template <int64_t DC>
static inline void qk_6x64z_t(const float* __restrict q, int64_t D_,
                              const float* __restrict kt, float* __restrict s, int64_t ss) {
  const int64_t D = DC > 0 ? DC : D_;
  __m512 a[MR][4];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t d = 0; d < D; ++d) {
    __m512 k[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) k[c] = _mm512_load_ps(kt + c * NR * D + d * NR);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m512 x = _mm512_set1_ps(q[r * D + d]);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_fmadd_ps(x, k[c], a[r][c]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * ss + c * NR, a[r][c]);
}

// The scores of a 6-row tile whose keys run lo..hi against the panels from key j0 (panel: its
// K^T) up to key jend (exclusive, at most j0 + 2 NR): both panels where the run reaches both,
// else the one it reaches. Writes whole panels (16 columns each) at s.
static inline void qk_pair(const float* q, int64_t D, const float* panel, int64_t j0,
                           int64_t jend, int64_t lo, int64_t hi, float* s, int64_t ss) {
  const bool p0 = j0 + NR - 1 >= lo && j0 <= hi;
  const bool p1 = j0 + NR < jend && j0 + 2 * NR - 1 >= lo && j0 + NR <= hi;
  if (p0 && p1) {
    if (D == 64) qk_6x32z_t<64>(q, D, panel, s, ss);
    else if (D == 128) qk_6x32z_t<128>(q, D, panel, s, ss);
    else qk_6x32z_t<0>(q, D, panel, s, ss);
    return;
  }
  if (!p0 && !p1) return;
  const float* kt = p0 ? panel : panel + NR * D;
  float* dst = p0 ? s : s + NR;
  if (D == 64) qk_6x16z_t<64>(q, D, kt, dst, ss);
  else if (D == 128) qk_6x16z_t<128>(q, D, kt, dst, ss);
  else qk_6x16z_t<0>(q, D, kt, dst, ss);
}

// o[6 x 16 NC] (row stride os) += A[6 x n] x[n x 16 NC] (row stride xs), A as in ax_6x16; the
// last zmm of a row takes only the lanes of `last` (a tail of < 16 columns)
template <bool TRANS, int NC>
static inline void ax_6xz(const float* __restrict p, int64_t ps, const float* __restrict x,
                          int64_t xs, int64_t n, float* __restrict o, int64_t os,
                          __mmask16 last) {
  const int64_t si = TRANS ? 1 : ps, sj = TRANS ? ps : 1;
  __m512 c[MR][NC];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int k = 0; k < NC; ++k)
      c[r][k] = _mm512_maskz_loadu_ps(k == NC - 1 ? last : __mmask16(0xFFFF), o + r * os + 16 * k);
#pragma GCC unroll 2
  for (int64_t j = 0; j < n; ++j) {
    const float* a = p + j * sj;
    __m512 xv[NC];
#pragma GCC unroll 4
    for (int k = 0; k < NC; ++k)
      xv[k] = _mm512_maskz_loadu_ps(k == NC - 1 ? last : __mmask16(0xFFFF), x + j * xs + 16 * k);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m512 b = _mm512_set1_ps(a[r * si]);
#pragma GCC unroll 4
      for (int k = 0; k < NC; ++k) c[r][k] = _mm512_fmadd_ps(b, xv[k], c[r][k]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int k = 0; k < NC; ++k)
      _mm512_mask_storeu_ps(o + r * os + 16 * k, k == NC - 1 ? last : __mmask16(0xFFFF),
                            c[r][k]);
}

// o[6 x D] (row stride D) += A[6 x n] x[n x D] (row stride D), all column tiles: 64 columns at
// a time, then the rest (up to 3 zmm, the last one masked)
template <bool TRANS>
static inline void ax_6xD(const float* p, int64_t ps, const float* x, int64_t D, int64_t n,
                          float* o) {
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) ax_6xz<TRANS, 4>(p, ps, x + c, D, n, o + c, D, 0xFFFF);
  const int64_t rem = D - c;
  if (rem == 0) return;
  const __mmask16 last = rem % 16 ? __mmask16((1u << (rem % 16)) - 1) : __mmask16(0xFFFF);
  switch ((rem + 15) / 16) {
    case 1: ax_6xz<TRANS, 1>(p, ps, x + c, D, n, o + c, D, last); break;
    case 2: ax_6xz<TRANS, 2>(p, ps, x + c, D, n, o + c, D, last); break;
    case 3: ax_6xz<TRANS, 3>(p, ps, x + c, D, n, o + c, D, last); break;
    default: ax_6xz<TRANS, 4>(p, ps, x + c, D, n, o + c, D, last); break;
  }
}

// The softmax's two passes over a row, 16 lanes at a time (the AVX2 row_max / row_exp below,
// widened): max of s[a..b]; s[a..b] = 2^(s[a..b] - m) in place (nothing past b), their sum.
// Four (max) and two (sum) independent accumulators, so neither pass waits on one chain of
// dependent max / add instructions. 2^x (x clamped at -125 as exp2_ps does): vreduceps gives
// f = x - floor(x) in [0, 1) in one instruction, a degree-5 minimax polynomial of 2^f on
// [0, 1) (rel. error ~1.6e-7 in float32), vscalefps multiplies by 2^floor(x): 3 instructions
// fewer than round, subtract and an exponent add.
static constexpr float kExp2Poly01[6] = {0.0018775727367028594f, 0.008989344350993633f,
                                         0.05582631751894951f,   0.24015361070632935f,
                                         0.6931530833244324f,    0.9999999403953552f};
static inline __m512 exp2_ps512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(kExp2Poly01[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly01[i]));
  return _mm512_scalef_ps(p, x);
}
static inline float row_max16(const float* s, int64_t a, int64_t b) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;
  int64_t j = a;
  for (; j + 64 <= b + 1; j += 64) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + j));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + j + 16));
    m2 = _mm512_max_ps(m2, _mm512_loadu_ps(s + j + 32));
    m3 = _mm512_max_ps(m3, _mm512_loadu_ps(s + j + 48));
  }
  for (; j + 16 <= b + 1; j += 16) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + j));
  if (j <= b) {
    const __mmask16 k = static_cast<__mmask16>((1u << (b + 1 - j)) - 1);
    m1 = _mm512_max_ps(m1, _mm512_mask_loadu_ps(ninf, k, s + j));
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
}
static inline float row_exp16(float* s, int64_t a, int64_t b, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t j = a;
  for (; j + 32 <= b + 1; j += 32) {
    const __m512 e0 = exp2_ps512(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
    const __m512 e1 = exp2_ps512(_mm512_sub_ps(_mm512_loadu_ps(s + j + 16), vm));
    _mm512_storeu_ps(s + j, e0);
    _mm512_storeu_ps(s + j + 16, e1);
    acc0 = _mm512_add_ps(acc0, e0);
    acc1 = _mm512_add_ps(acc1, e1);
  }
  for (; j + 16 <= b + 1; j += 16) {
    const __m512 e = exp2_ps512(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
    _mm512_storeu_ps(s + j, e);
    acc0 = _mm512_add_ps(acc0, e);
  }
  if (j <= b) {
    const __mmask16 k = static_cast<__mmask16>((1u << (b + 1 - j)) - 1);
    const __m512 e = exp2_ps512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), vm));
    _mm512_mask_storeu_ps(s + j, k, e);
    acc1 = _mm512_mask_add_ps(acc1, k, acc1, e);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// bwd_row (below) without score modifiers, 16 lanes at a time: s = P = 2^(s - m), d = dS =
// scale * P * (d - D) over ja..jb, 0 in the lanes past jb; returns the first column past the
// last one written (at most 15 past jb)
static inline int64_t bwd_row16(float* s, float* d, int64_t ja, int64_t jb, float m, float D,
                                float scale) {
  const __m512 vm = _mm512_set1_ps(m), vD = _mm512_set1_ps(D), vs = _mm512_set1_ps(scale);
  int64_t j = ja;
  for (; j + 16 <= jb + 1; j += 16) {
    const __m512 p = exp2_ps512(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
    const __m512 dd = _mm512_sub_ps(_mm512_loadu_ps(d + j), vD);
    const __m512 ds = _mm512_mul_ps(_mm512_mul_ps(p, vs), dd);
    _mm512_storeu_ps(s + j, p);
    _mm512_storeu_ps(d + j, ds);
  }
  if (j <= jb) {
    const __mmask16 k = static_cast<__mmask16>((1u << (jb + 1 - j)) - 1);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), vm);
    const __m512 p = _mm512_maskz_mov_ps(k, exp2_ps512(x));
    const __m512 dd = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, d + j), vD);
    _mm512_storeu_ps(s + j, p);
    _mm512_storeu_ps(d + j, _mm512_maskz_mul_ps(k, _mm512_mul_ps(p, vs), dd));
    j += 16;
  }
  return j;
}

#else  // the AVX2 build: never called (kWide gates every use), declared for if constexpr
constexpr bool kWide = false;
static inline void qk_pair(const float*, int64_t, const float*, int64_t, int64_t, int64_t,
                           int64_t, float*, int64_t) {}
template <int64_t DC>
static inline void qk_6x64z_t(const float*, int64_t, const float*, float*, int64_t) {}
static inline float row_max16(const float*, int64_t, int64_t) { return 0.0f; }
static inline float row_exp16(float*, int64_t, int64_t, float) { return 0.0f; }
static inline int64_t bwd_row16(float*, float*, int64_t, int64_t, float, float, float) {
  return 0;
}
#endif

// qk_6x64z_t with the head dim a compile-time constant where it is a common one (AVX-512)
static inline void qk_6x64(const float* q, int64_t D, const float* panel, float* s, int64_t ss) {
  if (D == 64) qk_6x64z_t<64>(q, D, panel, s, ss);
  else if (D == 128) qk_6x64z_t<128>(q, D, panel, s, ss);
  else qk_6x64z_t<0>(q, D, panel, s, ss);
}

// ---------------------------------------------------------------------------
// bfloat16 dot products (AVX512-BF16's vdpbf16ps: pairs of bf16 multiplied exactly and summed
// into float32 lanes), used forward and backward on bfloat16 inputs in the build made with
// -DRS_BF16DOT (rowspan.py builds it only where the CPU has avx512_bf16). Operands are pairs
// of bf16 along the reduction, one uint32 each:
//   * K panels [Dk/2][16 keys] of (k[key][2p], k[key][2p + 1]) pairs, 16 keys a zmm;
//   * V [key pairs][Dvp] of (v[2j][c], v[2j + 1][c]) pairs, 16 columns a zmm (Dvp: Dv
//     rounded up to 16, zeros past Dv and past S);
//   * rows of Q (Dk rounded up to even, zero padded) and of P (converted from the float32
//     softmax, rounded to nearest even) broadcast one pair at a time.
#ifdef RS_BF16DOT
constexpr bool kDot = true;
static inline __m512 dot2(__m512 acc, uint32_t a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(a)), (__m512bh)b);
}
// the same with the pair read from memory as an embedded broadcast ({1to16}): gcc does not
// fold the broadcast into vdpbf16ps itself, and the separate vpbroadcastd took as many slots
static inline __m512 dot2m(__m512 acc, const uint32_t* a, __m512i b) {
  __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(b), "m"(*a));
  return acc;
}

// s[6 x 16] (row stride ss) = sc * q[6 x 2 D2] k^T, q rows of D2 pairs (row stride qs pairs)
static inline void qk_dot_6x16(const uint32_t* __restrict q, int64_t qs, int64_t D2,
                               const uint32_t* __restrict kp, float* __restrict s, int64_t ss,
                               float sc) {
  __m512 a[MR], b[MR];  // two sums per row (even / odd pairs) to hide the latency
  for (int r = 0; r < MR; ++r) { a[r] = _mm512_setzero_ps(); b[r] = _mm512_setzero_ps(); }
  int64_t p = 0;
  for (; p + 2 <= D2; p += 2) {
    const __m512i k0 = _mm512_loadu_si512(kp + p * NR);
    const __m512i k1 = _mm512_loadu_si512(kp + (p + 1) * NR);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      a[r] = dot2m(a[r], q + r * qs + p, k0);
      b[r] = dot2m(b[r], q + r * qs + p + 1, k1);
    }
  }
  if (p < D2) {
    const __m512i k0 = _mm512_loadu_si512(kp + p * NR);
    for (int r = 0; r < MR; ++r) a[r] = dot2m(a[r], q + r * qs + p, k0);
  }
  const __m512 vs = _mm512_set1_ps(sc);
  for (int r = 0; r < MR; ++r)
    _mm512_storeu_ps(s + r * ss, _mm512_mul_ps(_mm512_add_ps(a[r], b[r]), vs));
}

// s[6 x 8] = sc * q k^T for half a K panel (kp: the panel's first or second 8 keys; rows of
// pairs 16 apart): the tiles at the ragged edges of the runs
static inline __m256 dot2m8(__m256 acc, const uint32_t* a, __m256i b) {
  __asm__("vdpbf16ps %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(b), "m"(*a));
  return acc;
}
static inline void qk_dot_6x8(const uint32_t* __restrict q, int64_t qs, int64_t D2,
                              const uint32_t* __restrict kp, float* __restrict s, int64_t ss,
                              float sc) {
  __m256 a[MR], b[MR];
  for (int r = 0; r < MR; ++r) { a[r] = _mm256_setzero_ps(); b[r] = _mm256_setzero_ps(); }
  int64_t p = 0;
  for (; p + 2 <= D2; p += 2) {
    const __m256i k0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp + p * NR));
    const __m256i k1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp + (p + 1) * NR));
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      a[r] = dot2m8(a[r], q + r * qs + p, k0);
      b[r] = dot2m8(b[r], q + r * qs + p + 1, k1);
    }
  }
  if (p < D2) {
    const __m256i k0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp + p * NR));
    for (int r = 0; r < MR; ++r) a[r] = dot2m8(a[r], q + r * qs + p, k0);
  }
  const __m256 vs = _mm256_set1_ps(sc);
  for (int r = 0; r < MR; ++r)
    _mm256_storeu_ps(s + r * ss, _mm256_mul_ps(_mm256_add_ps(a[r], b[r]), vs));
}

// The 6 x 16 scores of a tile against the panel from key j0 (j0 - kbase keys into kp), or
// only the half of it that the tile's keys lo..hi reach, as the float32 kernel does
static inline void qk_dot_tile(const uint32_t* q, int64_t D2, const uint32_t* kp, int64_t j0,
                               int64_t lo, int64_t hi, float* s, int64_t ss, float sc) {
  if (lo >= j0 + 8) qk_dot_6x8(q, D2, D2, kp + 8, s + 8, ss, sc);
  else if (hi < j0 + 8) qk_dot_6x8(q, D2, D2, kp, s, ss, sc);
  else qk_dot_6x16(q, D2, D2, kp, s, ss, sc);
}

// o[6 x 16 NC] (row stride os) += A[6 x 2 np] V, A(r, j) the pair p[r * si + j * sj] (rows of
// P: si the row stride, sj = 1; or, transposed, 6 keys of row pairs: si = 1, sj the stride of a
// row pair), V np rows of pairs (row stride vs pairs)
template <int NC>
static inline void pv_dot_6(const uint32_t* __restrict p, int64_t si, int64_t sj,
                            const uint32_t* __restrict v, int64_t vs, int64_t np,
                            float* __restrict o, int64_t os) {
  __m512 c[MR][NC];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
    for (int x = 0; x < NC; ++x) c[r][x] = _mm512_loadu_ps(o + r * os + 16 * x);
  for (int64_t j = 0; j < np; ++j) {
    __m512i vv[NC];
    for (int x = 0; x < NC; ++x) vv[x] = _mm512_loadu_si512(v + j * vs + 16 * x);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const uint32_t pr = p[r * si + j * sj];
      for (int x = 0; x < NC; ++x) c[r][x] = dot2(c[r][x], pr, vv[x]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
    for (int x = 0; x < NC; ++x) _mm512_storeu_ps(o + r * os + 16 * x, c[r][x]);
}

// o[6 x Dvp] += A V over all column tiles (Dvp a multiple of 16; A as in pv_dot_6)
static inline void pv_dot(const uint32_t* p, int64_t si, int64_t sj, const uint32_t* v,
                          int64_t Dvp, int64_t np, float* o) {
  int64_t c = 0;
  for (; c + 64 <= Dvp; c += 64) pv_dot_6<4>(p, si, sj, v + c, Dvp, np, o + c, Dvp);
  switch ((Dvp - c) / 16) {
    case 3: pv_dot_6<3>(p, si, sj, v + c, Dvp, np, o + c, Dvp); break;
    case 2: pv_dot_6<2>(p, si, sj, v + c, Dvp, np, o + c, Dvp); break;
    case 1: pv_dot_6<1>(p, si, sj, v + c, Dvp, np, o + c, Dvp); break;
    default: break;
  }
}

// Row pairs of the float32 rows x (row stride xs) interleaved: dst[rp * ds + c] = (x[2 rp][c],
// x[2 rp + 1][c]) as bf16, for rp < np and c < n (n a multiple of 16; rows past nrows read 0)
static inline void row_pairs(const float* x, int64_t xs, int64_t nrows, int64_t np, int64_t n,
                             uint32_t* dst, int64_t ds) {
  for (int64_t rp = 0; rp < np; ++rp) {
    const float* r0 = x + 2 * rp * xs;
    const float* r1 = 2 * rp + 1 < nrows ? r0 + xs : nullptr;
    for (int64_t c = 0; c < n; c += 16) {
      const __m512i a = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r0 + c)));
      const __m512i b = r1 ? _mm512_cvtepu16_epi32(
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r1 + c)))
                           : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + rp * ds + c, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
  }
}

// bf16 pairs of the float32 s[a..e) (a, e even) at dst[a/2..e/2), rounded to nearest even
static inline void to_pairs(const float* s, int64_t a, int64_t e, uint16_t* dst) {
  int64_t j = a;
  for (; j + 16 <= e; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + j)));
  if (j < e) {
    const __mmask16 m = static_cast<__mmask16>((1u << (e - j)) - 1);
    const __m256i x = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, s + j));
    _mm256_mask_storeu_epi16(dst + j, m, x);
  }
}

// a row of D bf16 as D2 = ceil(D / 2) pairs (odd D: the last is (x, 0))
static inline void q_pairs(const uint16_t* src, int64_t D, uint32_t* dst) {
  std::memcpy(dst, src, static_cast<size_t>(D) * sizeof(uint16_t));
  if (D & 1) dst[D / 2] = src[D - 1];
}

// O[6 x Dvp] += P V for one tile over its keys A..B (inclusive, relative to the chunk): the
// tile's float32 P rows (stride ss) become bf16 pairs over the even-aligned [A & ~1, B | 1]
// (the column beside an odd end is set to 0 first), pb the pairs' rows (stride ss), v the V
// pairs from the chunk's first key on
static inline void pv_dot_tile(float* s, uint16_t* pb, int64_t ss, int64_t A, int64_t B,
                               const uint32_t* v, int64_t Dvp, float* o) {
  const int64_t a2 = A & ~int64_t(1), e2 = (B | 1) + 1;
  for (int r = 0; r < MR; ++r) {
    float* row = s + r * ss;
    if (A & 1) row[a2] = 0.0f;
    if (!(B & 1)) row[e2 - 1] = 0.0f;
    to_pairs(row, a2, e2, pb + r * ss);
  }
  pv_dot(reinterpret_cast<const uint32_t*>(pb + a2), ss / 2, 1, v + (a2 / 2) * Dvp, Dvp,
         (e2 - a2) / 2, o);
}

// K panel of the 16 keys from key0 (zeros past S): dst[p * 16 + jj] = pair p of key key0 + jj
static inline void pack_k_pairs(const uint16_t* k, int64_t key0, int64_t S, int64_t D,
                                uint32_t* dst) {
  const int64_t D2 = (D + 1) / 2;
  for (int jj = 0; jj < NR; ++jj) {
    const int64_t key = key0 + jj;
    if (key >= S) {
      for (int64_t p = 0; p < D2; ++p) dst[p * NR + jj] = 0;
      continue;
    }
    const uint16_t* row = k + key * D;
    int64_t p = 0;
    for (; 2 * p + 1 < D; ++p) {
      uint32_t u;
      std::memcpy(&u, row + 2 * p, sizeof u);
      dst[p * NR + jj] = u;
    }
    if (p < D2) dst[p * NR + jj] = row[2 * p];  // odd D: the last pair is (k, 0)
  }
}

// V pairs of the 16 keys from key0 (key0 even; zeros past S and past Dv): dst[jp * Dvp + c]
static inline void pack_v_pairs(const uint16_t* v, int64_t key0, int64_t S, int64_t Dv,
                                int64_t Dvp, uint32_t* dst) {
  const __m256i zero = _mm256_setzero_si256();
  for (int jp = 0; jp < NR / 2; ++jp) {
    const int64_t j = key0 + 2 * jp;
    const uint16_t* r0 = j < S ? v + j * Dv : nullptr;
    const uint16_t* r1 = j + 1 < S ? v + (j + 1) * Dv : nullptr;
    uint32_t* out = dst + jp * Dvp;
    for (int64_t c = 0; c < Dvp; c += 16) {
      const int64_t n = std::min<int64_t>(16, Dv - c);
      const __mmask16 m = n >= 16 ? __mmask16(0xFFFF) : n > 0 ? __mmask16((1u << n) - 1) : 0;
      const __m256i x0 = r0 ? _mm256_maskz_loadu_epi16(m, r0 + c) : zero;
      const __m256i x1 = r1 ? _mm256_maskz_loadu_epi16(m, r1 + c) : zero;
      const __m512i lo = _mm512_cvtepu16_epi32(x0);
      const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(x1), 16);
      _mm512_storeu_si512(out + c, _mm512_or_si512(lo, hi));
    }
  }
}
#else  // the AVX2 build: never called (kDot gates every use), declared for if constexpr
constexpr bool kDot = false;
static inline void qk_dot_tile(const uint32_t*, int64_t, const uint32_t*, int64_t, int64_t,
                               int64_t, float*, int64_t, float) {}
static inline void pv_dot_tile(float*, uint16_t*, int64_t, int64_t, int64_t, const uint32_t*,
                               int64_t, float*) {}
static inline void q_pairs(const uint16_t*, int64_t, uint32_t*) {}
static inline void pack_k_pairs(const uint16_t*, int64_t, int64_t, int64_t, uint32_t*) {}
static inline void pack_v_pairs(const uint16_t*, int64_t, int64_t, int64_t, int64_t,
                                uint32_t*) {}
static inline void pv_dot(const uint32_t*, int64_t, int64_t, const uint32_t*, int64_t, int64_t,
                          float*) {}
static inline void row_pairs(const float*, int64_t, int64_t, int64_t, int64_t, uint32_t*,
                             int64_t) {}
#endif

// max of s[a..b] (inclusive); may read up to 7 floats past b.
static inline float row_max(const float* s, int64_t a, int64_t b) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m0 = ninf, m1 = ninf;
  int64_t j = a;
  for (; j + 16 <= b + 1; j += 16) {
    m0 = _mm256_max_ps(m0, _mm256_loadu_ps(s + j));
    m1 = _mm256_max_ps(m1, _mm256_loadu_ps(s + j + 8));
  }
  for (; j + 8 <= b + 1; j += 8) m0 = _mm256_max_ps(m0, _mm256_loadu_ps(s + j));
  int64_t rem = b + 1 - j;
  if (rem > 0) {
    __m256 x = _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + j), tail_mask((int)rem));
    m1 = _mm256_max_ps(m1, x);
  }
  return hmax(_mm256_max_ps(m0, m1));
}

// s[a..b] = 2^(s[a..b] - m) in place, returns the sum; lanes past b (up to 7)
// are written as 0.
static inline float row_exp(float* s, int64_t a, int64_t b, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t j = a;
  for (; j + 16 <= b + 1; j += 16) {
    __m256 e0 = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
    __m256 e1 = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j + 8), vm));
    _mm256_storeu_ps(s + j, e0);
    _mm256_storeu_ps(s + j + 8, e1);
    acc0 = _mm256_add_ps(acc0, e0);
    acc1 = _mm256_add_ps(acc1, e1);
  }
  for (; j + 8 <= b + 1; j += 8) {
    __m256 e0 = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
    _mm256_storeu_ps(s + j, e0);
    acc0 = _mm256_add_ps(acc0, e0);
  }
  int64_t rem = b + 1 - j;
  if (rem > 0) {
    __m256 e0 = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
    e0 = _mm256_and_ps(e0, tail_mask((int)rem));
    _mm256_storeu_ps(s + j, e0);
    acc1 = _mm256_add_ps(acc1, e0);
  }
  return hsum(_mm256_add_ps(acc0, acc1));
}

static inline void zero_range(float* s, int64_t a, int64_t b) {  // inclusive
  for (int64_t j = a; j <= b; ++j) s[j] = 0.0f;
}

template <Dt E>
static inline void transpose8_store(const elem_t<E>* const* rows, int64_t d, float* dst) {
  // rows[0..7] point to 8 key rows; stores dst[x*NR + y] = rows[y][d + x], x,y < 8
  __m256 r0 = load8<E>(rows[0] + d), r1 = load8<E>(rows[1] + d);
  __m256 r2 = load8<E>(rows[2] + d), r3 = load8<E>(rows[3] + d);
  __m256 r4 = load8<E>(rows[4] + d), r5 = load8<E>(rows[5] + d);
  __m256 r6 = load8<E>(rows[6] + d), r7 = load8<E>(rows[7] + d);
  __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_store_ps(dst + 0 * NR, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_store_ps(dst + 1 * NR, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_store_ps(dst + 2 * NR, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_store_ps(dst + 3 * NR, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_store_ps(dst + 4 * NR, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_store_ps(dst + 5 * NR, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_store_ps(dst + 6 * NR, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_store_ps(dst + 7 * NR, _mm256_permute2f128_ps(u3, u7, 0x31));
}

// panel[d*NR + jj] = k[key0 + jj][d] (zero for keys >= L), jj < NR, as float32; zrow: D zero
// elements (all-zero bits, which is 0 in every element type)
template <Dt E>
static inline void pack_panel(const elem_t<E>* kp, int64_t key0, int64_t L, int64_t D,
                              const float* zrow, float* panel) {
  const elem_t<E>* rows[NR];
  const elem_t<E>* z = reinterpret_cast<const elem_t<E>*>(zrow);
  for (int jj = 0; jj < NR; ++jj)
    rows[jj] = (key0 + jj < L) ? kp + (key0 + jj) * D : z;
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    transpose8_store<E>(rows, d, panel + d * NR);
    transpose8_store<E>(rows + 8, d, panel + d * NR + 8);
  }
  for (; d < D; ++d)
    for (int jj = 0; jj < NR; ++jj) panel[d * NR + jj] = load1<E>(rows[jj] + d);
}

// The float32 rows [j0, min(j0 + NR, S)) of x (row length D) at dst (row j at dst + (j - base)
// * D): K or V rows that the products read in place, for a low-precision x.
template <Dt E>
static inline void convert_rows(const elem_t<E>* x, int64_t j0, int64_t S, int64_t D,
                                int64_t base, float* dst) {
  const int64_t j1 = std::min<int64_t>(j0 + NR, S);
  if (j1 > j0) load_row<E>(x + j0 * D, dst + (j0 - base) * D, (j1 - j0) * D);
}

struct AlignedBuf {
  float* p = nullptr;
  explicit AlignedBuf(size_t n) {
    size_t bytes = ((n * sizeof(float) + 63) / 64) * 64 + 64;
    p = static_cast<float*>(std::aligned_alloc(64, bytes));
    std::fill(p, p + bytes / sizeof(float), 0.0f);
  }
  ~AlignedBuf() { std::free(p); }
  AlignedBuf(const AlignedBuf&) = delete;
  AlignedBuf& operator=(const AlignedBuf&) = delete;
};

// A buffer that keeps its largest size (contents undefined after a grow).
struct GrowBuf {
  float* p = nullptr;
  size_t cap = 0;
  void ensure(size_t n) {
    if (n <= cap) return;
    std::free(p);
    const size_t bytes = ((n * sizeof(float) + 63) / 64) * 64 + 64;
    p = static_cast<float*>(std::aligned_alloc(64, bytes));
    cap = bytes / sizeof(float) - 16;
  }
  GrowBuf() = default;
  ~GrowBuf() { std::free(p); }
  GrowBuf(const GrowBuf&) = delete;
  GrowBuf& operator=(const GrowBuf&) = delete;
};

static inline int64_t round_up(int64_t x, int64_t m) { return ((x + m - 1) / m) * m; }

// Per-row key spans: row i of batch row b attends keys lo..hi (inclusive), read clamped to
// [0, S] and [-1, S - 1]; lo > hi is an empty row. Both are non-decreasing in i.
struct Spans {
  const int64_t* lo;
  const int64_t* hi;
  int64_t bstride;  // 0 when one row of spans serves the whole batch
  int64_t S;
  inline int64_t l(int64_t b, int64_t i) const {
    return std::min<int64_t>(std::max<int64_t>(lo[b * bstride + i], 0), S);
  }
  inline int64_t h(int64_t b, int64_t i) const {
    return std::min<int64_t>(std::max<int64_t>(hi[b * bstride + i], -1), S - 1);
  }
};

// keys per softmax chunk, at most (forward, backward); -D at build time for tuning runs
#ifndef RS_MAXKC_FWD
#define RS_MAXKC_FWD 512
#endif
#ifndef RS_MAXKC_BWD
#define RS_MAXKC_BWD 512
#endif

// The work of one call: items (b, kv head, chunk of C query rows), ordered by cost
// (largest first: threads pull them from a shared counter).
struct Work {
  int64_t C = 0, nch = 0, KC = NR, nitems = 0;
  std::vector<int64_t> order;
};

static Work plan_work(int64_t B, int64_t Hkv, int64_t L, const Spans& sp, int64_t nth,
                      int64_t maxkc, int64_t mb = MB) {
  Work w;
  const int64_t BK = B * Hkv;
  const int64_t target = std::max<int64_t>(1, (8 * nth + BK - 1) / BK);
  int64_t C = (L + target - 1) / target;
  C = std::min<int64_t>(C, 2048);
  C = round_up(std::max<int64_t>(C, mb), mb);
  w.C = C;
  w.nch = (L + C - 1) / C;
  w.nitems = BK * w.nch;
  const int64_t nb = sp.bstride ? B : 1;
  int64_t maxw = NR;
  std::vector<double> cost(static_cast<size_t>(nb * w.nch), 0.0);
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t i0 = 0; i0 < L; i0 += mb) {
      const int64_t i1 = std::min<int64_t>(L, i0 + mb) - 1;
      const int64_t blo = sp.l(b, i0), bhi = sp.h(b, i1);
      if (blo <= bhi) {
        maxw = std::max<int64_t>(maxw, bhi + 1 - (blo / NR) * NR);
        cost[b * w.nch + i0 / C] += double(bhi + 1 - blo) * double(i1 + 1 - i0);
      }
    }
  }
  w.KC = std::min<int64_t>(maxkc, round_up(maxw, NR));
  w.order.resize(static_cast<size_t>(w.nitems));
  for (int64_t t = 0; t < w.nitems; ++t) w.order[t] = t;
  const int64_t nchk = w.nch;
  std::stable_sort(w.order.begin(), w.order.end(), [&](int64_t x, int64_t y) {
    const int64_t bx = sp.bstride ? (x / nchk) / Hkv : 0, by = sp.bstride ? (y / nchk) / Hkv : 0;
    return cost[bx * nchk + x % nchk] > cost[by * nchk + y % nchk];
  });
  return w;
}

// Runs fn(item) for every item on at::get_num_threads() threads, each pulling the next item.
// flush: denormal float32 results and inputs count as 0 while the items run (MXCSR's FTZ and
// DAZ, restored after): the bf16 dot-product code met denormal dS values (P * (dP - D) far
// below 2^-126) that made its backward 1.4x slower; values that small change no result here.
struct FlushDenormals {  // sets FTZ | DAZ for its lifetime (when on), then restores MXCSR
  unsigned csr;
  bool on;
  explicit FlushDenormals(bool f) : csr(_mm_getcsr()), on(f) {
    if (on) _mm_setcsr(csr | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
  }
  ~FlushDenormals() {
    if (on) _mm_setcsr(csr);
  }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

template <typename Init, typename Fn>
static void run_items(const Work& w, int64_t nth, bool flush, Init init, Fn fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nth, 1, [&](int64_t, int64_t) {
    const FlushDenormals guard(flush);
    auto state = init();
    for (;;) {
      const int64_t t = next.fetch_add(1);
      if (t >= w.nitems) break;
      fn(*state, w.order[t]);
    }
    _mm_sfence();
  });
}

// ---------------------------------------------------------------------------
// Forward.
struct FwdState {
  GrowBuf kt, vb;  // vb: float32 V rows (low-precision inputs only), or V pairs (dot)
  AlignedBuf qs, sb, ob, zrow, pb;  // pb: P as bf16 pairs (dot)
  FwdState(int64_t mb, int64_t Dk, int64_t Dv, int64_t SS, bool dot)
      : qs(mb * Dk), sb(mb * SS + NR), ob(mb * Dv), zrow(std::max(Dk, Dv)),
        pb(dot ? mb * SS / 2 + NR : 1) {}
};

template <Dt E>
static void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const Spans& sp, double scale, const Mods& md, at::Tensor& out,
                         at::Tensor& lse, bool& finite) {
  using T = elem_t<E>;
  constexpr bool LOWP = E != Dt::F32;
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), Dk = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2), Dv = v.size(3);
  const int64_t g = H / Hkv;
  const int64_t nth = std::max<int64_t>(1, at::get_num_threads());
  // bfloat16 dot products (the -DRS_BF16DOT build): Q, K, V and P as bf16 pairs
  constexpr bool DOT = kDot && E == Dt::BF16;
  constexpr int64_t FB = kWide && !DOT ? MBW : MB;  // query rows per block
  const Work w = plan_work(B, Hkv, L, sp, nth, RS_MAXKC_FWD, FB);
  const int64_t C = w.C, nch = w.nch, KC = w.KC;
  const int64_t SS = KC + NR;  // S row stride (room for tail over-writes)
  const float sc = static_cast<float>(scale * 1.4426950408889634);
  const float ln2 = 0.6931471805599453f;
  const float NINF = -std::numeric_limits<float>::infinity();
  const bool modded = md.any(), holes = md.keys != nullptr;  // holes: a chunk may have none
  const int64_t Dk2 = (Dk + 1) / 2, Dvp = round_up(Dv, 16);
  const int64_t OS = DOT ? Dvp : Dv;  // row stride of the output accumulators
  const T* qd = static_cast<const T*>(q.data_ptr());
  const T* kd = static_cast<const T*>(k.data_ptr());
  const T* vd = static_cast<const T*>(v.data_ptr());
  T* od = static_cast<T*>(out.data_ptr());
  float* ld = lse.data_ptr<float>();

  // NaN or inf in a query row, or in a key or value row a span may reach (the K panels and V
  // rows an item packs or reads: its rows' keys, rounded out to whole panels), clears
  // `finite`: the caller then applies the non-finite rule (attnkit.backends.nonfinite). Each
  // element is checked where it is read anyway, so a finite call pays no pass of its own.
  std::atomic<bool> bad{false};
  auto check = [&](const T* p, int64_t n) {
    if (n > 0 && !all_finite<E>(p, n)) bad.store(true, std::memory_order_relaxed);
  };
  auto empty_rows = [&](int64_t b, int64_t hk, int64_t r0, int64_t n) {
    for (int64_t gi = 0; gi < g; ++gi) {
      const int64_t bh = b * H + hk * g + gi;
      check(qd + (bh * L + r0) * Dk, n * Dk);  // a bad query row is NaN whatever its mask
      std::fill(od + (bh * L + r0) * Dv, od + (bh * L + r0 + n) * Dv, T(0));
      std::fill(ld + bh * L + r0, ld + bh * L + r0 + n, NINF);
    }
  };

  run_items(w, nth, DOT, [&] { return std::make_unique<FwdState>(FB, Dk, OS, SS, DOT); },
            [&](FwdState& st, int64_t item) {
    float mrow[MBW], lrow[MBW];
    int64_t rl[MBW], rh[MBW];
    int64_t tA[MBW / MR], tB[MBW / MR], tlo[MBW / MR], thi[MBW / MR];
    const int64_t bk = item / nch, ci = item % nch;
    const int64_t b = bk / Hkv, hk = bk % Hkv, bs = sp.bstride ? b : 0;
    const T* kp = kd + bk * S * Dk;
    const T* vp = vd + bk * S * Dv;
    const int64_t c0 = ci * C, c1 = std::min(L, c0 + C);
    const int64_t kfirst = sp.l(bs, c0), klast = sp.h(bs, c1 - 1);
    if (kfirst > klast) { empty_rows(b, hk, c0, c1 - c0); return; }
    const int64_t kbase = (kfirst / NR) * NR;
    const int64_t nk = round_up(klast + 1, NR) - kbase + NR;
    st.kt.ensure(static_cast<size_t>(nk * Dk));
    float* kt = st.kt.p;
    // V rows as the P V product reads them: in place (float32), or converted once per item
    const float* vrows;  // row j at vrows + (j - vbase) * Dv
    int64_t vbase = 0;
    if constexpr (LOWP) {
      st.vb.ensure(static_cast<size_t>(nk * (DOT ? Dvp / 2 : Dv)));
      vrows = st.vb.p;
      vbase = kbase;
    } else {
      vrows = vp;
    }
    int64_t packed_end = kbase;

    for (int64_t i0 = c0; i0 < c1; i0 += FB) {
      const int64_t mr = std::min<int64_t>(FB, c1 - i0);
      for (int64_t r = 0; r < mr; ++r) { rl[r] = sp.l(bs, i0 + r); rh[r] = sp.h(bs, i0 + r); }
      const int64_t blo = rl[0], bhi = rh[mr - 1];
      if (blo > bhi) { empty_rows(b, hk, i0, mr); continue; }
      const int64_t need = round_up(bhi + 1, NR);  // pack K^T panels up to bhi
      while (packed_end < need) {
        const int64_t rows = std::min<int64_t>(packed_end + NR, S) - packed_end;
        check(kp + packed_end * Dk, rows * Dk);
        check(vp + packed_end * Dv, rows * Dv);
        if constexpr (DOT) {
          const int64_t at = packed_end - kbase;
          pack_k_pairs(kp, packed_end, S, Dk, reinterpret_cast<uint32_t*>(kt) + at * Dk2);
          pack_v_pairs(vp, packed_end, S, Dv, Dvp,
                       reinterpret_cast<uint32_t*>(st.vb.p) + (at / 2) * Dvp);
        } else {
          pack_panel<E>(kp, packed_end, S, Dk, st.zrow.p, kt + (packed_end - kbase) * Dk);
          if constexpr (LOWP) convert_rows<E>(vp, packed_end, S, Dv, kbase, st.vb.p);
        }
        packed_end += NR;
      }
      const int64_t ntile = (mr + MR - 1) / MR;
      for (int64_t t = 0; t < ntile; ++t) {
        tlo[t] = rl[t * MR];
        thi[t] = rh[std::min<int64_t>(t * MR + MR, mr) - 1];
      }
      for (int64_t gi = 0; gi < g; ++gi) {  // the group's heads share the panels
        const int64_t bh = b * H + hk * g + gi;
        const T* qp = qd + bh * L * Dk;
        T* op = od + bh * L * Dv;
        float* lp = ld + bh * L;
        const float slope = md.slopes ? md.slopes[hk * g + gi] : 0.0f;
        check(qp + i0 * Dk, mr * Dk);
        for (int64_t r = 0; r < FB; ++r) {  // scaled Q block, zero padded
          if constexpr (DOT) {  // unscaled bf16 pairs (the scores are scaled as stored)
            uint32_t* dst = reinterpret_cast<uint32_t*>(st.qs.p) + r * Dk2;
            if (r < mr) q_pairs(qp + (i0 + r) * Dk, Dk, dst);
            else std::fill(dst, dst + Dk2, 0u);
            continue;
          }
          float* dst = st.qs.p + r * Dk;
          if (r < mr) {
            const T* src = qp + (i0 + r) * Dk;
            if constexpr (LOWP) load_row<E>(src, dst, Dk, sc);
            else for (int64_t d = 0; d < Dk; ++d) dst[d] = src[d] * sc;
          } else {
            std::fill(dst, dst + Dk, 0.0f);
          }
        }
        std::fill(st.ob.p, st.ob.p + FB * OS, 0.0f);
        for (int r = 0; r < FB; ++r) { mrow[r] = NINF; lrow[r] = 0.0f; }
        float* sb = st.sb.p;

        for (int64_t kc0 = (blo / NR) * NR; kc0 <= bhi; kc0 += KC) {
          const int64_t kc1 = std::min<int64_t>(kc0 + KC, bhi + 1);  // exclusive
          // ---- S = Q K^T on the tiles the spans touch
          if constexpr (kWide && !DOT) {  // two panels at a time, 16 keys a zmm
            for (int64_t j0 = kc0; j0 < kc1; j0 += 4 * NR) {  // 64 keys: 4 panels at a time
              const float* panel = kt + (j0 - kbase) * Dk;
              for (int64_t t = 0; t < ntile; ++t) {
                const float* qt = st.qs.p + t * MR * Dk;
                float* sd = sb + t * MR * SS + (j0 - kc0);
                if (j0 + 4 * NR <= kc1 && tlo[t] <= j0 && thi[t] >= j0 + 4 * NR - 1) {
                  qk_6x64(qt, Dk, panel, sd, SS);
                  continue;
                }
                for (int64_t j = j0; j < std::min<int64_t>(j0 + 4 * NR, kc1); j += 2 * NR)
                  qk_pair(qt, Dk, kt + (j - kbase) * Dk, j, std::min<int64_t>(j + 2 * NR, kc1),
                          tlo[t], thi[t], sb + t * MR * SS + (j - kc0), SS);
              }
            }
          } else
          for (int64_t j0 = kc0; j0 < kc1; j0 += NR) {
            const float* panel = kt + (j0 - kbase) * Dk;
            for (int64_t t = 0; t < ntile; ++t) {
              if (j0 + NR - 1 < tlo[t] || j0 > thi[t]) continue;
              float* sdst = sb + t * MR * SS + (j0 - kc0);
              if constexpr (DOT) {
                qk_dot_tile(reinterpret_cast<const uint32_t*>(st.qs.p) + t * MR * Dk2, Dk2,
                            reinterpret_cast<const uint32_t*>(kt) + (j0 - kbase) * Dk2, j0,
                            tlo[t], thi[t], sdst, SS, sc);
                continue;
              }
              const float* qt = st.qs.p + t * MR * Dk;
              if (tlo[t] >= j0 + 8) qk_6x8(qt, Dk, panel + 8, sdst + 8, SS);
              else if (thi[t] < j0 + 8) qk_6x8(qt, Dk, panel, sdst, SS);
              else qk_6x16(qt, Dk, panel, sdst, SS);
            }
          }
          // ---- softmax (exact per row, online across chunks)
          for (int64_t t = 0; t < ntile; ++t) {
            const int64_t A = std::max<int64_t>(tlo[t], kc0);
            const int64_t Bt = std::min<int64_t>(thi[t], kc1 - 1);
            tA[t] = A; tB[t] = Bt;
            if (A > Bt) continue;
            for (int rr = 0; rr < MR; ++rr) {
              const int64_t ri = t * MR + rr;
              float* srow = sb + ri * SS;
              if (ri >= mr) { zero_range(srow, A - kc0, Bt - kc0); continue; }
              const int64_t a = std::max<int64_t>(rl[ri], kc0);
              const int64_t bb = std::min<int64_t>(rh[ri], kc1 - 1);
              if (a > bb) { zero_range(srow, A - kc0, Bt - kc0); continue; }
              if (modded) {
                const float* kb = md.keys_at(b, kc0);
                const int64_t pos = i0 + ri + md.d0 - kc0;
                with_mods(md, [&](auto C, auto Bi, auto K) {
                  mod_row<C, Bi, K>(srow, a - kc0, bb - kc0, md.cap, slope, pos, kb);
                });
              }
              const float cm =
                  kWide ? row_max16(srow, a - kc0, bb - kc0) : row_max(srow, a - kc0, bb - kc0);
              if (holes && cm == NINF) { zero_range(srow, A - kc0, Bt - kc0); continue; }
              const float mo = mrow[ri];
              const float mn = std::max(mo, cm);
              float alpha = 1.0f;
              if (mo != mn) {
                alpha = (mo == NINF) ? 0.0f : std::exp2(mo - mn);
                float* orow = st.ob.p + ri * OS;
                for (int64_t d = 0; d < Dv; ++d) orow[d] *= alpha;
              }
              const float sum = kWide ? row_exp16(srow, a - kc0, bb - kc0, mn)
                                    : row_exp(srow, a - kc0, bb - kc0, mn);
              lrow[ri] = lrow[ri] * alpha + sum;
              mrow[ri] = mn;
              zero_range(srow, A - kc0, a - kc0 - 1);
              zero_range(srow, bb - kc0 + 1, Bt - kc0);
            }
          }
          // ---- O += P V  (V rows in place; or P and V as bf16 pairs)
          for (int64_t t = 0; t < ntile; ++t) {
            if (tA[t] > tB[t]) continue;
            if constexpr (DOT) {
              pv_dot_tile(sb + t * MR * SS, reinterpret_cast<uint16_t*>(st.pb.p) + t * MR * SS,
                          SS, tA[t] - kc0, tB[t] - kc0,
                          reinterpret_cast<const uint32_t*>(st.vb.p) + ((kc0 - kbase) / 2) * Dvp,
                          Dvp, st.ob.p + t * MR * Dvp);
              continue;
            }
            ax_6xD<false>(sb + t * MR * SS + (tA[t] - kc0), SS, vrows + (tA[t] - vbase) * Dv, Dv,
                          tB[t] - tA[t] + 1, st.ob.p + t * MR * Dv);
          }
        }
        // ---- normalize + write out (a row that saw nothing: 0 and lse -inf)
        for (int64_t r = 0; r < mr; ++r) {
          T* dst = op + (i0 + r) * Dv;
          if (!(lrow[r] > 0.0f)) {
            std::fill(dst, dst + Dv, T(0));
            lp[i0 + r] = NINF;
            continue;
          }
          const float inv = 1.0f / lrow[r];
          const float* src = st.ob.p + r * OS;
          if constexpr (LOWP) {
            store_row<E>(src, dst, Dv, inv);
          } else {
            int64_t d = 0;
            if ((reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
              const __m256 vinv = _mm256_set1_ps(inv);
              for (; d + 8 <= Dv; d += 8)
                _mm256_stream_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), vinv));
            }
            for (; d < Dv; ++d) dst[d] = src[d] * inv;
          }
          lp[i0 + r] = mrow[r] * ln2 + logf(lrow[r]);
        }
      }
    }
  });
  finite = !bad.load();
}

// ---------------------------------------------------------------------------
// Backward: per item, dQ of its rows (all heads of the group) is written directly; dK and dV
// of the keys it touches are summed in the item's own buffers, then added to dk/dv one stripe
// of keys at a time (items of one kv head overlap in keys wherever spans are wide), in a fixed
// order: the order the items are handed out in (Work::order), whatever order they finish in.
// An item whose turn on a stripe has not come parks a copy of its sums there, and the item
// before it adds them after its own; so every element of dk, dv is the same float32 sum in the
// same order on every run (for one thread count, which sets the items), bitwise repeatable.
constexpr int64_t LOCK_KEYS = 256;

// One stripe of keys of one (b, kv head): how many items add to it, whose turn it is, and the
// sums of the items that finished before their turn (by rank: rows s0..s0+n-1, Dk then Dv).
struct Parked {
  int64_t s0 = 0, n = 0;
  std::unique_ptr<float[]> sums;
};
struct Stripe {
  std::mutex m;
  int64_t total = 0, turn = 0;
  std::vector<Parked> parked;
};

// dst[r * D + d] += src[r * stride + d] for n rows
static inline void add_rows(float* dst, const float* src, int64_t stride, int64_t D, int64_t n) {
  if (stride == D) {
    for (int64_t e = 0; e < n * D; ++e) dst[e] += src[e];
    return;
  }
  for (int64_t r = 0; r < n; ++r)
    for (int64_t d = 0; d < D; ++d) dst[r * D + d] += src[r * stride + d];
}

struct BwdState {
  GrowBuf kt, vt, dka, dva, kb;  // kb: float32 K rows (low-precision inputs only), or pairs
  AlignedBuf qs, qr, gb, sb, db, ob, zrow;
  AlignedBuf gi, pb, pt, dt;  // dot only: dO row pairs, dS pairs, P^T and dS^T row pairs
  BwdState(int64_t mb, int64_t Dk, int64_t Dv, int64_t SS, bool dot)
      : qs(mb * Dk), qr(mb * Dk), gb(mb * Dv), sb(mb * SS + NR), db(mb * SS + NR),
        ob(mb * Dk), zrow(std::max(Dk, Dv)), gi(dot ? mb * Dv / 2 + NR : 1),
        pb(dot ? mb * SS / 2 + NR : 1), pt(dot ? mb * SS / 2 + NR : 1),
        dt(dot ? mb * SS / 2 + NR : 1) {}
};

// dq in the element type; dk, dv float32 sums (zeros on entry). For a low-precision element
// type, dk_low and dv_low (same shapes, element type) get dk and dv converted, one stripe of
// keys as soon as the last item that adds to it is done (while it is still in cache).
template <Dt E>
static void backward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& out, const at::Tensor& dout, const at::Tensor& lse,
                          const Spans& sp, double scale, const Mods& md, at::Tensor& dq,
                          at::Tensor& dk, at::Tensor& dv, at::Tensor& dk_low,
                          at::Tensor& dv_low) {
  using T = elem_t<E>;
  constexpr bool LOWP = E != Dt::F32;
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), Dk = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2), Dv = v.size(3);
  const int64_t g = H / Hkv;
  const int64_t nth = std::max<int64_t>(1, at::get_num_threads());
  // bfloat16 dot products (the -DRS_BF16DOT build): every product on bf16 pairs (P and dS
  // rounded to bf16), sums in float32; accumulators of dQ, dK, dV padded to 16 columns
  constexpr bool DOT = kDot && E == Dt::BF16;
  constexpr int64_t BB = kWide && !DOT ? MBW : MB;  // query rows per block
  const Work w = plan_work(B, Hkv, L, sp, nth, RS_MAXKC_BWD, BB);
  const int64_t C = w.C, nch = w.nch, KC = w.KC;
  const int64_t SS = KC + 2 * NR;
  const float sc = static_cast<float>(scale * 1.4426950408889634);
  const float log2e = 1.4426950408889634f;
  const int64_t Dk2 = (Dk + 1) / 2, Dv2 = (Dv + 1) / 2;
  const int64_t Dkp = round_up(Dk, 16), Dvp = round_up(Dv, 16);
  const int64_t KS = DOT ? Dkp : Dk, VS = DOT ? Dvp : Dv;  // accumulator row strides
  const float fscale = static_cast<float>(scale);
  const float NINF = -std::numeric_limits<float>::infinity();
  const T* qd = static_cast<const T*>(q.data_ptr());
  const T* kd = static_cast<const T*>(k.data_ptr());
  const T* vd = static_cast<const T*>(v.data_ptr());
  const T* od = static_cast<const T*>(out.data_ptr());
  const T* gd = static_cast<const T*>(dout.data_ptr());
  const float* ld = lse.data_ptr<float>();
  T* dqd = static_cast<T*>(dq.data_ptr());
  float* dkd = dk.data_ptr<float>();
  float* dvd = dv.data_ptr<float>();
  const int64_t nstripe = std::max<int64_t>(1, (S + LOCK_KEYS - 1) / LOCK_KEYS);
  std::unique_ptr<Stripe[]> stripes(new Stripe[static_cast<size_t>(B * Hkv * nstripe)]);
  // the keys an item adds to (kf > kl: none)
  auto item_keys = [&](int64_t item, int64_t& kf, int64_t& kl) {
    const int64_t bk = item / nch, ci = item % nch, bs = sp.bstride ? bk / Hkv : 0;
    const int64_t c0 = ci * C, c1 = std::min(L, c0 + C);
    kf = sp.l(bs, c0);
    kl = sp.h(bs, c1 - 1);
  };
  // each item's rank on each stripe it adds to, in the order the items are handed out:
  // rank[first[item] + t - kf / LOCK_KEYS] for stripe t
  std::vector<int64_t> first(static_cast<size_t>(w.nitems + 1), 0), rank;
  for (int64_t item = 0; item < w.nitems; ++item) {
    int64_t kf, kl;
    item_keys(item, kf, kl);
    first[item + 1] = first[item] + (kf <= kl ? kl / LOCK_KEYS - kf / LOCK_KEYS + 1 : 0);
  }
  rank.resize(static_cast<size_t>(first[w.nitems]));
  for (int64_t at = 0; at < w.nitems; ++at) {
    const int64_t item = w.order[at], bk = item / nch;
    int64_t kf, kl;
    item_keys(item, kf, kl);
    if (kf > kl) continue;
    for (int64_t t = kf / LOCK_KEYS; t <= kl / LOCK_KEYS; ++t)
      rank[first[item] + t - kf / LOCK_KEYS] = stripes[bk * nstripe + t].total++;
  }
  T* dkl = nullptr;
  T* dvl = nullptr;
  auto convert_stripe = [&](int64_t bk, int64_t stripe) {
    const int64_t a = stripe * LOCK_KEYS, e = std::min<int64_t>(S, a + LOCK_KEYS);
    store_row<E>(dkd + (bk * S + a) * Dk, dkl + (bk * S + a) * Dk, (e - a) * Dk);
    store_row<E>(dvd + (bk * S + a) * Dv, dvl + (bk * S + a) * Dv, (e - a) * Dv);
  };
  if constexpr (LOWP) {
    dkl = static_cast<T*>(dk_low.data_ptr());
    dvl = static_cast<T*>(dv_low.data_ptr());
    for (int64_t bk = 0; bk < B * Hkv; ++bk)  // stripes no item reaches: zeros
      for (int64_t t = 0; t < nstripe; ++t)
        if (stripes[bk * nstripe + t].total == 0) convert_stripe(bk, t);
  }

  auto zero_dq = [&](int64_t b, int64_t hk, int64_t r0, int64_t n) {
    for (int64_t gi = 0; gi < g; ++gi) {
      const int64_t bh = b * H + hk * g + gi;
      std::fill(dqd + (bh * L + r0) * Dk, dqd + (bh * L + r0 + n) * Dk, T(0));
    }
  };

  run_items(w, nth, DOT, [&] { return std::make_unique<BwdState>(BB, KS, VS, SS, DOT); },
            [&](BwdState& st, int64_t item) {
    float mrow[BB], drow[BB];
    int64_t rl[BB], rh[BB];
    int64_t tA[BB / MR], tB[BB / MR], tlo[BB / MR], thi[BB / MR];
    const int64_t bk = item / nch, ci = item % nch;
    const int64_t b = bk / Hkv, hk = bk % Hkv, bs = sp.bstride ? b : 0;
    const T* kp = kd + bk * S * Dk;
    const T* vp = vd + bk * S * Dv;
    const int64_t c0 = ci * C, c1 = std::min(L, c0 + C);
    const int64_t kfirst = sp.l(bs, c0), klast = sp.h(bs, c1 - 1);
    if (kfirst > klast) { zero_dq(b, hk, c0, c1 - c0); return; }
    const int64_t kbase = (kfirst / NR) * NR;
    const int64_t nk = round_up(klast + 1, NR) - kbase + 2 * NR;
    st.kt.ensure(static_cast<size_t>(nk * Dk));
    st.vt.ensure(static_cast<size_t>(nk * Dv));
    st.dka.ensure(static_cast<size_t>(nk * KS));
    st.dva.ensure(static_cast<size_t>(nk * VS));
    float *kt = st.kt.p, *vt = st.vt.p, *dka = st.dka.p, *dva = st.dva.p;
    // K rows as the dS K product reads them: in place (float32), or converted once per item
    const float* krows;  // row j at krows + (j - krbase) * Dk
    int64_t krbase = 0;
    if constexpr (LOWP) {
      st.kb.ensure(static_cast<size_t>(nk * (DOT ? Dkp / 2 : Dk)));
      krows = st.kb.p;
      krbase = kbase;
    } else {
      krows = kp;
    }
    std::fill(dka, dka + nk * KS, 0.0f);
    std::fill(dva, dva + nk * VS, 0.0f);
    float *sb = st.sb.p, *db = st.db.p;
    int64_t packed_end = kbase;

    for (int64_t i0 = c0; i0 < c1; i0 += BB) {
      const int64_t mr = std::min<int64_t>(BB, c1 - i0);
      for (int64_t r = 0; r < mr; ++r) { rl[r] = sp.l(bs, i0 + r); rh[r] = sp.h(bs, i0 + r); }
      const int64_t blo = rl[0], bhi = rh[mr - 1];
      if (blo > bhi) { zero_dq(b, hk, i0, mr); continue; }
      const int64_t need = round_up(bhi + 1, NR);
      while (packed_end < need) {
        if constexpr (DOT) {
          const int64_t at = packed_end - kbase;
          pack_k_pairs(kp, packed_end, S, Dk, reinterpret_cast<uint32_t*>(kt) + at * Dk2);
          pack_k_pairs(vp, packed_end, S, Dv, reinterpret_cast<uint32_t*>(vt) + at * Dv2);
          pack_v_pairs(kp, packed_end, S, Dk, Dkp,
                       reinterpret_cast<uint32_t*>(st.kb.p) + (at / 2) * Dkp);
        } else {
          pack_panel<E>(kp, packed_end, S, Dk, st.zrow.p, kt + (packed_end - kbase) * Dk);
          pack_panel<E>(vp, packed_end, S, Dv, st.zrow.p, vt + (packed_end - kbase) * Dv);
          if constexpr (LOWP) convert_rows<E>(kp, packed_end, S, Dk, kbase, st.kb.p);
        }
        packed_end += NR;
      }
      const int64_t ntile = (mr + MR - 1) / MR;
      for (int64_t t = 0; t < ntile; ++t) {
        tlo[t] = rl[t * MR];
        thi[t] = rh[std::min<int64_t>(t * MR + MR, mr) - 1];
      }
      for (int64_t gi = 0; gi < g; ++gi) {
        const int64_t bh = b * H + hk * g + gi;
        const T* qp = qd + bh * L * Dk;
        const T* op = od + bh * L * Dv;
        const T* gp = gd + bh * L * Dv;
        const float* lp = ld + bh * L;
        const float slope = md.slopes ? md.slopes[hk * g + gi] : 0.0f;
        if constexpr (DOT) {  // Q and dO rows as pairs along D, and as row pairs
          uint32_t* qi = reinterpret_cast<uint32_t*>(st.qr.p);
          uint32_t* gi2 = reinterpret_cast<uint32_t*>(st.gi.p);
          for (int64_t r0 = 0; r0 < BB; r0 += NR) {
            pack_v_pairs(qp, i0 + r0, i0 + mr, Dk, Dkp, qi + (r0 / 2) * Dkp);
            pack_v_pairs(gp, i0 + r0, i0 + mr, Dv, Dvp, gi2 + (r0 / 2) * Dvp);
          }
        }
        for (int64_t r = 0; r < BB; ++r) {
          if constexpr (DOT) {
            uint32_t* d1 = reinterpret_cast<uint32_t*>(st.qs.p) + r * Dk2;
            uint32_t* d3 = reinterpret_cast<uint32_t*>(st.gb.p) + r * Dv2;
            if (r < mr) {
              q_pairs(qp + (i0 + r) * Dk, Dk, d1);
              const T* s3 = gp + (i0 + r) * Dv;
              const T* s4 = op + (i0 + r) * Dv;
              q_pairs(s3, Dv, d3);
              __m256 acc = _mm256_setzero_ps();
              int64_t d = 0;
              for (; d + 8 <= Dv; d += 8)
                acc = _mm256_fmadd_ps(load8<E>(s3 + d), load8<E>(s4 + d), acc);
              float dsum = hsum(acc);
              for (; d < Dv; ++d) dsum += load1<E>(s3 + d) * load1<E>(s4 + d);
              drow[r] = dsum;
              mrow[r] = lp[i0 + r] * log2e;
            } else {
              std::fill(d1, d1 + Dk2, 0u);
              std::fill(d3, d3 + Dv2, 0u);
              drow[r] = 0.0f;
              mrow[r] = NINF;
            }
            continue;
          }
          float* d1 = st.qs.p + r * Dk;
          float* d2 = st.qr.p + r * Dk;
          float* d3 = st.gb.p + r * Dv;
          if (r < mr) {
            const T* s1 = qp + (i0 + r) * Dk;
            if constexpr (LOWP) {
              load_row<E>(s1, d2, Dk);
              for (int64_t d = 0; d < Dk; ++d) d1[d] = d2[d] * sc;
            } else {
              for (int64_t d = 0; d < Dk; ++d) { d1[d] = s1[d] * sc; d2[d] = s1[d]; }
            }
            const T* s3 = gp + (i0 + r) * Dv;
            const T* s4 = op + (i0 + r) * Dv;
            __m256 acc = _mm256_setzero_ps();
            int64_t d = 0;
            for (; d + 8 <= Dv; d += 8) {
              const __m256 gg = load8<E>(s3 + d);
              _mm256_storeu_ps(d3 + d, gg);
              acc = _mm256_fmadd_ps(gg, load8<E>(s4 + d), acc);
            }
            float dsum = hsum(acc);
            for (; d < Dv; ++d) {
              const float gv = load1<E>(s3 + d);
              d3[d] = gv;
              dsum += gv * load1<E>(s4 + d);
            }
            drow[r] = dsum;
            mrow[r] = lp[i0 + r] * log2e;
          } else {
            std::fill(d1, d1 + Dk, 0.0f);
            std::fill(d2, d2 + Dk, 0.0f);
            std::fill(d3, d3 + Dv, 0.0f);
            drow[r] = 0.0f;
            mrow[r] = NINF;
          }
        }
        std::fill(st.ob.p, st.ob.p + BB * KS, 0.0f);

        for (int64_t kc0 = (blo / NR) * NR; kc0 <= bhi; kc0 += KC) {
          const int64_t kc1 = std::min<int64_t>(kc0 + KC, bhi + 1);  // exclusive
          const int64_t Z = std::min<int64_t>(SS, kc1 - kc0 + NR);  // columns kept clean
          // ---- S = Qs K^T, dP = dO V^T on the tiles the spans touch
          if constexpr (kWide && !DOT) {  // 16 keys a zmm: 64 keys (four panels) at a time
            // where the tile's spans cover them (as the forward), else two panels at a time
            for (int64_t j0 = kc0; j0 < kc1; j0 += 4 * NR) {
              const int64_t j4 = std::min<int64_t>(j0 + 4 * NR, kc1);
              for (int64_t t = 0; t < ntile; ++t) {
                const float* qt = st.qs.p + t * MR * Dk;
                const float* gt = st.gb.p + t * MR * Dv;
                if (j0 + 4 * NR <= kc1 && tlo[t] <= j0 && thi[t] >= j0 + 4 * NR - 1) {
                  qk_6x64(qt, Dk, kt + (j0 - kbase) * Dk, sb + t * MR * SS + (j0 - kc0), SS);
                  qk_6x64(gt, Dv, vt + (j0 - kbase) * Dv, db + t * MR * SS + (j0 - kc0), SS);
                  continue;
                }
                for (int64_t j = j0; j < j4; j += 2 * NR) {
                  const int64_t jend = std::min<int64_t>(j + 2 * NR, kc1);
                  qk_pair(qt, Dk, kt + (j - kbase) * Dk, j, jend, tlo[t], thi[t],
                          sb + t * MR * SS + (j - kc0), SS);
                  qk_pair(gt, Dv, vt + (j - kbase) * Dv, j, jend, tlo[t], thi[t],
                          db + t * MR * SS + (j - kc0), SS);
                }
              }
            }
          } else
          for (int64_t j0 = kc0; j0 < kc1; j0 += NR) {
            const float* kpan = kt + (j0 - kbase) * Dk;
            const float* vpan = vt + (j0 - kbase) * Dv;
            for (int64_t t = 0; t < ntile; ++t) {
              if (j0 + NR - 1 < tlo[t] || j0 > thi[t]) continue;
              float* sdst = sb + t * MR * SS + (j0 - kc0);
              float* ddst = db + t * MR * SS + (j0 - kc0);
              if constexpr (DOT) {
                const uint32_t* q2 = reinterpret_cast<const uint32_t*>(st.qs.p);
                const uint32_t* g2 = reinterpret_cast<const uint32_t*>(st.gb.p);
                const uint32_t* k2 = reinterpret_cast<const uint32_t*>(kt);
                const uint32_t* v2 = reinterpret_cast<const uint32_t*>(vt);
                const int64_t lo = tlo[t], hi = thi[t];
                qk_dot_tile(q2 + t * MR * Dk2, Dk2, k2 + (j0 - kbase) * Dk2, j0, lo, hi, sdst, SS,
                            sc);
                qk_dot_tile(g2 + t * MR * Dv2, Dv2, v2 + (j0 - kbase) * Dv2, j0, lo, hi, ddst, SS,
                            1.0f);
                continue;
              }
              const float* qt = st.qs.p + t * MR * Dk;
              const float* gt = st.gb.p + t * MR * Dv;
              if (tlo[t] >= j0 + 8) {
                qk_6x8(qt, Dk, kpan + 8, sdst + 8, SS);
                qk_6x8(gt, Dv, vpan + 8, ddst + 8, SS);
              } else if (thi[t] < j0 + 8) {
                qk_6x8(qt, Dk, kpan, sdst, SS);
                qk_6x8(gt, Dv, vpan, ddst, SS);
              } else {
                qk_6x16(qt, Dk, kpan, sdst, SS);
                qk_6x16(gt, Dv, vpan, ddst, SS);
              }
            }
          }
          // ---- P = exp2(S - lse*log2e), dS = scale * P * (dP - Di); zeros elsewhere in
          // the row's first Z columns (the P^T products read whole columns)
          for (int64_t t = 0; t < BB / MR; ++t) {
            tA[t] = t < ntile ? std::max<int64_t>(tlo[t], kc0) : 1;
            tB[t] = t < ntile ? std::min<int64_t>(thi[t], kc1 - 1) : 0;
          }
          for (int64_t ri = 0; ri < BB; ++ri) {
            float* srow = sb + ri * SS;
            float* drw = db + ri * SS;
            const int64_t a = ri < mr ? std::max<int64_t>(rl[ri], kc0) : 1;
            const int64_t bb = ri < mr ? std::min<int64_t>(rh[ri], kc1 - 1) : 0;
            if (ri >= mr || a > bb || !(mrow[ri] > NINF)) {
              std::fill(srow, srow + Z, 0.0f);
              std::fill(drw, drw + Z, 0.0f);
              continue;
            }
            const int64_t ja = a - kc0, jb = bb - kc0;  // inclusive columns
            std::fill(srow, srow + ja, 0.0f);
            std::fill(drw, drw + ja, 0.0f);
            const int64_t pos = i0 + ri + md.d0 - kc0;
            const float m = mrow[ri], D = drow[ri];
            const float* kb = md.keys_at(b, kc0);
            const int64_t j =
                kWide && !md.any()
                    ? bwd_row16(srow, drw, ja, jb, m, D, fscale)
                    : with_mods(md, [&](auto C, auto Bi, auto K) {
                        return bwd_row<C, Bi, K>(srow, drw, ja, jb, m, D, fscale, md.cap, slope,
                                                 pos, kb);
                      });
            if (j < Z) {
              std::fill(srow + j, srow + Z, 0.0f);
              std::fill(drw + j, drw + Z, 0.0f);
            }
          }
          if constexpr (DOT) {  // the same products on bf16 pairs
            const int64_t ka = std::max<int64_t>(blo, kc0), kb = std::min<int64_t>(bhi, kc1 - 1);
            const int64_t np = (mr + 1) / 2, zc = round_up(Z, 16), ps = SS;
            uint32_t* pt = reinterpret_cast<uint32_t*>(st.pt.p);
            uint32_t* dt = reinterpret_cast<uint32_t*>(st.dt.p);
            for (int64_t t = 0; t < ntile; ++t) {  // dQ += dS K
              if (tA[t] > tB[t]) continue;
              pv_dot_tile(db + t * MR * SS, reinterpret_cast<uint16_t*>(st.pb.p) + t * MR * SS,
                          SS, tA[t] - kc0, tB[t] - kc0,
                          reinterpret_cast<const uint32_t*>(krows) + ((kc0 - kbase) / 2) * Dkp,
                          Dkp, st.ob.p + t * MR * Dkp);
            }
            row_pairs(sb, SS, mr, np, zc, pt, ps);  // P^T and dS^T as row pairs
            row_pairs(db, SS, mr, np, zc, dt, ps);
            const uint32_t* qi = reinterpret_cast<const uint32_t*>(st.qr.p);
            const uint32_t* gi2 = reinterpret_cast<const uint32_t*>(st.gi.p);
            int64_t ra = 0, rb = -1;
            for (int64_t j = ka; j <= kb; j += MR) {  // dV += P^T dO, dK += dS^T Q
              while (ra < mr && rh[ra] < j) ++ra;
              while (rb + 1 < mr && rl[rb + 1] <= j + MR - 1) ++rb;
              if (ra > rb) continue;
              const int64_t col = j - kc0, p0 = ra / 2, n2 = rb / 2 - p0 + 1;
              pv_dot(pt + p0 * ps + col, 1, ps, gi2 + p0 * Dvp, Dvp, n2, dva + (j - kbase) * Dvp);
              pv_dot(dt + p0 * ps + col, 1, ps, qi + p0 * Dkp, Dkp, n2, dka + (j - kbase) * Dkp);
            }
            continue;
          }
          // ---- dQ += dS K  (K rows in place)
          for (int64_t t = 0; t < ntile; ++t) {
            if (tA[t] > tB[t]) continue;
            ax_6xD<false>(db + t * MR * SS + (tA[t] - kc0), SS, krows + (tA[t] - krbase) * Dk, Dk,
                          tB[t] - tA[t] + 1, st.ob.p + t * MR * Dk);
          }
          // ---- dV += P^T dO, dK += dS^T Q over 6-key tiles, rows ra..rb: those whose
          // spans can reach the tile (both ends move forward with the key)
          const int64_t ka = std::max<int64_t>(blo, kc0), kb = std::min<int64_t>(bhi, kc1 - 1);
          int64_t ra = 0, rb = -1;
          for (int64_t j = ka; j <= kb; j += MR) {
            while (ra < mr && rh[ra] < j) ++ra;
            while (rb + 1 < mr && rl[rb + 1] <= j + MR - 1) ++rb;
            if (ra > rb) continue;
            const int64_t col = j - kc0;
            ax_6xD<true>(sb + ra * SS + col, SS, st.gb.p + ra * Dv, Dv, rb - ra + 1,
                         dva + (j - kbase) * Dv);
            ax_6xD<true>(db + ra * SS + col, SS, st.qr.p + ra * Dk, Dk, rb - ra + 1,
                         dka + (j - kbase) * Dk);
          }
        }
        if constexpr (DOT) {
          for (int64_t r = 0; r < mr; ++r)
            store_row<E>(st.ob.p + r * Dkp, dqd + (bh * L + i0 + r) * Dk, Dk);
        } else if constexpr (LOWP) {
          store_row<E>(st.ob.p, dqd + (bh * L + i0) * Dk, mr * Dk);
        } else {
          std::copy(st.ob.p, st.ob.p + mr * Dk, dqd + (bh * L + i0) * Dk);
        }
      }
    }
    // ---- this item's keys [kfirst, klast] into dk, dv, one stripe at a time, in turn
    for (int64_t s0 = kfirst, r = first[item]; s0 <= klast; ++r) {
      const int64_t stripe = s0 / LOCK_KEYS;
      const int64_t s1 = std::min<int64_t>(klast + 1, (stripe + 1) * LOCK_KEYS), n = s1 - s0;
      const float* sk = dka + (s0 - kbase) * KS;
      const float* sv = dva + (s0 - kbase) * VS;
      Stripe& sl = stripes[bk * nstripe + stripe];
      std::lock_guard<std::mutex> guard(sl.m);
      if (sl.turn != rank[r]) {  // an item handed out before this one has yet to add here
        if (sl.parked.empty()) sl.parked.resize(static_cast<size_t>(sl.total));
        Parked& pk = sl.parked[rank[r]];
        pk.s0 = s0;
        pk.n = n;
        pk.sums.reset(new float[static_cast<size_t>(n * (Dk + Dv))]);
        for (int64_t i = 0; i < n; ++i) {
          std::copy(sk + i * KS, sk + i * KS + Dk, pk.sums.get() + i * Dk);
          std::copy(sv + i * VS, sv + i * VS + Dv, pk.sums.get() + n * Dk + i * Dv);
        }
        s0 = s1;
        continue;
      }
      add_rows(dkd + (bk * S + s0) * Dk, sk, KS, Dk, n);
      add_rows(dvd + (bk * S + s0) * Dv, sv, VS, Dv, n);
      // then the items after it that finished first, in their order
      while (++sl.turn < sl.total && !sl.parked.empty() && sl.parked[sl.turn].sums) {
        Parked& pk = sl.parked[sl.turn];
        add_rows(dkd + (bk * S + pk.s0) * Dk, pk.sums.get(), Dk, Dk, pk.n);
        add_rows(dvd + (bk * S + pk.s0) * Dv, pk.sums.get() + pk.n * Dk, Dv, Dv, pk.n);
        pk.sums.reset();
      }
      if constexpr (LOWP)
        if (sl.turn == sl.total) convert_stripe(bk, stripe);
      s0 = s1;
    }
  });
}

// Checks what the kernel's memory safety depends on; returns the spans (contiguous int64).
// sizes: q (B, H, L, Dk), k (B, Hkv, S, Dk), v (B, Hkv, S, Dv); the caller (native.py) has
// checked the dims, dtypes and contiguity of every tensor it passes.
static Spans check_inputs(const int64_t* sizes, int32_t dtype, const int64_t* lp,
                          const int64_t* hp, int64_t lo_rows, int64_t lo_cols) {
  const int64_t* qs = sizes;
  const int64_t* ks = sizes + 4;
  const int64_t* vs = sizes + 8;
  ABI_CHECK(dtype == attnkit_abi::F32 || dtype == attnkit_abi::BF16 || dtype == attnkit_abi::F16,
            "row-span kernel: q, k, v must be float32, bfloat16 or float16, all one dtype");
  ABI_CHECK(dtype != attnkit_abi::F16 || (attnkit_abi::low_dtype_bits() & 2),
            "row-span kernel: built without F16C, it does not read float16");
  const int64_t B = qs[0], H = qs[1], L = qs[2];
  ABI_CHECK(ks[0] == B && vs[0] == B && ks[1] == vs[1] && ks[2] == vs[2] && ks[3] == qs[3],
            "row-span kernel: k (B, Hkv, S, Dk) and v (B, Hkv, S, Dv) do not fit q");
  ABI_CHECK(ks[1] >= 1 && H % ks[1] == 0, "row-span kernel: H % Hkv != 0");
  ABI_CHECK(qs[3] >= 1 && vs[3] >= 1, "row-span kernel: empty head dim");
  ABI_CHECK((lo_rows == 1 || lo_rows == B) && lo_cols == L,
            "row-span kernel: lo, hi must be contiguous int64 (1 or B, L)");
  for (int64_t b = 0; b < lo_rows; ++b)
    for (int64_t i = 1; i < L; ++i)
      ABI_CHECK(lp[b * L + i] >= lp[b * L + i - 1] && hp[b * L + i] >= hp[b * L + i - 1],
                "row-span kernel: lo and hi must be non-decreasing along the rows");
  return Spans{lp, hp, lo_rows == 1 ? 0 : L, ks[2]};
}

// The score modifiers of a call (see Mods); slopes_log2 keeps the scaled slopes alive.
// slopes: n_slopes float64 (0: none); keys: keys_rows x keys_cols float32 (0 rows: none).
static Mods check_mods(const int64_t* sizes, double softcap, const double* slopes,
                       int64_t n_slopes, int64_t d0, const float* keys, int64_t keys_rows,
                       int64_t keys_cols, std::vector<float>& slopes_log2) {
  constexpr double LOG2E = 1.4426950408889634;
  ABI_CHECK(softcap >= 0.0 && std::isfinite(softcap),
            "row-span kernel: softcap must be finite and >= 0 (0: none)");
  Mods md;
  md.cap = static_cast<float>(softcap * LOG2E);
  md.d0 = d0;
  if (n_slopes > 0) {
    ABI_CHECK(n_slopes == sizes[1],
              "row-span kernel: ALiBi slopes must be a CPU tensor (H,), one per query head");
    slopes_log2.resize(static_cast<size_t>(n_slopes));
    for (int64_t h = 0; h < n_slopes; ++h) slopes_log2[h] = static_cast<float>(slopes[h] * LOG2E);
    md.slopes = slopes_log2.data();
  }
  if (keys_rows > 0) {
    ABI_CHECK((keys_rows == 1 || keys_rows == sizes[0]) && keys_cols >= sizes[6] + 8,
              "row-span kernel: keys must be contiguous float32 (1 or B, >= S + 8), 0 or -inf");
    md.keys = keys;
    md.keys_bstride = keys_rows == 1 ? 0 : keys_cols;
  }
  return md;
}

// what both entry functions check and read first: the runs of keys, the modifiers (soft-cap,
// ALiBi, key holes; `keep` holds the key holes' rows) and the sizes; built in place, never
// moved (md may point into keep)
struct Entry {
  Spans sp;
  std::vector<float> keep;
  Mods md;
  int64_t B, H, L, Dk, Hkv, S, Dv;
  at::Tensor q, k, v;  // views of the caller's q (B, H, L, Dk), k (B, Hkv, S, Dk), v (.., Dv)
  Entry(const void* qp, const void* kp, const void* vp, const int64_t* sizes, int32_t dtype,
        const int64_t* lo, const int64_t* hi, int64_t lo_rows, int64_t lo_cols, double softcap,
        const double* slopes, int64_t n_slopes, int64_t d0, const float* keys,
        int64_t keys_rows, int64_t keys_cols)
      : sp(check_inputs(sizes, dtype, lo, hi, lo_rows, lo_cols)),
        keep(),
        md(check_mods(sizes, softcap, slopes, n_slopes, d0, keys, keys_rows, keys_cols, keep)),
        B(sizes[0]), H(sizes[1]), L(sizes[2]), Dk(sizes[3]),
        Hkv(sizes[5]), S(sizes[6]), Dv(sizes[11]),
        q(at::view(const_cast<void*>(qp), {B, H, L, Dk})),
        k(at::view(const_cast<void*>(kp), {B, Hkv, S, Dk})),
        v(at::view(const_cast<void*>(vp), {B, Hkv, S, Dv})) {}
  Entry(const Entry&) = delete;
  Entry& operator=(const Entry&) = delete;
};

}  // namespace rowspan

// The C ABI (attnkit.backends.blocked.native calls it through ctypes): every tensor is a
// pointer to contiguous memory that the caller allocated (outputs included), its sizes in
// `sizes` (q, k, v: 12 int64); dtype: attnkit_abi::Code of q, k, v (and out, dout, dq);
// nthreads: torch.get_num_threads(). Each returns 0, or 1 with attnkit_last_error() saying why.
extern "C" {

const char* attnkit_last_error() { return attnkit_abi::last_error().c_str(); }

// bit 0: reads bfloat16; bit 1: reads float16 (built with F16C)
int32_t attnkit_low_dtypes() { return attnkit_abi::low_dtype_bits(); }

// 1 for the AVX512-BF16 build (-DRS_BF16DOT), 0 for the AVX2 one
int32_t attnkit_span_dot() { return rowspan::kDot ? 1 : 0; }

// 1 where the float32 code is the AVX-512 one (-DRS_AVX512, and the AVX512-BF16 build), 0 for
// the AVX2 build
int32_t attnkit_span_avx512() { return rowspan::kWide ? 1 : 0; }

// out (B, H, L, Dv) in q's dtype, lse (B, H, L) float32 of rows attending keys lo[i]..hi[i]
// (lo, hi: int64 (lo_rows = 1 or B, lo_cols = L)). Scores are modified before the softmax:
// softcap > 0 caps them (c tanh(s / c)), n_slopes = H slopes add ALiBi's -slope_h |i + d0 - j|
// (query row i, local key j), and keys_rows = 1 or B rows of keys_cols >= S + 8 floats add
// each key's 0 or -inf (holes in the runs; see Mods). Returns 0, 1 (an error: see
// attnkit_last_error) or 2: done, but a q, k or v element it read was NaN or inf.
int32_t attnkit_span_forward(const void* q, const void* k, const void* v, int32_t dtype,
                             const int64_t* sizes, const int64_t* lo, const int64_t* hi,
                             int64_t lo_rows, int64_t lo_cols, double scale, double softcap,
                             const double* slopes, int64_t n_slopes, int64_t d0,
                             const float* keys, int64_t keys_rows, int64_t keys_cols, void* out,
                             float* lse, int64_t nthreads) {
  bool finite = true;
  const int32_t rc = attnkit_abi::guarded([&] {
    const rowspan::Entry e(q, k, v, sizes, dtype, lo, hi, lo_rows, lo_cols, softcap, slopes,
                           n_slopes, d0, keys, keys_rows, keys_cols);
    const int64_t B = e.B, H = e.H, L = e.L, Dv = e.Dv;
    if (B * H * L <= 0) return;
    at::set_call_threads(nthreads);
    at::Tensor to = at::view(out, {B, H, L, Dv});
    at::Tensor tl = at::view(lse, {B, H, L});
    using rowspan::Dt;
    switch (dtype) {
      case attnkit_abi::BF16:
        rowspan::forward_impl<Dt::BF16>(e.q, e.k, e.v, e.sp, scale, e.md, to, tl, finite);
        break;
#ifdef __F16C__
      case attnkit_abi::F16:
        rowspan::forward_impl<Dt::F16>(e.q, e.k, e.v, e.sp, scale, e.md, to, tl, finite);
        break;
#endif
      default:
        rowspan::forward_impl<Dt::F32>(e.q, e.k, e.v, e.sp, scale, e.md, to, tl, finite);
        break;
    }
  });
  return rc != 0 ? rc : (finite ? 0 : 2);
}

// dq in q's dtype, and dk, dv (B, Hkv, S, Dk / Dv) summed over each kv head's query heads in
// float32 (zeroed by the caller), given the final out and lse (out, dout (B, H, L, Dv) in q's
// dtype, lse (B, H, L) float32); for bfloat16/float16 also converted once into dk_low, dv_low
// (null for float32). Arguments otherwise as attnkit_span_forward's.
int32_t attnkit_span_backward(const void* q, const void* k, const void* v, const void* out,
                              const void* dout, const float* lse, int32_t dtype,
                              const int64_t* sizes, const int64_t* lo, const int64_t* hi,
                              int64_t lo_rows, int64_t lo_cols, double scale, double softcap,
                              const double* slopes, int64_t n_slopes, int64_t d0,
                              const float* keys, int64_t keys_rows, int64_t keys_cols, void* dq,
                              float* dk, float* dv, void* dk_low, void* dv_low,
                              int64_t nthreads) {
  return attnkit_abi::guarded([&] {
    const rowspan::Entry e(q, k, v, sizes, dtype, lo, hi, lo_rows, lo_cols, softcap, slopes,
                           n_slopes, d0, keys, keys_rows, keys_cols);
    const int64_t B = e.B, H = e.H, L = e.L, Dk = e.Dk, Hkv = e.Hkv, S = e.S, Dv = e.Dv;
    const size_t esize = dtype == attnkit_abi::F32 ? 4 : 2;
    if (!(B * H * L > 0 && S > 0)) {  // nothing to sum: dq 0, dk and dv stay 0
      if (B * H * L > 0) std::memset(dq, 0, static_cast<size_t>(B * H * L * Dk) * esize);
      if (dtype != attnkit_abi::F32) {
        std::memset(dk_low, 0, static_cast<size_t>(B * Hkv * S * Dk) * esize);
        std::memset(dv_low, 0, static_cast<size_t>(B * Hkv * S * Dv) * esize);
      }
      return;
    }
    at::set_call_threads(nthreads);
    const at::Tensor to = at::view(const_cast<void*>(out), {B, H, L, Dv});
    const at::Tensor tg = at::view(const_cast<void*>(dout), {B, H, L, Dv});
    const at::Tensor tl = at::view(const_cast<float*>(lse), {B, H, L});
    at::Tensor tdq = at::view(dq, {B, H, L, Dk});
    at::Tensor tdk = at::view(dk, {B, Hkv, S, Dk});
    at::Tensor tdv = at::view(dv, {B, Hkv, S, Dv});
    at::Tensor tkl = at::view(dk_low, {B, Hkv, S, Dk});
    at::Tensor tvl = at::view(dv_low, {B, Hkv, S, Dv});
    using rowspan::Dt;
    if (dtype == attnkit_abi::BF16)
      rowspan::backward_impl<Dt::BF16>(e.q, e.k, e.v, to, tg, tl, e.sp, scale, e.md, tdq, tdk,
                                       tdv, tkl, tvl);
#ifdef __F16C__
    else if (dtype == attnkit_abi::F16)
      rowspan::backward_impl<Dt::F16>(e.q, e.k, e.v, to, tg, tl, e.sp, scale, e.md, tdq, tdk,
                                      tdv, tkl, tvl);
#endif
    else
      rowspan::backward_impl<Dt::F32>(e.q, e.k, e.v, to, tg, tl, e.sp, scale, e.md, tdq, tdk,
                                      tdv, tkl, tvl);
  });
}

}  // extern "C"
