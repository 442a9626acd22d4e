#include "model/hf_cache.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace dl {
namespace {

namespace fs = std::filesystem;

bool IsRepoCache(const fs::path& p) {
  std::error_code ec;
  return p.filename().string().rfind("models--", 0) == 0 && fs::is_directory(p / "snapshots", ec);
}

Result<std::string> SnapshotOf(const fs::path& repo) {
  std::error_code ec;
  std::string revision;
  if (std::ifstream ref(repo / "refs" / "main"); ref) std::getline(ref, revision);
  if (!revision.empty()) {
    const fs::path snap = repo / "snapshots" / revision;
    if (fs::is_directory(snap, ec)) return snap.string();
    return NotFound("{}: refs/main names revision {}, but snapshots/{} is missing", repo.string(),
                    revision, revision);
  }
  std::vector<std::string> snaps;
  for (const auto& e : fs::directory_iterator(repo / "snapshots", ec)) {
    if (e.is_directory(ec)) snaps.push_back(e.path().filename().string());
  }
  std::sort(snaps.begin(), snaps.end());
  if (snaps.size() == 1) return (repo / "snapshots" / snaps[0]).string();
  if (snaps.empty()) return NotFound("{}: the cache holds no snapshot", repo.string());
  return InvalidArgument(
      "{}: no refs/main and {} snapshots ({}); pass the snapshot directory you want as --model",
      repo.string(), snaps.size(), fmt::join(snaps, ", "));
}

}  // namespace

Result<std::string> ResolveModelDir(const std::string& spec, const std::string& hub_cache_dir) {
  std::error_code ec;
  const fs::path p(spec);
  if (fs::is_directory(p, ec)) {
    if (IsRepoCache(p)) return SnapshotOf(p);
    return spec;
  }
  // org/name: exactly one slash, neither part empty, not a path that exists.
  const size_t slash = spec.find('/');
  const bool repo_id = slash != std::string::npos && slash > 0 && slash + 1 < spec.size() &&
                       spec.find('/', slash + 1) == std::string::npos && spec[0] != '.';
  if (!repo_id) return NotFound("--model {}: no such directory", spec);
  if (hub_cache_dir.empty()) {
    return NotFound("--model {}: not a directory, and no Hugging Face hub cache to look in", spec);
  }
  const fs::path repo = fs::path(hub_cache_dir) /
                        ("models--" + spec.substr(0, slash) + "--" + spec.substr(slash + 1));
  if (!fs::is_directory(repo, ec)) {
    return NotFound(
        "--model {}: not a directory, and not in the Hugging Face hub cache ({} does not exist); "
        "decodelab does not download: fetch it first (e.g. `hf download {}`) or give a directory",
        spec, repo.string(), spec);
  }
  return SnapshotOf(repo);
}

}  // namespace dl
