// The hidden `__tp-rank` subcommand: a child rank of `--tp N --tp-transport processes` (the CPU
// reference or the CUDA backend: rank 0's setup message says which), started by rank 0 (engine/tp_rank_process.h). Hidden from --help; not for people.
#include <unistd.h>

#include "apps/decodelab/commands.h"
#include "engine/tp_rank_process.h"

namespace dl::app {

void AddTpRankCommand(CLI::App& root, CommandContext& ctx) {
  (void)ctx;
  CLI::App* rank = root.add_subcommand("__tp-rank", "internal: one tensor-parallel rank as a process");
  rank->group("");
  rank->prefix_command();
  rank->allow_extras();
  // _exit, not return: rank 0 must see this rank's own exit code, whatever exit-time destructors do.
  rank->callback([rank] { ::_exit(TpRankProcessMain("decodelab", rank->remaining())); });
}

}  // namespace dl::app
