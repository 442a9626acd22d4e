// Every subcommand of `decodelab` lives in its own cmd_<name>.cc and registers itself on the root
// CLI11 app through one Add*Command function. A command's callback stores its exit code in the
// context; library code returns Status values, and only these files turn them into exit codes.
#pragma once

#include <CLI/CLI.hpp>

#include "base/status.h"

namespace dl::app {

struct CommandContext {
  int exit_code = 0;
};

// Prints "error: <message>" to stderr and returns the exit code for a failed Status (1, or 2 for bad
// input).
int ReportError(const ::dl::Status& status);

// Subcommands (one per cmd_<name>.cc):
void AddGenerateCommand(CLI::App& root, CommandContext& ctx);
void AddCalibrateCommand(CLI::App& root, CommandContext& ctx);
void AddBenchCommand(CLI::App& root, CommandContext& ctx);
void AddProbeCommand(CLI::App& root, CommandContext& ctx);
void AddMakeModelCommand(CLI::App& root, CommandContext& ctx);
void AddInspectCommand(CLI::App& root, CommandContext& ctx);
void AddKernelsCommand(CLI::App& root, CommandContext& ctx);
void AddServeCommand(CLI::App& root, CommandContext& ctx);
void AddLabCommand(CLI::App& root, CommandContext& ctx);
// Hidden: a child rank of `--tp N --tp-transport processes` (cmd_tp_rank.cc).
void AddTpRankCommand(CLI::App& root, CommandContext& ctx);


}  // namespace dl::app
