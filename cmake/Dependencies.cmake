# Every dependency comes from a Debian 12 package (see README). On the GPU machine they come from
# .deps/ (tools/device/bundle.sh) through CMAKE_PREFIX_PATH.
find_package(Threads REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(CLI11 REQUIRED)
find_package(OpenSSL REQUIRED COMPONENTS Crypto SSL)
find_package(OpenMP)
find_package(SQLite3 REQUIRED)
find_package(PkgConfig QUIET)

# PCRE2 (8-bit, with JIT) for the tokenizer's split regex. pkg-config where it exists; a plain library
# search otherwise (the GPU machine may lack pkg-config and gets the packages from .deps/).
if(PKG_CONFIG_FOUND)
  pkg_check_modules(PCRE2 QUIET IMPORTED_TARGET libpcre2-8)
endif()
if(NOT TARGET PkgConfig::PCRE2)
  find_path(PCRE2_INCLUDE_DIR pcre2.h REQUIRED)
  find_library(PCRE2_LIBRARY pcre2-8 REQUIRED)
  add_library(PkgConfig::PCRE2 INTERFACE IMPORTED)
  target_include_directories(PkgConfig::PCRE2 INTERFACE ${PCRE2_INCLUDE_DIR})
  target_link_libraries(PkgConfig::PCRE2 INTERFACE ${PCRE2_LIBRARY})
endif()

# Debian ships cpp-httplib compiled, with its feature defines in the pkg-config Cflags; consumers must
# use the same defines, so they are repeated here when pkg-config is unavailable.
if(PKG_CONFIG_FOUND)
  pkg_check_modules(HTTPLIB QUIET IMPORTED_TARGET cpp-httplib)
endif()
if(NOT TARGET PkgConfig::HTTPLIB)
  find_path(HTTPLIB_INCLUDE_DIR httplib.h REQUIRED)
  find_library(HTTPLIB_LIBRARY cpp-httplib)
  add_library(PkgConfig::HTTPLIB INTERFACE IMPORTED)
  target_include_directories(PkgConfig::HTTPLIB INTERFACE ${HTTPLIB_INCLUDE_DIR})
  if(HTTPLIB_LIBRARY)
    find_library(BROTLI_ENC brotlienc)
    find_library(BROTLI_DEC brotlidec)
    find_package(ZLIB)
    target_compile_definitions(PkgConfig::HTTPLIB INTERFACE CPPHTTPLIB_OPENSSL_SUPPORT
      CPPHTTPLIB_ZLIB_SUPPORT CPPHTTPLIB_BROTLI_SUPPORT)
    target_link_libraries(PkgConfig::HTTPLIB INTERFACE ${HTTPLIB_LIBRARY} OpenSSL::SSL OpenSSL::Crypto
      ${BROTLI_ENC} ${BROTLI_DEC} ZLIB::ZLIB Threads::Threads)
  endif()
endif()

if(DECODELAB_TESTS)
  find_package(GTest REQUIRED)
endif()
