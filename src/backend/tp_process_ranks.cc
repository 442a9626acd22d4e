#include "backend/tp_process_ranks.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "backend/cpu_runner.h"
#include "base/byte_codec.h"
#include "comm/tcp_communicator.h"
#include "model/forward_batch_codec.h"

#include <nlohmann/json.hpp>

namespace dl {
namespace {

using Clock = std::chrono::steady_clock;

// Control messages: rank 0 to a child ("DLTC") and a child's replies ("DLTR"), each with a version
// and a kind. Both ends are the same binary, so a version mismatch means a broken install.
constexpr uint32_t kControlMagic = 0x4354'4c44;  // "DLTC"
constexpr uint32_t kReplyMagic = 0x5254'4c44;    // "DLTR"
constexpr uint32_t kSetupMagic = 0x5354'4c44;    // "DLTS"
// 2: the setup says the backend (and a CUDA rank's options); replies carry the rank's report.
constexpr uint32_t kControlVersion = 2;
enum class ControlKind : uint8_t { kStep = 1, kStop = 2 };
enum class ReplyKind : uint8_t { kReady = 1, kStepDone = 2 };
// The largest control message either side reads: far above any plan (tokens, tables, adjustments of
// one step), and a bound on what a corrupt length can make the reader allocate.
constexpr size_t kMaxControlBytes = size_t{1} << 30;
constexpr double kRendezvousSeconds = 60.0;
// How long a child that is still computing gets to reply once rank 0's own forward failed (its
// collectives fail at once when the group is aborted; only a child stuck outside a collective
// takes longer, and it is then killed).
constexpr double kReplyGraceAfterFailureSeconds = 10.0;
// An unbounded wait, as the poll loop counts it (a child waits for the next step as long as rank 0
// lives; rank 0's death closes the connection or kills the child through PR_SET_PDEATHSIG).
constexpr double kForeverSeconds = 1e8;

void PutStatus(ByteWriter& w, const Status& st) {
  w.Put<int32_t>(static_cast<int32_t>(st.code()));
  w.PutString(st.message());
}

Status GetStatus(ByteReader& r, Status* out) {
  int32_t code = 0;
  std::string message;
  DL_RETURN_IF_ERROR(r.Get(&code, "status code"));
  DL_RETURN_IF_ERROR(r.GetString(&message, "status message"));
  if (code < 0 || code > static_cast<int32_t>(StatusCode::kCancelled)) {
    return DataLoss("{}: unknown status code {}", r.what(), code);
  }
  *out = code == 0 ? Status::Ok() : Status(static_cast<StatusCode>(code), std::move(message));
  return Status::Ok();
}

Status GetHeader(ByteReader& r, uint32_t magic, uint8_t* kind) {
  DL_RETURN_IF_ERROR(r.GetHeader(magic, kControlVersion));
  return r.Get(kind, "kind");
}

std::vector<std::byte> EncodeReply(ReplyKind kind, const Status& st, int64_t collectives, const std::string& report) {
  ByteWriter w;
  w.Put<uint32_t>(kReplyMagic);
  w.Put<uint32_t>(kControlVersion);
  w.Put<uint8_t>(static_cast<uint8_t>(kind));
  PutStatus(w, st);
  w.Put<int64_t>(collectives);
  w.PutString(report);
  return w.Take();
}

struct Reply {
  ReplyKind kind = ReplyKind::kReady;
  Status status;
  int64_t collectives = 0;
  std::string report;  // JSON text (TpProcessRanks::report)
};

Result<Reply> DecodeReply(std::span<const std::byte> bytes, int rank) {
  ByteReader r(bytes, fmt::format("reply of rank {}", rank));
  uint8_t kind = 0;
  DL_RETURN_IF_ERROR(GetHeader(r, kReplyMagic, &kind));
  if (kind != static_cast<uint8_t>(ReplyKind::kReady) && kind != static_cast<uint8_t>(ReplyKind::kStepDone)) {
    return DataLoss("reply of rank {}: unknown kind {}", rank, kind);
  }
  Reply reply;
  reply.kind = static_cast<ReplyKind>(kind);
  DL_RETURN_IF_ERROR(GetStatus(r, &reply.status));
  DL_RETURN_IF_ERROR(r.Get(&reply.collectives, "collectives"));
  DL_RETURN_IF_ERROR(r.GetString(&reply.report, "report"));
  DL_RETURN_IF_ERROR(r.ExpectEnd());
  return reply;
}

std::vector<std::byte> EncodeControl(ControlKind kind, const Status& injected, std::span<const std::byte> plan) {
  ByteWriter w;
  w.Put<uint32_t>(kControlMagic);
  w.Put<uint32_t>(kControlVersion);
  w.Put<uint8_t>(static_cast<uint8_t>(kind));
  if (kind == ControlKind::kStep) {
    PutStatus(w, injected);
    w.PutBytes(plan);
  }
  return w.Take();
}

bool WaitReaped(comm::ChildProcess& child, double seconds) {
  const auto until = Clock::now() + std::chrono::duration<double>(seconds);
  while (!child.Poll()) {
    if (Clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// Rank 0's side of one rendezvous, watching the children meanwhile: TcpGroup::Create accepts on a
// duplicate of the listener on a helper thread, and a child that ends first shuts the listening
// socket down, which ends the accept at once (instead of at the deadline). Closes the listener.
Result<std::unique_ptr<comm::TcpGroup>> RendezvousWatching(int tp, const comm::Listener& listener,
                                                           const comm::Endpoint& endpoint, comm::Deadline deadline,
                                                           std::vector<comm::ChildProcess>& children) {
  const int accept_fd = ::fcntl(listener.fd, F_DUPFD_CLOEXEC, 0);
  if (accept_fd < 0) {
    ::close(listener.fd);
    return Unavailable("duplicating the rendezvous listener: {}", std::strerror(errno));
  }
  Result<std::unique_ptr<comm::TcpGroup>> group = Status(StatusCode::kCancelled, "not run");
  std::atomic<bool> done{false};
  std::thread acceptor([&] {
    group = comm::TcpGroup::Create(0, tp, accept_fd, endpoint, deadline);
    done = true;
  });
  std::string ended;
  while (!done && ended.empty()) {
    for (int r = 1; r < tp; ++r) {
      if (children[r].pid() > 0 && children[r].Poll()) {
        ended += fmt::format("; rank {} (process {}) ended before it joined: {}", r, children[r].pid(),
                             children[r].exit_info().ToString());
      }
    }
    if (!ended.empty()) {
      ::shutdown(listener.fd, SHUT_RDWR);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  acceptor.join();
  ::close(listener.fd);
  if (!ended.empty()) {
    return Unavailable("{} (its output is on rank 0's stderr); the rendezvous was cut short: {}", ended.substr(2),
                       group.ok() ? "the group had formed" : group.status().message());
  }
  return group;
}

}  // namespace

std::vector<std::string> TpRankArgs::ToArgv() const {
  return {"--tp-rank",    std::to_string(rank),   "--tp-size",      std::to_string(tp_size),
          "--tp-control", control.ToString(),     "--tp-data",      data.ToString(),
          "--tp-timeout-s", fmt::format("{}", timeout_s)};
}

Result<TpRankArgs> ParseTpRankArgs(const std::vector<std::string>& args, std::vector<std::string>* rest) {
  TpRankArgs a;
  bool has_rank = false, has_size = false, has_control = false, has_data = false;
  rest->clear();
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& key = args[i];
    if (key != "--tp-rank" && key != "--tp-size" && key != "--tp-control" && key != "--tp-data" &&
        key != "--tp-timeout-s") {
      rest->push_back(key);
      continue;
    }
    if (i + 1 >= args.size()) return InvalidArgument("__tp-rank: {} needs a value", key);
    const std::string& value = args[++i];
    if (key == "--tp-rank") {
      DL_ASSIGN_OR_RETURN(long long v, comm::ParseInteger(value, key));
      a.rank = static_cast<int>(v), has_rank = true;
    } else if (key == "--tp-size") {
      DL_ASSIGN_OR_RETURN(long long v, comm::ParseInteger(value, key));
      a.tp_size = static_cast<int>(v), has_size = true;
    } else if (key == "--tp-control") {
      DL_ASSIGN_OR_RETURN(a.control, comm::ParseEndpoint(value));
      has_control = true;
    } else if (key == "--tp-data") {
      DL_ASSIGN_OR_RETURN(a.data, comm::ParseEndpoint(value));
      has_data = true;
    } else {
      char* end = nullptr;
      a.timeout_s = std::strtod(value.c_str(), &end);
      if (end == value.c_str() || *end != '\0' || !(a.timeout_s > 0)) {
        return InvalidArgument("__tp-rank: --tp-timeout-s '{}' is not a positive number", value);
      }
    }
  }
  if (!has_rank || !has_size || !has_control || !has_data) {
    return InvalidArgument("__tp-rank needs --tp-rank, --tp-size, --tp-control and --tp-data (it is started by "
                           "rank 0 of `--tp N --tp-transport processes`, not by hand)");
  }
  if (a.tp_size < 2 || a.rank < 1 || a.rank >= a.tp_size) {
    return InvalidArgument("__tp-rank: rank {} of {} is not a child rank (1..N-1 of N >= 2)", a.rank, a.tp_size);
  }
  return a;
}

TpRankSetup TpRankSetup::ForRankZero(const Checkpoint& checkpoint, int tp, EmbeddingMode embedding,
                                     const KvCacheSpec& kv, const KvScales& scales, TpRankBackend backend) {
  const ModelConfig& c = checkpoint.config();
  return {.tp_size = tp, .rank = 0, .embedding = embedding, .kv = kv, .scales = scales,
          .num_layers = c.num_hidden_layers, .hidden_size = c.hidden_size, .vocab_size = c.vocab_size,
          .weights_digest = WeightsDigest(checkpoint), .backend = backend, .cuda = {}};
}

uint64_t WeightsDigest(const Checkpoint& checkpoint) {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  };
  for (const TensorView& t : checkpoint.tensors()) {
    mix(t.name.data(), t.name.size() + 1);  // with its terminator: "ab"+"c" != "a"+"bc"
    const auto dtype = static_cast<int32_t>(t.dtype);
    mix(&dtype, sizeof dtype);
    for (int64_t d : t.shape) mix(&d, sizeof d);
    mix(&t.block_rows, sizeof t.block_rows);
    mix(&t.block_cols, sizeof t.block_cols);
    if (t.data != nullptr) mix(t.data, std::min<size_t>(t.nbytes(), 64));
    if (t.scales != nullptr) mix(t.scales, sizeof(float));
  }
  return h;
}

std::vector<std::byte> EncodeTpRankSetup(const TpRankSetup& s) {
  ByteWriter w;
  w.Put<uint32_t>(kSetupMagic);
  w.Put<uint32_t>(kControlVersion);
  w.Put<int32_t>(s.tp_size);
  w.Put<int32_t>(s.rank);
  w.Put<uint8_t>(static_cast<uint8_t>(s.embedding));
  w.Put<int32_t>(s.kv.num_layers);
  w.Put<int32_t>(s.kv.num_kv_heads);
  w.Put<int32_t>(s.kv.head_dim);
  w.Put<int32_t>(s.kv.page_size);
  w.Put<uint8_t>(static_cast<uint8_t>(s.kv.dtype));
  std::vector<uint8_t> groups;
  for (KvGroup g : s.kv.layer_groups) groups.push_back(static_cast<uint8_t>(g));
  w.PutVector<uint8_t>(groups);
  w.Put<int32_t>(s.kv.sliding_window);
  w.Put<int32_t>(s.kv.pages_full);
  w.Put<int32_t>(s.kv.pages_sliding);
  w.PutVector<float>(s.scales.k);
  w.PutVector<float>(s.scales.v);
  w.PutString(s.scales.source);
  w.Put<int64_t>(s.num_layers);
  w.Put<int64_t>(s.hidden_size);
  w.Put<int64_t>(s.vocab_size);
  w.Put<uint64_t>(s.weights_digest);
  w.Put<uint8_t>(static_cast<uint8_t>(s.backend));
  if (s.backend == TpRankBackend::kCuda) {
    const CudaRunnerOptions& o = s.cuda.options;
    w.Put<uint8_t>(o.allow_fallback ? 1 : 0);
    w.Put<uint8_t>(o.use_graph ? 1 : 0);
    w.Put<int32_t>(o.max_seq_len);
    w.Put<int32_t>(o.max_rows);
    w.Put<int32_t>(o.max_outputs);
    w.Put<int32_t>(o.max_taps);
    w.Put<uint64_t>(o.synthetic_seed);
    w.Put<uint64_t>(o.skip_ops.size());
    for (const std::string& op : o.skip_ops) w.PutString(op);
    // The tuning as its "name=value" settings (kernels::SetTuning reads them back): every knob, so a
    // child's kernels are rank 0's.
    const auto settings = kernels::TuningSettings(o.tuning);
    w.Put<uint64_t>(settings.size());
    for (const auto& [name, value] : settings) w.PutString(name + "=" + value);
    std::vector<int32_t> devices(s.cuda.devices.begin(), s.cuda.devices.end());
    w.PutVector<int32_t>(devices);
    w.Put<uint64_t>(s.cuda.oneshot_capacity);
    w.Put<int32_t>(s.cuda.oneshot_blocks);
  }
  return w.Take();
}

Result<TpRankSetup> DecodeTpRankSetup(std::span<const std::byte> bytes) {
  ByteReader r(bytes, "tensor-parallel rank setup");
  DL_RETURN_IF_ERROR(r.GetHeader(kSetupMagic, kControlVersion));
  TpRankSetup s;
  uint8_t embedding = 0, dtype = 0;
  DL_RETURN_IF_ERROR(r.Get(&s.tp_size, "tp size"));
  DL_RETURN_IF_ERROR(r.Get(&s.rank, "rank"));
  DL_RETURN_IF_ERROR(r.Get(&embedding, "embedding"));
  if (embedding > static_cast<uint8_t>(EmbeddingMode::kReplicated)) {
    return DataLoss("tensor-parallel rank setup: unknown embedding mode {}", embedding);
  }
  s.embedding = static_cast<EmbeddingMode>(embedding);
  DL_RETURN_IF_ERROR(r.Get(&s.kv.num_layers, "kv num_layers"));
  DL_RETURN_IF_ERROR(r.Get(&s.kv.num_kv_heads, "kv num_kv_heads"));
  DL_RETURN_IF_ERROR(r.Get(&s.kv.head_dim, "kv head_dim"));
  DL_RETURN_IF_ERROR(r.Get(&s.kv.page_size, "kv page_size"));
  DL_RETURN_IF_ERROR(r.Get(&dtype, "kv dtype"));
  if (dtype > static_cast<uint8_t>(DType::kF8E4M3)) return DataLoss("tensor-parallel rank setup: unknown kv dtype {}", dtype);
  s.kv.dtype = static_cast<DType>(dtype);
  std::vector<uint8_t> groups;
  DL_RETURN_IF_ERROR(r.GetVector(&groups, "kv layer groups"));
  for (uint8_t g : groups) {
    if (g > 1) return DataLoss("tensor-parallel rank setup: unknown kv layer group {}", g);
    s.kv.layer_groups.push_back(static_cast<KvGroup>(g));
  }
  DL_RETURN_IF_ERROR(r.Get(&s.kv.sliding_window, "kv sliding_window"));
  DL_RETURN_IF_ERROR(r.Get(&s.kv.pages_full, "kv pages_full"));
  DL_RETURN_IF_ERROR(r.Get(&s.kv.pages_sliding, "kv pages_sliding"));
  DL_RETURN_IF_ERROR(r.GetVector(&s.scales.k, "k scales"));
  DL_RETURN_IF_ERROR(r.GetVector(&s.scales.v, "v scales"));
  DL_RETURN_IF_ERROR(r.GetString(&s.scales.source, "scales source"));
  DL_RETURN_IF_ERROR(r.Get(&s.num_layers, "model num_layers"));
  DL_RETURN_IF_ERROR(r.Get(&s.hidden_size, "model hidden_size"));
  DL_RETURN_IF_ERROR(r.Get(&s.vocab_size, "model vocab_size"));
  DL_RETURN_IF_ERROR(r.Get(&s.weights_digest, "weights digest"));
  uint8_t backend = 0;
  DL_RETURN_IF_ERROR(r.Get(&backend, "backend"));
  if (backend > static_cast<uint8_t>(TpRankBackend::kCuda)) {
    return DataLoss("tensor-parallel rank setup: unknown backend {}", backend);
  }
  s.backend = static_cast<TpRankBackend>(backend);
  if (s.backend == TpRankBackend::kCuda) {
    CudaRunnerOptions& o = s.cuda.options;
    auto flag = [&](bool* out, const char* field) -> Status {
      uint8_t v = 0;
      DL_RETURN_IF_ERROR(r.Get(&v, field));
      if (v > 1) return DataLoss("tensor-parallel rank setup: {} is {}, not 0 or 1", field, v);
      *out = v == 1;
      return Status::Ok();
    };
    DL_RETURN_IF_ERROR(flag(&o.allow_fallback, "cuda allow_fallback"));
    DL_RETURN_IF_ERROR(flag(&o.use_graph, "cuda use_graph"));
    DL_RETURN_IF_ERROR(r.Get(&o.max_seq_len, "cuda max_seq_len"));
    DL_RETURN_IF_ERROR(r.Get(&o.max_rows, "cuda max_rows"));
    DL_RETURN_IF_ERROR(r.Get(&o.max_outputs, "cuda max_outputs"));
    DL_RETURN_IF_ERROR(r.Get(&o.max_taps, "cuda max_taps"));
    DL_RETURN_IF_ERROR(r.Get(&o.synthetic_seed, "cuda synthetic_seed"));
    uint64_t n = 0;
    // Every string takes at least its 8-byte length: the count is checked against what remains.
    DL_RETURN_IF_ERROR(r.GetCount(&n, 8, "cuda skip_ops"));
    o.skip_ops.resize(n);
    for (std::string& op : o.skip_ops) DL_RETURN_IF_ERROR(r.GetString(&op, "cuda skip_op"));
    DL_RETURN_IF_ERROR(r.GetCount(&n, 8, "cuda tuning"));
    o.tuning = kernels::Tuning{};
    for (uint64_t i = 0; i < n; ++i) {
      std::string setting;
      DL_RETURN_IF_ERROR(r.GetString(&setting, "cuda tuning setting"));
      Status st = kernels::SetTuning(&o.tuning, setting);
      if (!st.ok()) return DataLoss("tensor-parallel rank setup: tuning '{}': {}", setting, st.message());
    }
    std::vector<int32_t> devices;
    DL_RETURN_IF_ERROR(r.GetVector(&devices, "cuda devices"));
    if (devices.size() != static_cast<size_t>(std::max(0, s.tp_size))) {
      return DataLoss("tensor-parallel rank setup: {} devices for {} ranks", devices.size(), s.tp_size);
    }
    for (int32_t d : devices) {
      if (d < 0) return DataLoss("tensor-parallel rank setup: device {}", d);
    }
    s.cuda.devices.assign(devices.begin(), devices.end());
    DL_RETURN_IF_ERROR(r.Get(&s.cuda.oneshot_capacity, "cuda oneshot capacity"));
    DL_RETURN_IF_ERROR(r.Get(&s.cuda.oneshot_blocks, "cuda oneshot blocks"));
  }
  DL_RETURN_IF_ERROR(r.ExpectEnd());
  return s;
}

// ---------------------------------------------------------------------------------------------
// Rank 0's side.

Result<std::unique_ptr<TpProcessRanks>> TpProcessRanks::Start(const TpProcessOptions& options,
                                                              const TpRankSetup& setup, double timeout_s) {
  const int tp = setup.tp_size;
  if (tp < 2) return InvalidArgument("tensor-parallel ranks as processes need --tp 2 or more (got {})", tp);
  if (options.argv_prefix.empty()) {
    return InvalidArgument("tensor-parallel ranks as processes: no command line to start the children with");
  }
  std::unique_ptr<TpProcessRanks> p(new TpProcessRanks());
  p->timeout_s_ = timeout_s;
  p->children_.resize(tp);
  p->collectives_.assign(tp, 0);
  p->reports_.assign(tp, std::string());
  p->sent_.assign(tp, false);
  // Both listeners before any child exists (port 0: the kernel picks free ports; close-on-exec, so
  // no child inherits them).
  DL_ASSIGN_OR_RETURN(comm::Listener control_listener, comm::Listen("127.0.0.1", 0));
  Result<comm::Listener> data_listener = comm::Listen("127.0.0.1", 0);
  if (!data_listener.ok()) {
    ::close(control_listener.fd);
    return data_listener.status();
  }
  const comm::Endpoint control{"127.0.0.1", control_listener.port}, data{"127.0.0.1", data_listener->port};
  Status st;
  for (int r = 1; r < tp && st.ok(); ++r) {
    comm::SpawnSpec spec;
    spec.exe = options.exe;
    spec.argv = options.argv_prefix;
    TpRankArgs args{.rank = r, .tp_size = tp, .control = control, .data = data, .timeout_s = timeout_s};
    for (std::string& a : args.ToArgv()) spec.argv.push_back(std::move(a));
    spec.env = comm::EnvironmentWith({});
    spec.output_fd = options.output_fd;
    Result<comm::ChildProcess> child = comm::ChildProcess::Spawn(spec);
    if (!child.ok()) {
      st = child.status().WithContext(fmt::format("starting tensor-parallel rank {}", r));
    } else {
      p->children_[r] = std::move(child).value();
    }
  }
  if (!st.ok()) {
    ::close(control_listener.fd);
    ::close(data_listener->fd);
    p->Stop(0);
    return st;
  }
  // The children connect first thing (before loading weights), so this wait is short; a child that
  // ends before it connected ends the wait at once, named with how it ended.
  const comm::Deadline deadline = comm::DeadlineIn(kRendezvousSeconds);
  auto control_group = RendezvousWatching(tp, control_listener, control, deadline, p->children_);
  Result<std::unique_ptr<comm::TcpGroup>> data_group = Status(StatusCode::kCancelled, "not started");
  if (control_group.ok()) {
    data_group = RendezvousWatching(tp, *data_listener, data, deadline, p->children_);
  } else {
    ::close(data_listener->fd);
  }
  if (!control_group.ok() || !data_group.ok()) {
    p->Stop(0);
    return (!control_group.ok() ? control_group.status() : data_group.status())
        .WithContext("tensor-parallel ranks as processes: rendezvous");
  }
  p->control_ = std::move(control_group).value();
  p->data_ = std::make_unique<comm::TcpCommunicator>(std::move(data_group).value(), timeout_s);
  for (int r = 1; r < tp; ++r) {
    TpRankSetup s = setup;
    s.rank = r;
    Status sent = p->control_->SendMessage(r, EncodeTpRankSetup(s), comm::DeadlineIn(timeout_s));
    if (!sent.ok()) {
      Status gone = p->ChildGone(r, sent, 2.0);
      p->Stop(0);
      return gone.WithContext("tensor-parallel ranks as processes: setup");
    }
  }
  return p;
}

TpProcessRanks::~TpProcessRanks() { Stop(); }

Status TpProcessRanks::ChildGone(int r, const Status& why, double wait_s) {
  comm::ChildProcess& child = children_[r];
  const pid_t pid = child.pid();
  if (!WaitReaped(child, wait_s)) {
    child.KillAndReap();
    return Status(why.code(), fmt::format("{} (process {} was still running: killed)", why.message(), pid));
  }
  return Status(why.code(), fmt::format("process {} ended ({}): {}", pid, child.exit_info().ToString(),
                                        why.message()));
}

Status TpProcessRanks::WaitReady() {
  if (stopped_) return FailedPrecondition("the tensor-parallel group was stopped");
  std::vector<Status> statuses(children_.size());
  for (int r = 1; r < tp_size(); ++r) {
    auto m = control_->ReceiveMessage(r, kMaxControlBytes, comm::DeadlineIn(timeout_s_));
    Result<Reply> reply = m.ok() ? DecodeReply(*m, r) : Result<Reply>(m.status());
    if (!m.ok()) {
      statuses[r] = ChildGone(r, m.status(), m.status().code() == StatusCode::kDeadlineExceeded ? 0.0 : 5.0);
    } else if (!reply.ok()) {
      statuses[r] = reply.status();
    } else if (reply->kind != ReplyKind::kReady) {
      statuses[r] = DataLoss("rank {} replied to its setup with a step reply", r);
    } else {
      statuses[r] = reply->status;
      reports_[r] = reply->report;
    }
  }
  std::string failures;
  for (int r = 1; r < tp_size(); ++r) {
    if (!statuses[r].ok()) failures += fmt::format("{}rank {}: {}", failures.empty() ? "" : "; ", r, statuses[r].ToString());
  }
  if (failures.empty()) return Status::Ok();
  Stop();
  return Unavailable("tensor-parallel ranks as processes did not start: {}", failures);
}

std::vector<Status> TpProcessRanks::SendStep(std::span<const std::byte> plan, InjectedFailures& injected_failures) {
  std::vector<Status> statuses(children_.size());
  for (int r = 1; r < tp_size(); ++r) {
    if (stopped_) {
      statuses[r] = FailedPrecondition("the tensor-parallel group was stopped");
      sent_[r] = false;
      continue;
    }
    const Status injected = injected_failures.Take(r);
    statuses[r] = control_->SendMessage(r, EncodeControl(ControlKind::kStep, injected, plan),
                                        comm::DeadlineIn(timeout_s_));
    sent_[r] = statuses[r].ok();
  }
  return statuses;
}

void TpProcessRanks::CollectReplies(bool rank0_failed, std::vector<Status>* statuses) {
  const double wait_s = rank0_failed ? std::min(timeout_s_, kReplyGraceAfterFailureSeconds) : timeout_s_;
  const comm::Deadline deadline = comm::DeadlineIn(wait_s);
  for (int r = 1; r < tp_size(); ++r) {
    Status& st = (*statuses)[r];
    if (!sent_[r]) {
      if (!stopped_) st = ChildGone(r, st, 5.0);
      continue;
    }
    sent_[r] = false;
    auto m = control_->ReceiveMessage(r, kMaxControlBytes, deadline);
    if (!m.ok()) {
      if (m.status().code() == StatusCode::kDeadlineExceeded) {
        // Alive but silent: stuck outside any collective. It cannot be trusted with another step.
        st = ChildGone(r, Status(StatusCode::kDeadlineExceeded,
                                 fmt::format("no reply to its step within {} s", wait_s)),
                       0.0);
      } else {
        st = ChildGone(r, m.status(), 5.0);
      }
      continue;
    }
    Result<Reply> reply = DecodeReply(*m, r);
    if (!reply.ok()) {
      st = reply.status();
    } else if (reply->kind != ReplyKind::kStepDone) {
      st = DataLoss("rank {} replied to a step with a setup reply", r);
    } else {
      st = reply->status;
      collectives_[r] = reply->collectives;
      if (!reply->report.empty()) reports_[r] = reply->report;
    }
  }
}

void TpProcessRanks::Stop(double grace_s) {
  if (stopped_) return;
  stopped_ = true;
  if (control_) {
    const std::vector<std::byte> stop = EncodeControl(ControlKind::kStop, Status::Ok(), {});
    for (int r = 1; r < tp_size(); ++r) {
      if (children_[r].running()) (void)control_->SendMessage(r, stop, comm::DeadlineIn(1.0));
    }
  }
  const auto until = Clock::now() + std::chrono::duration<double>(grace_s);
  for (int r = 1; r < tp_size(); ++r) {
    comm::ChildProcess& child = children_[r];
    if (child.pid() <= 0) continue;
    const double left = std::max(0.0, std::chrono::duration<double>(until - Clock::now()).count());
    if (!WaitReaped(child, left)) child.KillAndReap();
    child.KillGroup();  // anything the child started that outlived it
  }
  // The sockets last: a child that was still running saw its stop message, not a closed connection.
  // Rank 0's communicator object stays (its CpuRunner points to it) but is aborted: any later
  // collective fails at once.
  if (data_) data_->Abort(Status(StatusCode::kCancelled, "the tensor-parallel group was stopped"));
  control_.reset();
}

std::vector<pid_t> TpProcessRanks::pids() const {
  std::vector<pid_t> p;
  for (int r = 0; r < tp_size(); ++r) p.push_back(pid(r));
  return p;
}

// ---------------------------------------------------------------------------------------------
// A child's side.

namespace {

// What a child process runs each step: its rank of one backend.
class ChildRank {
 public:
  virtual ~ChildRank() = default;
  // The rank's share of one step, to its end (results discarded: rank 0's are the step's).
  virtual Status Step(const ForwardBatch& batch) = 0;
  // Ends the group's collectives (every rank's pending and later ones fail).
  virtual void Abort(const Status& reason) = 0;
  virtual int64_t collectives_last_forward() const = 0;
  virtual int32_t page_size() const = 0;
  // TpProcessRanks::report's JSON text.
  virtual std::string Report() const { return {}; }
};

class CpuChildRank final : public ChildRank {
 public:
  CpuChildRank(std::unique_ptr<CpuRunner> runner, comm::Communicator* comm) : runner_(std::move(runner)), comm_(comm) {}
  Status Step(const ForwardBatch& batch) override {
    ForwardResult discarded;
    return runner_->Forward(batch, &discarded);
  }
  void Abort(const Status& reason) override { comm_->Abort(reason); }
  int64_t collectives_last_forward() const override { return runner_->collectives_last_forward(); }
  int32_t page_size() const override { return runner_->kv_spec().page_size; }

 private:
  std::unique_ptr<CpuRunner> runner_;
  comm::Communicator* comm_;
};

// A CUDA rank: its own CudaRunner over the one-shot IPC communicator. No Prepare barrier as the
// threads need: each process has its own CUDA context, so capturing or loading kernels here never
// waits for a peer's spinning kernel.
class CudaChildRank final : public ChildRank {
 public:
  // Declared first, destroyed last: the runner enqueues on it.
  std::unique_ptr<comm::DeviceCommunicator> comm;
  std::unique_ptr<CudaRunner> runner;

  Status Step(const ForwardBatch& batch) override {
    DL_RETURN_IF_ERROR(runner->Prepare(batch));
    Status st = runner->Submit();
    ForwardResult discarded;
    Status waited = runner->Wait(&discarded);
    return st.ok() ? waited : st;
  }
  void Abort(const Status& reason) override {
    if (comm) comm->Abort(reason);
  }
  int64_t collectives_last_forward() const override { return runner->collectives_last_forward(); }
  int32_t page_size() const override { return runner->kv_spec().page_size; }
  std::string Report() const override {
    const nlohmann::json d = runner->Describe();
    return nlohmann::json{{"kernel_nodes", runner->kernel_nodes()}, {"topology", d["topology"]}}.dump();
  }
  ~CudaChildRank() override { runner.reset(); }
};

}  // namespace

Status RunTpRankChild(const TpRankArgs& args, const std::function<Result<Checkpoint>()>& load) {
  const int r = args.rank;
  const comm::Deadline deadline = comm::DeadlineIn(kRendezvousSeconds);
  auto control_group = comm::TcpGroup::Create(r, args.tp_size, -1, args.control, deadline);
  if (!control_group.ok()) return control_group.status().WithContext(fmt::format("rank {}: control rendezvous", r));
  auto data_group = comm::TcpGroup::Create(r, args.tp_size, -1, args.data, deadline);
  if (!data_group.ok()) return data_group.status().WithContext(fmt::format("rank {}: data rendezvous", r));
  std::unique_ptr<comm::TcpGroup> control = std::move(control_group).value();
  comm::TcpCommunicator comm(std::move(data_group).value(), args.timeout_s);
  auto receive = [&](double seconds) {
    return control->ReceiveMessage(0, kMaxControlBytes, comm::DeadlineIn(seconds));
  };
  auto reply = [&](ReplyKind kind, const Status& st, int64_t collectives, const std::string& report) {
    return control->SendMessage(0, EncodeReply(kind, st, collectives, report), comm::DeadlineIn(args.timeout_s));
  };
  auto setup_message = receive(args.timeout_s);
  if (!setup_message.ok()) return setup_message.status().WithContext(fmt::format("rank {}: setup", r));
  const std::vector<std::byte> setup_bytes = std::move(setup_message).value();
  // Everything that can go wrong while building the rank is reported to rank 0 before leaving.
  std::optional<Checkpoint> checkpoint;
  std::unique_ptr<ChildRank> rank;
  Status built = [&]() -> Status {
    DL_ASSIGN_OR_RETURN(TpRankSetup setup, DecodeTpRankSetup(setup_bytes));
    if (setup.rank != r || setup.tp_size != args.tp_size) {
      return DataLoss("setup for rank {} of {} sent to rank {} of {}", setup.rank, setup.tp_size, r, args.tp_size);
    }
    std::unique_ptr<CudaChildRank> cuda_rank;
    if (setup.backend == TpRankBackend::kCuda) {
      // The communicator first: rank 0 builds its side right after sending the setups, and the
      // handle exchange is bounded by the collective timeout (loading weights is not).
      cuda_rank = std::make_unique<CudaChildRank>();
      DL_ASSIGN_OR_RETURN(cuda_rank->comm, comm::CreateOneShotIpcRank(r, args.tp_size, setup.cuda.devices[r],
                                                                      setup.cuda.oneshot(),
                                                                      args.timeout_s, comm::ExchangeOver(comm)));
    }
    DL_ASSIGN_OR_RETURN(Checkpoint ck, load());
    checkpoint.emplace(std::move(ck));
    const ModelConfig& c = checkpoint->config();
    if (c.num_hidden_layers != setup.num_layers || c.hidden_size != setup.hidden_size ||
        c.vocab_size != setup.vocab_size) {
      return FailedPrecondition(
          "this rank loaded a model of {} layers, hidden size {}, vocabulary {}; rank 0's has {}, {}, {}",
          c.num_hidden_layers, c.hidden_size, c.vocab_size, setup.num_layers, setup.hidden_size, setup.vocab_size);
    }
    if (const uint64_t mine = WeightsDigest(*checkpoint); mine != setup.weights_digest) {
      return FailedPrecondition(
          "this rank built other weights than rank 0 (weights digest {:016x}, rank 0's {:016x}: a tensor's dtype, "
          "shape, FP8 block shape or values differ)",
          mine, setup.weights_digest);
    }
    DL_ASSIGN_OR_RETURN(TensorParallelPlan plan, MakeTensorParallelPlan(c, args.tp_size, setup.embedding));
    if (cuda_rank) {
      CudaRunnerOptions o = setup.cuda.options;
      o.device = setup.cuda.devices[r];
      auto runner = CudaRunner::CreateRank(*checkpoint, setup.kv, setup.scales, o, plan, r, cuda_rank->comm.get());
      if (!runner.ok()) return runner.status().WithContext(fmt::format("on GPU {}", o.device));
      cuda_rank->runner = std::move(runner).value();
      rank = std::move(cuda_rank);
    } else {
      DL_ASSIGN_OR_RETURN(auto runner, CpuRunner::CreateRank(*checkpoint, setup.kv, setup.scales, plan, r, &comm));
      rank = std::make_unique<CpuChildRank>(std::move(runner), &comm);
    }
    return Status::Ok();
  }();
  // A rank that could not be built leaves the group: its peers must not wait for it in the handle
  // exchange (or later).
  if (!built.ok()) comm.Abort(built);
  DL_RETURN_IF_ERROR(reply(ReplyKind::kReady, built, 0, built.ok() ? rank->Report() : std::string())
                         .WithContext(fmt::format("rank {}: ready reply", r)));
  DL_RETURN_IF_ERROR(built.WithContext(fmt::format("rank {}", r)));

  for (;;) {
    auto m = receive(kForeverSeconds);
    if (!m.ok()) return m.status().WithContext(fmt::format("rank {}: rank 0 went away", r));
    ByteReader reader(*m, fmt::format("control message to rank {}", r));
    uint8_t kind = 0;
    Status st = GetHeader(reader, kControlMagic, &kind);
    if (st.ok() && kind == static_cast<uint8_t>(ControlKind::kStop)) {
      DL_RETURN_IF_ERROR(reader.ExpectEnd());
      return Status::Ok();
    }
    if (st.ok() && kind != static_cast<uint8_t>(ControlKind::kStep)) {
      st = DataLoss("control message to rank {}: unknown kind {}", r, kind);
    }
    Status injected;
    std::span<const std::byte> plan_bytes;
    if (st.ok()) st = GetStatus(reader, &injected);
    if (st.ok()) st = reader.GetBytes(&plan_bytes, "plan");
    if (st.ok()) st = reader.ExpectEnd();
    Result<DecodedForwardBatch> plan = st.ok() ? DecodeForwardBatch(plan_bytes) : Result<DecodedForwardBatch>(st);
    if (plan.ok()) st = plan->batch.Validate(checkpoint->config().vocab_size, rank->page_size());
    if (!plan.ok() || !st.ok()) {
      // A plan this rank cannot read: the group cannot go on (the others would wait for this rank's
      // collectives). Say so to rank 0 and leave.
      const Status bad = (plan.ok() ? st : plan.status()).WithContext(fmt::format("rank {}", r));
      rank->Abort(bad);
      comm.Abort(bad);
      (void)reply(ReplyKind::kStepDone, bad, 0, std::string());
      return bad;
    }
    st = injected.ok() ? rank->Step(plan->batch) : injected;
    // A failed rank must not leave the others waiting in a collective it will never join.
    if (!st.ok()) rank->Abort(st);
    DL_RETURN_IF_ERROR(reply(ReplyKind::kStepDone, st, rank->collectives_last_forward(), rank->Report())
                           .WithContext(fmt::format("rank {}: step reply", r)));
  }
}

}  // namespace dl
