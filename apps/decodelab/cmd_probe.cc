// `decodelab probe`: the collective health probe (lab.md §4), and the hidden `__probe-rank`
// subcommand its ranks run as.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "apps/decodelab/commands.h"
#include "comm/launch_env.h"
#include "lab/probe.h"

namespace dl::app {

namespace {

struct ProbeFlags {
  int ranks = 2;
  std::string transport = "nccl";
  double timeout_s = 60;
  size_t bytes = 1 << 20;
  int iters = 20;
  std::string log_dir;
  std::vector<std::string> inject;
  int nnodes = 1;
  int node_rank = -1;
  std::string master_addr;
  int master_port = 0;
};

// Errors that stop the probe before it classifies anything exit 1, never one of the class codes.
int ProbeSetupError(const Status& status) {
  std::fprintf(stderr, "error: %s\n", status.message().c_str());
  return 1;
}

void RunProbeCommand(const ProbeFlags& f, CommandContext& ctx) {
  lab::ProbeOptions o;
  o.ranks = f.ranks;
  o.timeout_s = f.timeout_s;
  o.bytes = f.bytes;
  o.iters = f.iters;
  o.log_dir = f.log_dir;
  o.nnodes = f.nnodes;
  Result<lab::Transport> t = lab::ParseTransport(f.transport);
  if (!t.ok()) {
    ctx.exit_code = ProbeSetupError(t.status());
    return;
  }
  o.transport = *t;
  for (const std::string& s : f.inject) {
    Result<lab::Injection> inj = lab::ParseInjection(s);
    if (!inj.ok()) {
      ctx.exit_code = ProbeSetupError(inj.status());
      return;
    }
    o.injections.push_back(*inj);
  }
  if (f.nnodes > 1) {
    // One supervisor per host: its index comes from the flag or from the launcher that started it
    // (mpirun / srun with one task per host).
    o.node_rank = f.node_rank;
    if (o.node_rank < 0) {
      Result<std::optional<comm::LaunchEnv>> env = comm::ReadLaunchEnv();
      if (!env.ok()) {
        ctx.exit_code = ProbeSetupError(env.status());
        return;
      }
      if (!env->has_value()) {
        ctx.exit_code =
            ProbeSetupError(InvalidArgument("--nnodes {} needs --node-rank, or a launcher (mpirun, "
                                            "srun) that sets the host's index",
                                            f.nnodes));
        return;
      }
      o.node_rank = (*env)->rank;
    }
    if (!f.master_addr.empty()) {
      o.master = comm::Endpoint{f.master_addr,
                                f.master_port > 0 ? f.master_port : comm::kDefaultRendezvousPort};
    } else {
      Result<std::optional<comm::Endpoint>> ep = comm::MasterEndpointFromEnv();
      if (!ep.ok()) {
        ctx.exit_code = ProbeSetupError(ep.status());
        return;
      }
      o.master = *ep;
      if (o.master && f.master_port > 0) o.master->port = f.master_port;
    }
  }
  o.progress = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  Result<lab::ProbeReport> r = lab::RunProbe(o);
  if (!r.ok()) {
    ctx.exit_code = ProbeSetupError(r.status());
    return;
  }
  std::fputs(lab::SummaryText(*r).c_str(), stdout);
  std::printf("%s\n", lab::ResultLine(*r).c_str());
  std::fflush(stdout);
  ctx.exit_code = r->exit_code;
}

}  // namespace

void AddProbeCommand(CLI::App& root, CommandContext& ctx) {
  auto flags = std::make_shared<ProbeFlags>();
  CLI::App* cmd = root.add_subcommand(
      "probe",
      "Collective health probe: one process per GPU runs an all-reduce through stage markers;\n"
      "a supervisor kills stuck ranks and classifies the run (lab.md §4).");
  cmd->footer(
      "Each rank writes fsync'd stage markers (import-done, device-set, comm-initialised,\n"
      "tensor-allocated, all_reduce-start, all_reduce-done, result-checked ok|mismatch,\n"
      "teardown-done) to <log-dir>/rank<R>.markers.jsonl; its stdout/stderr go to rank<R>.log.\n"
      "A rank with no new marker for --timeout-s (plus a grace of 25%, 1-10 s) has its process\n"
      "group killed. The run ends with one line and an exit code:\n"
      "  PROBE_RESULT=<class> clean_teardowns=<k>/<n>   (plus ' transport=sim' under sim)\n"
      "  PASS 0 | LAUNCH_FAILURE 2 | INIT_STAGE_FAILURE 3 | COLLECTIVE_STAGE_FAILURE 4 |\n"
      "  RESULT_MISMATCH 5 | TEARDOWN_FAILURE 6 | NOT_EXECUTED 8 | the probe could not run 1\n"
      "and <log-dir>/probe.json. With nccl it also prints the all-reduce's time per op over\n"
      "--iters (after 5 warm-ups), algbw = bytes/time, busbw = algbw*2(n-1)/n and #wrong, as\n"
      "nccl-tests' all_reduce_perf would. Every rank runs with NCCL_NVLS_ENABLE=0.\n"
      "Examples:\n"
      "  decodelab probe --ranks 2 --bytes 4096 --iters 200 --log-dir runs/probe\n"
      "  decodelab probe --ranks 2 --transport sim --inject all_reduce-done:1:hang --timeout-s 3\n"
      "Multi-host recipes (mpirun, srun): docs/multi-host.md.");
  cmd->add_option("--ranks", flags->ranks, "Rank processes on this host, one per GPU (default 2)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--transport", flags->transport,
                  "nccl: a real NCCL all-reduce on the GPUs; sim: the same supervisor and\n"
                  "classification with plain processes summing over local sockets, no GPU\n"
                  "(its result line says transport=sim)")
      ->check(CLI::IsMember({"nccl", "sim"}))
      ->capture_default_str();
  cmd->add_option("--timeout-s", flags->timeout_s,
                  "Timeout of every stage, in seconds; a rank gives up by itself after it, the\n"
                  "supervisor kills it after it plus the grace")
      ->check(CLI::Range(0.01, 86400.0))
      ->capture_default_str();
  cmd->add_option("--bytes", flags->bytes, "All-reduce size in bytes (float32 elements = bytes/4)")
      ->check(CLI::Range(size_t{4}, size_t{64} << 30))
      ->capture_default_str();
  cmd->add_option("--iters", flags->iters, "Timed all-reduce iterations")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  cmd->add_option("--log-dir", flags->log_dir,
                  "Run directory for rank logs and probe.json (default runs/probe-<UTC>-<pid>)");
  cmd->add_option(
         "--inject", flags->inject,
         "Fault injection for tests, STAGE:RANK:KIND (repeatable). KIND: hang (write the\n"
         "markers before STAGE, then block instead of STAGE's work), exit (exit non-zero\n"
         "there), wrong-value (contribute a wrong value; STAGE ignored), no-markers (run,\n"
         "exit 0, write no markers; STAGE ignored)")
      ->check([](const std::string& s) {
        Result<lab::Injection> r = lab::ParseInjection(s);
        return r.ok() ? std::string() : r.status().message();
      });
  cmd->add_option("--nnodes", flags->nnodes,
                  "Hosts in a multi-host probe; run one `decodelab probe` per host (world size =\n"
                  "nnodes x ranks)")
      ->check(CLI::Range(1, 4096))
      ->group("Multi-host");
  cmd->add_option("--node-rank", flags->node_rank,
                  "This host's index; default: the launcher's rank (OMPI_COMM_WORLD_RANK,\n"
                  "PMI_RANK, SLURM_PROCID) with one task per host")
      ->group("Multi-host");
  cmd->add_option("--master-addr", flags->master_addr,
                  "Host 0's address for the rendezvous; default DL_MASTER_ADDR or MASTER_ADDR")
      ->group("Multi-host");
  cmd->add_option("--master-port", flags->master_port,
                  "Rendezvous port on host 0; default DL_MASTER_PORT, MASTER_PORT or 29517")
      ->check(CLI::Range(1, 65535))
      ->group("Multi-host");
  cmd->callback([flags, &ctx] { RunProbeCommand(*flags, ctx); });

  // The ranks: this binary re-executed by the supervisor (or by mpirun/srun directly, reading the
  // launcher's environment). Hidden from --help.
  CLI::App* rank = root.add_subcommand("__probe-rank", "internal: one probe rank");
  rank->group("");
  rank->prefix_command();
  rank->allow_extras();
  rank->callback([rank] {
    Result<lab::RankOptions> o = lab::ParseRankArgs(rank->remaining());
    if (!o.ok()) {
      std::fprintf(stderr, "error: %s\n", o.status().message().c_str());
      std::fflush(nullptr);
      ::_exit(1);
    }
    int code = lab::RunProbeRank(*o);
    std::fflush(nullptr);
    // _exit, not return: after a failure, NCCL's and CUDA's exit-time destructors may block, and
    // the supervisor must see this rank's own exit code.
    ::_exit(code);
  });
}

}  // namespace dl::app
