// W8A8 block-scaled FP8 GEMM through cuBLASLt, as an XLA FFI custom call (fp8rl_jax.quant.cublaslt).
//
//   out [M, N] = (A [M, K] x a_scale 1x128) @ (B [N, K] x b_scale_inv 128x128)^T, float32 accumulation,
//
// the math of pallas_kernels.fp8_gemm (DeepSeek-V3 / vLLM block scales), done by cuBLASLt's block-scaled
// FP8 matmul (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F x BLK128x128_32F, cuBLAS >= 12.9, Hopper). cuBLAS is
// column-major, so it computes out^T [N, M] = B [N, K] . A^T: its "A" operand is our weight (K-major, TRANSA = T,
// 128x128 block scales laid out like the data: [N/128][ld] with the K blocks contiguous, ld = K/128 rounded up
// to 4) and its "B" operand our activations (K-major, TRANSB = N, 1x128 scales M-contiguous: [K/128][M]).
// With the attribute b_blocks = 0, B's scales are 1x128 per row as well, transposed the same way ([K/128][N]):
// the 1D x 1D scaling of an FP8 training's weight gradient, both operands grouped along the contraction.
//
// Algorithm choice: cuBLASLt's heuristic ranks the algorithms it has for a shape; the call takes the one at index
// `algo` of that list (0: the heuristic's first) and, with `split_k` > 0, pins its K splits (1: none; > 1: float32
// partials in the workspace summed by a second kernel, CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE), checked with
// cublasLtMatmulAlgoCheck. An index past the list, or splits the algorithm refuses, falls back to the heuristic's
// first (a tuning table made with another cuBLASLt must not break a run). fp8rl_cublaslt_algos lists the algorithms
// for a shape, for the tuning sweep (python -m experiments.bench cublaslt_tune).
//
// No CUDA or cuBLAS header is needed to build this file (g++ and jaxlib's FFI headers only): the few cuBLASLt
// entry points used are declared below with the values of cuBLAS 13's cublasLt.h (checked against the real
// header by cublaslt_check.cc wherever that header exists) and resolved with dlopen at the first call, from the
// library path the Python side passes (the libcublasLt that jax's CUDA plugin loads) or the usual sonames.

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// ---- the subset of cublasLt.h used (values of cuBLAS 13.x; cublaslt_check.cc compares them with the header) ----
namespace fp8rl_lt {
typedef int Status;
typedef struct Context* Handle;
typedef struct MatmulDescOpaque* MatmulDesc;
typedef struct MatrixLayoutOpaque* MatrixLayout;
typedef struct PreferenceOpaque* Preference;
typedef struct CUstream_st* Stream;
struct Algo {
  uint64_t data[8];
};
struct HeuristicResult {
  Algo algo;
  size_t workspaceSize;
  Status state;
  float wavesCount;
  int reserved[4];
};

constexpr Status kSuccess = 0;
constexpr int kCudaR32F = 0;         // CUDA_R_32F
constexpr int kCudaR16BF = 14;       // CUDA_R_16BF
constexpr int kCudaR8FE4M3 = 28;     // CUDA_R_8F_E4M3
constexpr int kComputeF32 = 68;      // CUBLAS_COMPUTE_32F
constexpr int32_t kOpN = 0;          // CUBLAS_OP_N
constexpr int32_t kOpT = 1;          // CUBLAS_OP_T
constexpr int kDescTransA = 3;       // CUBLASLT_MATMUL_DESC_TRANSA
constexpr int kDescTransB = 4;       // CUBLASLT_MATMUL_DESC_TRANSB
constexpr int kDescAScalePtr = 17;   // CUBLASLT_MATMUL_DESC_A_SCALE_POINTER
constexpr int kDescBScalePtr = 18;   // CUBLASLT_MATMUL_DESC_B_SCALE_POINTER
constexpr int kDescAScaleMode = 31;  // CUBLASLT_MATMUL_DESC_A_SCALE_MODE
constexpr int kDescBScaleMode = 32;  // CUBLASLT_MATMUL_DESC_B_SCALE_MODE
constexpr int32_t kScaleVec128F32 = 4;      // CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
constexpr int32_t kScaleBlk128x128F32 = 5;  // CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
constexpr int kPrefMaxWorkspace = 1;        // CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES
constexpr int kAlgoTileId = 1;              // CUBLASLT_ALGO_CONFIG_TILE_ID (uint32)
constexpr int kAlgoSplitK = 2;              // CUBLASLT_ALGO_CONFIG_SPLITK_NUM (uint32)
constexpr int kAlgoReduction = 3;           // CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME (uint32)
constexpr int kAlgoStagesId = 6;            // CUBLASLT_ALGO_CONFIG_STAGES_ID (uint32)
constexpr int kAlgoClusterShapeId = 8;      // CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID (uint32)
constexpr uint32_t kReductionNone = 0;      // CUBLASLT_REDUCTION_SCHEME_NONE
constexpr uint32_t kReductionCompute = 2;   // CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE
constexpr int kMaxAlgos = 32;               // heuristic results asked for at most
}  // namespace fp8rl_lt

namespace {

using namespace fp8rl_lt;

struct Lt {
  Status (*Create)(Handle*);
  const char* (*GetStatusName)(Status);
  size_t (*GetVersion)();
  Status (*MatmulDescCreate)(MatmulDesc*, int, int);
  Status (*MatmulDescDestroy)(MatmulDesc);
  Status (*MatmulDescSetAttribute)(MatmulDesc, int, const void*, size_t);
  Status (*MatrixLayoutCreate)(MatrixLayout*, int, uint64_t, uint64_t, int64_t);
  Status (*MatmulPreferenceCreate)(Preference*);
  Status (*MatmulPreferenceDestroy)(Preference);
  Status (*MatmulPreferenceSetAttribute)(Preference, int, const void*, size_t);
  Status (*MatmulAlgoGetHeuristic)(Handle, MatmulDesc, MatrixLayout,
                                           MatrixLayout, MatrixLayout, MatrixLayout,
                                           Preference, int, HeuristicResult*, int*);
  Status (*AlgoConfigSetAttribute)(Algo*, int, const void*, size_t);
  Status (*AlgoConfigGetAttribute)(const Algo*, int, void*, size_t, size_t*);
  Status (*AlgoCheck)(Handle, MatmulDesc, MatrixLayout, MatrixLayout, MatrixLayout, MatrixLayout, const Algo*,
                      HeuristicResult*);
  Status (*Matmul)(Handle, MatmulDesc, const void*, const void*, MatrixLayout,
                           const void*, MatrixLayout, const void*, const void*, MatrixLayout,
                           void*, MatrixLayout, const Algo*, void*, size_t, Stream);
};

std::mutex g_mu;
std::string g_library_path;  // set from Python before the first call; empty: the usual sonames
Lt g_lt;
bool g_loaded = false;
std::string g_load_error;
std::unordered_map<int, Handle> g_handles;  // per device ordinal

template <typename F>
bool Sym(void* lib, const char* name, F* out, std::string* err) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  if (*out == nullptr) *err = std::string("cuBLASLt has no symbol ") + name;
  return *out != nullptr;
}

// Loads cuBLASLt once (under g_mu); returns an empty string or why it failed.
std::string LoadLocked() {
  if (g_loaded) return "";
  if (!g_load_error.empty()) return g_load_error;
  void* lib = nullptr;
  std::string tried;
  const std::string candidates[] = {g_library_path, "libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"};
  for (const std::string& c : candidates) {
    if (c.empty()) continue;
    lib = dlopen(c.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (lib != nullptr) break;
    tried += " " + c + " (" + dlerror() + ")";
  }
  if (lib == nullptr) return g_load_error = "could not load cuBLASLt:" + tried;
  std::string err;
  bool ok = Sym(lib, "cublasLtCreate", &g_lt.Create, &err) &&
            Sym(lib, "cublasLtGetStatusName", &g_lt.GetStatusName, &err) &&
            Sym(lib, "cublasLtGetVersion", &g_lt.GetVersion, &err) &&
            Sym(lib, "cublasLtMatmulDescCreate", &g_lt.MatmulDescCreate, &err) &&
            Sym(lib, "cublasLtMatmulDescDestroy", &g_lt.MatmulDescDestroy, &err) &&
            Sym(lib, "cublasLtMatmulDescSetAttribute", &g_lt.MatmulDescSetAttribute, &err) &&
            Sym(lib, "cublasLtMatrixLayoutCreate", &g_lt.MatrixLayoutCreate, &err) &&
            Sym(lib, "cublasLtMatmulPreferenceCreate", &g_lt.MatmulPreferenceCreate, &err) &&
            Sym(lib, "cublasLtMatmulPreferenceDestroy", &g_lt.MatmulPreferenceDestroy, &err) &&
            Sym(lib, "cublasLtMatmulPreferenceSetAttribute", &g_lt.MatmulPreferenceSetAttribute, &err) &&
            Sym(lib, "cublasLtMatmulAlgoGetHeuristic", &g_lt.MatmulAlgoGetHeuristic, &err) &&
            Sym(lib, "cublasLtMatmulAlgoConfigSetAttribute", &g_lt.AlgoConfigSetAttribute, &err) &&
            Sym(lib, "cublasLtMatmulAlgoConfigGetAttribute", &g_lt.AlgoConfigGetAttribute, &err) &&
            Sym(lib, "cublasLtMatmulAlgoCheck", &g_lt.AlgoCheck, &err) &&
            Sym(lib, "cublasLtMatmul", &g_lt.Matmul, &err);
  if (!ok) return g_load_error = err;
  // block-scaled FP8 (VEC128 / BLK128x128 scale modes) arrived in cuBLAS 12.9
  size_t version = g_lt.GetVersion();
  if (version < 120900) return g_load_error = "cuBLASLt " + std::to_string(version) + " predates block-scaled FP8 (12.9)";
  g_loaded = true;
  return "";
}

std::string StatusName(Status s) {
  return g_lt.GetStatusName != nullptr ? g_lt.GetStatusName(s) : std::to_string(s);
}

#define LT_CHECK(expr, what)                                                                          \
  do {                                                                                                \
    Status _s = (expr);                                                                       \
    if (_s != kSuccess) return ffi::Error::Internal(std::string("cuBLASLt ") + (what) + ": " + StatusName(_s)); \
  } while (0)

// Layouts and the chosen algorithm of one problem shape, per thread (descriptors are not shared between
// threads; the scale pointers are set on this thread's matmul descriptor at every call).
struct Plan {
  MatmulDesc desc = nullptr;
  MatrixLayout a = nullptr, b = nullptr, d = nullptr;
  Algo algo;
  size_t workspace = 0;
};
using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, int, int32_t, int32_t, int32_t>;
struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    size_t h = 0;
    auto mix = [&h](uint64_t v) { h ^= std::hash<uint64_t>()(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(std::get<0>(k)); mix(std::get<1>(k)); mix(std::get<2>(k)); mix(std::get<3>(k)); mix(std::get<4>(k));
    mix(std::get<5>(k)); mix(std::get<6>(k)); mix(std::get<7>(k));
    return h;
  }
};
thread_local std::unordered_map<PlanKey, Plan, PlanKeyHash> t_plans;

// The descriptors of one problem: the matmul descriptor (its scale pointers sa: cuBLAS A's = our weight's, sb:
// cuBLAS B's = our activations') and the A, B, D layouts. The scale pointers go on the descriptor before the
// heuristic query: cuBLASLt refuses a block scale mode without its pointer (CUBLAS_STATUS_INVALID_VALUE, "the scaling
// mode for A scale requires a custom pointer"); they are set again at every call.
ffi::Error MakeDescriptors(int64_t m, int64_t n, int64_t k, int out_type, int32_t b_mode, const void* sa,
                           const void* sb, Plan* plan) {
  LT_CHECK(g_lt.MatmulDescCreate(&plan->desc, kComputeF32, kCudaR32F), "matmul descriptor");
  LT_CHECK(g_lt.MatmulDescSetAttribute(plan->desc, kDescTransA, &kOpT, sizeof(kOpT)), "TRANSA");
  LT_CHECK(g_lt.MatmulDescSetAttribute(plan->desc, kDescTransB, &kOpN, sizeof(kOpN)), "TRANSB");
  LT_CHECK(g_lt.MatmulDescSetAttribute(plan->desc, kDescAScaleMode, &b_mode, sizeof(int32_t)),
           b_mode == kScaleBlk128x128F32 ? "A scale mode (BLK128x128_32F)" : "A scale mode (VEC128_32F)");
  LT_CHECK(g_lt.MatmulDescSetAttribute(plan->desc, kDescBScaleMode, &kScaleVec128F32, sizeof(int32_t)),
           "B scale mode (VEC128_32F)");
  LT_CHECK(g_lt.MatmulDescSetAttribute(plan->desc, kDescAScalePtr, &sa, sizeof(sa)), "A scale pointer");
  LT_CHECK(g_lt.MatmulDescSetAttribute(plan->desc, kDescBScalePtr, &sb, sizeof(sb)), "B scale pointer");
  // column-major: A = weight as K x N (ld K), B = activations as K x M (ld K), D = out^T as N x M (ld N)
  LT_CHECK(g_lt.MatrixLayoutCreate(&plan->a, kCudaR8FE4M3, k, n, k), "A layout");
  LT_CHECK(g_lt.MatrixLayoutCreate(&plan->b, kCudaR8FE4M3, k, m, k), "B layout");
  LT_CHECK(g_lt.MatrixLayoutCreate(&plan->d, out_type, n, m, n), "D layout");
  return ffi::Error::Success();
}

// cuBLASLt's ranked algorithms for a plan's descriptors (at most kMaxAlgos): how many it found, or the error.
ffi::Error Heuristics(Handle handle, const Plan& plan, int64_t m, int64_t n, int64_t k, int32_t b_mode,
                      uint64_t max_workspace, HeuristicResult* results, int* found) {
  Preference pref;
  LT_CHECK(g_lt.MatmulPreferenceCreate(&pref), "preference");
  uint64_t ws = max_workspace;
  Status s = g_lt.MatmulPreferenceSetAttribute(pref, kPrefMaxWorkspace, &ws, sizeof(ws));
  if (s == kSuccess) {
    std::memset(results, 0, sizeof(HeuristicResult) * kMaxAlgos);
    *found = 0;
    s = g_lt.MatmulAlgoGetHeuristic(handle, plan.desc, plan.a, plan.b, plan.d, plan.d, pref, kMaxAlgos, results,
                                    found);
  }
  g_lt.MatmulPreferenceDestroy(pref);
  if (s != kSuccess || *found == 0)
    return ffi::Error::Internal(std::string("cuBLASLt has no ") +
                                (b_mode == kScaleBlk128x128F32 ? "1x128 x 128x128" : "1x128 x 1x128") +
                                " block-scaled FP8 algorithm for M=" + std::to_string(m) +
                                " N=" + std::to_string(n) + " K=" + std::to_string(k) + " (" + StatusName(s) + ")");
  return ffi::Error::Success();
}

// `algo` with its K splits pinned (split_k >= 1), if cuBLASLt accepts that for the plan within max_workspace:
// true and its workspace size, else false.
bool PinSplitK(Handle handle, const Plan& plan, uint32_t split_k, uint64_t max_workspace, Algo* algo,
               size_t* workspace) {
  const uint32_t scheme = split_k > 1 ? kReductionCompute : kReductionNone;
  if (g_lt.AlgoConfigSetAttribute(algo, kAlgoSplitK, &split_k, sizeof(split_k)) != kSuccess ||
      g_lt.AlgoConfigSetAttribute(algo, kAlgoReduction, &scheme, sizeof(scheme)) != kSuccess)
    return false;
  HeuristicResult check;
  std::memset(&check, 0, sizeof(check));
  if (g_lt.AlgoCheck(handle, plan.desc, plan.a, plan.b, plan.d, plan.d, algo, &check) != kSuccess ||
      check.state != kSuccess || check.workspaceSize > max_workspace)
    return false;
  *workspace = check.workspaceSize;
  return true;
}

// A plan for (m, n, k): descriptors and the algorithm at `algo_index` of the heuristic's list, its K splits pinned
// to `split_k` when > 0; the heuristic's first where the list is shorter or the splits are refused.
ffi::Error MakePlan(Handle handle, int64_t m, int64_t n, int64_t k, int out_type, int32_t b_mode, const void* sa,
                    const void* sb, uint64_t max_workspace, int32_t algo_index, int32_t split_k, Plan* plan) {
  ffi::Error e = MakeDescriptors(m, n, k, out_type, b_mode, sa, sb, plan);
  if (e.failure()) return e;
  HeuristicResult results[kMaxAlgos];
  int found = 0;
  e = Heuristics(handle, *plan, m, n, k, b_mode, max_workspace, results, &found);
  if (e.failure()) return e;
  plan->algo = results[0].algo;
  plan->workspace = results[0].workspaceSize;
  if (algo_index <= 0 && split_k <= 0) return ffi::Error::Success();
  if (algo_index < 0 || algo_index >= found) return ffi::Error::Success();
  Algo algo = results[algo_index].algo;
  size_t workspace = results[algo_index].workspaceSize;
  if (split_k > 0 && !PinSplitK(handle, *plan, static_cast<uint32_t>(split_k), max_workspace, &algo, &workspace))
    return ffi::Error::Success();
  plan->algo = algo;
  plan->workspace = workspace;
  return ffi::Error::Success();
}

// The handle of `device` (under g_mu, cuBLASLt loaded).
ffi::Error HandleLocked(int device, Handle* handle) {
  auto it = g_handles.find(device);
  if (it == g_handles.end()) {
    Handle h;
    LT_CHECK(g_lt.Create(&h), "handle");
    it = g_handles.emplace(device, h).first;
  }
  *handle = it->second;
  return ffi::Error::Success();
}

// The GEMM on `stream`. cuBLASLt's workspace is the call's second result (a byte buffer XLA allocates with the
// others, so the call needs no allocation of its own and can be captured into a CUDA graph); the algorithm is
// chosen for that size.
ffi::Error RunGemm(Stream stream, int32_t device, int32_t b_blocks, int32_t algo_index, int32_t split_k,
                   ffi::AnyBuffer a, ffi::Buffer<ffi::F32> a_scale_t, ffi::AnyBuffer b, ffi::Buffer<ffi::F32> b_scale,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace_buf) {
  // a [M, K] e4m3, a_scale_t [K/128, M], b [N, K] e4m3, out [M, N]; b_scale: with b_blocks (weights) the
  // 128x128 scales [N/128, ld >= K/128, ld % 4 == 0], else 1x128 per row of b, transposed: [K/128, N]
  auto ad = a.dimensions(), bd = b.dimensions(), od = out->dimensions();
  auto asd = a_scale_t.dimensions(), bsd = b_scale.dimensions();
  if (ad.size() != 2 || bd.size() != 2 || od.size() != 2 || asd.size() != 2 || bsd.size() != 2)
    return ffi::Error::InvalidArgument("fp8 block GEMM: operands must be 2-D");
  if (a.element_type() != ffi::F8E4M3FN || b.element_type() != ffi::F8E4M3FN)
    return ffi::Error::InvalidArgument("fp8 block GEMM: A and B must be float8_e4m3fn");
  const int64_t m = ad[0], k = ad[1], n = bd[0];
  const int64_t kb = (k + 127) / 128, nb = (n + 127) / 128;
  const bool b_ok = b_blocks ? (bsd[0] == nb && bsd[1] >= kb && bsd[1] % 4 == 0) : (bsd[0] == kb && bsd[1] == n);
  if (bd[1] != k || od[0] != m || od[1] != n || asd[0] != kb || asd[1] != m || !b_ok)
    return ffi::Error::InvalidArgument("fp8 block GEMM: inconsistent operand shapes");
  const int32_t b_mode = b_blocks ? kScaleBlk128x128F32 : kScaleVec128F32;
  int out_type;
  if (out->element_type() == ffi::BF16) {
    out_type = kCudaR16BF;
  } else if (out->element_type() == ffi::F32) {
    out_type = kCudaR32F;
  } else {
    return ffi::Error::InvalidArgument("fp8 block GEMM: the output must be bfloat16 or float32");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  Handle handle;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    std::string err = LoadLocked();
    if (!err.empty()) return ffi::Error::Internal(err);
    ffi::Error e = HandleLocked(device, &handle);
    if (e.failure()) return e;
  }
  const void* sa = b_scale.typed_data();    // cuBLAS A = our weight
  const void* sb = a_scale_t.typed_data();  // cuBLAS B = our activations
  PlanKey key{device, m, n, k, out_type, b_mode, algo_index, split_k};
  auto it = t_plans.find(key);
  if (it == t_plans.end()) {
    Plan plan;
    ffi::Error e = MakePlan(handle, m, n, k, out_type, b_mode, sa, sb, workspace_buf->size_bytes(), algo_index,
                            split_k, &plan);
    if (e.failure()) return e;
    it = t_plans.emplace(key, plan).first;
  }
  Plan& plan = it->second;
  LT_CHECK(g_lt.MatmulDescSetAttribute(plan.desc, kDescAScalePtr, &sa, sizeof(sa)), "A scale pointer");
  LT_CHECK(g_lt.MatmulDescSetAttribute(plan.desc, kDescBScalePtr, &sb, sizeof(sb)), "B scale pointer");
  if (plan.workspace > workspace_buf->size_bytes())
    return ffi::Error::Internal("fp8 block GEMM: the algorithm wants more workspace than the call has");
  void* workspace = plan.workspace > 0 ? workspace_buf->untyped_data() : nullptr;
  const float alpha = 1.0f, beta = 0.0f;
  void* d = out->untyped_data();
  LT_CHECK(g_lt.Matmul(handle, plan.desc, &alpha, b.untyped_data(), plan.a, a.untyped_data(), plan.b, &beta, d,
                       plan.d, d, plan.d, &plan.algo, workspace, plan.workspace, stream),
           "matmul");
  return ffi::Error::Success();
}

ffi::Error Fp8BlockGemm(Stream stream, int32_t device, int32_t b_blocks, int32_t algo_index, int32_t split_k,
                        ffi::AnyBuffer a, ffi::Buffer<ffi::F32> a_scale_t, ffi::AnyBuffer b,
                        ffi::Buffer<ffi::F32> b_scale, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> workspace) {
  return RunGemm(stream, device, b_blocks, algo_index, split_k, a, a_scale_t, b, b_scale, out, workspace);
}

// The same GEMM on host buffers, no stream (device 0; the workspace result is host memory too): for tests on the
// CPU platform against a host-memory stand-in of cuBLASLt (tests/fake_cublaslt.cc), which check the descriptors,
// layouts and scale pointers this file hands to cuBLASLt. Never registered by fp8rl_jax itself.
ffi::Error Fp8BlockGemmHost(int32_t b_blocks, int32_t algo_index, int32_t split_k, ffi::AnyBuffer a,
                            ffi::Buffer<ffi::F32> a_scale_t, ffi::AnyBuffer b, ffi::Buffer<ffi::F32> b_scale,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace) {
  return RunGemm(nullptr, 0, b_blocks, algo_index, split_k, a, a_scale_t, b, b_scale, out, workspace);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8rlCublasLtFp8BlockGemmHost, Fp8BlockGemmHost,
                              ffi::Ffi::Bind()
                                  .Attr<int32_t>("b_blocks")
                                  .Attr<int32_t>("algo")
                                  .Attr<int32_t>("split_k")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

#define FP8RL_GEMM_BINDING                                                          \
  ffi::Ffi::Bind()                                                                  \
      .Ctx<ffi::PlatformStream<Stream>>()                                           \
      .Ctx<ffi::DeviceOrdinal>()                                                    \
      .Attr<int32_t>("b_blocks") /* 1: 128x128 B scales, 0: 1x128 */                \
      .Attr<int32_t>("algo")     /* index into cuBLASLt's heuristic list */        \
      .Attr<int32_t>("split_k")  /* > 0: the algorithm's K splits pinned */        \
      .Arg<ffi::AnyBuffer>()                                                        \
      .Arg<ffi::Buffer<ffi::F32>>()                                                 \
      .Arg<ffi::AnyBuffer>()                                                        \
      .Arg<ffi::Buffer<ffi::F32>>()                                                 \
      .Ret<ffi::AnyBuffer>() /* out */                                              \
      .Ret<ffi::AnyBuffer>() /* cuBLASLt's workspace */

// Two registrations of one handler: XLA may capture the first into its command buffers (CUDA graphs), so a jitted
// decode loop replays it with the kernels around it instead of returning to the host for every call; the second
// runs it eagerly from the host, for where graph capture of cuBLASLt fails (fp8rl_jax.quant.cublaslt picks).
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8rlCublasLtFp8BlockGemm, Fp8BlockGemm, FP8RL_GEMM_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8rlCublasLtFp8BlockGemmEager, Fp8BlockGemm, FP8RL_GEMM_BINDING);

extern "C" {

// The libcublasLt to dlopen at the first call (the one jax's CUDA plugin uses); before any call.
void fp8rl_cublaslt_set_library(const char* path) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_library_path = path != nullptr ? path : "";
}

// Loads cuBLASLt now; writes why it failed (empty: loaded) into msg. Returns the cuBLASLt version or 0.
size_t fp8rl_cublaslt_load(char* msg, size_t msg_size) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::string err = LoadLocked();
  if (msg != nullptr && msg_size > 0) {
    std::strncpy(msg, err.c_str(), msg_size - 1);
    msg[msg_size - 1] = '\0';
  }
  return err.empty() ? g_lt.GetVersion() : 0;
}

// The algorithms cuBLASLt's heuristic offers for the block-scaled GEMM of (m, n, k) into bfloat16 (out_bf16) or
// float32 on `device`, with a workspace of at most max_workspace bytes, in its order: one row of 8 int64 per
// algorithm in `rows` (at most max_rows): tile id, stages id, K splits, reduction scheme, cluster shape id,
// workspace bytes, waves count x 1000, and whether pinning its K splits to `split_k` (when > 0) is accepted (the
// split and workspace columns are then those of the pinned algorithm). Returns how many it found, or -1 with the
// error in msg. Needs no device memory: the scale pointers of the query are placeholders. (Its three layouts are
// not freed: a few hundred bytes a query, for a tuning sweep.)
int fp8rl_cublaslt_algos(int device, int64_t m, int64_t n, int64_t k, int out_bf16, int split_k,
                         uint64_t max_workspace, int64_t* rows, int max_rows, char* msg, size_t msg_size) {
  auto fail = [&](const std::string& why) {
    if (msg != nullptr && msg_size > 0) {
      std::strncpy(msg, why.c_str(), msg_size - 1);
      msg[msg_size - 1] = '\0';
    }
    return -1;
  };
  Handle handle;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    std::string err = LoadLocked();
    if (!err.empty()) return fail(err);
    ffi::Error e = HandleLocked(device, &handle);
    if (e.failure()) return fail(e.message());
  }
  const void* placeholder = reinterpret_cast<const void*>(uintptr_t{256});
  Plan plan;
  ffi::Error e = MakeDescriptors(m, n, k, out_bf16 ? kCudaR16BF : kCudaR32F, kScaleBlk128x128F32, placeholder,
                                 placeholder, &plan);
  HeuristicResult results[kMaxAlgos];
  int found = 0;
  if (!e.failure()) e = Heuristics(handle, plan, m, n, k, kScaleBlk128x128F32, max_workspace, results, &found);
  if (e.failure()) return fail(e.message());
  for (int i = 0; i < found && i < max_rows; ++i) {
    Algo algo = results[i].algo, pinned = algo;
    size_t workspace = results[i].workspaceSize, pinned_workspace = workspace;
    const bool ok = split_k <= 0 || PinSplitK(handle, plan, static_cast<uint32_t>(split_k), max_workspace, &pinned,
                                              &pinned_workspace);
    if (split_k > 0 && ok) {
      algo = pinned;
      workspace = pinned_workspace;
    }
    const int attrs[5] = {kAlgoTileId, kAlgoStagesId, kAlgoSplitK, kAlgoReduction, kAlgoClusterShapeId};
    for (int j = 0; j < 5; ++j) {
      uint32_t v = 0;
      size_t written = 0;
      g_lt.AlgoConfigGetAttribute(&algo, attrs[j], &v, sizeof(v), &written);
      rows[i * 8 + j] = v;
    }
    rows[i * 8 + 5] = static_cast<int64_t>(workspace);
    rows[i * 8 + 6] = static_cast<int64_t>(results[i].wavesCount * 1000.0f);
    rows[i * 8 + 7] = ok ? 1 : 0;
  }
  g_lt.MatmulDescDestroy(plan.desc);
  return found;
}

}  // extern "C"
