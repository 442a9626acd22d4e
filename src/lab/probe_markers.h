// Stage-marker logs: one JSON object per line, written with a single write() and fsync'd before the
// rank moves on, so after a hard kill the last line still says where the rank was.
//   {"event":"marker","stage":"all_reduce-start","rank":1,"pid":4242,"t_mono_ns":...,
//    "t_wall":"2026-07-27T10:11:12.345Z","detail":{...}}
//   {"event":"error","stage":"comm-initialised","rank":1,...,"message":"..."}
// "error" lines are not markers: the classification looks only at "marker" lines.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "lab/probe.h"

namespace dl::lab {

class MarkerWriter {
 public:
  MarkerWriter() = default;
  ~MarkerWriter();
  MarkerWriter(const MarkerWriter&) = delete;
  MarkerWriter& operator=(const MarkerWriter&) = delete;

  // Truncates/creates `path`. With enabled == false nothing is ever written (the no-markers fault).
  Status Open(const std::string& path, int rank, bool enabled);
  Status Mark(Stage stage, const nlohmann::json& detail = nlohmann::json::object());
  Status Error(Stage stage, const std::string& message);

 private:
  Status WriteLine(nlohmann::json line);
  int fd_ = -1;
  int rank_ = 0;
  bool enabled_ = true;
  std::string path_;
};

struct MarkerRecord {
  Stage stage;
  int64_t t_mono_ns = 0;
  nlohmann::json detail;
};

struct MarkerLog {
  std::vector<MarkerRecord> markers;
  std::vector<std::string> errors;  // "comm-initialised: <message>"
};

// Reads a marker log; a missing file is an empty log. Malformed lines (a write cut short by a kill)
// are skipped.
MarkerLog ReadMarkerLog(const std::string& path);

int64_t MonotonicNs();
std::string WallTimeIso();  // "2026-07-27T10:11:12.345Z"

}  // namespace dl::lab
