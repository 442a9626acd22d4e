// Helpers for tests that drive the serving scheduler: the tiny synthetic model on the CPU reference,
// and a request's tokens collected until it finishes.
#pragma once

#include <chrono>
#include <memory>
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

}  // namespace dl::testing_scheduler
