// The gather kernel's backward rows (gather.cpp includes this after gather_rows.h; builds.py
// puts it in place of its #include line): the flash-attention backward on each query row's
// selected keys, from the saved out and lse. q, k, v, out, dout are elements (float32, or
// bfloat16 / float16 widened as they are loaded); P, dS and every sum are float32, and dK, dV
// are added into float32 rows (the caller's buffers), whatever the element type.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace gather {

// What the backward reads besides Rows: out, dout (elements, contiguous (B, H, L, Dv)) and
// lse (float32); dq (elements, contiguous (B, H, L, Dk)) is written.
struct Grads {
  const void *out, *dout;
  void* dq;
};

// one thread's float32 scratch of the backward: per head its q row, dout row, dq row, D and
// lse; a row's live entries (allowed for some head): positions, K and V rows; per group of four
// entries, each head's P and dS and whether the pair counts
struct BwdScratch {
  std::vector<float> qf, gf, dqf, D, l, p, ds;
  std::vector<uint8_t> use;
  std::vector<const uint8_t*> ok;  // each head's row of ok
  std::vector<int64_t> pos;
  std::vector<const void*> krow, vrow;
  Seen seen;
  BwdScratch(int64_t g, int64_t Dk, int64_t Dv, int64_t K, int64_t S)
      : qf(g * Dk), gf(g * Dv), dqf(g * Dk), D(g), l(g), p(g * 4), ds(g * 4), use(g * 4), ok(g),
        pos(K), krow(K), vrow(K), seen(S) {}
};

// Set up query row r's g heads (their ok rows, lse, q and dout rows as float32, D = dout . out,
// dq rows zeroed); whether any head has a key
template <Dt E>
static bool backward_heads(const Rows& P, const Grads& G, int64_t b, int64_t hk, int64_t r,
                           BwdScratch& w) {
  using T = elem_t<E>;
  const float ninf = -std::numeric_limits<float>::infinity();
  bool any = false;
  ok_rows(P, b, hk, r, w.ok);
  for (int64_t j = 0; j < P.g; ++j) {
    const int64_t h = hk * P.g + j, row = (b * P.H + h) * P.L + r;
    w.l[j] = P.lse[row];
    std::fill(w.dqf.begin() + j * P.Dk, w.dqf.begin() + (j + 1) * P.Dk, 0.0f);
    if (w.l[j] == ninf) continue;  // no key: gradient 0
    any = true;
    widen<E>(static_cast<const T*>(P.q) + b * P.qs[0] + h * P.qs[1] + r * P.qs[2], P.Dk, 1.0f,
             w.qf.data() + j * P.Dk);
    float* gf = w.gf.data() + j * P.Dv;
    widen<E>(static_cast<const T*>(G.dout) + row * P.Dv, P.Dv, 1.0f, gf);
    w.D[j] = dot<E>(gf, static_cast<const T*>(G.out) + row * P.Dv, P.Dv);
  }
  return any;
}

// Head j's P and dS of the c (<= 4) live entries from e0 (w.p, w.ds, w.use: 0 where the pair
// does not count), and its dq row += sum dS K
template <Dt E>
static void backward_head(const Rows& P, int64_t j, int64_t e0, int64_t c, BwdScratch& w) {
  using T = elem_t<E>;
  const T* const* kr = reinterpret_cast<const T* const*>(w.krow.data()) + e0;
  const T* const* vr = reinterpret_cast<const T* const*>(w.vrow.data()) + e0;
  const float* qf = w.qf.data() + j * P.Dk;
  const float* gf = w.gf.data() + j * P.Dv;
  alignas(16) float s[4], dp[4];
  if (c == 4) {
    _mm_store_ps(s, dot4<E>(qf, kr, P.Dk));
    _mm_store_ps(dp, dot4<E>(gf, vr, P.Dv));
  } else {
    for (int64_t e = 0; e < c; ++e) s[e] = dot<E>(qf, kr[e], P.Dk), dp[e] = dot<E>(gf, vr[e], P.Dv);
  }
  float* pj = w.p.data() + j * 4;
  float* dsj = w.ds.data() + j * 4;
  uint8_t* uj = w.use.data() + j * 4;
  const uint8_t* ok = w.ok[j];
  float* dq = w.dqf.data() + j * P.Dk;
  for (int64_t e = 0; e < c; ++e) {
    uj[e] = allowed(ok, w.pos[e0 + e]);
    pj[e] = uj[e] ? std::exp(s[e] * P.sc - w.l[j]) : 0.0f;
    dsj[e] = pj[e] * (dp[e] - w.D[j]) * P.sc;
    if (uj[e]) axpy<E>(dsj[e], kr[e], dq, P.Dk);  // a row the pair does not count is never read
  }
}

// Query rows r0 .. r1 - 1 of batch row b and key/value head hk, all g query heads: writes their
// dq rows and adds into dkb / dvb (float32: the S rows of dK and dV this task adds to). Each
// selected key's K and V rows are read once for the g heads (four keys at a time), and its dK
// and dV rows take the g heads' terms in turn while they are in cache; the rows kAhead entries
// on prefetched.
template <Dt E>
static void backward_rows(const Rows& P, const Grads& G, int64_t b, int64_t hk, int64_t r0,
                          int64_t r1, float* dkb, float* dvb, BwdScratch& w) {
  using T = elem_t<E>;
  const float ninf = -std::numeric_limits<float>::infinity();
  const T* kb = static_cast<const T*>(P.k) + b * P.ks[0] + hk * P.ks[1];
  const T* vb = static_cast<const T*>(P.v) + b * P.vs[0] + hk * P.vs[1];
  const int64_t kbytes = P.Dk * int64_t(sizeof(T)), vbytes = P.Dv * int64_t(sizeof(T));
  const int64_t* idx0 = P.idx + (b * P.IH + (P.IH > 1 ? hk : 0)) * P.L * P.K;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t* ix = idx0 + r * P.K;
    const int64_t m = !backward_heads<E>(P, G, b, hk, r, w)
                          ? 0
                          : live_entries<E>(P, ix, kb, vb, w.ok.data(), w.seen, 0, P.K,
                                            w.pos.data(), w.krow.data(), w.vrow.data());
    w.seen.clear(ix, P.K);
    for (int64_t e0 = 0; e0 < m; e0 += 4) {
      const int64_t c = std::min<int64_t>(4, m - e0);
      for (int64_t e = e0 + kAhead; e < std::min(e0 + kAhead + c, m); ++e) {
        prefetch_bytes(w.krow[e], kbytes);
        prefetch_bytes(w.vrow[e], vbytes);
        prefetch_bytes(dkb + ix[w.pos[e]] * P.Dk, P.Dk * 4);
        prefetch_bytes(dvb + ix[w.pos[e]] * P.Dv, P.Dv * 4);
      }
      for (int64_t j = 0; j < P.g; ++j) {
        if (w.l[j] != ninf) {
          backward_head<E>(P, j, e0, c, w);
        } else {
          std::fill(w.use.begin() + j * 4, w.use.begin() + j * 4 + 4, uint8_t(0));
        }
      }
      for (int64_t e = 0; e < c; ++e) {  // dK, dV rows of the entry: each head's terms
        float* dkp = dkb + ix[w.pos[e0 + e]] * P.Dk;
        float* dvp = dvb + ix[w.pos[e0 + e]] * P.Dv;
        for (int64_t j = 0; j < P.g; ++j) {
          if (!w.use[j * 4 + e]) continue;
          axpy<Dt::F32>(w.ds[j * 4 + e], w.qf.data() + j * P.Dk, dkp, P.Dk);
          axpy<Dt::F32>(w.p[j * 4 + e], w.gf.data() + j * P.Dv, dvp, P.Dv);
        }
      }
    }
    for (int64_t j = 0; j < P.g; ++j) {  // dq rows (0 where no key)
      T* dq = static_cast<T*>(G.dq) + ((b * P.H + hk * P.g + j) * P.L + r) * P.Dk;
      narrow<E>(w.dqf.data() + j * P.Dk, P.Dk, 1.0f, dq);
    }
  }
}

}  // namespace gather
