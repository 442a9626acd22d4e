#include "backend/cuda_tp_runner.h"

#include <algorithm>
#include <set>
#include <thread>

#include <unistd.h>

#include <fmt/format.h>

#include "comm/nccl_api.h"
#include "cuda/device.h"
#include "model/backend_support.h"
#include "model/forward_batch_codec.h"

namespace dl {

const char* CudaTpTransportName(CudaTpTransport t) {
  switch (t) {
    case CudaTpTransport::kAuto: return "auto";
    case CudaTpTransport::kDeviceInProcess: return "device-in-process";
    case CudaTpTransport::kDeviceOneShot: return "device-oneshot";
    case CudaTpTransport::kNccl: return "nccl";
    case CudaTpTransport::kProcesses: return "processes";
  }
  return "?";
}

Result<CudaTpTransport> ParseCudaTpTransport(std::string_view name) {
  for (CudaTpTransport t : {CudaTpTransport::kAuto, CudaTpTransport::kDeviceInProcess, CudaTpTransport::kDeviceOneShot,
                            CudaTpTransport::kNccl, CudaTpTransport::kProcesses}) {
    if (name == CudaTpTransportName(t)) return t;
  }
  return InvalidArgument("tensor-parallel transport '{}': auto, device-in-process, device-oneshot, nccl or processes",
                         name);
}

std::vector<int> TpRankDevices(int tp, int gpus) {
  std::vector<int> d;
  for (int r = 0; r < tp; ++r) d.push_back(gpus > 0 ? r % gpus : 0);
  return d;
}

Status CheckCudaTensorParallel(const Checkpoint& ck, const TensorParallelPlan& plan) {
  const ModelConfig& c = ck.config();
  const int tp = plan.tp_size;
  if (ck.weights().embed.data == nullptr) {
    return InvalidArgument("CUDA tensor parallelism shards the host weights; this checkpoint is shape-only (weights "
                           "generated on one device): give a checkpoint or host synthetic weights");
  }
  // FP8 weights shard with their scales (model/weight_shard.h refuses a slice that would split a
  // scale block); each rank's upload then checks that its kernels take the slice's width and block
  // shape, naming the tensor and the rank (CudaWeights, backend_support.h).
  for (int r = 0; r < tp; ++r) {
    const RankShard& rs = plan.ranks[r];
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const LayerShard& ls = rs.layers[l];
      // The kernels take no empty matrix: a width smaller than tp leaves some rank none of it.
      const bool sparse = c.is_sparse(l);
      const char* empty = !sparse && ls.dense_ff.size == 0  ? "intermediate_size"
                          : sparse && ls.expert_ff.size == 0 ? "moe_intermediate_size"
                          : sparse && ls.shared_ff.size == 0 ? "shared_expert_intermediate_size"
                                                             : nullptr;
      if (empty != nullptr) {
        return InvalidArgument("tensor parallel {} on the CUDA backend: layer {}'s {} leaves rank {} an empty "
                               "slice (the CPU reference runs it)",
                               tp, l, empty, r);
      }
    }
    if (rs.lm_head_vocab.size == 0) {
      return InvalidArgument("tensor parallel {} on the CUDA backend: the vocabulary of {} leaves rank {} no rows", tp,
                             c.vocab_size, r);
    }
  }
  for (int r = 0; r < tp; ++r) {
    DL_RETURN_IF_ERROR(CheckCudaShapeSupport(RankModelConfig(c, plan, r))
                           .WithContext(fmt::format("tensor parallel {}: rank {}'s slices", tp, r)));
  }
  return Status::Ok();
}

namespace {

// Staging for the largest collective: the [max_rows, d] BF16 all-reduce, or one rank's
// [max_outputs, largest vocabulary slice] BF16 logits block of the all-gather.
size_t LargestCollectiveBytes(const TensorParallelPlan& plan, const ModelConfig& c, const CudaRunnerOptions& base) {
  int64_t vocab_stride = 0;
  for (const RankShard& r : plan.ranks) vocab_stride = std::max(vocab_stride, r.lm_head_vocab.size);
  return std::max<size_t>(static_cast<size_t>(std::max(1, base.max_rows)) * c.hidden_size * 2,
                          static_cast<size_t>(std::max(1, base.max_outputs)) * vocab_stride * 2);
}

// Whether every rank's GPU can read every other's memory (the one-shot kernels read peers' slots).
bool AllPeersReachable(const std::vector<int>& devices) {
  for (int a : devices) {
    for (int b : devices) {
      if (!cuda::CanAccessPeer(a, b)) return false;
    }
  }
  return true;
}

}  // namespace

Status CudaTpRunner::StartProcesses(const Checkpoint& checkpoint, const KvCacheSpec& kv, KvScales scales,
                                    const CudaRunnerOptions& base, EmbeddingMode embedding, double timeout_s,
                                    const TpProcessOptions& processes) {
  const ModelConfig& c = checkpoint.config();
  const int tp = plan_.tp_size;
  TpRankSetup setup = TpRankSetup::ForRankZero(checkpoint, tp, embedding, kv, scales, TpRankBackend::kCuda);
  setup.cuda.options = base;
  setup.cuda.devices = devices_;
  setup.cuda.oneshot_capacity = LargestCollectiveBytes(plan_, c, base);
  const comm::DeviceGroup::OneShotOptions oneshot = setup.cuda.oneshot();
  scales_ = scales;
  DL_ASSIGN_OR_RETURN(children_, TpProcessRanks::Start(processes, setup, timeout_s));
  // The handle exchange meets every child right after its setup (before it loads any weights).
  auto ipc = comm::CreateOneShotIpcRank(0, tp, devices_[0], oneshot, timeout_s, comm::ExchangeOver(children_->rank0_comm()));
  if (!ipc.ok()) {
    // A child that failed first says why in its ready reply; the others must not wait for rank 0.
    children_->rank0_comm().Abort(ipc.status());
    const Status children = children_->WaitReady();
    return Unavailable("tensor-parallel rank 0 on GPU {}: {}{}", devices_[0], ipc.status().ToString(),
                       children.ok() ? "" : fmt::format("; {}", children.message()));
  }
  owned_.push_back(std::move(ipc).value());
  comms_.push_back(owned_.back().get());
  // Rank 0 builds its shard while the children build theirs.
  CudaRunnerOptions o = base;
  o.device = devices_[0];
  auto rank = CudaRunner::CreateRank(checkpoint, kv, std::move(scales), o, plan_, 0, comms_[0]);
  if (!rank.ok()) {
    comms_[0]->Abort(rank.status());
    children_->Stop();
    return rank.status().WithContext(fmt::format("tensor-parallel rank 0 on GPU {}", o.device));
  }
  ranks_.push_back(std::move(rank).value());
  return children_->WaitReady();
}

Result<std::unique_ptr<CudaTpRunner>> CudaTpRunner::Create(const Checkpoint& checkpoint, const KvCacheSpec& kv,
                                                           KvScales scales, const CudaRunnerOptions& base, int tp,
                                                           EmbeddingMode embedding, CudaTpTransport transport, int gpus,
                                                           double timeout_s, const TpProcessOptions& processes) {
  const ModelConfig& c = checkpoint.config();
  DL_ASSIGN_OR_RETURN(TensorParallelPlan plan, MakeTensorParallelPlan(c, tp, embedding));
  // What the shards need, before any GPU work.
  DL_RETURN_IF_ERROR(CheckCudaTensorParallel(checkpoint, plan));
  std::string why;
  const int visible = cuda::DeviceCount(&why);
  if (visible == 0) return Unavailable("--backend cuda --tp {}: no usable GPU ({})", tp, why);
  if (gpus <= 0 || gpus > visible) gpus = visible;
  std::unique_ptr<CudaTpRunner> runner(new CudaTpRunner());
  runner->plan_ = std::move(plan);
  runner->kv_spec_ = kv;
  runner->num_layers_ = c.num_hidden_layers;
  runner->vocab_size_ = c.vocab_size;
  runner->devices_ = TpRankDevices(tp, gpus);
  const bool own_gpus = std::set<int>(runner->devices_.begin(), runner->devices_.end()).size() ==
                        runner->devices_.size();
  if (transport == CudaTpTransport::kAuto) {
    // The rank-order sum (one-shot and two-shot kernels) keeps every promise of docs/exactness.md;
    // NCCL's order depends on the message size, so only GPUs without peer access take it.
    transport = own_gpus && tp > 1 && !AllPeersReachable(runner->devices_) && comm::BuiltWithNccl() &&
                        comm::FindNcclLibrary(comm::DefaultNcclLibraryCandidates()).ok()
                    ? CudaTpTransport::kNccl
                    : CudaTpTransport::kDeviceOneShot;
  }
  if (transport == CudaTpTransport::kProcesses) {
    DL_RETURN_IF_ERROR(runner->StartProcesses(checkpoint, kv, std::move(scales), base, embedding, timeout_s, processes));
    return runner;
  }
  if (transport == CudaTpTransport::kNccl) {
    DL_ASSIGN_OR_RETURN(runner->owned_, comm::CreateNcclGroup(runner->devices_));
    for (auto& p : runner->owned_) runner->comms_.push_back(p.get());
  } else {
    const size_t capacity = LargestCollectiveBytes(runner->plan_, c, base);
    if (transport == CudaTpTransport::kDeviceOneShot) {
      // One-shot slots as large as the largest collective: every forward's graph can hold its
      // collectives.
      DL_ASSIGN_OR_RETURN(runner->in_process_, comm::DeviceGroup::CreateOneShot(runner->devices_, capacity,
                                                                                CudaOneShotOptions(base, capacity),
                                                                                timeout_s));
    } else {
      DL_ASSIGN_OR_RETURN(runner->in_process_, comm::DeviceGroup::CreateInProcess(runner->devices_, capacity, timeout_s));
    }
    for (int r = 0; r < tp; ++r) runner->comms_.push_back(&runner->in_process_->rank(r));
  }
  for (int r = 0; r < tp; ++r) {
    CudaRunnerOptions o = base;
    o.device = runner->devices_[r];
    auto rank = CudaRunner::CreateRank(checkpoint, kv, scales, o, runner->plan_, r, runner->comms_[r]);
    if (!rank.ok()) return rank.status().WithContext(fmt::format("tensor-parallel rank {} on GPU {}", r, o.device));
    runner->ranks_.push_back(std::move(rank).value());
  }
  runner->threads_ = std::make_unique<RankThreads>(tp);
  runner->prepared_ = std::make_unique<comm::RankBarrier>(tp, timeout_s, "tensor-parallel ranks' graph capture");
  return runner;
}

CudaTpRunner::~CudaTpRunner() {
  if (children_) {
    if (in_flight_) {
      ForwardResult discarded;
      (void)WaitProcesses(&discarded);
    }
    // The children map rank 0's one-shot buffers: they go before rank 0's runner and communicator.
    children_->Stop();
    return;
  }
  threads_.reset();
  // A forward still in flight must finish before the ranks' buffers go.
  if (in_flight_) {
    for (auto& r : ranks_) {
      ForwardResult discarded;
      (void)r->Wait(&discarded);
    }
  }
}

void CudaTpRunner::FailNextForwardOnRank(int rank, Status error) { injected_.Set(rank, std::move(error)); }

std::vector<pid_t> CudaTpRunner::rank_pids() const { return children_ ? children_->pids() : std::vector<pid_t>{}; }

Status CudaTpRunner::EndGroup(const std::string& failures) {
  broken_ = Status(StatusCode::kUnavailable, fmt::format("tensor-parallel group of {} ended: {}", plan_.tp_size, failures));
  // The group is over: child processes are stopped and reaped now, not when the runner goes.
  if (children_) children_->Stop();
  return broken_;
}

// The children get the plan first (each runs Prepare, Submit and Wait on its own CudaRunner, then
// replies), then rank 0 prepares and submits its share. No Prepare barrier across processes: each
// has its own CUDA context, so no rank's capture or kernel loading waits for a peer's spinning
// kernel (cuda_runner.h says why threads need one).
Status CudaTpRunner::LaunchProcesses(const ForwardBatch& batch) {
  std::vector<Status> statuses = children_->SendStep(EncodeForwardBatch(batch), injected_);
  bool all_sent = true;
  for (int r = 1; r < plan_.tp_size; ++r) all_sent = all_sent && statuses[r].ok();
  Status st = all_sent ? injected_.Take(0)
                       : Status(StatusCode::kCancelled, "not run: a rank could not be sent the step");
  bool prepared = false;
  if (st.ok()) st = ranks_[0]->Prepare(batch);
  if (st.ok()) {
    prepared = true;
    st = ranks_[0]->Submit();
  }
  if (st.ok()) {
    in_flight_ = true;
    return Status::Ok();
  }
  // Rank 0 will not join this step's collectives: every rank's kernels leave their waits.
  comms_[0]->Abort(st);
  if (prepared) {
    ForwardResult discarded;
    (void)ranks_[0]->Wait(&discarded);
  }
  statuses[0] = st;
  children_->CollectReplies(/*rank0_failed=*/true, &statuses);
  return EndGroup(RankThreads::DescribeFailures(statuses));
}

// Rank 0 waits for its stream while a helper thread reads the children's replies: a child that
// failed, died or stayed silent past the timeout aborts the group, which ends rank 0's spinning
// kernels at once (they read the shared abort word) instead of at their own timeout.
Status CudaTpRunner::WaitProcesses(ForwardResult* result) {
  in_flight_ = false;
  std::vector<Status> statuses(static_cast<size_t>(plan_.tp_size));
  std::thread replies([&] {
    children_->CollectReplies(/*rank0_failed=*/false, &statuses);
    for (int r = 1; r < plan_.tp_size; ++r) {
      if (!statuses[r].ok()) {
        comms_[0]->Abort(Status(statuses[r].code(), fmt::format("rank {}: {}", r, statuses[r].message())));
        break;
      }
    }
  });
  Status s0 = ranks_[0]->Wait(result);
  if (!s0.ok()) comms_[0]->Abort(s0);
  replies.join();
  statuses[0] = s0;
  const std::string failures = RankThreads::DescribeFailures(statuses);
  if (failures.empty()) return Status::Ok();
  return EndGroup(failures);
}

Status CudaTpRunner::LaunchRank(int r, const ForwardBatch& batch) {
  Status st = injected_.Take(r);
  if (st.ok()) st = ranks_[r]->Prepare(batch);
  // No rank's graph runs before every rank has captured its own (CudaRunner::Prepare says why).
  if (st.ok()) {
    st = prepared_->Arrive(r, "prepare");
  } else {
    prepared_->Abort(r, st);
  }
  if (st.ok()) st = ranks_[r]->Submit();
  // A failed rank must not leave the others waiting in a collective it will never join.
  if (!st.ok()) comms_[r]->Abort(st);
  return st;
}

Status CudaTpRunner::Launch(const ForwardBatch& batch) {
  if (in_flight_) return FailedPrecondition("a forward is already in flight");
  if (!broken_.ok()) return broken_;
  if (observer_ != nullptr) {
    return FailedPrecondition("KV observation (calibration) runs on one rank, not under tensor parallelism");
  }
  // What a request can get wrong is checked here, before any rank starts (the ranks' own checks are
  // the same, on the same batch): every rank then takes the same path, and only a real failure
  // aborts the group.
  DL_RETURN_IF_ERROR(batch.Validate(vocab_size_, kv_spec_.page_size));
  // Hidden-state taps need nothing of their own: a tap reads the residual stream after the layer's
  // all-reduce, which every rank holds whole, so rank 0's forward returns them (forwards with taps
  // run eagerly on every rank, CudaRunner's rule). Their count and layers are checked here, so a
  // batch the ranks would refuse does not end the group.
  if (static_cast<int32_t>(batch.hidden_taps.size()) > ranks_[0]->max_taps()) {
    return Unimplemented("{} hidden-state taps on the CUDA backend, which was sized for {} (EngineOptions::max_hidden_taps)",
                         batch.hidden_taps.size(), ranks_[0]->max_taps());
  }
  DL_RETURN_IF_ERROR(batch.ValidateHiddenTaps(num_layers_));
  if (batch.num_rows() > max_rows() || static_cast<int32_t>(batch.outputs.size()) > max_outputs()) {
    return InvalidArgument("CUDA forward of {} rows, {} outputs exceeds the backend's {} / {}", batch.num_rows(),
                           batch.outputs.size(), max_rows(), max_outputs());
  }
  if (children_) return LaunchProcesses(batch);
  std::vector<Status> statuses = threads_->Run([&](int r) { return LaunchRank(r, batch); });
  const std::string failures = RankThreads::DescribeFailures(statuses);
  if (failures.empty()) {
    in_flight_ = true;
    return Status::Ok();
  }
  // Ranks whose launch went through still have work on their streams: finish it before failing.
  for (int r = 0; r < plan_.tp_size; ++r) {
    if (!statuses[r].ok()) continue;
    ForwardResult discarded;
    (void)ranks_[r]->Wait(&discarded);
  }
  broken_ = Status(StatusCode::kUnavailable,
                   fmt::format("tensor-parallel group of {} ended: {}", plan_.tp_size, failures));
  return broken_;
}

Status CudaTpRunner::Wait(ForwardResult* result) {
  if (!in_flight_) return FailedPrecondition("no forward in flight");
  if (children_) return WaitProcesses(result);
  in_flight_ = false;
  // Every rank's stream drains (ranks 1.. first, so rank 0's device is current afterwards); rank 0's
  // result is the step's: the tokens every rank chose from the same gathered logits.
  Status st;
  for (int r = plan_.tp_size - 1; r >= 1; --r) {
    ForwardResult discarded;
    Status s = ranks_[r]->Wait(&discarded);
    if (!s.ok() && st.ok()) st = s.WithContext(fmt::format("tensor-parallel rank {}", r));
  }
  Status s0 = ranks_[0]->Wait(result);
  if (!s0.ok() && st.ok()) st = s0.WithContext("tensor-parallel rank 0");
  if (!st.ok()) {
    broken_ = Status(StatusCode::kUnavailable,
                     fmt::format("tensor-parallel group of {} ended: {}", plan_.tp_size, st.ToString()));
    return broken_;
  }
  return Status::Ok();
}

std::vector<int64_t> CudaTpRunner::collectives_last_forward() const {
  std::vector<int64_t> v;
  for (int r = 0; r < plan_.tp_size; ++r) {
    // A child process reports its count with each step's reply.
    v.push_back(children_ && r > 0 ? children_->collectives_last_forward(r) : ranks_[r]->collectives_last_forward());
  }
  return v;
}

nlohmann::json CudaTpRunner::Describe() const {
  nlohmann::json d = ranks_[0]->Describe();
  d.erase("tensor_parallel_rank");
  nlohmann::json ranks = nlohmann::json::array(), topology = nlohmann::json::array();
  const std::vector<int64_t> collectives = collectives_last_forward();
  for (int r = 0; r < plan_.tp_size; ++r) {
    // A child process's topology and decode graph come with its last reply; its scales are the ones
    // rank 0 sent it.
    const bool child = children_ && r > 0;
    nlohmann::json rd;
    if (child) {
      rd = nlohmann::json::parse(children_->report(r), nullptr, /*allow_exceptions=*/false);
      if (!rd.is_object()) rd = nlohmann::json::object();
    } else {
      rd = ranks_[r]->Describe();
      rd["kernel_nodes"] = ranks_[r]->kernel_nodes();
    }
    nlohmann::json entry = {
        {"rank", r},
        {"device", devices_[r]},
        {"collectives_last_forward", collectives[r]},
        {"decode_graph_kernel_nodes", rd.value("kernel_nodes", 0)},
        {"kv_heads", plan_.ranks[r].layers.empty() ? 0 : plan_.ranks[r].layers[0].kv_heads.size},
        {"kv_scales", (child ? scales_ : ranks_[r]->kv_scales()).ToJson()},
        {"lm_head_vocab", {plan_.ranks[r].lm_head_vocab.begin, plan_.ranks[r].lm_head_vocab.end()}}};
    if (children_) entry["pid"] = r == 0 ? static_cast<int64_t>(::getpid()) : static_cast<int64_t>(children_->pid(r));
    ranks.push_back(std::move(entry));
    if (rd.contains("topology")) {
      for (const auto& t : rd["topology"]) topology.push_back(t);
    }
  }
  d["topology"] = topology;
  d["tensor_parallel"] = {{"size", plan_.tp_size},
                          {"embedding", EmbeddingModeName(plan_.embedding)},
                          {"transport", comms_[0]->transport()},
                          {"all_reduce_rule", comms_[0]->all_reduce_rule()},
                          {"graphs", comms_[0]->capturable() && d.value("graph", false)},
                          {"moe_sharding", "by intermediate width"},
                          {"all_reduces_per_forward", plan_.AllReducesPerForward(num_layers_)},
                          {"ranks", ranks}};
  return d;
}

}  // namespace dl
