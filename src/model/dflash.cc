#include "model/dflash.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>

#include "base/dtype.h"
#include "base/file_util.h"
#include "model/json_read.h"
#include "model/safetensors.h"
#include "model/synthetic.h"

namespace dl {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr size_t kMaxDflashConfigBytes = 4u << 20;

// The keys of one JSON object, consumed as they are read; whatever is left is unknown.
class Keys {
 public:
  Keys(const json& j, std::string where) : j_(j), where_(std::move(where)) {
    for (auto it = j.begin(); it != j.end(); ++it) left_.insert(it.key());
  }
  const json* Get(const std::string& key) {
    left_.erase(key);
    auto it = j_.find(key);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }
  Status Int(const std::string& key, int64_t* out, int64_t lo = 0, int64_t hi = kJsonInt32Max) {
    const json* v = Get(key);
    return v ? JsonInt(*v, where_ + key, lo, hi, out) : Status::Ok();
  }
  Status Double(const std::string& key, double* out) {
    const json* v = Get(key);
    if (!v) return Status::Ok();
    if (!v->is_number()) return InvalidArgument("key '{}{}' must be a number, got {}", where_, key, ShowJson(*v));
    *out = v->get<double>();
    return Status::Ok();
  }
  Status Bool(const std::string& key, std::optional<bool>* out) {
    const json* v = Get(key);
    if (!v) return Status::Ok();
    if (!v->is_boolean()) return InvalidArgument("key '{}{}' must be true or false, got {}", where_, key, ShowJson(*v));
    *out = v->get<bool>();
    return Status::Ok();
  }
  Status String(const std::string& key, std::string* out) {
    const json* v = Get(key);
    if (!v) return Status::Ok();
    if (!v->is_string()) return InvalidArgument("key '{}{}' must be a string, got {}", where_, key, ShowJson(*v));
    *out = v->get<std::string>();
    return Status::Ok();
  }
  // Accepted with no effect on the drafter's inference (the reason goes into notes).
  void Inert(const std::string& key, const char* why, std::vector<std::string>* notes) {
    if (Get(key)) notes->push_back(fmt::format("{}{}: {}", where_, key, why));
  }
  Status RejectRest() const {
    if (left_.empty()) return Status::Ok();
    return InvalidArgument("unsupported DFlash config key '{}{}' (not understood by this engine; see docs/speculative.md)",
                           where_, *left_.begin());
  }

 private:
  const json& j_;
  std::string where_;
  std::set<std::string> left_;
};

Status ReadIds(const json& v, const std::string& key, std::vector<int64_t>* out) {
  if (!v.is_array()) return InvalidArgument("key '{}' must be a list of integers, got {}", key, ShowJson(v));
  out->clear();
  for (const json& e : v) {
    int64_t x = 0;
    DL_RETURN_IF_ERROR(JsonInt(e, key, 0, kJsonInt32Max, &x));
    out->push_back(x);
  }
  return Status::Ok();
}

Status Positive(const char* key, int64_t v) {
  if (v <= 0) return InvalidArgument("DFlash config: '{}' must be given and > 0 (got {})", key, v);
  return Status::Ok();
}

Status ParseImpl(const json& j, DflashConfig* c) {
  if (!j.is_object()) return InvalidArgument("a DFlash config.json must be a JSON object");
  Keys k(j, "");
  // Family.
  const json* arch = k.Get("architectures");
  if (!arch || !arch->is_array() || arch->size() != 1 || !(*arch)[0].is_string()) {
    return InvalidArgument("DFlash config: 'architectures' must be a list of one name (DFlashDraftModel or "
                           "DFlashLagunaForCausalLM), got {}", arch ? ShowJson(*arch) : "nothing");
  }
  const std::string a = (*arch)[0].get<std::string>();
  if (a == "DFlashDraftModel") {
    c->family = DflashFamily::kZlab;
    c->model_type = "qwen3";
  } else if (a == "DFlashLagunaForCausalLM") {
    c->family = DflashFamily::kLaguna;
    c->model_type = "laguna";
  } else if (a.rfind("DFlash2", 0) == 0) {
    return Unimplemented("DFlash config: architecture '{}' is DFlash2 (grouped causal convolutions, a candidate "
                         "lattice), a different algorithm this engine does not implement", a);
  } else {
    return InvalidArgument("DFlash config: architecture '{}' is not a DFlash drafter (DFlashDraftModel or "
                           "DFlashLagunaForCausalLM)", a);
  }
  const bool laguna = c->family == DflashFamily::kLaguna;
  DL_RETURN_IF_ERROR(k.String("model_type", &c->model_type));
  DL_RETURN_IF_ERROR(k.Int("hidden_size", &c->hidden_size));
  DL_RETURN_IF_ERROR(k.Int("intermediate_size", &c->intermediate_size));
  DL_RETURN_IF_ERROR(k.Int("num_hidden_layers", &c->num_hidden_layers));
  DL_RETURN_IF_ERROR(k.Int("num_attention_heads", &c->num_attention_heads));
  c->num_key_value_heads = 0;
  DL_RETURN_IF_ERROR(k.Int("num_key_value_heads", &c->num_key_value_heads));
  DL_RETURN_IF_ERROR(k.Int("head_dim", &c->head_dim));
  DL_RETURN_IF_ERROR(Positive("hidden_size", c->hidden_size));
  DL_RETURN_IF_ERROR(Positive("intermediate_size", c->intermediate_size));
  DL_RETURN_IF_ERROR(Positive("num_hidden_layers", c->num_hidden_layers));
  DL_RETURN_IF_ERROR(Positive("num_attention_heads", c->num_attention_heads));
  if (c->num_key_value_heads == 0) c->num_key_value_heads = c->num_attention_heads;
  if (c->head_dim == 0) c->head_dim = c->hidden_size / c->num_attention_heads;
  if (c->num_attention_heads % c->num_key_value_heads != 0) {
    return InvalidArgument("DFlash config: num_attention_heads {} is not a multiple of num_key_value_heads {}",
                           c->num_attention_heads, c->num_key_value_heads);
  }
  DL_RETURN_IF_ERROR(k.Double("rms_norm_eps", &c->rms_norm_eps));
  DL_RETURN_IF_ERROR(k.Int("max_position_embeddings", &c->max_position_embeddings));
  // Vocabulary: the target's LM head predicts; draft_vocab_size (Laguna) must agree with vocab_size.
  DL_RETURN_IF_ERROR(k.Int("vocab_size", &c->vocab_size));
  int64_t draft_vocab = 0;
  DL_RETURN_IF_ERROR(k.Int("draft_vocab_size", &draft_vocab));
  if (draft_vocab > 0 && c->vocab_size > 0 && draft_vocab != c->vocab_size) {
    return Unimplemented("DFlash config: draft_vocab_size {} differs from vocab_size {} (a reduced draft "
                         "vocabulary with a d2t map is not supported)", draft_vocab, c->vocab_size);
  }
  if (c->vocab_size == 0) c->vocab_size = draft_vocab;
  DL_RETURN_IF_ERROR(Positive("vocab_size", c->vocab_size));

  // RoPE: the drafter's own (top-level rope_theta, or a flat default rope_parameters/rope_scaling).
  DL_RETURN_IF_ERROR(k.Double("rope_theta", &c->rope_theta));
  DL_RETURN_IF_ERROR(k.Double("partial_rotary_factor", &c->partial_rotary_factor));
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    const json* rp = k.Get(key);
    if (!rp) continue;
    if (!rp->is_object()) return InvalidArgument("DFlash config: '{}' must be an object, got {}", key, ShowJson(*rp));
    Keys r(*rp, std::string(key) + ".");
    std::string type = "default";
    DL_RETURN_IF_ERROR(r.String("rope_type", &type));
    if (type != "default") {
      return Unimplemented("DFlash config: {}.rope_type '{}' is not supported for drafters (only 'default')", key, type);
    }
    DL_RETURN_IF_ERROR(r.Double("rope_theta", &c->rope_theta));
    DL_RETURN_IF_ERROR(r.Double("partial_rotary_factor", &c->partial_rotary_factor));
    DL_RETURN_IF_ERROR(r.RejectRest());
  }
  if (!(c->rope_theta > 1.0)) return InvalidArgument("DFlash config: rope_theta must be > 1 (got {})", c->rope_theta);
  {
    const double rd = c->head_dim * c->partial_rotary_factor;
    if (!(c->partial_rotary_factor > 0.0 && c->partial_rotary_factor <= 1.0) ||
        static_cast<int64_t>(rd) % 2 != 0 || static_cast<int64_t>(rd) == 0) {
      return InvalidArgument("DFlash config: partial_rotary_factor {} gives no even rotary width of head_dim {}",
                             c->partial_rotary_factor, c->head_dim);
    }
  }
  std::optional<bool> neox;
  DL_RETURN_IF_ERROR(k.Bool("is_neox_style", &neox));
  if (neox && !*neox) return Unimplemented("DFlash config: is_neox_style false (interleaved RoPE) is not supported");

  // Layer types and the window.
  DL_RETURN_IF_ERROR(k.Int("sliding_window", &c->sliding_window));
  std::optional<bool> use_sliding;
  DL_RETURN_IF_ERROR(k.Bool("use_sliding_window", &use_sliding));
  int64_t max_window_layers = -1;
  DL_RETURN_IF_ERROR(k.Int("max_window_layers", &max_window_layers));
  if (const json* lt = k.Get("layer_types")) {
    if (!lt->is_array() || static_cast<int64_t>(lt->size()) != c->num_hidden_layers) {
      return InvalidArgument("DFlash config: 'layer_types' must list {} layer types, got {}", c->num_hidden_layers,
                             ShowJson(*lt));
    }
    for (const json& t : *lt) {
      if (t == "full_attention") {
        c->layer_types.push_back(LayerType::kFull);
      } else if (t == "sliding_attention") {
        c->layer_types.push_back(LayerType::kSliding);
      } else {
        return InvalidArgument("DFlash config: layer_types entry {} is neither full_attention nor sliding_attention",
                               ShowJson(t));
      }
    }
  } else if (use_sliding.value_or(false)) {
    return Unimplemented("DFlash config: use_sliding_window true without 'layer_types' (say which layers slide)");
  } else {
    c->layer_types.assign(static_cast<size_t>(c->num_hidden_layers), LayerType::kFull);
  }
  const bool any_sliding = std::count(c->layer_types.begin(), c->layer_types.end(), LayerType::kSliding) > 0;
  if (any_sliding && c->sliding_window <= 0) {
    return InvalidArgument("DFlash config: sliding_attention layers need 'sliding_window' > 0");
  }

  // Laguna-only keys.
  std::string gating;
  DL_RETURN_IF_ERROR(k.String("gating", &gating));
  if (!gating.empty()) {
    if (gating != "per-head") {
      return Unimplemented("DFlash config: gating '{}' is not supported for drafters (only 'per-head')", gating);
    }
    c->per_head_gate = true;
  }
  int64_t experts = 0;
  DL_RETURN_IF_ERROR(k.Int("num_experts", &experts));
  if (experts != 0) return Unimplemented("DFlash config: num_experts {} (a MoE drafter) is not supported", experts);
  std::string act = "silu";
  DL_RETURN_IF_ERROR(k.String("hidden_act", &act));
  if (act != "silu") return Unimplemented("DFlash config: hidden_act '{}' (only silu)", act);
  std::optional<bool> bias;
  DL_RETURN_IF_ERROR(k.Bool("attention_bias", &bias));
  if (bias.value_or(false)) return Unimplemented("DFlash config: attention_bias true is not supported");

  // The DFlash keys: top level (older z-lab) or inside dflash_config (newer, Laguna).
  DL_RETURN_IF_ERROR(k.Int("block_size", &c->block_size));
  DL_RETURN_IF_ERROR(k.Int("num_target_layers", &c->num_target_layers));
  DL_RETURN_IF_ERROR(k.Int("mask_token_id", &c->mask_token_id, -1));
  std::optional<bool> causal;
  DL_RETURN_IF_ERROR(k.Bool("is_causal", &causal));
  bool have_ids = false;
  if (const json* ids = k.Get("target_layer_ids")) {
    DL_RETURN_IF_ERROR(ReadIds(*ids, "target_layer_ids", &c->target_layer_ids));
    have_ids = true;
  }
  if (const json* dc = k.Get("dflash_config")) {
    if (!dc->is_object()) return InvalidArgument("DFlash config: 'dflash_config' must be an object, got {}", ShowJson(*dc));
    Keys d(*dc, "dflash_config.");
    DL_RETURN_IF_ERROR(d.Int("block_size", &c->block_size));
    DL_RETURN_IF_ERROR(d.Int("num_target_layers", &c->num_target_layers));
    DL_RETURN_IF_ERROR(d.Int("mask_token_id", &c->mask_token_id, -1));
    DL_RETURN_IF_ERROR(d.Bool("causal", &causal));
    if (const json* ids = d.Get("target_layer_ids")) {
      DL_RETURN_IF_ERROR(ReadIds(*ids, "dflash_config.target_layer_ids", &c->target_layer_ids));
      have_ids = true;
    }
    std::optional<bool> use_swa, aux;
    DL_RETURN_IF_ERROR(d.Bool("use_swa", &use_swa));
    if (use_swa && *use_swa != any_sliding) {
      return InvalidArgument("DFlash config: dflash_config.use_swa {} contradicts layer_types", *use_swa);
    }
    DL_RETURN_IF_ERROR(d.Bool("use_aux_hidden_state", &aux));
    if (aux && !*aux) return Unimplemented("DFlash config: dflash_config.use_aux_hidden_state false is not supported");
    DL_RETURN_IF_ERROR(d.RejectRest());
  }
  DL_RETURN_IF_ERROR(Positive("block_size", c->block_size));
  if (c->block_size < 2) return InvalidArgument("DFlash config: block_size must be >= 2 (got {})", c->block_size);
  if (c->mask_token_id < 0) return InvalidArgument("DFlash config: 'mask_token_id' must be given (top level or dflash_config)");
  if (!have_ids) {
    if (c->num_target_layers <= 0) {
      return InvalidArgument("DFlash config: no target_layer_ids and no num_target_layers to derive them from");
    }
    c->target_layer_ids = DefaultTargetLayerIds(c->num_hidden_layers, c->num_target_layers);
  }
  if (c->target_layer_ids.empty()) return InvalidArgument("DFlash config: target_layer_ids is empty");
  for (size_t i = 1; i < c->target_layer_ids.size(); ++i) {
    if (c->target_layer_ids[i] <= c->target_layer_ids[i - 1]) {
      return Unimplemented("DFlash config: target_layer_ids {} are not strictly ascending (unsupported order)",
                           json(c->target_layer_ids).dump());
    }
  }
  if (c->num_target_layers > 0 && c->target_layer_ids.back() >= c->num_target_layers) {
    return InvalidArgument("DFlash config: target layer {} is beyond num_target_layers {}",
                           c->target_layer_ids.back(), c->num_target_layers);
  }
  // vLLM's capture points: tap ids + 1 (post-layer depths).
  if (const json* eagle = k.Get("eagle_aux_hidden_state_layer_ids")) {
    std::vector<int64_t> e;
    DL_RETURN_IF_ERROR(ReadIds(*eagle, "eagle_aux_hidden_state_layer_ids", &e));
    std::vector<int64_t> want = c->target_layer_ids;
    for (int64_t& x : want) ++x;
    if (e != want) {
      return InvalidArgument("DFlash config: eagle_aux_hidden_state_layer_ids {} is not target_layer_ids + 1 ({})",
                             json(e).dump(), json(want).dump());
    }
  }
  // In-block causality (§1.6): explicit override, else sliding layers causal and full ones not.
  for (LayerType t : c->layer_types) c->block_causal.push_back(causal.value_or(t == LayerType::kSliding));
  c->context_input_norm = laguna;
  c->aux_hidden_norms = laguna;

  // Keys with no effect on inference.
  k.Inert("transformers_version", "metadata", &c->notes);
  k.Inert("_name_or_path", "metadata", &c->notes);
  k.Inert("dtype", "weights say their own dtype", &c->notes);
  k.Inert("torch_dtype", "weights say their own dtype", &c->notes);
  k.Inert("tie_word_embeddings", "the drafter uses the target's embedding and LM head", &c->notes);
  k.Inert("initializer_range", "training only", &c->notes);
  k.Inert("attention_dropout", "training only", &c->notes);
  k.Inert("use_cache", "the engine keeps the drafter's context K/V itself", &c->notes);
  k.Inert("bos_token_id", "the target's tokens decide", &c->notes);
  k.Inert("eos_token_id", "the target's tokens decide", &c->notes);
  k.Inert("pad_token_id", "the target's tokens decide", &c->notes);
  if (max_window_layers >= 0) c->notes.push_back("max_window_layers: layer_types decides");
  return k.RejectRest();
}

}  // namespace

const char* DflashFamilyName(DflashFamily f) {
  return f == DflashFamily::kZlab ? "z-lab (DFlashDraftModel)" : "laguna (DFlashLagunaForCausalLM)";
}

std::vector<int64_t> DefaultTargetLayerIds(int64_t n, int64_t L) {
  if (n <= 1) return {L / 2};
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < n; ++i) {
    ids.push_back(static_cast<int64_t>(std::lround(1.0 + static_cast<double>(i) * (L - 4) / (n - 1))));
  }
  return ids;
}

int64_t DflashConfig::rotary_dim() const { return static_cast<int64_t>(head_dim * partial_rotary_factor); }

Result<DflashConfig> DflashConfig::FromJson(const json& j) {
  DflashConfig c;
  DL_RETURN_IF_ERROR(ParseImpl(j, &c));
  return c;
}

Result<DflashConfig> DflashConfig::FromFile(const std::string& path) {
  DL_ASSIGN_OR_RETURN(const json j, ReadJsonFile(path, kMaxDflashConfigBytes));
  auto r = FromJson(j);
  if (!r.ok()) return r.status().WithContext(path);
  return r;
}

json DflashConfig::ToJson() const {
  json j;
  const bool laguna = family == DflashFamily::kLaguna;
  j["architectures"] = {laguna ? "DFlashLagunaForCausalLM" : "DFlashDraftModel"};
  j["model_type"] = model_type;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  if (partial_rotary_factor != 1.0) j["partial_rotary_factor"] = partial_rotary_factor;
  j["max_position_embeddings"] = max_position_embeddings;
  j["vocab_size"] = vocab_size;
  json types = json::array();
  for (LayerType t : layer_types) types.push_back(t == LayerType::kSliding ? "sliding_attention" : "full_attention");
  j["layer_types"] = types;
  if (sliding_window > 0) j["sliding_window"] = sliding_window;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["tie_word_embeddings"] = false;
  j["dtype"] = "bfloat16";
  json dc;
  dc["block_size"] = block_size;
  dc["mask_token_id"] = mask_token_id;
  if (num_target_layers > 0) dc["num_target_layers"] = num_target_layers;
  dc["target_layer_ids"] = target_layer_ids;
  // Causality is written explicitly only when it is the same for every layer.
  if (!block_causal.empty() && std::all_of(block_causal.begin(), block_causal.end(),
                                           [&](bool b) { return b == block_causal[0]; })) {
    dc["causal"] = static_cast<bool>(block_causal[0]);
  }
  j["dflash_config"] = dc;
  if (laguna) {
    j["draft_vocab_size"] = vocab_size;
    if (per_head_gate) j["gating"] = "per-head";
    j["num_experts"] = 0;
    std::vector<int64_t> eagle = target_layer_ids;
    for (int64_t& x : eagle) ++x;
    j["eagle_aux_hidden_state_layer_ids"] = eagle;
  } else {
    j["block_size"] = block_size;
  }
  return j;
}

Status DflashConfig::CheckTarget(const ModelConfig& t) const {
  if (hidden_size != t.hidden_size) {
    return InvalidArgument("DFlash drafter hidden_size {} differs from the target's {} (the drafter reads the target's "
                           "hidden states and embedding): not a drafter for this model", hidden_size, t.hidden_size);
  }
  if (vocab_size != t.vocab_size) {
    return InvalidArgument("DFlash drafter vocab_size {} differs from the target's {} (drafts are predicted through the "
                           "target's LM head)", vocab_size, t.vocab_size);
  }
  if (num_target_layers > 0 && num_target_layers != t.num_hidden_layers) {
    return InvalidArgument("DFlash drafter was trained on a target of {} layers; this target has {}", num_target_layers,
                           t.num_hidden_layers);
  }
  for (int64_t id : target_layer_ids) {
    if (id >= t.num_hidden_layers) {
      return InvalidArgument("DFlash drafter taps target layer {}, beyond the target's {} layers", id,
                             t.num_hidden_layers);
    }
  }
  if (mask_token_id >= t.vocab_size) {
    return InvalidArgument("DFlash drafter mask_token_id {} is outside the target's vocabulary of {}", mask_token_id,
                           t.vocab_size);
  }
  return Status::Ok();
}

// ---- checkpoint ----

struct DflashCheckpoint::Storage {
  std::optional<SafetensorsFile> file;
};

DflashCheckpoint::DflashCheckpoint() : storage_(std::make_unique<Storage>()) {}
DflashCheckpoint::DflashCheckpoint(DflashCheckpoint&&) noexcept = default;
DflashCheckpoint& DflashCheckpoint::operator=(DflashCheckpoint&&) noexcept = default;
DflashCheckpoint::~DflashCheckpoint() = default;

namespace {

// Rows [begin, begin + rows) of a row-major [out, in] tensor, as its own view.
TensorView RowSlice(const TensorView& t, int64_t begin, int64_t rows, const std::string& part) {
  const int64_t in = t.shape[1];
  TensorView v(t.name + "[" + part + "]", t.dtype, {rows, in},
               static_cast<const uint8_t*>(t.data) + static_cast<size_t>(begin * in) * DTypeSize(t.dtype));
  return v;
}

Status CheckShape(const TensorView& t, std::vector<int64_t> want) {
  if (t.shape != want) {
    return InvalidArgument("DFlash tensor '{}' has shape {}, expected {}", t.name, json(t.shape).dump(),
                           json(want).dump());
  }
  return Status::Ok();
}

}  // namespace

Result<DflashCheckpoint> DflashCheckpoint::Open(const std::string& dir) {
  DflashCheckpoint ck;
  ck.dir = dir;
  DL_ASSIGN_OR_RETURN(ck.config_, DflashConfig::FromFile((fs::path(dir) / "config.json").string()));
  const DflashConfig& c = ck.config_;
  const std::string st_path = (fs::path(dir) / "model.safetensors").string();
  if (!fs::exists(st_path)) {
    if (fs::exists(fs::path(dir) / "model.safetensors.index.json")) {
      return Unimplemented("{}: sharded DFlash drafters (model.safetensors.index.json) are not supported; published "
                           "drafters are one model.safetensors", dir);
    }
    return NotFound("{}: no model.safetensors", dir);
  }
  DL_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(st_path));
  ck.storage_->file = std::move(file);

  // Canonical names: no "model." prefix, midlayer. -> layers.0., layer numbers from 0.
  std::map<std::string, TensorView> by_name;
  std::set<int64_t> layer_ids;
  std::vector<std::pair<std::string, TensorView>> staged;
  for (const SafetensorsEntry& e : ck.storage_->file->tensors()) {
    if (e.dtype != DType::kBF16 && e.dtype != DType::kF16 && e.dtype != DType::kF32) {
      return Unimplemented("DFlash tensor '{}' is {}: drafters load BF16, F16 or F32 only", e.name,
                           DTypeName(e.dtype));
    }
    std::string n = e.name;
    if (n.rfind("model.", 0) == 0) n = n.substr(6);
    if (n.rfind("midlayer.", 0) == 0) n = "layers.0." + n.substr(9);
    if (n.rfind("layers.", 0) == 0) {
      const size_t dot = n.find('.', 7);
      int64_t id = -1;
      try {
        id = std::stoll(n.substr(7, dot - 7));
      } catch (...) {
        return InvalidArgument("DFlash tensor '{}': no layer number", e.name);
      }
      layer_ids.insert(id);
    }
    staged.emplace_back(n, TensorView(e.name, e.dtype, e.shape, e.data));
  }
  // Layers numbered 0..n-1 or num_target_layers..+n-1 (vLLM numbers them after the target's).
  const int64_t n = c.num_hidden_layers;
  int64_t base = layer_ids.empty() ? 0 : *layer_ids.begin();
  if (static_cast<int64_t>(layer_ids.size()) != n || *layer_ids.rbegin() != base + n - 1 ||
      (base != 0 && base != c.num_target_layers)) {
    return InvalidArgument("DFlash checkpoint {}: layer numbers {} are neither 0..{} nor num_target_layers ({})..+{}",
                           dir, json(std::vector<int64_t>(layer_ids.begin(), layer_ids.end())).dump(), n - 1,
                           c.num_target_layers, n - 1);
  }
  ck.layer_base_ = base;
  for (auto& [name, view] : staged) {
    std::string canon = name;
    if (canon.rfind("layers.", 0) == 0) {
      const size_t dot = canon.find('.', 7);
      canon = "layers." + std::to_string(std::stoll(canon.substr(7, dot - 7)) - base) + canon.substr(dot);
    }
    if (!by_name.emplace(canon, view).second) {
      return InvalidArgument("DFlash checkpoint {}: tensor '{}' appears twice (with and without a prefix?)", dir,
                             view.name);
    }
  }
  std::set<std::string> used;
  auto take = [&](const std::string& name) -> const TensorView* {
    auto it = by_name.find(name);
    if (it == by_name.end()) return nullptr;
    used.insert(name);
    return &it->second;
  };
  auto need = [&](const std::string& name, std::vector<int64_t> shape, TensorView* out) -> Status {
    const TensorView* t = take(name);
    if (!t) return InvalidArgument("DFlash checkpoint {}: tensor '{}' is missing", dir, name);
    DL_RETURN_IF_ERROR(CheckShape(*t, std::move(shape)));
    *out = *t;
    return Status::Ok();
  };
  const int64_t d = c.hidden_size, taps = c.num_taps(), D = c.head_dim, F = c.intermediate_size;
  DflashWeights& w = ck.weights_;
  DL_RETURN_IF_ERROR(need("fc.weight", {d, taps * d}, &w.fc));
  DL_RETURN_IF_ERROR(need("hidden_norm.weight", {d}, &w.hidden_norm));
  DL_RETURN_IF_ERROR(need("norm.weight", {d}, &w.norm));
  if (c.aux_hidden_norms) {
    w.aux_norms.resize(static_cast<size_t>(taps));
    for (int64_t i = 0; i < taps; ++i) {
      DL_RETURN_IF_ERROR(need(fmt::format("aux_hidden_norms.{}.weight", i), {d}, &w.aux_norms[i]));
    }
  }
  std::optional<bool> fused;
  for (int64_t l = 0; l < n; ++l) {
    const std::string p = fmt::format("layers.{}.", l);
    DflashLayerWeights L;
    DL_RETURN_IF_ERROR(need(p + "input_layernorm.weight", {d}, &L.input_norm));
    DL_RETURN_IF_ERROR(need(p + "post_attention_layernorm.weight", {d}, &L.post_attn_norm));
    const TensorView* qkv = take(p + "self_attn.qkv_proj.weight");
    const bool split = by_name.count(p + "self_attn.q_proj.weight") > 0;
    if (qkv && split) return InvalidArgument("DFlash layer {}: both qkv_proj and q_proj (fused and split)", l);
    if (qkv) {
      DL_RETURN_IF_ERROR(CheckShape(*qkv, {c.q_width() + 2 * c.kv_width(), d}));
      L.q = RowSlice(*qkv, 0, c.q_width(), "q");
      L.k = RowSlice(*qkv, c.q_width(), c.kv_width(), "k");
      L.v = RowSlice(*qkv, c.q_width() + c.kv_width(), c.kv_width(), "v");
    } else {
      DL_RETURN_IF_ERROR(need(p + "self_attn.q_proj.weight", {c.q_width(), d}, &L.q));
      DL_RETURN_IF_ERROR(need(p + "self_attn.k_proj.weight", {c.kv_width(), d}, &L.k));
      DL_RETURN_IF_ERROR(need(p + "self_attn.v_proj.weight", {c.kv_width(), d}, &L.v));
    }
    if (fused && *fused != (qkv != nullptr)) {
      return InvalidArgument("DFlash checkpoint {}: some layers fuse qkv_proj and others do not", dir);
    }
    fused = qkv != nullptr;
    DL_RETURN_IF_ERROR(need(p + "self_attn.o_proj.weight", {d, c.q_width()}, &L.o));
    DL_RETURN_IF_ERROR(need(p + "self_attn.q_norm.weight", {D}, &L.q_norm));
    DL_RETURN_IF_ERROR(need(p + "self_attn.k_norm.weight", {D}, &L.k_norm));
    if (c.per_head_gate) DL_RETURN_IF_ERROR(need(p + "self_attn.g_proj.weight", {c.num_attention_heads, d}, &L.g));
    const TensorView* gu = take(p + "mlp.gate_up_proj.weight");
    if (gu && by_name.count(p + "mlp.gate_proj.weight")) {
      return InvalidArgument("DFlash layer {}: both gate_up_proj and gate_proj (fused and split)", l);
    }
    if (gu) {
      DL_RETURN_IF_ERROR(CheckShape(*gu, {2 * F, d}));
      L.gate = RowSlice(*gu, 0, F, "gate");
      L.up = RowSlice(*gu, F, F, "up");
    } else {
      DL_RETURN_IF_ERROR(need(p + "mlp.gate_proj.weight", {F, d}, &L.gate));
      DL_RETURN_IF_ERROR(need(p + "mlp.up_proj.weight", {F, d}, &L.up));
    }
    DL_RETURN_IF_ERROR(need(p + "mlp.down_proj.weight", {d, F}, &L.down));
    w.layers.push_back(std::move(L));
  }
  ck.fused_qkv_ = fused.value_or(false);
  for (const auto& [name, view] : by_name) {
    if (used.count(name)) continue;
    if (name == "embed_tokens.weight" || name == "lm_head.weight") {
      return Unimplemented("DFlash checkpoint {}: tensor '{}': this engine's drafters use the target's embedding and "
                           "LM head, not their own", dir, view.name);
    }
    return InvalidArgument("DFlash checkpoint {}: unexpected tensor '{}' for a {} drafter", dir, view.name,
                           DflashFamilyName(c.family));
  }
  return ck;
}

// ---- synthetic drafters ----

DflashConfig DflashConfigFor(const ModelConfig& t, int64_t num_draft_layers, int64_t block_size,
                             DflashFamily family) {
  DflashConfig c;
  c.family = DflashFamily::kLaguna;
  c.model_type = "laguna";
  c.hidden_size = t.hidden_size;
  c.intermediate_size = t.intermediate_size > 0 ? t.intermediate_size : 4 * t.hidden_size;
  c.num_hidden_layers = num_draft_layers;
  // The heads of the target's sliding layers where it has any, as Poolside's drafters (XS.2's has the
  // 64 query heads of XS.2's sliding layers, S 2.1's the 72 of S 2.1's), so its attention has the
  // sliding layers' preset.
  c.num_attention_heads = t.num_attention_heads;
  for (size_t l = 0; l < t.layer_types.size() && l < t.num_attention_heads_per_layer.size(); ++l) {
    if (t.layer_types[l] == LayerType::kSliding) {
      c.num_attention_heads = t.num_attention_heads_per_layer[l];
      break;
    }
  }
  c.num_key_value_heads = t.num_key_value_heads;
  c.head_dim = t.head_dim;
  c.rms_norm_eps = t.rms_norm_eps;
  c.rope_theta = 500000.0;
  c.max_position_embeddings = t.max_position_embeddings;
  c.vocab_size = t.vocab_size;
  // As Poolside's drafters: every layer sliding with a window, causal blocks.
  c.layer_types.assign(static_cast<size_t>(num_draft_layers), LayerType::kSliding);
  c.sliding_window = t.sliding_window > 0 ? std::max<int64_t>(t.sliding_window, 2 * block_size) : 512;
  c.block_causal.assign(static_cast<size_t>(num_draft_layers), true);
  c.per_head_gate = true;
  c.context_input_norm = true;
  c.aux_hidden_norms = true;
  c.block_size = block_size;
  c.mask_token_id = std::min<int64_t>(12, t.vocab_size - 1);
  c.num_target_layers = t.num_hidden_layers;
  // Taps spread over the target, ending at its last layer (as the Laguna drafters do).
  const int64_t L = t.num_hidden_layers, n = std::min<int64_t>(L, std::max<int64_t>(2, num_draft_layers));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = n == 1 ? L - 1 : (1 + i * (L - 2) / (n - 1));
    if (c.target_layer_ids.empty() || id > c.target_layer_ids.back()) c.target_layer_ids.push_back(std::min(id, L - 1));
  }
  if (family == DflashFamily::kZlab) {
    c.family = DflashFamily::kZlab;
    c.model_type = "qwen3";
    c.per_head_gate = c.context_input_norm = c.aux_hidden_norms = false;
    c.layer_types.assign(c.layer_types.size(), LayerType::kFull);
    c.block_causal.assign(c.block_causal.size(), false);
  }
  return c;
}

Status WriteSyntheticDflash(const WriteDflashOptions& o) {
  const DflashConfig& c = o.config;
  if (fs::exists(o.out_dir) && !fs::is_empty(o.out_dir)) {
    return FailedPrecondition("{} exists and is not empty", o.out_dir);
  }
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec) return Internal("creating {}: {}", o.out_dir, ec.message());
  struct Spec {
    std::string name;
    std::vector<int64_t> shape;
    TensorKind kind;
    int64_t fan_in;
  };
  std::vector<Spec> specs;
  const int64_t d = c.hidden_size, F = c.intermediate_size, D = c.head_dim;
  const std::string pre = o.vllm_names ? "model." : "";
  const int64_t base = o.vllm_names ? c.num_target_layers : 0;
  specs.push_back({pre + "fc.weight", {d, c.num_taps() * d}, TensorKind::kLinear, c.num_taps() * d});
  specs.push_back({pre + "hidden_norm.weight", {d}, TensorKind::kNorm, 1});
  if (c.aux_hidden_norms) {
    for (int64_t i = 0; i < c.num_taps(); ++i) {
      specs.push_back({fmt::format("{}aux_hidden_norms.{}.weight", pre, i), {d}, TensorKind::kNorm, 1});
    }
  }
  const bool fused = o.layout == DflashLayout::kPoolside;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = fmt::format("{}layers.{}.", pre, base + l);
    specs.push_back({p + "input_layernorm.weight", {d}, TensorKind::kNorm, 1});
    if (fused) {
      specs.push_back({p + "self_attn.qkv_proj.weight", {c.q_width() + 2 * c.kv_width(), d}, TensorKind::kLinear, d});
    } else {
      specs.push_back({p + "self_attn.q_proj.weight", {c.q_width(), d}, TensorKind::kLinear, d});
      specs.push_back({p + "self_attn.k_proj.weight", {c.kv_width(), d}, TensorKind::kLinear, d});
      specs.push_back({p + "self_attn.v_proj.weight", {c.kv_width(), d}, TensorKind::kLinear, d});
    }
    if (c.per_head_gate) specs.push_back({p + "self_attn.g_proj.weight", {c.num_attention_heads, d}, TensorKind::kLinear, d});
    specs.push_back({p + "self_attn.o_proj.weight", {d, c.q_width()}, TensorKind::kLinear, c.q_width()});
    specs.push_back({p + "self_attn.q_norm.weight", {D}, TensorKind::kNorm, 1});
    specs.push_back({p + "self_attn.k_norm.weight", {D}, TensorKind::kNorm, 1});
    specs.push_back({p + "post_attention_layernorm.weight", {d}, TensorKind::kNorm, 1});
    if (fused) {
      specs.push_back({p + "mlp.gate_up_proj.weight", {2 * F, d}, TensorKind::kLinear, d});
    } else {
      specs.push_back({p + "mlp.gate_proj.weight", {F, d}, TensorKind::kLinear, d});
      specs.push_back({p + "mlp.up_proj.weight", {F, d}, TensorKind::kLinear, d});
    }
    specs.push_back({p + "mlp.down_proj.weight", {d, F}, TensorKind::kLinear, F});
  }
  specs.push_back({pre + "norm.weight", {d}, TensorKind::kNorm, 1});

  std::vector<SafetensorsEntry> entries;
  std::vector<std::vector<uint16_t>> buffers;
  std::vector<const void*> data;
  std::vector<float> values;
  for (const Spec& s : specs) {
    SafetensorsEntry e;
    e.name = s.name;
    e.dtype = DType::kBF16;
    e.shape = s.shape;
    int64_t numel = 1;
    for (int64_t x : s.shape) numel *= x;
    values.resize(static_cast<size_t>(numel));
    GenerateTensorValues(o.seed, s.name, s.kind, s.fan_in, values.data(), 0, numel);
    std::vector<uint16_t> b(static_cast<size_t>(numel));
    for (int64_t i = 0; i < numel; ++i) b[i] = FloatToBf16(values[i]);
    buffers.push_back(std::move(b));
    entries.push_back(std::move(e));
  }
  for (const auto& b : buffers) data.push_back(b.data());
  DL_RETURN_IF_ERROR(WriteSafetensorsFile((fs::path(o.out_dir) / "model.safetensors").string(), entries, data));
  std::ofstream f(fs::path(o.out_dir) / "config.json");
  f << c.ToJson().dump(2) << "\n";
  if (!f) return Internal("writing {}/config.json", o.out_dir);
  return Status::Ok();
}

}  // namespace dl
