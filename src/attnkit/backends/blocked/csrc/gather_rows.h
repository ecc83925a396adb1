// The gather kernel's row code (gather.cpp includes it; builds.py puts it in place of its
// #include line): one task's work of the forward and of the backward, for each element type
// (elements.h: float32, and bfloat16 / float16 widened to float32 in registers as they are
// loaded; everything inside is float32). K and V rows are read in place at their indices
// (any strides with a contiguous last dim), the rows of the next keys prefetched while the
// current ones are used: the keys are scattered, so the hardware's stride prefetcher cannot
// find them, and a task that waited on each row in turn would be bound by memory latency.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace gather {

using namespace attnkit_elements;

// the tuning knobs (-D at build time to measure others): keys per block of the forward (its
// scores, then their softmax step and P V; the block's V rows are prefetched by its score pass
// and read by its P V pass), and how many live entries ahead the K rows (in the backward also
// the V, dK and dV rows) are prefetched (4 to 64 measured alike here; gather_simd.h: into L2)
#ifndef GATHER_BLOCK_KEYS
#define GATHER_BLOCK_KEYS 64
#endif
#ifndef GATHER_PF_KEYS
#define GATHER_PF_KEYS 16
#endif
constexpr int64_t kBlock = GATHER_BLOCK_KEYS;
constexpr int64_t kAhead = GATHER_PF_KEYS;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// What a task reads (attnkit_gather_forward / _backward say the layout): q, k, v and (the
// backward) out, dout as elements; idx int64 (B, IH, L, K), -1 where an entry names no key; ok
// bool (B, OH, L, K): whether the spec's other rules allow the pair (OH = 0: no other rules).
struct Rows {
  const void *q, *k, *v;
  const int64_t* idx;
  const uint8_t* ok;
  float* lse;
  int64_t H, L, S, Dk, Dv, Hkv, IH, OH, K, g;
  const int64_t *qs, *ks, *vs;
  float sc;
};

// The keys of one row seen so far (a bit per key of the S; the words a row set are cleared
// after it, so a row costs O(k), whatever S): a key listed twice in a row counts once, at its
// first entry, as eager's scatter into a bool mask
struct Seen {
  std::vector<uint64_t> bits;
  explicit Seen(int64_t S) : bits(static_cast<size_t>((S + 63) / 64), 0) {}
  // whether key (0 <= key < S) is new to this row (and remember it)
  bool first(int64_t key) {
    uint64_t& w = bits[static_cast<size_t>(key >> 6)];
    const uint64_t b = uint64_t{1} << (key & 63);
    if (w & b) return false;
    w |= b;
    return true;
  }
  // forget the row's n entries ix
  void clear(const int64_t* ix, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
      if (ix[i] >= 0) bits[static_cast<size_t>(ix[i] >> 6)] = 0;
  }
};

// whether a head's row of ok allows entry i (no row: the spec has no other rules)
static inline bool allowed(const uint8_t* ok, int64_t i) { return ok == nullptr || ok[i] != 0; }

// each of the g heads' row of ok for query row r (nullptr where OH = 0: every pair allowed)
static inline void ok_rows(const Rows& P, int64_t b, int64_t hk, int64_t r,
                           std::vector<const uint8_t*>& ok) {
  for (int64_t j = 0; j < P.g; ++j) {
    const int64_t h = hk * P.g + j;
    ok[j] = P.OH == 0 ? nullptr : P.ok + ((b * P.OH + (P.OH > 1 ? h : 0)) * P.L + r) * P.K;
  }
}


// one thread's float32 scratch of the forward: q rows (g x Dk, times scale * log2 e), a block's
// scores then weights (g x kBlock), the output rows (g x Dv), each head's max and sum; the
// block's live entries (allowed for some head): their positions and K and V rows
struct FwdScratch {
  std::vector<float> qf, s, acc, m, l;
  std::vector<const uint8_t*> ok;  // each head's row of ok
  std::vector<int64_t> pos;
  std::vector<const void*> krow, vrow;
  Seen seen;
  FwdScratch(int64_t g, int64_t Dk, int64_t Dv, int64_t S)
      : qf(g * Dk), s(g * kBlock), acc(g * Dv), m(g), l(g), ok(g), pos(kBlock), krow(kBlock),
        vrow(kBlock), seen(S) {}
};

// The entries i0 .. i0 + n - 1 of a row that name a key not named before in the row (`seen`)
// and that some head may attend (`ok`: each head's row of ok): their positions, K rows and V
// rows, stored from pos, krow, vrow; how many
template <Dt E>
static int64_t live_entries(const Rows& P, const int64_t* ix, const elem_t<E>* kb,
                            const elem_t<E>* vb, const uint8_t* const* ok, Seen& seen, int64_t i0,
                            int64_t n, int64_t* pos, const void** krow, const void** vrow) {
  const int64_t heads = P.OH > 1 ? P.g : 1;
  int64_t m = 0;
  for (int64_t i = i0; i < i0 + n; ++i) {
    if (ix[i] < 0 || !seen.first(ix[i])) continue;  // no key, or a key named before
    bool any = false;
    for (int64_t j = 0; j < heads && !any; ++j) any = allowed(ok[j], i);
    if (!any) continue;
    pos[m] = i;
    krow[m] = kb + ix[i] * P.ks[2];
    vrow[m] = vb + ix[i] * P.vs[2];
    ++m;
  }
  return m;
}

// The scores of the m live entries of a block for each of the g heads (base-2 units, -inf where
// the entry does not count for the head), four keys at a time; the K rows of the entries kAhead
// positions on and the block's V rows prefetched. False where a score of an allowed pair was
// not finite.
template <Dt E>
static bool block_scores(const Rows& P, const int64_t* ix, const elem_t<E>* kb, int64_t m,
                         FwdScratch& w) {
  using T = elem_t<E>;
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t kbytes = P.Dk * int64_t(sizeof(T)), vbytes = P.Dv * int64_t(sizeof(T));
  const T* const* kr = reinterpret_cast<const T* const*>(w.krow.data());
  bool fine = true;
  for (int64_t i = 0; i < m; i += 4) {
    const int64_t c = std::min<int64_t>(4, m - i);
    for (int64_t e = i; e < i + c; ++e) {
      if (w.pos[e] + kAhead < P.K) prefetch_bytes(kb + ix[w.pos[e] + kAhead] * P.ks[2], kbytes);
      prefetch_bytes(w.vrow[e], vbytes);
    }
    for (int64_t j = 0; j < P.g; ++j) {
      float* s = w.s.data() + j * kBlock + i;
      const float* qf = w.qf.data() + j * P.Dk;
      if (c == 4) {
        _mm_storeu_ps(s, dot4<E>(qf, kr + i, P.Dk));
      } else {
        for (int64_t e = 0; e < c; ++e) s[e] = dot<E>(qf, kr[i + e], P.Dk);
      }
      for (int64_t e = 0; e < c; ++e) {
        if (!allowed(w.ok[j], w.pos[i + e])) {
          s[e] = ninf;
        } else {
          fine = fine && std::isfinite(s[e]);
        }
      }
    }
  }
  return fine;
}

// head j's online-softmax step over a block of n scores (w.s, turned into weights in place,
// 0 where the entry does not count): its max, sum and output rows rescaled where the max grew
static void block_softmax(FwdScratch& w, int64_t j, int64_t n, int64_t Dv) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float* s = w.s.data() + j * kBlock;
  float bm = ninf;
  for (int64_t i = 0; i < n; ++i) bm = s[i] > bm ? s[i] : bm;
  if (bm == ninf) {
    for (int64_t i = 0; i < n; ++i) s[i] = 0.0f;
    return;
  }
  float& m = w.m[j];
  if (bm > m) {
    if (m != ninf) {
      const float r = std::exp2(m - bm);
      w.l[j] *= r;
      float* acc = w.acc.data() + j * Dv;
      for (int64_t d = 0; d < Dv; ++d) acc[d] *= r;
    }
    m = bm;
  }
  const __m256 mv = _mm256_set1_ps(m), none = _mm256_set1_ps(ninf);
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(s + i);
    const __m256 live = _mm256_cmp_ps(x, none, _CMP_NEQ_OQ);  // false where -inf (or NaN)
    const __m256 p = _mm256_and_ps(exp2_ps(_mm256_sub_ps(x, mv)), live);
    _mm256_storeu_ps(s + i, p);
    sum = _mm256_add_ps(sum, p);
  }
  float t = hsum(sum);
  for (; i < n; ++i) {
    s[i] = s[i] == ninf ? 0.0f : std::exp2(std::max(s[i] - m, -125.0f));
    t += s[i];
  }
  w.l[j] += t;
}

// Forward of query row r of batch row b and key/value head hk, for its g query heads: out
// rows (elements) and lse (float32, natural log); false where a q element, a score of an allowed
// pair or an output element was not finite. A head with no entry allowed gets out 0, lse -inf.
template <Dt E>
static bool forward_task(const Rows& P, elem_t<E>* out, int64_t b, int64_t hk, int64_t r,
                         FwdScratch& w) {
  using T = elem_t<E>;
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t* ix = P.idx + ((b * P.IH + (P.IH > 1 ? hk : 0)) * P.L + r) * P.K;
  const T* kb = static_cast<const T*>(P.k) + b * P.ks[0] + hk * P.ks[1];
  const T* vb = static_cast<const T*>(P.v) + b * P.vs[0] + hk * P.vs[1];
  const int64_t g = P.g;
  bool fine = true;
  ok_rows(P, b, hk, r, w.ok);
  for (int64_t j = 0; j < g; ++j) {
    const int64_t h = hk * g + j;
    const T* qp = static_cast<const T*>(P.q) + b * P.qs[0] + h * P.qs[1] + r * P.qs[2];
    fine = fine && all_finite<E>(qp, P.Dk);
    widen<E>(qp, P.Dk, P.sc * kLog2e, w.qf.data() + j * P.Dk);
    w.m[j] = ninf;
    w.l[j] = 0.0f;
    std::fill(w.acc.begin() + j * P.Dv, w.acc.begin() + (j + 1) * P.Dv, 0.0f);
  }
  for (int64_t i0 = 0; i0 < P.K; i0 += kBlock) {
    const int64_t m = live_entries<E>(P, ix, kb, vb, w.ok.data(), w.seen, i0,
                                      std::min(kBlock, P.K - i0), w.pos.data(), w.krow.data(),
                                      w.vrow.data());
    fine = block_scores<E>(P, ix, kb, m, w) && fine;
    const T* const* vr = reinterpret_cast<const T* const*>(w.vrow.data());
    for (int64_t j = 0; j < g; ++j) {
      block_softmax(w, j, m, P.Dv);
      pv<E>(w.s.data() + j * kBlock, vr, m, P.Dv, w.acc.data() + j * P.Dv);
    }
  }
  w.seen.clear(ix, P.K);
  for (int64_t j = 0; j < g; ++j) {
    const int64_t row = (b * P.H + hk * g + j) * P.L + r;
    const bool dead = w.m[j] == ninf;
    P.lse[row] = dead ? ninf : w.m[j] * kLn2 + std::log(w.l[j]);
    const float inv = dead ? 0.0f : 1.0f / w.l[j];
    fine = narrow<E>(w.acc.data() + j * P.Dv, P.Dv, inv, out + row * P.Dv) && fine;
  }
  return fine;
}

}  // namespace gather
