#include "model/dflash.h"

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include <limits>
#include <nlohmann/json.hpp>

#include "model/safetensors.h"
#include "model/shapes.h"
#include "tests/common/temp_dir.h"

namespace dl {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct TempDir : test_util::TempDir {
  TempDir() : test_util::TempDir("dl_dflash_test") {}
};

// The config of z-lab/Qwen3-8B-DFlash-b16 as the design notes quote it (§2.1).
json ZlabQwen3Config() {
  return json::parse(R"({
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "num_target_layers": 36,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "attention_dropout": 0.0,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
  })");
}

// Poolside/Laguna-XS-2.1-DFlash's config (§2.3).
json LagunaXsConfig() {
  return json::parse(R"({
    "architectures": ["DFlashLagunaForCausalLM"], "model_type": "laguna", "hidden_size": 2048,
    "num_hidden_layers": 5, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 8192, "vocab_size": 100352, "draft_vocab_size": 100352, "rope_theta": 500000,
    "sliding_window": 512, "gating": "per-head", "num_experts": 0,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention",
                    "sliding_attention"],
    "dflash_config": {"block_size": 16, "mask_token_id": 12, "num_target_layers": 40,
                      "target_layer_ids": [1, 13, 25, 33, 39], "causal": true},
    "eagle_aux_hidden_state_layer_ids": [2, 14, 26, 34, 40]
  })");
}

TEST(DflashConfigTest, ParsesTheZlabQwen3Config) {
  auto c = DflashConfig::FromJson(ZlabQwen3Config());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->family, DflashFamily::kZlab);
  EXPECT_EQ(c->block_size, 16);
  EXPECT_EQ(c->mask_token_id, 151669);
  EXPECT_EQ(c->target_layer_ids, (std::vector<int64_t>{1, 9, 17, 25, 33}));
  EXPECT_FALSE(c->per_head_gate);
  EXPECT_FALSE(c->context_input_norm);
  EXPECT_FALSE(c->aux_hidden_norms);
  // Full-attention layers: bidirectional blocks.
  ASSERT_EQ(c->block_causal.size(), 5u);
  for (bool b : c->block_causal) EXPECT_FALSE(b);
  EXPECT_EQ(c->qkvg_width(), 4096 + 2 * 1024);
  EXPECT_FALSE(c->notes.empty());  // tie_word_embeddings etc. are named as inert
}

TEST(DflashConfigTest, ParsesTheLagunaXsConfig) {
  auto c = DflashConfig::FromJson(LagunaXsConfig());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->family, DflashFamily::kLaguna);
  EXPECT_TRUE(c->per_head_gate);
  EXPECT_TRUE(c->context_input_norm);
  EXPECT_TRUE(c->aux_hidden_norms);
  EXPECT_EQ(c->sliding_window, 512);
  for (bool b : c->block_causal) EXPECT_TRUE(b);
  EXPECT_EQ(c->qkvg_width(), 8192 + 2048 + 64);
}

TEST(DflashConfigTest, DefaultTapRuleMatchesPublishedConfigs) {
  EXPECT_EQ(DefaultTargetLayerIds(5, 36), (std::vector<int64_t>{1, 9, 17, 25, 33}));
  EXPECT_EQ(DefaultTargetLayerIds(5, 32), (std::vector<int64_t>{1, 8, 15, 22, 29}));
  EXPECT_EQ(DefaultTargetLayerIds(1, 36), (std::vector<int64_t>{18}));
  json j = ZlabQwen3Config();
  j["dflash_config"].erase("target_layer_ids");
  auto c = DflashConfig::FromJson(j);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->target_layer_ids, (std::vector<int64_t>{1, 9, 17, 25, 33}));
}

TEST(DflashConfigTest, RejectsUnknownAndUnsupportedKeysByName) {
  json j = ZlabQwen3Config();
  j["frobnicate"] = 1;
  auto c = DflashConfig::FromJson(j);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("frobnicate"), std::string::npos) << c.status().message();

  j = ZlabQwen3Config();
  j["dflash_config"]["mystery"] = true;
  c = DflashConfig::FromJson(j);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("dflash_config.mystery"), std::string::npos) << c.status().message();

  j = ZlabQwen3Config();
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  c = DflashConfig::FromJson(j);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnimplemented);

  j = ZlabQwen3Config();
  j["architectures"] = {"DFlash2DraftModel"};
  c = DflashConfig::FromJson(j);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("DFlash2"), std::string::npos);

  j = LagunaXsConfig();
  j["eagle_aux_hidden_state_layer_ids"] = {1, 13, 25, 33, 39};  // not ids + 1
  c = DflashConfig::FromJson(j);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("eagle_aux_hidden_state_layer_ids"), std::string::npos);

  j = LagunaXsConfig();
  j["dflash_config"]["target_layer_ids"] = {13, 1, 25, 33, 39};
  EXPECT_FALSE(DflashConfig::FromJson(j).ok());
  j = LagunaXsConfig();
  j["dflash_config"].erase("mask_token_id");
  EXPECT_FALSE(DflashConfig::FromJson(j).ok());

  // Integers as config.json's loader reads them: refused outside 32 bits, never wrapped or cast from
  // a float too large for an integer.
  for (const json& huge : {json(std::numeric_limits<uint64_t>::max()), json(1e300)}) {
    j = LagunaXsConfig();
    j["dflash_config"]["block_size"] = huge;
    c = DflashConfig::FromJson(j);
    ASSERT_FALSE(c.ok()) << huge.dump();
    EXPECT_NE(c.status().message().find("block_size"), std::string::npos) << c.status().message();
  }
}

TEST(DflashConfigTest, ToJsonRoundTrips) {
  auto target = ShapeConfig("tiny");
  ASSERT_TRUE(target.ok());
  const DflashConfig c = DflashConfigFor(*target, 2, 8);
  auto back = DflashConfig::FromJson(c.ToJson());
  ASSERT_TRUE(back.ok()) << back.status().ToString() << "\n" << c.ToJson().dump(2);
  EXPECT_EQ(back->ToJson(), c.ToJson());
  EXPECT_EQ(back->target_layer_ids, c.target_layer_ids);
  EXPECT_EQ(back->block_causal, c.block_causal);
  EXPECT_TRUE(c.CheckTarget(*target).ok());
}

TEST(DflashConfigTest, CheckTargetNamesTheMismatch) {
  auto target = ShapeConfig("tiny");
  ASSERT_TRUE(target.ok());
  DflashConfig c = DflashConfigFor(*target, 2, 8);
  DflashConfig bad = c;
  bad.hidden_size += 1;
  EXPECT_NE(bad.CheckTarget(*target).message().find("hidden_size"), std::string::npos);
  bad = c;
  bad.vocab_size += 1;
  EXPECT_NE(bad.CheckTarget(*target).message().find("vocab_size"), std::string::npos);
  bad = c;
  bad.num_target_layers = 0;
  bad.target_layer_ids = {1, target->num_hidden_layers};
  EXPECT_NE(bad.CheckTarget(*target).message().find("beyond"), std::string::npos);
  bad = c;
  bad.mask_token_id = target->vocab_size;
  EXPECT_NE(bad.CheckTarget(*target).message().find("mask_token_id"), std::string::npos);
}

// Both layouts and vLLM's prefixed, renumbered names load to the same views: the fused
// projections are sliced where the split ones are.
TEST(DflashCheckpointTest, BothKeyLayoutsAndVllmNamesLoad) {
  auto target = ShapeConfig("tiny");
  ASSERT_TRUE(target.ok());
  const DflashConfig c = DflashConfigFor(*target, 2, 8);
  TempDir tmp;
  struct Variant {
    DflashLayout layout;
    bool vllm;
    std::string dir;
  };
  std::vector<Variant> variants = {{DflashLayout::kPoolside, false, tmp / "poolside"},
                                   {DflashLayout::kZlab, false, tmp / "zlab"},
                                   {DflashLayout::kPoolside, true, tmp / "vllm"}};
  std::vector<DflashCheckpoint> cks;
  for (const Variant& v : variants) {
    WriteDflashOptions o;
    o.config = c;
    o.layout = v.layout;
    o.vllm_names = v.vllm;
    o.seed = 3;
    o.out_dir = v.dir;
    ASSERT_TRUE(WriteSyntheticDflash(o).ok());
    auto ck = DflashCheckpoint::Open(v.dir);
    ASSERT_TRUE(ck.ok()) << ck.status().ToString();
    EXPECT_EQ(ck->fused_qkv(), v.layout == DflashLayout::kPoolside);
    EXPECT_EQ(ck->layer_base(), v.vllm ? target->num_hidden_layers : 0);
    cks.push_back(std::move(ck).value());
  }
  // Element values: the synthetic rule keys values by tensor name, so the split and fused files hold
  // different numbers; what must agree is the geometry of every view and that the fused slices
  // read the fused tensor's rows.
  for (const DflashCheckpoint& ck : cks) {
    const DflashWeights& w = ck.weights();
    ASSERT_EQ(w.layers.size(), 2u);
    EXPECT_EQ(w.aux_norms.size(), c.target_layer_ids.size());
    EXPECT_EQ(w.fc.shape, (std::vector<int64_t>{c.hidden_size, c.num_taps() * c.hidden_size}));
    for (const DflashLayerWeights& L : w.layers) {
      EXPECT_EQ(L.q.shape, (std::vector<int64_t>{c.q_width(), c.hidden_size}));
      EXPECT_EQ(L.k.shape, (std::vector<int64_t>{c.kv_width(), c.hidden_size}));
      EXPECT_EQ(L.v.shape, (std::vector<int64_t>{c.kv_width(), c.hidden_size}));
      EXPECT_EQ(L.g.shape, (std::vector<int64_t>{c.num_attention_heads, c.hidden_size}));
      EXPECT_EQ(L.gate.shape, (std::vector<int64_t>{c.intermediate_size, c.hidden_size}));
      EXPECT_EQ(L.down.shape, (std::vector<int64_t>{c.hidden_size, c.intermediate_size}));
    }
  }
  // The fused file's k slice starts right after q's rows.
  const DflashLayerWeights& f = cks[0].weights().layers[1];
  EXPECT_EQ(static_cast<const uint8_t*>(f.k.data),
            static_cast<const uint8_t*>(f.q.data) + c.q_width() * c.hidden_size * 2);
}

TEST(DflashCheckpointTest, RejectsMissingMisshapenAndUnexpectedTensors) {
  auto target = ShapeConfig("tiny");
  ASSERT_TRUE(target.ok());
  const DflashConfig c = DflashConfigFor(*target, 1, 4);
  TempDir tmp;
  auto write = [&](const std::string& dir, std::vector<SafetensorsEntry> entries) {
    fs::create_directories(dir);
    std::ofstream(fs::path(dir) / "config.json") << c.ToJson().dump();
    std::vector<std::vector<uint16_t>> bufs;
    std::vector<const void*> data;
    for (auto& e : entries) {
      e.dtype = DType::kBF16;
      bufs.emplace_back(static_cast<size_t>(e.numel()), uint16_t{0x3f80});
    }
    for (auto& b : bufs) data.push_back(b.data());
    ASSERT_TRUE(WriteSafetensorsFile((fs::path(dir) / "model.safetensors").string(), entries, data).ok());
  };
  // Start from a valid file and break it.
  WriteDflashOptions o;
  o.config = c;
  o.out_dir = tmp / "good";
  ASSERT_TRUE(WriteSyntheticDflash(o).ok());
  auto good = SafetensorsFile::Open(tmp / "good/model.safetensors");
  ASSERT_TRUE(good.ok());
  std::vector<SafetensorsEntry> base;
  for (const auto& e : good->tensors()) {
    SafetensorsEntry x;
    x.name = e.name;
    x.shape = e.shape;
    base.push_back(x);
  }
  auto without = base;
  without.erase(std::remove_if(without.begin(), without.end(), [](auto& e) { return e.name == "norm.weight"; }),
                without.end());
  write(tmp / "missing", without);
  auto r = DflashCheckpoint::Open(tmp / "missing");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("norm.weight"), std::string::npos) << r.status().message();

  auto misshapen = base;
  for (auto& e : misshapen) {
    if (e.name == "fc.weight") e.shape[1] -= c.hidden_size;
  }
  write(tmp / "misshapen", misshapen);
  r = DflashCheckpoint::Open(tmp / "misshapen");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("fc.weight"), std::string::npos) << r.status().message();

  auto extra = base;
  SafetensorsEntry lm;
  lm.name = "lm_head.weight";
  lm.shape = {target->vocab_size, c.hidden_size};
  extra.push_back(lm);
  write(tmp / "extra", extra);
  r = DflashCheckpoint::Open(tmp / "extra");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("lm_head.weight"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace dl
