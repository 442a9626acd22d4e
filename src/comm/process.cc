#include "comm/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

extern char** environ;

namespace dl::comm {

std::string ExitInfo::ToString() const {
  if (exited) return fmt::format("exit code {}", code);
  if (signal != 0) return fmt::format("killed by signal {} ({})", signal, strsignal(signal));
  return "not started";
}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    if (running()) KillAndReap();
    pid_ = std::exchange(other.pid_, -1);
    reaped_ = std::exchange(other.reaped_, false);
    exit_ = other.exit_;
  }
  return *this;
}

ChildProcess::~ChildProcess() {
  if (running()) KillAndReap();
}

Result<ChildProcess> ChildProcess::Spawn(const SpawnSpec& spec) {
  if (spec.argv.empty()) return InvalidArgument("spawning {}: empty argv", spec.exe);
  // Everything the child needs is prepared before fork: after fork only async-signal-safe calls.
  std::vector<char*> argv, envp;
  for (const std::string& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const std::string& e : spec.env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);

  const char* out_path = spec.output_path.empty() ? "/dev/null" : spec.output_path.c_str();
  int out_fd = spec.output_fd >= 0
                   ? ::fcntl(spec.output_fd, F_DUPFD_CLOEXEC, 0)
                   : ::open(out_path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
  if (out_fd < 0) {
    return Unavailable("cannot open {} for the output of {}: {}",
                       spec.output_fd >= 0 ? "the output descriptor" : out_path, spec.exe,
                       std::strerror(errno));
  }
  int in_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (in_fd < 0) {
    ::close(out_fd);
    return Unavailable("cannot open /dev/null: {}", std::strerror(errno));
  }
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) {
    int err = errno;
    ::close(out_fd);
    ::close(in_fd);
    return Unavailable("fork for {} failed: {}", spec.exe, std::strerror(err));
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    // Die with the supervisor: a killed supervisor must not leave ranks behind.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(126);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::signal(SIGPIPE, SIG_DFL);
    ::dup2(in_fd, 0);
    ::dup2(out_fd, 1);
    ::dup2(out_fd, 2);
    if (spec.pass_fd >= 0) {
      if (spec.pass_fd != kPassedFd) {
        ::dup2(spec.pass_fd, kPassedFd);  // dup2 clears close-on-exec on the copy
      } else {
        ::fcntl(kPassedFd, F_SETFD, 0);
      }
    }
    ::execve(spec.exe.c_str(), argv.data(), envp.data());
    const char msg[] = "spawn: execve failed: ";
    ssize_t ignored = ::write(2, msg, sizeof(msg) - 1);
    const char* why = strerror(errno);
    ignored = ::write(2, why, std::strlen(why));
    ignored = ::write(2, "\n", 1);
    (void)ignored;
    ::_exit(127);
  }
  // Both sides set the group so a kill(-pid) right after Spawn cannot miss (no race with the
  // child).
  ::setpgid(pid, pid);
  ::close(out_fd);
  ::close(in_fd);
  ChildProcess child;
  child.pid_ = pid;
  return child;
}

bool ChildProcess::Poll() {
  if (pid_ <= 0) return false;
  if (reaped_) return true;
  int status = 0;
  pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    reaped_ = true;
    if (WIFEXITED(status)) {
      exit_.exited = true;
      exit_.code = WEXITSTATUS(status);
    } else if (WIFSIGNALED(status)) {
      exit_.signal = WTERMSIG(status);
    }
    return true;
  }
  if (r < 0 && errno == ECHILD) {  // someone else reaped it; nothing left to wait for
    reaped_ = true;
    return true;
  }
  return false;
}

void ChildProcess::KillGroup() {
  if (pid_ > 0) ::kill(-pid_, SIGKILL);
}

void ChildProcess::KillAndReap() {
  if (pid_ <= 0) return;
  KillGroup();
  while (!Poll()) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  KillGroup();  // any group member that outlived the leader
}

Result<ExitInfo> RunToCompletion(const SpawnSpec& spec, double timeout_s) {
  DL_ASSIGN_OR_RETURN(ChildProcess child, ChildProcess::Spawn(spec));
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  while (!child.Poll()) {
    if (std::chrono::steady_clock::now() >= deadline) {
      child.KillAndReap();
      return Status(StatusCode::kDeadlineExceeded,
                    fmt::format("{} did not finish within {} s (killed)", spec.exe, timeout_s));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return child.exit_info();
}

std::string FindExecutable(const std::string& name) {
  if (name.empty()) return "";
  if (name.find('/') != std::string::npos) return name;
  const char* path = std::getenv("PATH");
  std::string dirs = path && *path ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    const size_t end = std::min(dirs.find(':', start), dirs.size());
    // An empty entry means the current directory, as for execvp.
    std::string candidate = end > start ? dirs.substr(start, end - start) : std::string(1, '.');
    candidate += '/';
    candidate += name;
    struct stat st {};
    if (::stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
        ::access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
    start = end + 1;
  }
  return "";
}

std::vector<std::string> EnvironmentWith(const std::vector<std::string>& overrides) {
  std::vector<std::string> out;
  auto name_of = [](const std::string& kv) { return kv.substr(0, kv.find('=')); };
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string kv(*e);
    bool replaced = false;
    for (const std::string& o : overrides) {
      if (name_of(o) == name_of(kv)) replaced = true;
    }
    if (!replaced) out.push_back(std::move(kv));
  }
  for (const std::string& o : overrides) out.push_back(o);
  return out;
}

bool ProcessExists(pid_t pid) {
  if (pid <= 0) return false;
  return ::kill(pid, 0) == 0 || errno == EPERM;
}

bool ProcessIsRunning(pid_t pid) {
  if (!ProcessExists(pid)) return false;
  FILE* f = std::fopen(fmt::format("/proc/{}/stat", pid).c_str(), "r");
  if (f == nullptr) return true;  // no /proc: trust kill(0)
  char buf[512] = {0};
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  // "pid (comm) S ...": the state follows the last ')'.
  std::string stat(buf, n);
  size_t close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return true;
  char state = stat[close + 2];
  return state != 'Z' && state != 'X';
}

}  // namespace dl::comm
