// Decode-time MoE experts on XLA:CPU: the SwiGLU of each expert over the few rows routed to it,
// streaming each expert's weights once from tile-packed copies. Two XLA FFI handlers
// (`TarsMoeGateUp`, `TarsMoeDown`), built and registered by `tars_jax/models/expert_kernel.py`,
// which documents the layouts and why (XLA:CPU's Eigen dots read an expert's weights well below
// memory bandwidth for 1-16 rows; a register-tiled loop over packed weights on all cores streams them
// much closer to it).
//
// Rows of `xs` are sorted by expert: expert e owns rows [start_e, start_e + sizes[e]).
// Work is split into (expert, column tile) tasks shared by the calling thread and helpers on XLA's
// intra-op thread pool (`common.h`).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kGateUpTile = 8;  // gate|up: 8 gate + 8 up columns per packed row (one 64-byte line)
constexpr int kDownTile = 16;   // down: 16 columns per packed row (one 64-byte line)
constexpr int kRows = 4;        // rows per register block

// acc[r][p][j] = sum_k x[r, k] * w[k, p, j] for R rows of x (row stride ldx) and a packed tile
// w [K, P, W] (contiguous). GCC vector types (8 floats: one AVX2 register) so the R * P * W / 8
// accumulators stay in registers.
typedef float V8 __attribute__((vector_size(32)));

inline V8 Load8(const float* p) {
  V8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

template <int R, int P, int W>
inline void TileDot(const float* x, int64_t ldx, const float* w, int64_t k_dim, float (&acc)[R][P][W]) {
  constexpr int kV = P * W / 8;  // vectors per packed row
  V8 a[R][kV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kV; ++v) a[r][v] = V8{};
  for (int64_t k = 0; k < k_dim; ++k) {
    V8 wk[kV];
    for (int v = 0; v < kV; ++v) wk[v] = Load8(w + k * P * W + 8 * v);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      for (int v = 0; v < kV; ++v) a[r][v] += xv * wk[v];
    }
  }
  for (int r = 0; r < R; ++r) __builtin_memcpy(&acc[r][0][0], &a[r][0], sizeof(a[r]));
}

// h[row, t*W + j] = silu(x @ gate)[j] * (x @ up)[j] for R rows.
template <int R>
void GateUpRows(const float* x, int64_t d, const float* w_tile, float* h, int64_t i_dim, int64_t col) {
  float acc[R][2][kGateUpTile];
  TileDot<R, 2, kGateUpTile>(x, d, w_tile, d, acc);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kGateUpTile; ++j) {
      const float g = acc[r][0][j];
      h[r * i_dim + col + j] = g / (1.0f + std::exp(-g)) * acc[r][1][j];
    }
}

template <int R>
void DownRows(const float* h, int64_t i_dim, const float* w_tile, float* y, int64_t d, int64_t col) {
  float acc[R][1][kDownTile];
  TileDot<R, 1, kDownTile>(h, i_dim, w_tile, i_dim, acc);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kDownTile; ++j) y[r * d + col + j] = acc[r][0][j];
}

// fn(rows, x_offset_rows) over row blocks of kRows, the remainder with 1-3 rows.
template <typename F4, typename F1>
void ForRowBlocks(int64_t n, F4&& four, F1&& one) {
  int64_t r = 0;
  for (; r + kRows <= n; r += kRows) four(r);
  for (; r < n; ++r) one(r);
}

// Runs run(e, t) for every expert e with rows and every tile t < tiles (`tars::ParallelFor`).
void ParallelTiles(ffi::ThreadPool& pool, const int32_t* sizes, int64_t experts, int64_t tiles,
                   const std::function<void(int64_t, int64_t)>& run) {
  std::vector<int64_t> active;
  for (int64_t e = 0; e < experts; ++e)
    if (sizes[e] > 0) active.push_back(e);
  tars::ParallelFor(pool, static_cast<int64_t>(active.size()) * tiles,
                    [&](int64_t task) { run(active[task / tiles], task % tiles); });
}

// The rows of each expert's group through its packed weight tiles: kernel(rows tag R, R input rows,
// weight tile, R output rows, first output column) for every (expert, tile) and block of R = kRows
// (then 1) rows; output rows past sum(sizes) are zeroed.
template <typename Kernel>
ffi::Error Tiled(ffi::ThreadPool& pool, const int32_t* sz, int64_t experts, int64_t tiles, int64_t g, const float* in,
                 int64_t in_ld, const float* wp, int64_t tile_size, int64_t tile_cols, float* out, int64_t out_ld,
                 Kernel kernel) {
  if (auto err = tars::CheckGroups(sz, experts, g); err.failure()) return err;
  const auto start = tars::GroupStarts(sz, experts);
  std::fill(out + start[experts] * out_ld, out + g * out_ld, 0.0f);
  ParallelTiles(pool, sz, experts, tiles, [&](int64_t e, int64_t t) {
    const float* wt = wp + (e * tiles + t) * tile_size;
    auto rows = [&](auto tag, int64_t r) {
      kernel(tag, in + (start[e] + r) * in_ld, wt, out + (start[e] + r) * out_ld, t * tile_cols);
    };
    ForRowBlocks(
        sz[e], [&](int64_t r) { rows(std::integral_constant<int, kRows>{}, r); },
        [&](int64_t r) { rows(std::integral_constant<int, 1>{}, r); });
  });
  return ffi::Error::Success();
}

// xs [G, D], sizes [E] int32, w_gate_up packed [E, I/8, D, 2, 8] -> h [G, I] (rows past sum(sizes): 0).
ffi::Error GateUpImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> xs, ffi::Buffer<ffi::S32> sizes,
                      ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> h) {
  const auto xd = xs.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 5 || wd[3] != 2 || wd[4] != kGateUpTile || wd[2] != xd[1] ||
      wd[0] != sizes.element_count())
    return ffi::Error::InvalidArgument("TarsMoeGateUp: want xs [G, D], sizes [E], w [E, I/8, D, 2, 8]");
  const int64_t d = xd[1], tiles = wd[1], i_dim = tiles * kGateUpTile;
  return Tiled(pool, sizes.typed_data(), wd[0], tiles, xd[0], xs.typed_data(), d, w.typed_data(), d * 2 * kGateUpTile,
               kGateUpTile, h->typed_data(), i_dim, [&](auto tag, const float* x, const float* wt, float* o, int64_t col) {
                 GateUpRows<decltype(tag)::value>(x, d, wt, o, i_dim, col);
               });
}

// h [G, I], sizes [E] int32, w_down packed [E, D/16, I, 16] -> y [G, D] (rows past sum(sizes): 0).
ffi::Error DownImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::S32> sizes,
                    ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto hd = h.dimensions(), wd = w.dimensions();
  if (hd.size() != 2 || wd.size() != 4 || wd[3] != kDownTile || wd[2] != hd[1] || wd[0] != sizes.element_count())
    return ffi::Error::InvalidArgument("TarsMoeDown: want h [G, I], sizes [E], w [E, D/16, I, 16]");
  const int64_t i_dim = hd[1], tiles = wd[1], d = tiles * kDownTile;
  return Tiled(pool, sizes.typed_data(), wd[0], tiles, hd[0], h.typed_data(), i_dim, w.typed_data(), i_dim * kDownTile,
               kDownTile, y->typed_data(), d, [&](auto tag, const float* hr, const float* wt, float* o, int64_t col) {
                 DownRows<decltype(tag)::value>(hr, i_dim, wt, o, d, col);
               });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TarsMoeGateUp, GateUpImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TarsMoeDown, DownImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
