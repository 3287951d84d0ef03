// CUDA kernels of circle::loss for batches of up to kSmallBatch rows.
//
// There the strip path is bound by launches and latency: two cuBLAS calls and
// four kernels of a few microseconds each, most SMs idle. Here the op is two
// launches of our own, each spread over every SM:
//   small_similarity_kernel  one CTA per kTile × kTile tile above the diagonal
//                            of S, or per two tiles on it: the dot products,
//                            the CTA's LSE partials (off-diagonal tiles count
//                            twice) and, when the gradient is wanted, each
//                            pair's term E_ij = exp(z_ij − m)·c_ij, m the
//                            CTA's largest z of the pair's set, written for
//                            the tile and its mirror image to E, (B, B): 1 MiB
//                            at most;
//   small_gradient_kernel    one CTA per kTile rows × a slice of the features:
//                            folds every partial into the two LSEs (each CTA
//                            the same way, in a fixed order, so all agree),
//                            turns E into the weights
//                            W_ij = 2σ(Z)·exp(m − LSE)·E_ij (docs/math.md,
//                            "The global form"; one factor per CTA and set, no exp
//                            per pair) and multiplies them with F; one more
//                            CTA folds the loss. It is launched as a
//                            programmatic dependent of the first kernel: its
//                            CTAs start, and fetch their features, while that
//                            one finishes.
// The loss alone is the first kernel and finalize_kernel.
//
// Each warp streams its own chunks of F (and of E) into shared memory with
// asynchronous copies, two chunks in flight, and the warps' partial products
// are summed in warp order: no atomics, bitwise the same every run.
#include "common.cuh"
#include "small_batch.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace circle_loss {
namespace {

// Rows of a tile of S, and of a gradient CTA.
constexpr int kTile = 16;
static_assert(kTile * kTile == kThreads, "one thread per entry of a tile in the epilogues");
static_assert(kSmallBatch / kTile <= 32, "one lane per column block in the gradient's factors");

// Chunks a warp has in flight: the one it multiplies and the next.
constexpr int kRing = 2;

// A 2-D array of registers as one row of all its values.
template <typename T, int M, int N>
__device__ __forceinline__ T (&flat(T (&values)[M][N]))[M * N] {
  return *reinterpret_cast<T(*)[M * N]>(&values);
}

// One step of a sum across lanes that also splits the values between them:
// a lane and its partner `distance` lanes away each keep one half of their
// 2N values (the upper half where keep_upper, the partner the other) and add
// the partner's copy of it. Every lane ends with N sums of two lanes, and the
// pair shuffles N values instead of 2N.
template <typename T, int N2, int N>
__device__ __forceinline__ void add_partner_half(const T (&values)[N2], bool keep_upper, int distance, T (&sums)[N]) {
  static_assert(N2 == 2 * N, "halves of the values");
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const T kept = keep_upper ? values[N + i] : values[i];
    const T given = keep_upper ? values[i] : values[N + i];
    sums[i] = kept + __shfl_xor_sync(0xffffffffu, given, distance);
  }
}

// N values of T from shared memory, in one 8- or 16-byte load, as acc_t.
template <typename acc_t, int N, typename T>
__device__ __forceinline__ Packed<acc_t, N> load_as(const T* p) {
  const Packed<T, N> raw = *reinterpret_cast<const Packed<T, N>*>(p);
  Packed<acc_t, N> out;
#pragma unroll
  for (int v = 0; v < N; ++v) out.v[v] = static_cast<acc_t>(raw.v[v]);
  return out;
}

// Elements [d, d + kVec<T>) of row `row` of a matrix `width` wide to shared
// memory, zeros past the row's end and for rows not `row_inside`: one copy_16
// where `vectorized` (rows 16-byte aligned and width a multiple of kVec<T>, so
// that a vector lies wholly inside or outside), else element by element.
template <typename T>
__device__ __forceinline__ void stage_vector(
    T* shared,
    const T* matrix,
    int row,
    int d,
    bool row_inside,
    int width,
    bool vectorized) {
  if (vectorized) {
    const bool inside = row_inside && d < width;
    copy_16(shared, inside ? matrix + row * width + d : matrix, inside);
  } else {
#pragma unroll
    for (int v = 0; v < kVec<T>; ++v) {
      shared[v] = row_inside && d + v < width ? matrix[row * width + d + v] : T(0);
    }
  }
}

// A warp stages rows [first_row, first_row + kRows) of a matrix `width` wide,
// columns [first_col, first_col + kCols), to shared memory kPitch apart, its
// lanes taking kVec<T> elements each in turn; rows at or past `rows` and
// columns past `width` as zeros.
template <int kRows, int kCols, int kPitch, typename T>
__device__ __forceinline__ void stage_rows(
    T* shared,
    const T* matrix,
    int first_row,
    int rows,
    int first_col,
    int width,
    bool vectorized,
    int lane) {
  constexpr int kVectors = kCols / kVec<T>; // a row's
  static_assert(kRows * kVectors % 32 == 0, "every lane copies as many vectors");
#pragma unroll
  for (int u = 0; u < kRows * kVectors / 32; ++u) {
    const int e = lane + 32 * u;
    const int row = first_row + e / kVectors;
    const int col = e % kVectors * kVec<T>;
    stage_vector(shared + e / kVectors * kPitch + col, matrix, row, first_col + col, row < rows, width, vectorized);
  }
}

// What one similarity CTA computes: a tile (a, b) above the diagonal, or two
// diagonal tiles (a, a) and (b, b), b = a + 1 (past the last row block when
// edge is odd). Pairing the diagonal tiles, each as much work as a tile off
// it, gives edge²/2 CTAs: 128 at B = 256, one for each SM of an H200, where
// the 136 tiles one by one doubled up on 4 SMs that then finished last.
struct SimilarityUnit {
  int a;
  int b;
  bool diagonal_pair;
};

__host__ __device__ constexpr int off_diagonal_tiles(int edge) {
  return edge * (edge - 1) / 2;
}

__host__ __device__ constexpr int similarity_units(int edge) {
  return off_diagonal_tiles(edge) + (edge + 1) / 2;
}

// The tiles above the diagonal come first, numbered row by row (those of an
// edge × edge grid above its diagonal are the tiles on or above the diagonal
// of an (edge − 1)-grid, one column to the right), then the diagonal pairs.
__device__ __forceinline__ SimilarityUnit similarity_unit(int index, int edge) {
  const int off_diagonal = off_diagonal_tiles(edge);
  if (index >= off_diagonal) {
    const int a = 2 * (index - off_diagonal);
    return {a, a + 1, true};
  }
  const TilePosition<int> tile = upper_triangle_tile(index, edge - 1);
  return {tile.row, tile.col + 1, false};
}

// The similarity CTA, and so the partial, of tile (row, col), row <= col.
__device__ __forceinline__ int similarity_unit_of(int row, int col, int edge) {
  return row == col ? off_diagonal_tiles(edge) + row / 2 : upper_triangle_start(row, edge - 1) + col - 1 - row;
}

// small_similarity_kernel: off the diagonal each warp takes every kWarps-th
// chunk of kChunk features (128 bytes of a row) and stages the tile's 16 rows,
// then its 16 columns, kPitch apart (a 16-byte pad, so that the rows a load
// of 8 lanes touches fall in different banks); for a diagonal pair, warps
// [0, kWarps/2) take block a and the others block b, every (kWarps/2)-th
// chunk of its 16 rows, which are the tile's columns too.
template <typename scalar_t>
struct SimilarityShape {
  static constexpr int kChunk = 128 / sizeof(scalar_t);
  static constexpr int kPitch = kChunk + kVec<scalar_t>;
  static constexpr int kSlot = 2 * kTile * kPitch; // elements of one staged chunk
  static constexpr size_t kSharedBytes = kWarps * kRing * kSlot * sizeof(scalar_t);
};

// The pairs a thread reduces in the epilogue: one entry of the unit's tile,
// or one of each tile of a diagonal pair.
struct UnitEntries {
  int count; // 1, or 2 for a diagonal pair
  int i[2];
  int j[2];
  bool inside[2]; // a pair of the batch
  bool positive[2];
};

__device__ __forceinline__ UnitEntries unit_entries(const SimilarityUnit& unit, const int64_t* labels, int batch) {
  UnitEntries entries;
  entries.count = unit.diagonal_pair ? 2 : 1;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int tile_row = unit.diagonal_pair && e == 1 ? unit.b : unit.a;
    const int tile_col = unit.diagonal_pair ? tile_row : unit.b;
    entries.i[e] = tile_row * kTile + threadIdx.x / kTile;
    entries.j[e] = tile_col * kTile + threadIdx.x % kTile;
    entries.inside[e] = e < entries.count && entries.i[e] < batch && entries.j[e] < batch;
    entries.positive[e] = entries.inside[e] && labels[entries.i[e]] == labels[entries.j[e]];
  }
  return entries;
}

// A warp's ring of staged chunks of features for its unit: the team of warps
// that share a tile take its chunks in turn, `rank` this warp's place in it.
// A diagonal pair's warps stage 16 rows a chunk, half a slot, so their ring
// holds twice as many chunks: 8 KiB in flight a warp either way.
template <typename scalar_t>
struct SimilarityRing {
  using Shape = SimilarityShape<scalar_t>;

  scalar_t* base; // this warp's kRing slots
  int team;
  int rank;
  bool diagonal_pair;
  int row0; // the first of the rows staged
  int col0; // and of the columns, off the diagonal

  __device__ __forceinline__ SimilarityRing(unsigned char* shared, const SimilarityUnit& unit, int warp)
      : base(reinterpret_cast<scalar_t*>(shared) + warp * kRing * Shape::kSlot),
        team(unit.diagonal_pair ? kWarps / 2 : kWarps),
        rank(warp % team),
        diagonal_pair(unit.diagonal_pair),
        row0((unit.diagonal_pair && warp >= team ? unit.b : unit.a) * kTile),
        col0(unit.b * kTile) {}

  __device__ __forceinline__ int size() const { return diagonal_pair ? 2 * kRing : kRing; }

  __device__ __forceinline__ scalar_t* slot(int chunk) const {
    return base + chunk / team % size() * (diagonal_pair ? kTile * Shape::kPitch : Shape::kSlot);
  }

  // Where a slot's columns are: after its rows, or the rows themselves.
  __device__ __forceinline__ int columns_offset() const { return diagonal_pair ? 0 : kTile * Shape::kPitch; }

  __device__ __forceinline__ void stage(int chunk, const scalar_t* features, int batch, int dim, bool vectorized, int lane) const {
    constexpr int kChunk = Shape::kChunk;
    constexpr int kPitch = Shape::kPitch;
    scalar_t* to = slot(chunk);
    stage_rows<kTile, kChunk, kPitch>(to, features, row0, batch, chunk * kChunk, dim, vectorized, lane);
    if (!diagonal_pair) {
      stage_rows<kTile, kChunk, kPitch>(to + kTile * kPitch, features, col0, batch, chunk * kChunk, dim, vectorized, lane);
    }
  }
};

// Which products of the tile a lane makes: features [quarter·kChunk/4,
// (quarter + 1)·kChunk/4) of each chunk, for the tile's rows row_lane + 4x
// and columns col_lane + 2y: 12 loads from shared memory for 32·V products.
// (A 2 × 4 block over the whole chunk took 6 loads for 8·V, and shared
// memory's bandwidth set the loop's time.)
struct DotLanes {
  int quarter;
  int row_lane;
  int col_lane;

  __device__ __forceinline__ explicit DotLanes(int lane) : quarter(lane / 8), row_lane(lane % 8 / 2), col_lane(lane % 2) {}
};

// The main loop: the warp's chunks, each multiplied once staged, the next
// staged as each slot frees. A diagonal tile is symmetric: its lower-left
// quarter (rows 8–15, columns 0–7) mirrors the upper-right one and is not
// computed, which takes a quarter of the products off the diagonal pairs, the
// CTAs that finish last.
template <bool kDiagonalPair, typename scalar_t, typename acc_t>
__device__ __forceinline__ void accumulate_dots(
    const SimilarityRing<scalar_t>& ring,
    const scalar_t* features,
    int batch,
    int dim,
    bool vectorized,
    int lane,
    acc_t (&dot)[4][8]) {
  using Shape = SimilarityShape<scalar_t>;
  constexpr int kChunk = Shape::kChunk;
  constexpr int kPitch = Shape::kPitch;
  constexpr int V = kVec<scalar_t>;
  const DotLanes lanes(lane);
  const int chunks = (dim + kChunk - 1) / kChunk;
  for (int c = ring.rank; c < chunks; c += ring.team) {
    wait_copies<kDiagonalPair ? 2 * kRing - 1 : kRing - 1>(); // this lane's copies of chunk c have landed
    __syncwarp(); // and every lane's
    // Every load of this warp has landed: the gradient kernel's CTAs may
    // start and fetch their features now. Let in at the start, their loads
    // slowed this kernel's by 1 µs.
    if (c + ring.team >= chunks) allow_dependents_to_start();
    const scalar_t* slot = ring.slot(c);
#pragma unroll
    for (int u = 0; u < kChunk / 4 / V; ++u) {
      const int k = lanes.quarter * (kChunk / 4) + u * V;
      Packed<acc_t, V> a[4];
      Packed<acc_t, V> b[8];
#pragma unroll
      for (int x = 0; x < 4; ++x) a[x] = load_as<acc_t, V>(slot + (lanes.row_lane + 4 * x) * kPitch + k);
#pragma unroll
      for (int y = 0; y < 8; ++y) {
        b[y] = load_as<acc_t, V>(slot + ring.columns_offset() + (lanes.col_lane + 2 * y) * kPitch + k);
      }
#pragma unroll
      for (int x = 0; x < 4; ++x) {
#pragma unroll
        for (int y = 0; y < 8; ++y) {
          if (kDiagonalPair && x >= 2 && y < 4) continue; // rows ≥ 8, columns < 8
#pragma unroll
          for (int v = 0; v < V; ++v) dot[x][y] += a[x].v[v] * b[y].v[v];
        }
      }
    }
    __syncwarp(); // every lane is done with the slot
    if (c + ring.size() * ring.team < chunks) ring.stage(c + ring.size() * ring.team, features, batch, dim, vectorized, lane);
    commit_copies();
  }
}

// The quarters' sums, added across lanes l, l^8, l^16, l^24, and written to
// the warp's (kTile, kTile) block of warp_dots. Each step keeps half of what a
// lane holds and adds its partner's other half, so the lane ends with rows
// row_lane + 4x, x = 2·(quarter/2) + [0, 2), columns col_lane + 2y,
// y = 4·(quarter%2) + [0, 4). On the diagonal the lanes of the upper-right
// quarter write the lower-left one too, which the others did not compute.
template <typename acc_t>
__device__ __forceinline__ void store_warp_dots(
    acc_t (&dot)[4][8],
    bool diagonal_pair,
    int lane,
    acc_t* warp_dots) { // (kTile, kTile): this warp's
  const DotLanes lanes(lane);
  const bool upper_rows = lanes.quarter / 2 == 1;
  const bool upper_columns = lanes.quarter % 2 == 1;
  acc_t rows_half[2][8];
  add_partner_half(flat(dot), upper_rows, 16, flat(rows_half));
  acc_t quarter_sums[2][4];
#pragma unroll
  for (int x = 0; x < 2; ++x) add_partner_half(rows_half[x], upper_columns, 8, quarter_sums[x]);
  const bool computed = !(diagonal_pair && upper_rows && !upper_columns);
  const bool mirrored = diagonal_pair && !upper_rows && upper_columns;
#pragma unroll
  for (int x = 0; x < 2; ++x) {
#pragma unroll
    for (int y = 0; y < 4; ++y) {
      const int row = lanes.row_lane + 4 * (2 * upper_rows + x);
      const int column = lanes.col_lane + 2 * (4 * upper_columns + y);
      if (computed) warp_dots[row * kTile + column] = quarter_sums[x][y];
      if (mirrored) warp_dots[column * kTile + row] = quarter_sums[x][y];
    }
  }
}

// The epilogue: each entry's s (its team's warp sums, in warp order), its
// logit and slope, and the CTA's LSE states of both sets, folded.
template <typename acc_t>
__device__ __forceinline__ void reduce_entries(
    const acc_t* warp_dots, // (kWarps, kTile, kTile)
    const UnitEntries& entries,
    int team,
    const PairLogit<acc_t>& logit,
    acc_t* fold_scratch,
    acc_t (&z)[2],
    acc_t (&slope)[2],
    LseState<acc_t>& positive,
    LseState<acc_t>& negative) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    acc_t s = acc_t(0);
    for (int w = e * team; w < (e + 1) * team && w < kWarps; ++w) s += warp_dots[w * kTile * kTile + threadIdx.x];
    z[e] = logit(s, entries.positive[e], &slope[e]);
    if (entries.inside[e] && entries.positive[e]) positive.add(z[e], acc_t(1));
    if (entries.inside[e] && !entries.positive[e]) negative.add(z[e], acc_t(1));
  }
  block_fold<kThreads>(positive, negative, fold_scratch);
}

// E_ij = exp(z − m)·c for the thread's entries, m the CTA's largest z of the
// pair's set, written for the tile and, off the diagonal, its mirror image.
template <typename acc_t>
__device__ __forceinline__ void store_terms(
    const UnitEntries& entries,
    bool diagonal_pair,
    const acc_t (&z)[2],
    const acc_t (&slope)[2],
    const LseState<acc_t>& positive,
    const LseState<acc_t>& negative,
    int batch,
    acc_t* terms) { // (B, B)
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (!entries.inside[e]) continue;
    const LseState<acc_t> entry{z[e], acc_t(1)};
    const acc_t term = rescaled_sum(entry, entries.positive[e] ? positive.max : negative.max) * slope[e];
    terms[entries.i[e] * batch + entries.j[e]] = term;
    if (!diagonal_pair) terms[entries.j[e] * batch + entries.i[e]] = term;
  }
}

// Indices are 32-bit: fits_small_batch keeps B·D and B² below 2^31.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads, 2) small_similarity_kernel(
    const scalar_t* __restrict__ features, // (B, D)
    const int64_t* __restrict__ labels, // (B,)
    int batch,
    int dim,
    bool vectorized, // rows of features 16-byte aligned
    PairLogit<acc_t> logit,
    acc_t* __restrict__ terms, // (B, B) or null
    acc_t* __restrict__ partials) { // (units, 4)
  using Shape = SimilarityShape<scalar_t>;
  static_assert(kWarps * kTile * kTile * sizeof(acc_t) <= Shape::kSharedBytes, "the warps' sums fit in the staging space");
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  __shared__ acc_t fold_scratch[2 * kWarps];

  const SimilarityUnit unit = similarity_unit(blockIdx.x, (batch + kTile - 1) / kTile);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const UnitEntries entries = unit_entries(unit, labels, batch); // loaded ahead of the main loop
  const SimilarityRing<scalar_t> ring(shared_bytes, unit, warp);

  const int chunks = (dim + Shape::kChunk - 1) / Shape::kChunk;
#pragma unroll
  for (int q = 0; q < 2 * kRing; ++q) {
    if (q < ring.size()) {
      if (ring.rank + q * ring.team < chunks) ring.stage(ring.rank + q * ring.team, features, batch, dim, vectorized, lane);
      commit_copies();
    }
  }
  acc_t dot[4][8] = {};
  if (unit.diagonal_pair) {
    accumulate_dots<true>(ring, features, batch, dim, vectorized, lane, dot);
  } else {
    accumulate_dots<false>(ring, features, batch, dim, vectorized, lane, dot);
  }
  __syncthreads(); // every warp is done with its chunks: the space holds the sums now
  acc_t* warp_dots = reinterpret_cast<acc_t*>(shared_bytes); // [warp][row][column]
  store_warp_dots(dot, unit.diagonal_pair, lane, warp_dots + warp * kTile * kTile);
  __syncthreads();

  acc_t z[2];
  acc_t slope[2];
  LseState<acc_t> positive;
  LseState<acc_t> negative;
  reduce_entries(warp_dots, entries, ring.team, logit, fold_scratch, z, slope, positive, negative);
  if (terms != nullptr) store_terms(entries, unit.diagonal_pair, z, slope, positive, negative, batch, terms);
  if (threadIdx.x == 0) {
    // Off the diagonal the mirror image's pairs count too.
    const acc_t multiplicity = unit.diagonal_pair ? acc_t(1) : acc_t(2);
    positive.sum *= multiplicity;
    negative.sum *= multiplicity;
    PairStates<acc_t>{positive, negative}.store_at(partials, blockIdx.x);
  }
}

// What turns a CTA's terms exp(z − m)·c of one set into gradient weights,
// 2σ(Z)·exp(m − LSE) = exp(m − M)·2σ(Z)/S, M the set's largest z and S its
// Σ exp(z − M), folded from the partials by one warp in acc_t. The loss itself
// is folded in float64 (fold_partials, finish_loss) by a CTA of its own. Every
// gradient CTA waits for this fold, so it is kept short: float32, the block's
// largest max first (FoldOrder::kBlockMaxFirst), no softplus, one log (the
// loss's own fold took 1.5 µs here at B = 256).
template <typename acc_t>
struct WeightScales {
  acc_t max[2]; // [positive, negative]: the set's largest z
  acc_t scale[2]; // 2σ(Z) / Σ exp(z − max)

  // The factor of a CTA's terms of one set, m its largest z of that set. A
  // set the CTA does not hold (m = −inf) gets 0, which also keeps the zeros
  // staged for rows and partners outside the batch zeros.
  __device__ __forceinline__ acc_t factor(int set, acc_t cta_max) const {
    return cta_max == -std::numeric_limits<acc_t>::infinity() || scale[set] == acc_t(0)
        ? acc_t(0)
        : exp(cta_max - max[set]) * scale[set];
  }
};

template <typename acc_t>
__device__ __forceinline__ WeightScales<acc_t> fold_weight_scales(
    const acc_t* partials, // (units, 4)
    int units) {
  LseState<acc_t> positive;
  LseState<acc_t> negative;
  fold_partials<32, FoldOrder::kBlockMaxFirst>(partials, units, static_cast<acc_t*>(nullptr), positive, negative);
  // Z = M_P + M_N + log(S_P·S_N), the maxima summed in float64: they may be
  // large and of opposite signs.
  const double z = static_cast<double>(positive.max) + negative.max + log(positive.sum * negative.sum);
  // An empty set gives a zero gradient, as finish_loss says.
  const acc_t grad_scale =
      one_set_empty(positive.lse(), negative.lse()) ? acc_t(0) : acc_t(2) / (acc_t(1) + exp(-static_cast<acc_t>(z)));
  return {{positive.max, negative.max}, {grad_scale / positive.sum, grad_scale / negative.sum}};
}

// small_gradient_kernel: a CTA owns kTile rows and kSliceCols features of the
// gradient. Each warp takes every kWarps-th chunk of kSpan partners j and
// stages their terms E[j][rows] (E is symmetric), turned into weights in
// place, and their features F[j][slice]. One CTA more, the last, folds the
// loss.
template <typename scalar_t, typename acc_t>
struct GradientShape {
  static constexpr int kSpan = 64 / sizeof(acc_t);
  static constexpr int kSliceCols = 16 * kVec<acc_t>;
  static constexpr int kWeights = kSpan * kTile; // acc_t a slot, then
  static constexpr int kFeatures = kSpan * kSliceCols; // scalar_t
  static constexpr size_t kSlotBytes = kWeights * sizeof(acc_t) + kFeatures * sizeof(scalar_t);
  static constexpr int kOutputs = kTile * kSliceCols / kThreads; // per thread, in the final sum
  // Shared memory: the warps' staging, then their sums.
  static constexpr size_t kSharedBytes =
      std::max(kWarps * kRing * kSlotBytes, kWarps * kTile * kSliceCols * sizeof(acc_t));
  static_assert(kTile % kSpan == 0, "a chunk's partners lie in one column block");
};

// The loss of the small path, from the similarity kernel's partials: the
// gradient kernel's last CTA and, for the loss alone, finalize_kernel fold
// them alike, so that both paths give the same bits.
constexpr int kLossFoldThreads = kThreads;

// A warp's ring of staged chunks for one gradient CTA: each slot holds kSpan
// partners' terms of the CTA's rows, [partner][row], then their features of
// its slice, [partner][feature].
template <typename scalar_t, typename acc_t>
struct GradientRing {
  using Shape = GradientShape<scalar_t, acc_t>;

  unsigned char* base; // this warp's kRing slots
  int row0; // the CTA's first row
  int col0; // and its first feature

  __device__ __forceinline__ acc_t* weights(int chunk) const {
    return reinterpret_cast<acc_t*>(base + chunk / kWarps % kRing * Shape::kSlotBytes);
  }
  __device__ __forceinline__ scalar_t* features(int chunk) const {
    return reinterpret_cast<scalar_t*>(weights(chunk) + Shape::kWeights);
  }
  __device__ __forceinline__ void stage_features(
      int chunk, const scalar_t* features_in, int batch, int dim, bool vectorized, int lane) const {
    stage_rows<Shape::kSpan, Shape::kSliceCols, Shape::kSliceCols>(
        features(chunk), features_in, chunk * Shape::kSpan, batch, col0, dim, vectorized, lane);
  }
  __device__ __forceinline__ void stage_terms(int chunk, const acc_t* terms, int batch, bool vectorized, int lane) const {
    stage_rows<Shape::kSpan, kTile, kTile>(weights(chunk), terms, chunk * Shape::kSpan, batch, row0, batch, vectorized, lane);
  }
};

// The factor of each tile of the CTA's row block by set, one lane of warp 0
// per column block: from the fold of every partial and the tile's own maxima.
template <typename acc_t>
__device__ __forceinline__ void tile_set_factors(
    const acc_t* partials, // (units, 4), in shared memory
    int units,
    int row_block,
    int edge,
    int lane,
    acc_t (&set_factor)[2][kSmallBatch / kTile]) {
  const WeightScales<acc_t> scales = fold_weight_scales(partials, units);
  if (lane < edge) {
    const int unit = similarity_unit_of(min(row_block, lane), max(row_block, lane), edge);
    const PairStates<acc_t> states = PairStates<acc_t>::at(partials, unit);
    set_factor[0][lane] = scales.factor(0, states.positive.max);
    set_factor[1][lane] = scales.factor(1, states.negative.max);
  }
}

// A staged chunk's terms to weights, in place, by the factor of their set:
// positive pairs' slopes −γ·αp carry the sign of −γ, negative pairs' γ·αn
// that of γ (a zero term stays zero either way).
template <int kCount, typename acc_t>
__device__ __forceinline__ void terms_to_weights(
    acc_t* slot, acc_t positive_factor, acc_t negative_factor, bool gamma_negative, int lane) {
#pragma unroll
  for (int u = 0; u < kCount / 32; ++u) {
    const acc_t term = slot[lane + 32 * u];
    const bool negative_sign = signbit(term);
    slot[lane + 32 * u] = term * (negative_sign != gamma_negative ? positive_factor : negative_factor);
  }
}

// Which products of a chunk a lane makes: partners [partner_half·kSpan/2,
// (partner_half + 1)·kSpan/2), for rows 8·row_half + [0, 8) and features
// V·feature_lane + [0, V) and the same kSliceCols/2 on: 4 loads from shared
// memory for 16·V products, where a block of 4 rows over every partner took
// 3 for 8·V.
struct GradientLanes {
  int partner_half;
  int row_half;
  int feature_lane;

  __device__ __forceinline__ explicit GradientLanes(int lane)
      : partner_half(lane / 16), row_half(lane % 16 / 8), feature_lane(lane % 8) {}
};

// One chunk's weighted features added to the lane's sums.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void add_weighted_features(
    const acc_t* weight, // [partner][row]
    const scalar_t* member, // [partner][feature]
    const GradientLanes& lanes,
    acc_t (&sum)[8][2 * kVec<acc_t>]) {
  using Shape = GradientShape<scalar_t, acc_t>;
  constexpr int kSpan = Shape::kSpan;
  constexpr int kSliceCols = Shape::kSliceCols;
  constexpr int V = kVec<acc_t>;
#pragma unroll
  for (int q = 0; q < kSpan / 2; ++q) {
    const int p = lanes.partner_half * (kSpan / 2) + q;
    Packed<acc_t, 4> w[2];
#pragma unroll
    for (int x = 0; x < 2; ++x) w[x] = load_as<acc_t, 4>(weight + p * kTile + 8 * lanes.row_half + 4 * x);
    const Packed<acc_t, V> f0 = load_as<acc_t, V>(member + p * kSliceCols + V * lanes.feature_lane);
    const Packed<acc_t, V> f1 = load_as<acc_t, V>(member + p * kSliceCols + kSliceCols / 2 + V * lanes.feature_lane);
#pragma unroll
    for (int r = 0; r < 8; ++r) {
#pragma unroll
      for (int v = 0; v < V; ++v) {
        sum[r][v] += w[r / 4].v[r % 4] * f0.v[v];
        sum[r][V + v] += w[r / 4].v[r % 4] * f1.v[v];
      }
    }
  }
}

// The two partner halves' sums, added across lanes l and l^16, written to the
// warp's (kTile, kSliceCols) block of warp_sums: the lane keeps rows
// 8·row_half + 4·partner_half + [0, 4) and adds its partner's.
template <int kSliceCols, typename acc_t>
__device__ __forceinline__ void store_warp_sums(
    acc_t (&sum)[8][2 * kVec<acc_t>],
    const GradientLanes& lanes,
    acc_t* warp_sums) { // (kTile, kSliceCols): this warp's
  constexpr int V = kVec<acc_t>;
  acc_t row_sums[4][2 * V];
  add_partner_half(flat(sum), lanes.partner_half == 1, 16, flat(row_sums));
#pragma unroll
  for (int r = 0; r < 4; ++r) {
#pragma unroll
    for (int v = 0; v < 2 * V; ++v) {
      const int row = 8 * lanes.row_half + 4 * lanes.partner_half + r;
      const int feature = (v < V ? 0 : kSliceCols / 2) + V * lanes.feature_lane + v % V;
      warp_sums[row * kSliceCols + feature] = row_sums[r][v];
    }
  }
}

// The CTA's block of the gradient: the warps' sums added in warp order.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void store_gradient(
    const acc_t* warp_sums, // (kWarps, kTile, kSliceCols)
    int row0,
    int col0,
    int batch,
    int dim,
    scalar_t* grad) { // (B, D)
  using Shape = GradientShape<scalar_t, acc_t>;
  constexpr int kSliceCols = Shape::kSliceCols;
#pragma unroll
  for (int u = 0; u < Shape::kOutputs; ++u) {
    const int e = threadIdx.x + kThreads * u;
    acc_t total = acc_t(0);
    for (int w = 0; w < kWarps; ++w) total += warp_sums[w * kTile * kSliceCols + e];
    const int i = row0 + e / kSliceCols;
    const int d = col0 + e % kSliceCols;
    if (i < batch && d < dim) grad[i * dim + d] = static_cast<scalar_t>(total);
  }
}

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads, 2) small_gradient_kernel(
    const scalar_t* __restrict__ features, // (B, D)
    int batch,
    int dim,
    bool vectorized_features, // rows of features 16-byte aligned
    bool vectorized_terms, // rows of terms 16-byte aligned
    const acc_t* __restrict__ terms, // (B, B)
    const acc_t* __restrict__ partials, // (units, 4)
    int units,
    bool gamma_negative,
    scalar_t* __restrict__ loss, // ()
    scalar_t* __restrict__ grad) { // (B, D)
  using Shape = GradientShape<scalar_t, acc_t>;
  constexpr int kSpan = Shape::kSpan;
  constexpr int kSliceCols = Shape::kSliceCols;
  constexpr int V = kVec<acc_t>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  __shared__ acc_t set_factor[2][kSmallBatch / kTile]; // [positive, negative][column block]
  __shared__ __align__(16) acc_t staged_partials[PairStates<acc_t>::kValues * similarity_units(kSmallBatch / kTile)];

  if (blockIdx.x == gridDim.x - 1) {
    __shared__ double scratch[2 * kLossFoldThreads / 32];
    static_assert(kLossFoldThreads == kThreads, "the loss CTA folds with all its threads");
    wait_for_prerequisites();
    LseState<double> positive_set;
    LseState<double> negative_set;
    fold_partials<kLossFoldThreads>(partials, units, scratch, positive_set, negative_set);
    if (threadIdx.x == 0) store_loss(finish_loss(positive_set.lse(), negative_set.lse()), loss);
    return;
  }
  const int edge = (batch + kTile - 1) / kTile;
  const int row_block = blockIdx.x % edge;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const GradientRing<scalar_t, acc_t> ring{
      shared_bytes + warp * kRing * Shape::kSlotBytes, row_block * kTile, static_cast<int>(blockIdx.x / edge) * kSliceCols};

  // The features do not depend on the similarity kernel: their copies start
  // before it has finished, in the group the partials close.
  const int chunks = (batch + kSpan - 1) / kSpan;
#pragma unroll
  for (int q = 0; q < kRing; ++q) {
    if (warp + q * kWarps < chunks) ring.stage_features(warp + q * kWarps, features, batch, dim, vectorized_features, lane);
  }
  wait_for_prerequisites();
  // The partials go to shared memory in a group of their own (with the
  // features), ahead of the terms: the fold starts as soon as they land.
  constexpr int kPartialVectors = 4 / kVec<acc_t>; // 16-byte vectors a partial
  for (int e = threadIdx.x; e < units * kPartialVectors; e += kThreads) {
    copy_16(staged_partials + e * kVec<acc_t>, partials + e * kVec<acc_t>, true);
  }
  commit_copies();
#pragma unroll
  for (int q = 0; q < kRing; ++q) {
    if (warp + q * kWarps < chunks) ring.stage_terms(warp + q * kWarps, terms, batch, vectorized_terms, lane);
    commit_copies();
  }
  wait_copies<kRing>();
  __syncthreads(); // every thread's copies of the partials have landed
  if (warp == 0) tile_set_factors(staged_partials, units, row_block, edge, lane, set_factor);
  __syncthreads();

  const GradientLanes lanes(lane);
  acc_t sum[8][2 * V] = {};
  for (int c = warp; c < chunks; c += kWarps) {
    wait_copies<kRing - 1>(); // this lane's copies of chunk c have landed
    __syncwarp(); // and every lane's
    const int col_block = c * kSpan / kTile;
    terms_to_weights<Shape::kWeights>(ring.weights(c), set_factor[0][col_block], set_factor[1][col_block],
                                      gamma_negative, lane);
    __syncwarp();
    add_weighted_features<scalar_t>(ring.weights(c), ring.features(c), lanes, sum);
    __syncwarp(); // every lane is done with the slot
    if (c + kRing * kWarps < chunks) {
      ring.stage_features(c + kRing * kWarps, features, batch, dim, vectorized_features, lane);
      ring.stage_terms(c + kRing * kWarps, terms, batch, vectorized_terms, lane);
    }
    commit_copies();
  }
  __syncthreads(); // every warp is done with its chunks: the space holds the sums now
  acc_t* warp_sums = reinterpret_cast<acc_t*>(shared_bytes); // [warp][row][feature]
  store_warp_sums<kSliceCols>(sum, lanes, warp_sums + warp * kTile * kSliceCols);
  __syncthreads();
  store_gradient<scalar_t>(warp_sums, ring.row0, ring.col0, batch, dim, grad);
}

// The loss, and with grad given dloss/dfeatures, of one small batch.
template <typename scalar_t>
void small_batch(
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    double margin,
    double gamma,
    at::Tensor& loss, // ()
    at::Tensor* grad) { // (B, D) or null
  using acc_t = at::opmath_type<scalar_t>;
  const int batch = static_cast<int>(features.size(0));
  const int dim = static_cast<int>(features.size(1));
  const int edge = (batch + kTile - 1) / kTile;
  const int units = similarity_units(edge);
  const PairLogit<acc_t> logit{static_cast<acc_t>(margin), static_cast<acc_t>(gamma)};
  const scalar_t* feature_data = features.data_ptr<scalar_t>();
  const bool vectorized = dim % kVec<scalar_t> == 0 && reinterpret_cast<uintptr_t>(feature_data) % 16 == 0;
  // The CTAs' partials, then E when the gradient needs it (16-byte aligned:
  // 4 values a CTA).
  at::Tensor workspace =
      at::empty({PairStates<acc_t>::kValues * units + (grad != nullptr ? int64_t{batch} * batch : 0)},
                features.options().dtype(dtype_of<acc_t>()));
  acc_t* partials = workspace.data_ptr<acc_t>();
  acc_t* terms = grad != nullptr ? partials + PairStates<acc_t>::kValues * units : nullptr;

  constexpr auto similarity_kernel = small_similarity_kernel<scalar_t, acc_t>;
  constexpr size_t similarity_bytes = SimilarityShape<scalar_t>::kSharedBytes;
  // The largest carveout lets a gradient CTA, started early by its dependent
  // launch, fit on an SM beside a similarity CTA: by default the driver sizes
  // an SM's carveout for the kernel it runs first, which left too little room.
  configure_kernel<similarity_kernel>(similarity_bytes, /*largest_carveout=*/true);
  similarity_kernel<<<units, kThreads, similarity_bytes, c10::cuda::getCurrentCUDAStream()>>>(
      feature_data, labels.data_ptr<int64_t>(), batch, dim, vectorized, logit, terms, partials);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (grad == nullptr) {
    launch_finalize<kLossFoldThreads, acc_t, scalar_t>(partials, units, nullptr, nullptr, loss.data_ptr<scalar_t>());
    return;
  }
  *grad = at::empty_like(features);
  using Shape = GradientShape<scalar_t, acc_t>;
  constexpr auto gradient_kernel = small_gradient_kernel<scalar_t, acc_t>;
  configure_kernel<gradient_kernel>(Shape::kSharedBytes, /*largest_carveout=*/true);
  // One CTA per row block and slice of the features, and the loss's.
  const int slices = std::max((dim + Shape::kSliceCols - 1) / Shape::kSliceCols, 1);
  const dim3 grid(edge * slices + 1);
  launch_kernel(/*dependent=*/true, gradient_kernel, grid, dim3(kThreads), Shape::kSharedBytes, feature_data, batch, dim,
                vectorized, batch % kVec<acc_t> == 0, static_cast<const acc_t*>(terms),
                static_cast<const acc_t*>(partials), units, std::signbit(gamma), loss.data_ptr<scalar_t>(),
                grad->data_ptr<scalar_t>());
}

} // namespace

std::tuple<at::Tensor, at::Tensor> small_batch_loss(
    const at::Tensor& features,
    const at::Tensor& labels,
    double margin,
    double gamma,
    bool with_grad) {
  at::Tensor loss = at::empty({}, features.options());
  at::Tensor grad;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, features.scalar_type(), "circle_loss_small_batch", [&] {
    small_batch<scalar_t>(features, labels, margin, gamma, loss, with_grad ? &grad : nullptr);
  });
  return {loss, grad};
}

} // namespace circle_loss
