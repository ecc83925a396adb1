// attnkit's grouped-query decode kernel: a few query rows (L <= 16) against a long key/value
// cache, CPU (AVX2 + FMA; F16C for float16). Query row i of batch row b attends the keys
// lo[b, i]..hi[b, i] (inclusive; the Python side, attnkit.backends.blocked.decode, makes them
// from a mask spec with attnkit.masks.row_spans: none, end-aligned causal, sliding windows,
// per-sequence cache lengths and left/right padding).
//
// Memory is the bound: a decode step reads every key and value it may see once, so the kernel
// is built to read each of them once and nothing else.
//   * Grouped-query heads: the g = H / Hkv query heads of one key/value head and all L query
//     rows (R = g * L rows) run against the same K and V rows, read once for all of them; K and
//     V are never repeated or copied, and may be strided views (a KVCache buffer
//     (B, Hkv, N, D)[:, :, :S]): only the last dimension must be contiguous.
//   * Only the union of the rows' runs of keys is read (a window reads the window; a short
//     sequence of a ragged batch reads its own keys).
//   * Split-K: the keys of each (b, kv head) are cut into chunks of C keys; threads pull
//     (b, kv head, chunk) items from a shared counter; each item leaves a partial (max, sum,
//     acc) per row; the thread that finishes the last item of a (b, kv head) merges its rows by
//     the log-sum-exp rule (no second parallel pass). A call with little to read (under
//     DECODE_SERIAL_BYTES of K/V) runs on the calling thread: no thread start.
//   * In an item, block by block of NB keys (DECODE_BLOCK_BYTES of K, 64 KiB; at most 128 keys;
//     the block's K and V stay in L2 between the passes): scores S = q K^T
//     of every row over the block (q pre-scaled by scale * log2(e), so the softmax uses exp2;
//     4 rows x 2 keys per micro-kernel, each K vector loaded once for the four rows), each
//     row's online softmax step over its own keys of the block (vectorised degree-5 exp2
//     polynomial; the row's max, sum and output rescaled when its max grows), then acc += P V
//     with keys innermost per tile of the output (a value a row may not see is never
//     multiplied into it). So K and V each stream from memory once, in step, the block's K and
//     V hot between the passes. The streaming order (streams(): at most four rows per key/value
//     head, contiguous K/V rows, as a KVCache buffer's): the score pass of a block prefetches
//     the block's V rows and its P V pass the next block's K rows (after the item's last block,
//     the first K rows of the thread's next item), so that reads are in flight while either
//     pass computes; blocks of DECODE_STREAM_BLOCK_KEYS keys where the call reads from memory.
//     Otherwise K rows DECODE_PF_BYTES (8 KiB) ahead are prefetched by the score pass, V rows
//     by the pass that reads them first.
//   * bfloat16 and float16 K/V/q are converted as they are loaded (bf16: 16-bit shift; fp16:
//     vcvtph2ps); everything inside is float32; out comes back in q's dtype, lse in float32.
//   * NaN/inf: the kernel reports whether any q it read, any score of a key a row may see, or
//     any output is not finite (the caller then runs attnkit's exact non-finite rule); a
//     finite call pays no separate pass over q, k, v.
// at::Tensor, at::parallel_for, at::get_num_threads: abi.h (the C ABI's views, no libtorch)
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace decode {

// element types, their loads and stores, exp2_ps, hsum, hmax: elements.h
using namespace attnkit_elements;

// the micro-kernels are inlined into their loops (GCC otherwise keeps some out of line)
#define DECODE_INLINE inline __attribute__((always_inline))

// the tuning knobs (bytes but one; -D at build time to measure others): the K bytes of one
// block (its K and V rows stay in L2 between the score and the value pass), the keys of one
// block of a call in the streaming order (streams()) that reads more than
// DECODE_INPLACE_BYTES, the streaming order itself (0: off, for measuring), how far ahead K and
// V rows are prefetched outside it (0: no software prefetch), the K/V bytes under which a call
// runs on the calling thread, and those up to which P V reads float32 V rows in place
// (pv_in_place) outside the streaming order
#ifndef DECODE_BLOCK_BYTES
#define DECODE_BLOCK_BYTES 65536
#endif
#ifndef DECODE_STREAM_BLOCK_KEYS
#define DECODE_STREAM_BLOCK_KEYS 32
#endif
#ifndef DECODE_STREAM
#define DECODE_STREAM 1
#endif
#ifndef DECODE_INPLACE_BYTES
#define DECODE_INPLACE_BYTES (4 << 20)
#endif
#ifndef DECODE_PF_BYTES
#define DECODE_PF_BYTES 8192
#endif
#ifndef DECODE_SERIAL_BYTES
#define DECODE_SERIAL_BYTES 65536
#endif
#ifndef DECODE_PF_HINT
#define DECODE_PF_HINT _MM_HINT_T0
#endif

// prefetch the `bytes` of each of `count` rows at p (rows `stride` elements apart)
template <typename T>
static inline void prefetch_rows(const T* p, int64_t stride, int count, int64_t bytes) {
  for (int c = 0; c < count; ++c)
    for (int64_t b = 0; b < bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + c * stride) + b, DECODE_PF_HINT);
}

// contiguous bytes that a pass over other rows prefetches, `per` cache lines with each key, in
// address order (the streaming order, run_item): `lines` cache lines from p
struct PfRange {
  const char* p = nullptr;
  int64_t lines = 0, per = 0;
};

// the first `rows` rows at k (contiguous, `D` elements each) as a PfRange
template <typename T>
static inline PfRange rows_range(const T* k, int64_t rows, int64_t D) {
  const int64_t bytes = rows * D * static_cast<int64_t>(sizeof(T));
  return {reinterpret_cast<const char*>(k), (bytes + 63) / 64, 0};
}

// s[r * ss + kb] = q_r . k_kb for RB rows of q (float32, Dk apart) and KB keys
template <Dt E, int RB, int KB>
static DECODE_INLINE void qk_tile(const float* q, int64_t Dk, const elem_t<E>* const* k, float* s,
                                  int64_t ss) {
  __m256 acc[RB][KB];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KB; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= Dk; d += 8) {
    __m256 kv[KB];
    for (int c = 0; c < KB; ++c) kv[c] = load8<E>(k[c] + d);
    for (int r = 0; r < RB; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * Dk + d);
      for (int c = 0; c < KB; ++c) acc[r][c] = _mm256_fmadd_ps(qv, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < KB; ++c) {
      float t = hsum(acc[r][c]);
      for (int64_t e = d; e < Dk; ++e) t += q[r * Dk + e] * load1<E>(k[c] + e);
      s[r * ss + c] = t;
    }
  }
}

// four scores from four accumulators: [sum a0, sum a1, sum a2, sum a3]
static DECODE_INLINE __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// the scalar tail d0 .. Dk of four dot products of q (one row) with k0 + c * sk
template <Dt E>
static DECODE_INLINE __m128 tail4(const float* q, int64_t d0, int64_t Dk, const elem_t<E>* k0,
                                  int64_t sk) {
  alignas(16) float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int c = 0; c < 4; ++c)
    for (int64_t e = d0; e < Dk; ++e) t[c] += q[e] * load1<E>(k0 + c * sk + e);
  return _mm_load_ps(t);
}

// s[r * ss + c] = q_r . k_c for RB <= 2 rows of q (float32, Dk apart) and 4 keys (sk apart):
// eight accumulators in named registers over d, reduced to four scores per row by hadds
template <Dt E, int RB>
static DECODE_INLINE void qk_4keys(const float* q, int64_t Dk, const elem_t<E>* k0, int64_t sk,
                                   float* s, int64_t ss, const elem_t<E>* pf) {
  static_assert(RB == 1 || RB == 2, "one or two rows");
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  const elem_t<E>* k1 = k0 + sk;
  const elem_t<E>* k2 = k0 + 2 * sk;
  const elem_t<E>* k3 = k0 + 3 * sk;
  const float* q1 = q + (RB == 2 ? Dk : 0);
  int64_t d = 0;
  for (; d + 8 <= Dk; d += 8) {
    if (pf != nullptr && ((d * static_cast<int64_t>(sizeof(elem_t<E>))) & 63) == 0) {
      for (int c = 0; c < 4; ++c)  // the same keys of the next block, one line at a time
        _mm_prefetch(reinterpret_cast<const char*>(pf + c * sk + d), DECODE_PF_HINT);
    }
    const __m256 x0 = load8<E>(k0 + d), x1 = load8<E>(k1 + d);
    const __m256 x2 = load8<E>(k2 + d), x3 = load8<E>(k3 + d);
    const __m256 u = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(u, x0, a0);
    a1 = _mm256_fmadd_ps(u, x1, a1);
    a2 = _mm256_fmadd_ps(u, x2, a2);
    a3 = _mm256_fmadd_ps(u, x3, a3);
    if constexpr (RB == 2) {
      const __m256 w = _mm256_loadu_ps(q1 + d);
      b0 = _mm256_fmadd_ps(w, x0, b0);
      b1 = _mm256_fmadd_ps(w, x1, b1);
      b2 = _mm256_fmadd_ps(w, x2, b2);
      b3 = _mm256_fmadd_ps(w, x3, b3);
    }
  }
  __m128 x = sum4(a0, a1, a2, a3);
  if (d < Dk) x = _mm_add_ps(x, tail4<E>(q, d, Dk, k0, sk));
  _mm_storeu_ps(s, x);
  if constexpr (RB == 2) {
    __m128 y = sum4(b0, b1, b2, b3);
    if (d < Dk) y = _mm_add_ps(y, tail4<E>(q1, d, Dk, k0, sk));
    _mm_storeu_ps(s + ss, y);
  }
}

template <Dt E, int RB>
static inline void qk_rows(const float* q, int64_t Dk, const elem_t<E>* k0, int64_t sk,
                           int64_t n, float* s, int64_t ss, int64_t ahead,
                           int64_t dist, const elem_t<E>* v0, int64_t sv, int64_t vbytes,
                           int64_t vn) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const elem_t<E>* pf = j + 4 <= ahead ? k0 + (j + dist) * sk : nullptr;
    qk_4keys<E, RB>(q, Dk, k0 + j * sk, sk, s + j, ss, pf);
    if (j + 4 <= vn) prefetch_rows(v0 + j * sv, sv, 4, vbytes);
  }
  for (; j < n; ++j) {
    const elem_t<E>* kp[1] = {k0 + j * sk};
    qk_tile<E, RB, 1>(q, Dk, kp, s + j, ss);
  }
}

// s[r * ss + c] = q_r . k_c for 4 rows of q (float32, Dk apart) and 2 keys (sk apart): each K
// vector loaded (converted) once for the four rows; eight accumulators reduced by hadds
template <Dt E>
static DECODE_INLINE void qk_4x2(const float* q, int64_t Dk, const elem_t<E>* k0, int64_t sk,
                                 float* s, int64_t ss, const elem_t<E>* pf) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
  __m256 c0 = a0, c1 = a0, e0 = a0, e1 = a0;
  const elem_t<E>* k1 = k0 + sk;
  int64_t d = 0;
  for (; d + 8 <= Dk; d += 8) {
    if (pf != nullptr && ((d * static_cast<int64_t>(sizeof(elem_t<E>))) & 63) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + d), DECODE_PF_HINT);
      _mm_prefetch(reinterpret_cast<const char*>(pf + sk + d), DECODE_PF_HINT);
    }
    const __m256 x0 = load8<E>(k0 + d), x1 = load8<E>(k1 + d);
    __m256 u = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(u, x0, a0);
    a1 = _mm256_fmadd_ps(u, x1, a1);
    u = _mm256_loadu_ps(q + Dk + d);
    b0 = _mm256_fmadd_ps(u, x0, b0);
    b1 = _mm256_fmadd_ps(u, x1, b1);
    u = _mm256_loadu_ps(q + 2 * Dk + d);
    c0 = _mm256_fmadd_ps(u, x0, c0);
    c1 = _mm256_fmadd_ps(u, x1, c1);
    u = _mm256_loadu_ps(q + 3 * Dk + d);
    e0 = _mm256_fmadd_ps(u, x0, e0);
    e1 = _mm256_fmadd_ps(u, x1, e1);
  }
  __m128 x = sum4(a0, a1, b0, b1);  // [r0k0, r0k1, r1k0, r1k1]
  __m128 y = sum4(c0, c1, e0, e1);
  if (d < Dk) {
    alignas(16) float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 2; ++c)
        for (int64_t i = d; i < Dk; ++i) t[r * 2 + c] += q[r * Dk + i] * load1<E>(k0 + c * sk + i);
    x = _mm_add_ps(x, _mm_load_ps(t));
    y = _mm_add_ps(y, _mm_load_ps(t + 4));
  }
  _mm_storel_pi(reinterpret_cast<__m64*>(s), x);
  _mm_storeh_pi(reinterpret_cast<__m64*>(s + ss), x);
  _mm_storel_pi(reinterpret_cast<__m64*>(s + 2 * ss), y);
  _mm_storeh_pi(reinterpret_cast<__m64*>(s + 3 * ss), y);
}

// scores of four rows against keys k0[0 .. n), each key read once for the four rows
template <Dt E>
static inline void qk_rows4(const float* q, int64_t Dk, const elem_t<E>* k0, int64_t sk,
                            int64_t n, float* s, int64_t ss, int64_t ahead, int64_t dist,
                            const elem_t<E>* v0, int64_t sv, int64_t vbytes, int64_t vn) {
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const elem_t<E>* pf = j + 2 <= ahead ? k0 + (j + dist) * sk : nullptr;
    qk_4x2<E>(q, Dk, k0 + j * sk, sk, s + j, ss, pf);
    if (j + 2 <= vn) prefetch_rows(v0 + j * sv, sv, 2, vbytes);
  }
  if (j < n) {
    const elem_t<E>* kp[1] = {k0 + j * sk};
    qk_tile<E, 4, 1>(q, Dk, kp, s + j, ss);
  }
}

// scores of R rows against keys k0[0 .. n) (rows sk apart): s[r * ss + j], four rows at a time
// (each K row read once per four rows); the first group prefetches the K and V rows (V: v0,
// rows sv apart, vbytes each) `pf` keys ahead while ahead of them lie `avail` keys of the item,
// or, streaming (run_item), this block's own V rows and no K row
template <Dt E>
static void qk_block(const float* q, int64_t R, int64_t Dk, const elem_t<E>* k0, int64_t sk,
                     int64_t n, float* s, int64_t ss, int64_t pf, int64_t avail,
                     const elem_t<E>* v0, int64_t sv, int64_t vbytes, bool stream) {
  int64_t ahead = stream ? 0 : std::max<int64_t>(0, avail - pf);  // K rows pf on: j < ahead
  int64_t vn = stream ? n : ahead;  // V rows prefetched: vp + j * sv, j < vn
  const elem_t<E>* vp = stream ? v0 : v0 + pf * sv;
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) {
    qk_rows4<E>(q + r * Dk, Dk, k0, sk, n, s + r * ss, ss, ahead, pf, vp, sv, vbytes, vn);
    ahead = vn = 0;
  }
  for (; r + 2 <= R; r += 2) {
    qk_rows<E, 2>(q + r * Dk, Dk, k0, sk, n, s + r * ss, ss, ahead, pf, vp, sv, vbytes, vn);
    ahead = vn = 0;
  }
  if (r < R)
    qk_rows<E, 1>(q + r * Dk, Dk, k0, sk, n, s + r * ss, ss, ahead, pf, vp, sv, vbytes, vn);
}

// one block of a row's online softmax: s[a .. e) becomes 2^(s - m) for the row's running max m
// (raised to the block's max first, the running sum l and the row's output acc (Dv) rescaled
// by 2^(m_old - m_new) when it grows); bad |= a score there is NaN or inf
static inline void softmax_block(float* s, int64_t a, int64_t e, float& m_io, float& l_io,
                                 float* acc, int64_t Dv, bool& bad) {
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nf = _mm256_setzero_ps();  // NaN lanes where a score is NaN or inf
  int64_t j = a;
  for (; j + 8 <= e; j += 8) {
    const __m256 x = _mm256_loadu_ps(s + j);
    mv = _mm256_max_ps(mv, x);
    nf = _mm256_add_ps(nf, _mm256_sub_ps(x, x));
  }
  float bm = hmax(mv);
  float tail_nf = 0.0f;
  for (; j < e; ++j) {
    bm = std::max(bm, s[j]);
    tail_nf += s[j] - s[j];
  }
  const float nfs = hsum(nf) + tail_nf;
  if (!std::isfinite(nfs) || !std::isfinite(bm)) bad = true;
  float m = m_io, l = l_io;
  if (bm > m) {
    if (l > 0.0f) {  // rescale what the row holds to the new max
      const float alpha = std::exp2(m - bm);
      l *= alpha;
      const __m256 av = _mm256_set1_ps(alpha);
      int64_t d = 0;
      for (; d + 8 <= Dv; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_mul_ps(av, _mm256_loadu_ps(acc + d)));
      for (; d < Dv; ++d) acc[d] *= alpha;
    }
    m = bm;
  }
  const __m256 mb = _mm256_set1_ps(m);
  __m256 lv = _mm256_setzero_ps();
  j = a;
  for (; j + 8 <= e; j += 8) {
    const __m256 p = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), mb));
    _mm256_storeu_ps(s + j, p);
    lv = _mm256_add_ps(lv, p);
  }
  l += hsum(lv);
  for (; j < e; ++j) {
    const float p = std::exp2(s[j] - m);
    s[j] = p;
    l += p;
  }
  m_io = m;
  l_io = l;
}

// o_r[d ..] += sum_j p_r[j] v_j[d ..] for RB rows over keys j < n of vb (rows sv apart, as
// float32): the accumulators of NV vectors per row stay in registers across the keys; with each
// key, the next pf.per of pf's lines prefetched
template <Dt E, int RB, int NV>
static DECODE_INLINE void pv_tile(const float* const* p, const elem_t<E>* vb, int64_t sv, int64_t n,
                                  float* const* o, int64_t d, const PfRange& pf) {
  __m256 a[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NV; ++c) a[r][c] = _mm256_loadu_ps(o[r] + d + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    __m256 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = load8<E>(vb + j * sv + d + 8 * c);
    if (j * pf.per < pf.lines)
      for (int64_t c = 0; c < pf.per; ++c)
        _mm_prefetch(pf.p + 64 * (j * pf.per + c), DECODE_PF_HINT);
    for (int r = 0; r < RB; ++r) {
      const __m256 pb = _mm256_broadcast_ss(p[r] + j);
      for (int c = 0; c < NV; ++c) a[r][c] = _mm256_fmadd_ps(pb, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(o[r] + d + 8 * c, a[r][c]);
}

// P V of RB rows over n keys, tile by tile of 8 NV columns; pf's lines spread over the tiles'
// keys in address order (pf.per ignored: set here)
template <Dt E, int RB>
static DECODE_INLINE void pv_rows(const float* const* p, const elem_t<E>* vb, int64_t sv,
                                  int64_t Dv, int64_t n, float* const* o, const PfRange& pf = {}) {
  constexpr int NV = RB == 1 ? 8 : RB == 2 ? 4 : 2;
  const int64_t steps = Dv / (8 * NV) * n;  // key steps of the full tiles
  PfRange part{pf.p, pf.lines, steps > 0 ? (pf.lines + steps - 1) / steps : 0};
  int64_t d = 0;
  for (; d + 8 * NV <= Dv; d += 8 * NV) {
    pv_tile<E, RB, NV>(p, vb, sv, n, o, d, part);
    part.p += 64 * part.per * n;  // the next tile's share
    part.lines -= part.per * n;
  }
  for (; d + 8 <= Dv; d += 8) pv_tile<E, RB, 1>(p, vb, sv, n, o, d, PfRange{});
  for (; d < Dv; ++d)
    for (int r = 0; r < RB; ++r) {
      float t = o[r][d];
      for (int64_t j = 0; j < n; ++j) t += p[r][j] * load1<E>(vb + j * sv + d);
      o[r][d] = t;
    }
}

// acc[r] += sum_j p[r][j] v_j over each row's own keys [ra[r], re[r]) of one block of nb keys
// (vb its first V row, rows sv apart): rows whose run holds the whole block four at a time,
// the others key by key (so a value a row may not see is never multiplied into it)
template <Dt E>
static void pv_rows_all(const float* s, int64_t ss, int64_t R, const int64_t* ra,
                        const int64_t* re, const elem_t<E>* vb, int64_t sv, int64_t nb,
                        int64_t Dv, float* acc, const float** pp, float** op,
                        const PfRange& pf = {}) {
  int64_t nf = 0;
  for (int64_t r = 0; r < R; ++r) {
    if (ra[r] <= 0 && re[r] >= nb) {
      pp[nf] = s + r * ss;
      op[nf] = acc + r * Dv;
      ++nf;
    } else if (re[r] > ra[r]) {  // part of the block: key by key
      const int64_t a = ra[r];
      const float* pr = s + r * ss + a;
      float* o = acc + r * Dv;
      pv_rows<E, 1>(&pr, vb + a * sv, sv, Dv, re[r] - a, &o, PfRange{});
    }
  }
  int64_t i = 0;
  for (; i + 4 <= nf; i += 4) pv_rows<E, 4>(pp + i, vb, sv, Dv, nb, op + i, pf);
  switch (nf - i) {
    case 3: pv_rows<E, 3>(pp + i, vb, sv, Dv, nb, op + i, pf); break;
    case 2: pv_rows<E, 2>(pp + i, vb, sv, Dv, nb, op + i, pf); break;
    case 1: pv_rows<E, 1>(pp + i, vb, sv, Dv, nb, op + i, pf); break;
    default: break;
  }
}

// whether a call runs in the streaming order: the score pass of a block prefetches the block's
// own V rows and its P V pass the next block's K rows, each spread over the pass's keys in
// address order, so that the memory has reads in flight while either pass computes (with the
// K and V prefetches of one pass only, it sat idle through the other; docs/benchmarks.md,
// "Decoding"); P V then reads V in place. Where at most four rows read each K/V row (the
// micro-kernels' one group: the prefetches spread over one pass) and the rows are contiguous
// (a block's K or V rows one run of bytes: a KVCache buffer's are)
static inline bool streams(int64_t R, int64_t Dk, int64_t Dv, int64_t ks, int64_t vs) {
  return DECODE_STREAM != 0 && R <= 4 && ks == Dk && vs == Dv;
}

// outside the streaming order (streams()),
// whether P V reads a block's V rows in place (the score pass prefetches them) where at most
// four rows read them: always for bfloat16 and float16 (each element then converted once);
// for float32 where the call reads at most DECODE_INPLACE_BYTES of K/V (`bytes`), as a
// model's decode step over a short cache does, whose K/V the caches hold; a longer float32
// cache streams from memory, where copying each block's V rows into vbuf (prefetched as they
// are copied) ran faster (docs/benchmarks.md, "Decoding")
template <Dt E>
static inline bool pv_in_place(int64_t R, int64_t bytes) {
  return R <= 4 && (E != Dt::F32 || bytes <= DECODE_INPLACE_BYTES);
}

// P V of one block of nb keys (v0 its first V row, rows sv apart; `avail` keys of the item from
// it on, the V rows pf keys ahead prefetched where it copies; in_place: pv_in_place's answer)
template <Dt E>
static void pv_block(const float* s, int64_t ss, int64_t R, const int64_t* ra, const int64_t* re,
                     const elem_t<E>* v0, int64_t sv, int64_t nb, int64_t Dv, float* acc,
                     float* vbuf, const float** pp, float** op, int64_t pf, int64_t avail,
                     bool in_place, const PfRange& next_k) {
  if (in_place) {
    pv_rows_all<E>(s, ss, R, ra, re, v0, sv, nb, Dv, acc, pp, op, next_k);
    return;
  }
  const int64_t row_bytes = Dv * static_cast<int64_t>(sizeof(elem_t<E>));
  for (int64_t j = 0; j < nb; ++j) {
    const elem_t<E>* src = v0 + j * sv;
    float* dst = vbuf + j * Dv;
    if (j + pf < avail) prefetch_rows(src + pf * sv, sv, 1, row_bytes);
    int64_t d = 0;
    for (; d + 8 <= Dv; d += 8) _mm256_storeu_ps(dst + d, load8<E>(src + d));
    for (; d < Dv; ++d) dst[d] = load1<E>(src + d);
  }
  pv_rows_all<Dt::F32>(s, ss, R, ra, re, vbuf, Dv, nb, Dv, acc, pp, op);
}

// the per-thread buffers of run_item
struct Scratch {
  std::unique_ptr<float[]> fbuf;  // scores (R x ss), then vbuf (NB x Dv + 8): uninitialised
  float* sb;
  float* vbuf;
  std::vector<int64_t> idx;  // ra, re, ba, be: R each
  int64_t *ra, *re, *ba, *be;
  std::vector<const float*> pp;
  std::vector<float*> ob;
  std::vector<float> o;
  Scratch(int64_t R, int64_t ss, int64_t NB, int64_t Dv)
      : fbuf(new float[static_cast<size_t>(R * ss + NB * Dv + 8)]), idx(4 * R), pp(R), ob(R),
        o(static_cast<size_t>(Dv)) {
    sb = fbuf.get();
    vbuf = sb + R * ss;
    ra = idx.data();
    re = ra + R;
    ba = re + R;
    be = ba + R;
  }
};

// one item: R rows (qg, float32, Dk apart) against n keys k0/v0 (rows ks/vs apart), row r
// over its keys [ra[r], re[r]) of them: in blocks of NB keys, the scores of the block, each
// row's online softmax step, then P V of the block, so that K and V each stream once and a
// block's K and V rows are hot between the passes; leaves max m, sum l (log2 units) and the
// unnormalised output acc (R x Dv) of each row; in_place: whether P V reads V in place
// (pv_in_place's answer, or the streaming order's), stream: streams()'s answer for the call,
// after: in the streaming order, the K rows that the last block's P V pass prefetches
template <Dt E>
static void run_item(const float* qg, int64_t R, int64_t Dk, int64_t Dv, const elem_t<E>* k0,
                     int64_t ks, const elem_t<E>* v0, int64_t vs, int64_t n, int64_t NB,
                     Scratch& w, int64_t ss, float* acc, float* m, float* l, bool in_place,
                     bool stream, const PfRange& after, bool& bad) {
  const int64_t esize = static_cast<int64_t>(sizeof(elem_t<E>));
  const int64_t row_bytes = std::max(Dk, Dv) * esize;
  const int64_t pf = DECODE_PF_BYTES == 0
                         ? n
                         : std::max<int64_t>(4, DECODE_PF_BYTES / std::max<int64_t>(1, row_bytes));
  // the score pass prefetches V rows only where P V reads them in place
  const int64_t vbytes = in_place ? Dv * esize : 0;
  std::fill(acc, acc + R * Dv, 0.0f);
  for (int64_t r = 0; r < R; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
  }
  for (int64_t j0 = 0; j0 < n; j0 += NB) {
    const int64_t nb = std::min(NB, n - j0);
    // the streaming order's prefetch of the next block's K rows (contiguous: ks == Dk), or,
    // after the last block, the first of the thread's next item (`after`)
    const PfRange next_k =
        j0 + nb < n ? rows_range(k0 + (j0 + nb) * ks, std::min(NB, n - j0 - nb), Dk) : after;
    bool any = false;
    for (int64_t r = 0; r < R; ++r) {
      w.ba[r] = std::max<int64_t>(w.ra[r] - j0, 0);
      w.be[r] = std::min(w.re[r] - j0, nb);
      any |= w.be[r] > w.ba[r];
    }
    if (!any) continue;  // no row sees a key of this block
    qk_block<E>(qg, R, Dk, k0 + j0 * ks, ks, nb, w.sb, ss, pf, n - j0, v0 + j0 * vs, vs,
                vbytes, stream);
    for (int64_t r = 0; r < R; ++r)
      if (w.be[r] > w.ba[r])
        softmax_block(w.sb + r * ss, w.ba[r], w.be[r], m[r], l[r], acc + r * Dv, Dv, bad);
    pv_block<E>(w.sb, ss, R, w.ba, w.be, v0 + j0 * vs, vs, nb, Dv, acc, w.vbuf, w.pp.data(),
                w.ob.data(), pf, n - j0, in_place, stream ? next_k : PfRange{});
  }
}

struct Item {
  int64_t b, hk, a, e;  // keys [a, e) of kv head hk of batch row b
};

struct Problem {
  int64_t B, H, Hkv, L, S, Dk, Dv, g, R;
  int64_t lo_b;  // lo/hi rows apart per batch row (0: one row for the batch)
};

template <Dt E>
static void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& lo_t, const at::Tensor& hi_t, double scale,
                         at::Tensor& out, at::Tensor& lse, bool& finite) {
  using T = elem_t<E>;
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), Dk = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2), Dv = v.size(3);
  const int64_t g = H / Hkv, R = g * L;
  const int64_t lo_b = lo_t.size(0) == 1 ? 0 : L;
  const int64_t* lo = lo_t.data_ptr<int64_t>();
  const int64_t* hi = hi_t.data_ptr<int64_t>();
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  const int64_t kb = k.stride(0), kh = k.stride(1), ks = k.stride(2);
  const int64_t vb = v.stride(0), vh = v.stride(1), vs = v.stride(2);
  const int64_t nth = std::max<int64_t>(1, at::get_num_threads());
  std::atomic<bool> bad{false};

  // q as float32 rows (b, h, l), pre-scaled by scale * log2(e); a non-finite q is reported
  std::vector<float> qs(static_cast<size_t>(B * H * L * Dk));
  {
    const T* qp = reinterpret_cast<const T*>(q.data_ptr());  // contiguous (made so by caller)
    const float sc = static_cast<float>(scale * 1.4426950408889634);
    bool qbad = false;
    for (int64_t i = 0; i < B * H * L * Dk; ++i) {
      const float x = load1<E>(qp + i);
      qbad |= !std::isfinite(x);
      qs[i] = x * sc;
    }
    if (qbad) bad = true;
  }

  // the keys each batch row's items cover: the union of its rows' runs, cut into chunks
  std::vector<int64_t> ua(B), ue(B);
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t a = S, e = 0;
    for (int64_t l = 0; l < L; ++l) {
      const int64_t x = lo[b * lo_b + l], y = hi[b * lo_b + l];
      if (x <= y) {
        a = std::min(a, x);
        e = std::max(e, y + 1);
      }
    }
    a = std::max<int64_t>(a, 0);
    e = std::min(e, S);
    ua[b] = a;
    ue[b] = std::max(a, e);
    total += ue[b] - ua[b];
  }
  int64_t C = (total * Hkv + nth * 8 - 1) / (nth * 8);
  C = std::min<int64_t>(512, std::max<int64_t>(64, (C + 15) / 16 * 16));
  int64_t count = 0;
  for (int64_t b = 0; b < B; ++b) count += (ue[b] - ua[b] + C - 1) / C;
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(count * Hkv));
  std::vector<int64_t> first(B * Hkv + 1, 0);  // items of (b, hk): first[i] .. first[i + 1]
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      first[b * Hkv + hk] = static_cast<int64_t>(items.size());
      for (int64_t a = ua[b]; a < ue[b]; a += C) items.push_back({b, hk, a, std::min(a + C, ue[b])});
    }
  }
  first[B * Hkv] = static_cast<int64_t>(items.size());
  const int64_t nitems = static_cast<int64_t>(items.size());
  // partials per item and row: max, sum (log2 units) and the unnormalised output
  std::vector<float> pm(static_cast<size_t>(nitems * R)), pl(static_cast<size_t>(nitems * R));
  std::unique_ptr<float[]> pacc(new float[static_cast<size_t>(nitems * R * Dv)]);  // no init

  // merge group i's partials by the log-sum-exp rule (out in q's dtype, lse natural log); run
  // by the thread that finishes the group's last item, or here for a group with no keys
  T* op = reinterpret_cast<T*>(out.data_ptr());
  float* lp = lse.data_ptr<float>();
  auto merge = [&](int64_t i, std::vector<float>& o, bool& mybad) {
    const int64_t b = i / Hkv, hk = i % Hkv;
    const int64_t f0 = first[i], f1 = first[i + 1];
    for (int64_t r = 0; r < R; ++r) {
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t t = f0; t < f1; ++t)
        if (pl[t * R + r] > 0.0f) M = std::max(M, pm[t * R + r]);
      const int64_t row = (b * H + hk * g) * L + r;  // (b, h, l) row: gi-major like r
      T* dst = op + row * Dv;
      if (!(M > -std::numeric_limits<float>::infinity())) {  // no key (or NaN max)
        const bool nan = std::isnan(M);
        mybad |= nan;
        for (int64_t d = 0; d < Dv; ++d) store1<E>(dst + d, 0.0f);
        lp[row] = nan ? M : -std::numeric_limits<float>::infinity();
        continue;
      }
      std::fill(o.begin(), o.end(), 0.0f);
      float lsum = 0.0f;
      for (int64_t t = f0; t < f1; ++t) {
        if (!(pl[t * R + r] > 0.0f)) continue;
        const float w = std::exp2(pm[t * R + r] - M);
        lsum += w * pl[t * R + r];
        const float* a = pacc.get() + (t * R + r) * Dv;
        for (int64_t d = 0; d < Dv; ++d) o[d] += w * a[d];
      }
      const float inv = 1.0f / lsum;
      float chk = 0.0f;
      for (int64_t d = 0; d < Dv; ++d) {
        const float x = o[d] * inv;
        chk += x - x;
        store1<E>(dst + d, x);
      }
      mybad |= !std::isfinite(chk) || !std::isfinite(lsum);
      lp[row] = static_cast<float>((M + std::log2(lsum)) * 0.6931471805599453);
    }
  };
  std::vector<std::atomic<int64_t>> left(static_cast<size_t>(B * Hkv));
  {
    std::vector<float> o(static_cast<size_t>(Dv));
    bool mybad = false;
    for (int64_t i = 0; i < B * Hkv; ++i) {
      left[i].store(first[i + 1] - first[i]);
      if (first[i + 1] == first[i]) merge(i, o, mybad);
    }
    if (mybad) bad = true;
  }
  std::atomic<int64_t> next{0};
  const int64_t bytes = total * Hkv * (Dk + Dv) * static_cast<int64_t>(sizeof(T));  // K/V read
  const bool stream = streams(R, Dk, Dv, ks, vs);
  const bool in_place = stream || pv_in_place<E>(R, bytes);
  // from memory, the streaming order's blocks are shorter (a number of keys: the same compute
  // per block in every dtype): each pass's prefetches then run ahead by less than a long
  // block, and the next block's K arrives during a shorter P V
  const int64_t NB =
      stream && bytes > DECODE_INPLACE_BYTES
          ? DECODE_STREAM_BLOCK_KEYS
          : std::min<int64_t>(128, std::max<int64_t>(8, DECODE_BLOCK_BYTES /
                                                            (std::max<int64_t>({Dk, Dv, 1}) *
                                                             static_cast<int64_t>(sizeof(T)))) /
                                       8 * 8);
  const int64_t ss = NB + 8;
  auto work = [&](int64_t, int64_t) {
    Scratch w(R, ss, NB, Dv);
    bool mybad = false;
    int64_t t = next.fetch_add(1, std::memory_order_relaxed);
    while (t < nitems) {
      // the thread's next item, taken now: the streaming order prefetches its first K rows
      const int64_t tn = next.fetch_add(1, std::memory_order_relaxed);
      const Item* x = stream && tn < nitems ? &items[tn] : nullptr;
      const PfRange after = x == nullptr ? PfRange{}
                                         : rows_range(kp + x->b * kb + x->hk * kh + x->a * ks,
                                                      std::min(NB, x->e - x->a), Dk);
      const Item it = items[t];
      for (int64_t r = 0; r < R; ++r) {  // row r's keys of the item, local
        const int64_t l = r % L;
        const int64_t x = std::max(lo[it.b * lo_b + l], it.a);
        const int64_t y = std::min(hi[it.b * lo_b + l] + 1, it.e);
        w.ra[r] = x - it.a;
        w.re[r] = std::max(x, y) - it.a;
      }
      const float* qg = qs.data() + ((it.b * H + it.hk * g) * L) * Dk;  // R rows, gi-major
      run_item<E>(qg, R, Dk, Dv, kp + it.b * kb + it.hk * kh + it.a * ks, ks,
                  vp + it.b * vb + it.hk * vh + it.a * vs, vs, it.e - it.a, NB, w, ss,
                  pacc.get() + t * R * Dv, pm.data() + t * R, pl.data() + t * R, in_place,
                  stream, after, mybad);
      const int64_t gi = it.b * Hkv + it.hk;  // the group's last item merges it
      if (left[gi].fetch_sub(1, std::memory_order_acq_rel) == 1) merge(gi, w.o, mybad);
      t = tn;
    }
    if (mybad) bad = true;
  };
  // little work (a short cache): one thread, no thread start
  if (nth == 1 || nitems <= 1 || bytes < DECODE_SERIAL_BYTES)
    work(0, 1);
  else
    at::parallel_for(0, nth, 1, work);
  finite = !bad.load();
}

}  // namespace decode

// The C ABI (attnkit.backends.blocked.native calls it through ctypes; abi.h): out
// (B, H, L, Dv) in q's dtype and lse (B, H, L) float32 of query rows attending keys
// lo[b, i]..hi[b, i] (int64 (lo_rows = 1 or B, L), local, inclusive); q (B, H, L, Dk)
// contiguous, k (B, Hkv, S, Dk) and v (B, Hkv, S, Dv) strided with a contiguous last
// dimension. One int64 array a holds every argument but the scale (one ctypes argument
// costs about as much as a short array, and a decode step is short):
//   a[0..7)   pointers: q, k, v, lo, hi, out, lse
//   a[7]      dtype (attnkit_abi::Code of q, k, v), a[8] threads (torch.get_num_threads())
//   a[9]      lo_rows, a[10] lo_cols
//   a[11..15) q's sizes; a[15..19) k's sizes, a[19..23) its strides; v's: a[23..27), a[27..31)
// Returns 0 where everything it read and wrote was finite, 2 where a q, a score of a key a row
// may see, or an output was not, and 1 with attnkit_last_error() saying why it could not run.
extern "C" {

const char* attnkit_last_error() { return attnkit_abi::last_error().c_str(); }

// bit 0: reads bfloat16; bit 1: reads float16 (built with F16C)
int32_t attnkit_low_dtypes() { return attnkit_abi::low_dtype_bits(); }

int32_t attnkit_decode_forward(const int64_t* a, double scale) {
  bool finite = true;
  const int32_t rc = attnkit_abi::guarded([&] {
    const int64_t dtype = a[7], nthreads = a[8], lo_rows = a[9], lo_cols = a[10];
    const int64_t *qs = a + 11, *ks = a + 15, *kst = a + 19, *vs = a + 23, *vst = a + 27;
    const int64_t B = qs[0], H = qs[1], L = qs[2], Dk = qs[3];
    const int64_t Hkv = ks[1], S = ks[2], Dv = vs[3];
    ABI_CHECK(dtype == attnkit_abi::F32 || dtype == attnkit_abi::BF16 ||
                  (dtype == attnkit_abi::F16 && (attnkit_abi::low_dtype_bits() & 2)),
              "decode: dtype not supported");
    ABI_CHECK(ks[0] == B && vs[0] == B && vs[1] == Hkv && vs[2] == S && ks[3] == Dk &&
                  Hkv > 0 && H % Hkv == 0,
              "decode: shapes of q, k, v do not match");
    ABI_CHECK(kst[3] == 1 && vst[3] == 1, "decode: k and v need a contiguous last dim");
    ABI_CHECK(lo_cols == L && (lo_rows == 1 || lo_rows == B),
              "decode: lo/hi must be int64 (1 or B, L)");
    if (!(B * H * L > 0 && Dv > 0)) return;
    at::set_call_threads(nthreads);
    const at::Tensor tq = at::view(attnkit_abi::arg(a, 0), {B, H, L, Dk});
    at::Tensor tk = at::view(attnkit_abi::arg(a, 1), {B, Hkv, S, Dk});
    at::Tensor tv = at::view(attnkit_abi::arg(a, 2), {B, Hkv, S, Dv});
    for (int d = 0; d < 4; ++d) {
      tk.st[d] = kst[d];
      tv.st[d] = vst[d];
    }
    const at::Tensor tlo = at::view(attnkit_abi::arg(a, 3), {lo_rows, lo_cols});
    const at::Tensor thi = at::view(attnkit_abi::arg(a, 4), {lo_rows, lo_cols});
    at::Tensor to = at::view(attnkit_abi::arg(a, 5), {B, H, L, Dv});
    at::Tensor tl = at::view(attnkit_abi::arg(a, 6), {B, H, L});
    using decode::Dt;
    switch (dtype) {
      case attnkit_abi::BF16:
        decode::forward_impl<Dt::BF16>(tq, tk, tv, tlo, thi, scale, to, tl, finite);
        break;
#ifdef __F16C__
      case attnkit_abi::F16:
        decode::forward_impl<Dt::F16>(tq, tk, tv, tlo, thi, scale, to, tl, finite);
        break;
#endif
      default:
        decode::forward_impl<Dt::F32>(tq, tk, tv, tlo, thi, scale, to, tl, finite);
        break;
    }
  });
  return rc != 0 ? rc : (finite ? 0 : 2);
}

}  // extern "C"
