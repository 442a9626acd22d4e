// Child processes for supervisors: each child starts in its own process group (so one kill(-pgid)
// reaches everything it started), dies with its parent (PR_SET_PDEATHSIG), and is always reaped.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"

namespace dl::comm {

struct SpawnSpec {
  std::string exe;                // path given to execve, e.g. "/proc/self/exe"
  std::vector<std::string> argv;  // argv[0] included
  std::vector<std::string> env;   // "NAME=value"; the child's whole environment
  std::string output_path;        // stdout and stderr go here (truncated); /dev/null when empty
  int output_fd = -1;             // when >= 0, stdout and stderr go to this descriptor instead
  int pass_fd = -1;               // when >= 0, this descriptor is passed to the child as kPassedFd
};

// The descriptor number a passed descriptor gets in the child.
inline constexpr int kPassedFd = 3;

// How a reaped child ended.
struct ExitInfo {
  bool exited = false;  // exited on its own with `code`
  int code = -1;
  int signal = 0;  // the signal that killed it, when !exited
  std::string ToString() const;
};

class ChildProcess {
 public:
  ChildProcess() = default;
  ChildProcess(ChildProcess&& other) noexcept { *this = std::move(other); }
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  // Kills the group and reaps the child if the owner forgot: never leaves a zombie or an orphan.
  ~ChildProcess();

  // fork + setpgid + execve. The error names the executable.
  static Result<ChildProcess> Spawn(const SpawnSpec& spec);

  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0 && !reaped_; }
  bool reaped() const { return reaped_; }
  const ExitInfo& exit_info() const { return exit_; }

  // Non-blocking: reaps the child if it has ended. True once reaped.
  bool Poll();
  // SIGKILL to the child's whole process group (also after the leader ended: a grandchild that
  // stayed in the group dies too).
  void KillGroup();
  // Kills the group and waits until the child is reaped.
  void KillAndReap();

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  ExitInfo exit_;
};

// Runs `spec` to its end. After `timeout_s` its process group is killed and the result is
// DeadlineExceeded naming the executable; a spawn failure is the spawn's error.
Result<ExitInfo> RunToCompletion(const SpawnSpec& spec, double timeout_s);

// `name` resolved on $PATH as execvp would (a name containing '/' is returned unchanged); empty
// when no executable of that name is found.
std::string FindExecutable(const std::string& name);

// The current environment with `overrides` ("NAME=value") replacing or adding variables.
std::vector<std::string> EnvironmentWith(const std::vector<std::string>& overrides);

// True while a process with this pid exists (a zombie counts as existing).
bool ProcessExists(pid_t pid);
// True while a process with this pid exists and is not a zombie (a dead grandchild re-parented to a
// PID 1 that never reaps stays a zombie in some containers: it is gone for our purposes).
bool ProcessIsRunning(pid_t pid);

}  // namespace dl::comm
