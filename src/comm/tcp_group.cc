#include "comm/tcp_group.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

namespace dl::comm {
namespace {

constexpr uint32_t kMagic = 0x444c5047;  // "DLPG"
enum Tag : uint32_t {
  kHello = 1,
  kBroadcast = 2,
  kReduceIn = 3,
  kReduceOut = 4,
  kBarrier = 5,
  kWelcome = 6,
  kGatherIn = 7,
  kGatherOut = 8,
  kMessage = 9
};

struct FrameHeader {
  uint32_t magic;
  uint32_t tag;
  uint64_t bytes;
};

struct Hello {
  uint32_t rank;
  uint32_t world_size;
};

int RemainingMs(Deadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  return left.count() <= 0 ? 0 : static_cast<int>(std::min<long long>(left.count(), 1 << 30));
}

Status Timeout(std::string what) {
  return Status(StatusCode::kDeadlineExceeded, std::move(what));
}

Status SetNonBlocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return Internal("fcntl(O_NONBLOCK) failed: {}", std::strerror(errno));
  }
  return Status::Ok();
}

// Waits until fd is ready for `events`; kDeadlineExceeded when the deadline passes first.
Status WaitFd(int fd, short events, Deadline deadline, const std::string& what) {
  for (;;) {
    pollfd p{fd, events, 0};
    int ms = RemainingMs(deadline);
    int r = ::poll(&p, 1, ms);
    if (r > 0) return Status::Ok();
    if (r == 0) return Timeout(fmt::format("timed out {}", what));
    if (errno != EINTR) return Internal("poll failed {}: {}", what, std::strerror(errno));
  }
}

Status SendAll(int fd, const void* data, size_t bytes, Deadline deadline, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      bytes -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      DL_RETURN_IF_ERROR(WaitFd(fd, POLLOUT, deadline, what));
      continue;
    }
    return Unavailable("{}: send failed: {}", what, std::strerror(errno));
  }
  return Status::Ok();
}

Status RecvAll(int fd, void* data, size_t bytes, Deadline deadline, const std::string& what) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    ssize_t n = ::recv(fd, p, bytes, 0);
    if (n > 0) {
      p += n;
      bytes -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return Unavailable("{}: the peer closed the connection", what);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      DL_RETURN_IF_ERROR(WaitFd(fd, POLLIN, deadline, what));
      continue;
    }
    return Unavailable("{}: recv failed: {}", what, std::strerror(errno));
  }
  return Status::Ok();
}

// One non-blocking connect attempt bounded by the deadline; returns the connected fd.
Result<int> ConnectOnce(const addrinfo* ai, Deadline deadline, const std::string& what) {
  int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
  if (fd < 0) return Unavailable("{}: socket failed: {}", what, std::strerror(errno));
  Status st = SetNonBlocking(fd);
  if (!st.ok()) {
    ::close(fd);
    return st;
  }
  if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) return fd;
  if (errno != EINPROGRESS) {
    int err = errno;
    ::close(fd);
    return Unavailable("{}: connect failed: {}", what, std::strerror(err));
  }
  st = WaitFd(fd, POLLOUT, deadline, what);
  if (!st.ok()) {
    ::close(fd);
    return st;
  }
  int err = 0;
  socklen_t len = sizeof(err);
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) {
    ::close(fd);
    return Unavailable("{}: connect failed: {}", what, std::strerror(err));
  }
  return fd;
}

}  // namespace

Deadline DeadlineIn(double seconds) {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
             std::chrono::duration<double>(seconds));
}

Result<Listener> Listen(const std::string& host, int port, int backlog) {
  std::string bind_host = host.empty() ? "0.0.0.0" : host;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string port_str = std::to_string(port);
  int rc = ::getaddrinfo(bind_host.c_str(), port_str.c_str(), &hints, &res);
  if (rc != 0) {
    return InvalidArgument("cannot resolve rendezvous address {}: {}", bind_host, gai_strerror(rc));
  }
  std::string last_error = "no address";
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, backlog) != 0) {
      last_error = std::strerror(errno);
      ::close(fd);
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
    int bound = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                         : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    ::freeaddrinfo(res);
    return Listener{fd, bound};
  }
  ::freeaddrinfo(res);
  return Unavailable("cannot listen on {}:{}: {}", bind_host, port, last_error);
}

TcpGroup::~TcpGroup() {
  for (int fd : peers_) {
    if (fd >= 0) ::close(fd);
  }
}

Result<std::unique_ptr<TcpGroup>> TcpGroup::Create(int rank, int world_size, int listen_fd,
                                                   const Endpoint& root, Deadline deadline) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    if (listen_fd >= 0) ::close(listen_fd);
    return InvalidArgument("rank {} is outside a group of {}", rank, world_size);
  }
  std::unique_ptr<TcpGroup> g(new TcpGroup(rank, world_size));
  if (rank == 0) {
    g->peers_.assign(world_size, -1);
    if (listen_fd < 0) {
      DL_ASSIGN_OR_RETURN(Listener l, Listen("0.0.0.0", root.port));
      listen_fd = l.fd;
    }
    Status st = SetNonBlocking(listen_fd);
    int joined = 1;
    while (st.ok() && joined < world_size) {
      int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
          st = WaitFd(listen_fd, POLLIN, deadline,
                      fmt::format("rank 0 waiting for {} of {} ranks to connect to port {}",
                                  world_size - joined, world_size - 1, root.port));
          continue;
        }
        st = Unavailable("rank 0: accept failed: {}", std::strerror(errno));
        break;
      }
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      FrameHeader h{};
      Hello hello{};
      Status hs = RecvAll(fd, &h, sizeof(h), deadline, "rank 0 reading a hello");
      if (hs.ok()) hs = RecvAll(fd, &hello, sizeof(hello), deadline, "rank 0 reading a hello");
      if (!hs.ok() || h.magic != kMagic || h.tag != kHello) {
        ::close(fd);  // a stray connection (port scanner, stale rank): ignore it
        if (hs.code() == StatusCode::kDeadlineExceeded) st = hs;
        continue;
      }
      if (static_cast<int>(hello.world_size) != world_size || hello.rank == 0 ||
          static_cast<int>(hello.rank) >= world_size || g->peers_[hello.rank] >= 0) {
        ::close(fd);
        st = FailedPrecondition(
            "rank 0: a peer says it is rank {} of {}, but this group has {} ranks{}", hello.rank,
            hello.world_size, world_size,
            hello.rank < static_cast<uint32_t>(world_size) && hello.rank > 0 &&
                    g->peers_[hello.rank] >= 0
                ? " and that rank already joined"
                : "");
        break;
      }
      g->peers_[hello.rank] = fd;
      ++joined;
    }
    ::close(listen_fd);
    if (!st.ok()) {
      std::string missing;
      for (int r = 1; r < world_size; ++r) {
        if (g->peers_[r] < 0) missing += (missing.empty() ? "" : ",") + std::to_string(r);
      }
      return st.WithContext(fmt::format("rendezvous (ranks not connected: {})", missing));
    }
    // Tell every peer the group is complete, so a rank's Create returns only once all have joined.
    for (int r = 1; r < world_size; ++r) {
      Hello ack{0, static_cast<uint32_t>(world_size)};
      DL_RETURN_IF_ERROR(
          g->SendFrame(r, kWelcome, &ack, sizeof(ack), deadline).WithContext("rendezvous"));
    }
    return g;
  }

  if (listen_fd >= 0) ::close(listen_fd);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  std::string what = fmt::format("rank {} connecting to rank 0 at {}", rank, root.ToString());
  Status last = Timeout(fmt::format("timed out {}", what));
  while (std::chrono::steady_clock::now() < deadline) {
    addrinfo* res = nullptr;
    std::string port_str = std::to_string(root.port);
    int rc = ::getaddrinfo(root.host.c_str(), port_str.c_str(), &hints, &res);
    if (rc != 0) {
      last = Unavailable("{}: cannot resolve {}: {}", what, root.host, gai_strerror(rc));
    } else {
      for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
        Result<int> fd = ConnectOnce(ai, deadline, what);
        if (!fd.ok()) {
          last = fd.status();
          continue;
        }
        int one = 1;
        ::setsockopt(*fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        FrameHeader h{kMagic, kHello, sizeof(Hello)};
        Hello hello{static_cast<uint32_t>(rank), static_cast<uint32_t>(world_size)};
        Status st = SendAll(*fd, &h, sizeof(h), deadline, what);
        if (st.ok()) st = SendAll(*fd, &hello, sizeof(hello), deadline, what);
        if (!st.ok()) {
          ::close(*fd);
          last = st;
          continue;
        }
        ::freeaddrinfo(res);
        g->peers_.assign(1, *fd);
        // Connected is not joined: wait until rank 0 says every rank is there.
        Hello ack{};
        DL_RETURN_IF_ERROR(g->RecvFrame(0, kWelcome, &ack, sizeof(ack), deadline)
                               .WithContext(fmt::format("rank {} waiting for rank 0 to complete "
                                                        "the group of {}",
                                                        rank, world_size)));
        return g;
      }
      ::freeaddrinfo(res);
    }
    // Rank 0 may not be listening yet: retry (connection refused) until the deadline.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (last.code() != StatusCode::kDeadlineExceeded) {
    return Status(StatusCode::kDeadlineExceeded,
                  fmt::format("timed out; last error: {}", last.message()));
  }
  return last;
}

Status TcpGroup::SendFrame(int peer, uint32_t tag, const void* data, size_t bytes,
                           Deadline deadline) {
  int fd = rank_ == 0 ? peers_[peer] : peers_[0];
  std::string what = fmt::format("rank {} sending to rank {}", rank_, peer);
  FrameHeader h{kMagic, tag, bytes};
  DL_RETURN_IF_ERROR(SendAll(fd, &h, sizeof(h), deadline, what));
  return SendAll(fd, data, bytes, deadline, what);
}

Status TcpGroup::RecvFrame(int peer, uint32_t tag, void* data, size_t bytes, Deadline deadline) {
  int fd = rank_ == 0 ? peers_[peer] : peers_[0];
  std::string what = fmt::format("rank {} waiting for rank {}", rank_, peer);
  FrameHeader h{};
  DL_RETURN_IF_ERROR(RecvAll(fd, &h, sizeof(h), deadline, what));
  if (h.magic != kMagic || h.tag != tag || h.bytes != bytes) {
    return DataLoss("{}: expected message {} of {} bytes, got message {} of {} bytes", what, tag,
                    bytes, h.tag, h.bytes);
  }
  return RecvAll(fd, data, bytes, deadline, what);
}

Status TcpGroup::Broadcast(void* data, size_t bytes, Deadline deadline) {
  if (rank_ == 0) {
    for (int r = 1; r < world_size_; ++r) {
      DL_RETURN_IF_ERROR(SendFrame(r, kBroadcast, data, bytes, deadline));
    }
    return Status::Ok();
  }
  return RecvFrame(0, kBroadcast, data, bytes, deadline);
}

Status TcpGroup::AllReduceSum(std::span<float> data, Deadline deadline) {
  const size_t bytes = data.size_bytes();
  if (rank_ == 0) {
    std::vector<float> in(data.size());
    for (int r = 1; r < world_size_; ++r) {
      DL_RETURN_IF_ERROR(RecvFrame(r, kReduceIn, in.data(), bytes, deadline));
      for (size_t i = 0; i < data.size(); ++i) data[i] += in[i];
    }
    for (int r = 1; r < world_size_; ++r) {
      DL_RETURN_IF_ERROR(SendFrame(r, kReduceOut, data.data(), bytes, deadline));
    }
    return Status::Ok();
  }
  DL_RETURN_IF_ERROR(SendFrame(0, kReduceIn, data.data(), bytes, deadline));
  return RecvFrame(0, kReduceOut, data.data(), bytes, deadline);
}

Status TcpGroup::Barrier(Deadline deadline) {
  char token = 1;
  if (rank_ == 0) {
    for (int r = 1; r < world_size_; ++r) {
      DL_RETURN_IF_ERROR(RecvFrame(r, kBarrier, &token, 1, deadline));
    }
    for (int r = 1; r < world_size_; ++r) {
      DL_RETURN_IF_ERROR(SendFrame(r, kBarrier, &token, 1, deadline));
    }
    return Status::Ok();
  }
  DL_RETURN_IF_ERROR(SendFrame(0, kBarrier, &token, 1, deadline));
  return RecvFrame(0, kBarrier, &token, 1, deadline);
}

Status TcpGroup::AllGather(const void* local, std::span<const size_t> bytes_per_rank, void* out,
                           Deadline deadline) {
  if (static_cast<int>(bytes_per_rank.size()) != world_size_) {
    return InvalidArgument("all-gather: {} sizes for a group of {}", bytes_per_rank.size(), world_size_);
  }
  size_t total = 0;
  for (size_t b : bytes_per_rank) total += b;
  char* dst = static_cast<char*>(out);
  if (rank_ == 0) {
    if (bytes_per_rank[0] > 0) std::memcpy(dst, local, bytes_per_rank[0]);
    size_t offset = bytes_per_rank[0];
    for (int r = 1; r < world_size_; ++r) {
      DL_RETURN_IF_ERROR(RecvFrame(r, kGatherIn, dst + offset, bytes_per_rank[r], deadline));
      offset += bytes_per_rank[r];
    }
    for (int r = 1; r < world_size_; ++r) {
      DL_RETURN_IF_ERROR(SendFrame(r, kGatherOut, dst, total, deadline));
    }
    return Status::Ok();
  }
  DL_RETURN_IF_ERROR(SendFrame(0, kGatherIn, local, bytes_per_rank[rank_], deadline));
  return RecvFrame(0, kGatherOut, dst, total, deadline);
}

Status TcpGroup::SendMessage(int peer, std::span<const std::byte> message, Deadline deadline) {
  if (peer < 0 || peer >= world_size_ || peer == rank_ || (rank_ != 0 && peer != 0)) {
    return InvalidArgument("rank {} cannot send a message to rank {} (a star: rank 0 and one other)", rank_, peer);
  }
  return SendFrame(peer, kMessage, message.data(), message.size(), deadline);
}

Result<std::vector<std::byte>> TcpGroup::ReceiveMessage(int peer, size_t max_bytes, Deadline deadline) {
  if (peer < 0 || peer >= world_size_ || peer == rank_ || (rank_ != 0 && peer != 0)) {
    return InvalidArgument("rank {} cannot receive a message from rank {} (a star: rank 0 and one other)", rank_,
                           peer);
  }
  const int fd = rank_ == 0 ? peers_[peer] : peers_[0];
  const std::string what = fmt::format("rank {} waiting for a message from rank {}", rank_, peer);
  FrameHeader h{};
  DL_RETURN_IF_ERROR(RecvAll(fd, &h, sizeof(h), deadline, what));
  if (h.magic != kMagic || h.tag != kMessage) {
    return DataLoss("{}: expected a message, got frame {} (magic {:#x})", what, h.tag, h.magic);
  }
  if (h.bytes > max_bytes) return DataLoss("{}: a message of {} bytes, above the limit of {}", what, h.bytes, max_bytes);
  std::vector<std::byte> message(h.bytes);
  DL_RETURN_IF_ERROR(RecvAll(fd, message.data(), message.size(), deadline, what));
  return message;
}

}  // namespace dl::comm
