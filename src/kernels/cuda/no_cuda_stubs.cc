// CPU-only builds: the launchers exist so callers link, and say plainly that there is no CUDA backend.
#include "kernels/attention/attention.h"
#include "kernels/ops.h"
#include "kernels/sampling.h"
#include "kernels/timeline.h"

namespace dl::kernels {
namespace {
Status NoCuda(const char* what) {
  return Unavailable("{}: this build of decodelab has no CUDA backend", what);
}
}  // namespace

Status AddRmsNorm(const AddRmsNormParams&, Stream) { return NoCuda("add_rmsnorm"); }
Status QkNormRopeAppend(const QkNormRopeAppendParams&, Stream) {
  return NoCuda("qknorm_rope_append");
}
Status Gemv(const GemvParams&, Stream) { return NoCuda("gemv"); }
Status LibraryGemmAvailable() { return NoCuda("the library GEMM"); }
Result<std::string> DescribeLibraryGemm(int, int) { return NoCuda("the library GEMM"); }
std::vector<std::string> LibraryGemmAlgorithmsInUse() { return {}; }
bool GemvStreamSupported(int, int, int, int) { return false; }
size_t MoeWorkspaceBytes(int, int, int, int, int, int) { return 0; }
void SetDependentLaunch(bool) {}
bool DependentLaunchEnabled() { return false; }
Status Moe(const MoeParams&, Stream) { return NoCuda("moe"); }
Status MoeRouter(const MoeParams&, Stream) { return NoCuda("moe_router"); }
size_t ArgmaxWorkspaceBytes(int) { return 0; }
Status Argmax(const ArgmaxParams&, Stream) { return NoCuda("argmax"); }
Status SampleRows(const SampleRowsParams&, Stream) { return NoCuda("sample_rows"); }
Status FillRandomBf16(bf16*, size_t, uint64_t, float, Stream) { return NoCuda("fill_random_bf16"); }
bool TimelineBuilt() { return false; }
Status TimelineEnable(size_t) { return NoCuda("timeline"); }
Status TimelineReset(Stream) { return NoCuda("timeline"); }
Result<std::vector<TimelineRecord>> TimelineRead() { return NoCuda("timeline"); }
bool RegisterTimelineInstaller(TimelineInstaller) { return false; }
Status LaunchAttentionFallback(const AttentionParams&, Stream) {
  return NoCuda("attn_generic_fallback");
}

}  // namespace dl::kernels
