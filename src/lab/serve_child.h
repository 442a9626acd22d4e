// A `decodelab serve` child process for the lab's runs and `bench serve`.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "comm/process.h"
#include "lab/lab_client.h"

namespace dl::lab {

// A `decodelab serve` child on an ephemeral loopback port, stopped (SIGTERM, then a group kill) when
// destroyed.
class ServeChild {
 public:
  // Starts `binary serve <args> --host 127.0.0.1 --port 0`, logging to log_path, and waits until it
  // prints its URL and answers /health (at most timeout_s); the child is killed if it does not.
  static Result<std::unique_ptr<ServeChild>> Start(const std::string& binary, const std::vector<std::string>& args,
                                                   const std::string& log_path, double timeout_s);
  ~ServeChild();
  const Endpoint& endpoint() const { return ep_; }
  // The whole command line, argv[0] included.
  const std::vector<std::string>& argv() const { return argv_; }
  // SIGTERM, then up to 20 s for a clean stop, then a group kill.
  void Stop();
  // How the child ended (once stopped).
  std::string ExitReason() const { return child_.reaped() ? child_.exit_info().ToString() : "running"; }

 private:
  ServeChild() = default;
  comm::ChildProcess child_;
  Endpoint ep_;
  std::vector<std::string> argv_;
};

}  // namespace dl::lab
