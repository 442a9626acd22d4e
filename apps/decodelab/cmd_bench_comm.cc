// decodelab bench comm: all-reduce latency inside a CUDA graph, per message size, for the one-shot
// device communicator (one-shot and two-shot kernels) and NCCL (docs/tensor-parallel.md). Each transport's ranks are threads of this
// process, rank r on GPU r % GPUs; each rank captures --calls all-reduces into one graph and replays
// it --iters times, the ranks starting each replay together; a replay's time is the slowest rank's,
// divided by --calls. Prints p50/p99 per call and the bus bandwidth (nccl-tests' definition) with the
// settings, and writes them as JSON.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <set>

#include <nlohmann/json.hpp>

#include "apps/decodelab/bench_common.h"
#include "base/build_info.h"
#include "comm/comm_bench.h"
#include "comm/device_communicator.h"
#include "comm/nccl_api.h"
#include "cuda/device.h"
#include "lab/lab_stats.h"

namespace dl::app {
namespace {

struct BenchCommFlags {
  int tp = 2;
  int gpus = 0;  // 0: every visible GPU
  std::string sizes = "4K,16K,64K,1M";
  std::string dtype = "bf16";
  int iters = 200;
  int warmup = 20;
  int calls = 20;
  int oneshot_blocks = comm::DeviceGroup::OneShotOptions{}.blocks;
  std::string json_out;
};

// One transport at every size: a row per size, with the timing or why there is none.
nlohmann::json TimeTransport(const std::string& transport, const std::vector<comm::DeviceCommunicator*>& comms,
                             const std::string& not_run, const std::vector<size_t>& sizes, comm::DeviceElem elem,
                             const BenchCommFlags& f, bool* failed) {
  nlohmann::json rows = nlohmann::json::array();
  std::string broken;  // a failed timing aborts the group: later sizes are not run
  for (size_t bytes : sizes) {
    nlohmann::json row = {{"transport", transport}, {"bytes", bytes}, {"size", comm::FormatByteSize(bytes)}};
    if (!not_run.empty() || !broken.empty()) {
      row["not_run"] = !not_run.empty() ? not_run : "the group failed at an earlier size: " + broken;
      rows.push_back(row);
      continue;
    }
    const int64_t count = static_cast<int64_t>(bytes / comm::DeviceElemBytes(elem));
    auto t = comm::TimeAllReduceInGraph(comms, count, elem, f.calls, f.warmup, f.iters);
    if (!t.ok()) {
      *failed = true;
      broken = t.status().ToString();
      row["error"] = broken;
      rows.push_back(row);
      continue;
    }
    const double p50 = lab::Percentile(t->us_per_call, 50), p99 = lab::Percentile(t->us_per_call, 99);
    row.update({{"p50_us", p50},
                {"p99_us", p99},
                {"mean_us", [&] {
                   double s = 0;
                   for (double v : t->us_per_call) s += v;
                   return s / static_cast<double>(t->us_per_call.size());
                 }()},
                {"min_us", *std::min_element(t->us_per_call.begin(), t->us_per_call.end())},
                {"busbw_gbps_p50", comm::AllReduceBusGbps(bytes, p50 * 1e-6, f.tp)},
                {"samples", t->us_per_call.size()}});
    rows.push_back(row);
  }
  return rows;
}

int RunBenchComm(const BenchCommFlags& f) {
  auto sizes = comm::ParseByteSizes(f.sizes);
  if (!sizes.ok()) return ReportError(sizes.status().WithContext("--sizes"));
  const comm::DeviceElem elem = f.dtype == "f32" ? comm::DeviceElem::kF32 : comm::DeviceElem::kBF16;
  for (size_t b : *sizes) {
    if (b % comm::DeviceElemBytes(elem) != 0) {
      return ReportError(InvalidArgument("--sizes: {} bytes is not a whole number of {} elements", b,
                                         comm::DeviceElemName(elem)));
    }
  }
  std::string why;
  const int visible = cuda::DeviceCount(&why);
  if (visible == 0) return ReportError(Unavailable("bench comm needs a usable GPU ({})", why));
  const int gpus = f.gpus <= 0 || f.gpus > visible ? visible : f.gpus;
  std::vector<int> devices;
  for (int r = 0; r < f.tp; ++r) devices.push_back(r % gpus);
  const size_t distinct = std::set<int>(devices.begin(), devices.end()).size();
  const bool shared = distinct < devices.size();
  const size_t max_bytes = *std::max_element(sizes->begin(), sizes->end());
  nlohmann::json gpu = nullptr;
  if (auto info = cuda::GetDeviceInfo(0); info.ok()) {
    gpu = {{"name", info->name}, {"sms", info->sm_count}, {"pci", info->pci_bus_id}};
  }
  bool failed = false;
  nlohmann::json results = nlohmann::json::array();

  // The one-shot device communicator (slots as large as the largest size) with every size on the
  // one-shot kernel, then every size on the two-shot kernel (the same bits; `--tune
  // tp_two_shot_min_kb` picks between them by size in the engine).
  for (const bool two_shot : {false, true}) {
    comm::DeviceGroup::OneShotOptions o;
    o.capacity_bytes = max_bytes;
    o.blocks = f.oneshot_blocks;
    o.two_shot_min_bytes = two_shot ? 1 : 0;
    auto group = comm::DeviceGroup::CreateOneShot(devices, max_bytes, o, 60.0);
    std::vector<comm::DeviceCommunicator*> comms;
    std::string not_run;
    if (!group.ok()) {
      not_run = "cannot create the group: " + group.status().ToString();
      failed = true;
    } else {
      for (int r = 0; r < f.tp; ++r) comms.push_back(&(*group)->rank(r));
    }
    for (auto& row : TimeTransport(two_shot ? "device-twoshot" : "device-oneshot", comms, not_run, *sizes, elem, f,
                                   &failed)) {
      results.push_back(row);
    }
  }
  // NCCL: one rank per GPU.
  {
    std::string not_run;
    std::vector<std::unique_ptr<comm::DeviceCommunicator>> owned;
    std::vector<comm::DeviceCommunicator*> comms;
    if (shared) {
      not_run = fmt::format("not run: needs {} distinct GPUs ({} usable; NCCL takes one rank per GPU)", f.tp, gpus);
    } else {
      auto nccl = comm::CreateNcclGroup(devices);
      if (!nccl.ok()) {
        not_run = "not run: " + nccl.status().ToString();
      } else {
        owned = std::move(nccl).value();
        for (auto& c : owned) comms.push_back(c.get());
      }
    }
    for (auto& row : TimeTransport("nccl", comms, not_run, *sizes, elem, f, &failed)) results.push_back(row);
  }

  nlohmann::json settings = {{"tp", f.tp},
                             {"devices", devices},
                             {"ranks_share_gpus", shared},
                             {"dtype", comm::DeviceElemName(elem)},
                             {"sizes", f.sizes},
                             {"iters", f.iters},
                             {"warmup", f.warmup},
                             {"calls_per_graph", f.calls},
                             {"oneshot_blocks", f.oneshot_blocks},
                             {"timing", "per call: the slowest rank's graph replay time / calls_per_graph"}};
  PrintBenchHeader(" comm", gpu);
  std::printf("  settings     tp %d on GPUs [%s], %s, %d all-reduces per CUDA graph, %d timed replays (+%d warm-up), "
              "one-shot grid %d blocks\n",
              f.tp, fmt::format("{}", fmt::join(devices, ", ")).c_str(), comm::DeviceElemName(elem), f.calls, f.iters,
              f.warmup, f.oneshot_blocks);
  if (shared) {
    std::printf("  ** ranks share a GPU: the timings are not meaningful (every rank's kernels run on one device) **\n");
  }
  std::printf("  %-7s %-16s %10s %10s %14s\n", "size", "transport", "p50 us", "p99 us", "busbw GB/s");
  for (const auto& row : results) {
    const std::string size = row["size"], transport = row["transport"];
    if (row.contains("p50_us")) {
      std::printf("  %-7s %-16s %10.2f %10.2f %14.2f\n", size.c_str(), transport.c_str(), row["p50_us"].get<double>(),
                  row["p99_us"].get<double>(), row["busbw_gbps_p50"].get<double>());
    } else {
      const std::string why_not = row.contains("error") ? "FAILED: " + row["error"].get<std::string>()
                                                        : row["not_run"].get<std::string>();
      std::printf("  %-7s %-16s %s\n", size.c_str(), transport.c_str(), why_not.c_str());
    }
  }
  nlohmann::json j = {{"mode", "comm"},
                      {"results", results},
                      {"settings", settings},
                      {"commit", BuildCommit()},
                      {"gpu", gpu},
                      {"gpus_visible", visible},
                      {"driver", cuda::DriverVersionString()},
                      {"runtime", cuda::RuntimeVersionString()}};
  const int rc = WriteJsonOut(f.json_out, j);
  return rc != 0 ? rc : (failed ? 1 : 0);
}

}  // namespace

void AddBenchCommCommand(CLI::App* bench, CommandContext& ctx) {
  auto flags = std::make_shared<BenchCommFlags>();
  CLI::App* cmd = bench->add_subcommand(
      "comm",
      "All-reduce latency inside a CUDA graph per message size: the one-shot device communicator (rank-order "
      "sum over peer memory) and NCCL, ranks as threads of this process, rank r on GPU r % GPUs; p50/p99 per "
      "call and bus bandwidth. Ranks sharing a GPU run (one-shot only) but their timings are not meaningful");
  cmd->add_option("--tp", flags->tp, "Ranks")->default_val(2)->check(CLI::Range(2, 16));
  cmd->add_option("--gpus", flags->gpus, "GPUs the ranks use (0: every visible one)")->default_val(0);
  cmd->add_option("--sizes", flags->sizes,
                  "Message sizes in bytes, comma-separated, K = 1024 and M = 1024^2 (each rank's buffer)")
      ->default_val("4K,16K,64K,1M");
  cmd->add_option("--dtype", flags->dtype, "Element type of the all-reduce")
      ->default_val("bf16")
      ->check(CLI::IsMember({"bf16", "f32"}));
  cmd->add_option("--iters", flags->iters, "Timed graph replays per size and transport")
      ->default_val(200)
      ->check(CLI::Range(1, 1000000));
  cmd->add_option("--warmup", flags->warmup, "Untimed replays first")->default_val(20)->check(CLI::Range(0, 100000));
  cmd->add_option("--calls", flags->calls, "All-reduces captured in one graph (a replay's time / this = per call)")
      ->default_val(20)
      ->check(CLI::Range(1, 10000));
  cmd->add_option("--oneshot-blocks", flags->oneshot_blocks, "The one-shot kernels' fixed grid (blocks per rank)")
      ->default_val(flags->oneshot_blocks)
      ->check(CLI::Range(1, 64));
  cmd->add_option("--json-out", flags->json_out, "Write the results and settings as JSON");
  cmd->callback([flags, &ctx] { ctx.exit_code = RunBenchComm(*flags); });
}

}  // namespace dl::app
