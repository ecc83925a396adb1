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

#include "row_span_fp32_avx2.h"
#include "row_span_fp32_avx512.h"
#include "row_span_bf16dot.h"
#include "row_span_driver.h"

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
