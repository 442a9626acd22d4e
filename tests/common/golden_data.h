// Shared by the CPU and GPU golden tests: reading transformers' transcripts (tests/data/golden, made by
// tools/reference/make_goldens.py), loading a golden model into an engine, and the comparison metric.
#pragma once

#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/engine.h"

namespace dl::testing_golden {

namespace fs = std::filesystem;

struct GoldenPrompt {
  std::vector<int32_t> prompt;
  std::vector<int32_t> tokens;        // greedy argmax after prompt + tokens[:i]
  std::vector<double> margins;        // top-1 minus top-2 logit at each step
  std::vector<double> router_gaps;    // smallest k-th vs (k+1)-th biased router score per step
  std::vector<float> last_logits;     // at the last prompt position
};

inline fs::path GoldenDir(const std::string& name) {
  return fs::path(DECODELAB_SOURCE_DIR) / "tests/data/golden" / name;
}

// Every committed configuration with FP32 goldens, sorted by name.
inline std::vector<fs::path> GoldenDirs() {
  std::vector<fs::path> dirs;
  const fs::path root = fs::path(DECODELAB_SOURCE_DIR) / "tests/data/golden";
  if (!fs::exists(root)) return dirs;
  for (const auto& e : fs::directory_iterator(root)) {
    if (fs::exists(e.path() / "goldens_fp32.json")) dirs.push_back(e.path());
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

// file: goldens_fp32.json or goldens_bf16.json of one configuration.
inline std::vector<GoldenPrompt> LoadGoldens(const fs::path& file) {
  std::ifstream in(file);
  nlohmann::json j;
  in >> j;
  std::vector<GoldenPrompt> out;
  for (const auto& p : j.at("prompts")) {
    GoldenPrompt g;
    g.prompt = p.at("prompt_ids").get<std::vector<int32_t>>();
    g.tokens = p.at("tokens").get<std::vector<int32_t>>();
    g.margins = p.at("margins").get<std::vector<double>>();
    if (p.contains("router_min_gaps")) g.router_gaps = p.at("router_min_gaps").get<std::vector<double>>();
    g.last_logits = p.at("last_logits").get<std::vector<float>>();
    out.push_back(std::move(g));
  }
  return out;
}

inline std::unique_ptr<Engine> LoadGoldenModel(const fs::path& dir, BackendKind backend, DType kv,
                                               int32_t page, bool allow_fallback = false,
                                               const kernels::Tuning& tuning = {}) {
  EngineOptions o;
  o.tuning = tuning;
  o.model_dir = dir.string();
  o.backend = backend;
  o.kv_dtype = kv;
  o.page_size = page;
  o.max_seq_len = 256;
  o.allow_fallback = allow_fallback;
  auto e = LoadEngine(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

// The CPU reference at --tp `tp` with the goldens' KV settings (F32 KV, page 16, 256 positions): the
// options the tensor-parallel CPU tests load with (model_dir or shape still to set).
inline EngineOptions CpuTpOptions(int tp, EmbeddingMode embedding) {
  EngineOptions o;
  o.backend = BackendKind::kCpu;
  o.kv_dtype = DType::kF32;
  o.page_size = 16;
  o.max_seq_len = 256;
  o.tp = tp;
  o.embedding = embedding;
  return o;
}

// ||a - b|| / ||b||.
inline double RelL2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

}  // namespace dl::testing_golden
