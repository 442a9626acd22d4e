// The lab's own files (suites, teachers, plans, reproducers) are read with checked numbers: a value
// is never truncated (a token id 1.5 became 1) or wrapped, an unknown format version and negative
// counts are refused (issue 21 item 10).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "lab/lab_gate.h"
#include "lab/lab_repro.h"
#include "lab/lab_suite.h"

namespace dl::lab {
namespace {

using nlohmann::json;

json Suite() {
  return {{"format", "decodelab-lab-suite"},
          {"version", 1},
          {"screen_tokens", 16},
          {"suite_tokens", 20},
          {"kv_dtype", "f32"},
          {"prompts", {{{"name", "a"}, {"token_ids", {5, 17, 42}}}}}};
}

void ExpectSuiteError(const json& j, const std::string& want) {
  auto s = ParseSuite(j, "/x/suite.json", "sha");
  ASSERT_FALSE(s.ok()) << j.dump();
  EXPECT_NE(s.status().message().find(want), std::string::npos) << s.status().message();
}

TEST(LabFiles, SuiteNumbersAreCheckedNotTruncated) {
  ASSERT_TRUE(ParseSuite(Suite(), "/x/suite.json", "sha").ok());
  json j = Suite();
  j["prompts"][0]["token_ids"] = {5, 1.5, 42};
  ExpectSuiteError(j, "token_ids[1]: token id: expected an integer, got 1.5");
  j = Suite();
  j["prompts"][0]["token_ids"] = {5, int64_t{1} << 40};
  ExpectSuiteError(j, "outside");
  j = Suite();
  j["prompts"][0]["token_ids"] = {-3};
  ExpectSuiteError(j, "outside");
  j = Suite();
  j["version"] = 99;
  ExpectSuiteError(j, "version 99 is not supported");
  j = Suite();
  j["screen_tokens"] = 16.5;
  ExpectSuiteError(j, "screen_tokens");
  j = Suite();
  j["suite_tokens"] = int64_t{1} << 33;
  ExpectSuiteError(j, "suite_tokens");
}

TEST(LabFiles, TeacherTokensAreChecked) {
  json t = {{"format", "decodelab-teacher"},
            {"version", 1},
            {"prompts",
             {{{"name", "a"}, {"prompt", {5, 17}}, {"tokens", {3, 4}}, {"next", {{"2", 9}}}}}}};
  ASSERT_TRUE(ParseTeacher(t, "teacher.json").ok());
  json bad = t;
  bad["prompts"][0]["tokens"][1] = 4.5;
  EXPECT_FALSE(ParseTeacher(bad, "teacher.json").ok());
  bad = t;
  bad["prompts"][0]["next"] = {{"2", 9.25}};
  EXPECT_FALSE(ParseTeacher(bad, "teacher.json").ok());
  bad = t;
  bad["prompts"][0]["next"] = {{"two", 9}};
  EXPECT_FALSE(ParseTeacher(bad, "teacher.json").ok());
  bad = t;
  bad["version"] = 2;
  EXPECT_FALSE(ParseTeacher(bad, "teacher.json").ok());
}

TEST(LabFiles, PlanCountsAreChecked) {
  json p = {{"format", "decodelab-lab-plan"}, {"probe", {{"transport", "sim"}, {"ranks", 2}}}};
  auto ok = ParseGatePlan(p, "/x/plan.json");
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_EQ(ok->probe_ranks, 2);
  for (const json& ranks : {json(-1), json(2.5), json(int64_t{1} << 40)}) {
    json bad = p;
    bad["probe"]["ranks"] = ranks;
    auto r = ParseGatePlan(bad, "/x/plan.json");
    ASSERT_FALSE(r.ok()) << ranks.dump();
    EXPECT_NE(r.status().message().find("ranks"), std::string::npos) << r.status().message();
  }
  json bad = p;
  bad["model"] = {{"shape", "tiny"}, {"num_layers", -2}};
  EXPECT_FALSE(ParseGatePlan(bad, "/x/plan.json").ok());
}

TEST(LabFiles, ReproTokensAreChecked) {
  json r = {{"format", "decodelab-lab-repro"},
            {"target", {{"token_ids", {1, 2}}, {"max_tokens", 2}, {"expected", {3, 4}}}}};
  ASSERT_TRUE(ParseRepro(r, "/x/r.json").ok());
  json bad = r;
  bad["target"]["expected"] = {3, 4.75};
  EXPECT_FALSE(ParseRepro(bad, "/x/r.json").ok());
  bad = r;
  bad["target"]["max_tokens"] = 2.5;
  EXPECT_FALSE(ParseRepro(bad, "/x/r.json").ok());
}

}  // namespace
}  // namespace dl::lab
