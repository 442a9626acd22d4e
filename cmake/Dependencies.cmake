# Every dependency comes from a Debian 12 package (see README). On the GPU machine they come from
# .deps/ (tools/device/bundle.sh) through CMAKE_PREFIX_PATH.
find_package(Threads REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(CLI11 REQUIRED)
find_package(OpenSSL REQUIRED COMPONENTS Crypto)
find_package(SQLite3 REQUIRED)
find_package(PkgConfig REQUIRED)

# PCRE2 (8-bit, with JIT) for the tokenizer's split regex: pkg-config only.
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)

# Debian ships cpp-httplib compiled, with its feature defines in the pkg-config Cflags; consumers must
# use the same defines, so take them from pkg-config rather than the header-only form.
pkg_check_modules(HTTPLIB IMPORTED_TARGET cpp-httplib)
if(NOT HTTPLIB_FOUND)
  find_path(HTTPLIB_INCLUDE_DIR httplib.h REQUIRED)
  add_library(dl_httplib INTERFACE)
  target_include_directories(dl_httplib INTERFACE ${HTTPLIB_INCLUDE_DIR})
  add_library(PkgConfig::HTTPLIB ALIAS dl_httplib)
endif()

if(DECODELAB_TESTS)
  find_package(GTest REQUIRED)
endif()
