// A chat template is input (a model file): hostile templates must fail with a clear error, never
// crash (stack overflow, SIGFPE), hang or take the process's memory (issue 21 item 3).
#include <sys/resource.h>
#include <time.h>

#include <string>

#include <gtest/gtest.h>

#include "template/chat_template.h"
#include "template/jinja_eval.h"
#include "template/jinja_parser.h"

namespace dl {
namespace {

using nlohmann::ordered_json;
// The time bounds below say "the limit stops this work quickly": they measure the CPU time of the
// rendering thread, so other processes on a loaded machine (CI, parallel builds) cannot fail them.
struct Clock {
  using time_point = double;
  static double now() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  }
};

Result<std::string> Render(const std::string& src, const ordered_json& ctx = ordered_json::object()) {
  DL_ASSIGN_OR_RETURN(ChatTemplate t, ChatTemplate::Parse(src, "t"));
  return t.Render(ctx);
}

// The render fails, quickly, with a message containing `want`.
void ExpectFails(const std::string& src, const std::string& want, double max_seconds = 10) {
  const auto t0 = Clock::now();
  auto r = Render(src);
  const double s = Clock::now() - t0;
  ASSERT_FALSE(r.ok()) << src.substr(0, 120) << " rendered " << r->size() << " bytes";
  EXPECT_NE(r.status().message().find(want), std::string::npos)
      << src.substr(0, 120) << ": " << r.status().message();
  EXPECT_LT(s, max_seconds) << src.substr(0, 120);
}

std::string Repeat(const std::string& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

TEST(TemplateLimits, SelfReferencingValuesAreErrorsNotStackOverflows) {
  ExpectFails("{% set ns = namespace() %}{% set ns.a = ns %}{{ ns }}", "containing itself");
  ExpectFails("{% set l = [] %}{% set _ = l.append(l) %}{{ l }}", "containing itself");
  ExpectFails("{% set l = [] %}{% set _ = l.append(l) %}{{ l|tojson }}", "containing itself");
  ExpectFails("{% set d = {'k': []} %}{% set _ = d.k.append(d) %}{{ d|string }}",
              "containing itself");
  ExpectFails("{% set a = [] %}{% set b = [a] %}{% set _ = a.append(b) %}{{ a < b }}",
              "containing itself");
  // Identity needs no recursion.
  auto same = Render("{% set l = [] %}{% set _ = l.append(l) %}{{ l == l }}");
  ASSERT_TRUE(same.ok()) << same.status().message();
  EXPECT_EQ(*same, "True");
  // Many cyclic renders in a row (each cycle is emptied at the end of its render).
  for (int i = 0; i < 1000; ++i) {
    ASSERT_TRUE(Render("{% set ns = namespace() %}{% set ns.a = ns %}{% set ns.b = [ns] %}ok").ok());
  }
}

TEST(TemplateLimits, DeepValuesBuiltAtRunTimeFailToPrintAndFreeWithoutRecursion) {
  const std::string build =
      "{% set ns = namespace(x=1) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}"
      "{% endfor %}";
  ExpectFails(build + "{{ ns.x }}", "nested deeper");
  ExpectFails(build + "{{ ns.x|tojson }}", "nested deeper");
  ExpectFails(build + "{{ ns.x == [ns.x] }}", "nested deeper");
  // Building and dropping it is fine: freeing is a loop.
  auto r = Render(build + "done");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(*r, "done");
  // A context nested beyond the limit (the server bounds request JSON separately).
  ordered_json ctx = ordered_json::object();
  ctx["x"] = ordered_json::parse(std::string(20000, '[') + "1" + std::string(20000, ']'));
  auto c = Render("{{ x }}", ctx);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("nested deeper"), std::string::npos) << c.status().message();
}

TEST(TemplateLimits, HundredThousandDeepSyntaxIsRejectedAtLoad) {
  for (const std::string& src :
       {"{{ " + Repeat("[", 100000) + Repeat("]", 100000) + " }}",
        "{{ x" + Repeat("|string", 100000) + " }}",
        "{{ x" + Repeat(".a", 100000) + " }}",
        "{{ 1" + Repeat(" + 1", 100000) + " }}",
        "{{ x" + Repeat("[0]", 100000) + " }}",
        "{{ f" + Repeat("()", 100000) + " }}",
        "{{ 'a'" + Repeat(" ~ 'a'", 100000) + " }}",
        "{{ x" + Repeat(" is defined", 2) + Repeat(" and y", 100000) + " }}",
        Repeat("{% if true %}", 100000) + Repeat("{% endif %}", 100000),
        "{% filter upper" + Repeat("|lower", 100000) + " %}x{% endfilter %}"}) {
    const auto t0 = Clock::now();
    auto t = ChatTemplate::Parse(src, "hostile.jinja");
    EXPECT_FALSE(t.ok()) << src.substr(0, 60);
    if (!t.ok()) {
      EXPECT_NE(t.status().message().find("nested"), std::string::npos) << t.status().message();
    }
    EXPECT_LT(Clock::now() - t0, 10.0);
  }
  // Chains of a sane length still parse and render.
  auto ok = Render("{{ 'a'" + Repeat(" ~ 'a'", 200) + " }}");
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_EQ(ok->size(), 201u);
}

TEST(TemplateLimits, IntegerEdgeCasesAreErrorsNotTraps) {
  ExpectFails("{{ (-9223372036854775807 - 1) // -1 }}", "integer overflow");
  ExpectFails("{{ -(-9223372036854775807 - 1) }}", "integer overflow");
  ExpectFails("{{ (-9223372036854775807 - 1)|abs }}", "integer overflow");
  ExpectFails("{{ [9223372036854775807, 1]|sum }}", "integer overflow");
  ExpectFails("{{ 2 ** 64 }}", "integer overflow");
  ExpectFails("{{ 3 ** 9223372036854775807 }}", "integer overflow");
  ExpectFails("{{ 0 ** -1 }}", "negative power");
  auto r = Render(
      "{{ (-9223372036854775807 - 1) % -1 }} {{ 7 % -1 }} {{ (-9223372036854775807 - 1) is "
      "divisibleby(-1) }} {{ (-1) ** 3 }} {{ (-1) ** 9223372036854775807 }} {{ 2 ** 62 }} "
      "{{ 1e300|int }} {{ '1e300'|int }} {{ '%d'|format(1e20) }} {{ 'abc'[-9223372036854775807 - 1:] "
      "}} {{ [1, 2, 3][::9223372036854775807] }} {{ 'abc'[::-9223372036854775807] }}");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(*r, "0 0 True -1 -1 4611686018427387904 0 0 100000000000000000000 abc [1] c");
}

TEST(TemplateLimits, DoublingStringsAndListsStopsAtTheSizeLimits) {
  struct rusage before {};
  getrusage(RUSAGE_SELF, &before);
  ExpectFails(
      "{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
      "{% endfor %}{{ ns.s|length }}",
      "exceeds the limit");
  ExpectFails(
      "{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
      "{% endfor %}",
      "exceeds the limit");
  ExpectFails(
      "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}"
      "{% endfor %}",
      "exceeds the limit");
  ExpectFails("{{ ([1] * 1000000) * 1000000 }}", "exceeds the limit");
  ExpectFails("{{ 'ab'|replace('', 'x' * 60000000) }}", "exceeds the limit");
  ExpectFails("{{ 'a\nb'|indent(100000000000) }}", "exceeds the limit");
  ExpectFails("{{ [1]|tojson(indent=100000000000) }}", "exceeds the limit");
  ExpectFails("{% set s = 'x' * 60000000 %}{{ [s, s, s]|join('') }}", "exceeds the limit");
  // Many big strings kept alive: the per-render memory limit.
  ExpectFails(
      "{% set ns = namespace(l=[]) %}{% set big = 'x' * 60000000 %}{% for i in range(20) %}"
      "{% set _ = ns.l.append(big ~ i) %}{% endfor %}",
      "memory limit");
  struct rusage after {};
  getrusage(RUSAGE_SELF, &after);
  // Peak RSS (KiB): a few hundred MiB at most, never the gigabytes these asked for.
  EXPECT_LT(after.ru_maxrss, 1500L * 1024) << "peak RSS " << after.ru_maxrss << " KiB";
  // Building a long string piece by piece keeps little alive at once: no false alarm.
  auto ok = Render(
      "{% set ns = namespace(s='') %}{% for i in range(5000) %}{% set ns.s = ns.s ~ 'line "
      "of text ' ~ i ~ '\n' %}{% endfor %}{{ ns.s|length }}");
  ASSERT_TRUE(ok.ok()) << ok.status().message();
}

TEST(TemplateLimits, QuadraticFiltersStopAtTheStepLimit) {
  ExpectFails("{{ range(1000000)|unique|length }}", "evaluation steps", 8);
  ExpectFails("{{ range(1000000)|map('string')|unique|list|length }}", "evaluation steps", 8);
  ExpectFails(
      "{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}",
      "loop iterations", 8);
  // unique on a sane list still works.
  auto ok = Render("{{ [3, 1, 3, 2, 1]|unique|list }}");
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_EQ(*ok, "[3, 1, 2]");
}

TEST(TemplateLimits, RecursionThroughMacrosAndCallsIsBounded) {
  // Deep expressions inside deep macro recursion: the evaluation depth bounds the stack.
  const std::string deep_expr = "n" + Repeat(" + 0", 200);
  ExpectFails("{% macro f(n) %}{{ f(" + deep_expr + " + 1) }}{% endmacro %}{{ f(0) }}",
              "nested deeper");
  ExpectFails("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion");
}

}  // namespace
}  // namespace dl
