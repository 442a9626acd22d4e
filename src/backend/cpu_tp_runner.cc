#include "backend/cpu_tp_runner.h"

#include <fmt/format.h>

#include "comm/tcp_communicator.h"
#include "comm/tcp_group.h"

namespace dl {

const char* TpTransportName(TpTransport t) {
  return t == TpTransport::kInProcess ? "in-process" : "tcp-loopback";
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
                                                         TpTransport transport, double timeout_s) {
  const ModelConfig& c = checkpoint.config();
  DL_ASSIGN_OR_RETURN(TensorParallelPlan plan, MakeTensorParallelPlan(c, tp, embedding));
  std::unique_ptr<CpuTpRunner> runner(new CpuTpRunner());
  runner->plan_ = std::move(plan);
  runner->transport_ = transport;
  runner->kv_spec_ = kv;
  runner->num_layers_ = c.num_hidden_layers;
  runner->vocab_size_ = c.vocab_size;
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

CpuTpRunner::~CpuTpRunner() = default;

void CpuTpRunner::FailNextForwardOnRank(int rank, Status error) { threads_->InjectFailure(rank, std::move(error)); }

Status CpuTpRunner::RunRank(int r, const ForwardBatch& batch, ForwardResult* result) {
  Status st = threads_->TakeInjected(r);
  if (st.ok()) st = ranks_[r]->Forward(batch, result);
  // A failed rank must not leave the others waiting in a collective it will never join.
  if (!st.ok()) comms_[r]->Abort(st);
  return st;
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
  for (int32_t t : batch.hidden_taps) {
    if (t < 0 || t >= num_layers_) {
      return InvalidArgument("hidden tap at layer {} is outside the model's {} layers", t, num_layers_);
    }
  }
  in_flight_ = true;
  result_ = ForwardResult{};
  const std::vector<Status> statuses = threads_->Run([&](int r) {
    ForwardResult discarded;  // rank 0's result is the step's
    return RunRank(r, batch, r == 0 ? &result_ : &discarded);
  });
  const std::string failures = RankThreads::DescribeFailures(statuses);
  status_ = Status::Ok();
  if (!failures.empty()) {
    broken_ = Status(StatusCode::kUnavailable,
                     fmt::format("tensor-parallel group of {} ended: {}", plan_.tp_size, failures));
    status_ = broken_;
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

std::vector<int64_t> CpuTpRunner::collectives_last_forward() const {
  std::vector<int64_t> v;
  for (const auto& r : ranks_) v.push_back(r->collectives_last_forward());
  return v;
}

nlohmann::json CpuTpRunner::Describe() const {
  nlohmann::json d = ranks_[0]->Describe();
  nlohmann::json ranks = nlohmann::json::array();
  for (int r = 0; r < plan_.tp_size; ++r) {
    ranks.push_back({{"rank", r},
                     {"collectives_last_forward", ranks_[r]->collectives_last_forward()},
                     {"kv_heads", plan_.ranks[r].layers.empty() ? 0 : plan_.ranks[r].layers[0].kv_heads.size},
                     {"kv_scales", ranks_[r]->kv_scales().ToJson()},  // what the rank itself uses
                     {"lm_head_vocab", {plan_.ranks[r].lm_head_vocab.begin, plan_.ranks[r].lm_head_vocab.end()}}});
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
