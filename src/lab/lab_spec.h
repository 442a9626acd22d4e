// Speculative decoding acceptance as a client measures it: vLLM's spec-decode counters read from a
// server's Prometheus text (`/metrics`) before and after a run, and their difference. Used by the
// lab (a run's acceptance in summary.json, the ledger and the report) and by `bench serve` (beside
// tok/s, under `vllm bench serve`'s result keys). The counters are vLLM's
// (vllm/v1/spec_decode/metrics.py), so the same reader works against a vLLM server.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dl::lab {

// One snapshot of the counters. Samples of one counter with several label sets (vLLM labels each
// engine) are summed; per-position samples are indexed by their `position` label.
struct SpecCounters {
  bool present = false;  // the text has vllm:spec_decode_num_drafts (speculation is on there)
  double num_drafts = 0;
  double num_draft_tokens = 0;
  double num_accepted_tokens = 0;
  std::vector<double> accepted_per_pos;  // [i]: drafts whose tokens 0..i were all accepted
};

// Reads the counters from Prometheus text exposition. Accepts the names with or without the
// `_total` suffix (prometheus_client's text has `_total`; its metric family name has not). Lines it
// does not know are ignored; a malformed value line of a known counter is skipped.
SpecCounters ParseSpecCounters(const std::string& prometheus_text);

// The counters accumulated between two snapshots.
struct SpecDelta {
  bool enabled = false;  // the server exported the counters (both snapshots)
  double num_drafts = 0, num_draft_tokens = 0, num_accepted_tokens = 0;
  std::vector<double> accepted_per_pos;

  // 1 + accepted / drafts: tokens per verify, bonus included (vLLM's mean acceptance length);
  // 0 without drafts.
  double mean_acceptance_length() const;
  double acceptance_rate() const;  // accepted / drafted, 0..1; 0 without draft tokens
  // accepted_per_pos[i] / drafts, 0..1; empty without drafts.
  std::vector<double> per_position_acceptance_rate() const;

  // `vllm bench serve`'s result keys: spec_decode_acceptance_rate (percent),
  // spec_decode_acceptance_length, spec_decode_num_drafts, spec_decode_draft_tokens,
  // spec_decode_accepted_tokens, spec_decode_per_position_acceptance_rates (fractions). Null
  // values where there were no drafts.
  nlohmann::json ToBenchServeJson() const;
  // The lab's summary block: the counters under their /metrics names (vllm:..._total), and
  // mean_acceptance_length, acceptance_rate, per_position_acceptance_rate (null without drafts).
  nlohmann::json ToCountersJson() const;
};

// after - before. Not enabled unless both snapshots carry the counters. A counter that went down
// (the server restarted between the snapshots) gives the after value alone, as Prometheus' rate()
// treats a reset.
SpecDelta SpecDifference(const SpecCounters& before, const SpecCounters& after);

// The block `vllm bench serve` prints after its latency sections (one line per position), from a
// result holding SpecDelta::ToBenchServeJson's keys; empty when it has none (no speculation).
std::string FormatSpecBlock(const nlohmann::json& bench_serve_result);

}  // namespace dl::lab
