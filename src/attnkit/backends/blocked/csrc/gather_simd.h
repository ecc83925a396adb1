// The gather kernel's vector helpers (gather.cpp includes this; builds.py puts it in place of
// its #include line): loads of q, k, v rows as float32 (elements.h: float32, and bfloat16 /
// float16 widened in registers as they are loaded), dot products, row updates and stores back
// in the element type, in 256-bit registers (AVX2 + FMA).
#include <cmath>
#include <cstdint>

namespace gather {

using namespace attnkit_elements;

// the cache level rows are prefetched into (-D at build time to measure another): L2 (T1).
// Into L1 (T0), a decode step against a 32768-key cache took twice as long (docs/benchmarks.md):
// the rows of 16 entries ahead (up to 16 KiB of K and V, and in the backward as much of dK and
// dV) crowd L1 and its miss queue, where L2 holds them and has room for more requests in flight
#ifndef GATHER_PF_HINT
#define GATHER_PF_HINT _MM_HINT_T1
#endif

// bring the `bytes` at p (any alignment) into the cache
static inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, GATHER_PF_HINT);
  _mm_prefetch(c + bytes - 1, GATHER_PF_HINT);
}

// out[d] = x[d] * c for the n elements at x, as float32
template <Dt E>
static inline void widen(const elem_t<E>* x, int64_t n, float c, float* out) {
  const __m256 cv = _mm256_set1_ps(c);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(load8<E>(x + d), cv));
  for (; d < n; ++d) out[d] = load1<E>(x + d) * c;
}

// sum_d a[d] * x[d]: a float32, x elements (two accumulators, for the FMA latency)
template <Dt E>
static inline float dot(const float* a, const elem_t<E>* x, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8<E>(x + d), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), load8<E>(x + d + 8), s1);
  }
  if (d + 8 <= n) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8<E>(x + d), s0);
    d += 8;
  }
  float t = hsum(_mm256_add_ps(s0, s1));
  for (; d < n; ++d) t += a[d] * load1<E>(x + d);
  return t;
}

// acc[d] += p * x[d] for the n elements at x (float32 acc)
template <Dt E>
static inline void axpy(float p, const elem_t<E>* x, float* acc, int64_t n) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, load8<E>(x + d), _mm256_loadu_ps(acc + d)));
  for (; d < n; ++d) acc[d] += p * load1<E>(x + d);
}

// [q . x0, q . x1, q . x2, q . x3] for the four rows x[0..4): q float32, the rows elements;
// each chunk of q loaded once for the four
template <Dt E>
static inline __m128 dot4(const float* q, const elem_t<E>* const* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const __m256 u = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(u, load8<E>(x[0] + d), a0);
    a1 = _mm256_fmadd_ps(u, load8<E>(x[1] + d), a1);
    a2 = _mm256_fmadd_ps(u, load8<E>(x[2] + d), a2);
    a3 = _mm256_fmadd_ps(u, load8<E>(x[3] + d), a3);
  }
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  if (d < n) {
    alignas(16) float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int c = 0; c < 4; ++c)
      for (int64_t e = d; e < n; ++e) t[c] += q[e] * load1<E>(x[c] + e);
    s = _mm_add_ps(s, _mm_load_ps(t));
  }
  return s;
}

// acc[d0 .. d0 + 8 NR) += sum_i p[i] x_i[d0 ..] over the n rows x[i] whose p[i] != 0, the
// accumulators in NR registers
template <Dt E, int NR>
static inline void pv_tile(const float* p, const elem_t<E>* const* x, int64_t n, int64_t d0,
                           float* acc) {
  __m256 a[NR];
  for (int r = 0; r < NR; ++r) a[r] = _mm256_loadu_ps(acc + d0 + 8 * r);
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] == 0.0f) continue;
    const __m256 pv = _mm256_set1_ps(p[i]);
    const elem_t<E>* xi = x[i] + d0;
    for (int r = 0; r < NR; ++r) a[r] = _mm256_fmadd_ps(pv, load8<E>(xi + 8 * r), a[r]);
  }
  for (int r = 0; r < NR; ++r) _mm256_storeu_ps(acc + d0 + 8 * r, a[r]);
}

// acc[0 .. Dv) += sum_i p[i] x_i over the n rows x[i] whose p[i] != 0 (tiles of up to 64
// columns held in registers across the rows)
template <Dt E>
static void pv(const float* p, const elem_t<E>* const* x, int64_t n, int64_t Dv, float* acc) {
  int64_t d = 0;
  for (; d + 64 <= Dv; d += 64) pv_tile<E, 8>(p, x, n, d, acc);
  switch ((Dv - d) / 8) {
    case 7: pv_tile<E, 7>(p, x, n, d, acc); break;
    case 6: pv_tile<E, 6>(p, x, n, d, acc); break;
    case 5: pv_tile<E, 5>(p, x, n, d, acc); break;
    case 4: pv_tile<E, 4>(p, x, n, d, acc); break;
    case 3: pv_tile<E, 3>(p, x, n, d, acc); break;
    case 2: pv_tile<E, 2>(p, x, n, d, acc); break;
    case 1: pv_tile<E, 1>(p, x, n, d, acc); break;
    default: break;
  }
  for (d += (Dv - d) / 8 * 8; d < Dv; ++d)
    for (int64_t i = 0; i < n; ++i)
      if (p[i] != 0.0f) acc[d] += p[i] * load1<E>(x[i] + d);
}

// the n float32 at x as elements at out, each times c; whether they were all finite
template <Dt E>
static inline bool narrow(const float* x, int64_t n, float c, elem_t<E>* out) {
  float z = 0.0f;
  for (int64_t d = 0; d < n; ++d) {
    const float y = x[d] * c;
    z += y * 0.0f;  // NaN where y is not finite
    store1<E>(out + d, y);
  }
  return z == 0.0f;
}

}  // namespace gather
