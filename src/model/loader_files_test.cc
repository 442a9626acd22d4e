// Model files are input too: config.json, the shard index and the shards must be regular files of
// bounded size, so a path that names /dev/zero or a FIFO is a clear error, not a hang or an OOM.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "base/mapped_file.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/model_writer.h"
#include "model/shapes.h"

namespace dl {
namespace {

namespace fs = std::filesystem;

class LoaderFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/decodelab-loader-files-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  static double Seconds(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  std::string dir_;
};

TEST_F(LoaderFilesTest, ConfigThatIsADeviceOrFifoIsAClearError) {
  fs::create_symlink("/dev/zero", dir_ + "/zero.json");
  auto t0 = std::chrono::steady_clock::now();
  auto zero = ModelConfig::FromFile(dir_ + "/zero.json");
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.status().message().find("not a regular file"), std::string::npos)
      << zero.status().message();
  ASSERT_EQ(mkfifo((dir_ + "/fifo.json").c_str(), 0600), 0);
  auto fifo = ModelConfig::FromFile(dir_ + "/fifo.json");
  ASSERT_FALSE(fifo.ok());
  EXPECT_NE(fifo.status().message().find("FIFO"), std::string::npos) << fifo.status().message();
  EXPECT_LT(Seconds(t0), 2.0);
}

TEST_F(LoaderFilesTest, CheckpointIndexAndShardsMustBeRegularFiles) {
  auto cfg = ShapeConfig("tiny");
  ASSERT_TRUE(cfg.ok());
  MakeModelOptions o;
  o.config = *cfg;
  o.seed = 3;
  o.out_dir = dir_ + "/m";
  ASSERT_TRUE(WriteSyntheticModel(o).ok());
  ASSERT_TRUE(Checkpoint::Open(o.out_dir).ok());
  // The single shard replaced by a FIFO: refused without blocking.
  fs::remove(o.out_dir + "/model.safetensors");
  ASSERT_EQ(mkfifo((o.out_dir + "/model.safetensors").c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto shard = Checkpoint::Open(o.out_dir);
  ASSERT_FALSE(shard.ok());
  EXPECT_NE(shard.status().message().find("regular file"), std::string::npos)
      << shard.status().message();
  // An index that is /dev/zero.
  fs::remove(o.out_dir + "/model.safetensors");
  fs::create_symlink("/dev/zero", o.out_dir + "/model.safetensors.index.json");
  auto index = Checkpoint::Open(o.out_dir);
  ASSERT_FALSE(index.ok());
  EXPECT_NE(index.status().message().find("not a regular file"), std::string::npos)
      << index.status().message();
  EXPECT_LT(Seconds(t0), 2.0);
  auto mapped = MappedFile::Open("/dev/zero");
  EXPECT_FALSE(mapped.ok());
}

}  // namespace
}  // namespace dl
