// attnkit's gather kernel (attnkit/backends/blocked/gather.py): the forward of attention over
// each query's own selected keys (attnkit.masks.selected_keys, DeepSeek-V3.2's top-k), float32.
//
// One task per (batch row, key/value head, query row): its k selected keys are read in place
// (K and V rows at their indices, any strides with a contiguous last dim; never gathered into
// a copy) for each of the g query heads of the key/value head: scores, their max, exp, sum and
// the weighted sum of the V rows, all in float32. `ok` (bool, 1 byte) says which of the k
// entries count (the index names a key once, and the spec's other rules allow the pair; made by
// gather.py), per query head or for every head. A row with no entry allowed gets out 0 and
// lse -inf. O(L * k * D) work, memory O(1) per task besides out and lse.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// What the backward's row loop reads (see attnkit_gather_backward for the layout).
struct Backward {
  const float *q, *k, *v;
  const int64_t* idx;
  const uint8_t* ok;
  const float *out, *dout, *lse;
  float* dq;
  int64_t H, L, Dk, Dv, Hkv, IH, OH, K, g;
  const int64_t *qs, *ks, *vs;
  float sc;
};

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

// Query rows r0 .. r1 - 1 of batch row b and key/value head hk, each of its g query heads:
// adds into their dq rows and into dkb / dvb (the S rows of dK and dV this call adds to).
void backward_rows(const Backward& P, int64_t b, int64_t hk, int64_t r0, int64_t r1, float* dkb,
                   float* dvb) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const float* kb = P.k + b * P.ks[0] + hk * P.ks[1];
  const float* vb = P.v + b * P.vs[0] + hk * P.vs[1];
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t* ix = P.idx + ((b * P.IH + (P.IH > 1 ? hk : 0)) * P.L + r) * P.K;
    for (int64_t j = 0; j < P.g; ++j) {
      const int64_t h = hk * P.g + j, row = (b * P.H + h) * P.L + r;
      const float l = P.lse[row];
      if (l == ninf) continue;  // no key: gradient 0
      const uint8_t* okr = P.ok + ((b * P.OH + (P.OH > 1 ? h : 0)) * P.L + r) * P.K;
      const float* qp = P.q + b * P.qs[0] + h * P.qs[1] + r * P.qs[2];
      const float* op = P.out + row * P.Dv;
      const float* gp = P.dout + row * P.Dv;
      float* dqp = P.dq + row * P.Dk;
      float D = 0.0f;
#pragma omp simd reduction(+ : D)
      for (int64_t d = 0; d < P.Dv; ++d) D += gp[d] * op[d];
      for (int64_t i = 0; i < P.K; ++i) {
        if (!okr[i]) continue;
        const float* kp = kb + ix[i] * P.ks[2];
        const float* vp = vb + ix[i] * P.vs[2];
        float s = 0.0f, dp = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < P.Dk; ++d) s += qp[d] * kp[d];
#pragma omp simd reduction(+ : dp)
        for (int64_t d = 0; d < P.Dv; ++d) dp += gp[d] * vp[d];
        const float p = std::exp(s * P.sc - l);
        const float ds = p * (dp - D) * P.sc;
        float* dkp = dkb + ix[i] * P.Dk;
        float* dvp = dvb + ix[i] * P.Dv;
#pragma omp simd
        for (int64_t d = 0; d < P.Dk; ++d) {
          dqp[d] += ds * kp[d];
          dkp[d] += ds * qp[d];
        }
#pragma omp simd
        for (int64_t d = 0; d < P.Dv; ++d) dvp[d] += p * gp[d];
      }
    }
  }
}

}  // namespace

extern "C" {

const char* attnkit_last_error() { return attnkit_abi::last_error().c_str(); }

int32_t attnkit_low_dtypes() { return 0; }  // float32 only

// a: q, k, v, idx (int64), ok (bool), out, lse (float32, contiguous) addresses (0-6); threads
// (7); B, H, L, Dk (8-11); Hkv, S, Dv (12-14); q's strides (15-18); k's (19-22); v's (23-26);
// idx heads (27: 1 or Hkv), ok heads (28: 1 or H), k selected per row (29). Returns 0, 1 on
// an error (attnkit_last_error), 2 where a query, a score of an allowed pair or an output was
// not finite (the dispatcher then runs its exact rule for NaN and inf).
int32_t attnkit_gather_forward(const int64_t* a, double scale) {
  int bad = 0;
  const int32_t rc = attnkit_abi::guarded([&] {
    const float* q = attnkit_abi::arg<const float>(a, 0);
    const float* k = attnkit_abi::arg<const float>(a, 1);
    const float* v = attnkit_abi::arg<const float>(a, 2);
    const int64_t* idx = attnkit_abi::arg<const int64_t>(a, 3);
    const uint8_t* ok = attnkit_abi::arg<const uint8_t>(a, 4);
    float* out = attnkit_abi::arg<float>(a, 5);
    float* lse = attnkit_abi::arg<float>(a, 6);
    const int64_t nthreads = a[7], B = a[8], H = a[9], L = a[10], Dk = a[11];
    const int64_t Hkv = a[12], Dv = a[14];
    const int64_t *qs = a + 15, *ks = a + 19, *vs = a + 23;
    const int64_t IH = a[27], OH = a[28], K = a[29];
    ABI_CHECK(Hkv > 0 && H % Hkv == 0, "gather: H % Hkv != 0");
    ABI_CHECK(qs[3] == 1 && ks[3] == 1 && vs[3] == 1, "gather: q, k, v need a contiguous last dim");
    const int64_t g = H / Hkv, tasks = B * Hkv * L;
    const float sc = static_cast<float>(scale);
    const float ninf = -std::numeric_limits<float>::infinity();
#pragma omp parallel num_threads(static_cast<int>(nthreads > 0 ? nthreads : 1))
    {
      std::vector<float> s(static_cast<size_t>(K > 0 ? K : 1));
#pragma omp for schedule(dynamic, 8)
      for (int64_t t = 0; t < tasks; ++t) {
        const int64_t b = t / (Hkv * L), hk = (t / L) % Hkv, r = t % L;
        const int64_t* ix = idx + ((b * IH + (IH > 1 ? hk : 0)) * L + r) * K;
        const float* kb = k + b * ks[0] + hk * ks[1];
        const float* vb = v + b * vs[0] + hk * vs[1];
        for (int64_t j = 0; j < g; ++j) {
          const int64_t h = hk * g + j;
          const uint8_t* okr = ok + ((b * OH + (OH > 1 ? h : 0)) * L + r) * K;
          const float* qp = q + b * qs[0] + h * qs[1] + r * qs[2];
          float* op = out + ((b * H + h) * L + r) * Dv;
          float qsum = 0.0f;
#pragma omp simd reduction(+ : qsum)
          for (int64_t d = 0; d < Dk; ++d) qsum += qp[d] * 0.0f;  // NaN where q is not finite
          bool row_ok = qsum == 0.0f;
          float m = ninf;
          for (int64_t i = 0; i < K; ++i) {
            if (!okr[i]) {
              s[i] = ninf;
              continue;
            }
            const float* kp = kb + ix[i] * ks[2];
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < Dk; ++d) acc += qp[d] * kp[d];
            s[i] = acc * sc;
            row_ok = row_ok && std::isfinite(s[i]);
            m = s[i] > m ? s[i] : m;
          }
          for (int64_t d = 0; d < Dv; ++d) op[d] = 0.0f;
          if (m == ninf) {
            lse[(b * H + h) * L + r] = ninf;
            if (!row_ok) {
#pragma omp atomic write
              bad = 1;
            }
            continue;
          }
          float sum = 0.0f;
          for (int64_t i = 0; i < K; ++i) {
            if (s[i] == ninf) continue;
            const float p = std::exp(s[i] - m);
            sum += p;
            const float* vp = vb + ix[i] * vs[2];
#pragma omp simd
            for (int64_t d = 0; d < Dv; ++d) op[d] += p * vp[d];
          }
          const float inv = 1.0f / sum;
          float osum = 0.0f;
          for (int64_t d = 0; d < Dv; ++d) {
            op[d] *= inv;
            osum += op[d] * 0.0f;
          }
          lse[(b * H + h) * L + r] = m + std::log(sum);
          if (!(row_ok && osum == 0.0f)) {
#pragma omp atomic write
            bad = 1;
          }
        }
      }
    }
  });
  return rc != 0 ? rc : (bad ? 2 : 0);
}

// The backward, parallel over (batch row, key/value head, slice of query rows): each slice
// adds its dK and dV rows into a buffer of its own (the first slice of a head into dk/dv, the
// others into zeroed scratch of S rows each), so that no two threads add to one row; the
// scratch is then summed into dk/dv, parallel over key rows. One slice per head where there
// are as many heads as threads (a[34] = 0: chosen here, n > 0: n slices). a: q, k, v, idx,
// ok, out, dout, lse, dq, dk, dv addresses (0-10; out, dout, lse contiguous float32; dq
// (B, H, L, Dk), dk (B, Hkv, S, Dk), dv (B, Hkv, S, Dv) contiguous float32, zeroed by the
// caller); threads (11); B, H, L, Dk (12-15); Hkv, S, Dv (16-18); q's strides (19-22); k's
// (23-26); v's (27-30); idx heads (31), ok heads (32), k (33); slices of rows per head (34).
int32_t attnkit_gather_backward(const int64_t* a, double scale) {
  return attnkit_abi::guarded([&] {
    Backward P;
    P.q = attnkit_abi::arg<const float>(a, 0);
    P.k = attnkit_abi::arg<const float>(a, 1);
    P.v = attnkit_abi::arg<const float>(a, 2);
    P.idx = attnkit_abi::arg<const int64_t>(a, 3);
    P.ok = attnkit_abi::arg<const uint8_t>(a, 4);
    P.out = attnkit_abi::arg<const float>(a, 5);
    P.dout = attnkit_abi::arg<const float>(a, 6);
    P.lse = attnkit_abi::arg<const float>(a, 7);
    P.dq = attnkit_abi::arg<float>(a, 8);
    float* dk = attnkit_abi::arg<float>(a, 9);
    float* dv = attnkit_abi::arg<float>(a, 10);
    const int64_t nthreads = a[11] > 0 ? a[11] : 1, B = a[12];
    P.H = a[13], P.L = a[14], P.Dk = a[15], P.Hkv = a[16], P.Dv = a[18];
    const int64_t S = a[17];
    P.qs = a + 19, P.ks = a + 23, P.vs = a + 27;
    P.IH = a[31], P.OH = a[32], P.K = a[33];
    ABI_CHECK(P.Hkv > 0 && P.H % P.Hkv == 0, "gather: H % Hkv != 0");
    ABI_CHECK(P.qs[3] == 1 && P.ks[3] == 1 && P.vs[3] == 1,
              "gather: q, k, v need a contiguous last dim");
    P.g = P.H / P.Hkv;
    P.sc = static_cast<float>(scale);
    const int64_t heads = B * P.Hkv, row = S * (P.Dk + P.Dv);
    const int64_t split = row_slices(a[34], nthreads, heads, P.L, row);
    std::vector<float> scratch(static_cast<size_t>(heads * (split - 1) * row), 0.0f);
#pragma omp parallel for num_threads(static_cast<int>(nthreads)) schedule(dynamic, 1)
    for (int64_t t = 0; t < heads * split; ++t) {
      const int64_t w = t / split, c = t % split;
      float* dkb = c == 0 ? dk + w * S * P.Dk : scratch.data() + (w * (split - 1) + c - 1) * row;
      float* dvb = c == 0 ? dv + w * S * P.Dv : dkb + S * P.Dk;
      backward_rows(P, w / P.Hkv, w % P.Hkv, P.L * c / split, P.L * (c + 1) / split, dkb, dvb);
    }
    if (split > 1) {
#pragma omp parallel for num_threads(static_cast<int>(nthreads)) schedule(static)
      for (int64_t r = 0; r < heads * S; ++r) {
        const int64_t w = r / S, s = r % S;
        for (int64_t c = 1; c < split; ++c) {
          const float* part = scratch.data() + (w * (split - 1) + c - 1) * row;
          float* dkp = dk + r * P.Dk;
          float* dvp = dv + r * P.Dv;
          const float* pk = part + s * P.Dk;
          const float* pv = part + S * P.Dk + s * P.Dv;
#pragma omp simd
          for (int64_t d = 0; d < P.Dk; ++d) dkp[d] += pk[d];
#pragma omp simd
          for (int64_t d = 0; d < P.Dv; ++d) dvp[d] += pv[d];
        }
      }
    }
  });
}

}  // extern "C"
