#include "model/quantization.h"

#include <algorithm>
#include <regex>

namespace dl {

namespace {

using nlohmann::json;

std::string Show(const json& v) {
  return v.dump();
}

// Every key of `o` must be in `known`; `where` names the object in messages.
Status OnlyKnownKeys(const json& o, std::initializer_list<const char*> known,
                     const std::string& where) {
  for (auto it = o.begin(); it != o.end(); ++it) {
    if (std::none_of(known.begin(), known.end(), [&](const char* k) { return it.key() == k; })) {
      return InvalidArgument(
          "{}: unknown key '{}' = {} (known: {}); refusing rather than ignoring it", where,
          it.key(), Show(*it), fmt::join(known, ", "));
    }
  }
  return Status::Ok();
}

bool IsNullOrEmpty(const json& v) {
  return v.is_null() || (v.is_object() && v.empty()) || (v.is_array() && v.empty());
}

Status ReadStringList(const json& v, const std::string& where, std::vector<std::string>* out) {
  if (v.is_null()) return Status::Ok();
  if (!v.is_array())
    return InvalidArgument("{} must be a list of module names, got {}", where, Show(v));
  for (const json& e : v) {
    if (!e.is_string())
      return InvalidArgument("{} must be a list of module names, got the entry {}", where, Show(e));
    out->push_back(e.get<std::string>());
  }
  return Status::Ok();
}

// `key` of `o` must be absent, null or one of `allowed` (JSON values).
Status OneOf(const json& o, const char* key, std::initializer_list<json> allowed,
             const std::string& where) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return Status::Ok();
  for (const json& a : allowed) {
    if (*it == a) return Status::Ok();
  }
  return Unimplemented("{}.{} = {} is not supported (supported: {})", where, key, Show(*it),
                       Show(json(allowed)));
}

Status ParseNative(const json& q, WeightQuantization* w) {
  const std::string where = "quantization_config (quant_method \"fp8\")";
  DL_RETURN_IF_ERROR(
      OnlyKnownKeys(q,
                    {"quant_method", "activation_scheme", "weight_block_size",
                     "modules_to_not_convert", "ignored_layers", "fmt", "scale_fmt", "dequantize"},
                    where));
  w->format = WeightQuantFormat::kFp8Native;
  // Dynamic activation scaling is what other engines do at run time; this engine keeps activations
  // unquantised (docs/fp8.md). Static activation scales would be input_scale tensors we would
  // ignore.
  if (auto it = q.find("activation_scheme"); it != q.end() && !it->is_null()) {
    if (!it->is_string() ||
        (it->get<std::string>() != "dynamic" && it->get<std::string>() != "DYNAMIC")) {
      return Unimplemented(
          "{}: activation_scheme {} is not supported (only \"dynamic\": static activation scales "
          "are not implemented)",
          where, Show(*it));
    }
  }
  DL_RETURN_IF_ERROR(OneOf(q, "fmt", {"e4m3"}, where));
  DL_RETURN_IF_ERROR(OneOf(q, "scale_fmt", {"float"}, where));
  if (auto it = q.find("dequantize"); it != q.end() && !it->is_null() && !it->is_boolean()) {
    return InvalidArgument("{}: dequantize must be true or false, got {}", where, Show(*it));
  }
  auto bs = q.find("weight_block_size");
  if (bs == q.end()) {
    // transformers' FineGrainedFP8Config default.
    w->granularity = Fp8Granularity::kBlock;
    w->block_rows = w->block_cols = 128;
  } else if (bs->is_null()) {
    w->granularity = Fp8Granularity::kTensor;  // transformers: one block covering the matrix
  } else {
    if (!bs->is_array() || bs->size() != 2 || !(*bs)[0].is_number_integer() ||
        !(*bs)[1].is_number_integer() || (*bs)[0].get<int64_t>() <= 0 ||
        (*bs)[1].get<int64_t>() <= 0) {
      return InvalidArgument("{}: weight_block_size must be two positive integers, got {}", where,
                             Show(*bs));
    }
    w->granularity = Fp8Granularity::kBlock;
    w->block_rows = (*bs)[0].get<int64_t>();
    w->block_cols = (*bs)[1].get<int64_t>();
  }
  const bool has_mtnc =
      q.contains("modules_to_not_convert") && !q["modules_to_not_convert"].is_null();
  const bool has_ignored = q.contains("ignored_layers") && !q["ignored_layers"].is_null();
  if (has_mtnc && has_ignored && q["modules_to_not_convert"] != q["ignored_layers"]) {
    return InvalidArgument(
        "{}: modules_to_not_convert and ignored_layers are both given and differ", where);
  }
  if (has_mtnc)
    DL_RETURN_IF_ERROR(
        ReadStringList(q["modules_to_not_convert"], where + ".modules_to_not_convert", &w->ignore));
  else if (has_ignored)
    DL_RETURN_IF_ERROR(ReadStringList(q["ignored_layers"], where + ".ignored_layers", &w->ignore));
  return Status::Ok();
}

// One compressed-tensors quantisation args object ("weights" / "input_activations").
Status CheckArgs(const json& a, const std::string& where) {
  if (!a.is_object()) return InvalidArgument("{} must be an object, got {}", where, Show(a));
  DL_RETURN_IF_ERROR(OnlyKnownKeys(
      a,
      {"num_bits", "type", "symmetric", "dynamic", "strategy", "block_structure", "group_size",
       "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"},
      where));
  DL_RETURN_IF_ERROR(OneOf(a, "num_bits", {8}, where));
  DL_RETURN_IF_ERROR(OneOf(a, "type", {"float"}, where));
  DL_RETURN_IF_ERROR(OneOf(a, "symmetric", {true}, where));
  DL_RETURN_IF_ERROR(OneOf(a, "actorder", {false}, where));
  // FP32 scales only (the contract); a declared other scale dtype would be read wrongly.
  DL_RETURN_IF_ERROR(OneOf(a, "scale_dtype", {"torch.float32", "float32"}, where));
  return Status::Ok();
}

Status ParseCompressedTensors(const json& q, WeightQuantization* w, bool* quantizes_weights) {
  const std::string where = "quantization_config (quant_method \"compressed-tensors\")";
  DL_RETURN_IF_ERROR(
      OnlyKnownKeys(q,
                    {"quant_method", "format", "config_groups", "ignore", "kv_cache_scheme",
                     "quantization_status", "sparsity_config", "transform_config",
                     "global_compression_ratio", "version", "provider"},
                    where));
  if (auto it = q.find("sparsity_config"); it != q.end() && !IsNullOrEmpty(*it)) {
    return Unimplemented("{}: sparsity_config {} is not supported", where, Show(*it));
  }
  if (auto it = q.find("transform_config"); it != q.end() && !IsNullOrEmpty(*it)) {
    return Unimplemented(
        "{}: transform_config {} (e.g. a Hadamard rotation folded into the weights) is not "
        "supported",
        where, Show(*it));
  }
  DL_RETURN_IF_ERROR(OneOf(q, "quantization_status", {"compressed", "frozen"}, where));
  if (auto it = q.find("kv_cache_scheme"); it != q.end() && !it->is_null()) {
    DL_RETURN_IF_ERROR(CheckArgs(*it, where + ".kv_cache_scheme"));
    DL_RETURN_IF_ERROR(OneOf(*it, "strategy", {"tensor"}, where + ".kv_cache_scheme"));
    DL_RETURN_IF_ERROR(OneOf(*it, "dynamic", {false}, where + ".kv_cache_scheme"));
  }
  auto groups = q.find("config_groups");
  if (groups == q.end() || IsNullOrEmpty(*groups)) {
    *quantizes_weights = false;  // KV-cache scheme only: static k_scale / v_scale tensors
    return Status::Ok();
  }
  if (!groups->is_object())
    return InvalidArgument("{}: config_groups must be an object, got {}", where, Show(*groups));
  DL_RETURN_IF_ERROR(OneOf(q, "format", {"float-quantized"}, where));
  const json* weights = nullptr;
  for (auto g = groups->begin(); g != groups->end(); ++g) {
    const std::string gw = where + ".config_groups." + g.key();
    if (!g->is_object()) return InvalidArgument("{} must be an object, got {}", gw, Show(*g));
    DL_RETURN_IF_ERROR(OnlyKnownKeys(
        *g, {"targets", "weights", "input_activations", "output_activations", "format"}, gw));
    DL_RETURN_IF_ERROR(OneOf(*g, "format", {"float-quantized"}, gw));
    if (auto it = g->find("output_activations"); it != g->end() && !it->is_null()) {
      return Unimplemented("{}: output_activations {} are not supported", gw, Show(*it));
    }
    if (auto it = g->find("targets"); it == g->end() || !it->is_array()) {
      return InvalidArgument("{}: targets must be a list", gw);
    }
    auto wt = g->find("weights");
    if (wt == g->end() || wt->is_null())
      return Unimplemented("{}: a group without weights is not supported", gw);
    DL_RETURN_IF_ERROR(CheckArgs(*wt, gw + ".weights"));
    DL_RETURN_IF_ERROR(OneOf(*wt, "dynamic", {false}, gw + ".weights"));
    if (auto gs = wt->find("group_size"); gs != wt->end() && !gs->is_null()) {
      return Unimplemented(
          "{}.weights: group_size {} is not supported (FP8 weights: block, channel or tensor)", gw,
          Show(*gs));
    }
    if (weights != nullptr && *weights != *wt) {
      return Unimplemented("{}: groups with different weight schemes ({} vs {}) are not supported",
                           where, Show(*weights), Show(*wt));
    }
    weights = &*wt;
    if (auto ia = g->find("input_activations"); ia != g->end() && !ia->is_null()) {
      DL_RETURN_IF_ERROR(CheckArgs(*ia, gw + ".input_activations"));
      // Static activation scales would be input_scale tensors this engine does not apply.
      if (!ia->contains("dynamic") || (*ia)["dynamic"] != true) {
        return Unimplemented(
            "{}.input_activations: static activation quantisation (dynamic {}) is not supported",
            gw, ia->contains("dynamic") ? Show((*ia)["dynamic"]) : "absent");
      }
    }
  }
  const std::string ww = where + " weights";
  const std::string strategy = weights->value("strategy", std::string("tensor"));
  if (strategy == "block") {
    auto bs = weights->find("block_structure");
    if (bs == weights->end() || !bs->is_array() || bs->size() != 2 ||
        !(*bs)[0].is_number_integer() || !(*bs)[1].is_number_integer() ||
        (*bs)[0].get<int64_t>() <= 0 || (*bs)[1].get<int64_t>() <= 0) {
      return InvalidArgument(
          "{}: strategy \"block\" needs block_structure [rows, cols] of positive integers, got {}",
          ww, bs == weights->end() ? "none" : Show(*bs));
    }
    w->granularity = Fp8Granularity::kBlock;
    w->block_rows = (*bs)[0].get<int64_t>();
    w->block_cols = (*bs)[1].get<int64_t>();
  } else if (strategy == "channel") {
    w->granularity = Fp8Granularity::kChannel;
  } else if (strategy == "tensor") {
    w->granularity = Fp8Granularity::kTensor;
  } else {
    return Unimplemented("{}: strategy \"{}\" is not supported (block, channel or tensor)", ww,
                         strategy);
  }
  if (strategy != "block" && weights->contains("block_structure") &&
      !(*weights)["block_structure"].is_null()) {
    return InvalidArgument("{}: block_structure is given with strategy \"{}\"", ww, strategy);
  }
  w->format = WeightQuantFormat::kFp8CompressedTensors;
  *quantizes_weights = true;
  if (auto it = q.find("ignore"); it != q.end())
    DL_RETURN_IF_ERROR(ReadStringList(*it, where + ".ignore", &w->ignore));
  for (const std::string& e : w->ignore) {
    if (e.rfind("re:", 0) != 0) continue;
    try {
      std::regex r(e.substr(3));
    } catch (const std::regex_error& err) {
      return InvalidArgument("{}.ignore: pattern \"{}\" is not a valid regular expression: {}",
                             where, e, err.what());
    }
  }
  return Status::Ok();
}

}  // namespace

IgnoreMatcher::IgnoreMatcher(const std::vector<std::string>& entries) {
  for (const std::string& e : entries) {
    // Patterns were compiled once by ParseQuantizationConfig, so this cannot throw for a parsed
    // config.
    if (e.rfind("re:", 0) == 0) {
      patterns_.emplace_back(e.substr(3));
    } else {
      exact_.insert(e);
    }
  }
}

bool IgnoreMatcher::Matches(const std::string& module) const {
  for (size_t end = module.size(); end != std::string::npos && end > 0;
       end = module.rfind('.', end - 1)) {
    if (exact_.count(module.substr(0, end))) return true;
  }
  for (const std::regex& r : patterns_) {
    if (std::regex_search(module, r, std::regex_constants::match_continuous)) return true;
  }
  return false;
}

Status ParseQuantizationConfig(const nlohmann::json& q, WeightQuantization* out,
                               std::string* quant_method, bool* quantizes_weights) {
  if (!q.is_object())
    return InvalidArgument("quantization_config must be an object, got {}", Show(q));
  auto m = q.find("quant_method");
  if (m == q.end() || !m->is_string())
    return InvalidArgument("quantization_config has no quant_method string");
  *quant_method = m->get<std::string>();
  *out = WeightQuantization{};
  *quantizes_weights = true;
  if (*quant_method == "fp8") return ParseNative(q, out);
  if (*quant_method == "compressed-tensors")
    return ParseCompressedTensors(q, out, quantizes_weights);
  return Unimplemented(
      "quantization_config.quant_method \"{}\" is not supported (FP8 weights: \"fp8\" or "
      "\"compressed-tensors\" float-quantized)",
      *quant_method);
}

}  // namespace dl
