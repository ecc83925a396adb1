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
#include <cmath>
#include <limits>
#include <vector>

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

// The backward: one task per (batch row, key/value head), its rows in turn, so that the task
// owns its dK and dV rows (no two threads add to one). a: q, k, v, idx, ok, out, dout, lse,
// dq, dk, dv addresses (0-10; out, dout, lse contiguous float32; dq (B, H, L, Dk), dk
// (B, Hkv, S, Dk), dv (B, Hkv, S, Dv) contiguous float32, zeroed by the caller); threads (11);
// B, H, L, Dk (12-15); Hkv, S, Dv (16-18); q's strides (19-22); k's (23-26); v's (27-30);
// idx heads (31), ok heads (32), k (33).
int32_t attnkit_gather_backward(const int64_t* a, double scale) {
  return attnkit_abi::guarded([&] {
    const float* q = attnkit_abi::arg<const float>(a, 0);
    const float* k = attnkit_abi::arg<const float>(a, 1);
    const float* v = attnkit_abi::arg<const float>(a, 2);
    const int64_t* idx = attnkit_abi::arg<const int64_t>(a, 3);
    const uint8_t* ok = attnkit_abi::arg<const uint8_t>(a, 4);
    const float* out = attnkit_abi::arg<const float>(a, 5);
    const float* dout = attnkit_abi::arg<const float>(a, 6);
    const float* lse = attnkit_abi::arg<const float>(a, 7);
    float* dq = attnkit_abi::arg<float>(a, 8);
    float* dk = attnkit_abi::arg<float>(a, 9);
    float* dv = attnkit_abi::arg<float>(a, 10);
    const int64_t nthreads = a[11], B = a[12], H = a[13], L = a[14], Dk = a[15];
    const int64_t Hkv = a[16], S = a[17], Dv = a[18];
    const int64_t *qs = a + 19, *ks = a + 23, *vs = a + 27;
    const int64_t IH = a[31], OH = a[32], K = a[33];
    ABI_CHECK(Hkv > 0 && H % Hkv == 0, "gather: H % Hkv != 0");
    ABI_CHECK(qs[3] == 1 && ks[3] == 1 && vs[3] == 1, "gather: q, k, v need a contiguous last dim");
    const int64_t g = H / Hkv, tasks = B * Hkv;
    const float sc = static_cast<float>(scale);
    const float ninf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for num_threads(static_cast<int>(nthreads > 0 ? nthreads : 1)) \
    schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t b = t / Hkv, hk = t % Hkv;
      const float* kb = k + b * ks[0] + hk * ks[1];
      const float* vb = v + b * vs[0] + hk * vs[1];
      float* dkb = dk + (b * Hkv + hk) * S * Dk;
      float* dvb = dv + (b * Hkv + hk) * S * Dv;
      for (int64_t r = 0; r < L; ++r) {
        const int64_t* ix = idx + ((b * IH + (IH > 1 ? hk : 0)) * L + r) * K;
        for (int64_t j = 0; j < g; ++j) {
          const int64_t h = hk * g + j, row = (b * H + h) * L + r;
          const float l = lse[row];
          if (l == ninf) continue;  // no key: gradient 0
          const uint8_t* okr = ok + ((b * OH + (OH > 1 ? h : 0)) * L + r) * K;
          const float* qp = q + b * qs[0] + h * qs[1] + r * qs[2];
          const float* op = out + row * Dv;
          const float* gp = dout + row * Dv;
          float* dqp = dq + row * Dk;
          float D = 0.0f;
#pragma omp simd reduction(+ : D)
          for (int64_t d = 0; d < Dv; ++d) D += gp[d] * op[d];
          for (int64_t i = 0; i < K; ++i) {
            if (!okr[i]) continue;
            const float* kp = kb + ix[i] * ks[2];
            const float* vp = vb + ix[i] * vs[2];
            float s = 0.0f, dp = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < Dk; ++d) s += qp[d] * kp[d];
#pragma omp simd reduction(+ : dp)
            for (int64_t d = 0; d < Dv; ++d) dp += gp[d] * vp[d];
            const float p = std::exp(s * sc - l);
            const float ds = p * (dp - D) * sc;
            float* dkp = dkb + ix[i] * Dk;
            float* dvp = dvb + ix[i] * Dv;
#pragma omp simd
            for (int64_t d = 0; d < Dk; ++d) {
              dqp[d] += ds * kp[d];
              dkp[d] += ds * qp[d];
            }
#pragma omp simd
            for (int64_t d = 0; d < Dv; ++d) dvp[d] += p * gp[d];
          }
        }
      }
    }
  });
}

}  // extern "C"
