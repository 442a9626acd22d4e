// The work behind each probe stage, per transport. Internal to the probe (probe_rank.cc drives it;
// probe_nccl.cc and the sim transport in probe_rank.cc implement it). Every call is bounded by the
// deadline it is given and returns kDeadlineExceeded rather than blocking past it.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "comm/tcp_group.h"
#include "lab/probe.h"

namespace dl::lab {

struct CollectiveTiming {
  double time_us = 0;  // mean time per all-reduce over the timed iterations
  int warmup = 0;
  int iters = 0;
  nlohmann::json extra = nlohmann::json::object();  // transport facts for the marker's detail
};

class ProbeTransport {
 public:
  virtual ~ProbeTransport() = default;
  // device-set: choose and initialise the device; returns facts for the marker's detail.
  virtual Result<nlohmann::json> SetDevice(comm::Deadline deadline) = 0;
  // comm-initialised: rendezvous and communicator creation.
  virtual Result<nlohmann::json> InitComm(comm::Deadline deadline) = 0;
  // tensor-allocated: send and receive buffers; `send` is this rank's contribution.
  virtual Status Allocate(std::span<const float> send, comm::Deadline deadline) = 0;
  // all_reduce-done: `warmup` untimed then `iters` timed out-of-place sums of send into receive.
  virtual Result<CollectiveTiming> AllReduce(int warmup, int iters, comm::Deadline deadline) = 0;
  // result-checked: the receive buffer, on the host.
  virtual Result<std::vector<float>> ReadResult(comm::Deadline deadline) = 0;
  // teardown-done: finalize and free everything.
  virtual Status Teardown(comm::Deadline deadline) = 0;
};

std::unique_ptr<ProbeTransport> MakeSimTransport(const RankOptions& options);
// In a build without CUDA this transport fails at device-set with a clear message.
std::unique_ptr<ProbeTransport> MakeNcclTransport(const RankOptions& options);

}  // namespace dl::lab
