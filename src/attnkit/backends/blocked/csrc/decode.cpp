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
//     the log-sum-exp rule (no second parallel pass).
//   * In an item: scores S = q K^T (q pre-scaled by scale * log2(e), so the softmax uses exp2)
//     for every row over the chunk's keys (4 rows x 2 keys per micro-kernel, K row loaded once
//     per row block from L1), the softmax over each row's own keys (vectorised degree-5 exp2
//     polynomial), then acc += P V with keys outermost (V row loaded once per key for every
//     row whose run holds it, so a value a row may not see is never multiplied into it).
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
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace decode {

// element types, their loads and stores, exp2_ps, hsum, hmax: elements.h
using namespace attnkit_elements;




// s[r * ss + kb] = q_r . k_kb for RB rows of q (float32, Dk apart) and KB keys
template <Dt E, int RB, int KB>
static inline void qk_tile(const float* q, int64_t Dk, const elem_t<E>* const* k, float* s,
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

// how many keys ahead the score loop prefetches K rows (two blocks of 32)
constexpr int64_t kAhead = 64;

// four scores from four accumulators: [sum a0, sum a1, sum a2, sum a3]
static inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// the scalar tail d0 .. Dk of four dot products of q (one row) with k0 + c * sk
template <Dt E>
static inline __m128 tail4(const float* q, int64_t d0, int64_t Dk, const elem_t<E>* k0,
                           int64_t sk) {
  alignas(16) float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int c = 0; c < 4; ++c)
    for (int64_t e = d0; e < Dk; ++e) t[c] += q[e] * load1<E>(k0 + c * sk + e);
  return _mm_load_ps(t);
}

// s[r * ss + c] = q_r . k_c for RB <= 2 rows of q (float32, Dk apart) and 4 keys (sk apart):
// eight accumulators in named registers over d, reduced to four scores per row by hadds
template <Dt E, int RB>
static inline void qk_4keys(const float* q, int64_t Dk, const elem_t<E>* k0, int64_t sk,
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
        _mm_prefetch(reinterpret_cast<const char*>(pf + c * sk + d), _MM_HINT_T0);
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
                           int64_t n, float* s, int64_t ss, int64_t ahead) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const elem_t<E>* pf = j + 4 <= ahead ? k0 + (j + kAhead) * sk : nullptr;
    qk_4keys<E, RB>(q, Dk, k0 + j * sk, sk, s + j, ss, pf);
  }
  for (; j < n; ++j) {
    const elem_t<E>* kp[1] = {k0 + j * sk};
    qk_tile<E, RB, 1>(q, Dk, kp, s + j, ss);
  }
}

// scores of R rows against keys k0[0 .. n) (rows sk apart): s[r * ss + j]
template <Dt E>
static void qk_all(const float* q, int64_t R, int64_t Dk, const elem_t<E>* k0, int64_t sk,
                   int64_t n, float* s, int64_t ss) {
  // key blocks of 32 outermost: their K rows stay in L1 while every row pair reads them
  for (int64_t j0 = 0; j0 < n; j0 += 32) {
    const int64_t nb = std::min<int64_t>(32, n - j0);
    int64_t ahead = std::max<int64_t>(0, n - j0 - kAhead);  // keys kAhead on
    int64_t r = 0;
    for (; r + 2 <= R; r += 2) {  // the first row pair prefetches the next block's K rows
      qk_rows<E, 2>(q + r * Dk, Dk, k0 + j0 * sk, sk, nb, s + r * ss + j0, ss, ahead);
      ahead = 0;
    }
    if (r < R) qk_rows<E, 1>(q + r * Dk, Dk, k0 + j0 * sk, sk, nb, s + r * ss + j0, ss, ahead);
  }
}

// softmax numerators of s[a .. e) in place (2^(s - m)); returns (m, sum); bad |= non-finite
static inline void softmax_run(float* s, int64_t a, int64_t e, float& m_out, float& l_out,
                               bool& bad) {
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nf = _mm256_setzero_ps();  // NaN lanes where a score is NaN or inf
  int64_t j = a;
  for (; j + 8 <= e; j += 8) {
    const __m256 x = _mm256_loadu_ps(s + j);
    mv = _mm256_max_ps(mv, x);
    nf = _mm256_add_ps(nf, _mm256_sub_ps(x, x));
  }
  float m = hmax(mv);
  float tail_nf = 0.0f;
  for (; j < e; ++j) {
    m = std::max(m, s[j]);
    tail_nf += s[j] - s[j];
  }
  const float nfs = hsum(nf) + tail_nf;
  if (!std::isfinite(nfs) || !std::isfinite(m)) bad = true;
  const __m256 mb = _mm256_set1_ps(m);
  __m256 lv = _mm256_setzero_ps();
  j = a;
  for (; j + 8 <= e; j += 8) {
    const __m256 p = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), mb));
    _mm256_storeu_ps(s + j, p);
    lv = _mm256_add_ps(lv, p);
  }
  float l = hsum(lv);
  for (; j < e; ++j) {
    const float p = std::exp2(s[j] - m);
    s[j] = p;
    l += p;
  }
  m_out = m;
  l_out = l;
}

// o_r[d ..] += sum_j p_r[j] v_j[d ..] for RB rows over keys j < n of vb (float32 rows, Dv
// apart): the accumulators of NV vectors per row stay in registers across the keys
template <int RB, int NV>
static inline void pv_tile(const float* const* p, const float* vb, int64_t Dv, int64_t n,
                           float* const* o, int64_t d) {
  __m256 a[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NV; ++c) a[r][c] = _mm256_loadu_ps(o[r] + d + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    __m256 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = _mm256_loadu_ps(vb + j * Dv + d + 8 * c);
    for (int r = 0; r < RB; ++r) {
      const __m256 pb = _mm256_broadcast_ss(p[r] + j);
      for (int c = 0; c < NV; ++c) a[r][c] = _mm256_fmadd_ps(pb, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(o[r] + d + 8 * c, a[r][c]);
}

template <int RB>
static inline void pv_rows(const float* const* p, const float* vb, int64_t Dv, int64_t n,
                           float* const* o) {
  constexpr int NV = RB == 1 ? 8 : RB == 2 ? 4 : 2;
  int64_t d = 0;
  for (; d + 8 * NV <= Dv; d += 8 * NV) pv_tile<RB, NV>(p, vb, Dv, n, o, d);
  for (; d + 8 <= Dv; d += 8) pv_tile<RB, 1>(p, vb, Dv, n, o, d);
  for (; d < Dv; ++d)
    for (int r = 0; r < RB; ++r) {
      float t = o[r][d];
      for (int64_t j = 0; j < n; ++j) t += p[r][j] * vb[j * Dv + d];
      o[r][d] = t;
    }
}

// acc[r] += sum_j p[r][j] v_j over each row's own keys [ra[r], re[r]) (local to the chunk), in
// blocks of KB keys: the block's V rows are converted (copied for float32) once into vbuf, read
// sequentially; rows whose run holds the whole block go through pv_rows four at a time, the
// others key by key (so a value a row may not see is never multiplied into it)
template <Dt E>
static void pv_all(const float* s, int64_t ss, int64_t R, const int64_t* ra, const int64_t* re,
                   const elem_t<E>* v0, int64_t sv, int64_t n, int64_t Dv, float* acc,
                   float* vbuf, int64_t KB, const float** pp, float** op) {
  for (int64_t j0 = 0; j0 < n; j0 += KB) {
    const int64_t nb = std::min(KB, n - j0);
    for (int64_t j = 0; j < nb; ++j) {
      const elem_t<E>* src = v0 + (j0 + j) * sv;
      float* dst = vbuf + j * Dv;
      if (j0 + 2 * KB + j < n) {  // the same row of the next block
        const char* nx = reinterpret_cast<const char*>(src + 2 * KB * sv);
        for (int64_t b = 0; b < Dv * static_cast<int64_t>(sizeof(elem_t<E>)); b += 64)
          _mm_prefetch(nx + b, _MM_HINT_T0);
      }
      int64_t d = 0;
      for (; d + 8 <= Dv; d += 8) _mm256_storeu_ps(dst + d, load8<E>(src + d));
      for (; d < Dv; ++d) dst[d] = load1<E>(src + d);
    }
    int64_t nf = 0;
    for (int64_t r = 0; r < R; ++r) {
      if (ra[r] <= j0 && re[r] >= j0 + nb) {
        pp[nf] = s + r * ss + j0;
        op[nf] = acc + r * Dv;
        ++nf;
      } else if (ra[r] < j0 + nb && re[r] > j0) {  // part of the block: key by key
        const int64_t a = std::max(ra[r], j0) - j0, e = std::min(re[r], j0 + nb) - j0;
        const float* pr = s + r * ss + j0 + a;
        float* o = acc + r * Dv;
        pv_rows<1>(&pr, vbuf + a * Dv, Dv, e - a, &o);
      }
    }
    int64_t i = 0;
    for (; i + 4 <= nf; i += 4) pv_rows<4>(pp + i, vbuf, Dv, nb, op + i);
    switch (nf - i) {
      case 3: pv_rows<3>(pp + i, vbuf, Dv, nb, op + i); break;
      case 2: pv_rows<2>(pp + i, vbuf, Dv, nb, op + i); break;
      case 1: pv_rows<1>(pp + i, vbuf, Dv, nb, op + i); break;
      default: break;
    }
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
  std::vector<Item> items;
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
  std::vector<float> pacc(static_cast<size_t>(nitems * R * Dv));

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
        const float* a = pacc.data() + (t * R + r) * Dv;
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
  const int64_t ss = C + 8;
  at::parallel_for(0, nth, 1, [&](int64_t, int64_t) {
    std::vector<float> sb(static_cast<size_t>(R * ss));
    const int64_t KB = std::max<int64_t>(8, std::min<int64_t>(32, 4096 / std::max<int64_t>(Dv, 1)));
    std::vector<float> vbuf(static_cast<size_t>(KB * Dv + 8));
    std::vector<int64_t> ra(R), re(R);
    std::vector<const float*> pp(R);
    std::vector<float*> ob(R);
    std::vector<float> o(static_cast<size_t>(Dv));
    bool mybad = false;
    for (;;) {
      const int64_t t = next.fetch_add(1);
      if (t >= nitems) break;
      const Item it = items[t];
      const int64_t n = it.e - it.a;
      const float* qg = qs.data() + ((it.b * H + it.hk * g) * L) * Dk;  // R rows, gi-major
      const T* k0 = kp + it.b * kb + it.hk * kh + it.a * ks;
      const T* v0 = vp + it.b * vb + it.hk * vh + it.a * vs;
      qk_all<E>(qg, R, Dk, k0, ks, n, sb.data(), ss);
      float* acc = pacc.data() + t * R * Dv;
      std::fill(acc, acc + R * Dv, 0.0f);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t l = r % L;
        const int64_t x = std::max(lo[it.b * lo_b + l], it.a);
        const int64_t y = std::min(hi[it.b * lo_b + l] + 1, it.e);
        ra[r] = x - it.a;
        re[r] = std::max(x, y) - it.a;
        float m = -std::numeric_limits<float>::infinity(), s = 0.0f;
        if (re[r] > ra[r]) softmax_run(sb.data() + r * ss, ra[r], re[r], m, s, mybad);
        pm[t * R + r] = m;
        pl[t * R + r] = s;
      }
      pv_all<E>(sb.data(), ss, R, ra.data(), re.data(), v0, vs, n, Dv, acc, vbuf.data(), KB,
                pp.data(), ob.data());
      const int64_t gi = it.b * Hkv + it.hk;  // the group's last item merges it
      if (left[gi].fetch_sub(1, std::memory_order_acq_rel) == 1) merge(gi, o, mybad);
    }
    if (mybad) bad = true;
  });
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

int32_t attnkit_abi_version() { return 1; }

const char* attnkit_last_error() { return attnkit_abi::last_error().c_str(); }

// bit 0: reads bfloat16; bit 1: reads float16 (built with F16C)
int32_t attnkit_low_dtypes() { return attnkit_abi::low_dtype_bits(); }

int32_t attnkit_decode_forward(const int64_t* a, double scale) {
  bool finite = true;
  const int32_t rc = attnkit_abi::guarded([&] {
    auto ptr = [&](int i) { return reinterpret_cast<void*>(static_cast<intptr_t>(a[i])); };
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
    const at::Tensor tq = at::view(ptr(0), {B, H, L, Dk});
    at::Tensor tk = at::view(ptr(1), {B, Hkv, S, Dk});
    at::Tensor tv = at::view(ptr(2), {B, Hkv, S, Dv});
    for (int d = 0; d < 4; ++d) {
      tk.st[d] = kst[d];
      tv.st[d] = vst[d];
    }
    const at::Tensor tlo = at::view(ptr(3), {lo_rows, lo_cols});
    const at::Tensor thi = at::view(ptr(4), {lo_rows, lo_cols});
    at::Tensor to = at::view(ptr(5), {B, H, L, Dv});
    at::Tensor tl = at::view(ptr(6), {B, H, L});
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
