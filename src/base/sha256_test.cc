#include "base/sha256.h"

#include <cstdio>

#include <gtest/gtest.h>

namespace dl {
namespace {

TEST(Sha256Test, KnownVectors) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Sha256Test, FileMatchesBytes) {
  const std::string path = ::testing::TempDir() + "/sha_test.bin";
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fputs("abc", f);
  std::fclose(f);
  auto h = Sha256File(path);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(*h, Sha256Hex("abc"));
  EXPECT_FALSE(Sha256File(path + ".missing").ok());
}

}  // namespace
}  // namespace dl
