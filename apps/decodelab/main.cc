// decodelab: a Laguna decode engine and the lab that proves its speed claims. One binary, subcommands.
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <functional>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "apps/decodelab/commands.h"
#include "base/build_info.h"
#include "base/status.h"

namespace dl::app {

int ReportError(const Status& status) {
  // The command's outcome, not a log line: printed whatever --log-level says.
  std::fprintf(stderr, "error: %s\n", status.message().c_str());
  return status.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace dl::app

namespace {

// One logging path: every diagnostic goes through spdlog to stderr, so stdout carries only a
// command's results (ids, JSON, serve's ready line).
void SetUpLogging() {
  auto logger = spdlog::stderr_color_mt("decodelab");
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("%^%l%$ %m-%d %H:%M:%S.%e %v");
}

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
  SetUpLogging();
  // --log-level anywhere on the line (fallthrough lets subcommands pass it up), else
  // $DECODELAB_LOG_LEVEL, else info.
  std::string log_level;
  if (const char* env = std::getenv("DECODELAB_LOG_LEVEL"); env && *env) log_level = env;
  root.add_option("--log-level", log_level,
                  "Log level: trace, debug, info, warning, error, critical or off (default info, or "
                  "$DECODELAB_LOG_LEVEL)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "warning", "error", "critical", "off"},
                            CLI::ignore_case));
  root.parse_complete_callback([&log_level] {
    if (log_level.empty()) return;
    std::string l = log_level;
    for (char& c : l) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    spdlog::set_level(spdlog::level::from_str(l == "warning" ? "warn" : l));
  });
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
  dl::app::AddTpRankCommand(root, ctx);
  // --log-level may follow a subcommand: each passes options it does not know up to its parent.
  // Not __probe-rank or __tp-rank, whose unknown arguments are their own (allow_extras).
  std::function<void(CLI::App*)> pass_up = [&](CLI::App* app) {
    for (CLI::App* sub : app->get_subcommands([](CLI::App*) { return true; })) {
      if (sub->get_name() == "__probe-rank" || sub->get_name() == "__tp-rank") continue;
      sub->fallthrough();
      pass_up(sub);
    }
  };
  pass_up(&root);
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
