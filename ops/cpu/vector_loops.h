// What lets the CPU tile loops run as wide vector code: an exp that a loop
// can inline, and builds of each loop for AVX-512 and for AVX2 with FMA, one
// of them chosen at run time.
#pragma once

#include <ATen/Version.h>

#include <bit>
#include <cstdint>
#include <limits>
#include <string>

// Where the wide builds can be made: x86-64 compilers that take GCC's target
// attribute (GCC, Clang).
#if defined(__x86_64__) && defined(__GNUC__)
#define CIRCLE_LOSS_WIDE_BUILDS 1
#else
#define CIRCLE_LOSS_WIDE_BUILDS 0
#endif

namespace circle_loss {
namespace cpu {

template <typename T>
struct ExpConstants;

template <>
struct ExpConstants<float> {
  using Bits = int32_t;
  static constexpr float kFloor = -80.0f;
  static constexpr float kCeiling = 80.0f;
  static constexpr float kRound = 12582912.0f; // 1.5·2²³: adding it rounds to an integer
  static constexpr float kLn2High = 0.693145751953125f; // ln 2 split so that k·kLn2High is exact
  static constexpr float kLn2Low = 1.428606765330187045e-06f;
  static constexpr int kMantissaBits = 23;
  static constexpr int kExponentBias = 127;
  static constexpr int kDegree = 7;
};

template <>
struct ExpConstants<double> {
  using Bits = int64_t;
  static constexpr double kFloor = -700.0;
  static constexpr double kCeiling = 700.0;
  static constexpr double kRound = 6755399441055744.0; // 1.5·2⁵²
  static constexpr double kLn2High = 0.693147180369123816490;
  static constexpr double kLn2Low = 1.90821492927058770002e-10;
  static constexpr int kMantissaBits = 52;
  static constexpr int kExponentBias = 1023;
  static constexpr int kDegree = 13;
};

// How far below a shared shift R a row's (or column's) own maximum m may lie
// for exp(z - R) to stand in for exp(z - m) times exp(m - R): within it, the
// terms that fall under inline_exp's floor are below exp(kFloor / 2) of the
// row's largest, and vanish in its sum.
template <typename T>
constexpr T kSharedShiftSpan = -ExpConstants<T>::kFloor / 2;

// 1/k!.
template <typename T>
constexpr T inverse_factorial(int k) {
  double factorial = 1.0;
  for (int n = 2; n <= k; ++n) factorial *= n;
  return static_cast<T>(1.0 / factorial);
}

// Σ_{k=K..N} r^(k-K)/k! by Horner's rule, its coefficients immediate
// constants (a table in memory would be loaded in the loop and keep it scalar).
template <typename T, int N, int K = 0>
__attribute__((always_inline)) inline T taylor_polynomial(T r) {
  if constexpr (K == N) {
    return inverse_factorial<T>(N);
  } else {
    return taylor_polynomial<T, N, K + 1>(r) * r + inverse_factorial<T>(K);
  }
}

// exp(x) in straight-line arithmetic that a vectorised loop inlines (a call
// to a library exp would keep the loop scalar, and a separate exp pass over
// a buffer costs a write and a read of it): x = k·ln 2 + r with |r| ≤ ln 2 / 2,
// e^r by its Taylor polynomial (degree 7 in float32, 13 in float64: the
// truncation stays below an ulp), 2^k built in the exponent bits. Within 2
// ulp of exp on [kFloor, kCeiling]. Below kFloor it gives 0 (-inf included):
// exp(-80) = 2e-35 in float32, exp(-700) = 1e-304 in float64, is lost in any
// sum that holds its set's largest term, exp(0) = 1, and is far below any
// weight the gradient resolves. Above kCeiling it gives inf; NaN stays NaN.
template <typename T>
__attribute__((always_inline)) inline T inline_exp(T x) {
  using C = ExpConstants<T>;
  using Bits = typename C::Bits;
  const T clamped = x > C::kCeiling ? C::kCeiling : x;
  // x·log2(e) rounded to the integer k, which also sits in the low bits of `rounded`.
  const T rounded = clamped * T(1.44269504088896340736) + C::kRound;
  const T k = rounded - C::kRound;
  const T r = (clamped - k * C::kLn2High) - k * C::kLn2Low;
  const T p = taylor_polynomial<T, C::kDegree>(r);
  const T two_to_k =
      std::bit_cast<T>(static_cast<Bits>((std::bit_cast<Bits>(rounded) + C::kExponentBias) << C::kMantissaBits));
  const T e = x < C::kFloor ? T(0) : p * two_to_k;
  return x > C::kCeiling ? std::numeric_limits<T>::infinity() : e;
}

// The build of the loops that runs: the widest that ATen's own kernels take
// (its CPU capability, which the ATEN_CPU_CAPABILITY environment variable can
// lower, e.g. to "avx2" or "default" to test the other builds) and the CPU has.
enum class VectorBuild { kBaseline, kAvx2, kAvx512 };

inline VectorBuild vector_build() {
#if CIRCLE_LOSS_WIDE_BUILDS
  static const VectorBuild build = [] {
    const std::string capability = at::get_cpu_capability();
    if (capability == "AVX512" && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw")) {
      return VectorBuild::kAvx512;
    }
    if ((capability == "AVX2" || capability == "AVX512") && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma")) {
      return VectorBuild::kAvx2;
    }
    return VectorBuild::kBaseline;
  }();
  return build;
#else
  return VectorBuild::kBaseline;
#endif
}

#if CIRCLE_LOSS_WIDE_BUILDS
template <typename Loop>
__attribute__((target("avx2,fma"))) void run_avx2(Loop loop) {
  loop();
}

template <typename Loop>
__attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma"))) void run_avx512(Loop loop) {
  loop();
}
#endif

// Runs loop(), a lambda marked CIRCLE_LOSS_VECTOR_LOOP, compiled for the
// build vector_build() names. The lambda is inlined into each caller and so
// compiled three times; the functions it calls must inline too (inline_exp,
// PairLogit), or they stay baseline code. It captures by value (pointers and
// scalars) and is taken by value, so that its captures are registers, not
// memory the loop's stores might alias; its elementwise loops carry `omp
// simd` (no iteration depends on another), as GCC otherwise guards them with
// run-time overlap tests that can send them down the scalar path. FMA
// contraction and the vector width make the builds round differently, each
// the same from run to run and for any thread count.
#define CIRCLE_LOSS_VECTOR_LOOP __attribute__((always_inline))

template <typename Loop>
inline void run_vectorised(Loop loop) {
#if CIRCLE_LOSS_WIDE_BUILDS
  switch (vector_build()) {
    case VectorBuild::kAvx512:
      run_avx512(loop);
      return;
    case VectorBuild::kAvx2:
      run_avx2(loop);
      return;
    case VectorBuild::kBaseline:
      break;
  }
#endif
  loop();
}

} // namespace cpu
} // namespace circle_loss
