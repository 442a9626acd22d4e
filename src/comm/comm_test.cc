#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include <gtest/gtest.h>

#include "comm/launch_env.h"
#include "comm/nccl_api.h"
#include "comm/process.h"
#include "comm/tcp_group.h"

namespace dl::comm {
namespace {

EnvLookup MapEnv(const std::map<std::string, std::string>& m) {
  return [m](const char* name) -> const char* {
    auto it = m.find(name);
    return it == m.end() ? nullptr : it->second.c_str();
  };
}

TEST(LaunchEnv, NoneWhenNoLauncher) {
  auto r = ReadLaunchEnv(MapEnv({}));
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->has_value());
}

TEST(LaunchEnv, ReadsOpenMpi) {
  auto r = ReadLaunchEnv(MapEnv({{"OMPI_COMM_WORLD_RANK", "5"},
                                 {"OMPI_COMM_WORLD_SIZE", "16"},
                                 {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}}));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->has_value());
  EXPECT_EQ((*r)->rank, 5);
  EXPECT_EQ((*r)->world_size, 16);
  EXPECT_EQ((*r)->local_rank, 1);
  EXPECT_EQ((*r)->source, "OMPI");
}

TEST(LaunchEnv, ReadsPmiAndSlurmWithPrecedence) {
  auto pmi =
      ReadLaunchEnv(MapEnv({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "3"}}));
  ASSERT_TRUE(pmi.ok());
  EXPECT_EQ((*pmi)->source, "PMI");
  EXPECT_EQ((*pmi)->local_rank, 3);
  auto slurm =
      ReadLaunchEnv(MapEnv({{"SLURM_PROCID", "7"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "3"}}));
  ASSERT_TRUE(slurm.ok());
  EXPECT_EQ((*slurm)->rank, 7);
  EXPECT_EQ((*slurm)->local_rank, 3);
  EXPECT_EQ((*slurm)->source, "SLURM");
  // mpirun inside a Slurm allocation: the MPI variables describe the processes we are.
  auto both = ReadLaunchEnv(MapEnv({{"SLURM_PROCID", "0"},
                                    {"SLURM_NTASKS", "1"},
                                    {"OMPI_COMM_WORLD_RANK", "2"},
                                    {"OMPI_COMM_WORLD_SIZE", "4"}}));
  ASSERT_TRUE(both.ok());
  EXPECT_EQ((*both)->rank, 2);
  EXPECT_EQ((*both)->world_size, 4);
}

TEST(LaunchEnv, RejectsInconsistentValues) {
  EXPECT_FALSE(ReadLaunchEnv(MapEnv({{"PMI_RANK", "4"}, {"PMI_SIZE", "4"}})).ok());
  EXPECT_FALSE(ReadLaunchEnv(MapEnv({{"PMI_RANK", "x"}, {"PMI_SIZE", "4"}})).ok());
  auto r = ReadLaunchEnv(MapEnv({{"SLURM_PROCID", "1"}}));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("SLURM_NTASKS"), std::string::npos);
}

TEST(Endpoint, Parses) {
  auto a = ParseEndpoint("node-01.cluster:29500");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->host, "node-01.cluster");
  EXPECT_EQ(a->port, 29500);
  auto b = ParseEndpoint("[fe80::1]:7");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->host, "fe80::1");
  EXPECT_EQ(b->ToString(), "[fe80::1]:7");
  EXPECT_FALSE(ParseEndpoint("nohost").ok());
  EXPECT_FALSE(ParseEndpoint(":80").ok());
  EXPECT_FALSE(ParseEndpoint("h:99999").ok());
  EXPECT_FALSE(ParseEndpoint("h:12x").ok());
}

TEST(Endpoint, MasterFromEnv) {
  auto none = MasterEndpointFromEnv(MapEnv({}));
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  auto torch = MasterEndpointFromEnv(MapEnv({{"MASTER_ADDR", "10.0.0.1"}}));
  ASSERT_TRUE(torch.ok());
  EXPECT_EQ((*torch)->port, kDefaultRendezvousPort);
  auto ours = MasterEndpointFromEnv(MapEnv({{"MASTER_ADDR", "10.0.0.1"},
                                            {"MASTER_PORT", "1"},
                                            {"DL_MASTER_ADDR", "10.0.0.2"},
                                            {"DL_MASTER_PORT", "29600"}}));
  ASSERT_TRUE(ours.ok());
  EXPECT_EQ((*ours)->host, "10.0.0.2");
  EXPECT_EQ((*ours)->port, 29600);
  EXPECT_FALSE(MasterEndpointFromEnv(MapEnv({{"MASTER_ADDR", "a"}, {"MASTER_PORT", "0"}})).ok());
}

// Three ranks in threads: broadcast and an exact float sum of small integers.
TEST(TcpGroup, BroadcastAndAllReduce) {
  auto l = Listen("127.0.0.1", 0);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  const int n = 3;
  const size_t count = 1000;
  std::vector<std::string> errors(n);
  std::vector<std::vector<float>> results(n);
  std::vector<std::string> ids(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      Deadline d = DeadlineIn(10);
      auto g = TcpGroup::Create(r, n, r == 0 ? l->fd : -1, Endpoint{"127.0.0.1", l->port}, d);
      if (!g.ok()) {
        errors[r] = g.status().ToString();
        return;
      }
      char id[16] = {0};
      if (r == 0) std::snprintf(id, sizeof(id), "unique-id-42");
      Status st = (*g)->Broadcast(id, sizeof(id), d);
      ids[r] = id;
      std::vector<float> v(count);
      for (size_t i = 0; i < count; ++i) v[i] = static_cast<float>((r + 1) * (1 + i % 7));
      if (st.ok()) st = (*g)->AllReduceSum(v, d);
      if (st.ok()) st = (*g)->Barrier(d);
      if (!st.ok()) errors[r] = st.ToString();
      results[r] = v;
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(ids[r], "unique-id-42");
    ASSERT_EQ(results[r].size(), count);
    for (size_t i = 0; i < count; ++i) {
      // (1 + 2 + 3) * (1 + i % 7)
      ASSERT_EQ(results[r][i], static_cast<float>(6 * (1 + i % 7))) << "rank " << r << " i " << i;
    }
  }
}

// Messages of any length both ways; an oversized one is refused unread; a closed peer is named.
TEST(TcpGroup, MessagesOfAnyLengthAndAClosedPeer) {
  auto l = Listen("127.0.0.1", 0);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  Status peer_status;
  std::vector<std::byte> peer_got;
  std::thread peer([&] {
    auto g = TcpGroup::Create(1, 2, -1, Endpoint{"127.0.0.1", l->port}, DeadlineIn(10));
    if (!g.ok()) {
      peer_status = g.status();
      return;
    }
    auto m = (*g)->ReceiveMessage(0, 1 << 20, DeadlineIn(10));
    if (!m.ok()) {
      peer_status = m.status();
      return;
    }
    peer_got = *m;
    std::vector<std::byte> reply(3, std::byte{7});
    peer_status = (*g)->SendMessage(0, reply, DeadlineIn(10));
    if (peer_status.ok()) peer_status = (*g)->SendMessage(0, std::vector<std::byte>(100), DeadlineIn(10));
    // Then the peer goes away (its group closes the socket).
  });
  auto g = TcpGroup::Create(0, 2, l->fd, Endpoint{"127.0.0.1", l->port}, DeadlineIn(10));
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  std::vector<std::byte> big(100000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<std::byte>(i * 31);
  ASSERT_TRUE((*g)->SendMessage(1, big, DeadlineIn(10)).ok());
  auto reply = (*g)->ReceiveMessage(1, 16, DeadlineIn(10));
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  EXPECT_EQ(*reply, std::vector<std::byte>(3, std::byte{7}));
  auto oversized = (*g)->ReceiveMessage(1, 16, DeadlineIn(10));
  ASSERT_FALSE(oversized.ok());
  EXPECT_NE(oversized.status().message().find("above the limit of 16"), std::string::npos)
      << oversized.status().message();
  peer.join();
  ASSERT_TRUE(peer_status.ok()) << peer_status.ToString();
  EXPECT_EQ(peer_got, big);
  EXPECT_FALSE((*g)->SendMessage(2, big, DeadlineIn(1)).ok());  // no rank 2
}

TEST(TcpGroup, ReceiveMessageNamesAPeerThatClosed) {
  auto l = Listen("127.0.0.1", 0);
  ASSERT_TRUE(l.ok());
  std::thread peer([&] { (void)TcpGroup::Create(1, 2, -1, Endpoint{"127.0.0.1", l->port}, DeadlineIn(10)); });
  auto g = TcpGroup::Create(0, 2, l->fd, Endpoint{"127.0.0.1", l->port}, DeadlineIn(10));
  peer.join();  // its group is gone: the connection is closed
  ASSERT_TRUE(g.ok());
  auto m = (*g)->ReceiveMessage(1, 16, DeadlineIn(10));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(m.status().message().find("rank 0 waiting for a message from rank 1: the peer closed the connection"),
            std::string::npos)
      << m.status().message();
}

TEST(TcpGroup, RootTimesOutNamingMissingRank) {
  auto l = Listen("127.0.0.1", 0);
  ASSERT_TRUE(l.ok());
  auto t0 = std::chrono::steady_clock::now();
  auto g = TcpGroup::Create(0, 3, l->fd, Endpoint{"127.0.0.1", l->port}, DeadlineIn(0.3));
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(g.status().message().find("not connected: 1,2"), std::string::npos)
      << g.status().message();
  EXPECT_LT(s, 5.0);
}

// Connected is not joined: rank 1 must not report a complete group while rank 2 never came.
TEST(TcpGroup, PeerWaitsForTheWholeGroup) {
  auto l = Listen("127.0.0.1", 0);
  ASSERT_TRUE(l.ok());
  Status root_status;
  std::thread root([&] {
    root_status =
        TcpGroup::Create(0, 3, l->fd, Endpoint{"127.0.0.1", l->port}, DeadlineIn(0.4)).status();
  });
  auto g = TcpGroup::Create(1, 3, -1, Endpoint{"127.0.0.1", l->port}, DeadlineIn(0.4));
  root.join();
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("complete the group"), std::string::npos)
      << g.status().message();
  EXPECT_EQ(root_status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(root_status.message().find("not connected: 2"), std::string::npos)
      << root_status.message();
}

TEST(TcpGroup, PeerTimesOutWhenRootNeverListens) {
  auto l = Listen("127.0.0.1", 0);  // bound, then closed: nobody listens on this port
  ASSERT_TRUE(l.ok());
  int port = l->port;
  ::close(l->fd);
  auto g = TcpGroup::Create(1, 2, -1, Endpoint{"127.0.0.1", port}, DeadlineIn(0.3));
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(g.status().message().find("rank 1"), std::string::npos) << g.status().message();
}

class ProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           fmt::format("dl_comm_test_{}_{}", ::getpid(),
                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Read(const std::string& name) {
    std::ifstream f(dir_ / name);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  std::filesystem::path dir_;
};

TEST_F(ProcessTest, ExitCodeOutputAndEnvironment) {
  SpawnSpec spec;
  spec.exe = "/bin/sh";
  spec.argv = {"sh", "-c",
               "echo \"nvls=$NCCL_NVLS_ENABLE pgid=$(ps -o pgid= -p $$ 2>/dev/null)\"; "
               "echo pid=$$; exit 7"};
  spec.env = EnvironmentWith({"NCCL_NVLS_ENABLE=0"});
  spec.output_path = (dir_ / "out.log").string();
  auto c = ChildProcess::Spawn(spec);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  for (int i = 0; i < 500 && !c->Poll(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(c->reaped());
  EXPECT_TRUE(c->exit_info().exited);
  EXPECT_EQ(c->exit_info().code, 7);
  std::string out = Read("out.log");
  EXPECT_NE(out.find("nvls=0"), std::string::npos) << out;
  EXPECT_NE(out.find(fmt::format("pid={}", c->pid())), std::string::npos) << out;
  EXPECT_EQ(::getpgid(c->pid()), -1);  // reaped: gone
}

TEST_F(ProcessTest, OwnProcessGroupAndKillReachesGrandchildren) {
  SpawnSpec spec;
  spec.exe = "/bin/sh";
  std::string pidfile = (dir_ / "grandchild.pid").string();
  spec.argv = {"sh", "-c", "sleep 60 & echo $! > " + pidfile + "; wait"};
  spec.env = EnvironmentWith({});
  auto c = ChildProcess::Spawn(spec);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(::getpgid(c->pid()), c->pid());  // the child leads its own group
  EXPECT_NE(::getpgid(c->pid()), ::getpgid(0));
  pid_t grandchild = 0;
  for (int i = 0; i < 500 && grandchild == 0; ++i) {
    std::ifstream f(pidfile);
    f >> grandchild;
    if (grandchild == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_GT(grandchild, 0);
  EXPECT_TRUE(ProcessIsRunning(grandchild));
  EXPECT_EQ(::getpgid(grandchild), c->pid());
  c->KillAndReap();
  EXPECT_TRUE(c->reaped());
  EXPECT_FALSE(c->exit_info().exited);
  EXPECT_EQ(c->exit_info().signal, SIGKILL);
  bool gone = false;
  for (int i = 0; i < 300 && !gone; ++i) {
    gone = !ProcessIsRunning(grandchild);
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(gone) << "grandchild " << grandchild << " survived the group kill";
}

TEST_F(ProcessTest, PassesADescriptor) {
  auto l = Listen("127.0.0.1", 0);
  ASSERT_TRUE(l.ok());
  SpawnSpec spec;
  spec.exe = "/bin/sh";
  spec.argv = {"sh", "-c", "ls -l /proc/$$/fd/3"};
  spec.env = EnvironmentWith({});
  spec.output_path = (dir_ / "fd.log").string();
  spec.pass_fd = l->fd;
  auto c = ChildProcess::Spawn(spec);
  ASSERT_TRUE(c.ok());
  for (int i = 0; i < 500 && !c->Poll(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ::close(l->fd);
  EXPECT_EQ(c->exit_info().code, 0);
  EXPECT_NE(Read("fd.log").find("socket:"), std::string::npos) << Read("fd.log");
}

TEST_F(ProcessTest, MissingExecutableIsAnExitNotACrash) {
  SpawnSpec spec;
  spec.exe = (dir_ / "no-such-binary").string();
  spec.argv = {"x"};
  spec.output_path = (dir_ / "exec.log").string();
  auto c = ChildProcess::Spawn(spec);
  ASSERT_TRUE(c.ok());
  for (int i = 0; i < 500 && !c->Poll(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(c->exit_info().code, 127);
  EXPECT_NE(Read("exec.log").find("execve failed"), std::string::npos);
}

TEST_F(ProcessTest, RunToCompletionIsBoundedAndFindExecutableSearchesThePath) {
  SpawnSpec spec;
  spec.exe = FindExecutable("sleep");
  ASSERT_FALSE(spec.exe.empty());
  spec.argv = {"sleep", "30"};
  spec.env = EnvironmentWith({});
  const auto t0 = std::chrono::steady_clock::now();
  auto r = RunToCompletion(spec, 0.3);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded);
  spec.argv = {"sleep", "0"};
  auto quick = RunToCompletion(spec, 10);
  ASSERT_TRUE(quick.ok()) << quick.status().message();
  EXPECT_TRUE(quick->exited && quick->code == 0);
  EXPECT_EQ(FindExecutable("no-such-program-decodelab"), "");
  EXPECT_EQ(FindExecutable("/x/y"), "/x/y");
}

TEST(NcclApi, MissingLibraryIsAClearError) {
  auto r = FindNcclLibrary({"/nonexistent/dir/libnccl.so.2", "libnccl-does-not-exist.so.9"});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("/nonexistent/dir/libnccl.so.2"), std::string::npos);
  EXPECT_NE(r.status().message().find("libnccl-does-not-exist.so.9"), std::string::npos);
  EXPECT_NE(r.status().message().find("DECODELAB_NCCL_LIBRARY"), std::string::npos);
#if defined(DECODELAB_HAVE_NCCL_H)
  auto api = LoadNcclFrom({"/nonexistent/dir/libnccl.so.2"});
  EXPECT_FALSE(api.ok());
#endif
}

TEST(NcclApi, CandidatesCoverSystemAndToolkit) {
  auto c = DefaultNcclLibraryCandidates();
  EXPECT_NE(std::find(c.begin(), c.end(), "libnccl.so.2"), c.end());
  EXPECT_NE(std::find(c.begin(), c.end(), "/usr/local/cuda/lib/libnccl.so.2"), c.end());
  EXPECT_NE(std::find(c.begin(), c.end(), "/usr/local/cuda/lib64/libnccl.so.2"), c.end());
}

}  // namespace
}  // namespace dl::comm
