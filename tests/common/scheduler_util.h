// Helpers for tests that drive the serving scheduler: the tiny synthetic model on the CPU reference,
// and a request's tokens collected until it finishes.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "engine/scheduler.h"

namespace dl::testing_scheduler {

// The tiny shape (seed 7) on the CPU backend, KV pools for `max_sequences` sequences.
inline std::unique_ptr<Engine> TinyCpuEngine(int32_t max_sequences, int32_t prefill_chunk = 16,
                                             int32_t max_seq_len = 256) {
  EngineOptions o;
  o.shape = "tiny";
  o.seed = 7;
  o.backend = BackendKind::kCpu;
  o.max_sequences = max_sequences;
  o.prefill_chunk = prefill_chunk;
  o.max_seq_len = max_seq_len;
  auto e = LoadEngine(o);
  EXPECT_TRUE(e.ok()) << e.status().message();
  return std::move(e).value();
}

struct Collected {
  std::vector<int32_t> tokens;
  std::vector<TokenEvent> events;
  RequestState::Update last;  // the final update (finish reason, error)
};

// Polls `st` until it finishes (or about 1,000 s pass) and returns what it produced.
inline Collected Drain(RequestState& st) {
  Collected c;
  for (int i = 0; i < 20000; ++i) {
    RequestState::Update u;
    st.Poll(&u, std::chrono::milliseconds(50));
    for (auto& e : u.tokens) {
      c.tokens.push_back(e.token);
      c.events.push_back(e);
    }
    if (u.finished) {
      c.last = u;
      break;
    }
  }
  return c;
}

// Submits every request at once, then collects each one's output in submission order (a request the
// scheduler refuses fails the test and is left out).
inline std::vector<Collected> SubmitAndDrain(Scheduler& sched, std::vector<GenerationRequest> requests) {
  std::vector<std::shared_ptr<RequestState>> states;
  for (GenerationRequest& r : requests) {
    auto st = sched.Submit(std::move(r));
    EXPECT_TRUE(st.ok()) << st.status().message();
    if (st.ok()) states.push_back(*st);
  }
  std::vector<Collected> out;
  for (auto& st : states) out.push_back(Drain(*st));
  return out;
}


// 0, 1, ..., n - 1.
inline std::vector<size_t> AllIndices(size_t n) {
  std::vector<size_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

// Requests for prompts[i], i in `which`: `max_tokens` tokens, end-of-sequence ignored, 2 logprobs;
// greedy for even i, seeded sampling for odd i (temperature 0.8, top-k 50, seed 100 + i). The mixed
// batch the GPU speculative and tensor-parallel tests compare runs with.
inline std::vector<GenerationRequest> MixedSamplingRequests(const std::vector<std::vector<int32_t>>& prompts,
                                                            const std::vector<size_t>& which, int32_t max_tokens) {
  std::vector<GenerationRequest> requests;
  for (size_t i : which) {
    GenerationRequest& r = requests.emplace_back();
    r.prompt = prompts[i];
    r.sampling.max_tokens = max_tokens;
    r.sampling.ignore_eos = true;
    r.sampling.logprobs = 2;
    if (i % 2 == 1) {
      r.sampling.temperature = 0.8f;
      r.sampling.top_k = 50;
      r.sampling.seed = 100 + i;
    }
  }
  return requests;
}

// SubmitAndDrain's outputs as (token, logprob) per event, per request in submission order.
inline std::vector<std::vector<std::pair<int32_t, float>>> SubmitAndDrainLogprobs(Scheduler& sched,
                                                                                   std::vector<GenerationRequest> requests) {
  std::vector<std::vector<std::pair<int32_t, float>>> out;
  for (const Collected& c : SubmitAndDrain(sched, std::move(requests))) {
    std::vector<std::pair<int32_t, float>> events;
    for (const TokenEvent& e : c.events) events.emplace_back(e.token, e.logprob);
    out.push_back(std::move(events));
  }
  return out;
}

}  // namespace dl::testing_scheduler
