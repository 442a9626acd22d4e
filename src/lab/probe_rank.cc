// One probe rank: the stage sequence of lab.md §4, fault injection, and the simulated transport.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "comm/tcp_group.h"
#include "lab/probe.h"
#include "lab/probe_markers.h"
#include "lab/probe_transport.h"

namespace dl::lab {
namespace {

// This rank's contribution: small integers stored as float, so any sum over ranks is exact and the
// expected result can be computed independently on the host. Rank-dependent, never zero.
float PatternValue(int rank, size_t i) {
  return static_cast<float>(1 + (i * 7 + static_cast<size_t>(rank) * 13) % 31);
}

class SimTransport : public ProbeTransport {
 public:
  explicit SimTransport(const RankOptions& o) : o_(o) {}

  Result<nlohmann::json> SetDevice(comm::Deadline) override {
    return nlohmann::json{{"device", "sim"}, {"note", "simulated transport: no GPU is used"}};
  }

  Result<nlohmann::json> InitComm(comm::Deadline deadline) override {
    DL_ASSIGN_OR_RETURN(
        group_, comm::TcpGroup::Create(o_.rank, o_.world_size, o_.rdzv_fd, o_.rdzv, deadline));
    return nlohmann::json{
        {"transport", "sim"}, {"rendezvous", o_.rdzv.ToString()}, {"world_size", o_.world_size}};
  }

  Status Allocate(std::span<const float> send, comm::Deadline) override {
    send_.assign(send.begin(), send.end());
    recv_.assign(send.size(), 0.0f);
    return Status::Ok();
  }

  Result<CollectiveTiming> AllReduce(int warmup, int iters, comm::Deadline deadline) override {
    for (int i = 0; i < warmup; ++i) {
      recv_ = send_;
      DL_RETURN_IF_ERROR(group_->AllReduceSum(recv_, deadline));
    }
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) {
      recv_ = send_;
      DL_RETURN_IF_ERROR(group_->AllReduceSum(recv_, deadline));
    }
    std::chrono::duration<double, std::micro> dt = std::chrono::steady_clock::now() - t0;
    return CollectiveTiming{dt.count() / iters, warmup, iters, nlohmann::json::object()};
  }

  Result<std::vector<float>> ReadResult(comm::Deadline) override { return recv_; }

  Status Teardown(comm::Deadline) override {
    group_.reset();
    return Status::Ok();
  }

 private:
  RankOptions o_;
  std::unique_ptr<comm::TcpGroup> group_;
  std::vector<float> send_, recv_;
};

// Bounds a stage's work even when it blocks inside a call that takes no deadline (a blocking NCCL
// call, a CUDA call stuck in the driver): past the stage deadline plus a slack that lets the
// transport's own deadline checks report first, it writes an error line and exits 124.
class StageWatchdog {
 public:
  explicit StageWatchdog(MarkerWriter* w) : w_(w), thread_([this] { Loop(); }) {}
  ~StageWatchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Arm(Stage stage, double timeout_s) {
    std::lock_guard<std::mutex> lock(mu_);
    stage_ = stage;
    timeout_s_ = timeout_s;
    fire_at_ = comm::DeadlineIn(timeout_s + kSlackS);
    armed_ = true;
    cv_.notify_all();
  }
  void Disarm() {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = false;
  }

 private:
  static constexpr double kSlackS = 0.5;
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!quit_) {
      if (!armed_) {
        cv_.wait(lock);
        continue;
      }
      if (cv_.wait_until(lock, fire_at_) == std::cv_status::timeout && armed_ && !quit_ &&
          std::chrono::steady_clock::now() >= fire_at_) {
        std::string msg = fmt::format(
            "stage {} did not return within {} s (blocked inside a call); the rank's watchdog "
            "ends it",
            StageName(stage_), timeout_s_);
        std::fprintf(stderr, "probe: %s\n", msg.c_str());
        (void)w_->Error(stage_, msg);
        std::fflush(nullptr);
        ::_exit(kRankTimeoutExitCode);
      }
    }
  }

  MarkerWriter* w_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool quit_ = false;
  bool armed_ = false;
  Stage stage_ = Stage::kImportDone;
  double timeout_s_ = 0;
  comm::Deadline fire_at_;
  std::thread thread_;
};

// Blocks forever: the `hang` fault. Only a signal (the supervisor's SIGKILL) ends it.
[[noreturn]] void HangForever() {
  for (;;) ::pause();
}

}  // namespace

std::unique_ptr<ProbeTransport> MakeSimTransport(const RankOptions& options) {
  return std::make_unique<SimTransport>(options);
}

Result<RankOptions> ParseRankArgs(const std::vector<std::string>& args) {
  RankOptions o;
  std::optional<int> rank, world, local;
  std::optional<comm::Endpoint> rdzv;
  std::string log_dir;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string key = args[i], value;
    if (size_t eq = key.find('='); key.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
    } else {
      if (i + 1 >= args.size()) return InvalidArgument("__probe-rank: {} needs a value", key);
      value = args[++i];
    }
    auto integer = [&](long long lo) -> Result<long long> {
      DL_ASSIGN_OR_RETURN(long long v, comm::ParseInteger(value, key));
      if (v < lo) return InvalidArgument("__probe-rank: {} {} is below {}", key, v, lo);
      return v;
    };
    if (key == "--rank") {
      DL_ASSIGN_OR_RETURN(long long v, integer(0));
      rank = static_cast<int>(v);
    } else if (key == "--world-size") {
      DL_ASSIGN_OR_RETURN(long long v, integer(1));
      world = static_cast<int>(v);
    } else if (key == "--local-rank") {
      DL_ASSIGN_OR_RETURN(long long v, integer(0));
      local = static_cast<int>(v);
    } else if (key == "--transport") {
      DL_ASSIGN_OR_RETURN(o.transport, ParseTransport(value));
    } else if (key == "--timeout-s") {
      char* end = nullptr;
      o.timeout_s = std::strtod(value.c_str(), &end);
      if (end == value.c_str() || *end != '\0' || !(o.timeout_s > 0)) {
        return InvalidArgument("__probe-rank: --timeout-s '{}' is not a positive number", value);
      }
    } else if (key == "--bytes") {
      DL_ASSIGN_OR_RETURN(long long v, integer(4));
      o.bytes = static_cast<size_t>(v);
    } else if (key == "--iters") {
      DL_ASSIGN_OR_RETURN(long long v, integer(1));
      o.iters = static_cast<int>(v);
    } else if (key == "--warmup") {
      DL_ASSIGN_OR_RETURN(long long v, integer(0));
      o.warmup = static_cast<int>(v);
    } else if (key == "--marker-file") {
      o.marker_file = value;
    } else if (key == "--log-dir") {
      log_dir = value;
    } else if (key == "--rdzv") {
      DL_ASSIGN_OR_RETURN(rdzv, comm::ParseEndpoint(value));
    } else if (key == "--rdzv-fd") {
      DL_ASSIGN_OR_RETURN(long long v, integer(0));
      o.rdzv_fd = static_cast<int>(v);
    } else if (key == "--inject") {
      DL_ASSIGN_OR_RETURN(Injection inj, ParseInjection(value));
      o.injections.push_back(inj);
    } else if (key == "--run-id") {
      o.run_id = value;
    } else {
      return InvalidArgument("__probe-rank: unknown option {}", key);
    }
  }
  // Unset identity comes from a cluster launcher (mpirun, PMI, srun).
  if (!rank || !world) {
    DL_ASSIGN_OR_RETURN(std::optional<comm::LaunchEnv> env, comm::ReadLaunchEnv());
    if (!env) {
      return InvalidArgument(
          "__probe-rank: no --rank/--world-size and no launcher environment (OMPI_COMM_WORLD_*, "
          "PMI_*, SLURM_PROCID/SLURM_NTASKS, DL_RANK/DL_WORLD_SIZE)");
    }
    if (!rank) rank = env->rank;
    if (!world) world = env->world_size;
    if (!local && env->local_rank >= 0) local = env->local_rank;
  }
  o.rank = *rank;
  o.world_size = *world;
  o.local_rank = local.value_or(o.rank);
  if (o.rank >= o.world_size) {
    return InvalidArgument("__probe-rank: rank {} is outside a world of {}", o.rank, o.world_size);
  }
  if (!rdzv) {
    DL_ASSIGN_OR_RETURN(std::optional<comm::Endpoint> env_ep, comm::MasterEndpointFromEnv());
    if (env_ep) {
      rdzv = *env_ep;
    } else if (o.world_size > 1 && !(o.rank == 0 && o.rdzv_fd >= 0)) {
      return InvalidArgument(
          "__probe-rank: no --rdzv HOST:PORT and no DL_MASTER_ADDR/MASTER_ADDR for a world of {}",
          o.world_size);
    }
  }
  if (rdzv) o.rdzv = *rdzv;
  if (o.marker_file.empty()) {
    if (log_dir.empty()) return InvalidArgument("__probe-rank: give --marker-file or --log-dir");
    o.marker_file = fmt::format("{}/rank{}.markers.jsonl", log_dir, o.rank);
  }
  return o;
}

std::vector<std::string> RankArgs(const RankOptions& o) {
  std::vector<std::string> a = {
      "--rank",        std::to_string(o.rank),
      "--world-size",  std::to_string(o.world_size),
      "--local-rank",  std::to_string(o.local_rank),
      "--transport",   TransportName(o.transport),
      "--timeout-s",   fmt::format("{}", o.timeout_s),
      "--bytes",       std::to_string(o.bytes),
      "--iters",       std::to_string(o.iters),
      "--marker-file", o.marker_file,
      "--rdzv",        o.rdzv.ToString(),
  };
  if (o.warmup >= 0) a.insert(a.end(), {"--warmup", std::to_string(o.warmup)});
  if (o.rdzv_fd >= 0) a.insert(a.end(), {"--rdzv-fd", std::to_string(o.rdzv_fd)});
  if (!o.run_id.empty()) a.insert(a.end(), {"--run-id", o.run_id});
  for (const Injection& inj : o.injections) a.insert(a.end(), {"--inject", inj.ToString()});
  return a;
}

int RunProbeRank(const RankOptions& o) {
  bool write_markers = true;
  bool wrong_value = false;
  std::optional<Injection> stage_fault;  // hang / exit, at one stage
  for (const Injection& inj : o.injections) {
    if (inj.rank != o.rank) continue;
    if (inj.kind == InjectKind::kNoMarkers) write_markers = false;
    if (inj.kind == InjectKind::kWrongValue) wrong_value = true;
    if (inj.kind == InjectKind::kHang || inj.kind == InjectKind::kExit) stage_fault = inj;
  }
  MarkerWriter w;
  if (Status st = w.Open(o.marker_file, o.rank, write_markers); !st.ok()) {
    std::fprintf(stderr, "probe rank %d: %s\n", o.rank, st.message().c_str());
    return 1;
  }
  std::fprintf(stderr, "probe rank %d/%d: pid %d, transport %s, NCCL_NVLS_ENABLE=%s\n", o.rank,
               o.world_size, static_cast<int>(::getpid()), TransportName(o.transport),
               std::getenv("NCCL_NVLS_ENABLE") ? std::getenv("NCCL_NVLS_ENABLE") : "(unset)");

  auto fail = [&](Stage stage, const Status& st) {
    std::fprintf(stderr, "probe rank %d: stage %s failed: %s\n", o.rank, StageName(stage),
                 st.message().c_str());
    (void)w.Error(stage, st.message());
    return st.code() == StatusCode::kDeadlineExceeded ? kRankTimeoutExitCode : 1;
  };
  // Applies an injected hang / exit before `stage`'s work. Returns an exit code to leave with.
  auto inject = [&](Stage stage) -> std::optional<int> {
    if (!stage_fault || stage_fault->stage != stage) return std::nullopt;
    if (stage_fault->kind == InjectKind::kHang) {
      std::fprintf(stderr, "probe rank %d: injected hang before %s\n", o.rank, StageName(stage));
      std::fflush(stderr);
      HangForever();
    }
    (void)w.Error(stage, fmt::format("injected exit ({})", stage_fault->ToString()));
    std::fprintf(stderr, "probe rank %d: injected exit before %s\n", o.rank, StageName(stage));
    return 1;
  };
  auto mark = [&](Stage stage, const nlohmann::json& detail) -> std::optional<int> {
    if (Status st = w.Mark(stage, detail); !st.ok()) return fail(stage, st);
    return std::nullopt;
  };
#define DL_PROBE_STEP(expr)                 \
  do {                                      \
    if (auto code_ = (expr)) return *code_; \
  } while (0)

  // import-done: the probe's own code is running (what NOT_EXECUTED checks for).
  DL_PROBE_STEP(inject(Stage::kImportDone));
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  const char* cvd = std::getenv("CUDA_VISIBLE_DEVICES");
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  DL_PROBE_STEP(mark(Stage::kImportDone, {{"host", host},
                                          {"world_size", o.world_size},
                                          {"local_rank", o.local_rank},
                                          {"transport", TransportName(o.transport)},
                                          {"run_id", o.run_id},
                                          {"CUDA_VISIBLE_DEVICES", cvd ? cvd : ""},
                                          {"NCCL_NVLS_ENABLE", nvls ? nvls : ""}}));

  std::unique_ptr<ProbeTransport> t =
      o.transport == Transport::kSim ? MakeSimTransport(o) : MakeNcclTransport(o);
  StageWatchdog watchdog(&w);

  DL_PROBE_STEP(inject(Stage::kDeviceSet));
  watchdog.Arm(Stage::kDeviceSet, o.timeout_s);
  Result<nlohmann::json> device = t->SetDevice(comm::DeadlineIn(o.timeout_s));
  watchdog.Disarm();
  if (!device.ok()) return fail(Stage::kDeviceSet, device.status());
  DL_PROBE_STEP(mark(Stage::kDeviceSet, *device));

  DL_PROBE_STEP(inject(Stage::kCommInitialised));
  watchdog.Arm(Stage::kCommInitialised, o.timeout_s);
  Result<nlohmann::json> comm_info = t->InitComm(comm::DeadlineIn(o.timeout_s));
  watchdog.Disarm();
  if (!comm_info.ok()) return fail(Stage::kCommInitialised, comm_info.status());
  DL_PROBE_STEP(mark(Stage::kCommInitialised, *comm_info));

  DL_PROBE_STEP(inject(Stage::kTensorAllocated));
  const size_t count = std::max<size_t>(1, o.bytes / sizeof(float));
  std::vector<float> send(count);
  for (size_t i = 0; i < count; ++i) {
    send[i] = PatternValue(o.rank, i) + (wrong_value ? 1.0f : 0.0f);
  }
  watchdog.Arm(Stage::kTensorAllocated, o.timeout_s);
  if (Status st = t->Allocate(send, comm::DeadlineIn(o.timeout_s)); !st.ok()) {
    return fail(Stage::kTensorAllocated, st);
  }
  watchdog.Disarm();
  DL_PROBE_STEP(mark(Stage::kTensorAllocated, {{"count", count},
                                               {"dtype", "float32"},
                                               {"bytes", count * sizeof(float)},
                                               {"wrong_value_injected", wrong_value}}));

  DL_PROBE_STEP(inject(Stage::kAllReduceStart));
  const int warmup = o.warmup >= 0 ? o.warmup : (o.transport == Transport::kNccl ? 5 : 1);
  DL_PROBE_STEP(
      mark(Stage::kAllReduceStart,
           {{"op", "all_reduce"}, {"redop", "sum"}, {"warmup", warmup}, {"iters", o.iters}}));

  DL_PROBE_STEP(inject(Stage::kAllReduceDone));
  watchdog.Arm(Stage::kAllReduceDone, o.timeout_s);
  Result<CollectiveTiming> timing = t->AllReduce(warmup, o.iters, comm::DeadlineIn(o.timeout_s));
  watchdog.Disarm();
  if (!timing.ok()) return fail(Stage::kAllReduceDone, timing.status());
  nlohmann::json done = timing->extra;
  done["time_us"] = timing->time_us;
  done["warmup"] = timing->warmup;
  done["iters"] = timing->iters;
  DL_PROBE_STEP(mark(Stage::kAllReduceDone, done));

  DL_PROBE_STEP(inject(Stage::kResultChecked));
  watchdog.Arm(Stage::kResultChecked, o.timeout_s);
  Result<std::vector<float>> got = t->ReadResult(comm::DeadlineIn(o.timeout_s));
  watchdog.Disarm();
  if (!got.ok()) return fail(Stage::kResultChecked, got.status());
  long long wrong = 0;
  long long first_wrong = -1;
  for (size_t i = 0; i < count; ++i) {
    float expected = 0;
    for (int r = 0; r < o.world_size; ++r) expected += PatternValue(r, i);
    if (i >= got->size() || (*got)[i] != expected) {
      if (first_wrong < 0) first_wrong = static_cast<long long>(i);
      ++wrong;
    }
  }
  nlohmann::json check = {
      {"result", wrong == 0 ? "ok" : "mismatch"}, {"wrong", wrong}, {"count", count}};
  if (first_wrong >= 0) {
    size_t i = static_cast<size_t>(first_wrong);
    float expected = 0;
    for (int r = 0; r < o.world_size; ++r) expected += PatternValue(r, i);
    check["first_wrong"] = {{"index", first_wrong},
                            {"expected", expected},
                            {"got", i < got->size() ? (*got)[i] : 0.0f}};
  }
  DL_PROBE_STEP(mark(Stage::kResultChecked, check));

  DL_PROBE_STEP(inject(Stage::kTeardownDone));
  watchdog.Arm(Stage::kTeardownDone, o.timeout_s);
  if (Status st = t->Teardown(comm::DeadlineIn(o.timeout_s)); !st.ok()) {
    return fail(Stage::kTeardownDone, st);
  }
  t.reset();
  watchdog.Disarm();
  DL_PROBE_STEP(mark(Stage::kTeardownDone, nlohmann::json::object()));
#undef DL_PROBE_STEP
  return 0;
}

}  // namespace dl::lab
