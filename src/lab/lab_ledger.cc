#include "lab/lab_ledger.h"

#include <sqlite3.h>

#include <algorithm>
#include <filesystem>

#include "lab/lab_stats.h"
#include "lab/lab_suite.h"

namespace dl::lab {

namespace {

class Db {
 public:
  ~Db() {
    if (db_) sqlite3_close(db_);
  }
  Status Open(const std::string& path) {
    path_ = path;
    if (sqlite3_open(path.c_str(), &db_) != SQLITE_OK) {
      return Internal("{}: cannot open the ledger: {}", path, db_ ? sqlite3_errmsg(db_) : "?");
    }
    sqlite3_busy_timeout(db_, 5000);
    return Exec(
        "CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, label TEXT, mode TEXT, "
        "commit_id TEXT, started_utc TEXT, verdict TEXT, valid INTEGER, exact INTEGER, "
        "prompts INTEGER, conventional REAL, historical REAL, dir TEXT, per_prompt TEXT);"
        "CREATE TABLE IF NOT EXISTS checks (run_id TEXT, name TEXT, status TEXT, detail TEXT);"
        "CREATE TABLE IF NOT EXISTS metrics (run_id TEXT, name TEXT, value REAL);");
  }
  Status Exec(const std::string& sql) {
    char* err = nullptr;
    if (sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err) != SQLITE_OK) {
      std::string m = err ? err : "?";
      sqlite3_free(err);
      return Internal("{}: {}", path_, m);
    }
    return Status::Ok();
  }
  // Runs `sql` with text bindings (nullopt binds NULL).
  Status Run(const std::string& sql, const std::vector<std::optional<std::string>>& args) {
    sqlite3_stmt* st = nullptr;
    if (sqlite3_prepare_v2(db_, sql.c_str(), -1, &st, nullptr) != SQLITE_OK) {
      return Internal("{}: {}", path_, sqlite3_errmsg(db_));
    }
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i]) {
        sqlite3_bind_text(st, static_cast<int>(i + 1), args[i]->c_str(), -1, SQLITE_TRANSIENT);
      } else {
        sqlite3_bind_null(st, static_cast<int>(i + 1));
      }
    }
    const int rc = sqlite3_step(st);
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE) return Internal("{}: {}", path_, sqlite3_errmsg(db_));
    return Status::Ok();
  }
  sqlite3* get() { return db_; }
  const std::string& path() const { return path_; }

 private:
  sqlite3* db_ = nullptr;
  std::string path_;
};

std::optional<std::string> Num(const std::optional<double>& v) {
  if (!v) return std::nullopt;
  return fmt::format("{:.17g}", *v);
}

std::string Text(sqlite3_stmt* st, int col) {
  const unsigned char* t = sqlite3_column_text(st, col);
  return t ? reinterpret_cast<const char*>(t) : "";
}

}  // namespace

std::vector<IncompleteRun> ListIncompleteRuns(const std::string& runs_dir) {
  namespace fs = std::filesystem;
  std::vector<IncompleteRun> out;
  std::error_code ec;
  if (!fs::is_directory(runs_dir, ec)) return out;
  std::vector<std::string> recorded;
  if (fs::exists(LedgerPath(runs_dir), ec)) {
    if (auto rows = LedgerList(runs_dir); rows.ok()) {
      for (const auto& r : *rows) recorded.push_back(r.run_id);
    }
  }
  for (fs::directory_iterator it(runs_dir, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path marker = it->path() / kIncompleteMarker;
    if (!fs::is_regular_file(marker, ec)) continue;
    IncompleteRun r;
    r.run_id = it->path().filename().string();
    if (std::find(recorded.begin(), recorded.end(), r.run_id) != recorded.end()) continue;
    r.dir = it->path().string();
    if (auto text = ReadTextFile(marker.string()); text.ok()) {
      const auto j = nlohmann::json::parse(*text, nullptr, false);
      if (j.is_object()) {
        r.mode = j.value("mode", "");
        r.label = j.value("label", "");
        r.started_utc = j.value("started_utc", "");
      }
    }
    out.push_back(std::move(r));
  }
  std::sort(out.begin(), out.end(),
            [](const IncompleteRun& a, const IncompleteRun& b) { return a.run_id < b.run_id; });
  return out;
}

std::string LedgerPath(const std::string& runs_dir) {
  return (std::filesystem::path(runs_dir) / "ledger.sqlite").string();
}

Status LedgerRecord(const std::string& runs_dir, const LedgerRun& r,
                    const std::vector<CheckRow>& checks, const std::map<std::string, double>& m) {
  std::error_code ec;
  std::filesystem::create_directories(runs_dir, ec);
  Db db;
  DL_RETURN_IF_ERROR(db.Open(LedgerPath(runs_dir)));
  DL_RETURN_IF_ERROR(db.Exec("BEGIN"));
  DL_RETURN_IF_ERROR(db.Run("DELETE FROM runs WHERE run_id = ?", {r.run_id}));
  DL_RETURN_IF_ERROR(db.Run("DELETE FROM checks WHERE run_id = ?", {r.run_id}));
  DL_RETURN_IF_ERROR(db.Run("DELETE FROM metrics WHERE run_id = ?", {r.run_id}));
  DL_RETURN_IF_ERROR(
      db.Run("INSERT INTO runs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
             {r.run_id, r.label, r.mode, r.commit, r.started_utc, r.verdict, r.valid ? "1" : "0",
              std::to_string(r.exact), std::to_string(r.prompts), Num(r.conventional),
              Num(r.historical), r.dir, nlohmann::json(r.per_prompt_conventional).dump()}));
  for (const auto& c : checks) {
    DL_RETURN_IF_ERROR(db.Run("INSERT INTO checks VALUES (?,?,?,?)",
                              {r.run_id, c.name, CheckStatusName(c.status), c.detail}));
  }
  for (const auto& [name, v] : m) {
    DL_RETURN_IF_ERROR(
        db.Run("INSERT INTO metrics VALUES (?,?,?)", {r.run_id, name, fmt::format("{:.17g}", v)}));
  }
  return db.Exec("COMMIT");
}

namespace {

Result<std::vector<LedgerRun>> Query(const std::string& runs_dir, const std::string& where,
                                     const std::string& arg) {
  const std::string path = LedgerPath(runs_dir);
  if (!std::filesystem::exists(path)) return NotFound("{}: no ledger (no runs yet)", path);
  Db db;
  DL_RETURN_IF_ERROR(db.Open(path));
  const std::string sql =
      "SELECT run_id,label,mode,commit_id,started_utc,verdict,valid,exact,prompts,conventional,"
      "historical,dir,per_prompt FROM runs " +
      where + " ORDER BY started_utc, run_id";
  sqlite3_stmt* st = nullptr;
  if (sqlite3_prepare_v2(db.get(), sql.c_str(), -1, &st, nullptr) != SQLITE_OK) {
    return Internal("{}: {}", path, sqlite3_errmsg(db.get()));
  }
  if (!arg.empty()) sqlite3_bind_text(st, 1, arg.c_str(), -1, SQLITE_TRANSIENT);
  std::vector<LedgerRun> out;
  while (sqlite3_step(st) == SQLITE_ROW) {
    LedgerRun r;
    r.run_id = Text(st, 0);
    r.label = Text(st, 1);
    r.mode = Text(st, 2);
    r.commit = Text(st, 3);
    r.started_utc = Text(st, 4);
    r.verdict = Text(st, 5);
    r.valid = sqlite3_column_int(st, 6) != 0;
    r.exact = sqlite3_column_int(st, 7);
    r.prompts = sqlite3_column_int(st, 8);
    if (sqlite3_column_type(st, 9) != SQLITE_NULL) r.conventional = sqlite3_column_double(st, 9);
    if (sqlite3_column_type(st, 10) != SQLITE_NULL) r.historical = sqlite3_column_double(st, 10);
    r.dir = Text(st, 11);
    try {
      r.per_prompt_conventional = nlohmann::json::parse(Text(st, 12)).get<std::vector<double>>();
    } catch (...) {
    }
    out.push_back(std::move(r));
  }
  sqlite3_finalize(st);
  // The stream rate and speculation of each run, from its metric rows.
  const std::string msql =
      "SELECT run_id,name,value FROM metrics WHERE name IN ('decode_tok_s_stream_median',"
      "'spec_decode_num_speculative_tokens','spec_decode_mean_acceptance_length')";
  if (sqlite3_prepare_v2(db.get(), msql.c_str(), -1, &st, nullptr) != SQLITE_OK) {
    return Internal("{}: {}", path, sqlite3_errmsg(db.get()));
  }
  std::map<std::string, LedgerRun*> by_id;
  for (auto& r : out) by_id[r.run_id] = &r;
  while (sqlite3_step(st) == SQLITE_ROW) {
    auto it = by_id.find(Text(st, 0));
    if (it == by_id.end() || sqlite3_column_type(st, 2) == SQLITE_NULL) continue;
    const std::string name = Text(st, 1);
    const double v = sqlite3_column_double(st, 2);
    if (name == "decode_tok_s_stream_median") {
      if (it->second->valid) it->second->stream = v;
    } else if (name == "spec_decode_num_speculative_tokens") {
      it->second->speculative = true;
    } else {
      it->second->mean_acceptance_length = v;
    }
  }
  sqlite3_finalize(st);
  return out;
}

}  // namespace

Result<std::vector<LedgerRun>> LedgerList(const std::string& runs_dir) {
  return Query(runs_dir, "", "");
}

Result<std::vector<LedgerRun>> LedgerSelect(const std::string& runs_dir, const std::string& key) {
  DL_ASSIGN_OR_RETURN(auto by_id, Query(runs_dir, "WHERE run_id = ?", key));
  if (!by_id.empty()) return by_id;
  DL_ASSIGN_OR_RETURN(auto by_label, Query(runs_dir, "WHERE label = ?", key));
  if (by_label.empty()) {
    return NotFound("{}: no run id or label \"{}\"", LedgerPath(runs_dir), key);
  }
  return by_label;
}

std::string Comparison::Line() const {
  const double diff = median_b - median_a;
  const double pct = median_a > 0 ? 100.0 * diff / median_a : 0;
  std::string verdict;
  if (!spread_known) {
    verdict = "repeat spread unknown (each side has one run): no conclusion";
  } else if (exceeds) {
    verdict = fmt::format("difference exceeds the repeat spread ({:.2f} tok/s)",
                          std::max(spread_a, spread_b));
  } else {
    verdict = fmt::format("difference is within the repeat spread ({:.2f} tok/s)",
                          std::max(spread_a, spread_b));
  }
  if (statistic == "stream") {
    return fmt::format(
        "{}: {:.2f} tok/s ({} run(s), spread {:.2f}) vs {}: {:.2f} tok/s ({} run(s), spread "
        "{:.2f}); difference {:+.2f} tok/s ({:+.1f}%); {}; statistic: stream median (first to last "
        "token), since a side decodes speculatively",
        a, median_a, runs_a, spread_a, b, median_b, runs_b, spread_b, diff, pct, verdict);
  }
  return fmt::format(
      "{}: {:.2f} tok/s (historical {:.2f}, {} run(s), spread {:.2f}) vs {}: {:.2f} tok/s "
      "(historical {:.2f}, {} run(s), spread {:.2f}); difference {:+.2f} tok/s ({:+.1f}%); {}",
      a, median_a, hmedian_a, runs_a, spread_a, b, median_b, hmedian_b, runs_b, spread_b, diff, pct,
      verdict);
}

Result<Comparison> Compare(const std::string& a, const std::vector<LedgerRun>& ra,
                           const std::string& b, const std::vector<LedgerRun>& rb) {
  Comparison c;
  c.a = a;
  c.b = b;
  bool any_spec = false;
  for (const auto* side : {&ra, &rb}) {
    for (const auto& r : *side) any_spec |= r.valid && r.speculative;
  }
  if (any_spec) c.statistic = "stream";
  auto side = [&c](const std::string& name, const std::vector<LedgerRun>& runs, double* med,
                   double* hmed, double* spread, int* n) -> Status {
    std::vector<double> conv, hist;
    for (const auto& r : runs) {
      if (c.statistic == "stream") {
        if (!r.valid || !r.stream) continue;
        conv.push_back(*r.stream);
        hist.push_back(0);
        continue;
      }
      if (!r.valid || !r.conventional || !r.historical) continue;
      conv.push_back(*r.conventional);
      hist.push_back(*r.historical);
    }
    if (conv.empty()) return FailedPrecondition("{}: no valid run with a speed to compare", name);
    *med = Median(conv);
    *hmed = Median(hist);
    *spread =
        *std::max_element(conv.begin(), conv.end()) - *std::min_element(conv.begin(), conv.end());
    *n = static_cast<int>(conv.size());
    return Status::Ok();
  };
  DL_RETURN_IF_ERROR(side(a, ra, &c.median_a, &c.hmedian_a, &c.spread_a, &c.runs_a));
  DL_RETURN_IF_ERROR(side(b, rb, &c.median_b, &c.hmedian_b, &c.spread_b, &c.runs_b));
  c.spread_known = c.runs_a > 1 || c.runs_b > 1;
  c.exceeds =
      c.spread_known && std::abs(c.median_b - c.median_a) > std::max(c.spread_a, c.spread_b);
  return c;
}

}  // namespace dl::lab
