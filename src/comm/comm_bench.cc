#include "comm/comm_bench.h"

#include <algorithm>
#include <cctype>
#include <thread>

#include <fmt/format.h>

#include "comm/rank_barrier.h"

#if defined(DECODELAB_HAVE_CUDA)
#include <cuda_runtime.h>

#include "cuda/buffer.h"
#include "cuda/check.h"
#endif

namespace dl::comm {

Result<std::vector<size_t>> ParseByteSizes(std::string_view text) {
  std::vector<size_t> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string item(text.substr(start, comma - start));
    start = comma + 1;
    size_t digits = 0;
    while (digits < item.size() && std::isdigit(static_cast<unsigned char>(item[digits]))) ++digits;
    const std::string suffix = item.substr(digits);
    size_t scale = 1;
    if (suffix == "K" || suffix == "k") {
      scale = size_t{1} << 10;
    } else if (suffix == "M" || suffix == "m") {
      scale = size_t{1} << 20;
    } else if (!suffix.empty()) {
      return InvalidArgument("size '{}': a number of bytes with an optional K or M suffix (e.g. 4K, 1M, 1000)", item);
    }
    if (digits == 0 || digits > 10) {
      return InvalidArgument("size '{}': a number of bytes with an optional K or M suffix (e.g. 4K, 1M, 1000)", item);
    }
    const size_t bytes = std::stoull(item.substr(0, digits)) * scale;
    if (bytes < 1 || bytes > (size_t{1} << 30)) return InvalidArgument("size '{}': 1 byte to 1G", item);
    out.push_back(bytes);
    if (comma == text.size()) break;
  }
  return out;
}

std::string FormatByteSize(size_t bytes) {
  if (bytes >= (size_t{1} << 20) && bytes % (size_t{1} << 20) == 0) return fmt::format("{}M", bytes >> 20);
  if (bytes >= (size_t{1} << 10) && bytes % (size_t{1} << 10) == 0) return fmt::format("{}K", bytes >> 10);
  return fmt::format("{}", bytes);
}

double AllReduceBusGbps(size_t bytes, double seconds, int ranks) {
  if (seconds <= 0 || ranks < 1) return 0.0;
  return static_cast<double>(bytes) / seconds / 1e9 * 2.0 * (ranks - 1) / ranks;
}

#if defined(DECODELAB_HAVE_CUDA)

namespace {

// Rank r's part of TimeAllReduceInGraph; ms[i] is its i-th timed replay.
Status TimeRank(DeviceCommunicator& comm, RankBarrier& meet, int64_t count, DeviceElem elem, int calls, int warmup,
                int iters, std::vector<double>* ms) {
  const int r = comm.rank();
  DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(comm.device()));
  DL_ASSIGN_OR_RETURN(auto stream, cuda::Stream::Create());
  DL_ASSIGN_OR_RETURN(auto buf, cuda::DeviceBuffer::Create(std::max<size_t>(16, count * DeviceElemBytes(elem))));
  DL_RETURN_IF_ERROR(buf.Fill(0));  // zeros: repeated in-place sums stay finite
  DL_ASSIGN_OR_RETURN(auto start, cuda::Event::Create());
  DL_ASSIGN_OR_RETURN(auto end, cuda::Event::Create());
  cudaStream_t s = stream.get();
  DL_RETURN_IF_ERROR(comm.AllReduceSum(buf.data(), count, elem, s));
  DL_RETURN_IF_ERROR(stream.Synchronize());
  DL_RETURN_IF_ERROR(comm.DeviceError());
  // Every rank captures before any replays (a replaying rank's kernels would wait for a capturing one).
  DL_RETURN_IF_ERROR(meet.Arrive(r, "eager all-reduce"));
  DL_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  Status st;
  for (int c = 0; c < calls && st.ok(); ++c) st = comm.AllReduceSum(buf.data(), count, elem, s);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(s, &graph);
  if (!st.ok()) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    return st.WithContext("capturing the all-reduces");
  }
  if (ended != cudaSuccess) return Internal("all-reduce graph capture: {}", cudaGetErrorString(ended));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (inst != cudaSuccess) return Internal("instantiating the all-reduce graph: {}", cudaGetErrorString(inst));
  st = meet.Arrive(r, "graph captured");
  for (int i = 0; i < warmup + iters && st.ok(); ++i) {
    st = meet.Arrive(r, "replay");
    if (!st.ok()) break;
    st = start.Record(s);
    if (const cudaError_t e = cudaGraphLaunch(exec, s); st.ok() && e != cudaSuccess) {
      st = Internal("replaying the all-reduce graph: {}", cudaGetErrorString(e));
    }
    if (st.ok()) st = end.Record(s);
    if (st.ok()) st = stream.Synchronize();
    if (st.ok()) st = comm.DeviceError();
    if (st.ok() && i >= warmup) {
      auto elapsed = cuda::Event::ElapsedMs(start, end);
      if (!elapsed.ok()) {
        st = elapsed.status();
      } else {
        ms->push_back(*elapsed);
      }
    }
  }
  cudaGraphExecDestroy(exec);
  return st;
}

}  // namespace

Result<GraphAllReduceTiming> TimeAllReduceInGraph(const std::vector<DeviceCommunicator*>& comms, int64_t count,
                                                 DeviceElem elem, int calls, int warmup, int iters) {
  const int n = static_cast<int>(comms.size());
  if (n < 1 || calls < 1 || iters < 1 || warmup < 0 || count < 0) {
    return InvalidArgument("all-reduce timing: {} ranks, {} calls per graph, {} iterations", n, calls, iters);
  }
  RankBarrier meet(n, 600.0, "all-reduce timing");
  std::vector<std::vector<double>> ms(n);
  std::vector<Status> statuses(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      statuses[r] = TimeRank(*comms[r], meet, count, elem, calls, warmup, iters, &ms[r]);
      // A failed rank must not leave the others waiting: end the meetings and the collectives.
      if (!statuses[r].ok()) {
        meet.Abort(r, statuses[r]);
        comms[r]->Abort(statuses[r]);
      }
    });
  }
  for (auto& t : threads) t.join();
  std::string failures;
  for (int r = 0; r < n; ++r) {
    if (!statuses[r].ok()) failures += fmt::format("{}rank {}: {}", failures.empty() ? "" : "; ", r, statuses[r].ToString());
  }
  if (!failures.empty()) return Internal("all-reduce timing failed: {}", failures);
  GraphAllReduceTiming out;
  out.calls_per_graph = calls;
  for (int i = 0; i < iters; ++i) {
    double slowest = 0;
    for (int r = 0; r < n; ++r) slowest = std::max(slowest, ms[r][i]);
    out.us_per_call.push_back(slowest * 1e3 / calls);
  }
  return out;
}

#else

Result<GraphAllReduceTiming> TimeAllReduceInGraph(const std::vector<DeviceCommunicator*>&, int64_t, DeviceElem, int,
                                                 int, int) {
  return Unavailable("all-reduce timing needs a CUDA build of decodelab");
}

#endif

}  // namespace dl::comm
