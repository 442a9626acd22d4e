#include "model/safetensors.h"

#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace dl {
namespace {

std::string Build(const std::string& header_json, size_t data_bytes) {
  std::string s(8, '\0');
  const uint64_t n = header_json.size();
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  s += header_json;
  for (size_t i = 0; i < data_bytes; ++i) s.push_back(static_cast<char>(i * 7 + 1));
  return s;
}

Result<std::vector<SafetensorsEntry>> Parse(const std::string& bytes) {
  return ParseSafetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "f.safetensors");
}

TEST(SafetensorsTest, PlanRoundTrip) {
  std::vector<SafetensorsEntry> e = {{"a", DType::kBF16, {2, 3}}, {"b", DType::kF32, {4}},
                                     {"c", DType::kF8E4M3, {3}}, {"d", DType::kF16, {}}};
  SafetensorsPlan plan = PlanSafetensors(e);
  EXPECT_EQ(plan.prefix.size() % 8, 0u);
  EXPECT_EQ(plan.data_size, 12u + 16u + 3u + 2u);
  std::string bytes = plan.prefix;
  for (uint64_t i = 0; i < plan.data_size; ++i) bytes.push_back(static_cast<char>(i));
  std::map<std::string, std::string> md;
  auto r = ParseSafetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "x", &md);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_EQ(r->size(), 4u);
  EXPECT_EQ(md["format"], "pt");
  EXPECT_EQ((*r)[1].name, "b");
  EXPECT_EQ((*r)[1].dtype, DType::kF32);
  EXPECT_EQ((*r)[1].begin, 12u);
  EXPECT_EQ((*r)[1].data[0], 12);  // points at its own bytes
  EXPECT_EQ((*r)[3].shape.size(), 0u);
  EXPECT_EQ((*r)[3].numel(), 1);
}

TEST(SafetensorsTest, CorruptFilesGiveClearErrors) {
  const std::string ok_header = R"({"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}})";
  ASSERT_TRUE(Parse(Build(ok_header, 8)).ok());
  struct Case {
    std::string bytes, needle;
  };
  std::string past_end = Build(ok_header, 8);
  past_end[0] = static_cast<char>(0xff);  // header length past the end
  std::vector<Case> cases = {
      {"abc", "too short"},
      {past_end, "runs past the end"},
      {Build(ok_header, 4), "'w'"},                               // truncated data
      {Build(R"({"w":{"dtype":"BF16",)", 0), "not valid JSON"},   // bad JSON
      {Build(R"([1,2])", 0), "not a JSON object"},
      {Build(R"({"w":{"dtype":"Q4","shape":[2],"data_offsets":[0,2]}})", 2), "unsupported dtype 'Q4'"},
      {Build(R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}})", 4), "needs 6"},
      {Build(R"({"w":{"dtype":"BF16","shape":[-1],"data_offsets":[0,4]}})", 4), "bad shape"},
      {Build(R"({"w":{"dtype":"BF16","shape":[2],"data_offsets":[4,0]}})", 4), "reversed"},
      {Build(R"({"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"v":{"dtype":"BF16","shape":[2],"data_offsets":[2,6]}})",
             8),
       "overlap"},
      {Build(R"({"w":{"dtype":"BF16","shape":[4000000000,4000000000,4000000000],"data_offsets":[0,4]}})", 4),
       "overflows"},
  };
  for (const auto& c : cases) {
    auto r = Parse(c.bytes);
    ASSERT_FALSE(r.ok()) << c.needle;
    EXPECT_NE(r.status().message().find(c.needle), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("f.safetensors"), std::string::npos) << r.status().message();
  }
}

TEST(SafetensorsTest, OpenMissingFile) {
  auto r = SafetensorsFile::Open("/nonexistent/model.safetensors");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("/nonexistent/model.safetensors"), std::string::npos);
}

}  // namespace
}  // namespace dl
