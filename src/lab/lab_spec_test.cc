#include "lab/lab_spec.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace dl::lab {
namespace {

// The text decodelab's /metrics writes with --spec on (src/server/server.cc MetricsText).
constexpr const char* kDecodelab =
    R"(# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="tiny"} 0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{model_name="tiny"} 10
vllm:spec_decode_num_draft_tokens_total{model_name="tiny"} 40
vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"} 18
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"} 8
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="1"} 5
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="2"} 3
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="3"} 2
decodelab:spec_decode_mean_acceptance_length{model_name="tiny"} 2.8
)";

TEST(LabSpec, ParsesDecodelabMetrics) {
  const SpecCounters c = ParseSpecCounters(kDecodelab);
  EXPECT_TRUE(c.present);
  EXPECT_EQ(c.num_drafts, 10);
  EXPECT_EQ(c.num_draft_tokens, 40);
  EXPECT_EQ(c.num_accepted_tokens, 18);
  EXPECT_EQ(c.accepted_per_pos, (std::vector<double>{8, 5, 3, 2}));
}

TEST(LabSpec, SumsLabelSetsAndReadsVllmStyleLines) {
  // Two engines, labels in another order, a quoted comma and brace and escaped quote inside a label
  // value, a timestamp, CRLF line ends, and the family name without _total.
  const std::string text =
      "vllm:spec_decode_num_drafts_total{engine=\"0\",model_name=\"a,b}\\\"c\"} 3 1700000000\r\n"
      "vllm:spec_decode_num_drafts_total{engine=\"1\",model_name=\"m\"} 4\r\n"
      "vllm:spec_decode_num_draft_tokens{engine=\"0\"} 9\n"
      "vllm:spec_decode_num_accepted_tokens_per_pos_total{position=\"1\",engine=\"0\"} 2\n"
      "vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=\"1\",position=\"1\"} 1\n"
      "vllm:spec_decode_num_accepted_tokens_per_pos_total{position=\"x\"} 100\n"
      "vllm:spec_decode_num_accepted_tokens_total{engine=\"0\"} not-a-number\n";
  const SpecCounters c = ParseSpecCounters(text);
  EXPECT_TRUE(c.present);
  EXPECT_EQ(c.num_drafts, 7);
  EXPECT_EQ(c.num_draft_tokens, 9);
  EXPECT_EQ(c.num_accepted_tokens, 0);
  EXPECT_EQ(c.accepted_per_pos, (std::vector<double>{0, 3}));
}

TEST(LabSpec, WithoutSpeculationNothingIsPresent) {
  const SpecCounters c = ParseSpecCounters("vllm:num_requests_running{model_name=\"tiny\"} 0\n");
  EXPECT_FALSE(c.present);
  EXPECT_FALSE(SpecDifference(c, c).enabled);
}

TEST(LabSpec, DifferenceAndDerivedRatesAreVllms) {
  SpecCounters before = ParseSpecCounters(kDecodelab);
  SpecCounters after = before;
  after.num_drafts += 12;        // 12 verifies with drafts
  after.num_draft_tokens += 48;  // K = 4
  after.num_accepted_tokens += 24;
  after.accepted_per_pos = {8 + 12, 5 + 8, 3 + 4, 2 + 0};  // 12 + 8 + 4 + 0 = 24
  const SpecDelta d = SpecDifference(before, after);
  ASSERT_TRUE(d.enabled);
  EXPECT_EQ(d.num_drafts, 12);
  EXPECT_EQ(d.num_draft_tokens, 48);
  EXPECT_EQ(d.num_accepted_tokens, 24);
  EXPECT_DOUBLE_EQ(d.mean_acceptance_length(), 1 + 24.0 / 12);
  EXPECT_DOUBLE_EQ(d.acceptance_rate(), 0.5);
  EXPECT_EQ(d.per_position_acceptance_rate(), (std::vector<double>{1.0, 8.0 / 12, 4.0 / 12, 0.0}));
  const auto bs = d.ToBenchServeJson();
  EXPECT_DOUBLE_EQ(bs["spec_decode_acceptance_rate"].get<double>(), 50.0);
  EXPECT_DOUBLE_EQ(bs["spec_decode_acceptance_length"].get<double>(), 3.0);
  EXPECT_EQ(bs["spec_decode_num_drafts"], 12);
  EXPECT_EQ(bs["spec_decode_draft_tokens"], 48);
  EXPECT_EQ(bs["spec_decode_accepted_tokens"], 24);
  EXPECT_EQ(bs["spec_decode_per_position_acceptance_rates"].size(), 4u);
  const auto cj = d.ToCountersJson();
  EXPECT_EQ(cj["vllm:spec_decode_num_accepted_tokens_per_pos_total"],
            nlohmann::json({12, 8, 4, 0}));
  EXPECT_DOUBLE_EQ(cj["mean_acceptance_length"].get<double>(), 3.0);
  const std::string block = FormatSpecBlock(bs);
  EXPECT_NE(block.find(fmt::format("{:<40}3.00\n", "Acceptance length:")), std::string::npos)
      << block;
  EXPECT_NE(block.find(fmt::format("{:<40}66.67\n", "  Position 1:")), std::string::npos) << block;
}

TEST(LabSpec, NoDraftsGiveNullRatesNotZeros) {
  const SpecCounters c = ParseSpecCounters(kDecodelab);
  const SpecDelta d = SpecDifference(c, c);
  ASSERT_TRUE(d.enabled);
  EXPECT_TRUE(d.ToBenchServeJson()["spec_decode_acceptance_length"].is_null());
  EXPECT_TRUE(d.ToCountersJson()["mean_acceptance_length"].is_null());
  EXPECT_EQ(d.ToCountersJson()["vllm:spec_decode_num_drafts_total"], 0);
  EXPECT_NE(
      FormatSpecBlock(d.ToBenchServeJson()).find(fmt::format("{:<40}-\n", "Acceptance length:")),
      std::string::npos);
  EXPECT_EQ(FormatSpecBlock(nlohmann::json{{"completed", 3}}), "") << "no speculation, no block";
}

TEST(LabSpec, AResetCounterCountsFromZero) {
  SpecCounters before = ParseSpecCounters(kDecodelab);
  SpecCounters after = before;
  after.num_drafts = 3;  // the server restarted: the counters began again
  EXPECT_EQ(SpecDifference(before, after).num_drafts, 3);
}

}  // namespace
}  // namespace dl::lab
