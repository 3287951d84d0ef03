// Declarations shared by the op's translation units: the checks of the
// backward ops' extra inputs, and the scalar pieces of the loss that every
// backend must compute identically. The ops' arguments and their contracts
// are in kernel_args.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cmath>
#include <limits>

#if defined(__CUDACC__)
#define CIRCLE_LOSS_HOST_DEVICE __host__ __device__
#else
#define CIRCLE_LOSS_HOST_DEVICE
#endif

namespace circle_loss {

// Whether an optional tensor argument was given: None arrives as nullopt or,
// through some callers, as an undefined tensor.
inline bool is_given(const std::optional<at::Tensor>& tensor) {
  return tensor.has_value() && tensor->defined();
}

// ref_self_index as the kernels read it: (B,) int64 and contiguous, or an
// undefined tensor where none was given.
inline at::Tensor left_out_columns(const std::optional<at::Tensor>& ref_self_index) {
  return is_given(ref_self_index) ? ref_self_index->to(at::kLong).contiguous() : at::Tensor();
}

// The backward's inputs of the per-row forms (`op` names the backward op):
// row_lse (B, 2) in features' accumulation dtype, as their forward returns
// it; grad_losses (B,); both on features' device.
void check_row_lse_backward_inputs(
    const char* op,
    const at::Tensor& grad_losses,
    const at::Tensor& features,
    const at::Tensor& row_lse);

// Rows of a block of the CPU kernels (each of their tiles of S is at most
// kCpuTile × kCpuTile), and so the width of _anchor_loss_forward's
// diagonal_tiles. Measured on a 2-core AMD EPYC at D = 512 (bench/NOTES.md):
// 256 ran fwd+bwd at B = 2048 in 93 ms, 128 in 100 ms, 64 in 130 ms: larger
// tiles keep ATen's GEMM nearer its peak.
constexpr int64_t kCpuTile = 256;

// diagonal_tiles: (B, kCpuTile) in features' accumulation dtype on features'
// device, as _anchor_loss_forward returns it with keep_diagonal_tiles, and
// only without a reference set; or not given.
void check_anchor_diagonal_tiles(
    const std::optional<at::Tensor>& diagonal_tiles,
    const at::Tensor& features,
    bool has_ref);

// partials: (n, 4) float64, as _lse_finish takes them.
void check_partials(const at::Tensor& partials);

// scalars: (4,) float64 from _lse_finish, on `device`.
void check_scalars(const at::Tensor& scalars, const c10::Device& device);

// Every CPU and CUDA kernel holds one of these while it runs. Autocast, when
// the caller enabled it around the op, must not recast the kernels' internal
// ATen calls (at::mm would return bfloat16 into a float32 pipeline): the op
// computes in its own accumulation types whatever the autocast state, and
// returns the features' dtype, as it does outside autocast.
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

// The logit of one ordered pair and its slope dz/ds with alpha detached
// (docs/math.md, "Inputs"). Written once, inlined into the CPU loops and the
// CUDA epilogues alike. The two sets differ only in constants: α is
// max((1 + m) - s, 0) or max(s + m, 0), the slope -γα or γα, and
// z = slope·(s - Δ) with Δ = 1 - m or m. The set's values are selected before
// the arithmetic, with no branch, so that the loops around it vectorise and
// each entry pays for one set's operations.
template <typename T>
struct PairLogit {
  T margin;
  T gamma;

  CIRCLE_LOSS_HOST_DEVICE inline T operator()(T s, bool positive, T* slope) const {
    const T distance = positive ? T(1) + margin - s : s + margin;
    const T alpha = distance > T(0) ? distance : T(0);
    *slope = (positive ? -gamma : gamma) * alpha;
    return *slope * (s - (positive ? T(1) - margin : margin));
  }
};

// Largest of a and b; NaN if either is.
template <typename T>
CIRCLE_LOSS_HOST_DEVICE inline T nan_max(T a, T b) {
  return a > b || a != a ? a : b;
}

// exp(from - to) for two maxima from <= to of one pair set: 1 when they are
// equal, infinite ones included, so that an infinite logit gives an infinite
// LSE (as torch.logsumexp does) rather than inf - inf = NaN.
template <typename T>
CIRCLE_LOSS_HOST_DEVICE inline T max_ratio(T from, T to) {
  return from == to ? T(1) : exp(from - to);
}

// Log-sum-exp of one pair set kept as (max, sum of exp(z - max)): the form in
// which partial results from threads, tiles, blocks or ranks combine. An empty
// set is (-inf, 0). NaN propagates, as in PyTorch. add and merge are the CPU
// kernel's rules; the CUDA folds (common.cuh) take the largest max first and
// rescale every sum to it, the same arithmetic in an order that parallelises.
template <typename T>
struct LseState {
  T max = -std::numeric_limits<T>::infinity();
  T sum = T(0);

  // One term: weight · exp(z).
  CIRCLE_LOSS_HOST_DEVICE inline void add(T z, T weight) {
    if (z > max) {
      sum = sum * exp(max - z) + weight;
      max = z;
    } else {
      sum += weight * max_ratio(z, max); // a NaN z lands here and poisons the sum
    }
  }

  CIRCLE_LOSS_HOST_DEVICE inline void merge(T other_max, T other_sum) {
    const bool other_nan = other_max != other_max;
    if (other_sum == T(0) && !other_nan) {
      return;
    }
    if (other_nan || max != max) {
      max = std::numeric_limits<T>::quiet_NaN();
      sum = std::numeric_limits<T>::quiet_NaN();
      return;
    }
    if (other_max > max) {
      sum = sum * exp(max - other_max) + other_sum;
      max = other_max;
    } else {
      sum += other_sum * max_ratio(other_max, max);
    }
  }

  CIRCLE_LOSS_HOST_DEVICE inline T lse() const {
    return sum == T(0) ? -std::numeric_limits<T>::infinity() : max + log(sum);
  }
};

// The LSE states of both pair sets over some pairs: the record in which
// partial results (a tile's, a CTA's, a row's, a rank's) pass through memory,
// as 4 values (max_P, Σ_P, max_N, Σ_N). Records of an (n, 4) array are read
// and written through at and store_at, nowhere by hand.
template <typename T>
struct PairStates {
  static constexpr int kValues = 4;

  LseState<T> positive;
  LseState<T> negative;

  template <typename From>
  CIRCLE_LOSS_HOST_DEVICE static inline PairStates at(const From* records, int64_t index) {
    const From* r = records + kValues * index;
    return {{static_cast<T>(r[0]), static_cast<T>(r[1])}, {static_cast<T>(r[2]), static_cast<T>(r[3])}};
  }

  CIRCLE_LOSS_HOST_DEVICE inline void merge(const PairStates& other) {
    positive.merge(other.positive.max, other.positive.sum);
    negative.merge(other.negative.max, other.negative.sum);
  }

  template <typename To>
  CIRCLE_LOSS_HOST_DEVICE inline void store_at(To* records, int64_t index) const {
    To* r = records + kValues * index;
    r[0] = static_cast<To>(positive.max);
    r[1] = static_cast<To>(positive.sum);
    r[2] = static_cast<To>(negative.max);
    r[3] = static_cast<To>(negative.sum);
  }
};

// What the two set-wise log-sum-exps give: the loss and the factor
// 2·sigmoid(Z) by which each pair's softmax weight times slope enters
// dloss/dF = 2 G F.
struct LossScalars {
  double lse_positive;
  double lse_negative;
  double loss;
  double grad_scale;

  // As _lse_finish returns them: (LSE_P, LSE_N, loss, 2·sigmoid(Z)).
  CIRCLE_LOSS_HOST_DEVICE inline void store(double* out) const {
    out[0] = lse_positive;
    out[1] = lse_negative;
    out[2] = loss;
    out[3] = grad_scale;
  }

  CIRCLE_LOSS_HOST_DEVICE static inline LossScalars load(const double* in) {
    return {in[0], in[1], in[2], in[3]};
  }
};

// Whether one pair set is empty (its LSE -inf) and the other is not NaN: the
// loss is then exactly 0 with a zero gradient, also where the other set's LSE
// is +inf (γ near the edge of its range, all labels equal), where the sum
// -inf + inf would be NaN. NaN still propagates.
template <typename T>
CIRCLE_LOSS_HOST_DEVICE inline bool one_set_empty(T lse_positive, T lse_negative) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  return (lse_positive == kNegInf && lse_negative == lse_negative) ||
      (lse_negative == kNegInf && lse_positive == lse_positive);
}

CIRCLE_LOSS_HOST_DEVICE inline LossScalars finish_loss(double lse_positive, double lse_negative) {
  const double z = lse_positive + lse_negative;
  LossScalars out{lse_positive, lse_negative, 0.0, 0.0};
  if (one_set_empty(lse_positive, lse_negative)) {
    return out;
  }
  // softplus and sigmoid written so that z = -inf (an empty set) gives exactly
  // 0 and large z neither overflows nor loses digits.
  out.loss = z > 0 ? z + log1p(exp(-z)) : log1p(exp(z));
  out.grad_scale = 2.0 / (1.0 + exp(-z));
  return out;
}

// L_i of one anchor of circle::anchor_loss: 0 where either of its pair sets
// is empty (LSE -inf), else softplus(LSE_P(i) + LSE_N(i)).
CIRCLE_LOSS_HOST_DEVICE inline double anchor_row_loss(double lse_positive, double lse_negative) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  return lse_positive == kNegInf || lse_negative == kNegInf ? 0.0 : finish_loss(lse_positive, lse_negative).loss;
}

// dL_i/dZ_i = sigmoid(Z_i) of one anchor, 0 where L_i is identically 0.
template <typename T>
CIRCLE_LOSS_HOST_DEVICE inline T anchor_row_grad_scale(T lse_positive, T lse_negative) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  return lse_positive == kNegInf || lse_negative == kNegInf ? T(0)
                                                            : T(1) / (T(1) + exp(-(lse_positive + lse_negative)));
}

} // namespace circle_loss
