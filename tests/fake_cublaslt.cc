// A host-memory stand-in of the dozen cuBLASLt entry points fp8rl_jax/quant/csrc/cublaslt_fp8_gemm.cc calls,
// with cuBLASLt's documented semantics computed on the CPU: column-major operands, op(A) / op(B), D = alpha *
// (scaled A) . (scaled B); VEC128_32F scales one per 128 elements along K, stored outer-dimension-contiguous
// ([K/128][rows of the operand]); BLK128x128_32F scales one per 128 x 128 block, stored like the data (K blocks
// contiguous, leading dimension a multiple of 4). tests/test_cublaslt.py builds it, points the handler at it and
// runs the handler on the CPU platform: the descriptors, layouts, scale pointers and workspace the handler
// hands to cuBLASLt are checked against this model, not against cuBLAS itself (that is the GPU test's job).
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {
struct Desc {
  int compute = 0, scale_type = 0;
  int32_t transa = 0, transb = 0, a_mode = 0, b_mode = 0;
  const void* a_scale = nullptr;
  const void* b_scale = nullptr;
};
struct Layout {
  int type;
  uint64_t rows, cols;
  int64_t ld;
};
struct Pref {
  uint64_t max_workspace = 0;
};
struct Heuristic {
  uint64_t algo[8];
  size_t workspace;
  int state;
  float waves;
  int reserved[4];
};
constexpr int kInvalid = 7;  // CUBLAS_STATUS_INVALID_VALUE
constexpr size_t kWorkspace = 4096;
int g_matmuls = 0;

float E4m3(uint8_t v) {
  const int sign = v >> 7, exp = (v >> 3) & 15, mant = v & 7;
  float x = exp == 0 ? std::ldexp(mant / 8.0f, -6) : std::ldexp(1.0f + mant / 8.0f, exp - 7);
  if (exp == 15 && mant == 7) x = NAN;
  return sign ? -x : x;
}

uint16_t Bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
}  // namespace

extern "C" {
int cublasLtCreate(void** handle) {
  *handle = reinterpret_cast<void*>(0x1);
  return 0;
}
const char* cublasLtGetStatusName(int s) { return s == 0 ? "CUBLAS_STATUS_SUCCESS" : "CUBLAS_STATUS_INVALID_VALUE"; }
size_t cublasLtGetVersion() { return 131000; }
int cublasLtMatmulDescCreate(Desc** d, int compute, int scale_type) {
  *d = new Desc();
  (*d)->compute = compute;
  (*d)->scale_type = scale_type;
  return compute == 68 && scale_type == 0 ? 0 : kInvalid;  // CUBLAS_COMPUTE_32F, CUDA_R_32F
}
int cublasLtMatmulDescDestroy(Desc* d) {
  delete d;
  return 0;
}
int cublasLtMatmulDescSetAttribute(Desc* d, int attr, const void* buf, size_t size) {
  int32_t* i32 = nullptr;
  const void** ptr = nullptr;
  switch (attr) {
    case 3: i32 = &d->transa; break;
    case 4: i32 = &d->transb; break;
    case 31: i32 = &d->a_mode; break;
    case 32: i32 = &d->b_mode; break;
    case 17: ptr = &d->a_scale; break;
    case 18: ptr = &d->b_scale; break;
    default: return kInvalid;
  }
  if (i32 != nullptr) {
    if (size != sizeof(int32_t)) return kInvalid;
    std::memcpy(i32, buf, size);
  } else {
    if (size != sizeof(void*)) return kInvalid;
    std::memcpy(ptr, buf, size);
  }
  return 0;
}
int cublasLtMatrixLayoutCreate(Layout** l, int type, uint64_t rows, uint64_t cols, int64_t ld) {
  if (ld < static_cast<int64_t>(rows)) return kInvalid;
  *l = new Layout{type, rows, cols, ld};
  return 0;
}
int cublasLtMatmulPreferenceCreate(Pref** p) {
  *p = new Pref();
  return 0;
}
int cublasLtMatmulPreferenceDestroy(Pref* p) {
  delete p;
  return 0;
}
int cublasLtMatmulPreferenceSetAttribute(Pref* p, int attr, const void* buf, size_t size) {
  if (attr != 1 || size != sizeof(uint64_t)) return kInvalid;  // CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES
  std::memcpy(&p->max_workspace, buf, size);
  return 0;
}
// Algorithms exist for what Hopper's block-scaled FP8 takes: TN, E4M3 x E4M3, A scaled 128x128 or 1x128,
// B scaled 1x128, both K-major with the same K, D = C. Like the real library, a block scale mode without its scale
// pointer already set is an invalid value (status 7) at the heuristic query, not only at the matmul. It offers
// kAlgos of them (min(requested)); algo words: [0] 1 + the algorithm's rank, [1] tile id (10 + rank), [2] K splits,
// [3] reduction scheme. Splits 1-16 are accepted with a reduction scheme (NONE for 1), except by the last algorithm,
// which takes none (the refusal path of the handler).
constexpr int kAlgos = 3;
int cublasLtMatmulAlgoGetHeuristic(void*, Desc* d, Layout* a, Layout* b, Layout* c, Layout* dl, Pref* p, int requested,
                                   Heuristic* result, int* found) {
  if (d->a_scale == nullptr || d->b_scale == nullptr) return kInvalid;
  const bool ok = d->transa == 1 && d->transb == 0 && a->type == 28 && b->type == 28 && a->rows == b->rows &&
                  (d->a_mode == 5 || d->a_mode == 4) && d->b_mode == 4 && c == dl && dl->rows == a->cols &&
                  dl->cols == b->cols && (dl->type == 14 || dl->type == 0) && requested >= 1 &&
                  p->max_workspace >= kWorkspace;
  *found = ok ? (requested < kAlgos ? requested : kAlgos) : 0;
  for (int i = 0; i < *found; ++i) {
    std::memset(&result[i], 0, sizeof(Heuristic));
    result[i].algo[0] = 1 + i;
    result[i].algo[1] = 10 + i;
    result[i].algo[2] = 1;
    result[i].workspace = kWorkspace;
    result[i].waves = 0.25f * (i + 1);
  }
  return 0;
}
int cublasLtMatmulAlgoConfigSetAttribute(uint64_t* algo, int attr, const void* buf, size_t size) {
  if ((attr != 2 && attr != 3) || size != sizeof(uint32_t)) return kInvalid;
  uint32_t v;
  std::memcpy(&v, buf, size);
  algo[attr] = v;
  return 0;
}
int cublasLtMatmulAlgoConfigGetAttribute(const uint64_t* algo, int attr, void* buf, size_t size, size_t* written) {
  if (size != sizeof(uint32_t)) return kInvalid;
  const uint32_t v = attr == 1 ? static_cast<uint32_t>(algo[1]) : attr == 2 ? static_cast<uint32_t>(algo[2])
                     : attr == 3 ? static_cast<uint32_t>(algo[3]) : 0;
  std::memcpy(buf, &v, size);
  if (written != nullptr) *written = size;
  return 0;
}
int cublasLtMatmulAlgoCheck(void*, Desc*, Layout*, Layout*, Layout*, Layout*, const uint64_t* algo, Heuristic* result) {
  const uint64_t splits = algo[2], scheme = algo[3];
  const bool ok = algo[0] != kAlgos && splits >= 1 && splits <= 16 && ((splits == 1) == (scheme == 0));
  std::memset(result, 0, sizeof(Heuristic));
  result->state = ok ? 0 : kInvalid;
  result->workspace = kWorkspace;
  return ok ? 0 : kInvalid;
}
uint64_t g_last_algo[4] = {0, 0, 0, 0};
int cublasLtMatmul(void*, Desc* d, const void* alpha, const void* A, Layout* la, const void* B, Layout* lb,
                   const void* beta, const void* C, Layout* lc, void* D, Layout* ld, const void* algo, void* workspace,
                   size_t workspace_size, void*) {
  if (algo == nullptr || workspace == nullptr || workspace_size < kWorkspace || C != D || lc != ld) return kInvalid;
  if (*static_cast<const float*>(beta) != 0.0f || d->a_scale == nullptr || d->b_scale == nullptr) return kInvalid;
  const int64_t K = la->rows, N = la->cols, M = lb->cols, kb = (K + 127) / 128, lds = (kb + 3) / 4 * 4;
  const auto* a = static_cast<const uint8_t*>(A);
  const auto* b = static_cast<const uint8_t*>(B);
  const auto* sa = static_cast<const float*>(d->a_scale);
  const auto* sb = static_cast<const float*>(d->b_scale);
  const float al = *static_cast<const float*>(alpha);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0.0;
      for (int64_t blk = 0; blk < kb; ++blk) {
        double part = 0.0;
        for (int64_t k = blk * 128; k < std::min<int64_t>(K, blk * 128 + 128); ++k)
          part += static_cast<double>(E4m3(a[n * la->ld + k])) * E4m3(b[m * lb->ld + k]);
        const float scale_a = d->a_mode == 5 ? sa[(n / 128) * lds + blk] : sa[blk * N + n];
        acc += part * scale_a * sb[blk * M + m];
      }
      const float v = static_cast<float>(acc) * al;
      if (ld->type == 0)
        static_cast<float*>(D)[m * ld->ld + n] = v;
      else
        static_cast<uint16_t*>(D)[m * ld->ld + n] = Bf16(v);
    }
  }
  std::memcpy(g_last_algo, algo, sizeof(g_last_algo));
  ++g_matmuls;
  return 0;
}
int fake_cublaslt_matmuls() { return g_matmuls; }
// The words [0..3] of the algorithm the last matmul ran (rank + 1, tile, K splits, reduction scheme).
void fake_cublaslt_last_algo(uint64_t* out) { std::memcpy(out, g_last_algo, sizeof(g_last_algo)); }
}
