#include "lab/lab_spec.h"

#include <charconv>
#include <cmath>
#include <map>
#include <optional>
#include <sstream>

#include <fmt/format.h>

namespace dl::lab {

using nlohmann::json;

namespace {

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// One sample line of the text format: `name{k="v",...} value [timestamp]` or `name value`.
// nullopt for comments, blank and malformed lines.
std::optional<Sample> ParseSampleLine(const std::string& line) {
  size_t i = 0;
  while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
  if (i >= line.size() || line[i] == '#') return std::nullopt;
  Sample s;
  const size_t name_start = i;
  while (i < line.size() && line[i] != '{' && line[i] != ' ' && line[i] != '\t') ++i;
  s.name = line.substr(name_start, i - name_start);
  if (s.name.empty()) return std::nullopt;
  if (i < line.size() && line[i] == '{') {
    ++i;
    while (true) {
      while (i < line.size() && (line[i] == ' ' || line[i] == ',')) ++i;
      if (i >= line.size()) return std::nullopt;
      if (line[i] == '}') {
        ++i;
        break;
      }
      const size_t eq = line.find('=', i);
      if (eq == std::string::npos || eq + 1 >= line.size() || line[eq + 1] != '"')
        return std::nullopt;
      std::string key = line.substr(i, eq - i);
      std::string value;
      size_t j = eq + 2;
      bool closed = false;
      for (; j < line.size(); ++j) {
        if (line[j] == '\\' && j + 1 < line.size()) {
          const char e = line[++j];
          value += e == 'n' ? '\n' : e;
        } else if (line[j] == '"') {
          closed = true;
          break;
        } else {
          value += line[j];
        }
      }
      if (!closed) return std::nullopt;
      s.labels[key] = value;
      i = j + 1;
    }
  }
  while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
  size_t end = i;
  while (end < line.size() && line[end] != ' ' && line[end] != '\t') ++end;
  const std::string v = line.substr(i, end - i);
  if (v.empty()) return std::nullopt;
  double d = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), d);
  if (ec != std::errc() || p != v.data() + v.size() || !std::isfinite(d)) return std::nullopt;
  s.value = d;
  return s;
}

// "vllm:spec_decode_num_drafts" and "vllm:spec_decode_num_drafts_total" are the same counter.
std::string Family(const std::string& name) {
  constexpr std::string_view kTotal = "_total";
  if (name.size() > kTotal.size() &&
      name.compare(name.size() - kTotal.size(), kTotal.size(), kTotal) == 0) {
    return name.substr(0, name.size() - kTotal.size());
  }
  return name;
}

json NullIfNoDrafts(const SpecDelta& d, double v) {
  return d.num_drafts > 0 ? json(v) : json(nullptr);
}

}  // namespace

SpecCounters ParseSpecCounters(const std::string& text) {
  SpecCounters c;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    auto s = ParseSampleLine(line);
    if (!s) continue;
    const std::string f = Family(s->name);
    if (f == "vllm:spec_decode_num_drafts") {
      c.present = true;
      c.num_drafts += s->value;
    } else if (f == "vllm:spec_decode_num_draft_tokens") {
      c.num_draft_tokens += s->value;
    } else if (f == "vllm:spec_decode_num_accepted_tokens") {
      c.num_accepted_tokens += s->value;
    } else if (f == "vllm:spec_decode_num_accepted_tokens_per_pos") {
      auto it = s->labels.find("position");
      if (it == s->labels.end()) continue;
      int pos = -1;
      auto [p, ec] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), pos);
      if (ec != std::errc() || p != it->second.data() + it->second.size() || pos < 0 || pos > 4096)
        continue;
      if (static_cast<size_t>(pos) >= c.accepted_per_pos.size())
        c.accepted_per_pos.resize(pos + 1, 0.0);
      c.accepted_per_pos[pos] += s->value;
    }
  }
  return c;
}

SpecDelta SpecDifference(const SpecCounters& before, const SpecCounters& after) {
  SpecDelta d;
  d.enabled = before.present && after.present;
  if (!d.enabled) return d;
  auto diff = [](double b, double a) { return a >= b ? a - b : a; };
  d.num_drafts = diff(before.num_drafts, after.num_drafts);
  d.num_draft_tokens = diff(before.num_draft_tokens, after.num_draft_tokens);
  d.num_accepted_tokens = diff(before.num_accepted_tokens, after.num_accepted_tokens);
  d.accepted_per_pos.resize(after.accepted_per_pos.size(), 0.0);
  for (size_t i = 0; i < after.accepted_per_pos.size(); ++i) {
    const double b = i < before.accepted_per_pos.size() ? before.accepted_per_pos[i] : 0.0;
    d.accepted_per_pos[i] = diff(b, after.accepted_per_pos[i]);
  }
  return d;
}

double SpecDelta::mean_acceptance_length() const {
  return num_drafts > 0 ? 1.0 + num_accepted_tokens / num_drafts : 0.0;
}

double SpecDelta::acceptance_rate() const {
  return num_draft_tokens > 0 ? num_accepted_tokens / num_draft_tokens : 0.0;
}

std::vector<double> SpecDelta::per_position_acceptance_rate() const {
  std::vector<double> r;
  if (num_drafts <= 0) return r;
  for (double a : accepted_per_pos) r.push_back(a / num_drafts);
  return r;
}

json SpecDelta::ToBenchServeJson() const {
  return {{"spec_decode_acceptance_rate", NullIfNoDrafts(*this, 100.0 * acceptance_rate())},
          {"spec_decode_acceptance_length", NullIfNoDrafts(*this, mean_acceptance_length())},
          {"spec_decode_num_drafts", static_cast<int64_t>(num_drafts)},
          {"spec_decode_draft_tokens", static_cast<int64_t>(num_draft_tokens)},
          {"spec_decode_accepted_tokens", static_cast<int64_t>(num_accepted_tokens)},
          {"spec_decode_per_position_acceptance_rates",
           num_drafts > 0 ? json(per_position_acceptance_rate()) : json(nullptr)}};
}

json SpecDelta::ToCountersJson() const {
  json per_pos = json::array();
  for (double a : accepted_per_pos) per_pos.push_back(static_cast<int64_t>(a));
  return {{"vllm:spec_decode_num_drafts_total", static_cast<int64_t>(num_drafts)},
          {"vllm:spec_decode_num_draft_tokens_total", static_cast<int64_t>(num_draft_tokens)},
          {"vllm:spec_decode_num_accepted_tokens_total", static_cast<int64_t>(num_accepted_tokens)},
          {"vllm:spec_decode_num_accepted_tokens_per_pos_total", per_pos},
          {"mean_acceptance_length", NullIfNoDrafts(*this, mean_acceptance_length())},
          {"acceptance_rate", NullIfNoDrafts(*this, acceptance_rate())},
          {"per_position_acceptance_rate",
           num_drafts > 0 ? json(per_position_acceptance_rate()) : json(nullptr)}};
}

std::string FormatSpecBlock(const json& r) {
  if (!r.is_object() || !r.contains("spec_decode_num_drafts")) return "";
  std::string s = "---------------Speculative Decoding---------------\n";
  auto line = [&](const std::string& label, const std::string& value) {
    s += fmt::format("{:<40}{}\n", label, value);
  };
  auto num = [&](const char* key) {
    const json v = r.value(key, json());
    return v.is_number() ? fmt::format("{:.2f}", v.get<double>()) : std::string("-");
  };
  auto count = [&](const char* key) {
    const json v = r.value(key, json());
    return v.is_number() ? fmt::format("{}", v.get<int64_t>()) : std::string("-");
  };
  line("Acceptance rate (%):", num("spec_decode_acceptance_rate"));
  line("Acceptance length:", num("spec_decode_acceptance_length"));
  line("Drafts:", count("spec_decode_num_drafts"));
  line("Draft tokens:", count("spec_decode_draft_tokens"));
  line("Accepted tokens:", count("spec_decode_accepted_tokens"));
  const json rates = r.value("spec_decode_per_position_acceptance_rates", json());
  if (rates.is_array()) {
    s += "Per-position acceptance (%):\n";
    for (size_t i = 0; i < rates.size(); ++i) {
      line(fmt::format("  Position {}:", i),
           rates[i].is_number() ? fmt::format("{:.2f}", 100.0 * rates[i].get<double>()) : "-");
    }
  }
  return s;
}

}  // namespace dl::lab
