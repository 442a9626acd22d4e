// The hidden `__tp-rank` subcommand: one child rank of `--tp N --tp-transport processes`, on the CPU
// reference or the CUDA backend (backend/tp_process_ranks.h). Rank 0 starts it as
//   <program> __tp-rank <model source> --tp-rank r --tp-size N --tp-control HOST:PORT --tp-data HOST:PORT
//                     --tp-timeout-s S
// where the model source (TpRankModelArgs) makes the child build the very weights rank 0 holds: the
// same checkpoint directory, or the same --shape, --seed and --num-layers (synthetic weights are a
// pure function of them). Everything else (KV geometry and scales, embedding mode) comes from rank 0
// over the control connection (and for a CUDA rank its CudaRunnerOptions, its GPU and the one-shot
// IPC communicator's size).
#pragma once

#include <string>
#include <vector>

#include "base/status.h"
#include "backend/tp_process_ranks.h"
#include "engine/engine.h"

namespace dl {

// The model-source flags for a child rank (a --shape's FP8 layout included).
std::vector<std::string> TpRankModelArgs(const EngineOptions& options);
// How rank 0 starts its children for `options`: the options' executable and argv prefix, then the
// model source.
TpProcessOptions TpProcessOptionsFor(const EngineOptions& options);

// The subcommand's body: `args` are the flags after "__tp-rank". Ok once rank 0 said stop; an error
// when rank 0 went away, a message was bad, or the rank could not be built.
Status RunTpRankProcess(const std::vector<std::string>& args);

// A child rank process's main, for every program that can be one (`decodelab __tp-rank`, the tests
// that re-execute themselves): RunTpRankProcess(args), its error printed to stderr as "<program>
// __tp-rank: error: ..." (the output goes to rank 0's stderr: say which rank speaks), every stream
// flushed. Returns the exit code (0 or 1) for the caller's _exit: rank 0 must see this rank's own
// code, whatever exit-time destructors would do.
int TpRankProcessMain(const std::string& program, const std::vector<std::string>& args);

}  // namespace dl
