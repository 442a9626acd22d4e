#include "base/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace dl {

namespace {

const char* KindOf(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

Result<std::string> ReadRegularFile(const std::string& path, size_t max_bytes) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) return NotFound("cannot open {}: {}", path, std::strerror(err));
    return InvalidArgument("cannot open {}: {}", path, std::strerror(err));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return DataLoss("cannot stat {}: {}", path, std::strerror(errno));
  if (!S_ISREG(st.st_mode)) {
    return InvalidArgument("{} is {}, not a regular file", path, KindOf(st.st_mode));
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return InvalidArgument("{} is {} bytes, more than the limit of {} bytes for this file", path,
                           static_cast<uint64_t>(st.st_size), max_bytes);
  }
  std::string out;
  out.resize(static_cast<size_t>(st.st_size));
  size_t got = 0;
  while (true) {
    // One byte of room beyond the limit tells a file that grew while we read it.
    if (got == out.size()) {
      if (out.size() > max_bytes) break;
      out.resize(std::min(max_bytes + 1, std::max<size_t>(out.size() * 2, 4096)));
    }
    const ssize_t n = ::read(fd, out.data() + got, out.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      return DataLoss("error reading {}: {}", path, std::strerror(errno));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  if (got > max_bytes) {
    return InvalidArgument("{} is more than the limit of {} bytes for this file", path, max_bytes);
  }
  out.resize(got);
  return out;
}

Result<nlohmann::json> ReadJsonFile(const std::string& path, size_t max_bytes) {
  DL_ASSIGN_OR_RETURN(std::string text, ReadRegularFile(path, max_bytes));
  try {
    return nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    return InvalidArgument("{}: not valid JSON: {}", path, e.what());
  }
}

}  // namespace dl
