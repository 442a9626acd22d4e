// A small TCP process group used for rendezvous (handing rank 0's NCCL unique id to every rank)
// and, in the probe's `sim` transport, as the collective itself. Star topology: rank 0 accepts one
// connection from every other rank. Every call takes a deadline and returns kDeadlineExceeded
// instead of blocking past it, naming the rank it was waiting for.
#pragma once

#include <chrono>
#include <memory>
#include <span>
#include <vector>

#include "base/status.h"
#include "comm/launch_env.h"

namespace dl::comm {

using Deadline = std::chrono::steady_clock::time_point;
Deadline DeadlineIn(double seconds);

struct Listener {
  int fd = -1;   // owned by the caller (close it, or hand it to TcpGroup::Create)
  int port = 0;  // the bound port (useful when 0 was asked for)
};

// Binds and listens on host:port ("0.0.0.0" or "" for every interface; port 0 picks a free one).
Result<Listener> Listen(const std::string& host, int port, int backlog = 1024);

class TcpGroup {
 public:
  ~TcpGroup();
  TcpGroup(const TcpGroup&) = delete;
  TcpGroup& operator=(const TcpGroup&) = delete;

  // Rank 0 accepts world_size-1 peers: on `listen_fd` when >= 0 (the group takes ownership), else
  // on a socket it binds to every interface at root.port. Other ranks connect to `root`, retrying
  // until the deadline while rank 0 is not yet listening.
  static Result<std::unique_ptr<TcpGroup>> Create(int rank, int world_size, int listen_fd,
                                                  const Endpoint& root, Deadline deadline);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  // Rank 0's `bytes` bytes at `data` are copied to every rank's `data`.
  Status Broadcast(void* data, size_t bytes, Deadline deadline);
  // Element-wise sum over all ranks, result on every rank (gathered and summed on rank 0 in rank
  // order, so the result is the same on every rank).
  Status AllReduceSum(std::span<float> data, Deadline deadline);
  Status Barrier(Deadline deadline);
  // Every rank's `local` concatenated in rank order into every rank's `out` (gathered on rank 0, then
  // sent to every rank); rank r contributes bytes_per_rank[r] bytes.
  Status AllGather(const void* local, std::span<const size_t> bytes_per_rank, void* out, Deadline deadline);

  // Point-to-point messages of any length, for a control channel (a tensor-parallel step plan and
  // its replies): rank 0 to any rank, any other rank to rank 0 only. A message above `max_bytes`
  // is refused (DataLoss) without reading it; a closed connection is kUnavailable ("the peer closed
  // the connection"), so the receiver learns at once that its peer is gone.
  Status SendMessage(int peer, std::span<const std::byte> message, Deadline deadline);
  Result<std::vector<std::byte>> ReceiveMessage(int peer, size_t max_bytes, Deadline deadline);

 private:
  TcpGroup(int rank, int world_size) : rank_(rank), world_size_(world_size) {}
  Status SendFrame(int peer, uint32_t tag, const void* data, size_t bytes, Deadline deadline);
  Status RecvFrame(int peer, uint32_t tag, void* data, size_t bytes, Deadline deadline);

  int rank_;
  int world_size_;
  // Rank 0: peers_[r] is the socket to rank r (peers_[0] unused). Other ranks: peers_[0] is rank 0.
  std::vector<int> peers_;
};

}  // namespace dl::comm
