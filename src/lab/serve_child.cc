#include "lab/serve_child.h"

#include <signal.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>

namespace dl::lab {

Result<std::unique_ptr<ServeChild>> ServeChild::Start(const std::string& binary, const std::vector<std::string>& args,
                                                      const std::string& log_path, double timeout_s) {
  std::unique_ptr<ServeChild> c(new ServeChild());
  comm::SpawnSpec spec;
  spec.exe = binary;
  spec.argv = {binary, "serve"};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.argv.insert(spec.argv.end(), {"--host", "127.0.0.1", "--port", "0"});
  spec.env = comm::EnvironmentWith({});
  spec.output_path = log_path;
  c->argv_ = spec.argv;
  DL_ASSIGN_OR_RETURN(c->child_, comm::ChildProcess::Spawn(spec));
  const double deadline = MonotonicSeconds() + timeout_s;
  auto log_text = [&] {
    std::ifstream in(log_path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  std::string url;
  while (url.empty() && MonotonicSeconds() < deadline) {
    if (c->child_.Poll()) {
      std::string tail = log_text();
      if (tail.size() > 1500) tail = tail.substr(tail.size() - 1500);
      return Unavailable("decodelab serve exited before it was ready ({}); {}:\n{}", c->child_.exit_info().ToString(),
                         log_path, tail);
    }
    const std::string log = log_text();
    const size_t at = log.find("ready at ");
    const size_t end = at == std::string::npos ? at : log.find('\n', at);
    if (end != std::string::npos) url = log.substr(at + 9, end - at - 9);
    if (url.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (url.empty()) {
    c->child_.KillAndReap();
    return Unavailable("decodelab serve did not print its URL within {} s (see {})", timeout_s, log_path);
  }
  DL_ASSIGN_OR_RETURN(c->ep_, ParseEndpoint(url));
  while (MonotonicSeconds() < deadline) {
    if (Healthy(c->ep_)) return c;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  c->child_.KillAndReap();
  return Unavailable("{}: /health did not answer 200 within {} s", url, timeout_s);
}

ServeChild::~ServeChild() { Stop(); }

void ServeChild::Stop() {
  if (!child_.running()) return;
  ::kill(child_.pid(), SIGTERM);
  const double deadline = MonotonicSeconds() + 20;
  while (MonotonicSeconds() < deadline) {
    if (child_.Poll()) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  child_.KillAndReap();
}

}  // namespace dl::lab
