#include "model/checkpoint.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <deque>
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
  std::deque<std::vector<float>> scales;  // FP8 weight scales as FP32 (stable addresses)
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

// Whether a weight may be stored as FP8 (fp8 contract): linear weights only, never the embedding,
// norms, router, correction bias or LM head.
enum class Fp8 : bool { kNever, kAllowed };

}  // namespace

// Validates stored tensors against the config and assembles ModelWeights.
class CheckpointBuilder {
 public:
  // `scales` receives the FP32 copies of FP8 weight scales (the views point into it).
  CheckpointBuilder(const ModelConfig& c, std::vector<RawTensor> raw, std::deque<std::vector<float>>* scales)
      : c_(c), q_(c.weight_quant), ignore_(c.weight_quant.ignore), raw_(std::move(raw)), scales_(scales) {
    for (size_t i = 0; i < raw_.size(); ++i) index_[raw_[i].view.name] = i;
    used_.assign(raw_.size(), false);
  }

  Status Build(ModelWeights* w, bool* fused) {
    // Quantisation companions first: they would otherwise show up as "unexpected tensors".
    for (const auto& r : raw_) {
      const std::string& n = r.view.name;
      for (const char* s : {".weight_scale", ".weight_scale_inv"}) {
        if (EndsWith(n, s) && !q_.fp8()) {
          return InvalidArgument("{}: tensor '{}' is an FP8 weight scale, but config.json has no FP8 "
                                 "quantization_config (quant_method \"fp8\" or \"compressed-tensors\")",
                                 r.file, n);
        }
      }
      if (q_.fp8() && EndsWith(n, q_.format == WeightQuantFormat::kFp8Native ? ".weight_scale" : ".weight_scale_inv")) {
        return InvalidArgument("{}: tensor '{}' is named for the other FP8 format: quant_method \"{}\" stores scales "
                               "as '<weight>{}'",
                               r.file, n, c_.quant_method, q_.scale_suffix());
      }
      for (const char* s : {".weight_packed", ".input_scale", ".weight_global_scale", ".input_global_scale",
                            ".weight_zero_point"}) {
        if (EndsWith(n, s)) {
          return Unimplemented("{}: tensor '{}' belongs to a quantisation scheme this engine does not support (FP8 "
                               "weights with F32 block, channel or tensor scales only)",
                               r.file, n);
        }
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
      DL_ASSIGN_OR_RETURN(L.q, Take(p + "self_attn.q_proj.weight", {H * D, d}, Fp8::kAllowed));
      DL_ASSIGN_OR_RETURN(L.k, Take(p + "self_attn.k_proj.weight", {K * D, d}, Fp8::kAllowed));
      DL_ASSIGN_OR_RETURN(L.v, Take(p + "self_attn.v_proj.weight", {K * D, d}, Fp8::kAllowed));
      DL_ASSIGN_OR_RETURN(L.o, Take(p + "self_attn.o_proj.weight", {d, H * D}, Fp8::kAllowed));
      DL_ASSIGN_OR_RETURN(L.g, Take(p + "self_attn.g_proj.weight", {c_.gate_width(l), d}, Fp8::kAllowed));
      DL_ASSIGN_OR_RETURN(L.q_norm, Take(p + "self_attn.q_norm.weight", {D}));
      DL_ASSIGN_OR_RETURN(L.k_norm, Take(p + "self_attn.k_norm.weight", {D}));
      DL_ASSIGN_OR_RETURN(L.k_scale, TakeScale(p + "self_attn.k_scale"));
      DL_ASSIGN_OR_RETURN(L.v_scale, TakeScale(p + "self_attn.v_scale"));
      if (!c_.is_sparse(l)) {
        const int64_t F = c_.intermediate_size;
        DL_ASSIGN_OR_RETURN(L.mlp_gate, Take(p + "mlp.gate_proj.weight", {F, d}, Fp8::kAllowed));
        DL_ASSIGN_OR_RETURN(L.mlp_up, Take(p + "mlp.up_proj.weight", {F, d}, Fp8::kAllowed));
        DL_ASSIGN_OR_RETURN(L.mlp_down, Take(p + "mlp.down_proj.weight", {d, F}, Fp8::kAllowed));
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
      DL_ASSIGN_OR_RETURN(L.shared.gate, Take(shared_prefix + "gate_proj.weight", {Fs, d}, Fp8::kAllowed));
      DL_ASSIGN_OR_RETURN(L.shared.up, Take(shared_prefix + "up_proj.weight", {Fs, d}, Fp8::kAllowed));
      DL_ASSIGN_OR_RETURN(L.shared.down, Take(shared_prefix + "down_proj.weight", {d, Fs}, Fp8::kAllowed));
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
        for (const std::string& n : {fused_gu, fused_down}) {
          if (Has(n) && raw_[index_.at(n)].view.dtype == DType::kF8E4M3) {
            return Unimplemented("{}: tensor '{}' is F8_E4M3: FP8 experts are supported in the per-expert layout "
                                 "(mlp.experts.N.*_proj.weight) only",
                                 raw_[index_.at(n)].file, n);
          }
        }
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
          DL_ASSIGN_OR_RETURN(L.experts[e].gate, Take(q + "gate_proj.weight", {F, d}, Fp8::kAllowed));
          DL_ASSIGN_OR_RETURN(L.experts[e].up, Take(q + "up_proj.weight", {F, d}, Fp8::kAllowed));
          DL_ASSIGN_OR_RETURN(L.experts[e].down, Take(q + "down_proj.weight", {d, F}, Fp8::kAllowed));
        }
      }
    }
    // Anything left over is not part of this model: refuse rather than silently ignore weights.
    std::vector<std::string> extra;
    for (size_t i = 0; i < raw_.size(); ++i) {
      if (used_[i] || EndsWith(raw_[i].view.name, ".rotary_emb.inv_freq")) continue;
      const std::string& n = raw_[i].view.name;
      if (q_.fp8() && EndsWith(n, q_.scale_suffix())) {
        const std::string weight = n.substr(0, n.size() - std::string(q_.scale_suffix()).size());
        return InvalidArgument("{}: scale tensor '{}' belongs to '{}', which is {}not an FP8 weight", raw_[i].file, n,
                               weight, Has(weight) ? "" : "missing or ");
      }
      extra.push_back(fmt::format("'{}' in {}", n, raw_[i].file));
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

  Result<TensorView> Take(const std::string& name, const std::vector<int64_t>& shape, Fp8 fp8 = Fp8::kNever) {
    auto it = index_.find(name);
    if (it == index_.end()) return NotFound("missing tensor '{}' (expected shape {})", name, ShapeStr(shape));
    const RawTensor& r = raw_[it->second];
    if (r.view.shape != shape) {
      return InvalidArgument("{}: tensor '{}' has shape {}, the config needs {}", r.file, name,
                             ShapeStr(r.view.shape), ShapeStr(shape));
    }
    used_[it->second] = true;
    if (r.view.dtype != DType::kF8E4M3) return r.view;
    if (fp8 == Fp8::kNever) {
      return InvalidArgument("{}: tensor '{}' is F8_E4M3, but only linear layers may be FP8 (the embedding, norms, "
                             "routers, correction biases and LM head stay BF16)",
                             r.file, name);
    }
    if (!q_.fp8()) {
      return InvalidArgument("{}: tensor '{}' is F8_E4M3, but config.json has no FP8 quantization_config to say how "
                             "its scales are stored",
                             r.file, name);
    }
    const std::string module = name.substr(0, name.size() - std::string(".weight").size());
    if (ignore_.Matches(module)) {
      return InvalidArgument("{}: tensor '{}' is F8_E4M3, but quantization_config lists module '{}' as not "
                             "quantised",
                             r.file, name, module);
    }
    return WithScales(r, shape);
  }

  // An FP8 weight's view with its scales: the `<name><suffix>` tensor, F32, of the shape the
  // granularity gives, every value finite; copied into FP32 memory the checkpoint owns.
  Result<TensorView> WithScales(const RawTensor& r, const std::vector<int64_t>& shape) {
    TensorView v = r.view;
    const int64_t out = shape[0], in = shape[1];
    q_.BlockShape(out, in, &v.block_rows, &v.block_cols);
    v.scale_name = v.name + q_.scale_suffix();
    auto it = index_.find(v.scale_name);
    if (it == index_.end()) {
      return NotFound("{}: FP8 weight '{}' has no scale tensor '{}' (quant_method \"{}\")", r.file, v.name,
                      v.scale_name, c_.quant_method);
    }
    const RawTensor& s = raw_[it->second];
    used_[it->second] = true;
    if (s.view.dtype != DType::kF32) {
      return InvalidArgument("{}: scale tensor '{}' is {}; FP8 weight scales must be F32", s.file, v.scale_name,
                             DTypeSafetensorsName(s.view.dtype));
    }
    const int64_t rows = (out + v.block_rows - 1) / v.block_rows, cols = (in + v.block_cols - 1) / v.block_cols;
    std::vector<std::vector<int64_t>> accepted;
    switch (q_.granularity) {
      case Fp8Granularity::kBlock: accepted = {{rows, cols}}; break;
      case Fp8Granularity::kChannel: accepted = {{out, 1}, {out}}; break;
      case Fp8Granularity::kTensor: accepted = {{1}, {}, {1, 1}}; break;
    }
    if (std::find(accepted.begin(), accepted.end(), s.view.shape) == accepted.end()) {
      return InvalidArgument("{}: scale tensor '{}' has shape {}; weight [{}, {}] with {} scales{} needs {}", s.file,
                             v.scale_name, ShapeStr(s.view.shape), out, in,
                             Fp8GranularityName(q_.granularity),
                             q_.granularity == Fp8Granularity::kBlock
                                 ? fmt::format(" of {}x{} blocks", v.block_rows, v.block_cols)
                                 : std::string(),
                             ShapeStr(accepted[0]));
    }
    if (s.view.data == nullptr) return v;  // shape-only checkpoint: the device generates the scales
    std::vector<float> copy(static_cast<size_t>(rows * cols));
    for (int64_t i = 0; i < rows * cols; ++i) {
      copy[i] = s.view.at(i);
      if (!std::isfinite(copy[i])) {
        return InvalidArgument("{}: scale tensor '{}' has the non-finite value {} at block {} (row {}, column {})",
                               s.file, v.scale_name, copy[i], i, i / cols, i % cols);
      }
    }
    scales_->push_back(std::move(copy));
    v.scales = scales_->back().data();
    return v;
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
  const WeightQuantization& q_;
  IgnoreMatcher ignore_;
  std::vector<RawTensor> raw_;
  std::deque<std::vector<float>>* scales_;
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
  CheckpointBuilder b(ck.config_, std::move(raw), &ck.storage_->scales);
  Status s = b.Build(&ck.weights_, &ck.fused_experts_);
  if (!s.ok()) return s.WithContext(fmt::format("loading {}", dir));
  return ck;
}

Result<Checkpoint> MakeSyntheticCheckpoint(const ModelConfig& config, uint64_t seed, DType dtype,
                                           const Fp8Options* fp8) {
  if (dtype == DType::kF8E4M3) {
    return InvalidArgument("synthetic FP8 weights: pass Fp8Options, with a BF16/F16/F32 dtype for the rest");
  }
  Checkpoint ck;
  ck.config_ = config;
  if (fp8 != nullptr) DL_RETURN_IF_ERROR(ApplyFp8Options(&ck.config_, *fp8));
  const WeightQuantization& q = ck.config_.weight_quant;
  const std::vector<TensorSpec> specs = CheckpointTensorSpecs(ck.config_);
  // Per spec: its values (dtype) or FP8 codes, and for FP8 its scales, each 64-byte aligned.
  struct Layout {
    bool fp8 = false;
    int64_t block_rows = 0, block_cols = 0, bands = 0, col_blocks = 0;
    size_t offset = 0, scale_offset = 0;
  };
  std::vector<Layout> layout(specs.size());
  size_t total = 0;
  auto reserve = [&](size_t bytes) {
    const size_t at = total;
    total += (bytes + 63) / 64 * 64;
    return at;
  };
  for (size_t i = 0; i < specs.size(); ++i) {
    Layout& L = layout[i];
    L.fp8 = fp8 != nullptr && Fp8LayoutQuantizes(fp8->layout, specs[i]);
    if (!L.fp8) {
      L.offset = reserve(static_cast<size_t>(specs[i].numel()) * DTypeSize(dtype));
      continue;
    }
    const int64_t out = specs[i].shape[0], in = specs[i].shape[1];
    q.BlockShape(out, in, &L.block_rows, &L.block_cols);
    L.bands = (out + L.block_rows - 1) / L.block_rows;
    L.col_blocks = (in + L.block_cols - 1) / L.block_cols;
    L.offset = reserve(static_cast<size_t>(specs[i].numel()));
    L.scale_offset = reserve(static_cast<size_t>(L.bands * L.col_blocks) * sizeof(float));
  }
  try {
    ck.storage_->arena.resize(total);
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("synthetic weights need {} bytes of host memory", total);
  }
  uint8_t* arena = ck.storage_->arena.data();
  // Work items of up to 1M elements (FP8: one block row each), spread over the cores.
  constexpr int64_t kChunk = 1 << 20;
  struct Item {
    size_t tensor;
    int64_t begin, count;  // elements; FP8: begin = the band
  };
  std::vector<Item> items;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (layout[i].fp8) {
      for (int64_t band = 0; band < layout[i].bands; ++band) items.push_back({i, band, 0});
      continue;
    }
    for (int64_t b = 0; b < specs[i].numel(); b += kChunk) items.push_back({i, b, std::min(kChunk, specs[i].numel() - b)});
  }
  std::atomic<size_t> next{0};
  auto worker = [&] {
    std::vector<float> buf(kChunk);
    for (size_t k; (k = next.fetch_add(1)) < items.size();) {
      const Item& it = items[k];
      const TensorSpec& s = specs[it.tensor];
      const Layout& L = layout[it.tensor];
      if (L.fp8) {
        const int64_t in = s.shape[1];
        QuantizeSyntheticFp8Band(seed, s, L.block_rows, L.block_cols, it.begin, &buf,
                                 arena + L.offset + static_cast<size_t>(it.begin * L.block_rows * in),
                                 reinterpret_cast<float*>(arena + L.scale_offset) + it.begin * L.col_blocks);
        continue;
      }
      buf.resize(kChunk);
      GenerateTensorValues(seed, s.name, s.kind, s.fan_in, buf.data(), it.begin, it.count);
      void* dst = arena + L.offset;
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
    const Layout& L = layout[i];
    raw.push_back(RawTensor{TensorView{specs[i].name, L.fp8 ? DType::kF8E4M3 : dtype, specs[i].shape, arena + L.offset},
                            "<synthetic>"});
    if (L.fp8) {
      raw.push_back(RawTensor{TensorView{specs[i].name + q.scale_suffix(), DType::kF32,
                                         q.ScaleShape(specs[i].shape[0], specs[i].shape[1]), arena + L.scale_offset},
                              "<synthetic>"});
    }
  }
  for (const RawTensor& r : raw) ck.tensors_.push_back(r.view);
  CheckpointBuilder b(ck.config_, std::move(raw), &ck.storage_->scales);
  DL_RETURN_IF_ERROR(b.Build(&ck.weights_, &ck.fused_experts_));
  return ck;
}

Result<Checkpoint> MakeShapeOnlyCheckpoint(const ModelConfig& config, const Fp8Options* fp8) {
  Checkpoint ck;
  ck.config_ = config;
  if (fp8 != nullptr) DL_RETURN_IF_ERROR(ApplyFp8Options(&ck.config_, *fp8));
  const WeightQuantization& q = ck.config_.weight_quant;
  std::vector<RawTensor> raw;
  for (const TensorSpec& spec : CheckpointTensorSpecs(ck.config_)) {
    const bool is_fp8 = fp8 != nullptr && Fp8LayoutQuantizes(fp8->layout, spec);
    raw.push_back(RawTensor{TensorView{spec.name, is_fp8 ? DType::kF8E4M3 : DType::kBF16, spec.shape, nullptr},
                            "<shape-only>"});
    if (is_fp8) {
      const std::vector<int64_t> scale_shape = q.ScaleShape(spec.shape[0], spec.shape[1]);
      raw.push_back(RawTensor{TensorView{spec.name + q.scale_suffix(), DType::kF32, scale_shape, nullptr},
                              "<shape-only>"});
    }
  }
  for (const RawTensor& r : raw) ck.tensors_.push_back(r.view);
  CheckpointBuilder b(ck.config_, std::move(raw), &ck.storage_->scales);
  DL_RETURN_IF_ERROR(b.Build(&ck.weights_, &ck.fused_experts_));
  return ck;
}

}  // namespace dl
