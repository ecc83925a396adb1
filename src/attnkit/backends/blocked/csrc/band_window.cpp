// Exact causal sliding-window attention, forward and backward, fp32, CPU (AVX2 + FMA).
// query i attends keys j with i - window < j <= i  (L == S).
//
// Structure (per (b,h), per chunk of C <= 2048 query rows = one work item of
// at::parallel_for):
//   * K^T is packed incrementally (8x8 AVX transposes) into panels of 16 keys
//     ([D][16]) aligned to absolute key index; each key is packed once per
//     work item and reused by every query block whose window covers it.
//   * Query block of MB=48 rows (8 micro-tiles of 6 rows), pre-scaled by
//     scale*log2(e) so the softmax uses exp2.
//   * Keys processed in chunks of KC (a single chunk when window+MB <= ~500);
//     online softmax (running max / sum, rescale of O) across chunks.
//   * S = Q K^T via a 6x16 register-blocked FMA micro-kernel (12 ymm
//     accumulators); only tiles that intersect the band are computed, and a
//     6x8 kernel is used for edge tiles where only half of the 16 keys are in
//     the band of the 6 rows.
//   * Exact per-row softmax over the allowed keys (vectorized degree-5 exp2
//     polynomial), P written in place over S, zeros at the ragged edges.
//   * O += P V via a 6x16 micro-kernel over exactly the key range of each
//     6-row tile (V used in place, row-major, no packing).
//   * Next block's q/k/v rows are software-prefetched during the PV phase;
//     the normalized output is written with streaming stores.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <tuple>

namespace band {

constexpr int MR = 6;    // rows of a micro tile
constexpr int NR = 16;   // keys per packed K^T panel; output cols per PV tile
constexpr int MB = 48;   // query rows per block (multiple of MR)

static const int32_t kMaskTbl[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                     0,  0,  0,  0,  0,  0,  0,  0};

static inline __m256 tail_mask(int rem) {  // first rem lanes set, 0<=rem<=8
  return _mm256_castsi256_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMaskTbl + 8 - rem)));
}

// 2^x for x <= 0 (clamped at -125), rel. error ~2.4e-7: degree-5 minimax
// polynomial on [-0.5, 0.5]; 2^n applied by an integer add to the exponent.
static inline __m256 exp2_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-125.0f));
  __m256i ni = _mm256_cvtps_epi32(x);  // round to nearest
  __m256 f = _mm256_sub_ps(x, _mm256_cvtepi32_ps(ni));
  __m256 p = _mm256_set1_ps(0.0013276472454890609f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.009675541892647743f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.05550713092088699f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.24022120237350464f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.6931469440460205f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0000001192092896f));
  return _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(ni, 23)));
}

static inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
static inline float hsum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
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

// o[6 x D] (row stride D) += A[6 x n] x[n x D] (row stride D), all column tiles.
template <bool TRANS>
static inline void ax_6xD(const float* p, int64_t ps, const float* x, int64_t D,
                          int64_t n, float* o) {
  int64_t c = 0;
  for (; c + NR <= D; c += NR) ax_6x16<TRANS>(p, ps, x + c, D, n, o + c, D);
  if (c + 8 <= D) { ax_6x8<TRANS>(p, ps, x + c, D, n, o + c, D); c += 8; }
  if (c < D) ax_6xr<TRANS>(p, ps, x + c, D, n, o + c, D, D - c);
}

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

static inline void transpose8_store(const float* const* rows, int64_t d, float* dst) {
  // rows[0..7] point to 8 key rows; stores dst[x*NR + y] = rows[y][d + x], x,y < 8
  __m256 r0 = _mm256_loadu_ps(rows[0] + d), r1 = _mm256_loadu_ps(rows[1] + d);
  __m256 r2 = _mm256_loadu_ps(rows[2] + d), r3 = _mm256_loadu_ps(rows[3] + d);
  __m256 r4 = _mm256_loadu_ps(rows[4] + d), r5 = _mm256_loadu_ps(rows[5] + d);
  __m256 r6 = _mm256_loadu_ps(rows[6] + d), r7 = _mm256_loadu_ps(rows[7] + d);
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

// panel[d*NR + jj] = k[key0 + jj][d] (zero for keys >= L), jj < NR
static inline void pack_panel(const float* kp, int64_t key0, int64_t L, int64_t D,
                              const float* zrow, float* panel) {
  const float* rows[NR];
  for (int jj = 0; jj < NR; ++jj)
    rows[jj] = (key0 + jj < L) ? kp + (key0 + jj) * D : zrow;
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    transpose8_store(rows, d, panel + d * NR);
    transpose8_store(rows + 8, d, panel + d * NR + 8);
  }
  for (; d < D; ++d)
    for (int jj = 0; jj < NR; ++jj) panel[d * NR + jj] = rows[jj][d];
}

// Software prefetch of the next query block's q, k, v rows (each a contiguous
// span), spread over the current block's PV calls so DRAM latency overlaps
// with compute.
struct Prefetcher {
  const char* base[3];
  int64_t nlines = 0, pos = 0;
  void reset(const float* q, const float* k, const float* v, int64_t bytes) {
    base[0] = reinterpret_cast<const char*>(q);
    base[1] = reinterpret_cast<const char*>(k);
    base[2] = reinterpret_cast<const char*>(v);
    nlines = bytes > 0 ? (bytes + 63) / 64 : 0;
    pos = 0;
  }
  inline void step(int64_t n) {
    const int64_t total = 3 * nlines;
    for (int64_t e = std::min(pos + n, total); pos < e; ++pos) {
      const int64_t which = pos / nlines, line = pos - which * nlines;
      _mm_prefetch(base[which] + line * 64, _MM_HINT_T0);
    }
  }
};

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

static void band_forward_impl(at::Tensor q, at::Tensor k, at::Tensor v,
                              int64_t window, double scale, at::Tensor out,
                              at::Tensor lse) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "expect (B,H,L,D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat, "expect float32");
  TORCH_CHECK(q.sizes() == k.sizes() && q.sizes() == v.sizes(),
              "q, k, v must have the same shape (L == S)");
  TORCH_CHECK(window >= 1, "window must be >= 1");
  q = q.contiguous(); k = k.contiguous(); v = v.contiguous();
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.sizes() == q.sizes(),
              "out must be a contiguous float32 tensor shaped like q");
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat && lse.dim() == 3 &&
                  lse.size(0) == B && lse.size(1) == H && lse.size(2) == L,
              "lse must be a contiguous float32 tensor of shape (B, H, L)");
  if (B * H * L == 0 || D == 0) {
    out.zero_(); lse.fill_(-std::numeric_limits<float>::infinity());
    return;
  }
  const int64_t W = std::min<int64_t>(window, L);
  const float sc = static_cast<float>(scale * 1.4426950408889634);
  const float ln2 = 0.6931471805599453f;

  // key chunk (multiple of NR); one chunk per query block when window is small
  const int64_t KC = std::min<int64_t>(512, ((W + MB + NR + NR - 1) / NR) * NR);
  const int64_t SS = KC + NR;  // S row stride (room for tail over-writes)

  // query rows per work item
  const int64_t BH = B * H;
  const int64_t nth = std::max<int64_t>(1, at::get_num_threads());
  int64_t target_chunks = std::max<int64_t>(1, (4 * nth + BH - 1) / BH);
  int64_t C = (L + target_chunks - 1) / target_chunks;
  C = std::min<int64_t>(C, 2048);
  C = std::max<int64_t>(MB, ((C + MB - 1) / MB) * MB);
  const int64_t nch = (L + C - 1) / C;
  const int64_t nitems = BH * nch;

  const float* qd = q.data_ptr<float>();
  const float* kd = k.data_ptr<float>();
  const float* vd = v.data_ptr<float>();
  float* od = out.data_ptr<float>();
  float* ld = lse.data_ptr<float>();

  const int64_t kt_keys = std::min<int64_t>(C + W + 2 * NR, L + 2 * NR);

  at::parallel_for(0, nitems, 1, [&](int64_t beg, int64_t end) {
    AlignedBuf kt(static_cast<size_t>(kt_keys * D));
    AlignedBuf qs(static_cast<size_t>(MB * D));
    AlignedBuf sb(static_cast<size_t>(MB * SS + NR));
    AlignedBuf ob(static_cast<size_t>(MB * D));
    AlignedBuf zrow(static_cast<size_t>(D));
    float mrow[MB], lrow[MB];
    int64_t tA[MB / MR], tB[MB / MR];
    const float NINF = -std::numeric_limits<float>::infinity();
    Prefetcher pf;
    const int64_t pf_per_call =
        std::max<int64_t>(1, (3 * ((MB * D * 4 + 63) / 64)) / ((MB / MR) * (D / NR > 0 ? D / NR : 1)) + 1);

    for (int64_t item = beg; item < end; ++item) {
      const int64_t bh = item / nch, ci = item % nch;
      const float* qp = qd + bh * L * D;
      const float* kp = kd + bh * L * D;
      const float* vp = vd + bh * L * D;
      float* op = od + bh * L * D;
      float* lp = ld + bh * L;
      const int64_t c0 = ci * C, c1 = std::min(L, c0 + C);
      const int64_t kbase = (std::max<int64_t>(0, c0 - W + 1) / NR) * NR;
      int64_t packed_end = kbase;

      for (int64_t i0 = c0; i0 < c1; i0 += MB) {
        const int64_t mr = std::min<int64_t>(MB, c1 - i0);
        const int64_t hi = i0 + mr - 1;
        const int64_t lo = std::max<int64_t>(0, i0 - W + 1);
        // pack K^T panels up to hi
        const int64_t need = ((hi + 1 + NR - 1) / NR) * NR;
        while (packed_end < need) {
          pack_panel(kp, packed_end, L, D, zrow.p, kt.p + (packed_end - kbase) * D);
          packed_end += NR;
        }
        // scaled Q block (zero padded)
        for (int64_t r = 0; r < MB; ++r) {
          float* dst = qs.p + r * D;
          if (r < mr) {
            const float* src = qp + (i0 + r) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * sc;
          } else {
            for (int64_t d = 0; d < D; ++d) dst[d] = 0.0f;
          }
        }
        std::fill(ob.p, ob.p + MB * D, 0.0f);
        {  // prefetch rows [i0+MB, i0+2MB) of q, k, v during this block
          const int64_t n0 = std::min<int64_t>(c1, i0 + MB);
          const int64_t n1 = std::min<int64_t>(c1, i0 + 2 * MB);
          pf.reset(qp + n0 * D, kp + n0 * D, vp + n0 * D, (n1 - n0) * D * 4);
        }
        for (int r = 0; r < MB; ++r) { mrow[r] = NINF; lrow[r] = 0.0f; }
        const int64_t ntile = (mr + MR - 1) / MR;

        for (int64_t kc0 = (lo / NR) * NR; kc0 <= hi; kc0 += KC) {
          const int64_t kc1 = std::min<int64_t>(kc0 + KC, hi + 1);  // exclusive
          // ---- S = Q K^T on band tiles
          for (int64_t j0 = kc0; j0 < kc1; j0 += NR) {
            const float* panel = kt.p + (j0 - kbase) * D;
            for (int64_t t = 0; t < ntile; ++t) {
              const int64_t r0 = i0 + t * MR;
              const int64_t rlo = std::max<int64_t>(0, r0 - W + 1);
              const int64_t rhi = std::min<int64_t>(r0 + MR - 1, hi);
              if (j0 + NR - 1 < rlo || j0 > rhi) continue;
              float* sdst = sb.p + t * MR * SS + (j0 - kc0);
              if (rlo >= j0 + 8)        // only the upper 8 keys are in the band
                qk_6x8(qs.p + t * MR * D, D, panel + 8, sdst + 8, SS);
              else if (rhi < j0 + 8)    // only the lower 8 keys
                qk_6x8(qs.p + t * MR * D, D, panel, sdst, SS);
              else
                qk_6x16(qs.p + t * MR * D, D, panel, sdst, SS);
            }
          }
          // ---- softmax (exact per row, online across chunks)
          for (int64_t t = 0; t < ntile; ++t) {
            const int64_t r0 = i0 + t * MR;
            const int64_t A = std::max<int64_t>(std::max<int64_t>(0, r0 - W + 1), kc0);
            const int64_t Bt = std::min<int64_t>(std::min<int64_t>(r0 + MR - 1, hi), kc1 - 1);
            tA[t] = A; tB[t] = Bt;
            if (A > Bt) continue;
            for (int rr = 0; rr < MR; ++rr) {
              const int64_t ri = t * MR + rr;
              const int64_t i = i0 + ri;
              float* srow = sb.p + ri * SS;
              const int64_t a = std::max<int64_t>(std::max<int64_t>(0, i - W + 1), kc0);
              const int64_t b = std::min<int64_t>(i, kc1 - 1);
              if (ri >= mr || a > b) {
                zero_range(srow, A - kc0, Bt - kc0);
                continue;
              }
              const float cm = row_max(srow, a - kc0, b - kc0);
              const float mo = mrow[ri];
              const float mn = std::max(mo, cm);
              float alpha = 1.0f;
              if (mo != mn) {
                alpha = (mo == NINF) ? 0.0f : std::exp2(mo - mn);
                float* orow = ob.p + ri * D;
                for (int64_t d = 0; d < D; ++d) orow[d] *= alpha;
              }
              const float sum = row_exp(srow, a - kc0, b - kc0, mn);
              lrow[ri] = lrow[ri] * alpha + sum;
              mrow[ri] = mn;
              zero_range(srow, A - kc0, a - kc0 - 1);
              zero_range(srow, b - kc0 + 1, Bt - kc0);
            }
          }
          // ---- O += P V
          int64_t c = 0;
          for (; c + NR <= D; c += NR)
            for (int64_t t = 0; t < ntile; ++t) {
              pf.step(pf_per_call);
              if (tA[t] > tB[t]) continue;
              ax_6x16<false>(sb.p + t * MR * SS + (tA[t] - kc0), SS, vp + tA[t] * D + c, D,
                      tB[t] - tA[t] + 1, ob.p + t * MR * D + c, D);
            }
          if (c + 8 <= D) {
            for (int64_t t = 0; t < ntile; ++t) {
              if (tA[t] > tB[t]) continue;
              ax_6x8<false>(sb.p + t * MR * SS + (tA[t] - kc0), SS, vp + tA[t] * D + c, D,
                     tB[t] - tA[t] + 1, ob.p + t * MR * D + c, D);
            }
            c += 8;
          }
          if (c < D) {
            for (int64_t t = 0; t < ntile; ++t) {
              if (tA[t] > tB[t]) continue;
              ax_6xr<false>(sb.p + t * MR * SS + (tA[t] - kc0), SS, vp + tA[t] * D + c, D,
                     tB[t] - tA[t] + 1, ob.p + t * MR * D + c, D, D - c);
            }
          }
        }
        // ---- normalize + write out
        for (int64_t r = 0; r < mr; ++r) {
          const float inv = 1.0f / lrow[r];
          const float* src = ob.p + r * D;
          float* dst = op + (i0 + r) * D;
          int64_t d = 0;
          if ((reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
            const __m256 vinv = _mm256_set1_ps(inv);
            for (; d + 8 <= D; d += 8)
              _mm256_stream_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), vinv));
          }
          for (; d < D; ++d) dst[d] = src[d] * inv;
          lp[i0 + r] = mrow[r] * ln2 + logf(lrow[r]);
        }
      }
    }
    _mm_sfence();
  });
}


// ---------------------------------------------------------------------------
// Backward.
constexpr int MBB = 48;  // query rows per backward block (multiple of MR)
static void band_backward_impl(at::Tensor q, at::Tensor k, at::Tensor v,
                               at::Tensor out, at::Tensor dout, at::Tensor lse,
                               int64_t window, double scale, at::Tensor dq,
                               at::Tensor dk, at::Tensor dv) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3);
  const int64_t W = std::min<int64_t>(window, L);
  const float sc = static_cast<float>(scale * 1.4426950408889634);
  const float log2e = 1.4426950408889634f;
  const float fscale = static_cast<float>(scale);

  const int64_t KC = std::min<int64_t>(512, ((W + MBB + NR + NR - 1) / NR) * NR);
  const int64_t SS = KC + 2 * NR;  // row stride of the S / dP buffers

  // Work items: (b,h) x chunks of C query rows. C >= W, so the keys an item
  // touches below its chunk ("halo", at most W-1 of them) all lie in the
  // previous chunk; the halo's dK/dV go to a per-item buffer that a second
  // pass adds to the previous chunk's rows (no races, deterministic).
  const int64_t BH = B * H;
  const int64_t nth = std::max<int64_t>(1, at::get_num_threads());
  int64_t target_chunks = std::max<int64_t>(1, (4 * nth + BH - 1) / BH);
  int64_t C = (L + target_chunks - 1) / target_chunks;
  C = std::min<int64_t>(C, 2048);
  C = std::max<int64_t>(C, W);
  C = std::max<int64_t>(MBB, ((C + MBB - 1) / MBB) * MBB);
  const int64_t nch = (L + C - 1) / C;
  const int64_t nitems = BH * nch;
  const int64_t WH = std::max<int64_t>(1, W - 1);  // halo rows per item

  at::Tensor halo;
  float* hd = nullptr;
  if (nch > 1) {
    halo = at::empty({nitems, 2, WH, D}, q.options());
    hd = halo.data_ptr<float>();
  }

  const float* qd = q.data_ptr<float>();
  const float* kd = k.data_ptr<float>();
  const float* vd = v.data_ptr<float>();
  const float* od = out.data_ptr<float>();
  const float* gd = dout.data_ptr<float>();
  const float* ld = lse.data_ptr<float>();
  float* dqd = dq.data_ptr<float>();
  float* dkd = dk.data_ptr<float>();
  float* dvd = dv.data_ptr<float>();

  const int64_t kt_keys = std::min<int64_t>(C + W + 2 * NR, L + 2 * NR);
  const int64_t acc_keys = C + W + 2 * NR + 8;

  at::parallel_for(0, nitems, 1, [&](int64_t beg, int64_t end) {
    AlignedBuf kt(static_cast<size_t>(kt_keys * D));
    AlignedBuf vt(static_cast<size_t>(kt_keys * D));
    AlignedBuf qs(static_cast<size_t>(MBB * D));   // q * scale*log2(e)
    AlignedBuf qr(static_cast<size_t>(MBB * D));   // q
    AlignedBuf gb(static_cast<size_t>(MBB * D));   // dout
    AlignedBuf sb(static_cast<size_t>(MBB * SS + NR));  // S, then P
    AlignedBuf db(static_cast<size_t>(MBB * SS + NR));  // dP, then dS*scale
    AlignedBuf ob(static_cast<size_t>(MBB * D));   // dQ block
    AlignedBuf dka(static_cast<size_t>(acc_keys * D));
    AlignedBuf dva(static_cast<size_t>(acc_keys * D));
    AlignedBuf zrow(static_cast<size_t>(D));
    float mrow[MBB], drow[MBB];
    int64_t tA[MBB / MR], tB[MBB / MR];

    for (int64_t item = beg; item < end; ++item) {
      const int64_t bh = item / nch, ci = item % nch;
      const int64_t off = bh * L * D;
      const float* qp = qd + off;
      const float* kp = kd + off;
      const float* vp = vd + off;
      const float* op = od + off;
      const float* gp = gd + off;
      const float* lp = ld + bh * L;
      const int64_t c0 = ci * C, c1 = std::min(L, c0 + C);
      const int64_t kbase = (std::max<int64_t>(0, c0 - W + 1) / NR) * NR;
      int64_t packed_end = kbase;
      std::fill(dka.p, dka.p + (c1 + 8 + NR - kbase) * D, 0.0f);
      std::fill(dva.p, dva.p + (c1 + 8 + NR - kbase) * D, 0.0f);

      for (int64_t i0 = c0; i0 < c1; i0 += MBB) {
        const int64_t mr = std::min<int64_t>(MBB, c1 - i0);
        const int64_t hi = i0 + mr - 1;
        const int64_t lo = std::max<int64_t>(0, i0 - W + 1);
        const int64_t need = ((hi + 1 + NR - 1) / NR) * NR;
        while (packed_end < need) {
          pack_panel(kp, packed_end, L, D, zrow.p, kt.p + (packed_end - kbase) * D);
          pack_panel(vp, packed_end, L, D, zrow.p, vt.p + (packed_end - kbase) * D);
          packed_end += NR;
        }
        for (int64_t r = 0; r < MBB; ++r) {
          float* d1 = qs.p + r * D; float* d2 = qr.p + r * D; float* d3 = gb.p + r * D;
          if (r < mr) {
            const float* s1 = qp + (i0 + r) * D;
            const float* s3 = gp + (i0 + r) * D;
            const float* s4 = op + (i0 + r) * D;
            const __m256 vsc = _mm256_set1_ps(sc);
            __m256 acc = _mm256_setzero_ps();
            int64_t d = 0;
            for (; d + 8 <= D; d += 8) {
              const __m256 x = _mm256_loadu_ps(s1 + d);
              const __m256 g = _mm256_loadu_ps(s3 + d);
              _mm256_storeu_ps(d1 + d, _mm256_mul_ps(x, vsc));
              _mm256_storeu_ps(d2 + d, x);
              _mm256_storeu_ps(d3 + d, g);
              acc = _mm256_fmadd_ps(g, _mm256_loadu_ps(s4 + d), acc);
            }
            float dsum = hsum(acc);
            for (; d < D; ++d) {
              d1[d] = s1[d] * sc; d2[d] = s1[d]; d3[d] = s3[d];
              dsum += s3[d] * s4[d];
            }
            drow[r] = dsum;
            mrow[r] = lp[i0 + r] * log2e;
          } else {
            for (int64_t d = 0; d < D; ++d) { d1[d] = 0.0f; d2[d] = 0.0f; d3[d] = 0.0f; }
            drow[r] = 0.0f; mrow[r] = 0.0f;
          }
        }
        std::fill(ob.p, ob.p + MBB * D, 0.0f);
        const int64_t ntile = (mr + MR - 1) / MR;

        for (int64_t kc0 = (lo / NR) * NR; kc0 <= hi; kc0 += KC) {
          const int64_t kc1 = std::min<int64_t>(kc0 + KC, hi + 1);  // exclusive
          // ---- S = Qs K^T, dP = dO V^T on band tiles
          for (int64_t j0 = kc0; j0 < kc1; j0 += NR) {
            const float* kpan = kt.p + (j0 - kbase) * D;
            const float* vpan = vt.p + (j0 - kbase) * D;
            for (int64_t t = 0; t < ntile; ++t) {
              const int64_t r0 = i0 + t * MR;
              const int64_t rlo = std::max<int64_t>(0, r0 - W + 1);
              const int64_t rhi = std::min<int64_t>(r0 + MR - 1, hi);
              if (j0 + NR - 1 < rlo || j0 > rhi) continue;
              float* sdst = sb.p + t * MR * SS + (j0 - kc0);
              float* ddst = db.p + t * MR * SS + (j0 - kc0);
              const float* qt = qs.p + t * MR * D;
              const float* gt = gb.p + t * MR * D;
              if (rlo >= j0 + 8) {
                qk_6x8(qt, D, kpan + 8, sdst + 8, SS);
                qk_6x8(gt, D, vpan + 8, ddst + 8, SS);
              } else if (rhi < j0 + 8) {
                qk_6x8(qt, D, kpan, sdst, SS);
                qk_6x8(gt, D, vpan, ddst, SS);
              } else {
                qk_6x16(qt, D, kpan, sdst, SS);
                qk_6x16(gt, D, vpan, ddst, SS);
              }
            }
          }
          // ---- P = exp2(S - lse*log2e), dS = scale * P * (dP - Di); zeros
          // everywhere else in the row (the P^T products read whole columns)
          for (int64_t t = 0; t < MBB / MR; ++t) {
            const int64_t r0 = i0 + t * MR;
            tA[t] = std::max<int64_t>(std::max<int64_t>(0, r0 - W + 1), kc0);
            tB[t] = std::min<int64_t>(std::min<int64_t>(r0 + MR - 1, hi), kc1 - 1);
          }
          for (int64_t ri = 0; ri < MBB; ++ri) {
            float* srow = sb.p + ri * SS;
            float* drw = db.p + ri * SS;
            const int64_t i = i0 + ri;
            const int64_t a = std::max<int64_t>(std::max<int64_t>(0, i - W + 1), kc0);
            const int64_t b = std::min<int64_t>(i, kc1 - 1);
            if (ri >= mr || a > b) {
              std::fill(srow, srow + SS, 0.0f);
              std::fill(drw, drw + SS, 0.0f);
              continue;
            }
            const int64_t ja = a - kc0, jb = b - kc0;  // inclusive columns
            std::fill(srow, srow + ja, 0.0f);
            std::fill(drw, drw + ja, 0.0f);
            const __m256 vm = _mm256_set1_ps(mrow[ri]);
            const __m256 vD = _mm256_set1_ps(drow[ri]);
            const __m256 vs = _mm256_set1_ps(fscale);
            int64_t j = ja;
            for (; j + 8 <= jb + 1; j += 8) {
              __m256 p = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(srow + j), vm));
              __m256 ds = _mm256_mul_ps(_mm256_mul_ps(p, vs),
                                        _mm256_sub_ps(_mm256_loadu_ps(drw + j), vD));
              _mm256_storeu_ps(srow + j, p);
              _mm256_storeu_ps(drw + j, ds);
            }
            const int64_t rem = jb + 1 - j;
            if (rem > 0) {
              const __m256 msk = tail_mask((int)rem);
              __m256 p = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(srow + j), vm));
              p = _mm256_and_ps(p, msk);
              __m256 ds = _mm256_mul_ps(_mm256_mul_ps(p, vs),
                                        _mm256_sub_ps(_mm256_loadu_ps(drw + j), vD));
              ds = _mm256_and_ps(ds, msk);
              _mm256_storeu_ps(srow + j, p);
              _mm256_storeu_ps(drw + j, ds);
              j += 8;
            }
            if (j < SS) {
              std::fill(srow + j, srow + SS, 0.0f);
              std::fill(drw + j, drw + SS, 0.0f);
            }
          }
          // ---- dQ += dS K  (K rows in place)
          for (int64_t t = 0; t < ntile; ++t) {
            if (tA[t] > tB[t]) continue;
            ax_6xD<false>(db.p + t * MR * SS + (tA[t] - kc0), SS, kp + tA[t] * D, D,
                   tB[t] - tA[t] + 1, ob.p + t * MR * D);
          }
          // ---- dV += P^T dO, dK += dS^T Q over 6-key tiles
          const int64_t ka = std::max<int64_t>(lo, kc0), kb = std::min<int64_t>(hi, kc1 - 1);
          for (int64_t j = ka; j <= kb; j += MR) {
            const int64_t ra = std::max<int64_t>(i0, j) - i0;
            const int64_t rb = std::min<int64_t>(hi, j + MR - 1 + W - 1) - i0;
            if (ra > rb) continue;
            const int64_t col = j - kc0;
            ax_6xD<true>(sb.p + ra * SS + col, SS, gb.p + ra * D, D, rb - ra + 1,
                    dva.p + (j - kbase) * D);
            ax_6xD<true>(db.p + ra * SS + col, SS, qr.p + ra * D, D, rb - ra + 1,
                    dka.p + (j - kbase) * D);
          }
        }
        std::copy(ob.p, ob.p + mr * D, dqd + off + i0 * D);
      }
      // ---- owned keys [c0, c1) -> dk, dv; halo keys [hs, c0) -> halo buffer
      std::copy(dka.p + (c0 - kbase) * D, dka.p + (c1 - kbase) * D, dkd + off + c0 * D);
      std::copy(dva.p + (c0 - kbase) * D, dva.p + (c1 - kbase) * D, dvd + off + c0 * D);
      if (ci > 0) {
        const int64_t hs = std::max<int64_t>(0, c0 - W + 1);
        float* hk = hd + item * 2 * WH * D;
        float* hv = hk + WH * D;
        std::copy(dka.p + (hs - kbase) * D, dka.p + (c0 - kbase) * D, hk);
        std::copy(dva.p + (hs - kbase) * D, dva.p + (c0 - kbase) * D, hv);
      }
    }
  });

  if (nch > 1) {  // add each item's halo into the previous chunk's rows
    at::parallel_for(0, nitems, 1, [&](int64_t beg, int64_t end) {
      for (int64_t item = beg; item < end; ++item) {
        const int64_t bh = item / nch, ci = item % nch;
        if (ci + 1 >= nch) continue;
        const int64_t cn = (ci + 1) * C;
        const int64_t hs = std::max<int64_t>(0, cn - W + 1);
        const int64_t n = (cn - hs) * D;
        const float* hk = hd + (item + 1) * 2 * WH * D;
        const float* hv = hk + WH * D;
        float* dkp = dkd + bh * L * D + hs * D;
        float* dvp = dvd + bh * L * D + hs * D;
        for (int64_t e = 0; e < n; ++e) { dkp[e] += hk[e]; dvp[e] += hv[e]; }
      }
    });
  }
}

}  // namespace band

// (out, lse) freshly allocated.
std::tuple<at::Tensor, at::Tensor> band_forward(at::Tensor q, at::Tensor k,
                                                at::Tensor v, int64_t window,
                                                double scale) {
  TORCH_CHECK(q.dim() == 4, "expect (B,H,L,D)");
  auto out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  band::band_forward_impl(q, k, v, window, scale, out, lse);
  return {out, lse};
}

// (dq, dk, dv) of causal sliding-window attention given the final out, lse.
std::tuple<at::Tensor, at::Tensor, at::Tensor> band_backward(
    at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor out, at::Tensor dout,
    at::Tensor lse, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "expect (B,H,L,D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  dout.scalar_type() == at::kFloat && lse.scalar_type() == at::kFloat,
              "expect float32");
  TORCH_CHECK(q.sizes() == k.sizes() && q.sizes() == v.sizes() &&
                  q.sizes() == out.sizes() && q.sizes() == dout.sizes(),
              "q, k, v, out, dout must have the same shape (L == S)");
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) &&
                  lse.size(2) == q.size(2), "lse must be (B, H, L)");
  TORCH_CHECK(window >= 1, "window must be >= 1");
  q = q.contiguous(); k = k.contiguous(); v = v.contiguous();
  out = out.contiguous(); dout = dout.contiguous(); lse = lse.contiguous();
  auto dq = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  auto dk = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  auto dv = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  if (q.numel() == 0) return {dq, dk, dv};
  band::band_backward_impl(q, k, v, out, dout, lse, window, scale, dq, dk, dv);
  return {dq, dk, dv};
}
