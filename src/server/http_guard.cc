#include "server/http_guard.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace dl::http {

namespace {

using Clock = std::chrono::steady_clock;

double Now() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

// Every wait is cut into slices this long so `stopping` and deadlines are noticed promptly.
constexpr int kSliceMs = 100;
// After an error response on a connection whose request was not read to its end: how long and how
// much to keep reading (and discarding) before closing, so the client sees the response rather than
// a reset.
constexpr double kLingerSeconds = 1.0;
constexpr size_t kLingerBytes = 4u << 20;

int SliceMs(double seconds_left) {
  if (seconds_left <= 0) return 0;
  return static_cast<int>(std::min<double>(kSliceMs, seconds_left * 1000.0 + 1.0));
}

// Writes all of `data` within `timeout_s` (never longer than 1 s once `stopping` is set).
bool SendAll(socket_t sock, const char* data, size_t size, double timeout_s,
             const std::atomic<bool>* stopping) {
  double deadline = Now() + timeout_s;
  bool stop_seen = false;
  size_t off = 0;
  while (off < size) {
    if (!stop_seen && stopping && stopping->load()) {
      stop_seen = true;
      deadline = std::min(deadline, Now() + 1.0);
    }
    const ssize_t n = ::send(sock, data + off, size - off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      off += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
    const double left = deadline - Now();
    if (left <= 0) return false;
    pollfd p{sock, POLLOUT, 0};
    if (::poll(&p, 1, SliceMs(left)) < 0 && errno != EINTR) return false;
  }
  return true;
}

std::string ErrorJson(int status, const std::string& message, const char* code) {
  nlohmann::json err = {{"message", message},
                        {"type", status >= 500 ? "server_error" : "invalid_request_error"},
                        {"param", nullptr},
                        {"code", code}};
  return nlohmann::json{{"error", err}}.dump(-1, ' ', false,
                                            nlohmann::json::error_handler_t::replace);
}

thread_local Connection* t_connection = nullptr;
// Set while the accept thread runs a connection's task only to refuse it (see Pool::enqueue).
thread_local bool t_refusing = false;

}  // namespace

std::string RawJsonResponse(int status, const std::string& reason, const std::string& json_body) {
  return fmt::format(
      "HTTP/1.1 {} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: "
      "close\r\n\r\n{}",
      status, reason, json_body.size(), json_body);
}

// One client connection: a buffered socket reader that enforces the per-request limits while
// cpp-httplib parses the request through it.
class Connection final : public httplib::Stream {
 public:
  Connection(socket_t sock, const Limits& limits, const std::atomic<bool>* stopping)
      : sock_(sock), limits_(limits), stopping_(stopping), buf_(16u << 10) {
    body_cap_ = limits_.max_body_bytes * 2 + (64u << 10);
  }

  // A new request starts with its first byte already readable (or buffered).
  void BeginRequest() {
    phase_ = Phase::kHead;
    head_bytes_ = 0;
    header_lines_ = 0;
    line_len_ = 0;
    prev_ = 0;
    first_line_ = true;
    body_bytes_ = 0;
    deadline_ = Now() + limits_.header_timeout_s;
  }

  bool has_buffered() const { return off_ < len_; }
  bool rejected() const { return rejected_; }
  bool close_requested = false;

  bool ClientGone() {
    if (gone_) return true;
    pollfd p{sock_, static_cast<short>(POLLIN | POLLRDHUP), 0};
    if (::poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLERR | POLLHUP | POLLRDHUP | POLLNVAL)) {
      gone_ = true;
    } else if (p.revents & POLLIN) {
      char c;
      const ssize_t n = ::recv(sock_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        gone_ = true;
      }
    }
    return gone_;
  }

  bool is_readable() const override {
    if (off_ < len_) return true;
    pollfd p{sock_, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }

  bool is_writable() const override {
    return !rejected_ && !const_cast<Connection*>(this)->ClientGone();
  }

  ssize_t read(char* ptr, size_t size) override {
    if (rejected_) return -1;
    if (size == 0) return 0;
    if (off_ == len_) {
      const ssize_t r = Fill();
      if (r <= 0) return r;
    }
    size_t n = std::min(size, len_ - off_);
    if (phase_ == Phase::kHead) {
      // Scan what is delivered: the head ends with the first empty CRLF line after the request line.
      size_t i = 0;
      for (; i < n; ++i) {
        const char c = buf_[off_ + i];
        ++head_bytes_;
        ++line_len_;
        if (head_bytes_ > limits_.max_header_bytes) {
          if (first_line_) {
            Reject(414, "URI Too Long",
                   fmt::format("the request line is longer than {} bytes",
                               limits_.max_header_bytes),
                   "uri_too_long");
          } else {
            Reject(431, "Request Header Fields Too Large",
                   fmt::format("the request headers are larger than {} bytes",
                               limits_.max_header_bytes),
                   "request_header_fields_too_large");
          }
          return -1;
        }
        if (c == '\n') {
          const bool empty = line_len_ == 2 && prev_ == '\r';
          if (first_line_) {
            first_line_ = false;
          } else if (empty) {
            ++i;
            phase_ = Phase::kBody;
            deadline_ = Now() + limits_.body_timeout_s;
            break;
          } else if (++header_lines_ > limits_.max_header_count) {
            Reject(431, "Request Header Fields Too Large",
                   fmt::format("the request has more than {} header fields",
                               limits_.max_header_count),
                   "request_header_fields_too_large");
            return -1;
          }
          line_len_ = 0;
        }
        prev_ = c;
      }
      // Bytes after the head in the same delivery belong to the body.
      if (phase_ == Phase::kBody) body_bytes_ += n - i;
    } else {
      body_bytes_ += n;
    }
    if (phase_ == Phase::kBody && body_bytes_ > body_cap_) {
      Reject(413, "Payload Too Large",
             fmt::format("the request body is larger than the server's limit of {} bytes "
                         "(--max-body-bytes)",
                         limits_.max_body_bytes),
             "request_too_large");
      return -1;
    }
    std::copy_n(buf_.data() + off_, n, ptr);
    off_ += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    // After a limit response the library's own answer (a 400 for a failed read) is dropped: the
    // client already has the precise one.
    if (rejected_) return static_cast<ssize_t>(size);
    if (!SendAll(sock_, ptr, size, limits_.write_timeout_s, stopping_)) {
      gone_ = true;
      return -1;
    }
    return static_cast<ssize_t>(size);
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    if (::getpeername(sock_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) Describe(addr, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    if (::getsockname(sock_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) Describe(addr, ip, port);
  }
  socket_t socket() const override { return sock_; }

 private:
  enum class Phase { kHead, kBody };

  static void Describe(const sockaddr_storage& addr, std::string& ip, int& port) {
    char text[INET6_ADDRSTRLEN] = {};
    if (addr.ss_family == AF_INET) {
      const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
      ::inet_ntop(AF_INET, &a->sin_addr, text, sizeof text);
      port = ntohs(a->sin_port);
    } else if (addr.ss_family == AF_INET6) {
      const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
      ::inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof text);
      port = ntohs(a->sin6_port);
    }
    ip = text;
  }

  // Reads more bytes into the buffer: > 0 bytes, 0 at end of stream, -1 on error, deadline
  // (after writing 408) or shutdown.
  ssize_t Fill() {
    while (true) {
      if (stopping_ && stopping_->load()) return -1;
      const double left = deadline_ - Now();
      if (left <= 0) {
        Reject(408, "Request Timeout",
               phase_ == Phase::kHead
                   ? fmt::format("the request line and headers did not arrive within {} s",
                                 limits_.header_timeout_s)
                   : fmt::format("the request body did not arrive within {} s",
                                 limits_.body_timeout_s),
               "request_timeout");
        return -1;
      }
      pollfd p{sock_, POLLIN, 0};
      const int r = ::poll(&p, 1, SliceMs(left));
      if (r < 0) {
        if (errno == EINTR) continue;
        return -1;
      }
      if (r == 0) continue;
      const ssize_t n = ::recv(sock_, buf_.data(), buf_.size(), MSG_DONTWAIT);
      if (n > 0) {
        off_ = 0;
        len_ = static_cast<size_t>(n);
        return n;
      }
      if (n == 0) {
        gone_ = true;
        return 0;
      }
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      gone_ = true;
      return -1;
    }
  }

  void Reject(int status, const char* reason, const std::string& message, const char* code) {
    const std::string response = RawJsonResponse(status, reason, ErrorJson(status, message, code));
    (void)SendAll(sock_, response.data(), response.size(), 1.0, stopping_);
    rejected_ = true;
  }

  socket_t sock_;
  const Limits& limits_;
  const std::atomic<bool>* stopping_;
  std::vector<char> buf_;
  size_t off_ = 0, len_ = 0;
  Phase phase_ = Phase::kHead;
  size_t head_bytes_ = 0, header_lines_ = 0, line_len_ = 0, body_bytes_ = 0, body_cap_ = 0;
  char prev_ = 0;
  bool first_line_ = true;
  double deadline_ = 0;
  bool rejected_ = false;
  bool gone_ = false;
};

Connection* CurrentConnection() { return t_connection; }

bool CurrentClientGone() { return t_connection != nullptr && t_connection->ClientGone(); }

void CloseCurrentConnectionAfterResponse() {
  if (t_connection != nullptr) t_connection->close_requested = true;
}

// Connections get a worker each up to the limit; beyond it the accept thread runs the task itself
// with t_refusing set, and process_and_close_socket hands the socket to the refusal thread.
class GuardedServer::Pool final : public httplib::TaskQueue {
 public:
  Pool(GuardedServer* server, size_t threads) : server_(server), pool_(threads) {}
  void enqueue(std::function<void()> fn) override {
    if (server_->open_.load() >= server_->limits_.max_connections) {
      t_refusing = true;
      fn();
      t_refusing = false;
      return;
    }
    ++server_->open_;
    pool_.enqueue(std::move(fn));
  }
  void shutdown() override { pool_.shutdown(); }

 private:
  GuardedServer* server_;
  httplib::ThreadPool pool_;
};

GuardedServer::GuardedServer(Limits limits, const std::atomic<bool>* stopping)
    : limits_(limits), stopping_(stopping) {
  limits_.max_connections = std::max(1, limits_.max_connections);
  limits_.keep_alive_max_requests = std::max<size_t>(1, limits_.keep_alive_max_requests);
  const size_t threads = static_cast<size_t>(limits_.max_connections);
  new_task_queue = [this, threads] { return new Pool(this, threads); };
  set_payload_max_length(limits_.max_body_bytes);
  set_read_timeout(static_cast<time_t>(std::max(1.0, limits_.header_timeout_s)), 0);
  set_write_timeout(static_cast<time_t>(std::max(1.0, limits_.write_timeout_s)), 0);
  set_keep_alive_timeout(static_cast<time_t>(std::max(1.0, limits_.keep_alive_timeout_s)));
  set_keep_alive_max_count(limits_.keep_alive_max_requests);
  refuse_thread_ = std::thread([this] { RefusalLoop(); });
}

GuardedServer::~GuardedServer() {
  {
    std::lock_guard lock(refuse_mu_);
    refuse_quit_ = true;
  }
  refuse_cv_.notify_all();
  if (refuse_thread_.joinable()) refuse_thread_.join();
}

void GuardedServer::Refuse(socket_t sock) {
  std::unique_lock lock(refuse_mu_);
  if (refuse_quit_ || refused_.size() >= 1024) {
    lock.unlock();
    ::close(sock);
    return;
  }
  refused_.push_back(sock);
  lock.unlock();
  refuse_cv_.notify_one();
}

// Sends each refused connection its 503, then drains and closes them all from one poll loop, each
// within kLingerSeconds.
void GuardedServer::RefusalLoop() {
  struct Lingering {
    socket_t sock;
    double deadline;
    size_t drained;
  };
  std::vector<Lingering> lingering;
  const std::string response = RawJsonResponse(
      503, "Service Unavailable",
      ErrorJson(503,
                fmt::format("the server is at its limit of {} open connections; retry later",
                            limits_.max_connections),
                "too_many_connections"));
  char sink[16384];
  while (true) {
    {
      std::unique_lock lock(refuse_mu_);
      if (lingering.empty()) {
        refuse_cv_.wait(lock, [&] { return refuse_quit_ || !refused_.empty(); });
      }
      if (refuse_quit_) break;
      while (!refused_.empty()) {
        const socket_t s = refused_.front();
        refused_.pop_front();
        // A fresh socket's send buffer holds this short response without blocking.
        (void)::send(s, response.data(), response.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        ::shutdown(s, SHUT_WR);
        lingering.push_back({s, Now() + kLingerSeconds, 0});
      }
    }
    std::vector<pollfd> fds;
    for (const auto& l : lingering) fds.push_back({l.sock, POLLIN, 0});
    (void)::poll(fds.data(), fds.size(), 20);
    const double now = Now();
    for (size_t i = 0; i < lingering.size();) {
      Lingering& l = lingering[i];
      bool done = now >= l.deadline || l.drained >= kLingerBytes;
      if (!done && (fds[i].revents & (POLLIN | POLLHUP | POLLERR))) {
        const ssize_t n = ::recv(l.sock, sink, sizeof sink, MSG_DONTWAIT);
        if (n > 0) {
          l.drained += static_cast<size_t>(n);
        } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          done = true;
        }
      }
      if (done) {
        ::close(l.sock);
        fds[i] = fds.back();
        fds.pop_back();
        lingering[i] = lingering.back();
        lingering.pop_back();
      } else {
        ++i;
      }
    }
  }
  for (const auto& l : lingering) ::close(l.sock);
  std::lock_guard lock(refuse_mu_);
  for (socket_t s : refused_) ::close(s);
  refused_.clear();
}

bool GuardedServer::process_and_close_socket(socket_t sock) {
  if (t_refusing) {
    Refuse(sock);
    return false;
  }
  struct Release {
    std::atomic<int>& open;
    ~Release() { --open; }
  } release{open_};
  Connection conn(sock, limits_, stopping_);
  t_connection = &conn;
  auto stop = [&] { return svr_sock_ == INVALID_SOCKET || (stopping_ && stopping_->load()); };
  // Waits (in slices, watching for shutdown) until the next request's first byte is there.
  auto next_request = [&] {
    if (conn.has_buffered()) return true;
    const double deadline = Now() + limits_.keep_alive_timeout_s;
    while (!stop()) {
      const double left = deadline - Now();
      if (left <= 0) return false;
      pollfd p{sock, POLLIN, 0};
      const int r = ::poll(&p, 1, SliceMs(left));
      if (r > 0) return true;
      if (r < 0 && errno != EINTR) return false;
    }
    return false;
  };
  bool ret = false;
  for (size_t left = limits_.keep_alive_max_requests; left > 0 && !stop() && next_request();
       --left) {
    conn.BeginRequest();
    bool connection_closed = false;
    try {
      ret = process_request(conn, left == 1, connection_closed, nullptr);
    } catch (...) {
      // cpp-httplib writes responses (and calls the error handler and stream providers) outside
      // its own try block; whatever escapes ends this connection, never the process.
      ret = false;
    }
    if (!ret || connection_closed || conn.rejected() || conn.close_requested) break;
  }
  t_connection = nullptr;
  if (conn.rejected() || conn.close_requested) {
    // Unread request bytes may follow: linger so the client reads the response, not a reset.
    ::shutdown(sock, SHUT_WR);
    const double deadline = Now() + kLingerSeconds;
    size_t drained = 0;
    char sink[16384];
    while (drained < kLingerBytes && !stop()) {
      const double left = deadline - Now();
      if (left <= 0) break;
      pollfd p{sock, POLLIN, 0};
      if (::poll(&p, 1, SliceMs(left)) <= 0) continue;
      const ssize_t n = ::recv(sock, sink, sizeof sink, MSG_DONTWAIT);
      if (n <= 0) break;
      drained += static_cast<size_t>(n);
    }
  } else {
    ::shutdown(sock, SHUT_RDWR);
  }
  ::close(sock);
  return ret;
}

bool JsonNestingExceeds(const std::string& text, size_t max_depth) {
  size_t depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return true;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return false;
}

}  // namespace dl::http
