// Model directories from a Hugging Face hub cache, without downloading: `--model` may name a
// checkpoint directory, a cached repository (`.../models--org--name`), or `org/name`, looked up in
// the hub cache directory the caller passes (apps/decodelab reads $HF_HUB_CACHE / $HF_HOME).
//
// A cached repository resolves to snapshots/<revision>: the revision `refs/main` names, else the
// only snapshot there is. Snapshot files are symlinks into blobs/, as huggingface_hub writes them.
#pragma once

#include <string>

#include "base/status.h"

namespace dl {

// The directory to load for `spec`. NotFound says where it looked and that nothing is downloaded.
Result<std::string> ResolveModelDir(const std::string& spec, const std::string& hub_cache_dir);

}  // namespace dl
