// Where a rank learns who it is: the launcher's environment (mpirun, PMI, Slurm, or our own
// supervisor's DL_* variables) and the rendezvous endpoint (rank 0's address and port).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "base/status.h"

namespace dl::comm {

// getenv by default; tests pass a map lookup.
using EnvLookup = std::function<const char*(const char*)>;
EnvLookup ProcessEnv();

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = -1;  // -1: the launcher did not say
  std::string source;   // "DL", "OMPI", "PMI", "SLURM": which variables were read
};

// The rank and world size a launcher set, checked in this order: DL_RANK/DL_WORLD_SIZE,
// OMPI_COMM_WORLD_RANK/SIZE (Open MPI), PMI_RANK/PMI_SIZE (MPICH, Intel MPI), SLURM_PROCID/
// SLURM_NTASKS (srun). The local rank comes from DL_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK,
// MPI_LOCALRANKID or SLURM_LOCALID. nullopt when no launcher variables are set; an error when they
// are set but malformed or inconsistent (rank outside [0, size)).
Result<std::optional<LaunchEnv>> ReadLaunchEnv(const EnvLookup& env = ProcessEnv());

struct Endpoint {
  std::string host;
  int port = 0;
  std::string ToString() const;
};

// "host:port", "1.2.3.4:29500" or "[::1]:29500".
Result<Endpoint> ParseEndpoint(std::string_view text);

// Rank 0's rendezvous endpoint from DL_MASTER_ADDR/DL_MASTER_PORT, else MASTER_ADDR/MASTER_PORT
// (the torchrun names, often already exported by cluster scripts). nullopt when neither address is
// set; the port defaults to kDefaultRendezvousPort.
inline constexpr int kDefaultRendezvousPort = 29517;
Result<std::optional<Endpoint>> MasterEndpointFromEnv(const EnvLookup& env = ProcessEnv());

// Parses a whole decimal integer; `what` names the value in the error.
Result<long long> ParseInteger(std::string_view text, std::string_view what);

}  // namespace dl::comm
