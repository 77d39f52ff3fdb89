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
// An algorithm exists for what Hopper's block-scaled FP8 takes: TN, E4M3 x E4M3, A scaled 128x128 or 1x128,
// B scaled 1x128, both K-major with the same K, D = C. Like the real library, a block scale mode without its scale
// pointer already set is an invalid value (status 7) at the heuristic query, not only at the matmul.
int cublasLtMatmulAlgoGetHeuristic(void*, Desc* d, Layout* a, Layout* b, Layout* c, Layout* dl, Pref* p, int requested,
                                   Heuristic* result, int* found) {
  if (d->a_scale == nullptr || d->b_scale == nullptr) return kInvalid;
  const bool ok = d->transa == 1 && d->transb == 0 && a->type == 28 && b->type == 28 && a->rows == b->rows &&
                  (d->a_mode == 5 || d->a_mode == 4) && d->b_mode == 4 && c == dl && dl->rows == a->cols &&
                  dl->cols == b->cols && (dl->type == 14 || dl->type == 0) && requested >= 1 &&
                  p->max_workspace >= kWorkspace;
  *found = ok ? 1 : 0;
  if (ok) {
    std::memset(result, 0, sizeof(Heuristic));
    result->workspace = kWorkspace;
  }
  return 0;
}
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
  ++g_matmuls;
  return 0;
}
int fake_cublaslt_matmuls() { return g_matmuls; }
}
