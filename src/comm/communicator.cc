#include "comm/communicator.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "comm/rank_barrier.h"

namespace dl::comm {

Result<std::vector<float>> AllGatherFloats(Communicator& comm, std::span<const float> local,
                                           std::span<const int64_t> counts) {
  if (static_cast<int>(counts.size()) != comm.size()) {
    return InvalidArgument("all-gather: {} counts for a group of {}", counts.size(), comm.size());
  }
  std::vector<size_t> bytes(counts.size());
  int64_t total = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    bytes[r] = static_cast<size_t>(counts[r]) * sizeof(float);
    total += counts[r];
  }
  if (counts[comm.rank()] != static_cast<int64_t>(local.size())) {
    return InvalidArgument("all-gather: rank {} gives {} floats where the counts say {}", comm.rank(),
                           local.size(), counts[comm.rank()]);
  }
  std::vector<float> out(static_cast<size_t>(total));
  DL_RETURN_IF_ERROR(comm.AllGather(std::as_bytes(local), bytes, std::as_writable_bytes(std::span(out))));
  return out;
}

Result<std::vector<ArgmaxCandidate>> DistributedArgmax(Communicator& comm,
                                                       std::span<const ArgmaxCandidate> local) {
  const int n = comm.size();
  const size_t rows = local.size();
  std::vector<size_t> bytes(n, rows * sizeof(ArgmaxCandidate));
  std::vector<ArgmaxCandidate> all(rows * n);
  DL_RETURN_IF_ERROR(comm.AllGather(std::as_bytes(local), bytes, std::as_writable_bytes(std::span(all))));
  std::vector<ArgmaxCandidate> best(rows);
  for (size_t i = 0; i < rows; ++i) {
    ArgmaxCandidate b;
    for (int r = 0; r < n; ++r) {  // ascending ranks hold ascending ids: keep the first on ties
      const ArgmaxCandidate& c = all[r * rows + i];
      b.finite = b.finite && c.finite;
      if (c.index < 0) continue;
      if (b.index < 0 || c.value > b.value) {
        b.value = c.value;
        b.index = c.index;
      }
    }
    best[i] = b;
  }
  return best;
}

namespace {

class InProcessGroupImpl;

class InProcessRank final : public Communicator {
 public:
  InProcessRank(InProcessGroupImpl* group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override;
  std::string transport() const override { return "in-process"; }
  Status AllReduceSum(std::span<float> data) override;
  Status AllGather(std::span<const std::byte> local, std::span<const size_t> bytes_per_rank,
                   std::span<std::byte> out) override;
  void Abort(const Status& reason) override;

 private:
  InProcessGroupImpl* group_;
  int rank_;
};

// Ranks post a pointer to their input, meet at a barrier, each computes the result from every
// rank's input in rank order, and meet again before anyone may touch its input.
class InProcessGroupImpl final : public InProcessGroup {
 public:
  InProcessGroupImpl(int size, double timeout_s)
      : size_(size), barrier_(size, timeout_s, "tensor-parallel group"), inputs_(size), input_bytes_(size) {
    for (int r = 0; r < size; ++r) ranks_.push_back(std::make_unique<InProcessRank>(this, r));
  }
  Communicator& rank(int r) override { return *ranks_[r]; }
  int size() const override { return size_; }

  // Each rank writes only its own slot, before the barrier that lets the others read it.
  void Post(int r, const void* data, size_t bytes) {
    inputs_[r] = data;
    input_bytes_[r] = bytes;
  }
  const void* input(int r) const { return inputs_[r]; }
  size_t input_bytes(int r) const { return input_bytes_[r]; }

  Status Barrier(int r, const char* what) { return barrier_.Arrive(r, what); }
  void Abort(int r, const Status& reason) { barrier_.Abort(r, reason); }

 private:
  const int size_;
  std::vector<std::unique_ptr<InProcessRank>> ranks_;
  RankBarrier barrier_;
  std::vector<const void*> inputs_;
  std::vector<size_t> input_bytes_;
};

int InProcessRank::size() const { return group_->size(); }

Status InProcessRank::AllReduceSum(std::span<float> data) {
  ++collectives_issued_;
  group_->Post(rank_, data.data(), data.size_bytes());
  DL_RETURN_IF_ERROR(group_->Barrier(rank_, "all-reduce"));
  // Every rank sums the same inputs in the same order: the same bits everywhere (and the same order
  // as TcpGroup::AllReduceSum, so both transports agree).
  Status st;
  std::vector<float> sum;
  for (int r = 0; r < group_->size() && st.ok(); ++r) {
    if (group_->input_bytes(r) != data.size_bytes()) {
      st = InvalidArgument("all-reduce: rank {} gives {} bytes, rank {} gives {}", r, group_->input_bytes(r),
                           rank_, data.size_bytes());
    }
  }
  if (st.ok()) {
    const float* x0 = static_cast<const float*>(group_->input(0));
    sum.assign(x0, x0 + data.size());
    for (int r = 1; r < group_->size(); ++r) {
      const float* x = static_cast<const float*>(group_->input(r));
      for (size_t i = 0; i < data.size(); ++i) sum[i] += x[i];
    }
  }
  DL_RETURN_IF_ERROR(group_->Barrier(rank_, "all-reduce (release)"));
  DL_RETURN_IF_ERROR(st);
  std::copy(sum.begin(), sum.end(), data.begin());
  return Status::Ok();
}

Status InProcessRank::AllGather(std::span<const std::byte> local, std::span<const size_t> bytes_per_rank,
                                std::span<std::byte> out) {
  ++collectives_issued_;
  group_->Post(rank_, local.data(), local.size());
  DL_RETURN_IF_ERROR(group_->Barrier(rank_, "all-gather"));
  Status st;
  if (static_cast<int>(bytes_per_rank.size()) != group_->size()) {
    st = InvalidArgument("all-gather: {} sizes for a group of {}", bytes_per_rank.size(), group_->size());
  }
  size_t offset = 0;
  for (int r = 0; r < group_->size() && st.ok(); ++r) {
    if (group_->input_bytes(r) != bytes_per_rank[r]) {
      st = InvalidArgument("all-gather: rank {} gives {} bytes where {} were expected", r,
                           group_->input_bytes(r), bytes_per_rank[r]);
    } else if (offset + bytes_per_rank[r] > out.size()) {
      st = InvalidArgument("all-gather: output of {} bytes is too small", out.size());
    } else {
      if (bytes_per_rank[r] > 0) std::memcpy(out.data() + offset, group_->input(r), bytes_per_rank[r]);
      offset += bytes_per_rank[r];
    }
  }
  DL_RETURN_IF_ERROR(group_->Barrier(rank_, "all-gather (release)"));
  return st;
}

void InProcessRank::Abort(const Status& reason) { group_->Abort(rank_, reason); }

}  // namespace

std::shared_ptr<InProcessGroup> InProcessGroup::Create(int size, double timeout_s) {
  return std::make_shared<InProcessGroupImpl>(size, timeout_s);
}

}  // namespace dl::comm
