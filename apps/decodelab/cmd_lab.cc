// decodelab lab: the instruments of docs/lab.md (design: shared/design/lab.md). `screen` and
// `suite` start `decodelab serve` themselves, run every check and the speed statistics and write a
// run directory plus ledger rows; `teacher` records the exactness reference from a control; `lock`
// writes an identity lock; `runs` and `compare` read the ledger.
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
#include <thread>

#include <unistd.h>

#include "apps/decodelab/commands.h"
#include "apps/decodelab/engine_flags.h"
#include "base/build_info.h"
#include "base/file_util.h"
#include "base/sha256.h"
#include "comm/process.h"
#include "cuda/device.h"
#include "cuda/nvml.h"
#include "kernels/elementwise.h"
#include "lab/lab_checks.h"
#include "lab/lab_gate.h"
#include "lab/lab_ledger.h"
#include "lab/lab_report.h"
#include "lab/lab_runner.h"
#include "lab/lab_suite.h"
#include "model/config.h"
#include "model/model_writer.h"
#include "model/shapes.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/tokenizer_writer.h"

namespace dl::app {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct LabFlags {
  std::string model_dir, shape, backend = "auto", suite, runs_dir, label, teacher, lock;
  std::string binary, endpoint, cache_dir, out;
  std::string bundles;  // lab report: Vega-Lite bundle folder
  uint64_t seed = 0;
  int num_layers = 0;
  int repeats = 2;
  double start_timeout_s = 300;   // serve must answer /health within this
  double step_timeout_s = 3600;   // any child (calibrate, probe) and any one HTTP request
  bool accept_identity = false;
  std::vector<std::string> serve_flags;
  std::vector<std::string> compare;
  SpecFlags spec;  // --spec ...: speculative decoding for the screen's or suite's server
};

constexpr uint64_t kTinySeed = 11;

bool Exists(const std::string& path) {
  std::error_code ec;
  return fs::exists(path, ec);
}

std::string CacheDir(const LabFlags& f) {
  if (!f.cache_dir.empty()) return f.cache_dir;
  if (const char* d = std::getenv("DECODELAB_CACHE"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/decodelab";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/decodelab";
  return "/tmp/decodelab-cache";
}

// <default cache>/runs: where `lab screen` puts runs and `lab report` looks for them unless told
// otherwise, whatever the working directory (scripts/run-main.sh uses the same place).
std::string DefaultRunsDir() { return CacheDir(LabFlags{}) + "/runs"; }

// The embedded default tiny model: generated once into the cache with the make-model writer.
Result<std::string> EnsureTinyModel(const std::string& cache) {
  const std::string dir = cache + "/models/tiny-seed11";
  if (Exists(dir + "/config.json") && Exists(dir + "/tokenizer.json")) {
    return dir;
  }
  std::fprintf(stderr, "lab: generating the default tiny model in %s\n", dir.c_str());
  DL_ASSIGN_OR_RETURN(ModelConfig cfg, ShapeConfig("tiny"));
  const std::string tmp = dir + ".partial";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(fs::path(dir).parent_path(), ec);
  MakeModelOptions o;
  o.config = cfg;
  o.seed = kTinySeed;
  o.out_dir = tmp;
  DL_RETURN_IF_ERROR(WriteSyntheticModel(o).status());
  if (!Exists(tmp + "/tokenizer.json")) {
    DL_RETURN_IF_ERROR(WriteSmallTokenizer(tmp, static_cast<int32_t>(cfg.vocab_size)));
  }
  fs::remove_all(dir, ec);
  fs::rename(tmp, dir, ec);
  if (ec) return Internal("{}: cannot move the generated model into place: {}", dir, ec.message());
  return dir;
}

std::string ResolveBackend(const std::string& b) {
  if (b != "auto") return b;
  return cuda::DeviceCount() > 0 ? "cuda" : "cpu";
}

// Runs `exe args...` without a shell (no argument is ever interpreted), its output on our stderr
// (progress here, not the lab's result), killed after `timeout_s`.
Status RunChild(const std::string& exe, const std::vector<std::string>& args, double timeout_s) {
  comm::SpawnSpec spec;
  spec.exe = exe;
  spec.argv = {exe};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.env = comm::EnvironmentWith({});
  spec.output_fd = STDERR_FILENO;
  DL_ASSIGN_OR_RETURN(comm::ExitInfo exit, comm::RunToCompletion(spec, timeout_s));
  if (!exit.exited || exit.code != 0) {
    return Internal("`{} {}` failed: {}", exe, args.empty() ? "" : args[0], exit.ToString());
  }
  return Status::Ok();
}

// Moves the speculative decoding flags out of serve flags (after `--`, or a gate plan's side
// "flags") into `spec`: the lab owns them, so a run records them and a teacher never gets them.
// `found` says whether there were any.
Status TakeSpecFlags(std::vector<std::string>* serve, SpecFlags* spec, bool* found) {
  std::vector<std::string> rest;
  for (size_t i = 0; i < serve->size(); ++i) {
    const std::string& a = (*serve)[i];
    const size_t eq = a.find('=');
    const std::string name = a.substr(0, eq);
    if (name != "--spec" && name != "--spec-k" && name != "--spec-model" &&
        name != "--spec-ngram-min" && name != "--spec-ngram-max") {
      rest.push_back(a);
      continue;
    }
    std::string value;
    if (eq != std::string::npos) {
      value = a.substr(eq + 1);
    } else if (i + 1 < serve->size()) {
      value = (*serve)[++i];
    } else {
      return InvalidArgument("{} after -- needs a value", name);
    }
    *found = true;
    auto integer = [&](int* out) -> Status {
      int v = 0;
      auto [p, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
      if (value.empty() || ec != std::errc() || p != value.data() + value.size()) {
        return InvalidArgument("{} {}: not an integer", name, value);
      }
      *out = v;
      return Status::Ok();
    };
    if (name == "--spec") {
      spec->method = value;
    } else if (name == "--spec-model") {
      spec->model = value;
    } else if (name == "--spec-k") {
      DL_RETURN_IF_ERROR(integer(&spec->k));
    } else if (name == "--spec-ngram-min") {
      DL_RETURN_IF_ERROR(integer(&spec->ngram_min));
    } else {
      DL_RETURN_IF_ERROR(integer(&spec->ngram_max));
    }
  }
  *serve = std::move(rest);
  return Status::Ok();
}

// Builds LabOptions from the flags: model arguments, suite, calibration, teacher, lock.
Result<lab::LabOptions> Prepare(const LabFlags& f, const std::string& mode) {
  lab::LabOptions o;
  o.mode = mode;
  o.binary = f.binary.empty() ? "/proc/self/exe" : f.binary;
  if (f.binary.empty()) {
    std::error_code ec;
    auto real = fs::read_symlink("/proc/self/exe", ec);
    if (!ec) o.binary = real.string();
  }
  if (!Exists(o.binary)) return NotFound("--binary {}: no such file", o.binary);
  if (f.label.size() > 100) {
    return InvalidArgument("--label is {} characters; at most 100 (it names the run directory)",
                           f.label.size());
  }
  if (!(f.start_timeout_s > 0) || !(f.step_timeout_s > 0)) {
    return InvalidArgument("--start-timeout and --step-timeout must be positive");
  }
  o.server_start_timeout_s = f.start_timeout_s;
  o.request_timeout_s = f.step_timeout_s;
  o.endpoint = f.endpoint;
  o.hash_binary = f.endpoint.empty() || !f.binary.empty();
  o.runs_dir = f.runs_dir;
  o.serve_extra = f.serve_flags;
  // Speculation: the lab's --spec flags, or the same flags after `--` (not both).
  SpecFlags spec = f.spec;
  bool spec_after_dashes = false;
  DL_RETURN_IF_ERROR(TakeSpecFlags(&o.serve_extra, &spec, &spec_after_dashes));
  const SpecFlags defaults;
  const bool spec_on_lab = f.spec.method != defaults.method || f.spec.k != defaults.k ||
                           f.spec.ngram_min != defaults.ngram_min ||
                           f.spec.ngram_max != defaults.ngram_max || !f.spec.model.empty();
  if (spec_after_dashes && spec_on_lab) {
    return InvalidArgument("give the --spec flags to the lab or after --, not both");
  }
  {
    auto so = spec.ToOptions();
    if (!so.ok()) return so.status();
    if (so->enabled()) {
      if (!f.endpoint.empty()) {
        return InvalidArgument(
            "--spec configures the server the lab starts; with --endpoint the running server's own "
            "speculation is read from its /v1/decodelab/state and recorded");
      }
      o.spec_args = spec.ToArgs();
    }
  }
  // A speculative run is visibly one: its default label names the drafter.
  o.label = f.label;
  if (o.label.empty()) {
    o.label = o.spec_args.empty() ? mode : fmt::format("{}-spec-{}", mode, spec.method);
  }
  for (const auto& flag : o.serve_extra) {
    for (const char* owned : {"--kv-scales", "--kv-dtype", "--port", "--host", "--model", "--shape",
                              "--backend", "--seed", "--num-layers"}) {
      const std::string prefix = std::string(owned);
      if (flag == prefix || flag.rfind(prefix + "=", 0) == 0) {
        return InvalidArgument(
            "{} after -- is set by the lab itself (use the lab's own flag, or the suite's "
            "kv_dtype/calibration)",
            owned);
      }
    }
  }
  o.accept_identity = f.accept_identity;
  o.repeats = mode == "suite" ? f.repeats : 1;
  if (o.repeats < 1) return InvalidArgument("--repeats must be at least 1");
  const std::string cache = CacheDir(f);
  const std::string backend = ResolveBackend(f.backend);

  // Model.
  ModelConfig cfg;
  bool default_model = false;
  std::string model_key;
  if (!f.model_dir.empty() && !f.shape.empty()) {
    return InvalidArgument("give --model or --shape, not both");
  }
  if (!f.model_dir.empty()) {
    DL_ASSIGN_OR_RETURN(cfg,
                        ModelConfig::FromFile((fs::path(f.model_dir) / "config.json").string()));
    o.model_args = {"--model", f.model_dir};
    model_key = "model:" + fs::absolute(f.model_dir).string();
  } else if (!f.shape.empty()) {
    DL_ASSIGN_OR_RETURN(
        cfg,
        ShapeConfig(f.shape, f.num_layers > 0 ? std::optional<int>(f.num_layers) : std::nullopt));
    o.model_args = {"--shape", f.shape, "--seed", std::to_string(f.seed)};
    if (f.num_layers > 0) {
      o.model_args.insert(o.model_args.end(), {"--num-layers", std::to_string(f.num_layers)});
    }
    model_key = fmt::format("shape:{}:{}:{}", f.shape, f.seed, f.num_layers);
  } else {
    DL_ASSIGN_OR_RETURN(std::string dir, EnsureTinyModel(cache));
    DL_ASSIGN_OR_RETURN(cfg, ModelConfig::FromFile(dir + "/config.json"));
    o.model_args = {"--model", dir};
    default_model = true;
    model_key = "default-tiny";
  }
  o.model_args.insert(o.model_args.end(), {"--backend", backend});
  o.sliding_window = cfg.sliding_window;
  o.vocab_limit = static_cast<int>(cfg.vocab_size);
  const std::string model_dir = o.model_args[0] == "--model" ? o.model_args[1] : "";
  if (!model_dir.empty() && Exists(model_dir + "/tokenizer.json")) {
    auto t = Tokenizer::FromFile(model_dir);
    if (t.ok()) {
      auto tok = std::make_shared<Tokenizer>(std::move(t).value());
      o.tokenize = [tok](const std::string& text) { return tok->Encode(text); };
    }
  }

  // Suite: --suite, else the default suite written into the cache.
  std::string suite_path = f.suite;
  if (suite_path.empty()) {
    suite_path = cache + "/suites/default.json";
    DL_RETURN_IF_ERROR(lab::WriteTextFile(suite_path, lab::DefaultSuiteJson()));
  }
  DL_ASSIGN_OR_RETURN(o.suite, lab::ReadSuiteFile(suite_path));

  // Calibration: the suite's file, else `decodelab calibrate` for this model, cached.
  if (o.suite.calibration.empty() && o.endpoint.empty()) {
    // `decodelab calibrate` runs on the screen's backend (CPU: F32 cache; CUDA: a BF16 cache, so
    // large shapes never need host weights); the file records which, and the cache key includes it.
    const std::string backend_arg = o.model_args.back();
    const std::string cal = fmt::format("{}/calibration/{}.json", cache,
                                        Sha256Hex(model_key + "|" + backend_arg).substr(0, 16));
    if (!Exists(cal)) {
      std::fprintf(stderr, "lab: calibrating KV scales into %s\n", cal.c_str());
      std::vector<std::string> args = {"calibrate"};
      args.insert(args.end(), o.model_args.begin(), o.model_args.end() - 2);  // minus --backend
      args.insert(args.end(), {"--backend", backend_arg, "--out", cal});
      std::error_code ec;
      fs::create_directories(fs::path(cal).parent_path(), ec);
      if (Status st = RunChild(o.binary, args, f.step_timeout_s); !st.ok()) {
        return Internal("`decodelab calibrate` failed for {} (output above): {}", model_key,
                        st.message());
      }
    }
    o.suite.calibration = cal;
  }

  // Teacher: --teacher, else the suite's, else (default model only) cached per backend, KV dtype
  // and binary identity. A teacher named by the user or the suite must exist (except as the output
  // of `lab teacher`): recording a missing one from the binary under test would pass any run.
  o.teacher_path = !f.teacher.empty() ? f.teacher : o.suite.teacher;
  if (!o.teacher_path.empty() && mode != "teacher" && !Exists(o.teacher_path)) {
    return NotFound("teacher {} (named by {}) does not exist; record it with `decodelab lab "
                    "teacher`",
                    o.teacher_path, !f.teacher.empty() ? "--teacher" : o.suite.path);
  }
  if (o.teacher_path.empty() && (default_model || mode == "teacher")) {
    DL_ASSIGN_OR_RETURN(std::string bin_sha, Sha256File(o.binary));
    o.teacher_path =
        fmt::format("{}/teachers/{}-{}-{}-{}-{}.json", cache, Sha256Hex(model_key).substr(0, 12),
                    o.suite.sha256.substr(0, 12), backend, o.suite.kv_dtype, bin_sha.substr(0, 12));
  }
  if (!f.lock.empty()) {
    DL_ASSIGN_OR_RETURN(o.lock, lab::ReadLockFile(f.lock));
    o.lock_path = f.lock;
  }
  o.progress = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  if (!o.endpoint.empty() && mode != "teacher" &&
      (o.teacher_path.empty() || !Exists(o.teacher_path))) {
    return InvalidArgument(
        "--endpoint needs an existing teacher (--teacher FILE): a teacher is never recorded from "
        "the server under test");
  }
  if (default_model && mode != "teacher" && !Exists(o.teacher_path)) {
    std::fprintf(stderr, "lab: recording the default model's teacher on %s into %s\n",
                 backend.c_str(), o.teacher_path.c_str());
    lab::LabOptions t = o;
    t.mode = "teacher";
    DL_RETURN_IF_ERROR(lab::RecordTeacher(t));
  }
  return o;
}

int RunLab(const LabFlags& f, const std::string& mode) {
  auto o = Prepare(f, mode);
  if (!o.ok()) return ReportError(o.status());
  if (mode == "teacher") {
    if (!o->spec_args.empty()) {
      return ReportError(InvalidArgument(
          "a teacher is recorded from plain decoding: run `lab screen --spec ...` against it "
          "instead (a speculative run must give the teacher's tokens)"));
    }
    if (o->teacher_path.empty()) {
      return ReportError(InvalidArgument("teacher: give --teacher FILE (the transcript to write)"));
    }
    std::fprintf(stderr, "lab: recording the teacher (%zu prompts, M = %d/%d)\n",
                 o->suite.prompts.size(), o->suite.screen_tokens, o->suite.suite_tokens);
    if (Status st = lab::RecordTeacher(*o); !st.ok()) return ReportError(st);
    std::printf("wrote %s\n", o->teacher_path.c_str());
    return 0;
  }
  auto runs = lab::RunScreenOrSuite(*o);
  if (!runs.ok()) return ReportError(runs.status());
  bool ok = true;
  for (const auto& r : *runs) {
    std::printf("%s", lab::FormatRunTable(r).c_str());
    ok &= r.verdict == "PASS";
  }
  if (runs->size() >= 2 && ok) {
    // The repeat line: the same configuration twice, so their difference is the repeat spread any
    // later comparison has to beat.
    std::vector<double> conv;
    const char* key = lab::SpeedKey(runs->front().summary);
    for (const auto& r : *runs) {
      const auto& v = r.summary[key];
      if (v.is_number()) conv.push_back(v.get<double>());
    }
    if (conv.size() >= 2) {
      const double lo = *std::min_element(conv.begin(), conv.end());
      const double hi = *std::max_element(conv.begin(), conv.end());
      std::string list;
      for (double c : conv) list += fmt::format("{}{:.2f}", list.empty() ? "" : " / ", c);
      std::printf(
          "repeats: %s median %s tok/s; repeat spread %.2f tok/s (%.1f%%); a "
          "comparison must exceed it (`decodelab lab compare %s %s`)\n",
          key == std::string("decode_tok_s_stream_median") ? "stream" : "conventional",
          list.c_str(), hi - lo, lo > 0 ? 100 * (hi - lo) / lo : 0.0, runs->front().run_id.c_str(),
          runs->back().run_id.c_str());
    }
  }
  std::fflush(stdout);
  return ok ? 0 : 3;
}

int RunLock(const LabFlags& f) {
  std::string bin = f.binary;
  if (bin.empty()) {
    std::error_code ec;
    bin = fs::read_symlink("/proc/self/exe", ec).string();
  }
  auto sha = Sha256File(bin);
  if (!sha.ok()) return ReportError(sha.status());
  lab::IdentityLock l{*sha, BuildCommit()};
  if (Status st = lab::WriteTextFile(f.out, l.ToJson().dump(2) + "\n"); !st.ok()) {
    return ReportError(st);
  }
  std::printf("locked %s (sha256 %s, commit %s) in %s\n", bin.c_str(), sha->c_str(),
              l.commit.c_str(), f.out.c_str());
  return 0;
}

int RunRuns(const LabFlags& f) {
  const auto incomplete = lab::ListIncompleteRuns(f.runs_dir);
  auto runs = lab::LedgerList(f.runs_dir);
  // Only killed runs so far: no ledger yet, but they are listed.
  if (!runs.ok() && runs.status().code() == StatusCode::kNotFound && !incomplete.empty()) {
    runs = std::vector<lab::LedgerRun>{};
  }
  if (!runs.ok()) return ReportError(runs.status());
  std::printf("%-48s %-7s %-8s %-7s %12s %12s %12s %10s\n", "run id", "mode", "verdict", "exact",
              "conv tok/s", "hist tok/s", "stream tok/s", "accept len");
  for (const auto& r : *runs) {
    auto num = [&](const std::optional<double>& v) {
      return v && r.valid ? fmt::format("{:.2f}", *v) : std::string("-");
    };
    // Acceptance is not a speed: shown for every speculative run ("none": no drafts).
    const std::string accept = !r.speculative ? "-"
                               : r.mean_acceptance_length
                                   ? fmt::format("{:.2f}", *r.mean_acceptance_length)
                                   : "none";
    std::printf("%-48s %-7s %-8s %3d/%-3d %12s %12s %12s %10s\n", r.run_id.c_str(), r.mode.c_str(),
                r.verdict.c_str(), r.exact, r.prompts, num(r.conventional).c_str(),
                num(r.historical).c_str(), num(r.stream).c_str(), accept.c_str());
  }
  // Killed runs have a directory but no ledger row.
  for (const auto& r : incomplete) {
    std::printf(
        "%-48s %-7s %-8s %7s %12s %12s %12s %10s  (no result: the run was killed or stopped; %s)\n",
        r.run_id.c_str(), r.mode.c_str(), "INCOMPLETE", "-", "-", "-", "-", "-", r.dir.c_str());
  }
  return 0;
}

int RunCompare(const LabFlags& f) {
  if (f.compare.size() != 2)
    return ReportError(InvalidArgument("compare takes two run ids or labels"));
  auto a = lab::LedgerSelect(f.runs_dir, f.compare[0]);
  if (!a.ok()) return ReportError(a.status());
  auto b = lab::LedgerSelect(f.runs_dir, f.compare[1]);
  if (!b.ok()) return ReportError(b.status());
  auto c = lab::Compare(f.compare[0], *a, f.compare[1], *b);
  if (!c.ok()) return ReportError(c.status());
  std::printf("%s\n", c->Line().c_str());
  return 0;
}

// ---- gate (lab.md §5) ----

struct GateContext {
  LabFlags base;  // model, backend, suite, runs dir, cache
  lab::GatePlan plan;
  std::string dir;  // <runs>/gates/<gate id>
  lab::GateRecord record;
};

std::string SelfBinary() {
  std::error_code ec;
  auto p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? "/proc/self/exe" : p.string();
}

LabFlags SideFlags(const GateContext& g, const lab::GateSide& side, const std::string& label) {
  LabFlags f = g.base;
  f.binary = side.binary;
  f.lock = side.lock;
  f.serve_flags = side.flags;
  f.label = label;
  f.teacher = g.record.extra.value("teacher", std::string());
  f.endpoint.clear();
  return f;
}

// Runs `exe args...` without a shell and returns its exit code (-1 when it did not exit on its own
// within `timeout_s`, or could not start) and its combined output.
std::pair<int, std::string> Capture(const std::string& exe, const std::vector<std::string>& args,
                                    double timeout_s) {
  char tmpl[] = "/tmp/decodelab-capture-XXXXXX";
  const int fd = ::mkstemp(tmpl);
  if (fd < 0) return {-1, "cannot create a temporary file for the output of " + exe};
  ::close(fd);
  comm::SpawnSpec spec;
  spec.exe = exe;
  spec.argv = {exe};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.env = comm::EnvironmentWith({});
  spec.output_path = tmpl;
  auto exit = comm::RunToCompletion(spec, timeout_s);
  auto text = ReadRegularFile(tmpl, kMaxJsonSidecarBytes);
  ::unlink(tmpl);
  std::string out = text.ok() ? *text : "";
  if (!exit.ok()) return {-1, out + exit.status().message()};
  return {exit->exited ? exit->code : -1, out};
}

lab::GateStep GatePreflight(const GateContext& g) {
  const std::string backend = ResolveBackend(g.base.backend);
  std::string boot;
  if (auto b = lab::ReadTextFile("/proc/sys/kernel/random/boot_id"); b.ok()) boot = *b;
  while (!boot.empty() && boot.back() == '\n') boot.pop_back();
  if (backend == "cpu") {
    return {"preflight", "NOT_APPLICABLE", "CPU backend: no GPU to check; boot id " + boot, {}};
  }
  const int n = cuda::DeviceCount();
  if (n == 0) return {"preflight", "FAIL", "no usable GPU", {}};
  auto nvml = cuda::NvmlDriverVersion();
  std::string detail = fmt::format("{} GPU(s), driver {} (CUDA {}), boot id {}", n,
                                   nvml.ok() ? *nvml : "unknown: " + nvml.status().message(),
                                   cuda::DriverVersionString(), boot);
  // Idleness first: our own smoke test below creates a CUDA context that nvidia-smi would list.
  const std::string smi = comm::FindExecutable("nvidia-smi");
  auto [rc, out] = smi.empty() ? std::pair<int, std::string>{-1, ""}
                               : Capture(smi,
                                         {"--query-compute-apps=pid,used_memory",
                                          "--format=csv,noheader"},
                                         60);
  if (rc == 0) {
    std::string apps;
    for (char c : out) apps += c == '\n' ? ';' : c;
    if (!apps.empty() && apps != ";") {
      return {"preflight", "FAIL", "foreign compute processes on the GPUs: " + apps, {}};
    }
  } else {
    detail += "; nvidia-smi unavailable: idleness not checked";
  }
  // Every GPU individually usable: a tiny kernel on each, checked against the host, and little
  // memory in use before we start.
  for (int d = 0; d < n; ++d) {
    size_t in_use = 0;
    Status st = kernels::DeviceSmokeTest(d, &in_use);
    if (!st.ok()) return {"preflight", "FAIL", fmt::format("GPU {} not usable: {}", d, st.message()), {}};
    constexpr size_t kIdleBound = size_t{2} << 30;
    if (in_use > kIdleBound) {
      return {"preflight", "FAIL",
              fmt::format("GPU {} has {:.1f} GiB in use before the gate (bound 2 GiB)", d,
                          in_use / double(1 << 30)),
              {}};
    }
    detail += fmt::format("; GPU {} kernel ok, {:.2f} GiB in use", d, in_use / double(1 << 30));
  }
  return {"preflight", "PASS", detail, {}};
}

lab::GateStep GateProbe(const GateContext& g) {
  const bool gpu = ResolveBackend(g.base.backend) == "cuda";
  std::string transport =
      g.plan.probe_transport.empty() ? (gpu ? "nccl" : "sim") : g.plan.probe_transport;
  const int ranks = g.plan.probe_ranks > 0 ? g.plan.probe_ranks
                    : gpu                  ? std::max(1, cuda::DeviceCount())
                                           : 2;
  const std::string bin = g.plan.control.binary.empty() ? SelfBinary() : g.plan.control.binary;
  auto [rc, out] = Capture(bin,
                           {"probe", "--transport", transport, "--ranks", std::to_string(ranks),
                            "--log-dir", g.dir + "/probe"},
                           g.base.step_timeout_s);
  const size_t at = out.rfind("PROBE_RESULT=");
  if (at == std::string::npos) {
    return {"probe", "FAIL", fmt::format("no PROBE_RESULT line (exit {})", rc), {}};
  }
  const std::string line = out.substr(at, out.find('\n', at) - at);
  const bool pass =
      line.find("PROBE_RESULT=PASS ") == 0 &&
      line.find(fmt::format("clean_teardowns={}/{}", ranks, ranks)) != std::string::npos && rc == 0;
  if (!pass) return {"probe", "FAIL", line, {}};
  return {"probe", transport == "sim" ? "SIMULATED" : "PASS", line, {}};
}

lab::GateStep GateTeacher(GateContext& g) {
  if (!g.plan.teacher.empty()) {
    if (!Exists(g.plan.teacher)) {
      return {"teacher", "FAIL", g.plan.teacher + ": the plan's teacher does not exist", {}};
    }
    g.record.extra["teacher"] = g.plan.teacher;
    return {"teacher", "PASS", "the plan's teacher " + g.plan.teacher, {}};
  }
  LabFlags f = SideFlags(g, g.plan.control, "control");
  f.teacher = g.dir + "/teacher.json";
  // A speculative control's teacher is its plain decoding (RecordTeacher never passes --spec).
  SpecFlags ignored;
  bool found = false;
  if (Status st = TakeSpecFlags(&f.serve_flags, &ignored, &found); !st.ok()) {
    return {"teacher", "FAIL", st.message(), {}};
  }
  auto o = Prepare(f, "teacher");
  if (!o.ok()) return {"teacher", "FAIL", o.status().message(), {}};
  if (Status st = lab::RecordTeacher(*o); !st.ok()) return {"teacher", "FAIL", st.message(), {}};
  g.record.extra["teacher"] = f.teacher;
  return {"teacher", "PASS", "recorded from the control into " + f.teacher, {}};
}

// A screen or suite of one side; stores each run's conventional median under extra[key].
lab::GateStep GateRuns(GateContext& g, const std::string& step, const lab::GateSide& side,
                       const std::string& label, const std::string& mode, const std::string& key) {
  auto o = Prepare(SideFlags(g, side, label), mode);
  if (!o.ok()) return {step, "FAIL", o.status().message(), {}};
  auto runs = lab::RunScreenOrSuite(*o);
  if (!runs.ok()) return {step, "FAIL", runs.status().message(), {}};
  lab::GateStep s{step, "PASS", "", {}};
  json medians = json::array(), streams = json::array();
  bool speculative = false;
  for (const auto& r : *runs) {
    std::printf("%s", lab::FormatRunTable(r).c_str());
    s.run_ids.push_back(r.run_id);
    if (r.verdict != "PASS") s.status = r.verdict;
    medians.push_back(r.summary["decode_tok_s_conventional_99_interval_median"]);
    streams.push_back(r.summary.value("decode_tok_s_stream_median", json()));
    speculative |= r.summary.value("speculative", json()).is_object();
  }
  g.record.extra[key] = medians;
  g.record.extra[key + "_stream"] = streams;
  g.record.extra[key + "_speculative"] = speculative;
  s.detail = fmt::format("{} run(s) {}, verdict {}", runs->size(), label, s.status);
  return s;
}

double FirstMedian(const json& extra, const std::string& key) {
  const json v = extra.value(key, json::array());
  return !v.empty() && v[0].is_number() ? v[0].get<double>() : 0.0;
}

int RunGate(const LabFlags& f, const std::string& plan_path, bool resume) {
  GateContext g;
  g.base = f;
  if (!plan_path.empty()) {
    auto p = lab::ReadGatePlan(plan_path);
    if (!p.ok()) return ReportError(p.status());
    g.plan = *p;
    if (!g.plan.model_dir.empty() || !g.plan.shape.empty()) {
      g.base.model_dir = g.plan.model_dir;
      g.base.shape = g.plan.shape;
      g.base.seed = g.plan.seed;
      g.base.num_layers = g.plan.num_layers;
    }
    if (!g.plan.suite.empty()) g.base.suite = g.plan.suite;
  }
  const std::string gates = f.runs_dir + "/gates";
  if (resume) {
    std::vector<std::string> ids;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(gates, ec)) {
      if (Exists((e.path() / "gate.json").string())) ids.push_back(e.path().filename().string());
    }
    if (ids.empty()) return ReportError(NotFound("{}: no gate to resume", gates));
    std::sort(ids.begin(), ids.end());
    g.dir = gates + "/" + ids.back();
    auto text = lab::ReadTextFile(g.dir + "/gate.json");
    if (!text.ok()) return ReportError(text.status());
    Result<lab::GateRecord> rec = InvalidArgument("{}/gate.json: not JSON", g.dir);
    try {
      rec = lab::GateRecord::FromJson(json::parse(*text), g.dir + "/gate.json");
    } catch (const json::exception&) {
    }
    if (!rec.ok()) return ReportError(rec.status());
    g.record = *rec;
    if (g.record.plan_sha256 != g.plan.sha256) {
      std::fprintf(stderr,
                   "lab gate: the plan changed since %s started; resuming with the new one\n",
                   g.record.gate_id.c_str());
      g.record.plan_sha256 = g.plan.sha256;
    }
    g.record.steps.resize(g.record.ResumeIndex());
    g.record.verdict.clear();
    std::fprintf(stderr, "lab gate: resuming %s after %zu passed step(s)\n",
                 g.record.gate_id.c_str(), g.record.steps.size());
  } else {
    std::time_t now = std::time(nullptr);
    g.record.gate_id = lab::MakeRunId("gate", BuildCommit(), now);
    while (Exists(gates + "/" + g.record.gate_id)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      g.record.gate_id = lab::MakeRunId("gate", BuildCommit(), std::time(nullptr));
    }
    g.dir = gates + "/" + g.record.gate_id;
    g.record.plan_sha256 = g.plan.sha256;
  }
  std::error_code ec;
  fs::create_directories(g.dir, ec);
  auto save = [&] {
    return lab::WriteTextFile(g.dir + "/gate.json", g.record.ToJson().dump(2) + "\n");
  };
  const auto& names = lab::GateStepNames();
  for (size_t i = g.record.steps.size(); i < names.size(); ++i) {
    const std::string& name = names[i];
    std::fprintf(stderr, "lab gate: step %zu/%zu %s\n", i + 1, names.size(), name.c_str());
    lab::GateStep step;
    if (name == "preflight") {
      step = GatePreflight(g);
    } else if (name == "probe") {
      step = GateProbe(g);
    } else if (name == "teacher") {
      step = GateTeacher(g);
    } else if (name == "control_screen") {
      step = GateRuns(g, name, g.plan.control, "control", "screen", "control_screen");
    } else if (name == "candidate_screen") {
      step = GateRuns(g, name, g.plan.candidate, "candidate", "screen", "candidate_screen");
    } else if (name == "suite") {
      // A speculative side has no per-event statistic: both sides compare by stream rate then.
      const bool by_stream = g.record.extra.value("control_screen_speculative", false) ||
                             g.record.extra.value("candidate_screen_speculative", false);
      const std::string suffix = by_stream ? "_stream" : "";
      const double ctl = FirstMedian(g.record.extra, "control_screen" + suffix);
      const double cand = FirstMedian(g.record.extra, "candidate_screen" + suffix);
      if (!(cand > ctl)) {
        step = {name,
                "SKIPPED",
                fmt::format("candidate not faster on the screen ({:.2f} vs {:.2f} tok/s{})", cand,
                            ctl, by_stream ? ", stream medians" : ""),
                {}};
      } else {
        lab::GateStep a = GateRuns(g, name, g.plan.control, "control", "suite", "control_suite");
        step = a;
        if (lab::StepPassed(a)) {
          lab::GateStep b =
              GateRuns(g, name, g.plan.candidate, "candidate", "suite", "candidate_suite");
          step.run_ids.insert(step.run_ids.end(), b.run_ids.begin(), b.run_ids.end());
          step.status = b.status;
          step.detail = a.detail + "; " + b.detail;
        }
      }
    } else {  // verdict
      const lab::GateStep& suite = g.record.steps.back();
      if (suite.status == "SKIPPED") {
        g.record.verdict = "NOT_FASTER";
        step = {name, "PASS", suite.detail, {}};
      } else {
        std::vector<lab::LedgerRun> ctl, cand;
        for (const auto& id : suite.run_ids) {
          auto sel = lab::LedgerSelect(f.runs_dir, id);
          if (!sel.ok()) continue;
          for (auto& r : *sel) (r.label == "control" ? ctl : cand).push_back(r);
        }
        auto c = lab::Compare("control", ctl, "candidate", cand);
        if (!c.ok()) {
          step = {name, "FAIL", c.status().message(), {}};
        } else {
          g.record.verdict = c->exceeds && c->median_b > c->median_a ? "FASTER" : "NOT_PROVEN";
          g.record.extra["speedup"] = c->median_a > 0 ? c->median_b / c->median_a : 0.0;
          step = {name, "PASS", c->Line(), {}};
        }
      }
    }
    std::printf("gate %-17s %-15s %s\n", step.name.c_str(), step.status.c_str(),
                step.detail.c_str());
    std::fflush(stdout);
    g.record.steps.push_back(step);
    if (Status st = save(); !st.ok()) return ReportError(st);
    if (!lab::StepPassed(step)) {
      std::printf(
          "GATE_RESULT=STOPPED step=%s (%s); fix it and run `decodelab lab gate --resume`\n",
          step.name.c_str(), step.status.c_str());
      return 3;
    }
  }
  std::printf("GATE_RESULT=%s gate=%s\n", g.record.verdict.c_str(), g.dir.c_str());
  return 0;
}

int RunReproCommand(const LabFlags& f, const std::string& file) {
  auto repro = lab::ReadReproFile(file);
  if (!repro.ok()) return ReportError(repro.status());
  // The reproducer names its KV dtype and calibration; a one-prompt suite carries them to Prepare.
  json suite = {{"format", "decodelab-lab-suite"},
                {"name", "repro-" + repro->name},
                {"kv_dtype", repro->kv_dtype},
                {"calibration", repro->calibration},
                {"checks", json::array()},
                {"prompts", {{{"name", "target"}, {"token_ids", repro->target.token_ids}}}}};
  const std::string suite_path =
      CacheDir(f) + "/repro/" + Sha256Hex(suite.dump()).substr(0, 16) + ".suite.json";
  if (Status st = lab::WriteTextFile(suite_path, suite.dump(1) + "\n"); !st.ok()) {
    return ReportError(st);
  }
  LabFlags g = f;
  g.suite = suite_path;
  g.teacher = suite_path;  // not used: the reproducer carries its expected tokens
  auto o = Prepare(g, "teacher");
  if (!o.ok()) return ReportError(o.status());
  std::fprintf(stderr, "lab repro: %s (%zu precursor(s))\n", repro->name.c_str(),
               repro->precursors.size());
  auto row = lab::RunRepro(*o, *repro);
  if (!row.ok()) return ReportError(row.status());
  std::printf("REPRO_RESULT=%s %s\n", lab::CheckStatusName(row->status), row->detail.c_str());
  return row->status == lab::CheckStatus::kPass ? 0 : 3;
}

int RunReport(const LabFlags& f) {
  lab::ReportOptions ro;
  ro.bundles_dir = f.bundles;
  auto html = lab::BuildReportHtml(f.runs_dir, ro);
  if (!html.ok()) return ReportError(html.status());
  if (const auto b = lab::LoadReportBundles(f.bundles); !b.found) {
    std::fprintf(stderr,
                 "lab report: charts missing: Vega-Lite bundles not found (%s); writing the tables "
                 "and simple inline charts\n",
                 b.reason.c_str());
  }
  const std::string out = f.out.empty() ? f.runs_dir + "/report.html" : f.out;
  if (Status st = lab::WriteTextFile(out, *html); !st.ok()) return ReportError(st);
  std::printf("wrote %s\n", out.c_str());
  return 0;
}

void AddTimeoutFlags(CLI::App* cmd, LabFlags& f) {
  cmd->add_option("--start-timeout", f.start_timeout_s,
                  "Seconds the served binary may take to answer /health")
      ->default_val(300);
  cmd->add_option("--step-timeout", f.step_timeout_s,
                  "Seconds any child the lab runs (calibrate, probe) or any one request may take")
      ->default_val(3600);
}

// Every lab command returns an exit code; nothing it meets (a filesystem error, a malformed file)
// may abort the process instead.
std::function<void()> Guarded(CommandContext& ctx, std::function<int()> run) {
  return [&ctx, run = std::move(run)] {
    try {
      ctx.exit_code = run();
    } catch (const std::exception& e) {
      ctx.exit_code = ReportError(Internal("{}", e.what()));
    }
  };
}

void AddRunFlags(CLI::App* cmd, LabFlags& f) {
  cmd->add_option("--model", f.model_dir, "Model directory (default: the embedded tiny model)");
  cmd->add_option("--shape", f.shape, "Random-weight shape instead of --model: tiny, xs2, s21");
  cmd->add_option("--seed", f.seed, "Seed for --shape")->default_val(0);
  cmd->add_option("--num-layers", f.num_layers, "Fewer layers for --shape");
  cmd->add_option("--backend", f.backend, "auto, cpu or cuda (passed to serve)")
      ->default_val("auto")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  cmd->add_option("--suite", f.suite, "Suite file (JSON; default: the built-in 13-prompt suite)");
  cmd->add_option("--runs-dir", f.runs_dir, "Where run directories and ledger.sqlite go")
      ->default_val(DefaultRunsDir());
  cmd->add_option("--label", f.label, "Run label (first part of the run id; default: the mode)");
  cmd->add_option("--teacher", f.teacher, "Teacher transcript (overrides the suite's)");
  cmd->add_option("--lock", f.lock, "Identity lock file (`decodelab lab lock`)");
  cmd->add_flag("--accept-identity", f.accept_identity,
                "Run even when the binary differs from the lock (recorded in the manifest)");
  cmd->add_option("--binary", f.binary, "Engine binary to serve (default: this decodelab)");
  cmd->add_option("--endpoint", f.endpoint, "Use a running server (http://HOST:PORT)");
  cmd->add_option("--cache-dir", f.cache_dir,
                  "Cache for the default model, calibration, suite and teachers (default "
                  "$DECODELAB_CACHE, $XDG_CACHE_HOME/decodelab or ~/.cache/decodelab)");
  AddTimeoutFlags(cmd, f);
  cmd->add_option("serve_flags", f.serve_flags, "Flags after -- go to `decodelab serve`");
  // Speculative decoding for the server of a screen or suite (never a teacher's): recorded in the
  // manifest and default label, acceptance read from /metrics (docs/lab.md).
  f.spec.Add(cmd);
}

}  // namespace

void AddLabCommand(CLI::App& root, CommandContext& ctx) {
  auto f = std::make_shared<LabFlags>();
  CLI::App* lab = root.add_subcommand(
      "lab",
      "The lab: exactness-checked speed screens and suites, teacher transcripts, identity "
      "locks and the run ledger (docs/lab.md)");
  lab->require_subcommand(1);
  CLI::App* screen = lab->add_subcommand(
      "screen",
      "Short run (M = the suite's screen_tokens, 128 by default): every check of "
      "docs/lab.md, speed statistics, run directory and ledger row");
  AddRunFlags(screen, *f);
  screen->callback(Guarded(ctx, [f] { return RunLab(*f, "screen"); }));
  CLI::App* suite = lab->add_subcommand(
      "suite",
      "Full run (M = suite_tokens, 512 by default), repeated (twice by default) with a "
      "comparison line between the repeats");
  AddRunFlags(suite, *f);
  suite->add_option("--repeats", f->repeats, "How many runs")->default_val(2);
  suite->callback(Guarded(ctx, [f] { return RunLab(*f, "suite"); }));
  CLI::App* teacher = lab->add_subcommand(
      "teacher",
      "Record a teacher transcript from the control configuration (every prompt's "
      "tokens up to the largest M, and the re-prefilled token M+1 for every M)");
  AddRunFlags(teacher, *f);
  teacher->callback(Guarded(ctx, [f] { return RunLab(*f, "teacher"); }));
  auto plan = std::make_shared<std::string>();
  auto resume = std::make_shared<bool>(false);
  CLI::App* gate = lab->add_subcommand(
      "gate",
      "Run a plan in the resume order (preflight, probe, teacher, control screen, "
      "candidate screen, suite twice if the candidate is exact and faster, verdict); stops "
      "at the first failed step. Without PLAN: an A/A self-test of this binary");
  gate->add_option("plan", *plan, "Plan file (JSON, docs/lab.md)");
  gate->add_flag("--resume", *resume, "Continue the latest gate after its last passed step");
  gate->add_option("--model", f->model_dir, "Model directory (unless the plan names one)");
  gate->add_option("--shape", f->shape, "Random-weight shape (unless the plan names a model)");
  gate->add_option("--backend", f->backend, "auto, cpu or cuda")
      ->default_val("auto")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  gate->add_option("--suite", f->suite, "Suite file (unless the plan names one)");
  gate->add_option("--runs-dir", f->runs_dir, "Runs directory (gates go to <runs>/gates)")
      ->default_val(DefaultRunsDir());
  gate->add_option("--cache-dir", f->cache_dir, "Cache directory (as for screen)");
  gate->add_flag("--accept-identity", f->accept_identity, "Accept lock mismatches (recorded)");
  AddTimeoutFlags(gate, *f);
  gate->callback(Guarded(ctx, [f, plan, resume] { return RunGate(*f, *plan, *resume); }));
  auto repro_file = std::make_shared<std::string>();
  CLI::App* repro = lab->add_subcommand(
      "repro",
      "Replay a reproducer (precursor requests, then a target) against a fresh server; "
      "passes when the target's tokens equal the file's expected tokens");
  repro->add_option("file", *repro_file, "Reproducer file (JSON, docs/lab.md)")->required();
  repro->add_option("--model", f->model_dir, "Model directory (default: the embedded tiny model)");
  repro->add_option("--shape", f->shape, "Random-weight shape instead of --model");
  repro->add_option("--seed", f->seed, "Seed for --shape")->default_val(0);
  repro->add_option("--num-layers", f->num_layers, "Fewer layers for --shape");
  repro->add_option("--backend", f->backend, "auto, cpu or cuda")
      ->default_val("auto")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  repro->add_option("--binary", f->binary, "Engine binary to serve (default: this decodelab)");
  repro->add_option("--endpoint", f->endpoint, "Use a running server instead (http://HOST:PORT)");
  repro->add_option("--cache-dir", f->cache_dir, "Cache directory (as for screen)");
  repro->add_option("serve_flags", f->serve_flags, "Flags after -- go to `decodelab serve`");
  AddTimeoutFlags(repro, *f);
  repro->callback(Guarded(ctx, [f, repro_file] { return RunReproCommand(*f, *repro_file); }));
  CLI::App* report = lab->add_subcommand(
      "report", "Write one self-contained HTML report over the ledger (opens without a network)");
  report->add_option("--runs-dir", f->runs_dir, "Runs directory")->default_val(DefaultRunsDir());
  report->add_option("--out", f->out, "HTML file (default <runs>/report.html)");
  report->add_option("--bundles", f->bundles,
                     "Folder with vega.min.js, vega-lite.min.js, vega-embed.min.js (default "
                     "<bin>/../share/decodelab/report, filled at build time by npm)");
  report->callback(Guarded(ctx, [f] { return RunReport(*f); }));
  CLI::App* lock = lab->add_subcommand("lock", "Write an identity lock file (binary SHA-256)");
  lock->add_option("--binary", f->binary, "Binary to lock (default: this decodelab)");
  lock->add_option("--out", f->out, "Lock file to write")->required();
  lock->callback(Guarded(ctx, [f] { return RunLock(*f); }));
  CLI::App* runs = lab->add_subcommand("runs", "List the runs in the ledger");
  runs->add_option("--runs-dir", f->runs_dir, "Runs directory")->default_val(DefaultRunsDir());
  runs->callback(Guarded(ctx, [f] { return RunRuns(*f); }));
  CLI::App* compare = lab->add_subcommand(
      "compare",
      "Compare two runs or labels: both medians, their repeat spread, and whether the "
      "difference exceeds it");
  compare->add_option("runs", f->compare, "Two run ids or labels")->expected(2)->required();
  compare->add_option("--runs-dir", f->runs_dir, "Runs directory")->default_val(DefaultRunsDir());
  compare->callback(Guarded(ctx, [f] { return RunCompare(*f); }));
}

}  // namespace dl::app
