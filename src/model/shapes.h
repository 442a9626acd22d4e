// Built-in model shapes for `make-model --shape`, `inspect --shape` and `bench/serve --shape`:
// "tiny" (spec §7, exercises every feature), "xs2" (Laguna-XS.2) and "s21" (Laguna S 2.1, the 1M
// RoPE configuration).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "model/config.h"

namespace dl {

// The names ShapeConfig accepts.
std::vector<std::string> ShapeNames();

// The config of a named shape. `num_layers` keeps every dimension but only the first N layers
// (layer_types, mlp_layer_types and per-layer heads truncated); it must be in [1, L].
Result<ModelConfig> ShapeConfig(std::string_view shape, std::optional<int> num_layers = std::nullopt);

}  // namespace dl
