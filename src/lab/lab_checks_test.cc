#include "lab/lab_checks.h"

#include <filesystem>

#include <gtest/gtest.h>
#include <unistd.h>

#include "lab/lab_ledger.h"
#include "lab/lab_runner.h"
#include "lab/lab_suite.h"

namespace dl::lab {
namespace {

using nlohmann::json;

Teacher MakeTeacher() {
  Teacher t;
  t.backend = "cuda";
  t.topology = {"145/144", "145/144"};
  t.topology_applicable = true;
  t.prompts.push_back({"a", {5, 6, 7}, {10, 11, 12, 13}, {{2, 12}, {4, 99}}});
  t.prompts.push_back({"roll", {1, 2}, {20, 21, 22, 23}, {{2, 22}, {4, 98}}});
  return t;
}

PromptResult Result(const std::string& name, std::vector<int32_t> prompt,
                    std::vector<int32_t> tokens, std::optional<int32_t> next,
                    std::string kind = "regular") {
  PromptResult r;
  r.name = name;
  r.kind = kind;
  r.prompt = std::move(prompt);
  r.max_tokens = static_cast<int>(tokens.size());
  r.tokens = std::move(tokens);
  r.finish_reason = "length";
  r.cached_tokens = 0;
  r.next = next;
  return r;
}

// A recorded /v1/decodelab/state of a two-rank CUDA server, in the server's format.
json CudaState() {
  return json::parse(R"({
    "backend": "cuda", "binary_sha256": "abc", "kernel_presets": ["attn_h64"],
    "fallback": false, "fallback_ops": [], "kv_dtype": "fp8",
    "kv_scales": [
      {"rank": 0, "source": "file:x", "layers": [
        {"layer": 0, "k_scale": 0.5, "v_scale": 0.25, "k_scale_bits": "0x3f000000", "v_scale_bits": "0x3e800000"}]},
      {"rank": 1, "source": "file:x", "layers": [
        {"layer": 0, "k_scale": 0.5, "v_scale": 0.25, "k_scale_bits": "0x3f000000", "v_scale_bits": "0x3e800000"}]}],
    "topology": [{"rank": 0, "kernel_nodes": 145, "collectives": 144, "signature": "145/144"},
                 {"rank": 1, "kernel_nodes": 145, "collectives": 144, "signature": "145/144"}],
    "topology_applicable": true})");
}

TEST(LabChecks, ExactnessCountsAndFailsOnAWrongTeacher) {
  Teacher t = MakeTeacher();
  std::vector<PromptResult> rs = {Result("a", {5, 6, 7}, {10, 11}, 12),
                                  Result("roll", {1, 2}, {20, 21}, 22, "rollover")};
  int exact = -1;
  EXPECT_EQ(CheckExactness(rs, t, &exact).status, CheckStatus::kPass);
  EXPECT_EQ(exact, 2);
  t.prompts[1].tokens[1] = 77;  // the teacher disagrees at token 1 of "roll"
  CheckRow row = CheckExactness(rs, t, &exact);
  EXPECT_EQ(row.status, CheckStatus::kFail);
  EXPECT_EQ(exact, 1);
  EXPECT_NE(row.detail.find("1/2"), std::string::npos) << row.detail;
  EXPECT_EQ(CheckRollover(rs, t).status, CheckStatus::kFail);
}

TEST(LabChecks, PrefixCacheHitFails) {
  std::vector<PromptResult> rs = {Result("a", {5, 6, 7}, {10, 11}, 12)};
  EXPECT_EQ(CheckNoPrefixCache(rs).status, CheckStatus::kPass);
  rs[0].cached_tokens = 16;
  EXPECT_EQ(CheckNoPrefixCache(rs).status, CheckStatus::kFail);
  rs[0].cached_tokens = -1;  // not reported is not a pass either
  EXPECT_EQ(CheckNoPrefixCache(rs).status, CheckStatus::kFail);
}

TEST(LabChecks, BoundaryNeedsFullLengthAndTheTeachersNextToken) {
  Teacher t = MakeTeacher();
  std::vector<PromptResult> rs = {Result("a", {5, 6, 7}, {10, 11, 12, 13}, 99, "boundary")};
  EXPECT_EQ(CheckBoundary(rs, t).status, CheckStatus::kPass);
  rs[0].next = 98;
  EXPECT_EQ(CheckBoundary(rs, t).status, CheckStatus::kFail);
  rs[0].next = 99;
  rs[0].finish_reason = "stop";
  EXPECT_EQ(CheckBoundary(rs, t).status, CheckStatus::kFail);
  rs[0].finish_reason = "length";
  rs[0].max_tokens = 3;  // no teacher "next" for M = 3
  rs[0].tokens.pop_back();
  EXPECT_EQ(CheckBoundary(rs, t).status, CheckStatus::kFail);
}

TEST(LabChecks, ScaleAuditComparesBits) {
  KvScales cal{{0.5f}, {0.25f}, "file"};
  EXPECT_EQ(CheckScaleAudit(CudaState(), cal).status, CheckStatus::kPass);
  KvScales off = cal;
  off.v[0] = std::nextafter(0.25f, 1.0f);  // one ulp away
  CheckRow row = CheckScaleAudit(CudaState(), off);
  EXPECT_EQ(row.status, CheckStatus::kFail);
  EXPECT_NE(row.detail.find("layer 0"), std::string::npos) << row.detail;
  json bf16 = CudaState();
  bf16["kv_dtype"] = "bf16";
  EXPECT_EQ(CheckScaleAudit(bf16, off).status, CheckStatus::kNotApplicable);
}

TEST(LabChecks, TopologyAuditOnEveryRank) {
  const std::vector<std::string> expected = {"145/144", "145/144"};
  EXPECT_EQ(CheckTopology(CudaState(), expected).status, CheckStatus::kPass);
  json s = CudaState();
  s["topology"][1]["signature"] = "146/145";  // rank 1 issued one more collective
  CheckRow row = CheckTopology(s, expected);
  EXPECT_EQ(row.status, CheckStatus::kFail);
  EXPECT_NE(row.detail.find("rank 1"), std::string::npos) << row.detail;
  EXPECT_EQ(CheckTopology(CudaState(), {"145/144"}).status, CheckStatus::kFail);
  json cpu = {
      {"backend", "cpu-reference"}, {"topology", "not applicable"}, {"topology_applicable", false}};
  EXPECT_EQ(CheckTopology(cpu, expected).status, CheckStatus::kNotApplicable);
  EXPECT_EQ(CheckKernelPresets(cpu).status, CheckStatus::kNotApplicable);
  EXPECT_EQ(CheckKernelPresets(CudaState()).status, CheckStatus::kPass);
}

TEST(LabChecks, FallbackIsInvalid) {
  EXPECT_EQ(CheckNoFallback(CudaState()).status, CheckStatus::kPass);
  json s = CudaState();
  s["fallback"] = true;
  s["fallback_ops"] = json::array({"attention: preset attn_h64 not built"});
  CheckRow row = CheckNoFallback(s);
  EXPECT_EQ(row.status, CheckStatus::kInvalid);
  EXPECT_EQ(Verdict({row, {"exactness", CheckStatus::kPass, ""}}), "INVALID");
  s["fallback"] = false;  // ops listed alone still count
  EXPECT_EQ(CheckNoFallback(s).status, CheckStatus::kInvalid);
}

TEST(LabChecks, IdentityLock) {
  const json s = CudaState();
  EXPECT_EQ(CheckIdentity(s, "abc", std::nullopt, false).status, CheckStatus::kPass);
  EXPECT_EQ(CheckIdentity(s, "abc", IdentityLock{"abc", "c"}, false).status, CheckStatus::kPass);
  EXPECT_EQ(CheckIdentity(s, "abc", IdentityLock{"def", "c"}, false).status, CheckStatus::kInvalid);
  CheckRow accepted = CheckIdentity(s, "abc", IdentityLock{"def", "c"}, true);
  EXPECT_EQ(accepted.status, CheckStatus::kPass);
  EXPECT_NE(accepted.detail.find("accept-identity"), std::string::npos);
  // The server runs another binary than the one the lab hashed.
  EXPECT_EQ(CheckIdentity(s, "zzz", std::nullopt, false).status, CheckStatus::kInvalid);
}

TEST(LabChecks, VerdictOrder) {
  EXPECT_EQ(Verdict({{"a", CheckStatus::kPass, ""}, {"b", CheckStatus::kNotApplicable, ""}}),
            "PASS");
  EXPECT_EQ(Verdict({{"a", CheckStatus::kFail, ""}, {"b", CheckStatus::kPass, ""}}), "FAIL");
}

TEST(LabSuite, DefaultSuiteAndShippedFile) {
  auto s = ParseSuite(json::parse(DefaultSuiteJson()), "/x/default.json", "h");
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->prompts.size(), 15u);  // 13 + boundary + rollover
  EXPECT_EQ(s->screen_tokens, 128);
  EXPECT_EQ(s->suite_tokens, 512);
  EXPECT_EQ(s->Ms(), (std::vector<int>{128, 512}));
  EXPECT_EQ(s->checks, AllCheckNames());
  for (const auto& p : s->prompts) {
    for (int32_t id : p.token_ids) EXPECT_TRUE(id >= 1 && id < 500) << p.name;
  }
  auto shipped = ReadTextFile(std::string(DECODELAB_SOURCE_DIR) + "/suites/default.json");
  ASSERT_TRUE(shipped.ok());
  EXPECT_EQ(*shipped, DefaultSuiteJson()) << "suites/default.json is out of date";
}

TEST(LabSuite, RejectsBadSuites) {
  EXPECT_FALSE(ParseSuite(json::parse(R"({"format": "x", "prompts": []})"), "s", "h").ok());
  EXPECT_FALSE(
      ParseSuite(json::parse(R"({"format": "decodelab-lab-suite", "prompts": []})"), "s", "h")
          .ok());
  EXPECT_FALSE(ParseSuite(json::parse(R"({"format": "decodelab-lab-suite",
      "prompts": [{"name": "a", "token_ids": [1]}], "checks": ["speedy"]})"),
                          "s", "h")
                   .ok());
  auto ok = ParseSuite(json::parse(R"({"format": "decodelab-lab-suite", "calibration": "c.json",
      "prompts": [{"name": "a", "token_ids": [1]}]})"),
                       "/d/s.json", "h");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->calibration, "/d/c.json");
}

TEST(LabSuite, ComputedPromptLengths) {
  // Page 16, window 8: 15 tokens, so decode token 2 (position 16) opens page 1 with the ring
  // wrapped.
  EXPECT_EQ(RolloverPromptLength(16, 8), 15);
  // Page 16, window 512: 511, position 512 both opens a page and wraps the ring.
  EXPECT_EQ(RolloverPromptLength(16, 512), 511);
  EXPECT_EQ(RolloverPromptLength(16, 20), 31);
  EXPECT_EQ(BoundaryPromptLength(16), 32);
  auto ids = SyntheticPromptIds(64, 3, 100);
  EXPECT_EQ(ids.size(), 64u);
  for (int32_t id : ids) EXPECT_TRUE(id >= 1 && id < 100);
  EXPECT_EQ(ids, SyntheticPromptIds(64, 3, 100));
  EXPECT_NE(ids, SyntheticPromptIds(64, 4, 100));
}

TEST(LabSuite, TeacherRoundTrip) {
  Teacher t = MakeTeacher();
  auto back = ParseTeacher(t.ToJson(), "mem");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->topology, t.topology);
  ASSERT_EQ(back->prompts.size(), 2u);
  EXPECT_EQ(back->prompts[0].next, t.prompts[0].next);
  EXPECT_EQ(back->prompts[1].tokens, t.prompts[1].tokens);
}

TEST(LabLedger, RecordListAndCompare) {
  char tmpl[] = "/tmp/decodelab-ledger-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  auto add = [&](const std::string& id, const std::string& label, double conv, bool valid) {
    LedgerRun r;
    r.run_id = id;
    r.label = label;
    r.mode = "suite";
    r.verdict = valid ? "PASS" : "INVALID";
    r.valid = valid;
    r.exact = 3;
    r.prompts = 3;
    if (valid) r.conventional = conv, r.historical = conv - 1;
    ASSERT_TRUE(
        LedgerRecord(dir, r, {{"exactness", CheckStatus::kPass, "3/3"}}, {{"x", conv}}).ok());
  };
  add("ctl-1", "ctl", 100, true);
  add("ctl-2", "ctl", 104, true);
  add("cand-1", "cand", 110, true);
  add("cand-2", "cand", 112, true);
  add("bad-1", "bad", 0, false);
  auto all = LedgerList(dir);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 5u);
  auto ctl = LedgerSelect(dir, "ctl");
  auto cand = LedgerSelect(dir, "cand");
  ASSERT_TRUE(ctl.ok() && cand.ok());
  auto c = Compare("ctl", *ctl, "cand", *cand);
  ASSERT_TRUE(c.ok());
  // ctl median 102 spread 4; cand median 111 spread 2; difference 9 > 4.
  EXPECT_DOUBLE_EQ(c->median_a, 102);
  EXPECT_DOUBLE_EQ(c->median_b, 111);
  EXPECT_DOUBLE_EQ(c->spread_a, 4);
  EXPECT_TRUE(c->exceeds);
  auto one = LedgerSelect(dir, "ctl-1");
  ASSERT_TRUE(one.ok());
  auto c2 = Compare("ctl-1", *one, "ctl", *ctl);
  ASSERT_TRUE(c2.ok());
  EXPECT_FALSE(c2->exceeds);  // 2 tok/s difference within the 4 tok/s spread
  auto bad = LedgerSelect(dir, "bad");
  ASSERT_TRUE(bad.ok());
  EXPECT_FALSE(Compare("bad", *bad, "ctl", *ctl).ok());  // an invalid run has no speed
  EXPECT_FALSE(LedgerSelect(dir, "nope").ok());
  std::filesystem::remove_all(dir);
}

TEST(LabRunner, RunIdFormat) {
  EXPECT_EQ(MakeRunId("ctl", "abc123", 0), "ctl-abc123-19700101T000000Z");
  EXPECT_EQ(MakeRunId("a/b", "abc123+x (uncommitted)", 0), "a_b-abc123_x__uncommitted_-19700101T000000Z")
      << "a directory name a shell can take unquoted";
  EXPECT_EQ(MakeRunId("ctl", "", 0), "ctl-unknown-19700101T000000Z");
}

}  // namespace
}  // namespace dl::lab
