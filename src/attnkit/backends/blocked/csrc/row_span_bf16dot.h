// A part of row_span.cpp (the AVX512-BF16 dot-product micro-kernels (-DRS_BF16DOT; stubs elsewhere)): text inside its namespace rowspan, put in place of its
// #include line by builds.source_text, so every build compiles one translation unit as before.

// ---------------------------------------------------------------------------
// bfloat16 dot products (AVX512-BF16's vdpbf16ps: pairs of bf16 multiplied exactly and summed
// into float32 lanes), used forward and backward on bfloat16 inputs in the build made with
// -DRS_BF16DOT (rowspan.py builds it only where the CPU has avx512_bf16). Operands are pairs
// of bf16 along the reduction, one uint32 each:
//   * K panels [Dk/2][16 keys] of (k[key][2p], k[key][2p + 1]) pairs, 16 keys a zmm;
//   * V [key pairs][Dvp] of (v[2j][c], v[2j + 1][c]) pairs, 16 columns a zmm (Dvp: Dv
//     rounded up to 16, zeros past Dv and past S);
//   * rows of Q (Dk rounded up to even, zero padded) and of P (converted from the float32
//     softmax, rounded to nearest even) broadcast one pair at a time.
#ifdef RS_BF16DOT
constexpr bool kDot = true;
static inline __m512 dot2(__m512 acc, uint32_t a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(a)), (__m512bh)b);
}
// the same with the pair read from memory as an embedded broadcast ({1to16}): gcc does not
// fold the broadcast into vdpbf16ps itself, and the separate vpbroadcastd took as many slots
static inline __m512 dot2m(__m512 acc, const uint32_t* a, __m512i b) {
  __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(b), "m"(*a));
  return acc;
}

// s[6 x 16] (row stride ss) = sc * q[6 x 2 D2] k^T, q rows of D2 pairs (row stride qs pairs)
static inline void qk_dot_6x16(const uint32_t* __restrict q, int64_t qs, int64_t D2,
                               const uint32_t* __restrict kp, float* __restrict s, int64_t ss,
                               float sc) {
  __m512 a[MR], b[MR];  // two sums per row (even / odd pairs) to hide the latency
  for (int r = 0; r < MR; ++r) { a[r] = _mm512_setzero_ps(); b[r] = _mm512_setzero_ps(); }
  int64_t p = 0;
  for (; p + 2 <= D2; p += 2) {
    const __m512i k0 = _mm512_loadu_si512(kp + p * NR);
    const __m512i k1 = _mm512_loadu_si512(kp + (p + 1) * NR);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      a[r] = dot2m(a[r], q + r * qs + p, k0);
      b[r] = dot2m(b[r], q + r * qs + p + 1, k1);
    }
  }
  if (p < D2) {
    const __m512i k0 = _mm512_loadu_si512(kp + p * NR);
    for (int r = 0; r < MR; ++r) a[r] = dot2m(a[r], q + r * qs + p, k0);
  }
  const __m512 vs = _mm512_set1_ps(sc);
  for (int r = 0; r < MR; ++r)
    _mm512_storeu_ps(s + r * ss, _mm512_mul_ps(_mm512_add_ps(a[r], b[r]), vs));
}

// s[6 x 8] = sc * q k^T for half a K panel (kp: the panel's first or second 8 keys; rows of
// pairs 16 apart): the tiles at the ragged edges of the runs
static inline __m256 dot2m8(__m256 acc, const uint32_t* a, __m256i b) {
  __asm__("vdpbf16ps %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(b), "m"(*a));
  return acc;
}
static inline void qk_dot_6x8(const uint32_t* __restrict q, int64_t qs, int64_t D2,
                              const uint32_t* __restrict kp, float* __restrict s, int64_t ss,
                              float sc) {
  __m256 a[MR], b[MR];
  for (int r = 0; r < MR; ++r) { a[r] = _mm256_setzero_ps(); b[r] = _mm256_setzero_ps(); }
  int64_t p = 0;
  for (; p + 2 <= D2; p += 2) {
    const __m256i k0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp + p * NR));
    const __m256i k1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp + (p + 1) * NR));
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      a[r] = dot2m8(a[r], q + r * qs + p, k0);
      b[r] = dot2m8(b[r], q + r * qs + p + 1, k1);
    }
  }
  if (p < D2) {
    const __m256i k0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp + p * NR));
    for (int r = 0; r < MR; ++r) a[r] = dot2m8(a[r], q + r * qs + p, k0);
  }
  const __m256 vs = _mm256_set1_ps(sc);
  for (int r = 0; r < MR; ++r)
    _mm256_storeu_ps(s + r * ss, _mm256_mul_ps(_mm256_add_ps(a[r], b[r]), vs));
}

// The 6 x 16 scores of a tile against the panel from key j0 (j0 - kbase keys into kp), or
// only the half of it that the tile's keys lo..hi reach, as the float32 kernel does
static inline void qk_dot_tile(const uint32_t* q, int64_t D2, const uint32_t* kp, int64_t j0,
                               int64_t lo, int64_t hi, float* s, int64_t ss, float sc) {
  if (lo >= j0 + 8) qk_dot_6x8(q, D2, D2, kp + 8, s + 8, ss, sc);
  else if (hi < j0 + 8) qk_dot_6x8(q, D2, D2, kp, s, ss, sc);
  else qk_dot_6x16(q, D2, D2, kp, s, ss, sc);
}

// o[6 x 16 NC] (row stride os) += A[6 x 2 np] V, A(r, j) the pair p[r * si + j * sj] (rows of
// P: si the row stride, sj = 1; or, transposed, 6 keys of row pairs: si = 1, sj the stride of a
// row pair), V np rows of pairs (row stride vs pairs)
template <int NC>
static inline void pv_dot_6(const uint32_t* __restrict p, int64_t si, int64_t sj,
                            const uint32_t* __restrict v, int64_t vs, int64_t np,
                            float* __restrict o, int64_t os) {
  __m512 c[MR][NC];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
    for (int x = 0; x < NC; ++x) c[r][x] = _mm512_loadu_ps(o + r * os + 16 * x);
  for (int64_t j = 0; j < np; ++j) {
    __m512i vv[NC];
    for (int x = 0; x < NC; ++x) vv[x] = _mm512_loadu_si512(v + j * vs + 16 * x);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const uint32_t pr = p[r * si + j * sj];
      for (int x = 0; x < NC; ++x) c[r][x] = dot2(c[r][x], pr, vv[x]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
    for (int x = 0; x < NC; ++x) _mm512_storeu_ps(o + r * os + 16 * x, c[r][x]);
}

// o[6 x Dvp] += A V over all column tiles (Dvp a multiple of 16; A as in pv_dot_6)
static inline void pv_dot(const uint32_t* p, int64_t si, int64_t sj, const uint32_t* v,
                          int64_t Dvp, int64_t np, float* o) {
  int64_t c = 0;
  for (; c + 64 <= Dvp; c += 64) pv_dot_6<4>(p, si, sj, v + c, Dvp, np, o + c, Dvp);
  switch ((Dvp - c) / 16) {
    case 3: pv_dot_6<3>(p, si, sj, v + c, Dvp, np, o + c, Dvp); break;
    case 2: pv_dot_6<2>(p, si, sj, v + c, Dvp, np, o + c, Dvp); break;
    case 1: pv_dot_6<1>(p, si, sj, v + c, Dvp, np, o + c, Dvp); break;
    default: break;
  }
}

// Row pairs of the float32 rows x (row stride xs) interleaved: dst[rp * ds + c] = (x[2 rp][c],
// x[2 rp + 1][c]) as bf16, for rp < np and c < n (n a multiple of 16; rows past nrows read 0)
static inline void row_pairs(const float* x, int64_t xs, int64_t nrows, int64_t np, int64_t n,
                             uint32_t* dst, int64_t ds) {
  for (int64_t rp = 0; rp < np; ++rp) {
    const float* r0 = x + 2 * rp * xs;
    const float* r1 = 2 * rp + 1 < nrows ? r0 + xs : nullptr;
    for (int64_t c = 0; c < n; c += 16) {
      const __m512i a = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r0 + c)));
      const __m512i b = r1 ? _mm512_cvtepu16_epi32(
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r1 + c)))
                           : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + rp * ds + c, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
  }
}

// bf16 pairs of the float32 s[a..e) (a, e even) at dst[a/2..e/2), rounded to nearest even
static inline void to_pairs(const float* s, int64_t a, int64_t e, uint16_t* dst) {
  int64_t j = a;
  for (; j + 16 <= e; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + j)));
  if (j < e) {
    const __mmask16 m = static_cast<__mmask16>((1u << (e - j)) - 1);
    const __m256i x = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, s + j));
    _mm256_mask_storeu_epi16(dst + j, m, x);
  }
}

// a row of D bf16 as D2 = ceil(D / 2) pairs (odd D: the last is (x, 0))
static inline void q_pairs(const uint16_t* src, int64_t D, uint32_t* dst) {
  std::memcpy(dst, src, static_cast<size_t>(D) * sizeof(uint16_t));
  if (D & 1) dst[D / 2] = src[D - 1];
}

// O[6 x Dvp] += P V for one tile over its keys A..B (inclusive, relative to the chunk): the
// tile's float32 P rows (stride ss) become bf16 pairs over the even-aligned [A & ~1, B | 1]
// (the column beside an odd end is set to 0 first), pb the pairs' rows (stride ss), v the V
// pairs from the chunk's first key on
static inline void pv_dot_tile(float* s, uint16_t* pb, int64_t ss, int64_t A, int64_t B,
                               const uint32_t* v, int64_t Dvp, float* o) {
  const int64_t a2 = A & ~int64_t(1), e2 = (B | 1) + 1;
  for (int r = 0; r < MR; ++r) {
    float* row = s + r * ss;
    if (A & 1) row[a2] = 0.0f;
    if (!(B & 1)) row[e2 - 1] = 0.0f;
    to_pairs(row, a2, e2, pb + r * ss);
  }
  pv_dot(reinterpret_cast<const uint32_t*>(pb + a2), ss / 2, 1, v + (a2 / 2) * Dvp, Dvp,
         (e2 - a2) / 2, o);
}

// K panel of the 16 keys from key0 (zeros past S): dst[p * 16 + jj] = pair p of key key0 + jj
static inline void pack_k_pairs(const uint16_t* k, int64_t key0, int64_t S, int64_t D,
                                uint32_t* dst) {
  const int64_t D2 = (D + 1) / 2;
  for (int jj = 0; jj < NR; ++jj) {
    const int64_t key = key0 + jj;
    if (key >= S) {
      for (int64_t p = 0; p < D2; ++p) dst[p * NR + jj] = 0;
      continue;
    }
    const uint16_t* row = k + key * D;
    int64_t p = 0;
    for (; 2 * p + 1 < D; ++p) {
      uint32_t u;
      std::memcpy(&u, row + 2 * p, sizeof u);
      dst[p * NR + jj] = u;
    }
    if (p < D2) dst[p * NR + jj] = row[2 * p];  // odd D: the last pair is (k, 0)
  }
}

// V pairs of the 16 keys from key0 (key0 even; zeros past S and past Dv): dst[jp * Dvp + c]
static inline void pack_v_pairs(const uint16_t* v, int64_t key0, int64_t S, int64_t Dv,
                                int64_t Dvp, uint32_t* dst) {
  const __m256i zero = _mm256_setzero_si256();
  for (int jp = 0; jp < NR / 2; ++jp) {
    const int64_t j = key0 + 2 * jp;
    const uint16_t* r0 = j < S ? v + j * Dv : nullptr;
    const uint16_t* r1 = j + 1 < S ? v + (j + 1) * Dv : nullptr;
    uint32_t* out = dst + jp * Dvp;
    for (int64_t c = 0; c < Dvp; c += 16) {
      const int64_t n = std::min<int64_t>(16, Dv - c);
      const __mmask16 m = n >= 16 ? __mmask16(0xFFFF) : n > 0 ? __mmask16((1u << n) - 1) : 0;
      const __m256i x0 = r0 ? _mm256_maskz_loadu_epi16(m, r0 + c) : zero;
      const __m256i x1 = r1 ? _mm256_maskz_loadu_epi16(m, r1 + c) : zero;
      const __m512i lo = _mm512_cvtepu16_epi32(x0);
      const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(x1), 16);
      _mm512_storeu_si512(out + c, _mm512_or_si512(lo, hi));
    }
  }
}
#else  // the AVX2 build: never called (kDot gates every use), declared for if constexpr
constexpr bool kDot = false;
static inline void qk_dot_tile(const uint32_t*, int64_t, const uint32_t*, int64_t, int64_t,
                               int64_t, float*, int64_t, float) {}
static inline void pv_dot_tile(float*, uint16_t*, int64_t, int64_t, int64_t, const uint32_t*,
                               int64_t, float*) {}
static inline void q_pairs(const uint16_t*, int64_t, uint32_t*) {}
static inline void pack_k_pairs(const uint16_t*, int64_t, int64_t, int64_t, uint32_t*) {}
static inline void pack_v_pairs(const uint16_t*, int64_t, int64_t, int64_t, int64_t,
                                uint32_t*) {}
static inline void pv_dot(const uint32_t*, int64_t, int64_t, const uint32_t*, int64_t, int64_t,
                          float*) {}
static inline void row_pairs(const float*, int64_t, int64_t, int64_t, int64_t, uint32_t*,
                             int64_t) {}
#endif
