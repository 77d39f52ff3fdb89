// Compile-only check (never linked): the cuBLASLt declarations of cublaslt_fp8_gemm.cc against the real
// cublasLt.h, wherever that header exists (the nvidia-cublas package; tests/test_cublaslt.py builds it).
#include <cublasLt.h>

#include <cstddef>

#include "cublaslt_fp8_gemm.cc"

static_assert(fp8rl_lt::kSuccess == CUBLAS_STATUS_SUCCESS);
static_assert(fp8rl_lt::kCudaR32F == CUDA_R_32F && fp8rl_lt::kCudaR16BF == CUDA_R_16BF &&
              fp8rl_lt::kCudaR8FE4M3 == CUDA_R_8F_E4M3);
static_assert(fp8rl_lt::kComputeF32 == CUBLAS_COMPUTE_32F);
static_assert(fp8rl_lt::kOpN == CUBLAS_OP_N && fp8rl_lt::kOpT == CUBLAS_OP_T);
static_assert(fp8rl_lt::kDescTransA == CUBLASLT_MATMUL_DESC_TRANSA &&
              fp8rl_lt::kDescTransB == CUBLASLT_MATMUL_DESC_TRANSB);
static_assert(fp8rl_lt::kDescAScalePtr == CUBLASLT_MATMUL_DESC_A_SCALE_POINTER &&
              fp8rl_lt::kDescBScalePtr == CUBLASLT_MATMUL_DESC_B_SCALE_POINTER);
static_assert(fp8rl_lt::kDescAScaleMode == CUBLASLT_MATMUL_DESC_A_SCALE_MODE &&
              fp8rl_lt::kDescBScaleMode == CUBLASLT_MATMUL_DESC_B_SCALE_MODE);
static_assert(fp8rl_lt::kScaleVec128F32 == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F &&
              fp8rl_lt::kScaleBlk128x128F32 == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F);
static_assert(fp8rl_lt::kPrefMaxWorkspace == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES);
static_assert(sizeof(fp8rl_lt::Algo) == sizeof(cublasLtMatmulAlgo_t));
static_assert(sizeof(fp8rl_lt::HeuristicResult) == sizeof(::cublasLtMatmulHeuristicResult_t));
static_assert(offsetof(fp8rl_lt::HeuristicResult, workspaceSize) ==
              offsetof(::cublasLtMatmulHeuristicResult_t, workspaceSize));
static_assert(offsetof(fp8rl_lt::HeuristicResult, state) == offsetof(::cublasLtMatmulHeuristicResult_t, state));
static_assert(sizeof(cublasStatus_t) == sizeof(fp8rl_lt::Status) && sizeof(cudaDataType_t) == sizeof(int) &&
              sizeof(cublasLtMatmulDescAttributes_t) == sizeof(int) && sizeof(cublasComputeType_t) == sizeof(int));
static_assert(fp8rl_lt::kAlgoTileId == CUBLASLT_ALGO_CONFIG_TILE_ID &&
              fp8rl_lt::kAlgoSplitK == CUBLASLT_ALGO_CONFIG_SPLITK_NUM &&
              fp8rl_lt::kAlgoReduction == CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME &&
              fp8rl_lt::kAlgoStagesId == CUBLASLT_ALGO_CONFIG_STAGES_ID &&
              fp8rl_lt::kAlgoClusterShapeId == CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID);
static_assert(fp8rl_lt::kReductionNone == CUBLASLT_REDUCTION_SCHEME_NONE &&
              fp8rl_lt::kReductionCompute == CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE);
static_assert(offsetof(fp8rl_lt::HeuristicResult, wavesCount) ==
              offsetof(::cublasLtMatmulHeuristicResult_t, wavesCount));
