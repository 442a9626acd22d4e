// `decodelab bench comm`'s measurement (apps/decodelab/cmd_bench_comm.cc): all-reduce latency inside a
// CUDA graph for any DeviceCommunicator group, and the size list and bandwidth arithmetic around it
// (these two need no GPU and are unit-tested on the CPU).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "comm/device_communicator.h"

namespace dl::comm {

// "4K,16K,64K,1M" -> bytes: a number with an optional K (x 1024) or M (x 1024^2) suffix, either
// case, comma-separated; each at least 1 byte and at most 1G. Errors name the bad item.
Result<std::vector<size_t>> ParseByteSizes(std::string_view text);
// The inverse for printing: "4K", "1M", "1536" (K or M only when exact).
std::string FormatByteSize(size_t bytes);

// nccl-tests' bus bandwidth of an all-reduce over `ranks` ranks: the algorithm bandwidth
// (bytes / seconds) times 2 (ranks - 1) / ranks, in GB/s (1e9). 0 when seconds <= 0.
double AllReduceBusGbps(size_t bytes, double seconds, int ranks);

struct GraphAllReduceTiming {
  // One entry per timed replay: the slowest rank's graph time divided by the calls in the graph, us.
  std::vector<double> us_per_call;
  int calls_per_graph = 0;
};

// Every rank of `comms` (one per rank, in rank order) on its own thread, stream and buffer of
// `count` elements of `elem` (zeros) on its device: an eager all-reduce first (NCCL sets up its
// connections there), then `calls` all-reduces captured into one CUDA graph, replayed `warmup`
// times untimed and `iters` times timed with events; before each replay the ranks' threads meet on
// the host, so the replays start together. CUDA builds only (elsewhere: Unavailable).
Result<GraphAllReduceTiming> TimeAllReduceInGraph(const std::vector<DeviceCommunicator*>& comms, int64_t count,
                                                 DeviceElem elem, int calls, int warmup, int iters);

}  // namespace dl::comm
