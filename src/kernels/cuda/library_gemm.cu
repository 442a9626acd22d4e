// The library GEMM (ops.h, section 5c): cuBLASLt with one algorithm per (out, in) and device, fixed
// on first use, so a token's outputs do not depend on how many tokens share the call. Host code only.
//
// cuBLASLt is column-major. Our W [out, in] row-major is its in x out matrix, used transposed (A,
// op T); x [T, in] with row stride x_stride is its in x T matrix (B, ld x_stride); y [T, out] with row
// stride y_stride is its out x T result (D, ld y_stride): D = op(A) B is y^T = W x^T.
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/check.h"
#include "cuda/cublaslt.h"
#include "kernels/ops.h"

namespace dl::kernels {
namespace dev {
namespace {

struct Plan {
  cublasLtMatmulAlgo_t algo{};
  std::string description;
};

// Per process: one cuBLASLt handle per device and the fixed algorithm per (device, out, in). The
// matmul descriptor (op T on A, FP32 compute and scale) is the same for every call.
struct LibraryGemmState {
  std::mutex mu;
  const cuda::CublasLt* lt = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  std::map<int, cublasLtHandle_t> handles;
  std::map<std::tuple<int, int, int>, Plan> plans;
};

LibraryGemmState& State() {
  static LibraryGemmState* state = new LibraryGemmState;  // lives for the process (handles stay valid)
  return *state;
}

// The matrix layouts of one call (destroyed with it).
struct Layouts {
  const cuda::CublasLt* lt = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  ~Layouts() {
    if (a) lt->LayoutDestroy(a);
    if (b) lt->LayoutDestroy(b);
    if (d) lt->LayoutDestroy(d);
  }
  Status Create(int out, int in, int tokens, int64_t x_stride, int64_t y_stride) {
    DL_RETURN_IF_ERROR(cuda::CublasLtCheck(lt->LayoutCreate(&a, CUDA_R_16BF, in, out, in), "layout of W"));
    DL_RETURN_IF_ERROR(cuda::CublasLtCheck(lt->LayoutCreate(&b, CUDA_R_16BF, in, tokens, x_stride), "layout of x"));
    return cuda::CublasLtCheck(lt->LayoutCreate(&d, CUDA_R_16BF, out, tokens, y_stride), "layout of y");
  }
};

template <typename T>
T ConfigOf(const cuda::CublasLt& lt, const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr,
           T fallback) {
  T v{};
  size_t written = 0;
  if (lt.AlgoConfigGet(&algo, attr, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS) return fallback;
  return v;
}

// Loads cuBLASLt and creates the descriptor once (under the state's lock).
Status EnsureLoaded(LibraryGemmState& st) {
  if (st.lt != nullptr) return Status::Ok();
  auto loaded = cuda::LoadCublasLt();
  if (!loaded.ok()) return Unavailable("the library GEMM (prompt_gemm): {}", loaded.status().message());
  const cuda::CublasLt* lt = *loaded;
  cublasLtMatmulDesc_t desc = nullptr;
  DL_RETURN_IF_ERROR(cuda::CublasLtCheck(lt->DescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor"));
  const cublasOperation_t op_t = CUBLAS_OP_T;
  const Status set =
      cuda::CublasLtCheck(lt->DescSet(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)), "transpose of W");
  if (!set.ok()) {
    lt->DescDestroy(desc);
    return set;
  }
  st.lt = lt, st.desc = desc;
  return Status::Ok();
}

// The plan for (current device, out, in), chosen now if it has not been (under the state's lock).
Result<const Plan*> PlanFor(LibraryGemmState& st, int out, int in, cublasLtHandle_t* handle) {
  DL_RETURN_IF_ERROR(EnsureLoaded(st));
  int device = 0;
  DL_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  auto h = st.handles.find(device);
  if (h == st.handles.end()) {
    cublasLtHandle_t created = nullptr;
    DL_RETURN_IF_ERROR(cuda::CublasLtCheck(st.lt->Create(&created), "create"));
    h = st.handles.emplace(device, created).first;
  }
  *handle = h->second;
  const auto key = std::make_tuple(device, out, in);
  if (auto it = st.plans.find(key); it != st.plans.end()) return &it->second;
  const cuda::CublasLt& lt = *st.lt;
  Layouts l{&lt};
  DL_RETURN_IF_ERROR(l.Create(out, in, kLibraryGemmPlanTokens, in, out));
  cublasLtMatmulPreference_t pref = nullptr;
  DL_RETURN_IF_ERROR(cuda::CublasLtCheck(lt.PrefCreate(&pref), "preference"));
  constexpr int kAsk = 16;
  cublasLtMatmulHeuristicResult_t found[kAsk] = {};
  int n = 0;
  auto ask = [&]() -> Status {
    const uint64_t no_workspace = 0;
    DL_RETURN_IF_ERROR(cuda::CublasLtCheck(
        lt.PrefSet(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &no_workspace, sizeof(no_workspace)), "preference"));
    const uint32_t align = 16;  // any row of x and y the engine passes (LibraryGemmFits)
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      DL_RETURN_IF_ERROR(cuda::CublasLtCheck(lt.PrefSet(pref, attr, &align, sizeof(align)), "preference"));
    }
    return cuda::CublasLtCheck(lt.Heuristic(*handle, st.desc, l.a, l.b, l.d, l.d, pref, kAsk, found, &n), "heuristic");
  };
  const Status asked = ask();
  lt.PrefDestroy(pref);
  DL_RETURN_IF_ERROR(asked.WithContext(fmt::format("library GEMM {} x {}", out, in)));
  // The first (best-ranked) algorithm whose every output element is one thread block's K loop.
  for (int i = 0; i < n; ++i) {
    const cublasLtMatmulAlgo_t& algo = found[i].algo;
    if (found[i].state != CUBLAS_STATUS_SUCCESS || found[i].workspaceSize != 0) continue;
    const int32_t splitk = ConfigOf<int32_t>(lt, algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, -1);
    const uint32_t reduction = ConfigOf<uint32_t>(lt, algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, ~0u);
    if (splitk != 1 || reduction != CUBLASLT_REDUCTION_SCHEME_NONE) continue;
    Plan plan;
    plan.algo = algo;
    plan.description = fmt::format(
        "cuBLASLt {} ({}) algo {} tile {} stages {} swizzle {} custom {} cluster {} for {} x {} on device {}",
        lt.version, lt.path, ConfigOf<int32_t>(lt, algo, CUBLASLT_ALGO_CONFIG_ID, -1),
        ConfigOf<uint32_t>(lt, algo, CUBLASLT_ALGO_CONFIG_TILE_ID, 0),
        ConfigOf<uint32_t>(lt, algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, 0),
        ConfigOf<uint32_t>(lt, algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, 0),
        ConfigOf<uint32_t>(lt, algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, 0),
        ConfigOf<uint16_t>(lt, algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, 0), out, in, device);
    return &st.plans.emplace(key, plan).first->second;
  }
  return Unavailable("library GEMM {} x {}: cuBLASLt offers no algorithm without split-K and workspace "
                     "among its {} best for {} tokens (use --tune prompt_gemm=0)",
                     out, in, n, kLibraryGemmPlanTokens);
}

}  // namespace

Status LibraryGemm(const GemvParams& p, cudaStream_t s) {
  if (p.norm.residual) return InvalidArgument("gemv: the library GEMM takes no fused input norm");
  if (p.streaming.on) return InvalidArgument("gemv: the library GEMM has no streaming kernel: streaming.on must be off");
  if (!p.x) return InvalidArgument("gemv: w, x and y must be set");
  if (!LibraryGemmFits(p)) {
    return InvalidArgument("gemv: the library GEMM takes BF16 weights, out ({}), in ({}) and the row strides ({}, {}) "
                           "multiples of 8 and 16-byte aligned w, x and y (LibraryGemmFits)",
                           p.out, p.in, p.x_stride, p.y_stride);
  }
  LibraryGemmState& st = State();
  cublasLtHandle_t handle = nullptr;
  const Plan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    DL_ASSIGN_OR_RETURN(plan, PlanFor(st, p.out, p.in, &handle));
  }
  Layouts l{st.lt};
  DL_RETURN_IF_ERROR(l.Create(p.out, p.in, p.num_tokens, p.x_stride, p.y_stride));
  const float alpha = 1.0f, beta = 0.0f;
  return cuda::CublasLtCheck(st.lt->Matmul(handle, st.desc, &alpha, p.w, l.a, p.x, l.b, &beta, p.y, l.d, p.y, l.d,
                                           &plan->algo, nullptr, 0, s),
                             "matmul")
      .WithContext(fmt::format("library GEMM [{} x {}] x {} tokens", p.out, p.in, p.num_tokens));
}

}  // namespace dev

Status LibraryGemmAvailable() {
  auto loaded = cuda::LoadCublasLt();
  if (!loaded.ok()) return Unavailable("the library GEMM (prompt_gemm): {}", loaded.status().message());
  return Status::Ok();
}

Result<std::string> DescribeLibraryGemm(int out, int in) {
  dev::LibraryGemmState& st = dev::State();
  std::lock_guard<std::mutex> lock(st.mu);
  cublasLtHandle_t handle = nullptr;
  DL_ASSIGN_OR_RETURN(const dev::Plan* plan, dev::PlanFor(st, out, in, &handle));
  return plan->description;
}

std::vector<std::string> LibraryGemmAlgorithmsInUse() {
  std::vector<std::string> out;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return out;
  dev::LibraryGemmState& st = dev::State();
  std::lock_guard<std::mutex> lock(st.mu);
  for (const auto& [key, plan] : st.plans) {
    if (std::get<0>(key) == device) out.push_back(plan.description);
  }
  return out;
}

}  // namespace dl::kernels
