// A part of row_span.cpp (the AVX-512 float32 micro-kernels (-DRS_AVX512; stubs in the AVX2 build)): text inside its namespace rowspan, put in place of its
// #include line by builds.source_text, so every build compiles one translation unit as before.

// ---------------------------------------------------------------------------
// The AVX-512 float32 kernels (the build made with -DRS_AVX512, and the AVX512-BF16 build, whose
// float32 code is this too): the same tiles as the AVX2 kernels above, 16 lanes a zmm. A 16-key
// K^T panel is one zmm per row of D, so S = Q K^T runs two panels at a time (6 x 32: 12
// accumulators, FMA-bound), or one panel with the reduction over D split in two (even / odd d)
// to keep 12 sums in flight; no half panels (a zmm covers the panel whatever the run's edge
// reaches). The products with P take up to 64 columns at a time (6 x 4 zmm), a tail of < 16
// columns with masked loads and stores; the softmax and the backward's rows (without score
// modifiers) 16 lanes at a time with masked tails.
#ifdef RS_AVX512
constexpr bool kWide = true;

// s[6 x 16] (row stride ss) = q[6 x D] (row stride D) * kt[D x 16]
template <int64_t DC>  // DC > 0: compile-time head dim
static inline void qk_6x16z_t(const float* __restrict q, int64_t D_,
                              const float* __restrict kt, float* __restrict s, int64_t ss) {
  const int64_t D = DC > 0 ? DC : D_;
  __m512 a[MR], b[MR];  // even and odd d
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) { a[r] = _mm512_setzero_ps(); b[r] = _mm512_setzero_ps(); }
  int64_t d = 0;
#pragma GCC unroll 4
  for (; d + 2 <= D; d += 2) {
    const __m512 k0 = _mm512_load_ps(kt + d * NR);
    const __m512 k1 = _mm512_load_ps(kt + (d + 1) * NR);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      a[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d]), k0, a[r]);
      b[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d + 1]), k1, b[r]);
    }
  }
  if (d < D) {
    const __m512 k0 = _mm512_load_ps(kt + d * NR);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d]), k0, a[r]);
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(s + r * ss, _mm512_add_ps(a[r], b[r]));
}

// s[6 x 32] = q[6 x D] * [kt | kt + NR D]: two consecutive panels, one broadcast of q for both
template <int64_t DC>
static inline void qk_6x32z_t(const float* __restrict q, int64_t D_,
                              const float* __restrict kt, float* __restrict s, int64_t ss) {
  const int64_t D = DC > 0 ? DC : D_;
  const float* kt1 = kt + NR * D;
  __m512 a[MR], b[MR];  // the first panel's keys, the second's
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) { a[r] = _mm512_setzero_ps(); b[r] = _mm512_setzero_ps(); }
#pragma GCC unroll 4
  for (int64_t d = 0; d < D; ++d) {
    const __m512 k0 = _mm512_load_ps(kt + d * NR);
    const __m512 k1 = _mm512_load_ps(kt1 + d * NR);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m512 x = _mm512_set1_ps(q[r * D + d]);
      a[r] = _mm512_fmadd_ps(x, k0, a[r]);
      b[r] = _mm512_fmadd_ps(x, k1, b[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(s + r * ss, a[r]);
    _mm512_storeu_ps(s + r * ss + NR, b[r]);
  }
}

// s[6 x 64] = q[6 x D] * four consecutive panels (24 accumulators)
template <int64_t DC>
static inline void qk_6x64z_t(const float* __restrict q, int64_t D_,
                              const float* __restrict kt, float* __restrict s, int64_t ss) {
  const int64_t D = DC > 0 ? DC : D_;
  __m512 a[MR][4];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t d = 0; d < D; ++d) {
    __m512 k[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) k[c] = _mm512_load_ps(kt + c * NR * D + d * NR);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m512 x = _mm512_set1_ps(q[r * D + d]);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_fmadd_ps(x, k[c], a[r][c]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * ss + c * NR, a[r][c]);
}

// The scores of a 6-row tile whose keys run lo..hi against the panels from key j0 (panel: its
// K^T) up to key jend (exclusive, at most j0 + 2 NR): both panels where the run reaches both,
// else the one it reaches. Writes whole panels (16 columns each) at s.
static inline void qk_pair(const float* q, int64_t D, const float* panel, int64_t j0,
                           int64_t jend, int64_t lo, int64_t hi, float* s, int64_t ss) {
  const bool p0 = j0 + NR - 1 >= lo && j0 <= hi;
  const bool p1 = j0 + NR < jend && j0 + 2 * NR - 1 >= lo && j0 + NR <= hi;
  if (p0 && p1) {
    if (D == 64) qk_6x32z_t<64>(q, D, panel, s, ss);
    else if (D == 128) qk_6x32z_t<128>(q, D, panel, s, ss);
    else qk_6x32z_t<0>(q, D, panel, s, ss);
    return;
  }
  if (!p0 && !p1) return;
  const float* kt = p0 ? panel : panel + NR * D;
  float* dst = p0 ? s : s + NR;
  if (D == 64) qk_6x16z_t<64>(q, D, kt, dst, ss);
  else if (D == 128) qk_6x16z_t<128>(q, D, kt, dst, ss);
  else qk_6x16z_t<0>(q, D, kt, dst, ss);
}

// o[6 x 16 NC] (row stride os) += A[6 x n] x[n x 16 NC] (row stride xs), A as in ax_6x16; the
// last zmm of a row takes only the lanes of `last` (a tail of < 16 columns)
template <bool TRANS, int NC>
static inline void ax_6xz(const float* __restrict p, int64_t ps, const float* __restrict x,
                          int64_t xs, int64_t n, float* __restrict o, int64_t os,
                          __mmask16 last) {
  const int64_t si = TRANS ? 1 : ps, sj = TRANS ? ps : 1;
  __m512 c[MR][NC];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int k = 0; k < NC; ++k)
      c[r][k] = _mm512_maskz_loadu_ps(k == NC - 1 ? last : __mmask16(0xFFFF), o + r * os + 16 * k);
#pragma GCC unroll 2
  for (int64_t j = 0; j < n; ++j) {
    const float* a = p + j * sj;
    __m512 xv[NC];
#pragma GCC unroll 4
    for (int k = 0; k < NC; ++k)
      xv[k] = _mm512_maskz_loadu_ps(k == NC - 1 ? last : __mmask16(0xFFFF), x + j * xs + 16 * k);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m512 b = _mm512_set1_ps(a[r * si]);
#pragma GCC unroll 4
      for (int k = 0; k < NC; ++k) c[r][k] = _mm512_fmadd_ps(b, xv[k], c[r][k]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int k = 0; k < NC; ++k)
      _mm512_mask_storeu_ps(o + r * os + 16 * k, k == NC - 1 ? last : __mmask16(0xFFFF),
                            c[r][k]);
}

// o[6 x D] (row stride D) += A[6 x n] x[n x D] (row stride D), all column tiles: 64 columns at
// a time, then the rest (up to 3 zmm, the last one masked)
template <bool TRANS>
static inline void ax_6xD(const float* p, int64_t ps, const float* x, int64_t D, int64_t n,
                          float* o) {
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) ax_6xz<TRANS, 4>(p, ps, x + c, D, n, o + c, D, 0xFFFF);
  const int64_t rem = D - c;
  if (rem == 0) return;
  const __mmask16 last = rem % 16 ? __mmask16((1u << (rem % 16)) - 1) : __mmask16(0xFFFF);
  switch ((rem + 15) / 16) {
    case 1: ax_6xz<TRANS, 1>(p, ps, x + c, D, n, o + c, D, last); break;
    case 2: ax_6xz<TRANS, 2>(p, ps, x + c, D, n, o + c, D, last); break;
    case 3: ax_6xz<TRANS, 3>(p, ps, x + c, D, n, o + c, D, last); break;
    default: ax_6xz<TRANS, 4>(p, ps, x + c, D, n, o + c, D, last); break;
  }
}

// The softmax's two passes over a row, 16 lanes at a time (the AVX2 row_max / row_exp below,
// widened): max of s[a..b]; s[a..b] = 2^(s[a..b] - m) in place (nothing past b), their sum.
// Four (max) and two (sum) independent accumulators, so neither pass waits on one chain of
// dependent max / add instructions. 2^x (x clamped at -125 as exp2_ps does): vreduceps gives
// f = x - floor(x) in [0, 1) in one instruction, a degree-5 minimax polynomial of 2^f on
// [0, 1) (rel. error ~1.6e-7 in float32), vscalefps multiplies by 2^floor(x): 3 instructions
// fewer than round, subtract and an exponent add.
static constexpr float kExp2Poly01[6] = {0.0018775727367028594f, 0.008989344350993633f,
                                         0.05582631751894951f,   0.24015361070632935f,
                                         0.6931530833244324f,    0.9999999403953552f};
static inline __m512 exp2_ps512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(kExp2Poly01[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly01[i]));
  return _mm512_scalef_ps(p, x);
}
static inline float row_max16(const float* s, int64_t a, int64_t b) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;
  int64_t j = a;
  for (; j + 64 <= b + 1; j += 64) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + j));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + j + 16));
    m2 = _mm512_max_ps(m2, _mm512_loadu_ps(s + j + 32));
    m3 = _mm512_max_ps(m3, _mm512_loadu_ps(s + j + 48));
  }
  for (; j + 16 <= b + 1; j += 16) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + j));
  if (j <= b) {
    const __mmask16 k = static_cast<__mmask16>((1u << (b + 1 - j)) - 1);
    m1 = _mm512_max_ps(m1, _mm512_mask_loadu_ps(ninf, k, s + j));
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
}
static inline float row_exp16(float* s, int64_t a, int64_t b, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t j = a;
  for (; j + 32 <= b + 1; j += 32) {
    const __m512 e0 = exp2_ps512(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
    const __m512 e1 = exp2_ps512(_mm512_sub_ps(_mm512_loadu_ps(s + j + 16), vm));
    _mm512_storeu_ps(s + j, e0);
    _mm512_storeu_ps(s + j + 16, e1);
    acc0 = _mm512_add_ps(acc0, e0);
    acc1 = _mm512_add_ps(acc1, e1);
  }
  for (; j + 16 <= b + 1; j += 16) {
    const __m512 e = exp2_ps512(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
    _mm512_storeu_ps(s + j, e);
    acc0 = _mm512_add_ps(acc0, e);
  }
  if (j <= b) {
    const __mmask16 k = static_cast<__mmask16>((1u << (b + 1 - j)) - 1);
    const __m512 e = exp2_ps512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), vm));
    _mm512_mask_storeu_ps(s + j, k, e);
    acc1 = _mm512_mask_add_ps(acc1, k, acc1, e);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// bwd_row (below) without score modifiers, 16 lanes at a time: s = P = 2^(s - m), d = dS =
// scale * P * (d - D) over ja..jb, 0 in the lanes past jb; returns the first column past the
// last one written (at most 15 past jb)
static inline int64_t bwd_row16(float* s, float* d, int64_t ja, int64_t jb, float m, float D,
                                float scale) {
  const __m512 vm = _mm512_set1_ps(m), vD = _mm512_set1_ps(D), vs = _mm512_set1_ps(scale);
  int64_t j = ja;
  for (; j + 16 <= jb + 1; j += 16) {
    const __m512 p = exp2_ps512(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
    const __m512 dd = _mm512_sub_ps(_mm512_loadu_ps(d + j), vD);
    const __m512 ds = _mm512_mul_ps(_mm512_mul_ps(p, vs), dd);
    _mm512_storeu_ps(s + j, p);
    _mm512_storeu_ps(d + j, ds);
  }
  if (j <= jb) {
    const __mmask16 k = static_cast<__mmask16>((1u << (jb + 1 - j)) - 1);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), vm);
    const __m512 p = _mm512_maskz_mov_ps(k, exp2_ps512(x));
    const __m512 dd = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, d + j), vD);
    _mm512_storeu_ps(s + j, p);
    _mm512_storeu_ps(d + j, _mm512_maskz_mul_ps(k, _mm512_mul_ps(p, vs), dd));
    j += 16;
  }
  return j;
}

#else  // the AVX2 build: never called (kWide gates every use), declared for if constexpr
constexpr bool kWide = false;
static inline void qk_pair(const float*, int64_t, const float*, int64_t, int64_t, int64_t,
                           int64_t, float*, int64_t) {}
template <int64_t DC>
static inline void qk_6x64z_t(const float*, int64_t, const float*, float*, int64_t) {}
static inline float row_max16(const float*, int64_t, int64_t) { return 0.0f; }
static inline float row_exp16(float*, int64_t, int64_t, float) { return 0.0f; }
static inline int64_t bwd_row16(float*, float*, int64_t, int64_t, float, float, float) {
  return 0;
}
#endif

// qk_6x64z_t with the head dim a compile-time constant where it is a common one (AVX-512)
static inline void qk_6x64(const float* q, int64_t D, const float* panel, float* s, int64_t ss) {
  if (D == 64) qk_6x64z_t<64>(q, D, panel, s, ss);
  else if (D == 128) qk_6x64z_t<128>(q, D, panel, s, ss);
  else qk_6x64z_t<0>(q, D, panel, s, ss);
}
