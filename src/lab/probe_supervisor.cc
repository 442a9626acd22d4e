// The probe's supervisor: launch, watch, kill, reap, classify, report.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "comm/process.h"
#include "comm/tcp_group.h"
#include "lab/probe.h"
#include "lab/probe_markers.h"

namespace dl::lab {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string CompactUtc() {
  time_t now = ::time(nullptr);
  tm utc{};
  gmtime_r(&now, &utc);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y%m%dT%H%M%SZ", &utc);
  return buf;
}

struct RankSlot {
  int rank = 0;
  RankOptions options;
  std::string marker_path;
  std::string output_path;
  comm::ChildProcess child;
  bool started = false;
  std::string spawn_error;
  size_t markers_seen = 0;
  Clock::time_point last_progress;
  bool killed = false;
  std::string killed_after;  // the last marker when the supervisor killed it
  std::array<bool, kNumStages> has{};
};

Status Validate(const ProbeOptions& o) {
  if (o.ranks < 1 || o.ranks > 1024)
    return InvalidArgument("--ranks {} is outside [1, 1024]", o.ranks);
  if (!(o.timeout_s > 0) || o.timeout_s > 86400) {
    return InvalidArgument("--timeout-s {} is outside (0, 86400]", o.timeout_s);
  }
  if (o.bytes < sizeof(float))
    return InvalidArgument("--bytes {} is below 4 (one float32)", o.bytes);
  if (o.bytes > (size_t{64} << 30)) return InvalidArgument("--bytes {} is above 64 GiB", o.bytes);
  if (o.iters < 1) return InvalidArgument("--iters {} is below 1", o.iters);
  if (o.nnodes < 1) return InvalidArgument("--nnodes {} is below 1", o.nnodes);
  if (o.node_rank < 0 || o.node_rank >= o.nnodes) {
    return InvalidArgument("--node-rank {} is outside [0, {})", o.node_rank, o.nnodes);
  }
  if (o.nnodes > 1 && !o.master) {
    return InvalidArgument(
        "a multi-host probe (--nnodes {}) needs rank 0's address: --master-addr/--master-port or "
        "DL_MASTER_ADDR/MASTER_ADDR",
        o.nnodes);
  }
  const int world = o.nnodes * o.ranks;
  for (const Injection& inj : o.injections) {
    if (inj.rank >= world) {
      return InvalidArgument("--inject {}: rank {} does not exist (world of {} ranks)",
                             inj.ToString(), inj.rank, world);
    }
  }
  return Status::Ok();
}

}  // namespace

std::string ResultLine(const ProbeReport& r) {
  std::string line = fmt::format("PROBE_RESULT={} clean_teardowns={}/{}", ProbeClassName(r.cls),
                                 r.clean_teardowns, r.ranks);
  if (r.transport == Transport::kSim) line += " transport=sim";
  return line;
}

std::string SummaryText(const ProbeReport& r) {
  std::string s;
  for (const RankOutcome& o : r.outcomes) {
    std::optional<Stage> last = o.LastStage();
    s += fmt::format("# rank {:>3}  last marker {:<17} {}{}\n", o.rank,
                     last ? StageName(*last) : "(none)",
                     !o.started               ? "never started"
                     : o.killed_by_supervisor ? "killed by the supervisor"
                                              : o.exit.ToString(),
                     o.error.empty() ? "" : "  [" + o.error + "]");
  }
  const AllReduceStats& st = r.stats;
  if (st.measured) {
    if (r.transport == Transport::kSim) {
      s +=
          "# transport=sim: float32 sums over local sockets through rank 0 (NOT a GPU collective;\n"
          "# these numbers say nothing about the interconnect)\n";
    }
    s += "#       size         count      type   redop    root     time   algbw   busbw  #wrong\n";
    s += "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)\n";
    s += fmt::format("{:>12}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7.2f}  {:>6.2f}  {:>6.2f}  {:>6}\n",
                     st.bytes, st.count, "float", "sum", -1, st.time_us, st.algbw_gbs, st.busbw_gbs,
                     st.wrong >= 0 ? std::to_string(st.wrong) : "n/a");
    s += fmt::format(
        "# all-reduce: {} timed iterations per rank; time is the mean over ranks "
        "(slowest rank {:.2f} us)\n",
        st.iters, st.time_us_max);
  }
  s += fmt::format("# classification: {}\n", r.reason);
  s += fmt::format("# logs: {}\n", r.log_dir);
  return s;
}

Result<ProbeReport> RunProbe(const ProbeOptions& o) {
  DL_RETURN_IF_ERROR(Validate(o));
  auto progress = [&](const std::string& line) {
    if (o.progress) o.progress(line);
  };
  const Clock::time_point t_start = Clock::now();
  const std::string started_at = WallTimeIso();
  const int world = o.nnodes * o.ranks;
  ProbeReport report;
  report.transport = o.transport;
  report.ranks = o.ranks;
  report.run_id = fmt::format("probe-{}-{}", CompactUtc(), static_cast<int>(::getpid()));
  report.log_dir = o.log_dir.empty() ? "runs/" + report.run_id : o.log_dir;
  {
    std::error_code ec;
    std::filesystem::create_directories(report.log_dir, ec);
    if (ec)
      return Unavailable("cannot create the probe log directory {}: {}", report.log_dir,
                         ec.message());
  }
  // One supervisor per host may share a log directory: each host but a lone one names its JSON.
  report.json_path = o.nnodes == 1
                         ? report.log_dir + "/probe.json"
                         : fmt::format("{}/probe.node{}.json", report.log_dir, o.node_rank);

  // Rendezvous: this host's supervisor owns rank 0's listening socket and hands it to rank 0, so
  // the port is bound before any rank starts (no race for a free port).
  comm::Endpoint rdzv{"127.0.0.1", 0};
  int listen_fd = -1;
  if (o.nnodes == 1) {
    DL_ASSIGN_OR_RETURN(comm::Listener l, comm::Listen("127.0.0.1", 0));
    listen_fd = l.fd;
    rdzv.port = l.port;
  } else {
    rdzv = *o.master;
    if (o.node_rank == 0) {
      Result<comm::Listener> l = comm::Listen("0.0.0.0", o.master->port);
      if (!l.ok()) return l.status().WithContext("rank 0's rendezvous socket");
      listen_fd = l->fd;
    }
  }

  const double grace_s = std::clamp(o.timeout_s * 0.25, 1.0, 10.0);
  const double kill_after_s = o.timeout_s + grace_s;
  std::vector<std::string> env = comm::EnvironmentWith({
      "NCCL_NVLS_ENABLE=0",  // NVLink multicast stays off in everything we launch
      "DL_PROBE_RUN_ID=" + report.run_id,
  });
  if (std::getenv("NCCL_DEBUG") == nullptr) env.push_back("NCCL_DEBUG=WARN");

  std::vector<RankSlot> slots(o.ranks);
  for (int i = 0; i < o.ranks; ++i) {
    RankSlot& s = slots[i];
    s.rank = o.node_rank * o.ranks + i;
    s.marker_path = fmt::format("{}/rank{}.markers.jsonl", report.log_dir, s.rank);
    s.output_path = fmt::format("{}/rank{}.log", report.log_dir, s.rank);
    std::error_code ec;
    std::filesystem::remove(s.marker_path, ec);  // never classify a previous run's markers
    RankOptions& ro = s.options;
    ro.rank = s.rank;
    ro.world_size = world;
    ro.local_rank = i;
    ro.transport = o.transport;
    ro.timeout_s = o.timeout_s;
    ro.bytes = o.bytes;
    ro.iters = o.iters;
    ro.marker_file = s.marker_path;
    ro.rdzv = rdzv;
    ro.rdzv_fd = (s.rank == 0 && listen_fd >= 0) ? comm::kPassedFd : -1;
    ro.run_id = report.run_id;
    for (const Injection& inj : o.injections) {
      if (inj.rank == s.rank) ro.injections.push_back(inj);
    }
    comm::SpawnSpec spec;
    spec.exe = o.rank_exe;
    spec.argv = o.rank_argv_prefix;
    for (std::string& a : RankArgs(ro)) spec.argv.push_back(std::move(a));
    spec.env = env;
    spec.output_path = s.output_path;
    spec.pass_fd = ro.rdzv_fd >= 0 ? listen_fd : -1;
    s.last_progress = Clock::now();
    Result<comm::ChildProcess> child = comm::ChildProcess::Spawn(spec);
    if (child.ok()) {
      s.child = std::move(child).value();
      s.started = true;
      report.pids.push_back(s.child.pid());
    } else {
      s.spawn_error = child.status().message();
      progress(fmt::format("probe: rank {} could not be started: {}", s.rank, s.spawn_error));
    }
  }
  if (listen_fd >= 0) ::close(listen_fd);  // rank 0 holds its own copy
  progress(fmt::format(
      "probe: {} rank(s) of {} started ({} transport), stage timeout {} s, logs in {}",
      report.pids.size(), world, TransportName(o.transport), o.timeout_s, report.log_dir));

  // Watch: reap what ended, note progress, kill the group of a rank stuck past its stage timeout.
  int stages_all_reached = 0;
  Clock::time_point last_status = Clock::now();
  for (;;) {
    bool any_running = false;
    for (RankSlot& s : slots) {
      if (!s.started || s.child.reaped()) continue;
      MarkerLog log = ReadMarkerLog(s.marker_path);
      if (log.markers.size() > s.markers_seen) {
        s.markers_seen = log.markers.size();
        s.last_progress = Clock::now();
        for (const MarkerRecord& m : log.markers) s.has[static_cast<int>(m.stage)] = true;
      }
      if (s.child.Poll()) {
        s.child.KillGroup();  // anything the rank left in its group
        if (!(s.child.exit_info().exited && s.child.exit_info().code == 0)) {
          progress(fmt::format("probe: rank {} ended ({}) after {} marker(s)", s.rank,
                               s.child.exit_info().ToString(), s.markers_seen));
        }
        continue;
      }
      if (SecondsSince(s.last_progress) > kill_after_s) {
        s.killed = true;
        MarkerLog now = ReadMarkerLog(s.marker_path);
        s.killed_after = now.markers.empty() ? "(none)" : StageName(now.markers.back().stage);
        progress(
            fmt::format("probe: rank {} made no progress for {:.1f} s after marker {}; killing its "
                        "process group",
                        s.rank, SecondsSince(s.last_progress), s.killed_after));
        s.child.KillAndReap();
        continue;
      }
      any_running = true;
    }
    // One progress line per stage that every rank has reached.
    while (stages_all_reached < kNumStages) {
      bool all = true;
      for (const RankSlot& s : slots) all = all && s.has[stages_all_reached];
      if (!all) break;
      progress(fmt::format("probe: all {} rank(s) reached {} ({:.2f} s)", o.ranks,
                           StageName(static_cast<Stage>(stages_all_reached)),
                           SecondsSince(t_start)));
      ++stages_all_reached;
    }
    if (!any_running) break;
    // On long stages (NCCL start-up on a big machine), say every 10 s who is still waiting where.
    if (SecondsSince(last_status) >= 10.0) {
      last_status = Clock::now();
      std::string waiting;
      for (const RankSlot& s : slots) {
        if (!s.started || s.child.reaped()) continue;
        int last = -1;
        for (int k = 0; k < kNumStages; ++k) {
          if (s.has[k]) last = k;
        }
        waiting += fmt::format(" {}@{}({:.0f}s)", s.rank,
                               last < 0 ? "start" : StageName(static_cast<Stage>(last)),
                               SecondsSince(s.last_progress));
      }
      progress(fmt::format("probe: waiting (rank@last marker, time since):{}", waiting));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  // Classify from the final logs and exit statuses.
  std::vector<double> times;
  long long wrong = 0;
  bool all_checked = true;
  for (RankSlot& s : slots) {
    s.child.KillGroup();
    RankOutcome out;
    out.rank = s.rank;
    out.started = s.started;
    out.exit = s.child.exit_info();
    out.killed_by_supervisor = s.killed;
    MarkerLog log = ReadMarkerLog(s.marker_path);
    for (const MarkerRecord& m : log.markers) {
      out.has[static_cast<int>(m.stage)] = true;
      if (m.stage == Stage::kResultChecked) {
        if (auto it = m.detail.find("result"); it != m.detail.end() && it->is_string()) {
          out.result = it->get<std::string>();
        }
        if (auto it = m.detail.find("wrong"); it != m.detail.end() && it->is_number_integer()) {
          wrong += it->get<long long>();
        }
      }
      if (m.stage == Stage::kAllReduceDone) {
        if (auto it = m.detail.find("time_us"); it != m.detail.end() && it->is_number()) {
          times.push_back(it->get<double>());
        }
      }
    }
    if (!out.Has(Stage::kResultChecked)) all_checked = false;
    if (!s.started) out.error = s.spawn_error;
    if (!log.errors.empty()) out.error = log.errors.back();
    report.outcomes.push_back(std::move(out));
  }
  Classification c = Classify(report.outcomes);
  report.cls = c.cls;
  report.exit_code = ProbeExitCode(c.cls);
  report.clean_teardowns = c.clean_teardowns;
  report.reason = c.reason;

  AllReduceStats& st = report.stats;
  st.count = std::max<size_t>(1, o.bytes / sizeof(float));
  st.bytes = st.count * sizeof(float);
  st.iters = o.iters;
  st.wrong = all_checked ? wrong : -1;
  if (!times.empty() && static_cast<int>(times.size()) == o.ranks) {
    st.measured = true;
    double sum = 0;
    for (double t : times) {
      sum += t;
      st.time_us_max = std::max(st.time_us_max, t);
    }
    st.time_us = sum / static_cast<double>(times.size());
    if (st.time_us > 0) {
      st.algbw_gbs = static_cast<double>(st.bytes) / (st.time_us * 1e-6) / 1e9;
      st.busbw_gbs = st.algbw_gbs * 2.0 * (world - 1) / world;
    }
  }
  report.duration_s = SecondsSince(t_start);

  nlohmann::json ranks = nlohmann::json::array();
  for (size_t i = 0; i < slots.size(); ++i) {
    const RankOutcome& out = report.outcomes[i];
    const RankSlot& s = slots[i];
    nlohmann::json stages = nlohmann::json::array();
    for (int k = 0; k < kNumStages; ++k) {
      if (out.has[k]) stages.push_back(StageName(static_cast<Stage>(k)));
    }
    nlohmann::json exit = nullptr;
    if (out.exit.exited) {
      exit = {{"code", out.exit.code}};
    } else if (out.exit.signal != 0) {
      exit = {{"signal", out.exit.signal}};
    }
    std::optional<Stage> last = out.LastStage();
    ranks.push_back({{"rank", out.rank},
                     {"local_rank", static_cast<int>(i)},
                     {"pid", s.started ? s.child.pid() : -1},
                     {"started", out.started},
                     {"stages", stages},
                     {"last_stage", last ? nlohmann::json(StageName(*last)) : nlohmann::json()},
                     {"result", out.result.empty() ? nlohmann::json() : nlohmann::json(out.result)},
                     {"exit", exit},
                     {"killed_by_supervisor", out.killed_by_supervisor},
                     {"clean_teardown", out.Has(Stage::kTeardownDone) && out.exit.exited &&
                                            out.exit.code == 0 && !out.killed_by_supervisor},
                     {"error", out.error.empty() ? nlohmann::json() : nlohmann::json(out.error)},
                     {"marker_log", std::filesystem::path(s.marker_path).filename().string()},
                     {"output_log", std::filesystem::path(s.output_path).filename().string()}});
  }
  nlohmann::json injections = nlohmann::json::array();
  for (const Injection& inj : o.injections) injections.push_back(inj.ToString());
  nlohmann::json all_reduce = {
      {"bytes", st.bytes},  {"count", st.count},
      {"dtype", "float32"}, {"redop", "sum"},
      {"iters", st.iters},  {"wrong", st.wrong >= 0 ? nlohmann::json(st.wrong) : nlohmann::json()}};
  if (st.measured) {
    all_reduce["time_us"] = st.time_us;
    all_reduce["time_us_max"] = st.time_us_max;
    all_reduce["algbw_gbs"] = st.algbw_gbs;
    all_reduce["busbw_gbs"] = st.busbw_gbs;
  }
  report.json = {{"result", ProbeClassName(report.cls)},
                 {"exit_code", report.exit_code},
                 {"clean_teardowns", report.clean_teardowns},
                 {"ranks", report.ranks},
                 {"world_size", world},
                 {"nnodes", o.nnodes},
                 {"node_rank", o.node_rank},
                 {"transport", TransportName(o.transport)},
                 {"result_line", ResultLine(report)},
                 {"reason", report.reason},
                 {"run_id", report.run_id},
                 {"started_at", started_at},
                 {"duration_s", report.duration_s},
                 {"timeout_s", o.timeout_s},
                 {"kill_after_s", kill_after_s},
                 {"rendezvous", rdzv.ToString()},
                 {"injections", injections},
                 {"env", {{"NCCL_NVLS_ENABLE", "0"}}},
                 {"all_reduce", all_reduce},
                 {"rank_detail", ranks}};
  {
    std::string tmp = report.json_path + ".tmp";
    std::ofstream f(tmp, std::ios::trunc);
    f << report.json.dump(2) << "\n";
    f.close();
    std::error_code ec;
    if (!f) return Unavailable("cannot write {}", tmp);
    std::filesystem::rename(tmp, report.json_path, ec);
    if (ec) return Unavailable("cannot write {}: {}", report.json_path, ec.message());
  }
  return report;
}

}  // namespace dl::lab
