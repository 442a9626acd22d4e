// decodelab: a Laguna decode engine and the lab that proves its speed claims. One binary, subcommands.
#include <cstdio>

#include <CLI/CLI.hpp>

#include "apps/decodelab/commands.h"
#include "base/status.h"

namespace dl::app {

int ReportError(const Status& status) {
  std::fprintf(stderr, "error: %s\n", status.message().c_str());
  return status.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace dl::app

int main(int argc, char** argv) {
  CLI::App root{
      "decodelab: fast, exact decoding of Laguna models, with a lab that ties every speed claim to\n"
      "an exact output, a binary and a healthy interconnect."};
  root.require_subcommand(1);
  root.set_version_flag("--version", "decodelab 0.1.0");
  dl::app::CommandContext ctx;
  // Each subcommand registers itself here (apps/decodelab/cmd_<name>.cc).
  dl::app::AddGenerateCommand(root, ctx);
  dl::app::AddCalibrateCommand(root, ctx);
  dl::app::AddBenchCommand(root, ctx);
  dl::app::AddProbeCommand(root, ctx);
  dl::app::AddMakeModelCommand(root, ctx);
  dl::app::AddInspectCommand(root, ctx);
  dl::app::AddKernelsCommand(root, ctx);
  dl::app::AddServeCommand(root, ctx);
  dl::app::AddLabCommand(root, ctx);
  CLI11_PARSE(root, argc, argv);
  return ctx.exit_code;
}
