// decodelab: a Laguna decode engine and the lab that proves its speed claims. One binary, subcommands.
#include <cstdio>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "apps/decodelab/commands.h"
#include "base/build_info.h"
#include "base/status.h"

namespace dl::app {

int ReportError(const Status& status) {
  std::fprintf(stderr, "error: %s\n", status.message().c_str());
  return status.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace dl::app

namespace {

std::string VersionText() {
  return fmt::format("decodelab {}\ncommit {}\ncompilers {}\nbuild {}", DECODELAB_VERSION,
                     dl::BuildCommit(), dl::BuildCompilers(), dl::BuildFlags());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App root{
      "decodelab: fast, exact decoding of Laguna models, with a lab that ties every speed claim to\n"
      "an exact output, a binary and a healthy interconnect."};
  root.require_subcommand(1);
  root.set_version_flag("--version", [] { return VersionText(); });
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
  try {
    root.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Prints --help / --version output, or the error with a pointer to --help.
    const int rc = root.exit(e);
    if (rc == static_cast<int>(CLI::ExitCodes::Success)) return 0;
    // Usage errors exit 2, as getopt programs do. `probe` keeps 1: its codes 2..8 are the classes
    // of a probe that ran (docs/multi-host.md).
    return root.got_subcommand("probe") ? 1 : 2;
  }
  return ctx.exit_code;
}
