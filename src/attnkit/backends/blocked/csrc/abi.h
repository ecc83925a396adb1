// The kernels' entry layer without libtorch (row_span.cpp, decode.cpp; put after elements.h
// before each source by attnkit.backends.blocked.builds): the kernels are called through a
// plain C ABI (pointers, sizes, strides, dtype codes) that Python loads with ctypes, so that
// one build serves every torch version (no libtorch symbol, no torch header).
//
// The kernels' bodies are written against a small part of ATen's interface: at::Tensor's
// size(), stride(), data_ptr(), at::parallel_for and at::get_num_threads. This header gives
// them exactly that part, over memory the Python side owns (attnkit.backends.blocked.native
// allocates every output with torch and passes its pointer):
//   * at::Tensor: a view (pointer, 4 sizes, 4 strides), never an owner;
//   * at::parallel_for(begin, end, grain, f): f on up to get_num_threads() OpenMP threads, in
//     the OpenMP runtime the process has loaded (libgomp.so.1: torch's own, found by its
//     soname, so the kernels share torch's thread team as at::parallel_for does), run inline
//     inside a parallel region or with one thread;
//   * at::get_num_threads(): the thread count of the current call (torch.get_num_threads(),
//     passed in by the caller; at::set_call_threads sets it).
// Errors: the entry functions catch every exception, keep its message (attnkit_last_error)
// and return non-zero; ABI_CHECK(cond, msg) throws one, and so does TORCH_CHECK(cond, parts...)
// (its message the parts streamed in turn, as ATen's), for a body written against ATen.
#include <omp.h>

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace at {

struct Tensor {
  void* ptr = nullptr;
  int64_t ndim = 0;
  int64_t sz[4] = {0, 0, 0, 0};
  int64_t st[4] = {0, 0, 0, 0};
  int64_t size(int64_t i) const { return sz[i]; }
  int64_t stride(int64_t i) const { return st[i]; }
  void* data_ptr() const { return ptr; }
  template <typename T>
  T* data_ptr() const {
    return static_cast<T*>(ptr);
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t i = 0; i < ndim; ++i) n *= sz[i];
    return n;
  }
};

// a contiguous view of p with the given sizes
inline Tensor view(void* p, std::initializer_list<int64_t> sizes) {
  Tensor t;
  t.ptr = p;
  t.ndim = static_cast<int64_t>(sizes.size());
  int64_t i = 0;
  for (int64_t s : sizes) t.sz[i++] = s;
  int64_t stride = 1;
  for (int64_t d = t.ndim - 1; d >= 0; --d) {
    t.st[d] = stride;
    stride *= t.sz[d];
  }
  return t;
}

inline int64_t& call_threads() {
  static thread_local int64_t n = 1;
  return n;
}
inline void set_call_threads(int64_t n) { call_threads() = n < 1 ? 1 : n; }
inline int64_t get_num_threads() { return call_threads(); }

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t g = grain < 1 ? 1 : grain;
  int64_t nth = (n + g - 1) / g;
  if (nth > get_num_threads()) nth = get_num_threads();
  if (nth <= 1 || omp_in_parallel()) {
    f(begin, end);
    return;
  }
  // an exception thrown on a thread: its message, rethrown after the region (an exception
  // may not leave an OpenMP region)
  std::string error;
  bool failed = false;
#pragma omp parallel num_threads(static_cast<int>(nth))
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t chunk = (n + nt - 1) / nt;
    const int64_t b = begin + t * chunk, e = b + chunk < end ? b + chunk : end;
    if (b < e) {
      try {
        f(b, e);
      } catch (const std::exception& x) {
#pragma omp critical(attnkit_abi_error)
        if (!failed) failed = true, error = x.what();
      } catch (...) {
#pragma omp critical(attnkit_abi_error)
        if (!failed) failed = true, error = "unknown C++ exception";
      }
    }
  }
  if (failed) throw std::runtime_error(error);
}

}  // namespace at

namespace attnkit_abi {

// dtype codes of the C ABI (native.py's DTYPES): float32, bfloat16, float16; -1: anything else
enum Code : int32_t { F32 = 0, BF16 = 1, F16 = 2 };

// argument i of an entry's int64 array `a` as the pointer it carries (the Python side packs
// each tensor's address as an int64)
template <typename T = void>
inline T* arg(const int64_t* a, int i) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(a[i]));
}

template <typename... Parts>
inline std::string message(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

inline std::string& last_error() {
  static thread_local std::string s;
  return s;
}

// runs f (the body of an entry function); 0, or 1 with the message in last_error()
template <typename F>
inline int32_t guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    last_error() = e.what();
  } catch (...) {
    last_error() = "unknown C++ exception";
  }
  return 1;
}

// the dtypes besides float32 a build reads: bit 0 bfloat16, bit 1 float16 (with F16C only)
inline int32_t low_dtype_bits() {
#ifdef __F16C__
  return 3;
#else
  return 1;
#endif
}

}  // namespace attnkit_abi

#define ABI_CHECK(cond, msg)                      \
  do {                                            \
    if (!(cond)) throw std::runtime_error((msg)); \
  } while (0)
#define TORCH_CHECK(cond, ...) ABI_CHECK(cond, attnkit_abi::message(__VA_ARGS__))

// The version of the C ABI: native.py refuses a build whose version it does not know. Defined
// once, as ABI in attnkit/backends/blocked/builds.py, whose compile command passes it here.
#ifndef ATTNKIT_ABI
#error "ATTNKIT_ABI is passed by builds.py's compile command (-DATTNKIT_ABI=<builds.ABI>)"
#endif
extern "C" int32_t attnkit_abi_version() { return ATTNKIT_ABI; }
