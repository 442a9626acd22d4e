#include "model/checkpoint.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/model_writer.h"
#include "model/safetensors.h"
#include "model/shapes.h"
#include "tests/common/temp_dir.h"

namespace dl {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Each test's own directory (dl_model_test-XXXXXX).
struct TempDir : test_util::TempDir {
  TempDir() : test_util::TempDir("dl_model_test") {}
};

struct Owned {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

std::vector<Owned> TinyTensors(const ModelConfig& c, uint64_t seed = 1) {
  auto ck = MakeSyntheticCheckpoint(c, seed, DType::kBF16);
  EXPECT_TRUE(ck.ok()) << ck.status().message();
  std::vector<Owned> out;
  for (const auto& t : ck->tensors()) {
    const auto* p = static_cast<const uint8_t*>(t.data);
    out.push_back(Owned{t.name, t.dtype, t.shape, std::vector<uint8_t>(p, p + t.nbytes())});
  }
  return out;
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Writes config + tensors split evenly over `shards` files (one file: model.safetensors).
void WriteDir(const std::string& dir, const json& config, const std::vector<Owned>& tensors, int shards = 1) {
  fs::create_directories(dir);
  WriteText(dir + "/config.json", config.dump(2));
  json wm = json::object();
  const size_t per = (tensors.size() + shards - 1) / shards;
  for (int s = 0; s < shards; ++s) {
    const std::string file = shards == 1 ? "model.safetensors"
                                         : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards);
    std::vector<SafetensorsEntry> e;
    std::vector<const void*> d;
    for (size_t i = s * per; i < std::min(tensors.size(), (s + 1) * per); ++i) {
      e.push_back(SafetensorsEntry{tensors[i].name, tensors[i].dtype, tensors[i].shape});
      d.push_back(tensors[i].bytes.data());
      wm[tensors[i].name] = file;
    }
    ASSERT_TRUE(WriteSafetensorsFile(dir + "/" + file, e, d).ok());
  }
  if (shards > 1) WriteText(dir + "/model.safetensors.index.json", json{{"metadata", {{"total_size", 0}}}, {"weight_map", wm}}.dump());
}

ModelConfig Tiny(std::optional<int> layers = std::nullopt) {
  auto c = ShapeConfig("tiny", layers);
  EXPECT_TRUE(c.ok());
  return *c;
}

bool SameBytes(const TensorView& a, const TensorView& b) {
  return a.dtype == b.dtype && a.shape == b.shape && std::memcmp(a.data, b.data, a.nbytes()) == 0;
}

double Stddev(const TensorView& t) {
  double s = 0, s2 = 0;
  for (int64_t i = 0; i < t.numel(); ++i) {
    s += t.at(i);
    s2 += double(t.at(i)) * t.at(i);
  }
  const double m = s / t.numel();
  return std::sqrt(s2 / t.numel() - m * m);
}

Status OpenStatus(const std::string& dir) { return Checkpoint::Open(dir).status(); }

void ExpectError(const Status& s, std::initializer_list<const char*> needles) {
  ASSERT_FALSE(s.ok());
  for (const char* n : needles) EXPECT_NE(s.message().find(n), std::string::npos) << "'" << n << "' not in: " << s.message();
}

TEST(MakeModelTest, WritesLoadableDeterministicCheckpoint) {
  TempDir tmp;
  MakeModelOptions o;
  o.config = Tiny();
  o.seed = 7;
  o.out_dir = tmp / "m";
  auto r = WriteSyntheticModel(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->files, std::vector<std::string>{"model.safetensors"});
  EXPECT_TRUE(fs::exists(tmp / "m/generation_config.json"));
  EXPECT_FALSE(fs::exists(tmp / "m/model.safetensors.index.json"));
  for (const auto& e : fs::directory_iterator(tmp.path())) EXPECT_EQ(e.path().filename(), "m");

  auto ck = Checkpoint::Open(tmp / "m");
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_EQ(ck->config().ToJson(), o.config.ToJson());
  const ModelWeights& w = ck->weights();
  ASSERT_EQ(w.layers.size(), 5u);
  EXPECT_EQ(w.layers[1].experts.size(), 8u);
  EXPECT_EQ(w.layers[1].q.shape, (std::vector<int64_t>{8 * 32, 64}));
  EXPECT_EQ(w.layers[0].g.shape, (std::vector<int64_t>{4, 64}));
  EXPECT_TRUE(w.layers[1].mlp_gate.empty());
  EXPECT_FALSE(w.layers[0].k_scale.has_value());

  // The in-memory builder gives identical bytes.
  auto syn = MakeSyntheticCheckpoint(o.config, 7, DType::kBF16);
  ASSERT_TRUE(syn.ok());
  ASSERT_EQ(syn->tensors().size(), ck->tensors().size());
  std::map<std::string, TensorView> by_name;
  for (const auto& t : syn->tensors()) by_name[t.name] = t;
  for (const auto& t : ck->tensors()) EXPECT_TRUE(SameBytes(t, by_name.at(t.name))) << t.name;

  // Distributions as documented: linear std 1/sqrt(in), embedding 1, norms 1 + 0.2 N, bias 0.1 N.
  EXPECT_NEAR(Stddev(w.embed), 1.0, 0.02);
  EXPECT_NEAR(Stddev(w.layers[1].q), 1.0 / 8.0, 0.01);
  EXPECT_NEAR(Stddev(w.layers[1].o), 1.0 / 16.0, 0.005);
  EXPECT_NEAR(Stddev(w.lm_head), 3.0 / 8.0, 0.01);
  EXPECT_NEAR(Stddev(w.layers[0].input_norm), 0.2, 0.06);
  EXPECT_GT(Stddev(w.layers[1].correction_bias), 0.03);
  EXPECT_NEAR(w.final_norm.at(0), 1.0, 1.0);
  EXPECT_NE(w.final_norm.at(0), w.final_norm.at(1));

  // Another seed gives other values; the same seed the same ones.
  auto other = MakeSyntheticCheckpoint(o.config, 8, DType::kBF16);
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(SameBytes(other->weights().layers[2].experts[3].down, w.layers[2].experts[3].down));
}

TEST(MakeModelTest, ShardsLikeTransformersAndTruncatesLayers) {
  TempDir tmp;
  MakeModelOptions o;
  o.config = Tiny(2);
  o.out_dir = tmp / "m";
  o.max_shard_size = 40000;
  o.dtype = DType::kF32;
  auto r = WriteSyntheticModel(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_GT(r->files.size(), 3u);
  EXPECT_EQ(r->files[0], fmt::format("model-00001-of-{:05d}.safetensors", r->files.size()));
  std::ifstream in(tmp / "m/model.safetensors.index.json");
  json idx = json::parse(in);
  EXPECT_EQ(idx["metadata"]["total_size"].get<uint64_t>(), r->weight_bytes);
  EXPECT_EQ(idx["weight_map"]["lm_head.weight"], r->files.back());
  for (const auto& f : r->files) {
    auto sf = SafetensorsFile::Open(tmp / ("m/" + f));
    ASSERT_TRUE(sf.ok());
    EXPECT_EQ(sf->metadata().at("format"), "pt");
  }
  auto ck = Checkpoint::Open(tmp / "m");
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_EQ(ck->config().num_hidden_layers, 2);
  EXPECT_EQ(ck->weights().embed.dtype, DType::kF32);
  auto syn = MakeSyntheticCheckpoint(o.config, 0, DType::kF32);
  ASSERT_TRUE(syn.ok());
  EXPECT_TRUE(SameBytes(ck->weights().layers[1].experts[5].up, syn->weights().layers[1].experts[5].up));
}

TEST(MakeModelTest, PlanShardsAndSizes) {
  auto s = PlanShards({4, 4, 4, 10, 1}, 8);
  ASSERT_EQ(s.size(), 4u);  // [4,4] [4] [10] [1]
  EXPECT_EQ(s[0].tensors, (std::vector<size_t>{0, 1}));
  EXPECT_EQ(s[2].tensors, (std::vector<size_t>{3}));  // oversized tensor alone
  EXPECT_EQ(s[3].file, "model-00004-of-00004.safetensors");
  EXPECT_EQ(PlanShards({1, 2}, 100)[0].file, "model.safetensors");
  EXPECT_EQ(*ParseByteSize("5GB"), 5'000'000'000u);
  EXPECT_EQ(*ParseByteSize("2GiB"), 2ull << 30);
  EXPECT_EQ(*ParseByteSize("500mb"), 500'000'000u);
  EXPECT_FALSE(ParseByteSize("GB").ok());
  EXPECT_FALSE(ParseByteSize("5XB").ok());
}

TEST(MakeModelTest, FailsCleanly) {
  TempDir tmp;
  MakeModelOptions o;
  o.config = Tiny(1);
  o.out_dir = tmp / "m";
  o.free_bytes_override = 1000;
  ExpectError(WriteSyntheticModel(o).status(), {"not enough disk space", "GB"});
  o.free_bytes_override.reset();
  std::atomic<bool> cancel{true};
  o.cancel = &cancel;
  EXPECT_EQ(WriteSyntheticModel(o).status().code(), StatusCode::kCancelled);
  EXPECT_TRUE(fs::is_empty(tmp.path())) << "partial directory left behind";
  o.cancel = nullptr;
  fs::create_directories(tmp / "m");
  WriteText(tmp / "m/keep", "x");
  ExpectError(WriteSyntheticModel(o).status(), {"already exists"});
  EXPECT_TRUE(fs::exists(tmp / "m/keep"));
}

TEST(CheckpointTest, FourteenShardsAndQuirks) {
  TempDir tmp;
  ModelConfig c = Tiny();
  json cfg = c.ToJson();
  // Quirks of shipped configs: the top-level duplicate, "per-head" string, torch_dtype.
  cfg["rope_parameters"]["original_max_position_embeddings"] = 4096;
  cfg["gating"] = "per-head";
  cfg.erase("dtype");
  cfg["torch_dtype"] = "bfloat16";
  std::vector<Owned> t = TinyTensors(c);
  // An F32 correction bias beside BF16 weights.
  std::vector<float> bias_f32;
  for (auto& x : t) {
    if (x.name == "model.layers.2.mlp.experts.e_score_correction_bias") {
      for (int i = 0; i < 8; ++i) bias_f32.push_back(LoadAsFloat(x.bytes.data(), DType::kBF16, i) + 1e-3f);
      x.dtype = DType::kF32;
      x.bytes.assign(reinterpret_cast<uint8_t*>(bias_f32.data()), reinterpret_cast<uint8_t*>(bias_f32.data() + 8));
    }
  }
  WriteDir(tmp / "m", cfg, t, 14);
  EXPECT_TRUE(fs::exists(tmp / "m/model-00014-of-00014.safetensors"));
  auto ck = Checkpoint::Open(tmp / "m");
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_EQ(ck->files().size(), 14u);
  EXPECT_EQ(ck->config().gating, GatingKind::kPerHead);
  const TensorView& b = ck->weights().layers[2].correction_bias;
  EXPECT_EQ(b.dtype, DType::kF32);
  EXPECT_EQ(b.at(5), bias_f32[5]);
}

TEST(CheckpointTest, FusedLayout) {
  TempDir tmp;
  ModelConfig c = Tiny(2);
  auto syn = MakeSyntheticCheckpoint(c, 3, DType::kBF16);
  ASSERT_TRUE(syn.ok());
  std::vector<Owned> t;
  const int64_t E = 8, F = 32, d = 64, Fs = 16;
  Owned gu{"model.layers.1.mlp.experts.gate_up_proj", DType::kBF16, {E, 2 * F, d}, {}};
  Owned dn{"model.layers.1.mlp.experts.down_proj", DType::kBF16, {E, d, F}, {}};
  const LayerWeights& L = syn->weights().layers[1];
  auto append = [](Owned& o, const TensorView& v) {
    const auto* p = static_cast<const uint8_t*>(v.data);
    o.bytes.insert(o.bytes.end(), p, p + v.nbytes());
  };
  for (int64_t e = 0; e < E; ++e) {
    append(gu, L.experts[e].gate);  // gate rows first
    append(gu, L.experts[e].up);
    append(dn, L.experts[e].down);
  }
  for (const auto& v : syn->tensors()) {
    if (v.name.find("mlp.experts.") != std::string::npos && v.name.find("bias") == std::string::npos) continue;
    std::string name = v.name;
    if (name == "model.layers.1.mlp.experts.e_score_correction_bias") name = "model.layers.1.mlp.gate.e_score_correction_bias";
    if (auto at = name.find("shared_expert."); at != std::string::npos) name.replace(at, 14, "shared_experts.");
    Owned o{name, v.dtype, v.shape, {}};
    append(o, v);
    t.push_back(std::move(o));
  }
  t.push_back(gu);
  t.push_back(dn);
  WriteDir(tmp / "m", c.ToJson(), t);
  auto ck = Checkpoint::Open(tmp / "m");
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_TRUE(ck->fused_experts());
  const LayerWeights& M = ck->weights().layers[1];
  ASSERT_EQ(M.experts.size(), 8u);
  for (int64_t e = 0; e < E; ++e) {
    EXPECT_TRUE(SameBytes(M.experts[e].gate, L.experts[e].gate)) << e;
    EXPECT_TRUE(SameBytes(M.experts[e].up, L.experts[e].up)) << e;
    EXPECT_TRUE(SameBytes(M.experts[e].down, L.experts[e].down)) << e;
  }
  EXPECT_TRUE(SameBytes(M.correction_bias, L.correction_bias));
  EXPECT_TRUE(SameBytes(M.shared.down, L.shared.down));
  EXPECT_EQ(M.shared.gate.shape, (std::vector<int64_t>{Fs, d}));
}

TEST(CheckpointTest, KvScalesAreExposed) {
  TempDir tmp;
  ModelConfig c = Tiny(1);
  std::vector<Owned> t = TinyTensors(c);
  const uint16_t half = FloatToBf16(0.5f), q = FloatToBf16(0.25f);
  t.push_back(Owned{"model.layers.0.self_attn.k_scale", DType::kBF16, {1}, {uint8_t(half), uint8_t(half >> 8)}});
  t.push_back(Owned{"model.layers.0.self_attn.v_scale", DType::kBF16, {}, {uint8_t(q), uint8_t(q >> 8)}});
  WriteDir(tmp / "m", c.ToJson(), t);
  auto ck = Checkpoint::Open(tmp / "m");
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  EXPECT_EQ(ck->weights().layers[0].k_scale, 0.5f);
  EXPECT_EQ(ck->weights().layers[0].v_scale, 0.25f);
}

// FP8 tensors and scales need a quantization_config saying how to read them (fp8_test.cc covers FP8
// checkpoints themselves); an FP8 config over BF16 tensors is fine: each tensor's header decides.
TEST(CheckpointTest, Fp8TensorsNeedAnFp8QuantizationConfig) {
  TempDir tmp;
  ModelConfig c = Tiny(1);
  json cfg = c.ToJson();
  cfg["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}};
  WriteDir(tmp / "a", cfg, TinyTensors(c));
  EXPECT_TRUE(Checkpoint::Open(tmp / "a").ok());
  std::vector<Owned> t = TinyTensors(c);
  t.push_back(Owned{"model.layers.0.mlp.down_proj.weight_scale_inv", DType::kF32, {1}, {0, 0, 128, 63}});
  WriteDir(tmp / "b", c.ToJson(), t);
  ExpectError(OpenStatus(tmp / "b"), {"no FP8", "quantization_config", "weight_scale_inv"});
  t = TinyTensors(c);
  for (auto& x : t) {
    if (x.name == "model.layers.0.self_attn.q_proj.weight") {
      x.dtype = DType::kF8E4M3;
      x.bytes.resize(x.bytes.size() / 2);
    }
  }
  WriteDir(tmp / "c", c.ToJson(), t);
  ExpectError(OpenStatus(tmp / "c"), {"F8_E4M3", "no FP8 quantization_config", "q_proj"});
}

TEST(CheckpointTest, BadInputGivesClearErrors) {
  TempDir tmp;
  ModelConfig c = Tiny(2);
  const std::vector<Owned> good = TinyTensors(c);
  {
    std::vector<Owned> t = good;
    t.erase(std::remove_if(t.begin(), t.end(), [](const Owned& x) { return x.name == "model.layers.1.mlp.experts.3.up_proj.weight"; }),
            t.end());
    WriteDir(tmp / "missing", c.ToJson(), t);
    ExpectError(OpenStatus(tmp / "missing"), {"missing tensor", "model.layers.1.mlp.experts.3.up_proj.weight"});
  }
  {
    std::vector<Owned> t = good;
    t.push_back(Owned{"model.layers.1.mlp.experts.8.up_proj.weight", DType::kBF16, {2}, {1, 2, 3, 4}});
    WriteDir(tmp / "extra", c.ToJson(), t, 3);
    ExpectError(OpenStatus(tmp / "extra"), {"unexpected", "model.layers.1.mlp.experts.8.up_proj.weight",
                                            "model-00003-of-00003.safetensors"});
  }
  {
    json cfg = c.ToJson();
    cfg["num_attention_heads_per_layer"] = {4, 4};  // file has 8 heads on layer 1
    WriteDir(tmp / "shape", cfg, good);
    ExpectError(OpenStatus(tmp / "shape"), {"model.layers.1.self_attn.q_proj.weight", "[256, 64]", "[128, 64]",
                                            "model.safetensors"});
  }
  {
    WriteDir(tmp / "trunc", c.ToJson(), good, 2);
    const std::string f = tmp / "trunc/model-00002-of-00002.safetensors";
    fs::resize_file(f, fs::file_size(f) - 10);
    ExpectError(OpenStatus(tmp / "trunc"), {"model-00002-of-00002.safetensors", "truncated"});
  }
  {
    WriteDir(tmp / "badidx", c.ToJson(), good, 2);
    WriteText(tmp / "badidx/model.safetensors.index.json", "{\"weight_map\": ");
    ExpectError(OpenStatus(tmp / "badidx"), {"model.safetensors.index.json", "JSON"});
    WriteText(tmp / "badidx/model.safetensors.index.json",
              R"({"weight_map": {"model.norm.weight": "model-00009-of-00009.safetensors"}})");
    ExpectError(OpenStatus(tmp / "badidx"), {"model-00009-of-00009.safetensors"});
  }
  {
    WriteDir(tmp / "badcfg", c.ToJson(), good);
    WriteText(tmp / "badcfg/config.json", "{\"hidden_size\": 64,");
    ExpectError(OpenStatus(tmp / "badcfg"), {"config.json", "JSON"});
  }
  {
    WriteDir(tmp / "garbage", c.ToJson(), good);
    WriteText(tmp / "garbage/model.safetensors", std::string("\x10\0\0\0\0\0\0\0{\"a\":", 13));
    ExpectError(OpenStatus(tmp / "garbage"), {"garbage/model.safetensors"});
  }
  ExpectError(OpenStatus(tmp / "nope"), {"nope"});
}

}  // namespace
}  // namespace dl
