// Limits the packaged cpp-httplib (Debian 12: 0.11.4, compiled into libcpp-httplib.so) cannot
// enforce itself, for a server that faces untrusted clients:
//
//   * request line + headers: at most `max_header_bytes` bytes and `max_header_count` fields (431;
//     414 when the request line alone is too long). 0.11.4 accumulates a header line of any length
//     in memory before it checks CPPHTTPLIB_HEADER_MAX_LENGTH, and counts no fields at all.
//   * the request line and headers must arrive within `header_timeout_s`, the body within
//     `body_timeout_s` after them (408): the library's read timeout is per recv() call, so a client
//     trickling one byte at a time held a worker thread forever.
//   * raw body bytes at most 2 x `max_body_bytes` + 64 KiB (413): 0.11.4 checks
//     set_payload_max_length only against Content-Length, never for chunked or length-less bodies.
//     The exact limit on the decoded body is the route's (Server checks req.body.size()).
//   * at most `max_connections` connections in service; beyond it a connection gets an immediate
//     503 with `Connection: close` instead of waiting behind busy workers.
//   * every blocking read and write wakes up at least every 100 ms to notice `stopping`, so a
//     shutdown never waits on a silent client.
//
// The subclass replaces httplib::Server::process_and_close_socket (a virtual in 0.11.4) with its
// own keep-alive loop around the library's protected process_request, reading through a Stream that
// enforces the limits above. Requests that break a limit get the OpenAI error envelope and the
// connection is closed after a short lingering drain (so the client reads the response instead of a
// reset).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include <httplib.h>

namespace dl::http {

struct Limits {
  size_t max_body_bytes = 16u << 20;
  size_t max_header_bytes = 32u << 10;  // request line and every header line, CRLFs included
  size_t max_header_count = 100;
  int max_connections = 160;  // connections being served at once; more get 503
  double header_timeout_s = 10;
  double body_timeout_s = 60;
  double write_timeout_s = 30;         // one write() call
  double keep_alive_timeout_s = 2;     // idle time between requests on one connection
  size_t keep_alive_max_requests = 100;
};

// The connection the calling thread is serving (inside a route handler or content provider), or
// null outside one.
class Connection;
Connection* CurrentConnection();
// True once the client of the current request has closed its end or the socket failed (a peer that
// half-closes its sending side counts as gone). False outside a request.
bool CurrentClientGone();
// Closes the current connection once the response is written (the rest of the request is unread).
void CloseCurrentConnectionAfterResponse();

class GuardedServer : public httplib::Server {
 public:
  // `stopping` is read by every wait of the connection threads; it must outlive the server.
  GuardedServer(Limits limits, const std::atomic<bool>* stopping);
  ~GuardedServer() override;

  const Limits& limits() const { return limits_; }
  int open_connections() const { return open_.load(); }

 private:
  class Pool;
  bool process_and_close_socket(socket_t sock) override;
  void Refuse(socket_t sock);
  void RefusalLoop();

  Limits limits_;
  const std::atomic<bool>* stopping_;
  std::atomic<int> open_{0};
  // Refused sockets get their 503 and a lingering close on this thread, off the accept loop.
  std::mutex refuse_mu_;
  std::condition_variable refuse_cv_;
  std::deque<socket_t> refused_;
  bool refuse_quit_ = false;
  std::thread refuse_thread_;
};

// The JSON text `text` nests arrays/objects deeper than `max_depth` (a linear scan of the raw text
// that never recurses, run before parsing). Invalid JSON is left to the parser.
bool JsonNestingExceeds(const std::string& text, size_t max_depth);

// An HTTP response as raw bytes, for errors written before or outside cpp-httplib's response path.
std::string RawJsonResponse(int status, const std::string& reason, const std::string& json_body);

}  // namespace dl::http
