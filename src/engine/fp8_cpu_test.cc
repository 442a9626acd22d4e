// The CPU reference on FP8 weights is exact dequantisation (docs/fp8.md): an FP8 checkpoint's
// logits equal, bit for bit, those of an F32 checkpoint holding code x scale (computed in FP32) for
// every FP8 weight and the BF16 values widened for the rest -- both formats, block (with partial
// edge blocks), per-channel and per-tensor scales. It is the oracle the CUDA FP8 kernels are tested
// against.
#include <cstring>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "model/model_writer.h"
#include "model/safetensors.h"
#include "model/shapes.h"
#include "tests/common/temp_dir.h"

namespace dl {
namespace {

namespace fs = std::filesystem;

// Each test's own directory (dl_fp8_cpu_test-XXXXXX).
struct TempDir : test_util::TempDir {
  TempDir() : test_util::TempDir("dl_fp8_cpu_test") {}
};

// Writes `ck` as an F32 checkpoint without quantization_config: FP8 weights dequantised as
// Fp8E4M3ToFloat(code) * scale in FP32, everything else widened exactly.
Status WriteDequantisedF32(const Checkpoint& ck, const std::string& dir) {
  ModelConfig c = ck.config();
  c.has_quantization_config = false;
  c.quantization_config = nullptr;
  c.dtype = "float32";
  fs::create_directories(dir);
  std::ofstream(dir + "/config.json") << c.ToJson().dump(2);
  // Scales by weight name, from the weight views (the scale tensors themselves are not written).
  std::map<std::string, const TensorView*> weights;
  for (const LayerWeights& L : ck.weights().layers) {
    for (const TensorView* t : {&L.q, &L.k, &L.v, &L.o, &L.g, &L.mlp_gate, &L.mlp_up, &L.mlp_down,
                                &L.shared.gate, &L.shared.up, &L.shared.down}) {
      weights[t->name] = t;
    }
    for (const ExpertWeights& e : L.experts) {
      for (const TensorView* t : {&e.gate, &e.up, &e.down}) weights[t->name] = t;
    }
  }
  std::vector<SafetensorsEntry> entries;
  std::vector<std::vector<float>> values;
  for (const TensorView& t : ck.tensors()) {
    if (t.name.size() > 6 && (t.name.ends_with("_scale_inv") || t.name.ends_with("weight_scale")))
      continue;
    std::vector<float> v(static_cast<size_t>(t.numel()));
    if (t.dtype == DType::kF8E4M3) {
      const TensorView& w = *weights.at(t.name);
      const int64_t in = w.shape[1], col_blocks = (in + w.block_cols - 1) / w.block_cols;
      const auto* codes = static_cast<const uint8_t*>(w.data);
      for (int64_t i = 0; i < t.numel(); ++i) {
        const int64_t r = i / in, col = i % in;
        v[i] = Fp8E4M3ToFloat(codes[i]) *
               w.scales[(r / w.block_rows) * col_blocks + col / w.block_cols];
      }
    } else {
      for (int64_t i = 0; i < t.numel(); ++i) v[i] = t.at(i);
    }
    entries.push_back(SafetensorsEntry{t.name, DType::kF32, t.shape});
    values.push_back(std::move(v));
  }
  std::vector<const void*> data;
  for (const auto& v : values) data.push_back(v.data());
  return WriteSafetensorsFile(dir + "/model.safetensors", entries, data);
}

Result<GenerateResult> RunCpu(const std::string& model_dir,
                              std::optional<Fp8Options> shape_fp8 = std::nullopt) {
  EngineOptions o;
  if (shape_fp8) {
    o.shape = "tiny";
    o.num_layers = 3;
    o.seed = 11;
    o.shape_fp8 = shape_fp8;
  } else {
    o.model_dir = model_dir;
  }
  o.backend = BackendKind::kCpu;
  o.max_seq_len = 64;
  DL_ASSIGN_OR_RETURN(auto engine, LoadEngine(o));
  const std::vector<int32_t> prompt = {2, 41, 300, 7, 99, 1, 260, 18, 77, 5, 431};
  GenerateOptions g;
  g.max_tokens = 6;
  g.ignore_eos = true;
  g.keep_step_logits = true;
  g.prefill_chunk = 4;
  return GenerateGreedy(*engine, prompt, g);
}

void ExpectSameBits(const GenerateResult& a, const GenerateResult& b) {
  EXPECT_EQ(a.tokens, b.tokens);
  ASSERT_EQ(a.last_prompt_logits.size(), b.last_prompt_logits.size());
  EXPECT_EQ(std::memcmp(a.last_prompt_logits.data(), b.last_prompt_logits.data(),
                        a.last_prompt_logits.size() * 4),
            0);
  ASSERT_EQ(a.step_logits.size(), b.step_logits.size());
  for (size_t s = 0; s < a.step_logits.size(); ++s) {
    ASSERT_EQ(a.step_logits[s].size(), b.step_logits[s].size());
    EXPECT_EQ(
        std::memcmp(a.step_logits[s].data(), b.step_logits[s].data(), a.step_logits[s].size() * 4),
        0)
        << "step " << s;
  }
}

TEST(Fp8CpuTest, LogitsEqualTheF32CheckpointOfTheDequantisedWeights) {
  struct Case {
    WeightQuantFormat format;
    Fp8Granularity g;
  };
  for (const Case& k : {Case{WeightQuantFormat::kFp8Native, Fp8Granularity::kBlock},
                        Case{WeightQuantFormat::kFp8CompressedTensors, Fp8Granularity::kBlock},
                        Case{WeightQuantFormat::kFp8CompressedTensors, Fp8Granularity::kChannel},
                        Case{WeightQuantFormat::kFp8CompressedTensors, Fp8Granularity::kTensor}}) {
    SCOPED_TRACE(fmt::format("{} {}", Fp8FormatName(k.format), Fp8GranularityName(k.g)));
    TempDir tmp;
    MakeModelOptions o;
    o.config = *ShapeConfig("tiny", 3);
    o.seed = 11;
    Fp8Options f;
    f.format = k.format;
    f.granularity = k.g;
    f.layout = Fp8Layout::kAllLinear;
    f.block_rows = 24;  // partial blocks on every tiny matrix edge
    f.block_cols = 40;
    o.fp8 = f;
    o.out_dir = tmp / "fp8";
    ASSERT_TRUE(WriteSyntheticModel(o).ok());
    auto ck = Checkpoint::Open(tmp / "fp8");
    ASSERT_TRUE(ck.ok()) << ck.status().message();
    ASSERT_TRUE(WriteDequantisedF32(*ck, tmp / "f32").ok());
    auto fp8 = RunCpu(tmp / "fp8");
    ASSERT_TRUE(fp8.ok()) << fp8.status().message();
    auto f32 = RunCpu(tmp / "f32");
    ASSERT_TRUE(f32.ok()) << f32.status().message();
    ExpectSameBits(*fp8, *f32);
    // Not vacuous: the FP8 model is a different model from the BF16 one of the same seed.
    o.fp8.reset();
    o.out_dir = tmp / "bf16";
    ASSERT_TRUE(WriteSyntheticModel(o).ok());
    auto bf16 = RunCpu(tmp / "bf16");
    ASSERT_TRUE(bf16.ok());
    EXPECT_NE(std::memcmp(bf16->last_prompt_logits.data(), fp8->last_prompt_logits.data(),
                          fp8->last_prompt_logits.size() * 4),
              0);
  }
}

// --shape with FP8 weights on the CPU builds the same model make-model writes.
TEST(Fp8CpuTest, ShapeWeightsEqualMakeModelFp8) {
  TempDir tmp;
  Fp8Options f;
  f.layout = Fp8Layout::kExport;
  MakeModelOptions o;
  o.config = *ShapeConfig("tiny", 3);
  o.seed = 11;
  o.fp8 = f;
  o.out_dir = tmp / "m";
  ASSERT_TRUE(WriteSyntheticModel(o).ok());
  auto file = RunCpu(tmp / "m");
  ASSERT_TRUE(file.ok()) << file.status().message();
  auto shape = RunCpu("", f);
  ASSERT_TRUE(shape.ok()) << shape.status().message();
  ExpectSameBits(*file, *shape);
}

}  // namespace
}  // namespace dl
