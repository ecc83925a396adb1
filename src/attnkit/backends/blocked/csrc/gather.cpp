// attnkit's gather kernel (attnkit/backends/blocked/gather.py): attention over each query's own
// selected keys (attnkit.masks.selected_keys, DeepSeek-V3.2's top-k), forward and backward.
// q, k, v (and out, dout, dq, dk, dv) are float32, or bfloat16 / float16 read in place: widened
// to float32 in registers as they are loaded (bfloat16 a 16-bit shift; float16 F16C's
// vcvtph2ps, in a build with -mf16c only), everything inside float32, the results written in
// the input dtype (rounded to nearest even). The dtype is chosen at run time (its code, abi.h).
//
// Forward: one task per (batch row, key/value head, query row): its k selected keys are read in
// place (K and V rows at their indices, any strides with a contiguous last dim; never gathered
// into a copy), each K and V row once for the g query heads of the key/value head, in blocks of
// keys (gather_rows.h: the live entries, their scores four keys at a time, an online-softmax
// step, P V with the output in registers), the rows of keys further on prefetched; vector
// helpers in gather_simd.h, the backward's rows in gather_backward.h. An entry counts where it
// names a key (not -1), the first time in its row (a key listed twice counts once: a bit per
// key, per thread), and where `ok` (bool, 1 byte; made by gather.py from the spec's other rules, per
// query head or for every head; none where the spec has no other rules) allows the pair. A row
// with no entry counting gets out 0 and lse -inf. O(L * k * D) work, memory O(g * D + S / 8)
// bytes per thread besides out and lse.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "gather_simd.h"
#include "gather_rows.h"
#include "gather_backward.h"

namespace {

using attnkit_elements::Dt;

// How many slices of query rows each of `heads` (batch row, key/value head) pairs runs in:
// `asked` where > 0, else enough slices to give every thread one (1 where there are as many
// heads as threads), at least 16 rows each, and scratch (slices - 1 buffers of S rows of dK
// and dV per head, `row` floats) of at most 256 MiB.
int64_t row_slices(int64_t asked, int64_t nthreads, int64_t heads, int64_t L, int64_t row) {
  int64_t n = asked > 0 ? asked : (heads >= nthreads ? 1 : (nthreads + heads - 1) / heads);
  if (asked <= 0) n = std::min(n, std::max<int64_t>(L / 16, 1));
  n = std::max<int64_t>(std::min(n, std::max<int64_t>(L, 1)), 1);
  const int64_t budget = (int64_t{256} << 20) / 4;
  while (asked <= 0 && n > 1 && heads * (n - 1) * row > budget) --n;
  return n;
}

// The dtype code a[i] as checked: float32, bfloat16, or float16 in a build with F16C.
int64_t dtype_code(int64_t code) {
  ABI_CHECK(code == attnkit_abi::F32 || code == attnkit_abi::BF16 ||
                (code == attnkit_abi::F16 && (attnkit_abi::low_dtype_bits() & 2)),
            "gather: dtype not supported by this build");
  return code;
}

// The forward's tasks on `nthreads` threads; whether everything it read and wrote was finite.
template <Dt E>
bool forward_all(const gather::Rows& P, void* out, int64_t tasks, int64_t nthreads) {
  int bad = 0;
#pragma omp parallel num_threads(static_cast<int>(nthreads > 0 ? nthreads : 1))
  {
    gather::FwdScratch w(P.g, P.Dk, P.Dv, P.S);
    bool mine = true;
#pragma omp for schedule(dynamic, 8)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t b = t / (P.Hkv * P.L), hk = (t / P.L) % P.Hkv, r = t % P.L;
      mine = gather::forward_task<E>(P, static_cast<attnkit_elements::elem_t<E>*>(out), b, hk,
                                     r, w) &&
             mine;
    }
    if (!mine) {
#pragma omp atomic write
      bad = 1;
    }
  }
  return bad == 0;
}

// The backward's sizes: the slices of query rows per head (split) and the float32 dK/dV buffers
// its tasks add into (`first`: slice 0's, where it does not add into dk/dv themselves).
struct Plan {
  int64_t heads, split, row, S, nthreads;
  bool first;  // slice 0 adds into scratch too (dk/dv are not float32)
};

// dK/dV rows of buffer c (0 .. split - 1) of head w: dk/dv themselves for slice 0 of a float32
// call, else scratch
float* buffer(const Plan& Q, float* dk, float* scratch, int64_t w, int64_t c, int64_t Dk) {
  if (c == 0 && !Q.first) return dk + w * Q.S * Dk;
  const int64_t slot = Q.first ? w * Q.split + c : w * (Q.split - 1) + c - 1;
  return scratch + slot * Q.row;
}

// Sum each key row's slices into dk/dv (float32), or into the dtype's dk/dv where `first`.
template <Dt E>
void sum_slices(const Plan& Q, float* scratch, void* dk, void* dv, int64_t Dk, int64_t Dv) {
  using T = attnkit_elements::elem_t<E>;
#pragma omp parallel num_threads(static_cast<int>(Q.nthreads)) if (Q.heads * Q.S > 64)
  {
    std::vector<float> sk(Dk), sv(Dv);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < Q.heads * Q.S; ++r) {
      const int64_t w = r / Q.S, s = r % Q.S;
      T* dkp = static_cast<T*>(dk) + r * Dk;
      T* dvp = static_cast<T*>(dv) + r * Dv;
      if (Q.first) {
        std::fill(sk.begin(), sk.end(), 0.0f);
        std::fill(sv.begin(), sv.end(), 0.0f);
      } else {
        std::copy(reinterpret_cast<const float*>(dkp), reinterpret_cast<const float*>(dkp) + Dk,
                  sk.begin());
        std::copy(reinterpret_cast<const float*>(dvp), reinterpret_cast<const float*>(dvp) + Dv,
                  sv.begin());
      }
      for (int64_t c = Q.first ? 0 : 1; c < Q.split; ++c) {
        const float* part = buffer(Q, nullptr, scratch, w, c, Dk);
        gather::axpy<Dt::F32>(1.0f, part + s * Dk, sk.data(), Dk);
        gather::axpy<Dt::F32>(1.0f, part + Q.S * Dk + s * Dv, sv.data(), Dv);
      }
      gather::narrow<E>(sk.data(), Dk, 1.0f, dkp);
      gather::narrow<E>(sv.data(), Dv, 1.0f, dvp);
    }
  }
}

// The backward's tasks: (head, slice) pairs, each adding into a dK/dV buffer of its own, zeroed
// by the task first; then the slices summed (and written in the dtype) where there is more than
// one buffer, or where the dtype is not float32.
template <Dt E>
void backward_all(const gather::Rows& P, const gather::Grads& G, const Plan& Q, void* dk,
                  void* dv) {
  const int64_t buffers = Q.heads * (Q.first ? Q.split : Q.split - 1);
  std::unique_ptr<float[]> scratch(new float[static_cast<size_t>(buffers * Q.row)]);
  float* fdk = Q.first ? nullptr : static_cast<float*>(dk);
  float* fdv = Q.first ? nullptr : static_cast<float*>(dv);
#pragma omp parallel num_threads(static_cast<int>(Q.nthreads))
  {
    gather::BwdScratch w(P.g, P.Dk, P.Dv, P.K, P.S);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < Q.heads * Q.split; ++t) {
      const int64_t h = t / Q.split, c = t % Q.split;
      float* dkb = buffer(Q, fdk, scratch.get(), h, c, P.Dk);
      float* dvb = c == 0 && !Q.first ? fdv + h * Q.S * P.Dv : dkb + Q.S * P.Dk;
      std::fill(dkb, dkb + Q.S * P.Dk, 0.0f);
      std::fill(dvb, dvb + Q.S * P.Dv, 0.0f);
      gather::backward_rows<E>(P, G, h / P.Hkv, h % P.Hkv, P.L * c / Q.split,
                               P.L * (c + 1) / Q.split, dkb, dvb, w);
    }
  }
  if (Q.first || Q.split > 1) sum_slices<E>(Q, scratch.get(), dk, dv, P.Dk, P.Dv);
}

// The sizes and strides both entries share, from s = their "B" slot (the forward's 8, the
// backward's 12): B, H, L, Dk, Hkv, S, Dv, q's, k's and v's strides, idx heads, ok heads, k
// selected per row; checked, with the head group and the scale set. Returns B.
int64_t read_sizes(gather::Rows& P, const int64_t* s, double scale) {
  const int64_t B = s[0];
  P.H = s[1], P.L = s[2], P.Dk = s[3], P.Hkv = s[4], P.S = s[5], P.Dv = s[6];
  P.qs = s + 7, P.ks = s + 11, P.vs = s + 15;
  P.IH = s[19], P.OH = s[20], P.K = s[21];
  ABI_CHECK(P.Hkv > 0 && P.H % P.Hkv == 0, "gather: H % Hkv != 0");
  ABI_CHECK(P.qs[3] == 1 && P.ks[3] == 1 && P.vs[3] == 1,
            "gather: q, k, v need a contiguous last dim");
  P.g = P.H / P.Hkv;
  P.sc = static_cast<float>(scale);
  return B;
}

}  // namespace

extern "C" {

const char* attnkit_last_error() { return attnkit_abi::last_error().c_str(); }

// bit 0: reads bfloat16; bit 1: reads float16 (built with F16C)
int32_t attnkit_low_dtypes() { return attnkit_abi::low_dtype_bits(); }

// a: q, k, v, idx (int64, -1: no key; < S, as checked by the caller), ok (bool, or 0), out
// (q's dtype), lse (float32; both contiguous) addresses (0-6); threads (7); B, H, L, Dk (8-11);
// Hkv, S, Dv (12-14); q's strides (15-18); k's (19-22); v's (23-26); idx heads (27: 1 or Hkv),
// ok heads (28: 1 or H; 0 where ok is 0: every pair allowed), k selected per row
// (29); the dtype code of q, k, v, out (30). Returns 0, 1 on an error (attnkit_last_error), 2
// where a query, a score of an allowed pair or an output was not finite (the dispatcher then
// runs its exact rule for NaN and inf).
int32_t attnkit_gather_forward(const int64_t* a, double scale) {
  bool finite = true;
  const int32_t rc = attnkit_abi::guarded([&] {
    gather::Rows P;
    P.q = attnkit_abi::arg(a, 0), P.k = attnkit_abi::arg(a, 1), P.v = attnkit_abi::arg(a, 2);
    P.idx = attnkit_abi::arg<const int64_t>(a, 3);
    P.ok = attnkit_abi::arg<const uint8_t>(a, 4);
    void* out = attnkit_abi::arg(a, 5);
    P.lse = attnkit_abi::arg<float>(a, 6);
    const int64_t nthreads = a[7], B = read_sizes(P, a + 8, scale);
    const int64_t dtype = dtype_code(a[30]);
    const int64_t tasks = B * P.Hkv * P.L;
    if (dtype == attnkit_abi::BF16) {
      finite = forward_all<Dt::BF16>(P, out, tasks, nthreads);
#ifdef __F16C__
    } else if (dtype == attnkit_abi::F16) {
      finite = forward_all<Dt::F16>(P, out, tasks, nthreads);
#endif
    } else {
      finite = forward_all<Dt::F32>(P, out, tasks, nthreads);
    }
  });
  return rc != 0 ? rc : (finite ? 0 : 2);
}

// The backward, parallel over (batch row, key/value head, slice of query rows): each slice
// adds its dK and dV rows into a float32 buffer of its own (for float32 the first slice of a
// head into dk/dv, the others into scratch of S rows each; for bfloat16/float16 every slice into
// scratch), so that no two threads add to one row; the buffers are then summed into dk/dv (and
// written in the dtype), parallel over key rows. One slice per head where there are as many
// heads as threads (a[34] = 0: chosen here, n > 0: n slices). a: q, k, v, idx, ok (as the
// forward's), out, dout, lse, dq, dk, dv addresses (0-10; out, dout contiguous in the dtype, lse float32; dq
// (B, H, L, Dk), dk (B, Hkv, S, Dk), dv (B, Hkv, S, Dv) contiguous in the dtype, written here);
// threads (11); B, H, L, Dk (12-15); Hkv, S, Dv (16-18); q's strides (19-22); k's (23-26); v's
// (27-30); idx heads (31), ok heads (32), k (33); slices of rows per head (34); the dtype code
// (35).
int32_t attnkit_gather_backward(const int64_t* a, double scale) {
  return attnkit_abi::guarded([&] {
    gather::Rows P;
    gather::Grads G;
    P.q = attnkit_abi::arg(a, 0), P.k = attnkit_abi::arg(a, 1), P.v = attnkit_abi::arg(a, 2);
    P.idx = attnkit_abi::arg<const int64_t>(a, 3);
    P.ok = attnkit_abi::arg<const uint8_t>(a, 4);
    G.out = attnkit_abi::arg(a, 5), G.dout = attnkit_abi::arg(a, 6);
    P.lse = attnkit_abi::arg<float>(a, 7);
    G.dq = attnkit_abi::arg(a, 8);
    void* dk = attnkit_abi::arg(a, 9);
    void* dv = attnkit_abi::arg(a, 10);
    const int64_t nthreads = a[11] > 0 ? a[11] : 1, B = read_sizes(P, a + 12, scale);
    const int64_t dtype = dtype_code(a[35]);
    Plan Q;
    Q.heads = B * P.Hkv, Q.S = P.S, Q.row = Q.S * (P.Dk + P.Dv), Q.nthreads = nthreads;
    Q.first = dtype != attnkit_abi::F32;
    Q.split = row_slices(a[34], nthreads, Q.heads, P.L, Q.row);
    if (dtype == attnkit_abi::BF16) {
      backward_all<Dt::BF16>(P, G, Q, dk, dv);
#ifdef __F16C__
    } else if (dtype == attnkit_abi::F16) {
      backward_all<Dt::F16>(P, G, Q, dk, dv);
#endif
    } else {
      backward_all<Dt::F32>(P, G, Q, dk, dv);
    }
  });
}

}  // extern "C"
