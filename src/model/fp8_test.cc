// FP8 weight checkpoints (docs/fp8.md): quantization_config parsing, make-model's FP8 output read
// back (codes and scales as the synthetic rule gives them), both formats and every scale
// granularity, the layouts, and the errors a broken FP8 checkpoint gives.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/checkpoint.h"
#include "model/fp8_layout.h"
#include "model/model_writer.h"
#include "model/param_count.h"
#include "model/safetensors.h"
#include "model/shapes.h"
#include "model/synthetic.h"
#include "tests/common/temp_dir.h"

namespace dl {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Each test's own directory (dl_fp8_test-XXXXXX).
struct TempDir : test_util::TempDir {
  TempDir() : test_util::TempDir("dl_fp8_test") {}
};

ModelConfig Tiny(int layers = 3) {
  auto c = ShapeConfig("tiny", layers);
  EXPECT_TRUE(c.ok());
  return *c;
}

Result<WeightQuantization> Parse(const json& q) {
  WeightQuantization w;
  std::string method;
  bool weights = false;
  DL_RETURN_IF_ERROR(ParseQuantizationConfig(q, &w, &method, &weights));
  if (!weights) return InvalidArgument("no weights");
  return w;
}

void ExpectError(const Status& s, std::initializer_list<std::string> parts) {
  ASSERT_FALSE(s.ok()) << "expected an error mentioning " << *parts.begin();
  for (const auto& p : parts)
    EXPECT_NE(s.message().find(p), std::string::npos) << "'" << p << "' not in: " << s.message();
}

// The synthetic rule written out independently: per block amax, scale amax / 448, code of v /
// scale.
void ReferenceQuantize(const TensorSpec& s, int64_t br, int64_t bc, std::vector<uint8_t>* codes,
                       std::vector<float>* scales) {
  const int64_t out = s.shape[0], in = s.shape[1];
  std::vector<float> v(static_cast<size_t>(out * in));
  GenerateTensorValues(7, s.name, s.kind, s.fan_in, v.data(), 0, out * in);
  const int64_t nr = (out + br - 1) / br, nc = (in + bc - 1) / bc;
  codes->assign(v.size(), 0);
  scales->assign(static_cast<size_t>(nr * nc), 0.0f);
  for (int64_t bi = 0; bi < nr; ++bi) {
    for (int64_t bj = 0; bj < nc; ++bj) {
      float amax = 0.0f;
      for (int64_t r = bi * br; r < std::min(out, (bi + 1) * br); ++r)
        for (int64_t c = bj * bc; c < std::min(in, (bj + 1) * bc); ++c)
          amax = std::max(amax, std::fabs(v[r * in + c]));
      const float scale = amax == 0.0f ? 1.0f : amax / 448.0f;
      (*scales)[bi * nc + bj] = scale;
      for (int64_t r = bi * br; r < std::min(out, (bi + 1) * br); ++r)
        for (int64_t c = bj * bc; c < std::min(in, (bj + 1) * bc); ++c)
          (*codes)[r * in + c] = FloatToFp8E4M3(v[r * in + c] / scale);
    }
  }
}

TEST(Fp8ConfigTest, BothFormatsAndEveryGranularityParse) {
  auto native = Parse({{"quant_method", "fp8"},
                       {"activation_scheme", "dynamic"},
                       {"weight_block_size", {128, 128}},
                       {"ignored_layers", {"model.layers.0.self_attn.o_proj"}}});
  ASSERT_TRUE(native.ok()) << native.status().message();
  EXPECT_EQ(native->format, WeightQuantFormat::kFp8Native);
  EXPECT_EQ(native->granularity, Fp8Granularity::kBlock);
  EXPECT_EQ(native->block_rows, 128);
  EXPECT_STREQ(native->scale_suffix(), "_scale_inv");
  EXPECT_TRUE(IgnoreMatcher(native->ignore).Matches("model.layers.0.self_attn.o_proj"));
  EXPECT_FALSE(IgnoreMatcher(native->ignore).Matches("model.layers.10.self_attn.o_proj"));
  auto per_tensor = Parse({{"quant_method", "fp8"}, {"weight_block_size", nullptr}});
  ASSERT_TRUE(per_tensor.ok());
  EXPECT_EQ(per_tensor->granularity, Fp8Granularity::kTensor);

  for (Fp8Granularity g :
       {Fp8Granularity::kBlock, Fp8Granularity::kChannel, Fp8Granularity::kTensor}) {
    Fp8Options o;
    o.format = WeightQuantFormat::kFp8CompressedTensors;
    o.granularity = g;
    auto q = BuildQuantizationConfig(Tiny(), o);
    ASSERT_TRUE(q.ok());
    auto w = Parse(*q);
    ASSERT_TRUE(w.ok()) << w.status().message();
    EXPECT_EQ(w->format, WeightQuantFormat::kFp8CompressedTensors);
    EXPECT_EQ(w->granularity, g);
    EXPECT_STREQ(w->scale_suffix(), "_scale");
  }
  // compressed-tensors "re:" patterns match like Python's re.match.
  EXPECT_TRUE(IgnoreMatcher({"re:.*mlp\\.gate$"}).Matches("model.layers.3.mlp.gate"));
  EXPECT_FALSE(IgnoreMatcher({"re:.*mlp\\.gate$"}).Matches("model.layers.3.mlp.gate_proj"));
  EXPECT_TRUE(
      IgnoreMatcher({"lm_head", "model.layers.1"}).Matches("model.layers.1.mlp.experts.0.up_proj"));
}

TEST(Fp8ConfigTest, UnknownOrUnsupportedValuesAreErrors) {
  ExpectError(
      Parse({{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}, {"colour", "blue"}})
          .status(),
      {"unknown key 'colour'"});
  ExpectError(Parse({{"quant_method", "fp8"}, {"activation_scheme", "static"}}).status(),
              {"activation_scheme", "static"});
  ExpectError(Parse({{"quant_method", "fp8"}, {"weight_block_size", {128}}}).status(),
              {"weight_block_size"});
  ExpectError(Parse({{"quant_method", "fp8"}, {"scale_fmt", "ue8m0"}}).status(),
              {"scale_fmt", "ue8m0"});
  ExpectError(Parse({{"quant_method", "awq"}}).status(), {"quant_method \"awq\""});
  Fp8Options o;
  o.format = WeightQuantFormat::kFp8CompressedTensors;
  json q = *BuildQuantizationConfig(Tiny(), o);
  json bad = q;
  bad["config_groups"]["group_0"]["weights"]["num_bits"] = 4;
  ExpectError(Parse(bad).status(), {"num_bits", "4"});
  bad = q;
  bad["config_groups"]["group_0"]["input_activations"]["dynamic"] = false;
  ExpectError(Parse(bad).status(), {"static activation"});
  bad = q;
  bad["transform_config"] = {{"config_groups", {{"R1", {{"type", "hadamard"}}}}}};
  ExpectError(Parse(bad).status(), {"transform_config"});
  bad = q;
  bad["config_groups"]["group_0"]["weights"]["strategy"] = "group";
  ExpectError(Parse(bad).status(), {"strategy \"group\""});
  bad = q;
  bad["ignore"] = {"re:(unclosed"};
  ExpectError(Parse(bad).status(), {"re:(unclosed"});
  // A config that only carries the KV-cache scheme does not quantise weights.
  WeightQuantization w;
  std::string method;
  bool weights = true;
  ASSERT_TRUE(
      ParseQuantizationConfig(
          {{"quant_method", "compressed-tensors"},
           {"kv_cache_scheme", {{"num_bits", 8}, {"type", "float"}, {"strategy", "tensor"}}}},
          &w, &method, &weights)
          .ok());
  EXPECT_FALSE(weights);
  EXPECT_FALSE(w.fp8());
}

TEST(Fp8LayoutTest, ExportIsTheRoutedExpertsOfLayersBelow44AllLinearSkipsHeadRouterAndGate) {
  auto s21 = ShapeConfig("s21");
  ASSERT_TRUE(s21.ok());
  int64_t export_fp8 = 0, all_fp8 = 0;
  for (const TensorSpec& s : CheckpointTensorSpecs(*s21)) {
    const bool e = Fp8LayoutQuantizes(Fp8Layout::kExport, s),
               a = Fp8LayoutQuantizes(Fp8Layout::kAllLinear, s);
    export_fp8 += e;
    all_fp8 += a;
    if (e) {
      EXPECT_NE(s.name.find(".mlp.experts."), std::string::npos) << s.name;
    }
    if (s.name.find("g_proj") != std::string::npos || s.kind != TensorKind::kLinear) {
      EXPECT_FALSE(a) << s.name;
    }
  }
  // laguna-checkpoints.md §2.2: exactly 33,024 FP8 weight/scale pairs = 43 x 768.
  EXPECT_EQ(export_fp8, 33024);
  EXPECT_EQ(all_fp8, 48 * 4 + 3 + 47 * (768 + 3));
  EXPECT_EQ(LayerOfTensor("model.layers.43.mlp.experts.0.up_proj.weight"), 43);
  EXPECT_EQ(LayerOfTensor("lm_head.weight"), -1);
}

// make-model --dtype fp8 writes what the synthetic rule gives; reading it back gives the same codes
// and scales as the in-memory checkpoint and as the rule written out independently.
TEST(Fp8CheckpointTest, MakeModelRoundTripsEveryFormatAndGranularity) {
  const ModelConfig c = Tiny();
  struct Case {
    WeightQuantFormat format;
    Fp8Granularity g;
    Fp8Layout layout;
  };
  for (const Case& k :
       {Case{WeightQuantFormat::kFp8Native, Fp8Granularity::kBlock, Fp8Layout::kAllLinear},
        Case{WeightQuantFormat::kFp8Native, Fp8Granularity::kTensor, Fp8Layout::kExport},
        Case{WeightQuantFormat::kFp8CompressedTensors, Fp8Granularity::kBlock, Fp8Layout::kExport},
        Case{WeightQuantFormat::kFp8CompressedTensors, Fp8Granularity::kChannel,
             Fp8Layout::kAllLinear},
        Case{WeightQuantFormat::kFp8CompressedTensors, Fp8Granularity::kTensor,
             Fp8Layout::kAllLinear}}) {
    SCOPED_TRACE(fmt::format("{} {} {}", Fp8FormatName(k.format), Fp8GranularityName(k.g),
                             Fp8LayoutName(k.layout)));
    TempDir tmp;
    Fp8Options f;
    f.format = k.format;
    f.granularity = k.g;
    f.layout = k.layout;
    f.block_rows = 24;  // partial blocks at the edges of every tiny matrix
    f.block_cols = 40;
    MakeModelOptions o;
    o.config = c;
    o.seed = 7;
    o.fp8 = f;
    o.out_dir = tmp / "m";
    o.max_shard_size = 40000;  // several shards: per-shard dtype ordering and the index
    o.threads = 3;
    auto w = WriteSyntheticModel(o);
    ASSERT_TRUE(w.ok()) << w.status().message();
    EXPECT_GT(w->files.size(), 1u);
    auto ck = Checkpoint::Open(tmp / "m");
    ASSERT_TRUE(ck.ok()) << ck.status().message();
    auto mem = MakeSyntheticCheckpoint(c, 7, DType::kBF16, &f);
    ASSERT_TRUE(mem.ok()) << mem.status().message();
    EXPECT_EQ(ck->config().quantization_config, mem->config().quantization_config);
    EXPECT_EQ(ck->config().quant_method,
              k.format == WeightQuantFormat::kFp8Native ? "fp8" : "compressed-tensors");
    // Every tensor (codes, scales, BF16 values) byte-identical to the in-memory build.
    std::map<std::string, const TensorView*> file;
    for (const TensorView& t : ck->tensors()) file[t.name] = &t;
    ASSERT_EQ(file.size(), mem->tensors().size());
    int fp8_weights = 0;
    for (const TensorView& t : mem->tensors()) {
      ASSERT_TRUE(file.count(t.name)) << t.name;
      const TensorView& r = *file[t.name];
      EXPECT_EQ(r.dtype, t.dtype) << t.name;
      ASSERT_EQ(r.shape, t.shape) << t.name;
      EXPECT_EQ(std::memcmp(r.data, t.data, t.nbytes()), 0) << t.name;
      fp8_weights += t.dtype == DType::kF8E4M3;
    }
    EXPECT_GT(fp8_weights, 0);
    // The weights' views carry the scales; check one expert against the independent rule.
    const TensorView& up = ck->weights().layers[1].experts[2].up;
    ASSERT_EQ(up.dtype, DType::kF8E4M3);
    ASSERT_NE(up.scales, nullptr);
    const TensorSpec spec{up.name, up.shape, TensorKind::kLinear, up.shape[1]};
    int64_t br = 0, bc = 0;
    ck->config().weight_quant.BlockShape(up.shape[0], up.shape[1], &br, &bc);
    EXPECT_EQ(up.block_rows, br);
    EXPECT_EQ(up.block_cols, bc);
    std::vector<uint8_t> codes;
    std::vector<float> scales;
    ReferenceQuantize(spec, br, bc, &codes, &scales);
    EXPECT_EQ(std::memcmp(up.data, codes.data(), codes.size()), 0);
    ASSERT_EQ(up.num_scales(), static_cast<int64_t>(scales.size()));
    for (size_t i = 0; i < scales.size(); ++i) EXPECT_EQ(up.scales[i], scales[i]) << i;
    EXPECT_EQ(up.scale_name, up.name + ck->config().weight_quant.scale_suffix());
    // Attention: FP8 only in all-linear; the head gate, router and LM head never.
    const LayerWeights& L1 = ck->weights().layers[1];
    EXPECT_EQ(L1.q.dtype, k.layout == Fp8Layout::kAllLinear ? DType::kF8E4M3 : DType::kBF16);
    EXPECT_EQ(L1.g.dtype, DType::kBF16);
    EXPECT_EQ(L1.router.dtype, DType::kBF16);
    EXPECT_EQ(ck->weights().lm_head.dtype, DType::kBF16);
    EXPECT_EQ(L1.shared.up.dtype,
              k.layout == Fp8Layout::kAllLinear ? DType::kF8E4M3 : DType::kBF16);
    // The BF16 tensors are those of a plain BF16 make-model.
    auto bf16 = MakeSyntheticCheckpoint(c, 7, DType::kBF16);
    ASSERT_TRUE(bf16.ok());
    EXPECT_EQ(
        std::memcmp(L1.router.data, bf16->weights().layers[1].router.data, L1.router.nbytes()), 0);
  }
}

TEST(Fp8CheckpointTest, ConfigJsonSpellsTheQuantizationConfig) {
  TempDir tmp;
  MakeModelOptions o;
  o.config = Tiny();
  o.fp8 = Fp8Options{};
  o.out_dir = tmp / "n";
  ASSERT_TRUE(WriteSyntheticModel(o).ok());
  json cfg = json::parse(std::ifstream(tmp / "n/config.json"));
  const json& q = cfg["quantization_config"];
  EXPECT_EQ(q["quant_method"], "fp8");
  EXPECT_EQ(q["activation_scheme"], "dynamic");
  EXPECT_EQ(q["weight_block_size"], json({128, 128}));
  const auto& ig = q["ignored_layers"];
  auto has = [&](const std::string& m) { return std::find(ig.begin(), ig.end(), m) != ig.end(); };
  EXPECT_TRUE(has("model.layers.0.self_attn.o_proj"));
  EXPECT_TRUE(has("model.layers.1.mlp.gate"));
  EXPECT_TRUE(has("lm_head"));
  EXPECT_TRUE(has("model.layers.1.mlp.shared_expert.down_proj"));
  EXPECT_FALSE(has("model.layers.1.mlp.experts.0.down_proj"));
  EXPECT_EQ(q.size(), 4u);
}

struct Owned {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

std::vector<Owned> Tensors(const Checkpoint& ck) {
  std::vector<Owned> out;
  for (const auto& t : ck.tensors()) {
    const auto* p = static_cast<const uint8_t*>(t.data);
    out.push_back(Owned{t.name, t.dtype, t.shape, std::vector<uint8_t>(p, p + t.nbytes())});
  }
  return out;
}

Status WriteAndOpen(const std::string& dir, const json& config, const std::vector<Owned>& tensors) {
  fs::create_directories(dir);
  std::ofstream(dir + "/config.json") << config.dump(2);
  std::vector<SafetensorsEntry> e;
  std::vector<const void*> d;
  for (const Owned& t : tensors) {
    e.push_back(SafetensorsEntry{t.name, t.dtype, t.shape});
    d.push_back(t.bytes.data());
  }
  DL_RETURN_IF_ERROR(WriteSafetensorsFile(dir + "/model.safetensors", e, d));
  return Checkpoint::Open(dir).status();
}

Owned* Find(std::vector<Owned>& t, const std::string& name) {
  for (Owned& x : t) {
    if (x.name == name) return &x;
  }
  ADD_FAILURE() << "no tensor " << name;
  static Owned none;
  return &none;
}

TEST(Fp8CheckpointTest, BrokenScalesAndMisplacedFp8AreErrorsNamingTheTensor) {
  TempDir tmp;
  Fp8Options f;
  f.layout = Fp8Layout::kAllLinear;
  auto mem = MakeSyntheticCheckpoint(Tiny(), 1, DType::kBF16, &f);
  ASSERT_TRUE(mem.ok()) << mem.status().message();
  const json cfg = mem->config().ToJson();
  const std::vector<Owned> good = Tensors(*mem);
  ASSERT_TRUE(WriteAndOpen(tmp / "good", cfg, good).ok());
  const std::string w = "model.layers.1.mlp.experts.2.down_proj.weight", s = w + "_scale_inv";
  {
    auto t = good;
    t.erase(std::find_if(t.begin(), t.end(), [&](const Owned& x) { return x.name == s; }));
    ExpectError(WriteAndOpen(tmp / "missing", cfg, t), {"has no scale tensor", s});
  }
  {
    auto t = good;
    Find(t, s)->shape = {2, 1};
    Find(t, s)->bytes.resize(8);
    ExpectError(WriteAndOpen(tmp / "shape", cfg, t), {s, "[2, 1]", "[1, 1]"});
  }
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    auto t = good;
    std::memcpy(Find(t, s)->bytes.data(), &bad, 4);
    ExpectError(WriteAndOpen(tmp / (std::isnan(bad) ? "nan" : "inf"), cfg, t), {s, "non-finite"});
  }
  {
    auto t = good;
    Owned* x = Find(t, s);
    x->dtype = DType::kBF16;
    x->bytes.resize(2);
    ExpectError(WriteAndOpen(tmp / "dtype", cfg, t), {s, "BF16", "must be F32"});
  }
  {
    auto t = good;  // the embedding is never FP8
    Owned* x = Find(t, "model.embed_tokens.weight");
    x->dtype = DType::kF8E4M3;
    x->bytes.resize(x->bytes.size() / 2);
    ExpectError(WriteAndOpen(tmp / "embed", cfg, t),
                {"model.embed_tokens.weight", "only linear layers"});
  }
  {
    auto t = good;  // a scale beside a BF16 weight
    t.push_back(
        Owned{"model.layers.1.mlp.gate.weight_scale_inv", DType::kF32, {1, 1}, {0, 0, 128, 63}});
    ExpectError(WriteAndOpen(tmp / "stray", cfg, t),
                {"model.layers.1.mlp.gate.weight_scale_inv", "not an FP8 weight"});
  }
  {
    auto t = good;  // compressed-tensors names in a native checkpoint
    Find(t, s)->name = w + "_scale";
    ExpectError(WriteAndOpen(tmp / "other", cfg, t), {w + "_scale", "other FP8 format"});
  }
  {
    json c2 = cfg;  // the config says the module stays BF16, the header says FP8
    c2["quantization_config"]["ignored_layers"].push_back("model.layers.1.mlp.experts.2");
    ExpectError(WriteAndOpen(tmp / "ignored", c2, good),
                {"model.layers.1.mlp.experts.2.", "not quantised"});
  }
  {
    json c2 = cfg;  // FP8 tensors without any quantization_config
    c2.erase("quantization_config");
    ExpectError(WriteAndOpen(tmp / "noconfig", c2, good), {"quantization_config"});
  }
}

TEST(Fp8CheckpointTest, ShapeOnlyCheckpointSaysWhichTensorsAreFp8) {
  Fp8Options f;
  f.layout = Fp8Layout::kExport;
  auto ck = MakeShapeOnlyCheckpoint(Tiny(), &f);
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  const TensorView& gate = ck->weights().layers[2].experts[0].gate;
  EXPECT_EQ(gate.dtype, DType::kF8E4M3);
  EXPECT_EQ(gate.data, nullptr);
  EXPECT_EQ(gate.scales, nullptr);
  EXPECT_EQ(gate.block_rows, 128);
  EXPECT_EQ(gate.block_cols, 128);
  EXPECT_EQ(ck->weights().layers[2].q.dtype, DType::kBF16);
  EXPECT_EQ(ck->config().weight_quant.format, WeightQuantFormat::kFp8Native);
}

}  // namespace
}  // namespace dl
