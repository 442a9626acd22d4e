// Tensor-parallel ranks as processes (CpuTpRunner with TpTransport::kProcesses, CudaTpRunner with
// CudaTpTransport::kProcesses): rank 0 is this process and stays the ModelRunner the engine sees;
// ranks 1..N-1 are child processes, this binary re-executed with a hidden subcommand
// (engine/tp_rank_process.h), each building its own shard of the same weights: a CpuRunner, or a
// CudaRunner over the one-shot IPC communicator (comm::CreateOneShotIpcRank), as the setup message
// says. docs/tensor-parallel.md ("Ranks as processes") has the whole picture.
//
// Two TcpGroups over 127.0.0.1, both rendezvoused at listeners rank 0 opened on port 0 (the ports go
// to the children in argv):
//   - data: the CPU's collectives (comm::TcpCommunicator), summed on rank 0 in rank order, so the
//     bits equal the in-process transport's. A rank whose forward fails aborts it (closes its
//     sockets), so the others leave their collective at once. CUDA ranks use it once, to exchange
//     their IPC handles; their collectives run on the device.
//   - control: rank 0's messages to each child (setup, each step's plan, stop) and the child's
//     replies (ready, each step's status, collectives and report). Separate from the data group
//     because it must outlive an aborted data group (a failed rank still reports why) and because a
//     child waits on it for an unbounded time between steps, while every collective is bounded by
//     the collective timeout.
//
// Supervision (the probe's rules, comm/process.h): every child has its own process group and dies
// with the thread of rank 0 that spawned it (PR_SET_PDEATHSIG); rank 0 always reaps them. A child
// that died is named with how it ended (ExitInfo); one that does not reply is killed. Stop sends
// each child a stop message, waits a bounded time, then kills and reaps what is left.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/cuda_runner.h"
#include "backend/rank_threads.h"
#include "base/status.h"
#include "comm/communicator.h"
#include "comm/device_communicator.h"
#include "comm/launch_env.h"
#include "comm/process.h"
#include "comm/tcp_group.h"
#include "kv_cache/kv_cache.h"
#include "kv_cache/kv_scales.h"
#include "model/checkpoint.h"
#include "model/shard_plan.h"

namespace dl {

// How rank 0 starts the other ranks.
struct TpProcessOptions {
  std::string exe = "/proc/self/exe";
  // A child's argv before its rank flags (TpRankArgs::ToArgv): the program name, the hidden
  // subcommand, and the model source that makes it build the same weights as rank 0
  // (EngineOptions' model dir, or shape, seed and layers). Required.
  std::vector<std::string> argv_prefix;
  // The children's stdout and stderr (they write logs and errors only): rank 0's stderr by default.
  int output_fd = 2;
};

// A child rank's own flags, appended to TpProcessOptions::argv_prefix.
struct TpRankArgs {
  int rank = 0;
  int tp_size = 0;
  comm::Endpoint control, data;
  double timeout_s = 600.0;
  std::vector<std::string> ToArgv() const;
};
// Takes the TpRankArgs flags out of `args`; what is left (the model source) stays in `rest`.
Result<TpRankArgs> ParseTpRankArgs(const std::vector<std::string>& args, std::vector<std::string>* rest);

// Which backend a child rank runs.
enum class TpRankBackend : uint8_t { kCpu = 0, kCuda = 1 };

// The one-shot communicators' options for CUDA ranks run with `options` (threads or processes):
// slots of `capacity` bytes, `blocks` per kernel, two-shot from the tuning's tp_two_shot_min_kb on.
inline comm::DeviceGroup::OneShotOptions CudaOneShotOptions(const CudaRunnerOptions& options, size_t capacity,
                                                            int blocks = comm::DeviceGroup::OneShotOptions{}.blocks) {
  return {.capacity_bytes = capacity,
          .blocks = blocks,
          .two_shot_min_bytes = static_cast<size_t>(options.tuning.tp_two_shot_min_kb) * 1024};
}

// What a CUDA child rank needs beyond the CPU's setup: rank 0's CudaRunnerOptions (its `device`
// replaced by devices[rank]) and the one-shot IPC communicator's size.
struct TpCudaRankSetup {
  CudaRunnerOptions options;
  std::vector<int> devices;  // [tp]: rank r's GPU
  uint64_t oneshot_capacity = 0;
  int32_t oneshot_blocks = comm::DeviceGroup::OneShotOptions{}.blocks;
  // The one-shot IPC communicator's options every rank builds.
  comm::DeviceGroup::OneShotOptions oneshot() const {
    return CudaOneShotOptions(options, oneshot_capacity, oneshot_blocks);
  }
};

// What rank 0 sends a child before it builds its rank.
struct TpRankSetup {
  int tp_size = 0;
  int rank = 0;
  EmbeddingMode embedding = EmbeddingMode::kReplicated;
  KvCacheSpec kv;
  KvScales scales;
  // The model rank 0 loaded, for a check that the child built the same one: its size, and
  // WeightsDigest of its weights.
  int64_t num_layers = 0, hidden_size = 0, vocab_size = 0;
  uint64_t weights_digest = 0;
  TpRankBackend backend = TpRankBackend::kCpu;
  TpCudaRankSetup cuda;  // kCuda only

  // Rank 0's setup for a group of `tp` over `checkpoint` (cuda left empty for the caller to fill).
  static TpRankSetup ForRankZero(const Checkpoint& checkpoint, int tp, EmbeddingMode embedding, const KvCacheSpec& kv,
                                 const KvScales& scales, TpRankBackend backend);
};

// A digest of what makes two loads of a model the same weights, cheap enough for every start: each
// tensor's name, dtype, shape and FP8 block shape, and its first 64 bytes and first scale where it
// has host data (FNV-1a, 64 bits). A child that built other weights than rank 0 (another dtype, FP8
// layout, seed or file) refuses at setup instead of computing with them.
uint64_t WeightsDigest(const Checkpoint& checkpoint);
std::vector<std::byte> EncodeTpRankSetup(const TpRankSetup& s);
Result<TpRankSetup> DecodeTpRankSetup(std::span<const std::byte> bytes);

// Rank 0's side: the children, their control channel, and rank 0's data communicator.
class TpProcessRanks {
 public:
  // Spawns ranks 1..tp-1 and rendezvouses both groups (bounded by 60 s: the children connect before
  // they load anything), then sends each its setup. The children then build their ranks; call
  // WaitReady after building rank 0's.
  static Result<std::unique_ptr<TpProcessRanks>> Start(const TpProcessOptions& options, const TpRankSetup& setup,
                                                       double timeout_s);
  ~TpProcessRanks();  // Stop()
  TpProcessRanks(const TpProcessRanks&) = delete;
  TpProcessRanks& operator=(const TpProcessRanks&) = delete;

  // Rank 0's end of the data group.
  comm::Communicator& rank0_comm() { return *data_; }
  // Every child's ready reply (it built its rank), within the collective timeout; the error names
  // each rank that failed or ended.
  Status WaitReady();

  // One step on every child: `plan` (EncodeForwardBatch) to each, with the runner's injected
  // failure for it, taken from `injected` (the test hook: the child fails that step before its
  // forward). Returns per rank (index r, rank 0's entry unused) the send's status: a child that
  // cannot be sent its plan is gone.
  std::vector<Status> SendStep(std::span<const std::byte> plan, InjectedFailures& injected);
  // Each child's reply to the step (statuses[r] for r >= 1; entries that already failed are kept
  // and completed with how the child ended). `rank0_failed`: rank 0's own forward failed, so a child
  // still computing is given a short grace instead of the collective timeout.
  void CollectReplies(bool rank0_failed, std::vector<Status>* statuses);
  // Stop message, up to `grace_s` for the children to exit, then kill and reap: afterwards no child
  // process remains. Idempotent.
  void Stop(double grace_s = 5.0);

  int tp_size() const { return static_cast<int>(children_.size()); }
  // Child r's pid (0 for rank 0 itself).
  pid_t pid(int rank) const { return rank == 0 ? 0 : children_[rank].pid(); }
  std::vector<pid_t> pids() const;  // every rank's, by rank
  // Collectives child r reported for its last forward (0 before any).
  int64_t collectives_last_forward(int rank) const { return collectives_[rank]; }
  // What child r reported with its last reply (ready or step): a JSON object, empty before any. A
  // CUDA rank's: {"kernel_nodes", "topology": [its entry]}; a CPU rank's: {}.
  const std::string& report(int rank) const { return reports_[rank]; }

 private:
  TpProcessRanks() = default;
  // Why child r is gone: its reply error, completed with how the process ended once it is reaped
  // (waiting up to `wait_s` for it; killed when it is still running after that).
  Status ChildGone(int rank, const Status& why, double wait_s);

  double timeout_s_ = 600.0;
  std::vector<comm::ChildProcess> children_;  // [tp], entry 0 unused
  std::unique_ptr<comm::TcpGroup> control_;
  std::unique_ptr<comm::Communicator> data_;
  std::vector<int64_t> collectives_;  // [tp]
  std::vector<std::string> reports_;  // [tp]
  std::vector<bool> sent_;            // [tp]: this step's plan reached the child
  bool stopped_ = false;
};

// A child rank's whole life (the hidden subcommand's body): joins both groups, receives its setup,
// calls `load` for the checkpoint (after the rendezvous, so rank 0 is not kept waiting to learn the
// child is alive), builds its rank (a CpuRunner, or for TpRankBackend::kCuda a CudaRunner on
// devices[rank] over the one-shot IPC communicator), replies ready, then runs each step plan rank 0
// sends until the stop message (Ok) or an error: rank 0 gone (the control connection closed), a bad
// plan or setup (DataLoss), a checkpoint that is not rank 0's. A failed forward is not the end: the
// child aborts its group's collectives, reports the error and waits for rank 0's stop.
Status RunTpRankChild(const TpRankArgs& args, const std::function<Result<Checkpoint>()>& load);

}  // namespace dl
