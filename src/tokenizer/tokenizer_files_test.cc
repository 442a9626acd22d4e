// tokenizer.json is input: a path naming /dev/zero or a FIFO is a clear error, not unbounded memory
// or a hang.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>

#include <gtest/gtest.h>

#include "tokenizer/tokenizer.h"

namespace dl {
namespace {

namespace fs = std::filesystem;

TEST(TokenizerFilesTest, DeviceOrFifoTokenizerJsonIsAClearError) {
  char tmpl[] = "/tmp/decodelab-tokenizer-files-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const auto t0 = std::chrono::steady_clock::now();
  fs::create_symlink("/dev/zero", dir + "/tokenizer.json");
  auto zero = Tokenizer::FromFile(dir);
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.status().message().find("not a regular file"), std::string::npos)
      << zero.status().message();
  fs::remove(dir + "/tokenizer.json");
  ASSERT_EQ(mkfifo((dir + "/tokenizer.json").c_str(), 0600), 0);
  auto fifo = Tokenizer::FromFile(dir);
  ASSERT_FALSE(fifo.ok());
  EXPECT_NE(fifo.status().message().find("FIFO"), std::string::npos) << fifo.status().message();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
}  // namespace dl
