#include "model/fp8_layout.h"

#include <charconv>

namespace dl {

using nlohmann::json;

std::string_view Fp8LayoutName(Fp8Layout l) {
  return l == Fp8Layout::kExport ? "export" : "all-linear";
}

Result<Fp8Layout> ParseFp8Layout(std::string_view name) {
  if (name == "export") return Fp8Layout::kExport;
  if (name == "all-linear") return Fp8Layout::kAllLinear;
  return InvalidArgument("FP8 layout '{}' is not one of export, all-linear", name);
}

std::string_view Fp8FormatName(WeightQuantFormat f) {
  switch (f) {
    case WeightQuantFormat::kNone:
      return "none";
    case WeightQuantFormat::kFp8Native:
      return "native";
    case WeightQuantFormat::kFp8CompressedTensors:
      return "compressed-tensors";
  }
  return "?";
}

Result<WeightQuantFormat> ParseFp8Format(std::string_view name) {
  if (name == "native") return WeightQuantFormat::kFp8Native;
  if (name == "compressed-tensors") return WeightQuantFormat::kFp8CompressedTensors;
  return InvalidArgument("FP8 format '{}' is not one of native, compressed-tensors", name);
}

std::string_view Fp8GranularityName(Fp8Granularity g) {
  switch (g) {
    case Fp8Granularity::kBlock:
      return "block";
    case Fp8Granularity::kChannel:
      return "channel";
    case Fp8Granularity::kTensor:
      return "tensor";
  }
  return "?";
}

Result<Fp8Granularity> ParseFp8Granularity(std::string_view name) {
  if (name == "block") return Fp8Granularity::kBlock;
  if (name == "channel") return Fp8Granularity::kChannel;
  if (name == "tensor") return Fp8Granularity::kTensor;
  return InvalidArgument("FP8 scale granularity '{}' is not one of block, channel, tensor", name);
}

int64_t LayerOfTensor(std::string_view name) {
  constexpr std::string_view kPrefix = "model.layers.";
  if (name.substr(0, kPrefix.size()) != kPrefix) return -1;
  const char* b = name.data() + kPrefix.size();
  int64_t l = -1;
  auto [p, ec] = std::from_chars(b, name.data() + name.size(), l);
  if (ec != std::errc() || p == b || p == name.data() + name.size() || *p != '.') return -1;
  return l;
}

bool Fp8LayoutQuantizes(Fp8Layout layout, const TensorSpec& spec) {
  if (spec.kind != TensorKind::kLinear) return false;
  switch (layout) {
    case Fp8Layout::kExport:
      return spec.name.find(".mlp.experts.") != std::string::npos &&
             LayerOfTensor(spec.name) < kExportFirstBf16ExpertLayer;
    case Fp8Layout::kAllLinear:
      return spec.name.find(".self_attn.g_proj.") == std::string::npos;
  }
  return false;
}

Result<json> BuildQuantizationConfig(const ModelConfig& c, const Fp8Options& o) {
  json ignore = json::array();
  for (const TensorSpec& s : CheckpointTensorSpecs(c)) {
    const bool linear_module = s.kind == TensorKind::kLinear || s.kind == TensorKind::kRouter ||
                               s.kind == TensorKind::kLmHead;
    if (!linear_module || Fp8LayoutQuantizes(o.layout, s)) continue;
    ignore.push_back(s.name.substr(0, s.name.size() - std::string_view(".weight").size()));
  }
  if (o.granularity == Fp8Granularity::kBlock && (o.block_rows <= 0 || o.block_cols <= 0)) {
    return InvalidArgument("FP8 block shape {}x{} must be positive", o.block_rows, o.block_cols);
  }
  const json block =
      o.granularity == Fp8Granularity::kBlock ? json{o.block_rows, o.block_cols} : json(nullptr);
  if (o.format == WeightQuantFormat::kFp8Native) {
    if (o.granularity == Fp8Granularity::kChannel) {
      return InvalidArgument(
          "the native fp8 format has block or per-tensor scales only; per-channel scales are "
          "a compressed-tensors strategy (--fp8-format compressed-tensors)");
    }
    return json{{"activation_scheme", "dynamic"},
                {"ignored_layers", ignore},
                {"quant_method", "fp8"},
                {"weight_block_size", block}};
  }
  if (o.format != WeightQuantFormat::kFp8CompressedTensors)
    return InvalidArgument("no FP8 format given");
  const std::string strategy(Fp8GranularityName(o.granularity));
  json weights = {{"actorder", nullptr},
                  {"block_structure", block},
                  {"dynamic", false},
                  {"group_size", nullptr},
                  {"num_bits", 8},
                  {"observer", "minmax"},
                  {"observer_kwargs", json::object()},
                  {"strategy", strategy},
                  {"symmetric", true},
                  {"type", "float"}};
  // What LLM Compressor's FP8 presets declare for activations: per token-group of 128 with block
  // weights, per token otherwise, dynamic. Engines that quantise activations read this; decodelab
  // keeps activations unquantised (docs/fp8.md).
  const bool grouped = o.granularity == Fp8Granularity::kBlock;
  json acts = {{"actorder", nullptr},
               {"block_structure", nullptr},
               {"dynamic", true},
               {"group_size", grouped ? json(o.block_cols) : json(nullptr)},
               {"num_bits", 8},
               {"observer", nullptr},
               {"observer_kwargs", json::object()},
               {"strategy", grouped ? "group" : "token"},
               {"symmetric", true},
               {"type", "float"}};
  json group = {{"format", "float-quantized"},
                {"input_activations", acts},
                {"output_activations", nullptr},
                {"targets", {"Linear"}},
                {"weights", weights}};
  return json{{"config_groups", {{"group_0", group}}},
              {"format", "float-quantized"},
              {"global_compression_ratio", nullptr},
              {"ignore", ignore},
              {"kv_cache_scheme", nullptr},
              {"quant_method", "compressed-tensors"},
              {"quantization_status", "compressed"},
              {"sparsity_config", json::object()},
              {"transform_config", json::object()},
              {"version", "0.12.2"}};
}

Status ApplyFp8Options(ModelConfig* c, const Fp8Options& o) {
  DL_ASSIGN_OR_RETURN(json q, BuildQuantizationConfig(*c, o));
  c->has_quantization_config = true;
  c->quantization_config = q;
  return ParseQuantizationConfig(q, &c->weight_quant, &c->quant_method, &c->quantizes_weights);
}

}  // namespace dl
