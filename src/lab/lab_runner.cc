#include "lab/lab_runner.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <thread>

#include <fmt/ranges.h>

#include "base/build_info.h"
#include "base/sha256.h"
#include "comm/process.h"
#include "kv_cache/kv_scales.h"
#include "lab/lab_client.h"
#include "lab/lab_spec.h"
#include "lab/serve_child.h"

namespace dl::lab {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

void Progress(const LabOptions& o, const std::string& line) {
  if (o.progress) o.progress(line);
}

std::string FirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return "";
  return line;
}

std::string UtcStamp(std::time_t t, const char* fmtstr) {
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, fmtstr, &tm);
  return buf;
}

// The engine server for one run: a child `decodelab serve` on an ephemeral loopback port, or a
// running endpoint.
class ServerHandle {
 public:
  // `with_spec` false: plain decoding whatever o.spec_args say (the teacher's server).
  Status Start(const LabOptions& o, const std::string& log_path, bool with_spec = true) {
    if (!o.endpoint.empty()) {
      DL_ASSIGN_OR_RETURN(ep_, ParseEndpoint(o.endpoint));
      if (!Healthy(ep_))
        return Unavailable("--endpoint {}: /health does not answer 200", o.endpoint);
      argv_ = {"(endpoint)", o.endpoint};
      return Status::Ok();
    }
    std::vector<std::string> args = o.model_args;
    args.insert(args.end(), {"--kv-dtype", o.suite.kv_dtype});
    // Scales only mean something for an FP8 cache (serve refuses them otherwise).
    if (!o.suite.calibration.empty() && o.suite.kv_dtype == "fp8") {
      args.insert(args.end(), {"--kv-scales", o.suite.calibration});
    }
    args.insert(args.end(), o.serve_extra.begin(), o.serve_extra.end());
    if (with_spec) args.insert(args.end(), o.spec_args.begin(), o.spec_args.end());
    DL_ASSIGN_OR_RETURN(child_, ServeChild::Start(o.binary, args, log_path, o.server_start_timeout_s));
    ep_ = child_->endpoint();
    argv_ = child_->argv();
    return Status::Ok();
  }
  void Stop() {
    if (child_) child_->Stop();
  }
  std::string StopReason() const { return child_ ? child_->ExitReason() : "endpoint (not stopped by the lab)"; }
  const Endpoint& endpoint() const { return ep_; }
  const std::vector<std::string>& argv() const { return argv_; }

 private:
  std::unique_ptr<ServeChild> child_;
  Endpoint ep_;
  std::vector<std::string> argv_;
};

struct ResolvedPrompt {
  std::string name, kind;
  std::vector<int32_t> ids;
};

// Computed prompts (boundary, rollover) are derived from the page size of the server that records the
// teacher; a run against a teacher replays the teacher's ids for them, so a candidate with another page
// size (the page-32-vs-64 screen) sends the control's prompts and stays comparable. The control's
// boundary falls on a page boundary of every smaller power-of-two page size too.
Result<std::vector<ResolvedPrompt>> ResolvePrompts(const LabOptions& o, const json& state,
                                                   const Teacher* teacher = nullptr) {
  const int page_size = state.value("page_size", 16);
  std::vector<ResolvedPrompt> out;
  int salt = 0;
  for (const auto& p : o.suite.prompts) {
    ResolvedPrompt r{p.name, p.kind, p.token_ids};
    ++salt;
    const TeacherPrompt* recorded = teacher ? teacher->Find(p.name) : nullptr;
    if (p.computed && recorded) {
      r.ids = recorded->prompt;
    } else if (p.computed) {
      const int len = p.kind == "rollover" ? RolloverPromptLength(page_size, o.sliding_window)
                                           : BoundaryPromptLength(page_size);
      r.ids = SyntheticPromptIds(len, 1000 + salt, o.vocab_limit);
    } else if (r.ids.empty()) {
      if (!o.tokenize) {
        return InvalidArgument(
            "{}: prompt {} is text, and no tokenizer is available (serve a "
            "model directory with tokenizer.json)",
            o.suite.path, p.name);
      }
      DL_ASSIGN_OR_RETURN(r.ids, o.tokenize(p.text));
    }
    for (int32_t id : r.ids) {
      if (id < 0 || id >= o.vocab_limit) {
        return InvalidArgument("{}: prompt {}: token id {} is outside the vocabulary (< {})",
                               o.suite.path, p.name, id, o.vocab_limit);
      }
    }
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<std::string> Signatures(const json& state) {
  std::vector<std::string> s;
  if (!state.value("topology_applicable", false) || !state["topology"].is_array()) return s;
  for (const auto& t : state["topology"]) s.push_back(t.value("signature", ""));
  return s;
}

// The server's speculative configuration from /v1/decodelab/state (`speculative`: drafter, K);
// a server without the object (an older binary, another engine) decodes plainly.
json SpecConfig(const json& state) {
  const json sp = state.value("speculative", json::object());
  const std::string drafter = sp.is_object() ? sp.value("drafter", "none") : "none";
  json out = {{"drafter", drafter}};
  if (drafter != "none") out["num_speculative_tokens"] = sp.value("num_speculative_tokens", 0);
  return out;
}

bool SpecOn(const json& state) {
  return SpecConfig(state)["drafter"] != "none";
}

json Manifest(const LabOptions& o, const std::string& run_id, const std::string& binary_sha,
              const json& state, const std::vector<std::string>& serve_argv, int m,
              const std::string& teacher_sha) {
  const json runner = state.value("runner", json::object());
  json spec = SpecConfig(state);
  spec["flags"] = o.spec_args;
  std::string driver = FirstLine("/proc/driver/nvidia/version");
  return {
      {"run_id", run_id},
      {"mode", o.mode},
      {"label", o.label},
      {"commit", BuildCommit()},
      {"compilers", BuildCompilers()},
      {"binary", o.binary},
      {"binary_sha256", binary_sha},
      {"server_binary_sha256", state.value("binary_sha256", "")},
      {"kernel_presets", state.value("kernel_presets", json(nullptr))},
      {"backend", state.value("backend", "")},
      {"kv_dtype", state.value("kv_dtype", json(nullptr))},
      {"model", state.value("model_identity", json(nullptr))},
      {"serve_argv", serve_argv},
      {"gpu", runner.value("device", json("none"))},
      {"driver", driver.empty() ? "none" : driver},
      {"boot_id", FirstLine("/proc/sys/kernel/random/boot_id")},
      {"host",
       [] {
         char h[256] = {};
         gethostname(h, sizeof h - 1);
         return std::string(h);
       }()},
      {"suite", o.suite.path},
      {"suite_sha256", o.suite.sha256},
      {"teacher", o.teacher_path},
      {"teacher_sha256", teacher_sha},
      {"calibration", o.suite.calibration},
      {"max_tokens", m},
      {"ignore_eos", true},
      {"temperature", 0},
      {"lock", o.lock_path},
      {"accept_identity", o.accept_identity},
      {"speculative", spec},
  };
}

Status WriteJson(const fs::path& p, const json& j) {
  return WriteTextFile(p.string(), j.dump(2) + "\n");
}

Result<RunOutcome> RunOnce(const LabOptions& o, const Teacher& teacher,
                           const std::string& binary_sha, const std::string& teacher_sha) {
  RunOutcome out;
  std::time_t now = std::time(nullptr);
  out.run_id = MakeRunId(o.label, BuildCommit(), now);
  std::error_code exists_ec;
  while (fs::exists(fs::path(o.runs_dir) / out.run_id, exists_ec)) {
    // Two runs in one second would share a directory: wait for the next second.
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    out.run_id = MakeRunId(o.label, BuildCommit(), std::time(nullptr));
  }
  const fs::path dir = fs::path(o.runs_dir) / out.run_id;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Internal("{}: cannot create the run directory: {}", dir.string(), ec.message());
  out.dir = dir.string();
  const std::string started = UtcStamp(std::time(nullptr), "%Y-%m-%dT%H:%M:%SZ");
  // Removed only after the ledger row is written: a killed run leaves it behind, and `lab runs`
  // and the report list the directory as incomplete.
  DL_RETURN_IF_ERROR(WriteJson(dir / kIncompleteMarker,
                               {{"run_id", out.run_id},
                                {"mode", o.mode},
                                {"label", o.label},
                                {"started_utc", started},
                                {"pid", static_cast<int>(::getpid())}}));
  const int m = o.mode == "suite" ? o.suite.suite_tokens : o.suite.screen_tokens;
  Progress(o, fmt::format("run {} ({} x {} tokens) in {}", out.run_id, o.suite.prompts.size(), m,
                          out.dir));

  std::vector<CheckRow>& rows = out.checks;
  std::vector<PromptResult> results;
  std::vector<RequestTiming> timings;
  json state = json::object();
  ServerHandle server;
  bool stopped_early = false;
  std::string server_stop = "not started";
  // Speculation: the server's own report decides (state), the counters are read from /metrics
  // before the first prompt and after the last, so a running --endpoint's earlier traffic is not
  // counted.
  bool spec_on = false;
  SpecCounters spec_before;
  std::optional<SpecDelta> spec_delta;
  std::string spec_error;

  // Identity before anything starts: a locked run refuses a different binary.
  if (o.lock && !binary_sha.empty() && o.lock->binary_sha256 != binary_sha && !o.accept_identity) {
    rows.push_back(CheckIdentity(json::object(), binary_sha, o.lock, false));
    rows.back().detail += " (server not started; --accept-identity overrides)";
    stopped_early = true;
  }

  if (!stopped_early) {
    Status st = server.Start(o, (dir / "server.log").string());
    if (!st.ok()) {
      rows.push_back({"server", CheckStatus::kInvalid, st.message()});
      stopped_early = true;
    }
  }
  if (!stopped_early) {
    auto s = GetState(server.endpoint());
    if (!s.ok()) {
      rows.push_back({"server", CheckStatus::kInvalid, s.status().message()});
      stopped_early = true;
    } else {
      state = *s;
      (void)WriteJson(dir / "state.json", state);
    }
  }
  if (!stopped_early) {
    spec_on = SpecOn(state);
    if (!o.spec_args.empty() && !spec_on) {
      rows.push_back({"speculative", CheckStatus::kInvalid,
                      fmt::format("the lab asked serve for `{}` and its state reports drafter none",
                                  fmt::join(o.spec_args, " "))});
      stopped_early = true;
    }
  }
  if (!stopped_early && o.suite.HasCheck("identity")) {
    rows.push_back(CheckIdentity(state, binary_sha, o.lock, o.accept_identity));
    stopped_early = rows.back().status == CheckStatus::kInvalid;
  }
  if (!stopped_early && o.suite.HasCheck("no_fallback")) {
    rows.push_back(CheckNoFallback(state));
    stopped_early = rows.back().status == CheckStatus::kInvalid;
  }
  if (!stopped_early) {
    rows.push_back(CheckKernelPresets(state));
    if (o.suite.HasCheck("scale_audit")) {
      if (o.suite.calibration.empty()) {
        rows.push_back({"scale_audit", CheckStatus::kFail, "the suite names no calibration file"});
      } else {
        int layers = 0;
        try {
          layers = static_cast<int>(state.at("kv_scales").at(0).at("layers").size());
        } catch (...) {
        }
        auto cal = ReadKvScalesFile(o.suite.calibration, layers);
        rows.push_back(cal.ok()
                           ? CheckScaleAudit(state, *cal)
                           : CheckRow{"scale_audit", CheckStatus::kFail, cal.status().message()});
      }
    }
  }

  if (!stopped_early && spec_on) {
    auto text = GetMetricsText(server.endpoint());
    if (!text.ok()) {
      spec_error = text.status().message();
    } else {
      spec_before = ParseSpecCounters(*text);
      if (!spec_before.present) spec_error = "/metrics has no vllm:spec_decode_num_drafts counter";
    }
  }

  // The prompts, one at a time, streamed.
  std::ofstream requests(dir / "requests.jsonl"), responses(dir / "responses.jsonl");
  std::ofstream csv(dir / "timings.csv");
  csv << "prompt,index,token_id,arrival_s,gap_s\n";
  if (!stopped_early) {
    auto prompts = ResolvePrompts(o, state, &teacher);
    if (!prompts.ok()) {
      rows.push_back({"requests", CheckStatus::kInvalid, prompts.status().message()});
      stopped_early = true;
    } else {
      for (const auto& p : *prompts) {
        PromptResult r;
        r.name = p.name;
        r.kind = p.kind;
        r.prompt = p.ids;
        r.max_tokens = m;
        RequestTiming t;
        const json body = CompletionBody(p.ids, m, true);
        requests << json{{"name", p.name}, {"kind", "generate"}, {"body", body}}.dump() << "\n";
        Status st = StreamCompletion(server.endpoint(), body, &r, &t, o.request_timeout_s);
        if (st.ok() && o.suite.HasCheck("boundary")) {
          std::vector<int32_t> next_prompt = p.ids;
          next_prompt.insert(next_prompt.end(), r.tokens.begin(), r.tokens.end());
          requests << json{{"name", p.name},
                           {"kind", "next"},
                           {"body", CompletionBody(next_prompt, 1, false)}}
                          .dump()
                   << "\n";
          auto nt = NextToken(server.endpoint(), next_prompt, o.request_timeout_s);
          if (nt.ok()) {
            r.next = *nt;
          } else {
            st = nt.status();
          }
        }
        responses << json{{"name", r.name},
                          {"kind", r.kind},
                          {"prompt_tokens", r.prompt.size()},
                          {"token_ids", r.tokens},
                          {"finish_reason", r.finish_reason},
                          {"cached_tokens", r.cached_tokens},
                          {"next", r.next ? json(*r.next) : json(nullptr)}}
                         .dump()
                  << "\n";
        for (size_t i = 0; i < t.arrivals.size(); ++i) {
          csv << fmt::format("{},{},{},{:.9f},{:.9f}\n", r.name, i, r.tokens[i],
                             t.arrivals[i] - t.sent,
                             t.arrivals[i] - (i == 0 ? t.first_byte : t.arrivals[i - 1]));
        }
        if (!st.ok()) {
          rows.push_back({"requests", CheckStatus::kInvalid, st.message()});
          stopped_early = true;
          break;
        }
        Progress(o, fmt::format("  {} ({} prompt tokens): {} tokens, {}", r.name, r.prompt.size(),
                                r.tokens.size(), r.finish_reason));
        results.push_back(std::move(r));
        timings.push_back(std::move(t));
        // An op may take a generic path only once it runs: re-read the state after every prompt
        // and stop at once on a fallback.
        if (o.suite.HasCheck("no_fallback")) {
          auto now_state = GetState(server.endpoint());
          if (now_state.ok() && CheckNoFallback(*now_state).status == CheckStatus::kInvalid) {
            state = *now_state;
            for (auto& row : rows) {
              if (row.name == "no_fallback") row = CheckNoFallback(state);
            }
            stopped_early = true;
            break;
          }
        }
      }
    }
  }
  if (!stopped_early && spec_on && spec_error.empty()) {
    auto text = GetMetricsText(server.endpoint());
    if (!text.ok()) {
      spec_error = text.status().message();
    } else {
      spec_delta = SpecDifference(spec_before, ParseSpecCounters(*text));
      if (!spec_delta->enabled) {
        spec_error = "/metrics lost its vllm:spec_decode counters during the run";
        spec_delta.reset();
      }
    }
  }
  // The topology audit reads the state after the prompts: a graph is captured on first decode.
  if (!stopped_early && o.suite.HasCheck("topology")) {
    auto after = GetState(server.endpoint());
    if (after.ok()) {
      state = *after;
      (void)WriteJson(dir / "state-after.json", state);
    }
    auto it = o.suite.expected_topology.find(o.label);
    rows.push_back(CheckTopology(
        state, it != o.suite.expected_topology.end() ? it->second : teacher.topology));
  }
  server.Stop();
  server_stop = server.StopReason();

  int exact = 0;
  if (!stopped_early) {
    if (o.suite.HasCheck("exactness")) {
      CheckRow row = CheckExactness(results, teacher, &exact);
      std::string why;
      if (teacher.suite_sha256 != o.suite.sha256) why = "teacher was recorded for another suite";
      const json kv = state.value("kv_dtype", json(nullptr));
      if (kv.is_string() && !teacher.kv_dtype.empty() &&
          teacher.kv_dtype != kv.get<std::string>()) {
        why = fmt::format("teacher KV dtype {} differs from the run's {}", teacher.kv_dtype,
                          kv.get<std::string>());
      }
      if (teacher.backend != state.value("backend", "")) {
        why = fmt::format("teacher backend {} differs from the run's {}", teacher.backend,
                          state.value("backend", ""));
      }
      if (!why.empty()) {
        row.status = CheckStatus::kFail;
        row.detail = why + "; " + row.detail;
      }
      rows.push_back(row);
    }
    if (o.suite.HasCheck("no_prefix_cache")) rows.push_back(CheckNoPrefixCache(results));
    if (o.suite.HasCheck("boundary")) rows.push_back(CheckBoundary(results, teacher));
    if (o.suite.HasCheck("rollover")) rows.push_back(CheckRollover(results, teacher));
  }

  out.verdict = Verdict(rows);
  out.valid = out.verdict != "INVALID";
  json summary = {{"run_id", out.run_id},
                  {"mode", o.mode},
                  {"label", o.label},
                  {"verdict", out.verdict},
                  {"valid", out.valid},
                  {"exact", exact},
                  {"prompts", static_cast<int>(o.suite.prompts.size())},
                  {"max_tokens", m},
                  {"stopped_early", stopped_early},
                  {"server_exit", server_stop},
                  {"decode_tok_s_conventional_99_interval_median", nullptr},
                  {"decode_tok_s_historical_100_event_median", nullptr},
                  {"decode_tok_s_stream_median", nullptr}};
  LedgerRun lr;
  std::map<std::string, double> metrics;
  // Acceptance is not a speed: it is reported for INVALID runs too (it explains, never claims).
  if (spec_on) {
    json sp = SpecConfig(state);
    if (spec_delta) {
      sp.update(spec_delta->ToCountersJson());
    } else {
      sp["error"] =
          spec_error.empty() ? "the run stopped before its counters were read" : spec_error;
    }
    summary["speculative"] = sp;
  } else {
    summary["speculative"] = nullptr;
  }
  if (spec_on) {
    metrics["spec_decode_num_speculative_tokens"] =
        SpecConfig(state).value("num_speculative_tokens", 0);
  }
  if (spec_delta) {
    metrics["spec_decode_num_drafts"] = spec_delta->num_drafts;
    metrics["spec_decode_num_draft_tokens"] = spec_delta->num_draft_tokens;
    metrics["spec_decode_num_accepted_tokens"] = spec_delta->num_accepted_tokens;
    if (spec_delta->num_drafts > 0) {
      metrics["spec_decode_mean_acceptance_length"] = spec_delta->mean_acceptance_length();
      metrics["spec_decode_acceptance_rate"] = spec_delta->acceptance_rate();
      const auto rates = spec_delta->per_position_acceptance_rate();
      for (size_t i = 0; i < rates.size(); ++i) {
        metrics[fmt::format("spec_decode_acceptance_rate_pos_{}", i)] = rates[i];
      }
    }
  }
  if (out.valid && !timings.empty()) {
    // A verify emits its accepted tokens together: with speculation the per-event statistics
    // describe that grouping, not the speed, and are left out; the stream rate is the speed.
    auto speed = ComputeRunSpeed(timings, /*per_event=*/!spec_on);
    if (speed.ok()) {
      if (speed->per_event) {
        summary["decode_tok_s_conventional_99_interval_median"] = speed->conventional_median;
        summary["decode_tok_s_historical_100_event_median"] = speed->historical_median;
        lr.conventional = speed->conventional_median;
        lr.historical = speed->historical_median;
        lr.per_prompt_conventional = speed->conventional;
        metrics["decode_tok_s_conventional_99_interval_median"] = speed->conventional_median;
        metrics["decode_tok_s_historical_100_event_median"] = speed->historical_median;
      } else {
        summary["per_event_statistics"] =
            "left out: with speculative decoding a verify's tokens arrive together, so the gaps "
            "between token events measure that grouping, not the speed; "
            "decode_tok_s_stream_median is the speed";
      }
      summary["decode_tok_s_stream_median"] = speed->stream_median;
      summary["ttft"] = speed->ttft.ToJson();
      summary["tpot"] = speed->tpot.ToJson();
      summary["itl"] = speed->itl.ToJson();
      json per = json::array();
      for (size_t i = 0; i < results.size(); ++i) {
        json p = {{"name", results[i].name}, {"stream_tok_s", speed->stream[i]}};
        if (speed->per_event) {
          p["conventional_tok_s"] = speed->conventional[i];
          p["historical_tok_s"] = speed->historical[i];
        }
        per.push_back(p);
      }
      summary["per_prompt"] = per;
      metrics["decode_tok_s_stream_median"] = speed->stream_median;
      metrics["ttft_median_ms"] = speed->ttft.median * 1e3;
      metrics["tpot_median_ms"] = speed->tpot.median * 1e3;
      metrics["itl_median_ms"] = speed->itl.median * 1e3;
      metrics["itl_p99_ms"] = speed->itl.p99 * 1e3;
    } else {
      summary["speed_error"] = speed.status().message();
    }
  }
  out.summary = summary;
  json checks = json::array();
  for (const auto& r : rows) checks.push_back(r.ToJson());
  DL_RETURN_IF_ERROR(WriteJson(dir / "checks.json", checks));
  DL_RETURN_IF_ERROR(WriteJson(dir / "summary.json", summary));
  DL_RETURN_IF_ERROR(WriteJson(dir / "manifest.json", Manifest(o, out.run_id, binary_sha, state,
                                                               server.argv(), m, teacher_sha)));
  lr.run_id = out.run_id;
  lr.label = o.label;
  lr.mode = o.mode;
  lr.commit = BuildCommit();
  lr.started_utc = started;
  lr.verdict = out.verdict;
  lr.dir = fs::absolute(dir).string();
  lr.valid = out.valid;
  lr.exact = exact;
  lr.prompts = static_cast<int>(o.suite.prompts.size());
  DL_RETURN_IF_ERROR(LedgerRecord(o.runs_dir, lr, rows, metrics));
  fs::remove(dir / kIncompleteMarker, ec);
  return out;
}

std::string BinarySha(const LabOptions& o) {
  if (o.binary.empty() || !o.hash_binary) return "";
  auto s = Sha256File(o.binary);
  return s.ok() ? *s : "";
}

}  // namespace

std::string MakeRunId(const std::string& label, const std::string& commit, std::time_t t) {
  // The id names a directory and is typed into shells: keep [A-Za-z0-9._-], anything else (a slash,
  // a space, a hand-written build stamp such as "abc (uncommitted)") becomes '_'.
  auto safe = [](std::string s) {
    for (char& ch : s) {
      const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
                      ch == '.' || ch == '_' || ch == '-';
      if (!ok) ch = '_';
    }
    return s;
  };
  return fmt::format("{}-{}-{}", safe(label), safe(commit.empty() ? "unknown" : commit), UtcStamp(t, "%Y%m%dT%H%M%SZ"));
}

Result<std::vector<RunOutcome>> RunScreenOrSuite(const LabOptions& o) {
  if (o.teacher_path.empty()) {
    return InvalidArgument(
        "no teacher transcript: give --teacher FILE or name one in the suite "
        "(record it from the control with `decodelab lab teacher`)");
  }
  DL_ASSIGN_OR_RETURN(Teacher teacher, ReadTeacherFile(o.teacher_path));
  auto tsha = Sha256File(o.teacher_path);
  const std::string binary_sha = BinarySha(o);
  if (o.hash_binary && binary_sha.empty()) {
    return NotFound("{}: cannot read the engine binary to hash it", o.binary);
  }
  std::vector<RunOutcome> runs;
  for (int i = 0; i < o.repeats; ++i) {
    DL_ASSIGN_OR_RETURN(RunOutcome r, RunOnce(o, teacher, binary_sha, tsha.ok() ? *tsha : ""));
    const bool invalid = !r.valid;
    runs.push_back(std::move(r));
    if (invalid) break;  // an invalid run voids the repeat too
  }
  return runs;
}

Status RecordTeacher(const LabOptions& o) {
  if (o.teacher_path.empty()) return InvalidArgument("teacher: an output path is required");
  const std::string binary_sha = BinarySha(o);
  std::error_code ec;
  fs::path log = fs::path(o.teacher_path).parent_path();
  if (log.empty()) log = ".";
  fs::create_directories(log, ec);
  log /= fs::path(o.teacher_path).filename().string() + ".server.log";
  ServerHandle server;
  DL_RETURN_IF_ERROR(server.Start(o, log.string(), /*with_spec=*/false));
  DL_ASSIGN_OR_RETURN(json state, GetState(server.endpoint()));
  if (SpecOn(state)) {
    return FailedPrecondition(
        "the teacher's server reports speculative decoding ({}): a teacher is recorded from plain "
        "decoding",
        SpecConfig(state).dump());
  }
  if (CheckNoFallback(state).status != CheckStatus::kPass) {
    return FailedPrecondition(
        "the control reports a fallback ({}): a teacher from it is not a "
        "control",
        state.value("fallback_ops", json::array()).dump());
  }
  DL_ASSIGN_OR_RETURN(auto prompts, ResolvePrompts(o, state));
  Teacher t;
  t.suite_sha256 = o.suite.sha256;
  t.control_identity = state.value("binary_sha256", binary_sha);
  t.backend = state.value("backend", "");
  t.kv_dtype = state.value("kv_dtype", json(nullptr)).is_string()
                   ? state["kv_dtype"].get<std::string>()
                   : o.suite.kv_dtype;
  const std::vector<int> ms = o.suite.Ms();
  const int max_m = ms.back();
  for (const auto& p : prompts) {
    PromptResult r;
    r.name = p.name;
    RequestTiming timing;
    DL_RETURN_IF_ERROR(
        StreamCompletion(server.endpoint(), CompletionBody(p.ids, max_m, true), &r, &timing,
                         o.request_timeout_s));
    if (static_cast<int>(r.tokens.size()) != max_m) {
      return DataLoss("teacher: {} returned {} tokens, expected {} (finish_reason {})", p.name,
                      r.tokens.size(), max_m, r.finish_reason);
    }
    TeacherPrompt tp{p.name, p.ids, r.tokens, {}};
    for (int m : ms) {
      std::vector<int32_t> next_prompt = p.ids;
      next_prompt.insert(next_prompt.end(), r.tokens.begin(), r.tokens.begin() + m);
      DL_ASSIGN_OR_RETURN(tp.next[m], NextToken(server.endpoint(), next_prompt, o.request_timeout_s));
    }
    Progress(o, fmt::format("  teacher {}: {} prompt tokens, {} generated", p.name, p.ids.size(),
                            max_m));
    t.prompts.push_back(std::move(tp));
  }
  // The control's topology once its graphs are captured (after the prompts).
  DL_ASSIGN_OR_RETURN(state, GetState(server.endpoint()));
  t.topology = Signatures(state);
  t.topology_applicable = !t.topology.empty();
  server.Stop();
  return WriteTeacherFile(o.teacher_path, t);
}

Result<CheckRow> RunRepro(const LabOptions& o, const Repro& repro) {
  char tmpl[] = "/tmp/decodelab-repro-XXXXXX";
  const char* tmp = mkdtemp(tmpl);
  if (!tmp) return Internal("cannot create a temporary directory for the server log");
  const std::string log = std::string(tmp) + "/server.log";
  ServerHandle server;
  DL_RETURN_IF_ERROR(server.Start(o, log));
  for (size_t i = 0; i < repro.precursors.size(); ++i) {
    PromptResult r;
    r.name = fmt::format("precursor {}", i);
    RequestTiming t;
    const auto& q = repro.precursors[i];
    DL_RETURN_IF_ERROR(StreamCompletion(server.endpoint(),
                                        CompletionBody(q.token_ids, q.max_tokens, true), &r, &t,
                                        o.request_timeout_s));
    Progress(o, fmt::format("  precursor {}: {} prompt tokens, {} generated", i, q.token_ids.size(),
                            r.tokens.size()));
  }
  PromptResult r;
  r.name = "target";
  RequestTiming t;
  DL_RETURN_IF_ERROR(StreamCompletion(
      server.endpoint(), CompletionBody(repro.target.token_ids, repro.target.max_tokens, true), &r,
      &t, o.request_timeout_s));
  server.Stop();
  std::error_code ec;
  std::filesystem::remove_all(tmp, ec);
  for (size_t i = 0; i < repro.expected.size(); ++i) {
    if (i >= r.tokens.size() || r.tokens[i] != repro.expected[i]) {
      return CheckRow{"repro", CheckStatus::kFail,
                      fmt::format("{}: target token {} is {}, expected {}", repro.name, i,
                                  i < r.tokens.size() ? std::to_string(r.tokens[i]) : "missing",
                                  repro.expected[i])};
    }
  }
  return CheckRow{"repro", CheckStatus::kPass,
                  fmt::format("{}: {} precursor(s), then {} target tokens equal the expected ones",
                              repro.name, repro.precursors.size(), repro.expected.size())};
}

const char* SpeedKey(const json& summary) {
  return summary.value("speculative", json()).is_object()
             ? "decode_tok_s_stream_median"
             : "decode_tok_s_conventional_99_interval_median";
}

std::string FormatRunTable(const RunOutcome& run) {
  std::string s = fmt::format("run {}  verdict {}\n", run.run_id, run.verdict);
  for (const auto& r : run.checks) {
    s += fmt::format("  {:<16} {:<15} {}\n", r.name, CheckStatusName(r.status), r.detail);
  }
  const json& sm = run.summary;
  const json spec = sm.value("speculative", json());
  if (spec.is_object()) {
    s += fmt::format("  speculative: {} K={}", spec.value("drafter", "?"),
                     spec.value("num_speculative_tokens", 0));
    if (spec.contains("error")) {
      s += fmt::format(": acceptance not read ({})\n", spec["error"].get<std::string>());
    } else {
      const json mal = spec.value("mean_acceptance_length", json());
      const json rate = spec.value("acceptance_rate", json());
      s += fmt::format(": {} drafts, {} draft tokens, {} accepted",
                       spec.value("vllm:spec_decode_num_drafts_total", 0),
                       spec.value("vllm:spec_decode_num_draft_tokens_total", 0),
                       spec.value("vllm:spec_decode_num_accepted_tokens_total", 0));
      if (mal.is_number()) {
        s += fmt::format(" ({:.1f}%), mean acceptance length {:.2f}, per position",
                         100 * rate.get<double>(), mal.get<double>());
        for (const auto& r : spec["per_position_acceptance_rate"])
          s += fmt::format(" {:.1f}%", 100 * r.get<double>());
      }
      s += "\n";
    }
  }
  if (!run.valid) {
    s += "  speed: not reported (the run is INVALID)\n";
  } else if (spec.is_object() && sm.value("decode_tok_s_stream_median", json()).is_number()) {
    s += fmt::format(
        "  decode tok/s: stream median {:.2f} (first to last token; the per-event statistics are "
        "left out with speculation)\n",
        sm["decode_tok_s_stream_median"].get<double>());
    s += fmt::format("  TTFT median {:.2f} ms p99 {:.2f} ms | TPOT median {:.2f} ms\n",
                     sm["ttft"]["median_ms"].get<double>(), sm["ttft"]["p99_ms"].get<double>(),
                     sm["tpot"]["median_ms"].get<double>());
  } else if (sm.contains("decode_tok_s_conventional_99_interval_median") &&
             sm["decode_tok_s_conventional_99_interval_median"].is_number()) {
    s += fmt::format(
        "  decode tok/s: conventional 99-interval median {:.2f} | historical 100-event median "
        "{:.2f} | stream median {:.2f}\n",
        sm["decode_tok_s_conventional_99_interval_median"].get<double>(),
        sm["decode_tok_s_historical_100_event_median"].get<double>(),
        sm.value("decode_tok_s_stream_median", 0.0));
    s += fmt::format(
        "  TTFT median {:.2f} ms p99 {:.2f} ms | TPOT median {:.2f} ms | ITL median "
        "{:.2f} ms p99 {:.2f} ms\n",
        sm["ttft"]["median_ms"].get<double>(), sm["ttft"]["p99_ms"].get<double>(),
        sm["tpot"]["median_ms"].get<double>(), sm["itl"]["median_ms"].get<double>(),
        sm["itl"]["p99_ms"].get<double>());
  }
  s += fmt::format("  exact {}/{}  artifacts {}\n", sm.value("exact", 0), sm.value("prompts", 0),
                   run.dir);
  return s;
}

}  // namespace dl::lab
