#include "model/checkpoint.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "base/file_util.h"
#include "model/safetensors.h"
#include "model/synthetic.h"

namespace dl {

namespace fs = std::filesystem;

struct Checkpoint::Storage {
  std::vector<SafetensorsFile> files;
  std::vector<uint8_t> arena;  // synthetic weights
};

Checkpoint::Checkpoint() : storage_(std::make_unique<Storage>()) {}
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;
Checkpoint::~Checkpoint() = default;

uint64_t Checkpoint::weight_bytes() const {
  uint64_t n = 0;
  for (const auto& t : tensors_) n += t.nbytes();
  return n;
}

namespace {

std::string ShapeStr(const std::vector<int64_t>& s) {
  return fmt::format("[{}]", fmt::join(s, ", "));
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// One stored tensor and the file it came from (for messages).
struct RawTensor {
  TensorView view;
  std::string file;
};

constexpr const char* kFp8Unsupported =
    "FP8 weight checkpoints are not supported yet (use the BF16 checkpoint)";

}  // namespace

// Validates stored tensors against the config and assembles ModelWeights.
class CheckpointBuilder {
 public:
  CheckpointBuilder(const ModelConfig& c, std::vector<RawTensor> raw) : c_(c), raw_(std::move(raw)) {
    for (size_t i = 0; i < raw_.size(); ++i) index_[raw_[i].view.name] = i;
    used_.assign(raw_.size(), false);
  }

  Status Build(ModelWeights* w, bool* fused) {
    // Quantised weights first: their companions would otherwise show up as "unexpected tensors".
    for (const auto& r : raw_) {
      const std::string& n = r.view.name;
      for (const char* s : {".weight_scale", ".weight_scale_inv", ".weight_packed", ".input_scale",
                            ".weight_global_scale", ".input_global_scale", ".weight_zero_point"}) {
        if (EndsWith(n, s)) return Unimplemented("{}: tensor '{}' is a quantisation scale: {}", r.file, n, kFp8Unsupported);
      }
    }
    const int64_t d = c_.hidden_size, D = c_.head_dim, K = c_.num_key_value_heads, V = c_.vocab_size;
    DL_ASSIGN_OR_RETURN(w->embed, Take("model.embed_tokens.weight", {V, d}));
    DL_ASSIGN_OR_RETURN(w->final_norm, Take("model.norm.weight", {d}));
    if (c_.tie_word_embeddings) {
      w->lm_head = w->embed;
      if (Has("lm_head.weight")) DL_RETURN_IF_ERROR(Take("lm_head.weight", {V, d}).status());
    } else {
      DL_ASSIGN_OR_RETURN(w->lm_head, Take("lm_head.weight", {V, d}));
    }
    w->layers.resize(c_.num_hidden_layers);
    *fused = false;
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l) {
      LayerWeights& L = w->layers[l];
      const std::string p = fmt::format("model.layers.{}.", l);
      const int64_t H = c_.heads(l);
      DL_ASSIGN_OR_RETURN(L.input_norm, Take(p + "input_layernorm.weight", {d}));
      DL_ASSIGN_OR_RETURN(L.post_attn_norm, Take(p + "post_attention_layernorm.weight", {d}));
      DL_ASSIGN_OR_RETURN(L.q, Take(p + "self_attn.q_proj.weight", {H * D, d}));
      DL_ASSIGN_OR_RETURN(L.k, Take(p + "self_attn.k_proj.weight", {K * D, d}));
      DL_ASSIGN_OR_RETURN(L.v, Take(p + "self_attn.v_proj.weight", {K * D, d}));
      DL_ASSIGN_OR_RETURN(L.o, Take(p + "self_attn.o_proj.weight", {d, H * D}));
      DL_ASSIGN_OR_RETURN(L.g, Take(p + "self_attn.g_proj.weight", {c_.gate_width(l), d}));
      DL_ASSIGN_OR_RETURN(L.q_norm, Take(p + "self_attn.q_norm.weight", {D}));
      DL_ASSIGN_OR_RETURN(L.k_norm, Take(p + "self_attn.k_norm.weight", {D}));
      DL_ASSIGN_OR_RETURN(L.k_scale, TakeScale(p + "self_attn.k_scale"));
      DL_ASSIGN_OR_RETURN(L.v_scale, TakeScale(p + "self_attn.v_scale"));
      if (!c_.is_sparse(l)) {
        const int64_t F = c_.intermediate_size;
        DL_ASSIGN_OR_RETURN(L.mlp_gate, Take(p + "mlp.gate_proj.weight", {F, d}));
        DL_ASSIGN_OR_RETURN(L.mlp_up, Take(p + "mlp.up_proj.weight", {F, d}));
        DL_ASSIGN_OR_RETURN(L.mlp_down, Take(p + "mlp.down_proj.weight", {d, F}));
        continue;
      }
      const int64_t E = c_.num_experts, F = c_.moe_intermediate_size, Fs = c_.shared_expert_intermediate_size;
      DL_ASSIGN_OR_RETURN(L.router, Take(p + "mlp.gate.weight", {E, d}));
      DL_ASSIGN_OR_RETURN(std::string bias_name,
                          Either(p + "mlp.experts.e_score_correction_bias", p + "mlp.gate.e_score_correction_bias"));
      DL_ASSIGN_OR_RETURN(L.correction_bias, Take(bias_name, {E}));
      DL_ASSIGN_OR_RETURN(std::string shared_prefix,
                          Either(p + "mlp.shared_expert.gate_proj.weight", p + "mlp.shared_experts.gate_proj.weight"));
      shared_prefix = shared_prefix.substr(0, shared_prefix.size() - std::string("gate_proj.weight").size());
      DL_ASSIGN_OR_RETURN(L.shared.gate, Take(shared_prefix + "gate_proj.weight", {Fs, d}));
      DL_ASSIGN_OR_RETURN(L.shared.up, Take(shared_prefix + "up_proj.weight", {Fs, d}));
      DL_ASSIGN_OR_RETURN(L.shared.down, Take(shared_prefix + "down_proj.weight", {d, Fs}));
      L.experts.resize(E);
      const std::string fused_gu = p + "mlp.experts.gate_up_proj";
      const std::string fused_down = p + "mlp.experts.down_proj";
      const bool has_fused = Has(fused_gu) || Has(fused_down);
      const bool has_split = Has(p + "mlp.experts.0.gate_proj.weight");
      if (has_fused && has_split) {
        return InvalidArgument("layer {}: both fused (mlp.experts.gate_up_proj) and per-expert "
                               "(mlp.experts.0.gate_proj.weight) expert tensors are present",
                               l);
      }
      if (has_fused) {
        *fused = true;
        DL_ASSIGN_OR_RETURN(TensorView gu, Take(fused_gu, {E, 2 * F, d}));
        DL_ASSIGN_OR_RETURN(TensorView dn, Take(fused_down, {E, d, F}));
        const size_t es = DTypeSize(gu.dtype), es_dn = DTypeSize(dn.dtype);
        for (int64_t e = 0; e < E; ++e) {
          const auto* base = static_cast<const uint8_t*>(gu.data) + static_cast<size_t>(e * 2 * F * d) * es;
          L.experts[e].gate = TensorView{fmt::format("{}[{}].gate", fused_gu, e), gu.dtype, {F, d}, base};
          L.experts[e].up = TensorView{fmt::format("{}[{}].up", fused_gu, e), gu.dtype, {F, d},
                                       base + static_cast<size_t>(F * d) * es};
          L.experts[e].down = TensorView{fmt::format("{}[{}]", fused_down, e), dn.dtype, {d, F},
                                         static_cast<const uint8_t*>(dn.data) + static_cast<size_t>(e * d * F) * es_dn};
        }
      } else {
        for (int64_t e = 0; e < E; ++e) {
          const std::string q = fmt::format("{}mlp.experts.{}.", p, e);
          DL_ASSIGN_OR_RETURN(L.experts[e].gate, Take(q + "gate_proj.weight", {F, d}));
          DL_ASSIGN_OR_RETURN(L.experts[e].up, Take(q + "up_proj.weight", {F, d}));
          DL_ASSIGN_OR_RETURN(L.experts[e].down, Take(q + "down_proj.weight", {d, F}));
        }
      }
    }
    // Anything left over is not part of this model: refuse rather than silently ignore weights.
    std::vector<std::string> extra;
    for (size_t i = 0; i < raw_.size(); ++i) {
      if (used_[i] || EndsWith(raw_[i].view.name, ".rotary_emb.inv_freq")) continue;
      extra.push_back(fmt::format("'{}' in {}", raw_[i].view.name, raw_[i].file));
    }
    if (!extra.empty()) {
      const size_t n = extra.size();
      if (n > 5) extra.resize(5);
      return InvalidArgument("{} unexpected tensor(s) for this config: {}{}", n, fmt::join(extra, ", "),
                             n > 5 ? ", ..." : "");
    }
    return Status::Ok();
  }

 private:
  bool Has(const std::string& name) const { return index_.count(name) != 0; }

  Result<std::string> Either(const std::string& a, const std::string& b) const {
    if (Has(a) && Has(b)) return InvalidArgument("both '{}' and '{}' are present; expected one of them", a, b);
    if (Has(b)) return b;
    return a;  // missing -> Take(a) reports it
  }

  Result<TensorView> Take(const std::string& name, const std::vector<int64_t>& shape) {
    auto it = index_.find(name);
    if (it == index_.end()) return NotFound("missing tensor '{}' (expected shape {})", name, ShapeStr(shape));
    const RawTensor& r = raw_[it->second];
    if (r.view.dtype == DType::kF8E4M3) {
      return Unimplemented("{}: tensor '{}' is F8_E4M3: {}", r.file, name, kFp8Unsupported);
    }
    if (r.view.shape != shape) {
      return InvalidArgument("{}: tensor '{}' has shape {}, the config needs {}", r.file, name,
                             ShapeStr(r.view.shape), ShapeStr(shape));
    }
    used_[it->second] = true;
    return r.view;
  }

  Result<std::optional<float>> TakeScale(const std::string& name) {
    auto it = index_.find(name);
    if (it == index_.end()) return std::optional<float>();
    const RawTensor& r = raw_[it->second];
    if (r.view.numel() != 1 || r.view.shape.size() > 1) {
      return InvalidArgument("{}: KV scale '{}' has shape {}, expected [] or [1]", r.file, name, ShapeStr(r.view.shape));
    }
    used_[it->second] = true;
    const float v = r.view.at(0);
    if (!(v > 0.0f) || !std::isfinite(v)) return InvalidArgument("{}: KV scale '{}' is {}, must be positive", r.file, name, v);
    return std::optional<float>(v);
  }

  const ModelConfig& c_;
  std::vector<RawTensor> raw_;
  std::unordered_map<std::string, size_t> index_;
  std::vector<bool> used_;
};

namespace {

Result<nlohmann::json> ReadJsonFile(const std::string& path) {
  DL_ASSIGN_OR_RETURN(std::string text, ReadRegularFile(path, kMaxJsonSidecarBytes));
  try {
    return nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    return DataLoss("{}: not valid JSON: {}", path, e.what());
  }
}

}  // namespace

Result<Checkpoint> Checkpoint::Open(const std::string& dir) {
  Checkpoint ck;
  ck.dir = dir;
  if (!fs::is_directory(dir)) return NotFound("model directory {} does not exist", dir);
  DL_ASSIGN_OR_RETURN(ck.config_, ModelConfig::FromFile((fs::path(dir) / "config.json").string()));
  if (ck.config_.has_quantization_config && ck.config_.quantizes_weights) {
    return Unimplemented("{}/config.json: quantization_config (quant_method '{}'): {}", dir, ck.config_.quant_method,
                         kFp8Unsupported);
  }
  const std::string single = (fs::path(dir) / "model.safetensors").string();
  const std::string index_path = (fs::path(dir) / "model.safetensors.index.json").string();
  std::vector<RawTensor> raw;
  if (fs::exists(single)) {
    DL_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(single));
    ck.storage_->files.push_back(std::move(f));
  } else if (fs::exists(index_path)) {
    DL_ASSIGN_OR_RETURN(auto idx, ReadJsonFile(index_path));
    if (!idx.is_object() || !idx.contains("weight_map") || !idx["weight_map"].is_object()) {
      return DataLoss("{}: no \"weight_map\" object", index_path);
    }
    std::map<std::string, std::string> weight_map;
    std::vector<std::string> shard_names;
    for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end(); ++it) {
      if (!it->is_string()) return DataLoss("{}: weight_map['{}'] is not a file name", index_path, it.key());
      const std::string shard = it->get<std::string>();
      if (shard.empty() || shard.find('/') != std::string::npos || shard.find("..") != std::string::npos) {
        return DataLoss("{}: weight_map['{}'] = '{}' is not a plain file name", index_path, it.key(), shard);
      }
      weight_map[it.key()] = shard;
      if (std::find(shard_names.begin(), shard_names.end(), shard) == shard_names.end()) shard_names.push_back(shard);
    }
    if (weight_map.empty()) return DataLoss("{}: weight_map is empty", index_path);
    std::sort(shard_names.begin(), shard_names.end());
    for (const auto& s : shard_names) {
      DL_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open((fs::path(dir) / s).string()));
      std::set<std::string> in_file;
      for (const auto& t : f.tensors()) {
        in_file.insert(t.name);
        auto it = weight_map.find(t.name);
        if (it == weight_map.end() || it->second != s) {
          return DataLoss("{}: tensor '{}' is not mapped to this shard in {}", f.path(), t.name, index_path);
        }
      }
      for (const auto& [name, shard] : weight_map) {
        if (shard == s && !in_file.count(name)) {
          return DataLoss("{}: tensor '{}' is listed in the index but missing from {}", index_path, name, f.path());
        }
      }
      ck.storage_->files.push_back(std::move(f));
    }
  } else {
    return NotFound("{} has neither model.safetensors nor model.safetensors.index.json", dir);
  }
  for (const auto& f : ck.storage_->files) {
    ck.files_.push_back(f.path());
    for (const auto& t : f.tensors()) {
      raw.push_back(RawTensor{TensorView{t.name, t.dtype, t.shape, t.data}, f.path()});
    }
  }
  for (const auto& r : raw) ck.tensors_.push_back(r.view);
  CheckpointBuilder b(ck.config_, std::move(raw));
  Status s = b.Build(&ck.weights_, &ck.fused_experts_);
  if (!s.ok()) return s.WithContext(fmt::format("loading {}", dir));
  return ck;
}

Result<Checkpoint> MakeSyntheticCheckpoint(const ModelConfig& config, uint64_t seed, DType dtype) {
  if (dtype == DType::kF8E4M3) return Unimplemented("synthetic FP8 weights are not supported");
  Checkpoint ck;
  ck.config_ = config;
  const std::vector<TensorSpec> specs = CheckpointTensorSpecs(config);
  const size_t es = DTypeSize(dtype);
  std::vector<size_t> offsets(specs.size());
  size_t total = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    offsets[i] = total;
    total += (static_cast<size_t>(specs[i].numel()) * es + 63) / 64 * 64;
  }
  try {
    ck.storage_->arena.resize(total);
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("synthetic weights need {} bytes of host memory", total);
  }
  uint8_t* arena = ck.storage_->arena.data();
  // Work items of up to 1M elements, spread over the cores.
  constexpr int64_t kChunk = 1 << 20;
  struct Item {
    size_t tensor;
    int64_t begin, count;
  };
  std::vector<Item> items;
  for (size_t i = 0; i < specs.size(); ++i) {
    for (int64_t b = 0; b < specs[i].numel(); b += kChunk) items.push_back({i, b, std::min(kChunk, specs[i].numel() - b)});
  }
  std::atomic<size_t> next{0};
  auto worker = [&] {
    std::vector<float> buf(kChunk);
    for (size_t k; (k = next.fetch_add(1)) < items.size();) {
      const Item& it = items[k];
      const TensorSpec& s = specs[it.tensor];
      GenerateTensorValues(seed, s.name, s.kind, s.fan_in, buf.data(), it.begin, it.count);
      void* dst = arena + offsets[it.tensor];
      for (int64_t j = 0; j < it.count; ++j) StoreFromFloat(dst, dtype, static_cast<size_t>(it.begin + j), buf[j]);
    }
  };
  const unsigned n_threads = std::max(1u, std::min(8u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  for (unsigned t = 1; t < n_threads && items.size() > 1; ++t) threads.emplace_back(worker);
  worker();
  for (auto& t : threads) t.join();
  std::vector<RawTensor> raw;
  for (size_t i = 0; i < specs.size(); ++i) {
    raw.push_back(RawTensor{TensorView{specs[i].name, dtype, specs[i].shape, arena + offsets[i]}, "<synthetic>"});
    ck.tensors_.push_back(raw.back().view);
  }
  CheckpointBuilder b(ck.config_, std::move(raw));
  DL_RETURN_IF_ERROR(b.Build(&ck.weights_, &ck.fused_experts_));
  return ck;
}

Result<Checkpoint> MakeShapeOnlyCheckpoint(const ModelConfig& config) {
  Checkpoint ck;
  ck.config_ = config;
  std::vector<RawTensor> raw;
  for (const TensorSpec& spec : CheckpointTensorSpecs(config)) {
    raw.push_back(RawTensor{TensorView{spec.name, DType::kBF16, spec.shape, nullptr}, "<shape-only>"});
    ck.tensors_.push_back(raw.back().view);
  }
  CheckpointBuilder b(ck.config_, std::move(raw));
  DL_RETURN_IF_ERROR(b.Build(&ck.weights_, &ck.fused_experts_));
  return ck;
}

}  // namespace dl
