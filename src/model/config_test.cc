#include "model/config.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "model/shapes.h"

namespace dl {
namespace {

using nlohmann::json;

// Spec §7, verbatim.
const char* kTinyJson = R"({
  "architectures": ["LagunaForCausalLM"],
  "model_type": "laguna",
  "vocab_size": 512,
  "hidden_size": 64,
  "intermediate_size": 96,
  "num_hidden_layers": 5,
  "num_attention_heads": 4,
  "num_attention_heads_per_layer": [4, 8, 8, 8, 4],
  "num_key_value_heads": 2,
  "head_dim": 32,
  "hidden_act": "silu",
  "rms_norm_eps": 1e-6,
  "attention_bias": false,
  "tie_word_embeddings": false,
  "max_position_embeddings": 131072,
  "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
                  "sliding_attention", "full_attention"],
  "sliding_window": 8,
  "rope_parameters": {
    "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 32.0,
                       "original_max_position_embeddings": 4096, "beta_fast": 64.0,
                       "beta_slow": 1.0, "attention_factor": 1.0,
                       "partial_rotary_factor": 0.5},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                          "partial_rotary_factor": 1.0}
  },
  "gating": true,
  "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"],
  "num_experts": 8,
  "num_experts_per_tok": 3,
  "moe_intermediate_size": 32,
  "shared_expert_intermediate_size": 16,
  "moe_routed_scaling_factor": 2.5,
  "moe_router_logit_softcapping": 0.0,
  "moe_apply_router_weight_on_input": false,
  "bos_token_id": 2, "eos_token_id": [2, 24], "pad_token_id": 9
})";

json Tiny() { return json::parse(kTinyJson); }

Status ParseStatus(const json& j) { return ModelConfig::FromJson(j).status(); }

void ExpectRel(double got, double want, double rel, const char* what) {
  EXPECT_NEAR(got, want, std::fabs(want) * rel) << what;
}

TEST(ConfigTest, ParsesSpecTinyConfig) {
  auto r = ModelConfig::FromJson(Tiny());
  ASSERT_TRUE(r.ok()) << r.status().message();
  const ModelConfig& c = *r;
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.num_hidden_layers, 5);
  EXPECT_EQ(c.heads(1), 8);
  EXPECT_EQ(c.heads(4), 4);
  EXPECT_EQ(c.heads(0) / c.num_key_value_heads, 2);  // GQA group full
  EXPECT_EQ(c.heads(1) / c.num_key_value_heads, 4);  // GQA group sliding
  EXPECT_TRUE(c.is_sliding(1));
  EXPECT_FALSE(c.is_sliding(4));
  EXPECT_FALSE(c.is_sparse(0));
  EXPECT_TRUE(c.is_sparse(1));
  EXPECT_EQ(c.rotary_dim(0), 16);
  EXPECT_EQ(c.rotary_dim(1), 32);
  EXPECT_EQ(c.gating, GatingKind::kPerHead);
  EXPECT_EQ(c.gate_width(1), 8);
  EXPECT_EQ(c.rope_full.rope_type, "yarn");
  EXPECT_EQ(c.rope_full.original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.rope_full.attention_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.moe_routed_scaling_factor, 2.5);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{2, 24}));
  EXPECT_EQ(c.pad_token_id, 9);
  EXPECT_TRUE(c.warnings.empty());
}

TEST(ConfigTest, TinyShapeIsExactlyTheSpecConfig) {
  auto a = ModelConfig::FromJson(Tiny());
  auto b = ShapeConfig("tiny");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->ToJson(), b->ToJson());
  // And the written config.json parses back to the same thing.
  auto c = ModelConfig::FromJson(b->ToJson());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->ToJson(), b->ToJson());
}

TEST(ConfigTest, ShapesAndTruncation) {
  auto xs = ShapeConfig("xs2");
  ASSERT_TRUE(xs.ok()) << xs.status().message();
  EXPECT_EQ(xs->num_hidden_layers, 40);
  EXPECT_EQ(xs->heads(0), 48);
  EXPECT_EQ(xs->heads(1), 64);
  EXPECT_EQ(xs->rotary_dim(0), 64);
  auto s = ShapeConfig("s21", 6);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->num_hidden_layers, 6);
  EXPECT_EQ(s->layer_types.size(), 6u);
  EXPECT_EQ(s->heads(5), 72);
  EXPECT_EQ(s->hidden_size, 3072);
  EXPECT_FALSE(ShapeConfig("s21", 0).ok());
  EXPECT_FALSE(ShapeConfig("s21", 49).ok());
  EXPECT_FALSE(ShapeConfig("huge").ok());
}

TEST(ConfigTest, GatingValues) {
  json j = Tiny();
  j["gating"] = "per-head";
  ASSERT_TRUE(ModelConfig::FromJson(j).ok());
  EXPECT_EQ(ModelConfig::FromJson(j)->gating, GatingKind::kPerHead);
  j["gating"] = "per-element";
  EXPECT_EQ(ModelConfig::FromJson(j)->gating, GatingKind::kPerElement);
  EXPECT_EQ(ModelConfig::FromJson(j)->gate_width(1), 8 * 32);
  for (json bad : {json(false), json("per_head"), json("none"), json(1)}) {
    j["gating"] = bad;
    Status s = ParseStatus(j);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad.dump();
    EXPECT_NE(s.message().find("gating"), std::string::npos) << s.message();
  }
}

TEST(ConfigTest, RejectsUnknownStringsAndBadLengths) {
  {
    json j = Tiny();
    j["mlp_layer_types"][2] = "moe";
    Status s = ParseStatus(j);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("mlp_layer_types[2]"), std::string::npos) << s.message();
  }
  {
    json j = Tiny();
    j["layer_types"][1] = "sliding";
    Status s = ParseStatus(j);
    EXPECT_NE(s.message().find("layer_types[1]"), std::string::npos) << s.message();
  }
  for (const char* key : {"layer_types", "mlp_layer_types", "num_attention_heads_per_layer"}) {
    json j = Tiny();
    j[key].erase(j[key].size() - 1);
    Status s = ParseStatus(j);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << key;
    EXPECT_NE(s.message().find(key), std::string::npos) << s.message();
  }
  {
    json j = Tiny();
    j["num_attention_heads_per_layer"][3] = 5;  // not a multiple of 2 KV heads
    Status s = ParseStatus(j);
    EXPECT_NE(s.message().find("layer 3"), std::string::npos) << s.message();
  }
  {
    json j = Tiny();
    j["hidden_size"] = "64";
    EXPECT_NE(ParseStatus(j).message().find("hidden_size"), std::string::npos);
  }
  {
    json j = Tiny();
    j["hidden_act"] = "gelu";
    EXPECT_EQ(ParseStatus(j).code(), StatusCode::kUnimplemented);
  }
}

TEST(ConfigTest, RopeParameterQuirks) {
  {
    // The duplicate top-level original_max_position_embeddings: accepted and ignored.
    json j = Tiny();
    j["rope_parameters"]["original_max_position_embeddings"] = 4096;
    auto r = ModelConfig::FromJson(j);
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_EQ(r->rope_full.original_max_position_embeddings, 4096);
  }
  {
    json j = Tiny();
    j["rope_parameters"] = j["rope_parameters"]["full_attention"];  // flat
    EXPECT_NE(ParseStatus(j).message().find("flat"), std::string::npos);
  }
  {
    json j = Tiny();
    j["rope_parameters"].erase("sliding_attention");
    EXPECT_NE(ParseStatus(j).message().find("sliding_attention"), std::string::npos);
  }
  {
    json j = Tiny();
    j["rope_parameters"]["full_attention"].erase("original_max_position_embeddings");
    EXPECT_NE(ParseStatus(j).message().find("original_max_position_embeddings"), std::string::npos);
  }
  {
    // attention_factor absent -> 0.1 ln(32) + 1 (5.17.0 gave 1.3465735902799727).
    json j = Tiny();
    j["rope_parameters"]["full_attention"].erase("attention_factor");
    auto r = ModelConfig::FromJson(j);
    ASSERT_TRUE(r.ok());
    EXPECT_NEAR(r->rope_full.attention_factor, 1.3465735902799727, 1e-15);
  }
  {
    // Top-level partial_rotary_factor is copied into entries lacking one when a YaRN entry exists.
    json j = Tiny();
    j["partial_rotary_factor"] = 0.25;
    j["rope_parameters"]["sliding_attention"].erase("partial_rotary_factor");
    auto r = ModelConfig::FromJson(j);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->rotary_dim(1), 8);
    EXPECT_EQ(r->rotary_dim(0), 16);  // explicit 0.5 wins
    // Without a YaRN entry nothing is copied.
    j["rope_parameters"]["full_attention"] = {{"rope_type", "default"}, {"rope_theta", 500000.0},
                                              {"partial_rotary_factor", 0.5}};
    r = ModelConfig::FromJson(j);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->rotary_dim(1), 32);
  }
  {
    // A null factor falls back to max_position_embeddings / original.
    json j = Tiny();
    j["rope_parameters"]["full_attention"]["factor"] = nullptr;
    j["max_position_embeddings"] = 65536;
    auto r = ModelConfig::FromJson(j);
    ASSERT_TRUE(r.ok());
    EXPECT_DOUBLE_EQ(r->rope_full.factor, 16.0);
  }
}

TEST(ConfigTest, TorchDtypeAndDefaults) {
  json j = Tiny();
  j["torch_dtype"] = "float32";
  EXPECT_EQ(ModelConfig::FromJson(j)->dtype, "float32");
  j["dtype"] = "bfloat16";
  EXPECT_EQ(ModelConfig::FromJson(j)->dtype, "bfloat16");
  json k = Tiny();
  k.erase("moe_routed_scaling_factor");
  k.erase("num_attention_heads_per_layer");
  k["num_attention_heads_per_layer"] = nullptr;
  auto r = ModelConfig::FromJson(k);
  ASSERT_TRUE(r.ok());
  EXPECT_DOUBLE_EQ(r->moe_routed_scaling_factor, 1.0);
  EXPECT_EQ(r->heads(1), 4);
  EXPECT_EQ(r->warnings.size(), 2u);
}

TEST(ConfigTest, UnknownKeysAreListedInWarnings) {
  for (const auto& name : ShapeNames()) {
    auto c = ShapeConfig(name);
    ASSERT_TRUE(c.ok());
    EXPECT_TRUE(c->warnings.empty()) << name << ": " << c->warnings[0];
  }
  json j = Tiny();
  j["frobnicate_layers"] = 3;
  j["norm_topk_prob"] = true;  // a Poolside key for other engines: known, ignored as transformers does
  auto r = ModelConfig::FromJson(j);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_EQ(r->warnings.size(), 1u);
  EXPECT_NE(r->warnings[0].find("unknown key 'frobnicate_layers' = 3"), std::string::npos)
      << r->warnings[0];
}

TEST(ConfigTest, LegacyRopeScalingIsRefusedNotDropped) {
  json j = Tiny();
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 4096}};
  Status st = ParseStatus(j);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("rope_scaling"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("rope_parameters"), std::string::npos) << st.message();
  j["rope_scaling"] = nullptr;  // what transformers writes when there is none
  EXPECT_TRUE(ParseStatus(j).ok());
  json k = Tiny();
  k["moe_router_score_func"] = "sqrtsoftplus";
  EXPECT_EQ(ParseStatus(k).code(), StatusCode::kUnimplemented);
  k["moe_router_score_func"] = "sigmoid";
  EXPECT_TRUE(ParseStatus(k).ok());
}

TEST(ConfigTest, GenerationConfigBesideConfigJsonIsRead) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("dl_gen_config_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  json j = Tiny();
  j["eos_token_id"] = 2;  // config.json knows only 2; generation_config.json adds 24
  std::ofstream(dir / "config.json") << j.dump();
  std::ofstream(dir / "generation_config.json") << R"({"bos_token_id": 2, "eos_token_id": [2, 24],
      "pad_token_id": 9, "do_sample": true, "temperature": 0.7, "top_p": 0.95, "top_k": 20,
      "num_beams": 4, "transformers_version": "5.14.1"})";
  auto r = ModelConfig::FromFile((dir / "config.json").string());
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->eos_token_ids, (std::vector<int64_t>{2, 24}));
  EXPECT_TRUE(r->generation.present);
  EXPECT_DOUBLE_EQ(r->generation.temperature.value_or(-1), 0.7);
  EXPECT_DOUBLE_EQ(r->generation.top_p.value_or(-1), 0.95);
  EXPECT_EQ(r->generation.top_k.value_or(-1), 20);
  EXPECT_FALSE(r->generation.min_p.has_value());
  ASSERT_EQ(r->warnings.size(), 1u);
  EXPECT_NE(r->warnings[0].find("num_beams = 4"), std::string::npos) << r->warnings[0];
  // A broken file is an error, not a silent default.
  std::ofstream(dir / "generation_config.json") << R"({"temperature": "hot"})";
  EXPECT_FALSE(ModelConfig::FromFile((dir / "config.json").string()).ok());
  std::filesystem::remove(dir / "generation_config.json");
  auto none = ModelConfig::FromFile((dir / "config.json").string());
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->generation.present);
  EXPECT_EQ(none->eos_token_ids, (std::vector<int64_t>{2}));
  std::filesystem::remove_all(dir);
}

TEST(ConfigTest, QuantizationConfigIsRecorded) {
  json j = Tiny();
  j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}};
  auto r = ModelConfig::FromJson(j);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->quantizes_weights);
  j["quantization_config"] = {{"quant_method", "compressed-tensors"}, {"kv_cache_scheme", {{"num_bits", 8}}}};
  EXPECT_FALSE(ModelConfig::FromJson(j)->quantizes_weights);
}

TEST(RopeTest, Xs2YarnMatchesReference) {
  auto c = ShapeConfig("xs2");
  ASSERT_TRUE(c.ok());
  RopeTable t = ComputeRopeTable(c->rope_full, c->head_dim);
  ASSERT_EQ(t.rotary_dim, 64);
  ASSERT_EQ(t.inv_freq.size(), 32u);
  EXPECT_EQ(t.yarn_low, 5.0);
  EXPECT_EQ(t.yarn_high, 16.0);
  EXPECT_EQ(t.attention_factor, 1.0f);
  const double rel = 3e-6;  // FP32 table vs FP64 reference values
  const std::pair<int, double> ref[] = {
      {0, 1.0},          {1, 0.6636012377},   {2, 0.4403666027},    {3, 0.2922278226},
      {4, 0.1939227447}, {5, 0.1286873734},   {6, 7.787633293e-2},  {7, 4.668804040e-2},
      {10, 9.268200841e-3}, {15, 2.542813084e-4}, {16, 4.419417382e-5}, {31, 9.418306725e-8}};
  for (auto [j, v] : ref) ExpectRel(t.inv_freq[j], v, rel, ("f_" + std::to_string(j)).c_str());
  // Sliding layers: default RoPE over all 128 dims, f_j = 10000^(-2j/128).
  RopeTable s = ComputeRopeTable(c->rope_sliding, c->head_dim);
  ASSERT_EQ(s.inv_freq.size(), 64u);
  for (int j = 0; j < 64; ++j) ExpectRel(s.inv_freq[j], std::pow(10000.0, -2.0 * j / 128), rel, "sliding");
}

TEST(RopeTest, TinyMatchesReference) {
  auto c = ShapeConfig("tiny");
  ASSERT_TRUE(c.ok());
  RopeTable t = ComputeRopeTable(c->rope_full, c->head_dim);
  ASSERT_EQ(t.rotary_dim, 16);
  EXPECT_EQ(t.yarn_low, 1.0);
  EXPECT_EQ(t.yarn_high, 4.0);
  const double ref[] = {1,           1.939227447e-1, 2.546241678e-2, 2.582818761e-3,
                        4.419417382e-5, 8.570255490e-6, 1.661967468e-6, 3.222932930e-7};
  ASSERT_EQ(t.inv_freq.size(), 8u);
  for (int j = 0; j < 8; ++j) ExpectRel(t.inv_freq[j], ref[j], 3e-6, "tiny f_j");
  RopeTable s = ComputeRopeTable(c->rope_sliding, c->head_dim);
  ASSERT_EQ(s.inv_freq.size(), 16u);
  for (int j = 0; j < 16; ++j) ExpectRel(s.inv_freq[j], std::pow(10000.0, -j / 16.0), 3e-6, "tiny sliding");
}

TEST(RopeTest, S21OneMillionAnd256K) {
  auto c = ShapeConfig("s21");
  ASSERT_TRUE(c.ok());
  RopeParams p = c->rope_full;
  RopeTable m = ComputeRopeTable(p, 128);
  EXPECT_EQ(m.yarn_low, 9.0);
  EXPECT_EQ(m.yarn_high, 18.0);
  EXPECT_NEAR(m.attention_factor, 1.4852030263919618, 1e-6);
  ExpectRel(m.inv_freq[9], 2.495540867e-2, 3e-6, "1M f_9");
  ExpectRel(m.inv_freq[10], 1.473476657e-2, 3e-6, "1M f_10");
  ExpectRel(m.inv_freq[18], 4.865409546e-6, 3e-6, "1M f_18");
  ExpectRel(m.inv_freq[31], 2.354576681e-8, 3e-6, "1M f_31");
  p.factor = 32.0;
  p.attention_factor = 0.1 * std::log(32.0) + 1.0;
  RopeTable k = ComputeRopeTable(p, 128);
  ExpectRel(k.inv_freq[10], 1.477789271e-2, 3e-6, "256K f_10");
  ExpectRel(k.inv_freq[18], 1.946163818e-5, 3e-6, "256K f_18");
  ExpectRel(k.inv_freq[31], 9.418306725e-8, 3e-6, "256K f_31");
  EXPECT_NEAR(k.attention_factor, 1.3465735902799727, 1e-6);
}

}  // namespace
}  // namespace dl

namespace dl {
namespace {

// Sizes, counts and ids are 32-bit downstream: out-of-range values are errors naming the key, never
// wrapped (issue 21 item 10).
TEST(ConfigTest, IntegersOutOfRangeAreErrorsNamingTheKey) {
  auto expect_error = [](json j, const std::string& key) {
    auto c = ModelConfig::FromJson(j);
    ASSERT_FALSE(c.ok()) << j.dump().substr(0, 80);
    EXPECT_NE(c.status().message().find(key), std::string::npos) << c.status().message();
    EXPECT_NE(c.status().message().find("outside"), std::string::npos) << c.status().message();
  };
  json j = Tiny();
  j["sliding_window"] = (int64_t{1} << 32) + 8;  // used to become 8
  expect_error(j, "sliding_window");
  j = Tiny();
  j["sliding_window"] = int64_t{1000000000000};  // used to print as -727379968
  expect_error(j, "sliding_window");
  j = Tiny();
  j["vocab_size"] = uint64_t{18446744073709551615u};
  expect_error(j, "vocab_size");
  j = Tiny();
  j["hidden_size"] = -64;
  expect_error(j, "hidden_size");
  j = Tiny();
  j["eos_token_id"] = int64_t{1} << 40;
  expect_error(j, "eos_token_id");
  j = Tiny();
  j["eos_token_id"] = json::array({2, int64_t{1} << 33});
  expect_error(j, "eos_token_id");
  j = Tiny();
  j["num_attention_heads_per_layer"][1] = int64_t{1} << 33;
  expect_error(j, "num_attention_heads_per_layer[1]");
  j = Tiny();
  j["rope_parameters"]["full_attention"]["original_max_position_embeddings"] = int64_t{1} << 35;
  expect_error(j, "original_max_position_embeddings");
  // The largest int32 is still accepted where the shape allows it.
  j = Tiny();
  j["max_position_embeddings"] = 2147483647;
  EXPECT_TRUE(ModelConfig::FromJson(j).ok());
}

}  // namespace
}  // namespace dl
