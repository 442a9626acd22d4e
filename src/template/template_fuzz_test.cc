// Random chat templates (tests/common/fuzz_gen.h, fixed seed) rendered against random contexts: each
// must parse or fail, render or fail, within the interpreter's limits, and never take the process
// down (issue 21). The same generator drives the server fuzz test.
#include <chrono>

#include <gtest/gtest.h>

#include "template/chat_template.h"
#include "tests/common/fuzz_gen.h"

namespace dl {
namespace {

using Clock = std::chrono::steady_clock;

TEST(TemplateFuzz, RandomTemplatesAndContextsNeverCrash) {
  constexpr uint64_t kSeed = 0x2121;
  fuzz::Rng rng(kSeed);
  fuzz::TemplateGen gen(rng);
  const auto t0 = Clock::now();
  int parsed = 0, rendered = 0;
  constexpr int kTemplates = 1500;
  for (int i = 0; i < kTemplates; ++i) {
    const std::string src = gen.Template();
    auto t = ChatTemplate::Parse(src, "fuzz");
    if (!t.ok()) continue;
    ++parsed;
    {
      nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
      ctx["messages"] = nlohmann::ordered_json::array();
      for (int m = 0, n = static_cast<int>(rng.Int(0, 4)); m < n; ++m) {
        ctx["messages"].push_back({{"role", rng.Chance(0.5) ? "user" : "assistant"},
                                   {"content", fuzz::RandomJson(rng)}});
      }
      ctx["tools"] = fuzz::RandomJson(rng);
      ctx["x"] = fuzz::RandomJson(rng);
      ctx["add_generation_prompt"] = rng.Chance(0.5);
      const auto r0 = Clock::now();
      auto out = t->Render(ctx);
      const double s = std::chrono::duration<double>(Clock::now() - r0).count();
      ASSERT_LT(s, 15.0) << "seed " << kSeed << " template " << i << ":\n" << src;
      rendered += out.ok();
    }
  }
  // The generator must reach the interpreter, not only its parser.
  EXPECT_GT(parsed, kTemplates / 2);
  EXPECT_GT(rendered, kTemplates / 10);
  std::printf("%d templates, %d parsed, %d renders succeeded, %.1f s\n", kTemplates, parsed,
              rendered, std::chrono::duration<double>(Clock::now() - t0).count());
}

}  // namespace
}  // namespace dl
