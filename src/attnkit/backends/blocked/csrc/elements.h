// attnkit's C++ kernels' element types (row_span.cpp, decode.cpp; builds.source_text puts this
// text before each): what q, k, v (and out, dout) are stored as, and their loads as float32.
// bfloat16 -> float32 is a 16-bit shift; float16 -> float32 is F16C's vcvtph2ps (built with
// -mf16c only where the CPU has it: float16 is not served otherwise).
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace attnkit_elements {

enum class Dt { F32, BF16, F16 };
template <Dt E>
using elem_t = typename std::conditional<E == Dt::F32, float, uint16_t>::type;

// 8 elements at p as float32
template <Dt E>
static inline __m256 load8(const elem_t<E>* p) {
  if constexpr (E == Dt::F32) {
    return _mm256_loadu_ps(p);
  } else if constexpr (E == Dt::BF16) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
  } else {
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    static_assert(E != Dt::F16, "float16 needs F16C");
    return _mm256_setzero_ps();
#endif
  }
}

// one element at p as float32
template <Dt E>
static inline float load1(const elem_t<E>* p) {
  if constexpr (E == Dt::F32) {
    return *p;
  } else if constexpr (E == Dt::BF16) {
    const uint32_t u = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  } else {
#ifdef __F16C__
    return _cvtsh_ss(*p);
#else
    return 0.0f;
#endif
  }
}

// whether the n elements at p are all finite (no NaN, no inf): an exponent field of all ones
// is either; read as integers, so the loop vectorises for every element type
template <Dt E>
static inline bool all_finite(const elem_t<E>* p, int64_t n) {
  if constexpr (E == Dt::F32) {
    const uint32_t* u = reinterpret_cast<const uint32_t*>(p);
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad |= (u[i] & 0x7F800000u) == 0x7F800000u;
    return bad == 0;
  } else {
    const uint16_t m = E == Dt::BF16 ? 0x7F80 : 0x7C00;  // bfloat16's, float16's exponent
    uint16_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad |= (p[i] & m) == m;
    return bad == 0;
  }
}

// one float32 as an element, rounded to nearest even (bfloat16: NaN -> 0x7FC0), as torch rounds
template <Dt E>
static inline void store1(elem_t<E>* p, float x) {
  if constexpr (E == Dt::F32) {
    *p = x;
  } else if constexpr (E == Dt::BF16) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    *p = std::isnan(x) ? uint16_t(0x7FC0)
                       : static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  } else {
#ifdef __F16C__
    *p = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  }
}

// 2^x for x <= 0 (clamped at -125), rel. error ~2.4e-7: degree-5 minimax
// polynomial on [-0.5, 0.5] (coefficients highest degree first; the 16-lane exp2_ps512 of the
// bf16 build shares them); 2^n applied by an integer add to the exponent.
static constexpr float kExp2Poly[6] = {0.0013276472454890609f, 0.009675541892647743f,
                                       0.05550713092088699f,   0.24022120237350464f,
                                       0.6931469440460205f,    1.0000001192092896f};
static inline __m256 exp2_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-125.0f));
  __m256i ni = _mm256_cvtps_epi32(x);  // round to nearest
  __m256 f = _mm256_sub_ps(x, _mm256_cvtepi32_ps(ni));
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  return _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(ni, 23)));
}

// the largest and the sum of 8 lanes
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

}  // namespace attnkit_elements
