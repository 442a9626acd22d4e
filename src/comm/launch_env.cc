#include "comm/launch_env.h"

#include <cerrno>
#include <cstdlib>

namespace dl::comm {

EnvLookup ProcessEnv() {
  return [](const char* name) -> const char* { return std::getenv(name); };
}

std::string Endpoint::ToString() const {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

Result<long long> ParseInteger(std::string_view text, std::string_view what) {
  std::string s(text);
  if (s.empty()) return InvalidArgument("{} is empty", what);
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end == s.c_str() || *end != '\0') {
    return InvalidArgument("{} is not an integer: '{}'", what, s);
  }
  return v;
}

namespace {

struct RankVars {
  const char* source;
  const char* rank;
  const char* size;
};

constexpr RankVars kRankVars[] = {
    {"DL", "DL_RANK", "DL_WORLD_SIZE"},
    {"OMPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
    {"PMI", "PMI_RANK", "PMI_SIZE"},
    {"SLURM", "SLURM_PROCID", "SLURM_NTASKS"},
};

constexpr const char* kLocalRankVars[] = {"DL_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                                          "MPI_LOCALRANKID", "SLURM_LOCALID"};

}  // namespace

Result<std::optional<LaunchEnv>> ReadLaunchEnv(const EnvLookup& env) {
  for (const RankVars& vars : kRankVars) {
    const char* rank = env(vars.rank);
    if (rank == nullptr) continue;
    const char* size = env(vars.size);
    if (size == nullptr) {
      return InvalidArgument("{} is set but {} is not", vars.rank, vars.size);
    }
    DL_ASSIGN_OR_RETURN(long long r, ParseInteger(rank, vars.rank));
    DL_ASSIGN_OR_RETURN(long long n, ParseInteger(size, vars.size));
    if (n < 1 || r < 0 || r >= n) {
      return InvalidArgument("{}={} is outside [0, {}={})", vars.rank, r, vars.size, n);
    }
    LaunchEnv out;
    out.rank = static_cast<int>(r);
    out.world_size = static_cast<int>(n);
    out.source = vars.source;
    for (const char* name : kLocalRankVars) {
      const char* local = env(name);
      if (local == nullptr) continue;
      DL_ASSIGN_OR_RETURN(long long lr, ParseInteger(local, name));
      if (lr < 0) return InvalidArgument("{}={} is negative", name, lr);
      out.local_rank = static_cast<int>(lr);
      break;
    }
    return std::optional<LaunchEnv>(out);
  }
  return std::optional<LaunchEnv>();
}

Result<Endpoint> ParseEndpoint(std::string_view text) {
  std::string_view host, port;
  if (!text.empty() && text.front() == '[') {
    size_t close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return InvalidArgument("rendezvous endpoint '{}' is not [ipv6]:port", text);
    }
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    size_t colon = text.rfind(':');
    if (colon == std::string_view::npos) {
      return InvalidArgument("rendezvous endpoint '{}' is not host:port", text);
    }
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  if (host.empty()) return InvalidArgument("rendezvous endpoint '{}' has no host", text);
  DL_ASSIGN_OR_RETURN(long long p, ParseInteger(port, fmt::format("port of '{}'", text)));
  if (p < 0 || p > 65535) return InvalidArgument("port {} of '{}' is outside [0, 65535]", p, text);
  return Endpoint{std::string(host), static_cast<int>(p)};
}

Result<std::optional<Endpoint>> MasterEndpointFromEnv(const EnvLookup& env) {
  const char* addr_names[] = {"DL_MASTER_ADDR", "MASTER_ADDR"};
  const char* port_names[] = {"DL_MASTER_PORT", "MASTER_PORT"};
  for (int i = 0; i < 2; ++i) {
    const char* addr = env(addr_names[i]);
    if (addr == nullptr || *addr == '\0') continue;
    Endpoint ep{addr, kDefaultRendezvousPort};
    const char* port = env(port_names[i]);
    if (port != nullptr && *port != '\0') {
      DL_ASSIGN_OR_RETURN(long long p, ParseInteger(port, port_names[i]));
      if (p < 1 || p > 65535)
        return InvalidArgument("{}={} is outside [1, 65535]", port_names[i], p);
      ep.port = static_cast<int>(p);
    }
    return std::optional<Endpoint>(ep);
  }
  return std::optional<Endpoint>();
}

}  // namespace dl::comm
