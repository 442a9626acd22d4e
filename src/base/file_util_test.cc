#include "base/file_util.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

namespace dl {
namespace {

namespace fs = std::filesystem;

class FileUtilTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/decodelab-file-util-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string dir_;
};

TEST_F(FileUtilTest, ReadsRegularFilesWithinTheLimit) {
  const std::string p = dir_ + "/a.json";
  std::ofstream(p) << "{\"x\": 1}";
  auto r = ReadRegularFile(p, 100);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(*r, "{\"x\": 1}");
  // Files whose size stat reports as 0 are still read to their end.
  auto proc = ReadRegularFile("/proc/self/status", 1 << 20);
  ASSERT_TRUE(proc.ok()) << proc.status().message();
  EXPECT_NE(proc->find("VmRSS"), std::string::npos);
}

TEST_F(FileUtilTest, ReadJsonFileParsesOrNamesThePath) {
  const std::string good = dir_ + "/good.json", bad = dir_ + "/bad.json";
  std::ofstream(good) << "{\"x\": [1, 2]}";
  std::ofstream(bad) << "{\"x\": ";
  auto j = ReadJsonFile(good, 100);
  ASSERT_TRUE(j.ok()) << j.status().message();
  EXPECT_EQ((*j)["x"][1], 2);
  auto broken = ReadJsonFile(bad, 100);
  EXPECT_EQ(broken.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(broken.status().message().find(bad + ": not valid JSON"), std::string::npos) << broken.status().message();
  // The bounds of ReadRegularFile hold: a FIFO (a generation_config.json used to be read without any).
  ASSERT_EQ(mkfifo((dir_ + "/fifo.json").c_str(), 0600), 0);
  EXPECT_EQ(ReadJsonFile(dir_ + "/fifo.json", 100).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadJsonFile(dir_ + "/nope.json", 100).status().code(), StatusCode::kNotFound);
}

TEST_F(FileUtilTest, RefusesDevicesFifosDirectoriesAndLargeFiles) {
  auto missing = ReadRegularFile(dir_ + "/nope.json", 100);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);

  // /dev/zero used to grow memory without end; through a symlink named like a config file too.
  fs::create_symlink("/dev/zero", dir_ + "/config.json");
  auto zero = ReadRegularFile(dir_ + "/config.json", 1 << 20);
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(zero.status().message().find("character device"), std::string::npos)
      << zero.status().message();

  // A FIFO with no writer used to block the open forever.
  ASSERT_EQ(mkfifo((dir_ + "/fifo.json").c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto fifo = ReadRegularFile(dir_ + "/fifo.json", 1 << 20);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
  ASSERT_FALSE(fifo.ok());
  EXPECT_NE(fifo.status().message().find("FIFO"), std::string::npos) << fifo.status().message();

  auto d = ReadRegularFile(dir_, 100);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("directory"), std::string::npos);

  std::ofstream(dir_ + "/big.json") << std::string(101, 'x');
  auto big = ReadRegularFile(dir_ + "/big.json", 100);
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.status().message().find("100"), std::string::npos) << big.status().message();
}

}  // namespace
}  // namespace dl
