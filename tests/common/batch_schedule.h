// Batch invariance harness: sequences run through a ModelRunner alone (prefill in fixed chunks, then one
// decode row per step) or together under a random schedule (random arrivals, random subsets of the
// running sequences per step, random prefill chunk sizes under a per-step row budget). A sequence's
// tokens and the logits of every row that produced one must come out bit-identical either way: that is
// the engine's exactness promise (docs/exactness.md). Used by the CPU test and the GPU test alike.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace dl::testing_batch {

struct SeqTrace {
  std::vector<int32_t> tokens;               // generated
  std::vector<std::vector<float>> logits;    // the logits each token was chosen from
};

// How sequence i samples: greedy for even i, seeded top-k/top-p sampling for odd i.
inline RowSampling SamplingFor(size_t i, int32_t step) {
  RowSampling s;
  if (i % 2 == 1) {
    s.temperature = 0.8f;
    s.top_k = 40;
    s.top_p = 0.9f;
    s.key = 0x5eed0000 + i;
  }
  s.step = static_cast<uint64_t>(step);
  return s;
}

struct SchedSeq {
  std::vector<int32_t> context;  // prompt + generated
  int32_t prompt_length = 0;     // BatchSequence::prompt_length: the rows' class (prompt or generated)
  SequenceKv kv;
  SeqTrace trace;
  int arrival = 0;
  bool done = false;
};

// One forward over `rows` (sequence index, row count) of `seqs`; commits and appends sampled tokens.
inline Status Step(Engine& e, std::vector<SchedSeq>& seqs, const std::vector<std::pair<size_t, int32_t>>& rows,
                   int32_t steps) {
  ForwardBatch b;
  std::vector<int> out_of;  // output index -> sequence index
  for (auto [i, n] : rows) {
    SchedSeq& s = seqs[i];
    DL_RETURN_IF_ERROR(e.kv->Reserve(s.kv, n));
    const int32_t first = b.AddSequence(
        s.kv, std::span<const int32_t>(s.context.data() + s.kv.length(), static_cast<size_t>(n)), s.prompt_length);
    if (s.kv.length() + n == static_cast<int32_t>(s.context.size())) {
      OutputRequest& o = b.AddOutput(first + n - 1);
      o.sampling = SamplingFor(i, static_cast<int32_t>(s.trace.tokens.size()));
      o.want_logits = true;
      out_of.push_back(static_cast<int>(i));
    }
  }
  b.mode = ForwardMode::kPrefill;
  ForwardResult r;
  DL_RETURN_IF_ERROR(e.runner->Forward(b, &r));
  for (auto [i, n] : rows) DL_RETURN_IF_ERROR(e.kv->Commit(seqs[i].kv, n));
  for (size_t o = 0; o < out_of.size(); ++o) {
    SchedSeq& s = seqs[out_of[o]];
    if (!r.rows[o].finite) return DataLoss("non-finite logits");
    s.trace.tokens.push_back(r.rows[o].token);
    s.trace.logits.push_back(std::move(r.rows[o].logits));
    s.context.push_back(r.rows[o].token);
    if (static_cast<int32_t>(s.trace.tokens.size()) == steps) {
      s.done = true;
      DL_RETURN_IF_ERROR(e.kv->Release(s.kv));
    }
  }
  return Status::Ok();
}

// Sequence `index` of a schedule alone: prefill chunks of `chunk`, then decode rows.
inline Result<SeqTrace> RunAlone(Engine& e, const std::vector<int32_t>& prompt, size_t index, int32_t steps,
                                 int32_t chunk) {
  std::vector<SchedSeq> seqs(index + 1);
  SchedSeq& s = seqs[index];
  s.context = prompt;
  s.prompt_length = static_cast<int32_t>(prompt.size());
  while (!s.done) {
    const int32_t remaining = static_cast<int32_t>(s.context.size()) - s.kv.length();
    DL_RETURN_IF_ERROR(Step(e, seqs, {{index, std::min(remaining, chunk)}}, steps));
  }
  return s.trace;
}

// Every prompt together: sequence i arrives at a random step, each step takes a random subset of the
// arrived sequences, prefill chunks are random in [1, 64], and a step holds at most `max_rows` rows.
inline Result<std::vector<SeqTrace>> RunRandomSchedule(Engine& e, const std::vector<std::vector<int32_t>>& prompts,
                                                       int32_t steps, uint64_t seed, int32_t max_rows) {
  std::mt19937_64 rng(seed);
  std::vector<SchedSeq> seqs(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    seqs[i].context = prompts[i];
    seqs[i].prompt_length = static_cast<int32_t>(prompts[i].size());
    seqs[i].arrival = static_cast<int>(rng() % 12);
  }
  for (int step = 0; step < 100000; ++step) {
    std::vector<size_t> live;
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (!seqs[i].done && seqs[i].arrival <= step) live.push_back(i);
    }
    bool all_done = true;
    for (const SchedSeq& s : seqs) all_done = all_done && s.done;
    if (all_done) break;
    if (live.empty()) continue;
    std::shuffle(live.begin(), live.end(), rng);
    std::vector<std::pair<size_t, int32_t>> rows;
    int32_t budget = max_rows;
    for (size_t i : live) {
      if (rng() % 4 == 0 && !rows.empty()) continue;  // sits this step out
      const SchedSeq& s = seqs[i];
      const int32_t remaining = static_cast<int32_t>(s.context.size()) - s.kv.length();
      int32_t n = remaining == 1 ? 1 : 1 + static_cast<int32_t>(rng() % 64);
      n = std::min({n, remaining, budget});
      if (n <= 0) break;
      rows.emplace_back(i, n);
      budget -= n;
    }
    std::sort(rows.begin(), rows.end());  // any order works; sorted keeps failures reproducible
    DL_RETURN_IF_ERROR(Step(e, seqs, rows, steps));
  }
  std::vector<SeqTrace> out;
  for (SchedSeq& s : seqs) {
    if (!s.done) return Internal("schedule ended with a sequence unfinished");
    out.push_back(std::move(s.trace));
  }
  return out;
}

// "" when equal bit for bit, else what differs first.
inline std::string Compare(const SeqTrace& alone, const SeqTrace& together) {
  if (alone.tokens != together.tokens) return "tokens differ";
  for (size_t t = 0; t < alone.logits.size(); ++t) {
    if (alone.logits[t].size() != together.logits[t].size() ||
        std::memcmp(alone.logits[t].data(), together.logits[t].data(), alone.logits[t].size() * sizeof(float)) != 0) {
      return "logits differ at step " + std::to_string(t);
    }
  }
  return "";
}

}  // namespace dl::testing_batch
