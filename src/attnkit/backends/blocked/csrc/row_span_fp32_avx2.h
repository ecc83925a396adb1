// A part of row_span.cpp (the float32 micro-kernels in ymm registers (every build): bf16/fp16 rows in and out, the score modifiers (soft-cap, ALiBi, key holes), S = Q K^T and the products with P as 6 x 16 / 6 x 8 register tiles): text inside its namespace rowspan, put in place of its
// #include line by builds.source_text, so every build compiles one translation unit as before.

// bfloat16 bits of 8 floats, rounded to nearest even (NaN -> 0x7FC0), as torch rounds
static inline __m128i bf16_bits(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <Dt E>
static inline void store8(elem_t<E>* p, __m256 x) {
  if constexpr (E == Dt::F32) {
    _mm256_storeu_ps(p, x);
  } else if constexpr (E == Dt::BF16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits(x));
  } else {
#ifdef __F16C__
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  }
}


// dst[0..n) = src[0..n) * s as float32
template <Dt E>
static inline void load_row(const elem_t<E>* src, float* dst, int64_t n, float s = 1.0f) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(load8<E>(src + d), vs));
  for (; d < n; ++d) dst[d] = load1<E>(src + d) * s;
}

// dst[0..n) = src[0..n) * s in the element type
template <Dt E>
static inline void store_row(const float* src, elem_t<E>* dst, int64_t n, float s = 1.0f) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) store8<E>(dst + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), vs));
  for (; d < n; ++d) store1<E>(dst + d, src[d] * s);
}

constexpr int MR = 6;    // rows of a micro tile
constexpr int NR = 16;   // keys per packed K^T panel; output cols per PV tile
constexpr int MB = 48;   // query rows per block (multiple of MR)
constexpr int MBW = 96;  // the AVX-512 float32 build's: K panels and V rows read half as often

static const int32_t kMaskTbl[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                     0,  0,  0,  0,  0,  0,  0,  0};

static inline __m256 tail_mask(int rem) {  // first rem lanes set, 0<=rem<=8
  return _mm256_castsi256_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMaskTbl + 8 - rem)));
}



// tanh(y), relative error ~3e-7: an odd Taylor polynomial to y^11 below |y| = 0.3, above it
// (1 - e) / (1 + e) with e = exp(-2|y|) < 0.55 (exp2_ps), so the difference does not cancel.
static inline __m256 tanh_ps(__m256 y) {
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  const __m256 ay = _mm256_andnot_ps(sign, y);
  const __m256 e = exp2_ps(_mm256_mul_ps(ay, _mm256_set1_ps(-2.8853900817779268f)));
  __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  big = _mm256_or_ps(big, _mm256_and_ps(sign, y));
  const __m256 y2 = _mm256_mul_ps(y, y);
  __m256 p = _mm256_set1_ps(-1382.0f / 155925.0f);
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(62.0f / 2835.0f));
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(-17.0f / 315.0f));
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(2.0f / 15.0f));
  p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(-1.0f / 3.0f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, y2), y, y);
  return _mm256_blendv_ps(big, small, _mm256_cmp_ps(ay, _mm256_set1_ps(0.3f), _CMP_LT_OQ));
}

// What changes the scores before the softmax, in the kernel's units (a score is
// scale * log2(e) * q.k): Gemma 2's soft-cap c * tanh(s / c) (cap = c * log2(e); 0: none),
// then ALiBi's bias -slope_h * |i + d0 - j| for query row i and local key j (slopes: the H
// slopes times log2(e); nullptr: none), then the keys' own mask (keys: 0 for a key that may be
// attended, -inf for a hole in a run; one row of S + 8 floats per batch row, keys_bstride apart
// (0: one row for the batch); nullptr: none).
struct Mods {
  float cap = 0.0f;
  const float* slopes = nullptr;
  int64_t d0 = 0;
  const float* keys = nullptr;
  int64_t keys_bstride = 0;
  bool any() const { return cap > 0.0f || slopes || keys; }
  // the keys' mask from key k0 on, for batch row b (nullptr: none)
  const float* keys_at(int64_t b, int64_t k0) const {
    return keys ? keys + b * keys_bstride + k0 : nullptr;
  }
};

// f(CAP, BIAS, KEYS) with the modifiers of md as compile-time flags (std::bool_constant).
template <bool C, bool B, typename F>
static inline auto with_keys(const Mods& md, F&& f) {
  return md.keys ? f(std::bool_constant<C>{}, std::bool_constant<B>{}, std::true_type{})
                 : f(std::bool_constant<C>{}, std::bool_constant<B>{}, std::false_type{});
}
template <bool C, typename F>
static inline auto with_bias(const Mods& md, F&& f) {
  return md.slopes ? with_keys<C, true>(md, f) : with_keys<C, false>(md, f);
}
template <typename F>
static inline auto with_mods(const Mods& md, F&& f) {
  return md.cap > 0.0f ? with_bias<true>(md, f) : with_bias<false>(md, f);
}

// The modified scores of 8 keys at column j of a row whose query stands at column pos (kb: the
// keys' mask at column 0); t gets tanh(s / cap) (the soft-cap's derivative is 1 - t^2).
template <bool CAP, bool BIAS, bool KEYS>
static inline __m256 mod8(__m256 x, float cap, float slope, int64_t pos, int64_t j,
                          const float* kb, __m256& t) {
  if constexpr (CAP) {
    t = tanh_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.0f / cap)));
    x = _mm256_mul_ps(_mm256_set1_ps(cap), t);
  }
  if constexpr (BIAS) {
    const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 dist = _mm256_sub_ps(_mm256_set1_ps(static_cast<float>(pos - j)), lanes);
    dist = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), dist);
    x = _mm256_fnmadd_ps(_mm256_set1_ps(slope), dist, x);
  }
  if constexpr (KEYS) x = _mm256_add_ps(x, _mm256_loadu_ps(kb + j));
  return x;
}

// s[a..b] = the modified scores, in place (may write up to 7 floats past b, as row_exp does).
template <bool CAP, bool BIAS, bool KEYS>
static inline void mod_row(float* s, int64_t a, int64_t b, float cap, float slope, int64_t pos,
                           const float* kb) {
  __m256 t;
  for (int64_t j = a; j <= b; j += 8)
    _mm256_storeu_ps(s + j,
                     mod8<CAP, BIAS, KEYS>(_mm256_loadu_ps(s + j), cap, slope, pos, j, kb, t));
}

// One row of the backward over its columns ja..jb (inclusive): s = P = 2^(S' - m) and
// d = dS = scale * P * (dP - D) (times 1 - t^2 under a soft-cap), S' the modified scores; lanes
// past jb and holes in the keys' mask get 0. Returns the first column past the last one written.
template <bool CAP, bool BIAS, bool KEYS>
static inline int64_t bwd_row(float* s, float* d, int64_t ja, int64_t jb, float m, float D,
                              float scale, float cap, float slope, int64_t pos, const float* kb) {
  const __m256 vm = _mm256_set1_ps(m), vD = _mm256_set1_ps(D), vs = _mm256_set1_ps(scale);
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 t = one;
  int64_t j = ja;
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (; j + 8 <= jb + 1; j += 8) {
    __m256 x = mod8<CAP, BIAS, KEYS>(_mm256_loadu_ps(s + j), cap, slope, pos, j, kb, t);
    __m256 p = exp2_ps(_mm256_sub_ps(x, vm));
    if constexpr (KEYS) p = _mm256_and_ps(p, _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ));
    __m256 ds = _mm256_mul_ps(_mm256_mul_ps(p, vs), _mm256_sub_ps(_mm256_loadu_ps(d + j), vD));
    if constexpr (CAP) ds = _mm256_mul_ps(ds, _mm256_fnmadd_ps(t, t, one));
    _mm256_storeu_ps(s + j, p);
    _mm256_storeu_ps(d + j, ds);
  }
  const int64_t rem = jb + 1 - j;
  if (rem > 0) {
    __m256 msk = tail_mask((int)rem);
    __m256 x = mod8<CAP, BIAS, KEYS>(_mm256_loadu_ps(s + j), cap, slope, pos, j, kb, t);
    if constexpr (KEYS) msk = _mm256_and_ps(msk, _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ));
    __m256 p = _mm256_and_ps(exp2_ps(_mm256_sub_ps(x, vm)), msk);
    __m256 ds = _mm256_mul_ps(_mm256_mul_ps(p, vs), _mm256_sub_ps(_mm256_loadu_ps(d + j), vD));
    if constexpr (CAP) ds = _mm256_mul_ps(ds, _mm256_fnmadd_ps(t, t, one));
    _mm256_storeu_ps(s + j, p);
    _mm256_storeu_ps(d + j, _mm256_and_ps(ds, msk));
    j += 8;
  }
  return j;
}

// s[6 x 16] (row stride ss) = q[6 x D] (row stride D) * kt[D x 16]
template <int64_t DC>  // DC > 0: compile-time head dim
static inline void qk_6x16_t(const float* __restrict q, int64_t D_,
                             const float* __restrict kt, float* __restrict s,
                             int64_t ss) {
  const int64_t D = DC > 0 ? DC : D_;
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
  __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
  __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
  __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
  __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps();
  __m256 c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
  const float* q0 = q;
  const float* q1 = q + D;
  const float* q2 = q + 2 * D;
  const float* q3 = q + 3 * D;
  const float* q4 = q + 4 * D;
  const float* q5 = q + 5 * D;
#pragma GCC unroll 8
  for (int64_t d = 0; d < D; ++d) {
    __m256 k0 = _mm256_load_ps(kt + d * NR);
    __m256 k1 = _mm256_load_ps(kt + d * NR + 8);
    __m256 a;
    a = _mm256_broadcast_ss(q0 + d);
    c00 = _mm256_fmadd_ps(a, k0, c00); c01 = _mm256_fmadd_ps(a, k1, c01);
    a = _mm256_broadcast_ss(q1 + d);
    c10 = _mm256_fmadd_ps(a, k0, c10); c11 = _mm256_fmadd_ps(a, k1, c11);
    a = _mm256_broadcast_ss(q2 + d);
    c20 = _mm256_fmadd_ps(a, k0, c20); c21 = _mm256_fmadd_ps(a, k1, c21);
    a = _mm256_broadcast_ss(q3 + d);
    c30 = _mm256_fmadd_ps(a, k0, c30); c31 = _mm256_fmadd_ps(a, k1, c31);
    a = _mm256_broadcast_ss(q4 + d);
    c40 = _mm256_fmadd_ps(a, k0, c40); c41 = _mm256_fmadd_ps(a, k1, c41);
    a = _mm256_broadcast_ss(q5 + d);
    c50 = _mm256_fmadd_ps(a, k0, c50); c51 = _mm256_fmadd_ps(a, k1, c51);
  }
  _mm256_storeu_ps(s + 0 * ss, c00); _mm256_storeu_ps(s + 0 * ss + 8, c01);
  _mm256_storeu_ps(s + 1 * ss, c10); _mm256_storeu_ps(s + 1 * ss + 8, c11);
  _mm256_storeu_ps(s + 2 * ss, c20); _mm256_storeu_ps(s + 2 * ss + 8, c21);
  _mm256_storeu_ps(s + 3 * ss, c30); _mm256_storeu_ps(s + 3 * ss + 8, c31);
  _mm256_storeu_ps(s + 4 * ss, c40); _mm256_storeu_ps(s + 4 * ss + 8, c41);
  _mm256_storeu_ps(s + 5 * ss, c50); _mm256_storeu_ps(s + 5 * ss + 8, c51);
}

static inline void qk_6x16(const float* __restrict q, int64_t D,
                           const float* __restrict kt, float* __restrict s,
                           int64_t ss) {
  if (D == 64) qk_6x16_t<64>(q, D, kt, s, ss);
  else if (D == 128) qk_6x16_t<128>(q, D, kt, s, ss);
  else qk_6x16_t<0>(q, D, kt, s, ss);
}

// s[6 x 8] = q[6 x D] * kt[D x 8] (kt row stride NR): half-panel edge tiles
static inline void qk_6x8(const float* __restrict q, int64_t D,
                          const float* __restrict kt, float* __restrict s,
                          int64_t ss) {
  __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(), c2 = _mm256_setzero_ps();
  __m256 c3 = _mm256_setzero_ps(), c4 = _mm256_setzero_ps(), c5 = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t d = 0; d < D; ++d) {
    __m256 k0 = _mm256_load_ps(kt + d * NR);
    c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(q + d), k0, c0);
    c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(q + D + d), k0, c1);
    c2 = _mm256_fmadd_ps(_mm256_broadcast_ss(q + 2 * D + d), k0, c2);
    c3 = _mm256_fmadd_ps(_mm256_broadcast_ss(q + 3 * D + d), k0, c3);
    c4 = _mm256_fmadd_ps(_mm256_broadcast_ss(q + 4 * D + d), k0, c4);
    c5 = _mm256_fmadd_ps(_mm256_broadcast_ss(q + 5 * D + d), k0, c5);
  }
  _mm256_storeu_ps(s, c0); _mm256_storeu_ps(s + ss, c1);
  _mm256_storeu_ps(s + 2 * ss, c2); _mm256_storeu_ps(s + 3 * ss, c3);
  _mm256_storeu_ps(s + 4 * ss, c4); _mm256_storeu_ps(s + 5 * ss, c5);
}

// The products with P (forward O += P V; backward dQ += dS K, dV += P^T dO, dK += dS^T Q):
// o[6 x cols] (row stride os) += A[6 x n] * x[n x cols] (x row stride xs), where
// A(i, j) = p[i*ps + j] (rows of P) or, with TRANS, p[j*ps + i] (columns of P: the 6
// rows of the product are 6 consecutive keys).
template <bool TRANS>
static inline void ax_6x16(const float* __restrict p, int64_t ps,
                           const float* __restrict x, int64_t xs, int64_t n,
                           float* __restrict o, int64_t os) {
  const int64_t si = TRANS ? 1 : ps, sj = TRANS ? ps : 1;
  __m256 c0[MR], c1[MR];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    c0[r] = _mm256_loadu_ps(o + r * os);
    c1[r] = _mm256_loadu_ps(o + r * os + 8);
  }
#pragma GCC unroll 4
  for (int64_t j = 0; j < n; ++j) {
    const float* a = p + j * sj;
    __m256 x0 = _mm256_loadu_ps(x + j * xs);
    __m256 x1 = _mm256_loadu_ps(x + j * xs + 8);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      __m256 b = _mm256_broadcast_ss(a + r * si);
      c0[r] = _mm256_fmadd_ps(b, x0, c0[r]);
      c1[r] = _mm256_fmadd_ps(b, x1, c1[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(o + r * os, c0[r]);
    _mm256_storeu_ps(o + r * os + 8, c1[r]);
  }
}

// Same for an 8-column remainder.
template <bool TRANS>
static inline void ax_6x8(const float* __restrict p, int64_t ps,
                          const float* __restrict x, int64_t xs, int64_t n,
                          float* __restrict o, int64_t os) {
  const int64_t si = TRANS ? 1 : ps, sj = TRANS ? ps : 1;
  __m256 c[MR];
  for (int r = 0; r < MR; ++r) c[r] = _mm256_loadu_ps(o + r * os);
  for (int64_t j = 0; j < n; ++j) {
    __m256 x0 = _mm256_loadu_ps(x + j * xs);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r)
      c[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * si + j * sj), x0, c[r]);
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(o + r * os, c[r]);
}

// Scalar remainder (< 8 columns).
template <bool TRANS>
static inline void ax_6xr(const float* p, int64_t ps, const float* x, int64_t xs,
                          int64_t n, float* o, int64_t os, int64_t nc) {
  const int64_t si = TRANS ? 1 : ps, sj = TRANS ? ps : 1;
  for (int r = 0; r < MR; ++r)
    for (int64_t c = 0; c < nc; ++c) {
      float acc = o[r * os + c];
      for (int64_t j = 0; j < n; ++j) acc += p[r * si + j * sj] * x[j * xs + c];
      o[r * os + c] = acc;
    }
}

#ifndef RS_AVX512  // (the AVX-512 build's is below)
// o[6 x D] (row stride D) += A[6 x n] x[n x D] (row stride D), all column tiles.
template <bool TRANS>
static inline void ax_6xD(const float* p, int64_t ps, const float* x, int64_t D,
                          int64_t n, float* o) {
  int64_t c = 0;
  for (; c + NR <= D; c += NR) ax_6x16<TRANS>(p, ps, x + c, D, n, o + c, D);
  if (c + 8 <= D) { ax_6x8<TRANS>(p, ps, x + c, D, n, o + c, D); c += 8; }
  if (c < D) ax_6xr<TRANS>(p, ps, x + c, D, n, o + c, D, D - c);
}
#endif
