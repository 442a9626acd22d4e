#include "base/dynamic_library.h"

#include <gtest/gtest.h>

namespace dl {
namespace {

TEST(DynamicLibraryTest, OpensTheFirstThatLoadsAndListsEveryFailure) {
  auto none = OpenFirstLibrary({"/nonexistent/libnope.so", "libdecodelab-missing.so.9"});
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kUnavailable);
  const std::string& m = none.status().message();
  EXPECT_EQ(m.rfind("Tried:", 0), 0u) << m;
  EXPECT_NE(m.find("\n  /nonexistent/libnope.so: "), std::string::npos) << m;
  EXPECT_NE(m.find("\n  libdecodelab-missing.so.9: "), std::string::npos) << m;

  auto libc = OpenFirstLibrary({"libdecodelab-missing.so.9", "libc.so.6"});
  ASSERT_TRUE(libc.ok()) << libc.status().message();
  EXPECT_EQ(libc->path, "libc.so.6");
  using StrlenFn = size_t (*)(const char*);
  StrlenFn len = nullptr, absent = nullptr;
  std::string missing;
  ResolveSymbol(libc->handle, len, "strlen", true, &missing);
  ResolveSymbol(libc->handle, absent, "decodelab_no_such_symbol", false, &missing);
  EXPECT_EQ(missing, "") << "an optional symbol is not reported";
  ResolveSymbol(libc->handle, absent, "decodelab_no_such_symbol", true, &missing);
  EXPECT_EQ(missing, " decodelab_no_such_symbol");
  ASSERT_NE(len, nullptr);
  EXPECT_EQ(len("abc"), 3u);
  EXPECT_EQ(absent, nullptr);
}

}  // namespace
}  // namespace dl
