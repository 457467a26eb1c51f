// Grouped SwiGLU experts for the CPU train step (forward and backward), each expert's group of rows as
// OpenBLAS sgemm calls (scipy-openblas32, the BLAS numpy ships). Two XLA FFI handlers
// (`TarsGroupedSwigluFwd`, `TarsGroupedSwigluBwd`) registered by `tars_jax/models/expert_kernel.py`,
// which documents shapes and why: for the MoE shapes of the benchmark model OpenBLAS runs these
// products faster than XLA:CPU's dots in the `grouped` while loop.
//
// Rows of `xs` are sorted by expert: expert e owns rows [start_e, start_e + sizes[e]). Weights:
// gate|up [E, D, 2I] (gate columns first: `MoE.w_gate_up` [E, D, 2, I] reshaped), down [E, I, D].
// Row chunks of the experts' groups (and, for the weight gradients, blocks of output columns) run in
// parallel on XLA's intra-op pool (`common.h`), each sgemm on one thread: OpenBLAS is set to one
// thread, so no second thread pool competes with XLA's (with OpenBLAS threading its own calls the
// train step was no faster than XLA's loop).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cblas.h"  // scipy-openblas32: scipy_cblas_* symbols
#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// C[M, N] = op(A) op(B), row-major.
void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, float* c, int64_t ldc) {
  scipy_cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, m, n, k,
                    1.0f, a, lda, b, ldb, 0.0f, c, ldc);
}

// OpenBLAS single-threaded, set once when the library loads.
const bool kOneBlasThread = [] {
  scipy_openblas_set_num_threads(1);
  return true;
}();

// C[M, N] = A^T B over K rows (a weight gradient); K = 0 (an expert with no rows): C = 0 (an sgemm
// with K = 0 would leave C unwritten). C may be a column block of a wider matrix (row stride ldc).
void GemmTN(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
            int64_t ldc) {
  if (k) return Gemm(true, false, m, n, k, a, lda, b, ldb, c, ldc);
  for (int64_t r = 0; r < m; ++r) std::memset(c + r * ldc, 0, n * sizeof(float));
}

inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

ffi::Error CheckShapes(const char* who, ffi::Buffer<ffi::F32>& xs, ffi::Buffer<ffi::S32>& sizes,
                       ffi::Buffer<ffi::F32>& wgu, ffi::Buffer<ffi::F32>& wd) {
  const auto xd = xs.dimensions(), gd = wgu.dimensions(), dd = wd.dimensions();
  if (xd.size() != 2 || gd.size() != 3 || dd.size() != 3 || gd[0] != sizes.element_count() || dd[0] != gd[0] ||
      gd[1] != xd[1] || dd[2] != xd[1] || gd[2] != 2 * dd[1])
    return ffi::Error::InvalidArgument(std::string(who) + ": want xs [G, D], sizes [E], w_gate_up [E, D, 2I], w_down [E, I, D]");
  return ffi::Error::Success();
}

// Tasks of at most kChunkRows rows of one expert's group: both cores stay busy whatever the group
// sizes, and a helper that starts late still finds work. (Fewer rows per sgemm repack the expert's
// weights more often: 128 rows keep that a small share of the product.)
constexpr int64_t kChunkRows = 128;

struct RowChunk {
  int64_t expert, start, rows;
};

std::vector<RowChunk> RowChunks(const int32_t* sizes, const std::vector<int64_t>& start, int64_t experts) {
  std::vector<RowChunk> chunks;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = sizes[e], pieces = (n + kChunkRows - 1) / kChunkRows;
    for (int64_t c = 0; c < pieces; ++c) {  // pieces of near-equal size
      const int64_t lo = n * c / pieces, hi = n * (c + 1) / pieces;
      chunks.push_back({e, start[e] + lo, hi - lo});
    }
  }
  return chunks;
}

// ys [G, D] and the gate|up pre-activations ab [G, 2I] (kept for the backward).
ffi::Error FwdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> xs, ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::F32> wgu,
                   ffi::Buffer<ffi::F32> wd, ffi::ResultBuffer<ffi::F32> ys, ffi::ResultBuffer<ffi::F32> ab) {
  if (auto err = CheckShapes("TarsGroupedSwigluFwd", xs, sizes, wgu, wd); err.failure()) return err;
  const int64_t g = xs.dimensions()[0], d = xs.dimensions()[1], experts = wgu.dimensions()[0],
                i = wd.dimensions()[1];
  const int32_t* sz = sizes.typed_data();
  if (auto err = tars::CheckGroups(sz, experts, g); err.failure()) return err;
  const auto start = tars::GroupStarts(sz, experts);
  const int64_t total = start[experts];
  const float* x = xs.typed_data();
  float* y = ys->typed_data();
  float* p = ab->typed_data();
  const auto chunks = RowChunks(sz, start, experts);
  tars::ParallelFor(pool, static_cast<int64_t>(chunks.size()), [&](int64_t t) {
    const auto [e, s, n] = chunks[t];
    std::vector<float> h(n * i);
    float* pe = p + s * 2 * i;
    Gemm(false, false, n, 2 * i, d, x + s * d, d, wgu.typed_data() + e * d * 2 * i, 2 * i, pe, 2 * i);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < i; ++j) {
        const float a = pe[r * 2 * i + j], b = pe[r * 2 * i + i + j];
        h[r * i + j] = a * Sigmoid(a) * b;
      }
    Gemm(false, false, n, d, i, h.data(), i, wd.typed_data() + e * i * d, d, y + s * d, d);
  });
  std::memset(y + total * d, 0, (g - total) * d * sizeof(float));
  std::memset(p + total * 2 * i, 0, (g - total) * 2 * i * sizeof(float));
  return ffi::Error::Success();
}

// (dxs [G, D], d w_gate_up [E, D, 2I], d w_down [E, I, D]) from xs, sizes, weights, ab, dys [G, D].
// Two parallel phases: per row chunk, h, the SwiGLU derivative dab and dx (rows independent); then
// per expert and block of output columns, the weight gradients (sums over the expert's rows).
ffi::Error BwdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> xs, ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::F32> wgu,
                   ffi::Buffer<ffi::F32> wd, ffi::Buffer<ffi::F32> ab, ffi::Buffer<ffi::F32> dys,
                   ffi::ResultBuffer<ffi::F32> dxs, ffi::ResultBuffer<ffi::F32> dwgu, ffi::ResultBuffer<ffi::F32> dwd) {
  if (auto err = CheckShapes("TarsGroupedSwigluBwd", xs, sizes, wgu, wd); err.failure()) return err;
  const int64_t g = xs.dimensions()[0], d = xs.dimensions()[1], experts = wgu.dimensions()[0],
                i = wd.dimensions()[1];
  if (ab.dimensions()[0] != g || ab.dimensions()[1] != 2 * i || dys.dimensions()[0] != g || dys.dimensions()[1] != d)
    return ffi::Error::InvalidArgument("TarsGroupedSwigluBwd: want ab [G, 2I] and dys [G, D]");
  const int32_t* sz = sizes.typed_data();
  if (auto err = tars::CheckGroups(sz, experts, g); err.failure()) return err;
  const auto start = tars::GroupStarts(sz, experts);
  const int64_t total = start[experts];
  const float* x = xs.typed_data();
  const float* dy = dys.typed_data();
  float* dx = dxs->typed_data();
  std::vector<float> h(total * i), dab(total * 2 * i);  // per routed row, for the weight gradients

  const auto chunks = RowChunks(sz, start, experts);
  tars::ParallelFor(pool, static_cast<int64_t>(chunks.size()), [&](int64_t t) {
    const auto [e, s, n] = chunks[t];
    const float* pe = ab.typed_data() + s * 2 * i;
    float* he = h.data() + s * i;
    float* de = dab.data() + s * 2 * i;
    std::vector<float> dh(n * i);
    Gemm(false, true, n, i, d, dy + s * d, d, wd.typed_data() + e * i * d, d, dh.data(), i);  // dh = dy wd^T
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < i; ++j) {
        const float a = pe[r * 2 * i + j], b = pe[r * 2 * i + i + j], sig = Sigmoid(a), silu = a * sig,
                    g_ = dh[r * i + j];
        he[r * i + j] = silu * b;
        de[r * 2 * i + j] = g_ * b * sig * (1.0f + a * (1.0f - sig));  // d/da: silu'(a) = sig (1 + a (1 - sig))
        de[r * 2 * i + i + j] = g_ * silu;                                // d/db
      }
    Gemm(false, true, n, d, 2 * i, de, 2 * i, wgu.typed_data() + e * d * 2 * i, 2 * i, dx + s * d, d);  // dab wgu^T
  });

  // Weight gradients: per expert, dwgu = x^T dab in kBlocks column blocks of 2I, and dwd = h^T dy.
  constexpr int64_t kBlocks = 3;  // + 1 task for dwd: four tasks of similar cost (2I / 3 ~ D columns)
  tars::ParallelFor(pool, experts * (kBlocks + 1), [&](int64_t t) {
    const int64_t e = t / (kBlocks + 1), blk = t % (kBlocks + 1), n = sz[e], s = start[e];
    if (blk == kBlocks) {  // dwd = h^T dy
      GemmTN(i, d, n, h.data() + s * i, i, dy + s * d, d, dwd->typed_data() + e * i * d, d);
      return;
    }
    const int64_t lo = 2 * i * blk / kBlocks, hi = 2 * i * (blk + 1) / kBlocks;  // dwgu[:, lo:hi] = x^T dab[:, lo:hi]
    GemmTN(d, hi - lo, n, x + s * d, d, dab.data() + s * 2 * i + lo, 2 * i, dwgu->typed_data() + e * d * 2 * i + lo,
           2 * i);
  });
  std::memset(dx + total * d, 0, (g - total) * d * sizeof(float));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TarsGroupedSwigluFwd, FwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TarsGroupedSwigluBwd, BwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
