#include "backend/cpu_tp_runner.h"

#include <unistd.h>

#include <fmt/format.h>

#include "comm/tcp_communicator.h"
#include "comm/tcp_group.h"
#include "model/forward_batch_codec.h"

namespace dl {

const char* TpTransportName(TpTransport t) {
  switch (t) {
    case TpTransport::kInProcess: return "in-process";
    case TpTransport::kTcpLoopback: return "tcp-loopback";
    case TpTransport::kProcesses: return "processes";
  }
  return "?";
}

namespace {

// tp TcpGroups over 127.0.0.1, one per rank, rendezvoused by threads of this process.
Result<std::vector<std::unique_ptr<comm::Communicator>>> TcpLoopbackGroup(int tp, double timeout_s) {
  DL_ASSIGN_OR_RETURN(comm::Listener listener, comm::Listen("127.0.0.1", 0));
  const comm::Endpoint root{"127.0.0.1", listener.port};
  const comm::Deadline deadline = comm::DeadlineIn(60.0);
  std::vector<Result<std::unique_ptr<comm::TcpGroup>>> groups;
  for (int r = 0; r < tp; ++r) groups.emplace_back(InvalidArgument("not created"));
  std::vector<std::thread> joiners;
  for (int r = 1; r < tp; ++r) {
    joiners.emplace_back([&, r] { groups[r] = comm::TcpGroup::Create(r, tp, -1, root, deadline); });
  }
  groups[0] = comm::TcpGroup::Create(0, tp, listener.fd, root, deadline);
  for (auto& t : joiners) t.join();
  std::vector<std::unique_ptr<comm::Communicator>> comms;
  for (int r = 0; r < tp; ++r) {
    if (!groups[r].ok()) return groups[r].status().WithContext(fmt::format("tcp rendezvous of rank {}", r));
    comms.push_back(std::make_unique<comm::TcpCommunicator>(std::move(groups[r]).value(), timeout_s));
  }
  return comms;
}

}  // namespace

Result<std::unique_ptr<CpuTpRunner>> CpuTpRunner::Create(const Checkpoint& checkpoint, const KvCacheSpec& kv,
                                                         KvScales scales, int tp, EmbeddingMode embedding,
                                                         TpTransport transport, double timeout_s,
                                                         const TpProcessOptions& processes) {
  const ModelConfig& c = checkpoint.config();
  DL_ASSIGN_OR_RETURN(TensorParallelPlan plan, MakeTensorParallelPlan(c, tp, embedding));
  std::unique_ptr<CpuTpRunner> runner(new CpuTpRunner());
  runner->plan_ = std::move(plan);
  runner->transport_ = transport;
  runner->kv_spec_ = kv;
  runner->num_layers_ = c.num_hidden_layers;
  runner->vocab_size_ = c.vocab_size;
  runner->scales_ = scales;
  if (transport == TpTransport::kProcesses) {
    const TpRankSetup setup = TpRankSetup::ForRankZero(checkpoint, tp, embedding, kv, scales, TpRankBackend::kCpu);
    DL_ASSIGN_OR_RETURN(runner->children_, TpProcessRanks::Start(processes, setup, timeout_s));
    runner->comms_.push_back(&runner->children_->rank0_comm());
    // Rank 0 builds its shard while the children build theirs.
    DL_ASSIGN_OR_RETURN(auto rank, CpuRunner::CreateRank(checkpoint, kv, scales, runner->plan_, 0, runner->comms_[0]));
    runner->ranks_.push_back(std::move(rank));
    DL_RETURN_IF_ERROR(runner->children_->WaitReady());
    return runner;
  }
  if (transport == TpTransport::kInProcess) {
    runner->in_process_ = comm::InProcessGroup::Create(tp, timeout_s);
    for (int r = 0; r < tp; ++r) runner->comms_.push_back(&runner->in_process_->rank(r));
  } else {
    DL_ASSIGN_OR_RETURN(runner->owned_, TcpLoopbackGroup(tp, timeout_s));
    for (auto& p : runner->owned_) runner->comms_.push_back(p.get());
  }
  for (int r = 0; r < tp; ++r) {
    DL_ASSIGN_OR_RETURN(auto rank, CpuRunner::CreateRank(checkpoint, kv, scales, runner->plan_, r, runner->comms_[r]));
    runner->ranks_.push_back(std::move(rank));
  }
  runner->threads_ = std::make_unique<RankThreads>(tp);
  return runner;
}

CpuTpRunner::~CpuTpRunner() {
  if (children_) children_->Stop();
}

void CpuTpRunner::FailNextForwardOnRank(int rank, Status error) { injected_.Set(rank, std::move(error)); }

std::vector<pid_t> CpuTpRunner::rank_pids() const { return children_ ? children_->pids() : std::vector<pid_t>{}; }

Status CpuTpRunner::RunRank(int r, const ForwardBatch& batch, ForwardResult* result) {
  Status st = injected_.Take(r);
  if (st.ok()) st = ranks_[r]->Forward(batch, result);
  // A failed rank must not leave the others waiting in a collective it will never join.
  if (!st.ok()) comms_[r]->Abort(st);
  return st;
}

std::vector<Status> CpuTpRunner::RunStep(const ForwardBatch& batch) {
  if (!children_) {
    return threads_->Run([&](int r) {
      ForwardResult discarded;  // rank 0's result is the step's
      return RunRank(r, batch, r == 0 ? &result_ : &discarded);
    });
  }
  // The children get the plan first, then rank 0 runs its share (the children wait for it in their
  // first collective), then each child's reply says how its share went.
  std::vector<Status> statuses = children_->SendStep(EncodeForwardBatch(batch), injected_);
  bool all_sent = true;
  for (int r = 1; r < plan_.tp_size; ++r) all_sent = all_sent && statuses[r].ok();
  if (all_sent) {
    statuses[0] = RunRank(0, batch, &result_);
  } else {
    // A child that did not get the plan will not join the collectives: nobody waits for it.
    statuses[0] = Status(StatusCode::kCancelled, "not run: a rank could not be sent the step");
    comms_[0]->Abort(statuses[0]);
  }
  children_->CollectReplies(!statuses[0].ok(), &statuses);
  return statuses;
}

Status CpuTpRunner::Launch(const ForwardBatch& batch) {
  if (in_flight_) return FailedPrecondition("a forward is already in flight");
  if (!broken_.ok()) return broken_;
  if (observer_ != nullptr) {
    return FailedPrecondition("KV observation (calibration) runs on one rank, not under tensor parallelism");
  }
  // What a request can get wrong is checked here, on rank 0, before any rank starts: every rank then
  // takes the same path through the forward, and only a real failure aborts the group.
  DL_RETURN_IF_ERROR(batch.Validate(vocab_size_, kv_spec_.page_size));
  DL_RETURN_IF_ERROR(batch.ValidateHiddenTaps(num_layers_));
  in_flight_ = true;
  result_ = ForwardResult{};
  const std::vector<Status> statuses = RunStep(batch);
  const std::string failures = RankThreads::DescribeFailures(statuses);
  status_ = Status::Ok();
  if (!failures.empty()) {
    broken_ = Status(StatusCode::kUnavailable,
                     fmt::format("tensor-parallel group of {} ended: {}", plan_.tp_size, failures));
    status_ = broken_;
    // The group is over: child processes are stopped and reaped now, not when the runner goes.
    if (children_) children_->Stop();
  }
  return Status::Ok();
}

Status CpuTpRunner::Wait(ForwardResult* result) {
  if (!in_flight_) return FailedPrecondition("no forward in flight");
  in_flight_ = false;
  DL_RETURN_IF_ERROR(std::exchange(status_, Status::Ok()));
  *result = std::move(result_);
  return Status::Ok();
}

int64_t CpuTpRunner::rank_collectives(int r) const {
  // A child process reports its count with each step's reply.
  return children_ && r > 0 ? children_->collectives_last_forward(r) : ranks_[r]->collectives_last_forward();
}

std::vector<int64_t> CpuTpRunner::collectives_last_forward() const {
  std::vector<int64_t> v;
  for (int r = 0; r < plan_.tp_size; ++r) v.push_back(rank_collectives(r));
  return v;
}

nlohmann::json CpuTpRunner::Describe() const {
  nlohmann::json d = ranks_[0]->Describe();
  nlohmann::json ranks = nlohmann::json::array();
  for (int r = 0; r < plan_.tp_size; ++r) {
    // A child process's scales are the ones rank 0 sent it in its setup.
    const KvScales& scales = children_ && r > 0 ? scales_ : ranks_[r]->kv_scales();
    nlohmann::json rank = {{"rank", r},
                           {"collectives_last_forward", rank_collectives(r)},
                           {"kv_heads", plan_.ranks[r].layers.empty() ? 0 : plan_.ranks[r].layers[0].kv_heads.size},
                           {"kv_scales", scales.ToJson()},  // what the rank itself uses
                           {"lm_head_vocab", {plan_.ranks[r].lm_head_vocab.begin, plan_.ranks[r].lm_head_vocab.end()}}};
    if (children_) rank["pid"] = r == 0 ? static_cast<int64_t>(::getpid()) : static_cast<int64_t>(children_->pid(r));
    ranks.push_back(std::move(rank));
  }
  d["tensor_parallel"] = {{"size", plan_.tp_size},
                          {"embedding", EmbeddingModeName(plan_.embedding)},
                          {"transport", TpTransportName(transport_)},
                          {"moe_sharding", "by intermediate width"},
                          {"all_reduces_per_forward", plan_.AllReducesPerForward(num_layers_)},
                          {"ranks", ranks}};
  return d;
}

}  // namespace dl
