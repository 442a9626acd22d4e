#include "model/hf_cache.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

namespace dl {
namespace {

namespace fs = std::filesystem;

class HfCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    hub_ = fs::temp_directory_path() / ("dl_hf_cache_" + std::to_string(::getpid()));
    fs::remove_all(hub_);
    repo_ = hub_ / "models--acme--laguna-tiny";
    // huggingface_hub's layout: files in blobs/, snapshots/<rev>/ holds symlinks to them.
    fs::create_directories(repo_ / "blobs");
    fs::create_directories(repo_ / "refs");
    for (const char* rev : {"1111", "2222"}) {
      fs::create_directories(repo_ / "snapshots" / rev);
      std::ofstream(repo_ / "blobs" / (std::string("cfg") + rev)) << "{}";
      fs::create_symlink(fs::path("../../blobs") / (std::string("cfg") + rev),
                         repo_ / "snapshots" / rev / "config.json");
    }
    std::ofstream(repo_ / "refs" / "main") << "2222";
  }
  void TearDown() override { fs::remove_all(hub_); }
  fs::path hub_, repo_;
};

TEST_F(HfCacheTest, RepoIdsAndCacheDirectoriesResolveToTheMainSnapshot) {
  const std::string want = (repo_ / "snapshots" / "2222").string();
  EXPECT_EQ(*ResolveModelDir("acme/laguna-tiny", hub_.string()), want);
  EXPECT_EQ(*ResolveModelDir(repo_.string(), hub_.string()), want);
  EXPECT_EQ(*ResolveModelDir(repo_.string(), ""), want) << "a cache directory needs no hub path";
  // A plain directory is itself, whatever the cache holds.
  EXPECT_EQ(*ResolveModelDir(want, ""), want);
  EXPECT_TRUE(fs::exists(fs::path(want) / "config.json"));
}

TEST_F(HfCacheTest, WithoutRefsOneSnapshotIsEnoughTwoAreAmbiguous) {
  fs::remove(repo_ / "refs" / "main");
  auto two = ResolveModelDir("acme/laguna-tiny", hub_.string());
  ASSERT_FALSE(two.ok());
  EXPECT_NE(two.status().message().find("1111, 2222"), std::string::npos) << two.status().message();
  fs::remove_all(repo_ / "snapshots" / "1111");
  EXPECT_EQ(*ResolveModelDir("acme/laguna-tiny", hub_.string()), (repo_ / "snapshots" / "2222").string());
}

TEST_F(HfCacheTest, MissingModelsAreClearErrorsWithoutDownloading) {
  auto r = ResolveModelDir("acme/other", hub_.string());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("models--acme--other"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("does not download"), std::string::npos);
  EXPECT_FALSE(ResolveModelDir("/no/such/dir", hub_.string()).ok());
  EXPECT_FALSE(ResolveModelDir("nodir", hub_.string()).ok());
  std::ofstream(repo_ / "refs" / "main", std::ios::trunc) << "3333";
  auto stale = ResolveModelDir("acme/laguna-tiny", hub_.string());
  ASSERT_FALSE(stale.ok());
  EXPECT_NE(stale.status().message().find("3333"), std::string::npos);
}

}  // namespace
}  // namespace dl
