// Which weights are FP8 in a generated checkpoint (make-model --dtype fp8, --shape-dtype fp8), and
// the quantization_config that says so. The one place that decides the layouts (docs/fp8.md):
//   export      what Laguna's own FP8 exports quantise: the routed experts, except in MoE layers
//               44 and up (the current Laguna-S-2.1-FP8 keeps 4 of its 47 MoE layers' experts in
//               BF16 -- 43 x 768 FP8 tensors; which four is not recorded, the last ones are the
//               best guess, laguna-checkpoints.md §2.2). Attention, shared experts, the dense
//               layer, routers, embedding and LM head stay BF16. On XS.2 (40 layers) every routed
//               expert is FP8, as in Laguna-XS.2-FP8 (§2.1).
//   all-linear  every linear layer except the LM head, the routers and the attention head gate
//               (g_proj): q/k/v/o, dense MLP, routed and shared experts.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "model/config.h"
#include "model/quantization.h"
#include "model/synthetic.h"

namespace dl {

enum class Fp8Layout : uint8_t { kExport, kAllLinear };

// MoE layers at this index and above keep BF16 experts in the `export` layout.
constexpr int64_t kExportFirstBf16ExpertLayer = 44;

// How to write (or generate) an FP8 checkpoint.
struct Fp8Options {
  WeightQuantFormat format = WeightQuantFormat::kFp8Native;
  Fp8Layout layout = Fp8Layout::kExport;
  Fp8Granularity granularity = Fp8Granularity::kBlock;
  int64_t block_rows = 128, block_cols = 128;  // kBlock
};

std::string_view Fp8LayoutName(Fp8Layout l);  // "export", "all-linear"
Result<Fp8Layout> ParseFp8Layout(std::string_view name);
std::string_view Fp8FormatName(WeightQuantFormat f);  // "native", "compressed-tensors"
Result<WeightQuantFormat> ParseFp8Format(std::string_view name);
std::string_view Fp8GranularityName(Fp8Granularity g);  // "block", "channel", "tensor"
Result<Fp8Granularity> ParseFp8Granularity(std::string_view name);

// The decoder layer a tensor name belongs to ("model.layers.N...."), or -1.
int64_t LayerOfTensor(std::string_view name);

// Whether `layout` stores tensor `spec` (of CheckpointTensorSpecs) as FP8. Only kLinear tensors
// ever are: never the embedding, norms, routers, correction biases or the LM head.
bool Fp8LayoutQuantizes(Fp8Layout layout, const TensorSpec& spec);

// The quantization_config object for `options` over config `c`, spelled as the real exports spell
// it: native {"activation_scheme": "dynamic", "ignored_layers": [...], "quant_method": "fp8",
// "weight_block_size": [128, 128]}; compressed-tensors one "float-quantized" config group targeting
// Linear with the block/channel/tensor weight strategy and dynamic activations, and an "ignore"
// list. The ignore lists name every linear module left in BF16 (LM head and routers included).
Result<nlohmann::json> BuildQuantizationConfig(const ModelConfig& c, const Fp8Options& options);

// `c` with its quantization_config (and the parsed fields) set for `options`.
Status ApplyFp8Options(ModelConfig* c, const Fp8Options& options);

}  // namespace dl
