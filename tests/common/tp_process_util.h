// Helpers of the tests that run tensor-parallel ranks as child processes (`--tp-transport processes`),
// on the CPU (tests/reference/tp_processes_cpu_test.cc) and on CUDA (tests/gpu/cuda_tp_gpu_test.cc).
#pragma once

#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "comm/process.h"
#include "engine/engine.h"

namespace dl::test_util {

inline void ExpectContains(const std::string& text, const std::string& needle) {
  EXPECT_NE(text.find(needle), std::string::npos) << "'" << needle << "' not in: " << text;
}

// Every pid gone: not running, not a zombie, and reaped by us (waitpid finds no such child).
inline void ExpectGone(const std::vector<pid_t>& pids) {
  for (pid_t pid : pids) {
    EXPECT_FALSE(comm::ProcessExists(pid)) << "rank process " << pid << " still exists (orphan or zombie)";
    int status = 0;
    EXPECT_EQ(::waitpid(pid, &status, WNOHANG), -1) << "rank process " << pid << " was not reaped";
  }
}

// The child ranks' pids of an engine whose runner is a `Runner` (CpuTpRunner or CudaTpRunner) with
// ranks as processes: rank_pids() without rank 0 (this process).
template <typename Runner>
std::vector<pid_t> ChildPids(Engine& e) {
  std::vector<pid_t> pids = dynamic_cast<Runner&>(*e.runner).rank_pids();
  if (!pids.empty()) pids.erase(pids.begin());
  return pids;
}

// One prefill forward of `prompt` as a fresh sequence, its pages released after.
inline Status ForwardOnce(Engine& e, const std::vector<int32_t>& prompt) {
  SequenceKv seq;
  DL_RETURN_IF_ERROR(e.kv->Reserve(seq, static_cast<int32_t>(prompt.size())));
  ForwardBatch batch;
  batch.mode = ForwardMode::kPrefill;
  batch.AddSequence(seq, prompt);
  batch.AddOutput(static_cast<int32_t>(prompt.size()) - 1);
  ForwardResult result;
  Status st = e.runner->Forward(batch, &result);
  DL_RETURN_IF_ERROR(e.kv->Release(seq));
  return st;
}

// A group of two with its child `pids[0]` killed (SIGKILL) after one good forward: the next forward
// fails naming rank 1 and how it ended, the child is reaped at once, later forwards are refused, and
// destroying the engine leaves no process. Returns the failing forward's seconds.
inline double ExpectAKilledChildEndsTheGroup(std::unique_ptr<Engine>& e, const std::vector<pid_t>& pids) {
  EXPECT_EQ(pids.size(), 1u);
  if (pids.size() != 1) return 0;
  EXPECT_TRUE(ForwardOnce(*e, {3, 4, 5, 6}).ok());
  EXPECT_EQ(::kill(pids[0], SIGKILL), 0);
  const auto t0 = std::chrono::steady_clock::now();
  const Status st = ForwardOnce(*e, {3, 4, 5, 6});
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_FALSE(st.ok());
  std::printf("[tp-processes] after %.2f s: %s\n", s, st.message().c_str());
  ExpectContains(st.message(), "tensor-parallel group of 2 ended");
  ExpectContains(st.message(), fmt::format("rank 1: UNAVAILABLE: process {} ended (killed by signal 9", pids[0]));
  ExpectGone(pids);
  const Status again = ForwardOnce(*e, {3, 4, 5, 6});
  EXPECT_FALSE(again.ok());
  ExpectContains(again.message(), "tensor-parallel group of 2 ended");
  e.reset();
  ExpectGone(pids);
  return s;
}

}  // namespace dl::test_util
