#include "lab/probe_markers.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <fstream>

namespace dl::lab {

int64_t MonotonicNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

std::string WallTimeIso() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  tm utc{};
  gmtime_r(&ts.tv_sec, &utc);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &utc);
  return fmt::format("{}.{:03d}Z", buf, static_cast<int>(ts.tv_nsec / 1000000));
}

MarkerWriter::~MarkerWriter() {
  if (fd_ >= 0) ::close(fd_);
}

Status MarkerWriter::Open(const std::string& path, int rank, bool enabled) {
  path_ = path;
  rank_ = rank;
  enabled_ = enabled;
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    return Unavailable("rank {}: cannot open marker log {}: {}", rank, path, std::strerror(errno));
  }
  return Status::Ok();
}

Status MarkerWriter::WriteLine(nlohmann::json line) {
  if (!enabled_) return Status::Ok();
  std::string text = line.dump() + "\n";
  // One write() per line: O_APPEND keeps the line whole even if something else appends.
  ssize_t n = ::write(fd_, text.data(), text.size());
  if (n != static_cast<ssize_t>(text.size())) {
    return Unavailable("rank {}: writing marker log {} failed: {}", rank_, path_,
                       n < 0 ? std::strerror(errno) : "short write");
  }
  if (::fsync(fd_) != 0) {
    return Unavailable("rank {}: fsync of marker log {} failed: {}", rank_, path_,
                       std::strerror(errno));
  }
  return Status::Ok();
}

Status MarkerWriter::Mark(Stage stage, const nlohmann::json& detail) {
  return WriteLine({{"event", "marker"},
                    {"stage", StageName(stage)},
                    {"rank", rank_},
                    {"pid", static_cast<int>(::getpid())},
                    {"t_mono_ns", MonotonicNs()},
                    {"t_wall", WallTimeIso()},
                    {"detail", detail}});
}

Status MarkerWriter::Error(Stage stage, const std::string& message) {
  return WriteLine({{"event", "error"},
                    {"stage", StageName(stage)},
                    {"rank", rank_},
                    {"pid", static_cast<int>(::getpid())},
                    {"t_mono_ns", MonotonicNs()},
                    {"t_wall", WallTimeIso()},
                    {"message", message}});
}

MarkerLog ReadMarkerLog(const std::string& path) {
  MarkerLog log;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) continue;
    auto event = j.find("event");
    auto stage_name = j.find("stage");
    if (event == j.end() || !event->is_string() || stage_name == j.end() ||
        !stage_name->is_string()) {
      continue;
    }
    std::optional<Stage> stage = StageFromName(stage_name->get<std::string>());
    if (!stage) continue;
    if (*event == "marker") {
      MarkerRecord r{*stage, 0, nlohmann::json::object()};
      if (auto t = j.find("t_mono_ns"); t != j.end() && t->is_number_integer()) {
        r.t_mono_ns = t->get<int64_t>();
      }
      if (auto d = j.find("detail"); d != j.end() && d->is_object()) r.detail = *d;
      log.markers.push_back(std::move(r));
    } else if (*event == "error") {
      auto m = j.find("message");
      log.errors.push_back(
          fmt::format("{}: {}", StageName(*stage),
                      m != j.end() && m->is_string() ? m->get<std::string>() : ""));
    }
  }
  return log;
}

}  // namespace dl::lab
