// What every `decodelab bench` mode shares (cmd_bench.cc, cmd_bench_comm.cc): the report's first line
// and the --json-out file.
#pragma once

#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "apps/decodelab/commands.h"

namespace dl::app {

// --json-out: the results as indented JSON (nothing without a path); the exit code.
int WriteJsonOut(const std::string& path, const nlohmann::json& j);
// The first line of every mode's report: the build and where it ran (`gpu` null: the CPU).
void PrintBenchHeader(const char* mode, const nlohmann::json& gpu);

// `decodelab bench comm` (cmd_bench_comm.cc), a subcommand of `bench`.
void AddBenchCommCommand(CLI::App* bench, CommandContext& ctx);

}  // namespace dl::app
