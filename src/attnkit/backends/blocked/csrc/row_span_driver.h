// A part of row_span.cpp (the shared driver: row softmax, K^T panel packing, buffers, spans, work planning and the work loop (every build)): text inside its namespace rowspan, put in place of its
// #include line by builds.source_text, so every build compiles one translation unit as before.

// max of s[a..b] (inclusive); may read up to 7 floats past b.
static inline float row_max(const float* s, int64_t a, int64_t b) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m0 = ninf, m1 = ninf;
  int64_t j = a;
  for (; j + 16 <= b + 1; j += 16) {
    m0 = _mm256_max_ps(m0, _mm256_loadu_ps(s + j));
    m1 = _mm256_max_ps(m1, _mm256_loadu_ps(s + j + 8));
  }
  for (; j + 8 <= b + 1; j += 8) m0 = _mm256_max_ps(m0, _mm256_loadu_ps(s + j));
  int64_t rem = b + 1 - j;
  if (rem > 0) {
    __m256 x = _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + j), tail_mask((int)rem));
    m1 = _mm256_max_ps(m1, x);
  }
  return hmax(_mm256_max_ps(m0, m1));
}

// s[a..b] = 2^(s[a..b] - m) in place, returns the sum; lanes past b (up to 7)
// are written as 0.
static inline float row_exp(float* s, int64_t a, int64_t b, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t j = a;
  for (; j + 16 <= b + 1; j += 16) {
    __m256 e0 = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
    __m256 e1 = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j + 8), vm));
    _mm256_storeu_ps(s + j, e0);
    _mm256_storeu_ps(s + j + 8, e1);
    acc0 = _mm256_add_ps(acc0, e0);
    acc1 = _mm256_add_ps(acc1, e1);
  }
  for (; j + 8 <= b + 1; j += 8) {
    __m256 e0 = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
    _mm256_storeu_ps(s + j, e0);
    acc0 = _mm256_add_ps(acc0, e0);
  }
  int64_t rem = b + 1 - j;
  if (rem > 0) {
    __m256 e0 = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
    e0 = _mm256_and_ps(e0, tail_mask((int)rem));
    _mm256_storeu_ps(s + j, e0);
    acc1 = _mm256_add_ps(acc1, e0);
  }
  return hsum(_mm256_add_ps(acc0, acc1));
}

static inline void zero_range(float* s, int64_t a, int64_t b) {  // inclusive
  for (int64_t j = a; j <= b; ++j) s[j] = 0.0f;
}

template <Dt E>
static inline void transpose8_store(const elem_t<E>* const* rows, int64_t d, float* dst) {
  // rows[0..7] point to 8 key rows; stores dst[x*NR + y] = rows[y][d + x], x,y < 8
  __m256 r0 = load8<E>(rows[0] + d), r1 = load8<E>(rows[1] + d);
  __m256 r2 = load8<E>(rows[2] + d), r3 = load8<E>(rows[3] + d);
  __m256 r4 = load8<E>(rows[4] + d), r5 = load8<E>(rows[5] + d);
  __m256 r6 = load8<E>(rows[6] + d), r7 = load8<E>(rows[7] + d);
  __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_store_ps(dst + 0 * NR, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_store_ps(dst + 1 * NR, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_store_ps(dst + 2 * NR, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_store_ps(dst + 3 * NR, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_store_ps(dst + 4 * NR, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_store_ps(dst + 5 * NR, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_store_ps(dst + 6 * NR, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_store_ps(dst + 7 * NR, _mm256_permute2f128_ps(u3, u7, 0x31));
}

// panel[d*NR + jj] = k[key0 + jj][d] (zero for keys >= L), jj < NR, as float32; zrow: D zero
// elements (all-zero bits, which is 0 in every element type)
template <Dt E>
static inline void pack_panel(const elem_t<E>* kp, int64_t key0, int64_t L, int64_t D,
                              const float* zrow, float* panel) {
  const elem_t<E>* rows[NR];
  const elem_t<E>* z = reinterpret_cast<const elem_t<E>*>(zrow);
  for (int jj = 0; jj < NR; ++jj)
    rows[jj] = (key0 + jj < L) ? kp + (key0 + jj) * D : z;
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    transpose8_store<E>(rows, d, panel + d * NR);
    transpose8_store<E>(rows + 8, d, panel + d * NR + 8);
  }
  for (; d < D; ++d)
    for (int jj = 0; jj < NR; ++jj) panel[d * NR + jj] = load1<E>(rows[jj] + d);
}

// The float32 rows [j0, min(j0 + NR, S)) of x (row length D) at dst (row j at dst + (j - base)
// * D): K or V rows that the products read in place, for a low-precision x.
template <Dt E>
static inline void convert_rows(const elem_t<E>* x, int64_t j0, int64_t S, int64_t D,
                                int64_t base, float* dst) {
  const int64_t j1 = std::min<int64_t>(j0 + NR, S);
  if (j1 > j0) load_row<E>(x + j0 * D, dst + (j0 - base) * D, (j1 - j0) * D);
}

struct AlignedBuf {
  float* p = nullptr;
  explicit AlignedBuf(size_t n) {
    size_t bytes = ((n * sizeof(float) + 63) / 64) * 64 + 64;
    p = static_cast<float*>(std::aligned_alloc(64, bytes));
    std::fill(p, p + bytes / sizeof(float), 0.0f);
  }
  ~AlignedBuf() { std::free(p); }
  AlignedBuf(const AlignedBuf&) = delete;
  AlignedBuf& operator=(const AlignedBuf&) = delete;
};

// A buffer that keeps its largest size (contents undefined after a grow).
struct GrowBuf {
  float* p = nullptr;
  size_t cap = 0;
  void ensure(size_t n) {
    if (n <= cap) return;
    std::free(p);
    const size_t bytes = ((n * sizeof(float) + 63) / 64) * 64 + 64;
    p = static_cast<float*>(std::aligned_alloc(64, bytes));
    cap = bytes / sizeof(float) - 16;
  }
  GrowBuf() = default;
  ~GrowBuf() { std::free(p); }
  GrowBuf(const GrowBuf&) = delete;
  GrowBuf& operator=(const GrowBuf&) = delete;
};

static inline int64_t round_up(int64_t x, int64_t m) { return ((x + m - 1) / m) * m; }

// Per-row key spans: row i of batch row b attends keys lo..hi (inclusive), read clamped to
// [0, S] and [-1, S - 1]; lo > hi is an empty row. Both are non-decreasing in i.
struct Spans {
  const int64_t* lo;
  const int64_t* hi;
  int64_t bstride;  // 0 when one row of spans serves the whole batch
  int64_t S;
  inline int64_t l(int64_t b, int64_t i) const {
    return std::min<int64_t>(std::max<int64_t>(lo[b * bstride + i], 0), S);
  }
  inline int64_t h(int64_t b, int64_t i) const {
    return std::min<int64_t>(std::max<int64_t>(hi[b * bstride + i], -1), S - 1);
  }
};

// keys per softmax chunk, at most (forward, backward); -D at build time for tuning runs
#ifndef RS_MAXKC_FWD
#define RS_MAXKC_FWD 512
#endif
#ifndef RS_MAXKC_BWD
#define RS_MAXKC_BWD 512
#endif

// The work of one call: items (b, kv head, chunk of C query rows), ordered by cost
// (largest first: threads pull them from a shared counter).
struct Work {
  int64_t C = 0, nch = 0, KC = NR, nitems = 0;
  std::vector<int64_t> order;
};

static Work plan_work(int64_t B, int64_t Hkv, int64_t L, const Spans& sp, int64_t nth,
                      int64_t maxkc, int64_t mb = MB) {
  Work w;
  const int64_t BK = B * Hkv;
  const int64_t target = std::max<int64_t>(1, (8 * nth + BK - 1) / BK);
  int64_t C = (L + target - 1) / target;
  C = std::min<int64_t>(C, 2048);
  C = round_up(std::max<int64_t>(C, mb), mb);
  w.C = C;
  w.nch = (L + C - 1) / C;
  w.nitems = BK * w.nch;
  const int64_t nb = sp.bstride ? B : 1;
  int64_t maxw = NR;
  std::vector<double> cost(static_cast<size_t>(nb * w.nch), 0.0);
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t i0 = 0; i0 < L; i0 += mb) {
      const int64_t i1 = std::min<int64_t>(L, i0 + mb) - 1;
      const int64_t blo = sp.l(b, i0), bhi = sp.h(b, i1);
      if (blo <= bhi) {
        maxw = std::max<int64_t>(maxw, bhi + 1 - (blo / NR) * NR);
        cost[b * w.nch + i0 / C] += double(bhi + 1 - blo) * double(i1 + 1 - i0);
      }
    }
  }
  w.KC = std::min<int64_t>(maxkc, round_up(maxw, NR));
  w.order.resize(static_cast<size_t>(w.nitems));
  for (int64_t t = 0; t < w.nitems; ++t) w.order[t] = t;
  const int64_t nchk = w.nch;
  std::stable_sort(w.order.begin(), w.order.end(), [&](int64_t x, int64_t y) {
    const int64_t bx = sp.bstride ? (x / nchk) / Hkv : 0, by = sp.bstride ? (y / nchk) / Hkv : 0;
    return cost[bx * nchk + x % nchk] > cost[by * nchk + y % nchk];
  });
  return w;
}

// Runs fn(item) for every item on at::get_num_threads() threads, each pulling the next item.
// flush: denormal float32 results and inputs count as 0 while the items run (MXCSR's FTZ and
// DAZ, restored after): the bf16 dot-product code met denormal dS values (P * (dP - D) far
// below 2^-126) that made its backward 1.4x slower; values that small change no result here.
struct FlushDenormals {  // sets FTZ | DAZ for its lifetime (when on), then restores MXCSR
  unsigned csr;
  bool on;
  explicit FlushDenormals(bool f) : csr(_mm_getcsr()), on(f) {
    if (on) _mm_setcsr(csr | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
  }
  ~FlushDenormals() {
    if (on) _mm_setcsr(csr);
  }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

template <typename Init, typename Fn>
static void run_items(const Work& w, int64_t nth, bool flush, Init init, Fn fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nth, 1, [&](int64_t, int64_t) {
    const FlushDenormals guard(flush);
    auto state = init();
    for (;;) {
      const int64_t t = next.fetch_add(1);
      if (t >= w.nitems) break;
      fn(*state, w.order[t]);
    }
    _mm_sfence();
  });
}
