// Crash, starvation and resource cases of issue 21 against a real `decodelab serve` process on the
// CPU backend (docs/security.md lists each case with its limit). Every test ends by checking that
// the same process is still alive and answering.
#include <signal.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <thread>

#include <gtest/gtest.h>
#ifdef DL_TEST_HAVE_ZLIB
#include <zlib.h>
#endif

#include "model/safetensors.h"
#include "tests/server/server_test_util.h"

namespace dl::test {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Sends raw bytes on a fresh connection and returns everything the server answers.
std::string RawExchange(int port, const std::string& request, double timeout_s = 10) {
  const int fd = Connect(port);
  if (fd < 0) return "";
  SendAll(fd, request);
  ::shutdown(fd, SHUT_WR);
  std::string out = ReadAll(fd, timeout_s);
  ::close(fd);
  return out;
}

json BodyOf(const std::string& response) {
  const size_t at = response.find("\r\n\r\n");
  if (at == std::string::npos) return json();
  return json::parse(response.substr(at + 4), nullptr, false);
}

std::string Post(const std::string& path, const std::string& body,
                 const std::string& extra_headers = "") {
  return "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
         extra_headers + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

std::string Nested(size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

TEST(ServerRobustnessTest, InvalidUtf8PathAndBodyGetErrorsNotACrash) {
  for (const bool with_key : {false, true}) {
    ServeProcessOptions o;
    if (with_key) o.extra_args = {"--api-key", "sekrit"};
    auto server = ServeProcess::Start(o);
    ASSERT_NE(server, nullptr);
    // The 404 handler used to put the raw path into JSON, whose dump threw outside any handler.
    for (const char* path : {"/%FF", "/\xff\xfe", "/v1/%FF", "/v1/\xc3"}) {
      const std::string r =
          RawExchange(server->port(), std::string("GET ") + path + " HTTP/1.1\r\nHost: x\r\n" +
                                          (with_key ? "Authorization: Bearer sekrit\r\n" : "") +
                                          "Connection: close\r\n\r\n");
      EXPECT_EQ(StatusOf(r), 404) << path << ": " << r;
      const json body = BodyOf(r);
      ASSERT_TRUE(body.is_object()) << r;
      EXPECT_EQ(body["error"]["code"], "not_found");
    }
    // Invalid UTF-8 inside a JSON string of the body is a 400.
    const std::string bad = std::string("{\"prompt\": \"a\xff\xfe b\", \"max_tokens\": 2}");
    for (const char* route : {"/v1/completions", "/v1/chat/completions"}) {
      std::string body = bad;
      if (std::string(route) == "/v1/chat/completions") {
        body = std::string("{\"messages\": [{\"role\": \"user\", \"content\": \"\xc3\x28\"}]}");
      }
      const std::string r = RawExchange(
          server->port(),
          Post(route, body, with_key ? "Authorization: Bearer sekrit\r\n" : "") );
      EXPECT_EQ(StatusOf(r), 400) << r;
      EXPECT_TRUE(BodyOf(r).is_object()) << r;
    }
    EXPECT_TRUE(server->Alive()) << server->Log();
    if (!with_key) EXPECT_TRUE(server->Answers());
  }
}

TEST(ServerRobustnessTest, DeeplyNestedRequestJsonIsA400NamingTheLimit) {
  auto server = ServeProcess::Start();
  ASSERT_NE(server, nullptr);
  auto cli = server->Client();
  const std::string deep = Nested(20000);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "hi", "extra": )" + deep + "}]}"},
      {"/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "hi"}], "tools": )" + deep + "}"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "hi"}], )"
                               R"("chat_template_kwargs": {"x": )" + deep + "}}"},
      {"/v1/completions", R"({"prompt": [1, 2], "stop": )" + deep + "}"},
  };
  for (const auto& [route, body] : cases) {
    auto r = PostRaw(cli, route, body);
    EXPECT_EQ(r.status, 400) << route << ": " << r.body.substr(0, 300);
    ASSERT_TRUE(r.json.is_object()) << r.body.substr(0, 300);
    EXPECT_NE(r.json["error"]["message"].get<std::string>().find("128"), std::string::npos)
        << r.body;
  }
  // Nesting within the limit still works.
  auto ok = PostJson(cli, "/v1/chat/completions",
                     {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                      {"chat_template_kwargs", {{"x", json::parse(Nested(100))}}},
                      {"max_tokens", 2}});
  EXPECT_EQ(ok.status, 200) << ok.body;
  EXPECT_TRUE(server->Answers()) << server->Log();
}


// ---- item 3: hostile chat templates (the model's own file) ----

// One template, many attacks: chat_template_kwargs.attack picks the branch.
constexpr const char* kHostileTemplate = R"TPL(
{%- if attack == 'selfref' -%}{% set ns = namespace() %}{% set ns.a = ns %}{{ ns }}
{%- elif attack == 'selflist' -%}{% set l = [] %}{% set _ = l.append(l) %}{{ l|tojson }}
{%- elif attack == 'deepvalue' -%}{% set ns = namespace(x=1) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}
{%- elif attack == 'floordiv' -%}{{ (-9223372036854775807 - 1) // -1 }}
{%- elif attack == 'mod' -%}{{ (-9223372036854775807 - 1) % -1 }}{{ (-9223372036854775807 - 1) is divisibleby(-1) }}
{%- elif attack == 'strdouble' -%}{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}
{%- elif attack == 'listdouble' -%}{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|length }}
{%- elif attack == 'unique' -%}{{ range(1000000)|unique|length }}
{%- else -%}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>
{%- endif -%})TPL";

TEST(ServerRobustnessTest, HostileChatTemplatesFailTheRequestNotTheServer) {
  ServeProcessOptions o;
  o.model_dir = TinyModelCopy(kHostileTemplate);
  ASSERT_FALSE(o.model_dir.empty());
  auto server = ServeProcess::Start(o);
  ASSERT_NE(server, nullptr);
  auto cli = server->Client(60);
  const json messages = {{{"role", "user"}, {"content", "hi"}}};
  for (const char* attack : {"selfref", "selflist", "deepvalue", "floordiv", "strdouble",
                             "listdouble", "unique"}) {
    const auto t0 = Clock::now();
    auto r = PostJson(cli, "/v1/chat/completions",
                      {{"messages", messages},
                       {"max_tokens", 2},
                       {"chat_template_kwargs", {{"attack", attack}}}});
    EXPECT_EQ(r.status, 400) << attack << ": " << r.body.substr(0, 300);
    EXPECT_LT(SecondsSince(t0), 10.0) << attack;
    ASSERT_TRUE(server->Alive()) << attack << " took the server down:\n" << server->Log();
  }
  // x % -1 is 0, not a trap.
  auto mod = PostJson(cli, "/v1/chat/completions",
                      {{"messages", messages}, {"max_tokens", 2},
                       {"chat_template_kwargs", {{"attack", "mod"}}}});
  EXPECT_EQ(mod.status, 200) << mod.body;
  auto plain = PostJson(cli, "/v1/chat/completions", {{"messages", messages}, {"max_tokens", 2}});
  EXPECT_EQ(plain.status, 200) << plain.body;
  EXPECT_TRUE(server->Answers()) << server->Log();
}

TEST(ServerRobustnessTest, TemplatesTooDeepToParseAreRefusedAtLoad) {
  std::string chain = "{{ messages";
  for (int i = 0; i < 100000; ++i) chain += "|string";
  chain += " }}";
  std::string nested = "{{ " + std::string(100000, '[') + std::string(100000, ']') + " }}";
  for (const std::string& tmpl : {chain, nested}) {
    ServeProcessOptions o;
    o.model_dir = TinyModelCopy(tmpl);
    ASSERT_FALSE(o.model_dir.empty());
    auto server = ServeProcess::Start(o);
    ASSERT_NE(server, nullptr);
    EXPECT_NE(server->Log().find("nested"), std::string::npos) << server->Log();
    auto cli = server->Client();
    auto r = PostJson(cli, "/v1/chat/completions",
                      {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 2}});
    EXPECT_EQ(r.status, 400) << r.body;
    EXPECT_NE(r.body.find("chat template"), std::string::npos) << r.body;
    EXPECT_TRUE(server->Answers()) << server->Log();
  }
}

// ---- item 10: non-finite logits are an error, not a token ----

// A copy of the tiny model whose final norm weight is NaN: every logit comes out NaN.
std::string NanModel() {
  const std::string dir = TinyModelCopy("");
  if (dir.empty()) return "";
  const std::string path = dir + "/model.safetensors";
  auto file = SafetensorsFile::Open(path);
  if (!file.ok()) {
    ADD_FAILURE() << file.status().message();
    return "";
  }
  const SafetensorsEntry* norm = nullptr;
  for (const auto& t : file->tensors()) {
    if (t.name == "model.norm.weight") norm = &t;
  }
  if (!norm) {
    ADD_FAILURE() << "no model.norm.weight in " << path;
    return "";
  }
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t header = 0;
  f.read(reinterpret_cast<char*>(&header), 8);
  std::string nan;
  const float nf = std::numeric_limits<float>::quiet_NaN();
  for (uint64_t i = 0; i < norm->nbytes() / DTypeSize(norm->dtype); ++i) {
    if (norm->dtype == DType::kF32) {
      nan.append(reinterpret_cast<const char*>(&nf), 4);
    } else {
      nan += std::string("\xc0\x7f", 2);  // BF16 / F16-compatible quiet NaN bits
    }
  }
  f.seekp(static_cast<std::streamoff>(8 + header + norm->begin));
  f.write(nan.data(), static_cast<std::streamsize>(nan.size()));
  return f.good() ? dir : "";
}

TEST(ServerRobustnessTest, NonFiniteLogitsAreAnErrorInServeAndGenerate) {
  const std::string dir = NanModel();
  ASSERT_FALSE(dir.empty());
  // generate: an error exit, no tokens.
  {
    comm::SpawnSpec spec;
    spec.exe = DecodelabBinary();
    spec.argv = {spec.exe, "generate", "--model", dir, "--backend", "cpu", "--prompt-ids",
                 "5,6,7", "--max-tokens", "4"};
    spec.env = comm::EnvironmentWith({});
    spec.output_path = dir + "/../generate.log";
    auto exit = comm::RunToCompletion(spec, 60);
    ASSERT_TRUE(exit.ok()) << exit.status().message();
    std::ifstream in(spec.output_path);
    const std::string log(std::istreambuf_iterator<char>(in), {});
    EXPECT_TRUE(exit->exited && exit->code != 0) << exit->ToString() << "\n" << log;
    EXPECT_NE(log.find("non-finite"), std::string::npos) << log;
  }
  // serve: the request fails (500, or an error event in a stream); the server lives on.
  ServeProcessOptions o;
  o.model_dir = dir;
  auto server = ServeProcess::Start(o);
  ASSERT_NE(server, nullptr);
  auto cli = server->Client();
  for (const double temperature : {0.0, 0.8}) {
    auto r = PostJson(cli, "/v1/completions",
                      {{"prompt", {5, 6, 7}}, {"max_tokens", 3}, {"temperature", temperature}});
    EXPECT_EQ(r.status, 500) << r.body;
    EXPECT_NE(r.body.find("non-finite"), std::string::npos) << r.body;
  }
  auto s = PostStream(cli, "/v1/completions",
                      {{"prompt", {5, 6, 7}}, {"max_tokens", 3}, {"stream", true}});
  ASSERT_GE(s.data.size(), 2u) << s.raw;
  EXPECT_NE(s.data[s.data.size() - 2].find("non-finite"), std::string::npos) << s.raw;
  EXPECT_TRUE(server->Alive()) << server->Log();
}

// ---- item 8: loaders read regular files of bounded size only ----

// Runs `decodelab serve` on `model_dir` and expects it to fail fast; returns its output.
std::string ServeMustFail(const std::string& model_dir) {
  comm::SpawnSpec spec;
  spec.exe = DecodelabBinary();
  spec.argv = {spec.exe, "serve", "--model", model_dir, "--backend", "cpu", "--port", "0"};
  spec.env = comm::EnvironmentWith({});
  spec.output_path = model_dir + "/../serve.log";
  // Not spawned, or still running after 10 s (then killed): a failure either way.
  auto exit = comm::RunToCompletion(spec, 10);
  EXPECT_TRUE(exit.ok()) << exit.status().message();
  if (exit.ok()) {
    EXPECT_TRUE(exit->exited && exit->code != 0) << exit->ToString();
  }
  std::ifstream in(spec.output_path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(ServerRobustnessTest, ServeRefusesModelFilesThatAreDevicesOrFifos) {
  namespace fs = std::filesystem;
  {
    const std::string dir = TinyModelCopy("");
    ASSERT_FALSE(dir.empty());
    fs::remove(dir + "/tokenizer.json");
    fs::create_symlink("/dev/zero", dir + "/tokenizer.json");
    const std::string log = ServeMustFail(dir);
    EXPECT_NE(log.find("tokenizer.json is a character device"), std::string::npos) << log;
  }
  {
    const std::string dir = TinyModelCopy("");
    ASSERT_FALSE(dir.empty());
    fs::remove(dir + "/config.json");
    ASSERT_EQ(mkfifo((dir + "/config.json").c_str(), 0600), 0);
    const std::string log = ServeMustFail(dir);
    EXPECT_NE(log.find("config.json is a FIFO"), std::string::npos) << log;
  }
}

// ---- item 5: bounded bodies and headers ----

#ifdef DL_TEST_HAVE_ZLIB
std::string Gzip(const std::string& data) {
  z_stream z{};
  deflateInit2(&z, Z_BEST_COMPRESSION, Z_DEFLATED, 15 + 16, 9, Z_DEFAULT_STRATEGY);
  std::string out(deflateBound(&z, data.size()), '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  z.avail_in = static_cast<uInt>(data.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}
#endif

TEST(ServerRobustnessTest, CompressedBodiesAreRefusedBeforeTheyInflate) {
#ifndef DL_TEST_HAVE_ZLIB
  GTEST_SKIP() << "zlib not found at build time";
#else
  auto server = ServeProcess::Start();
  ASSERT_NE(server, nullptr);
  // 96 MiB of JSON whitespace compresses to ~100 KB: the 16 MiB body limit must hold after decoding.
  std::string inflated = "{\"prompt\": [1, 2], \"max_tokens\": 1, \"user\": \"";
  inflated += std::string(96u << 20, 'a');
  inflated += "\"}";
  const std::string bomb = Gzip(inflated);
  inflated.clear();
  inflated.shrink_to_fit();
  ASSERT_LT(bomb.size(), 1u << 20);
  const long rss0 = server->RssKiB();
  for (const char* enc : {"gzip", "deflate", "br"}) {
    const std::string r = RawExchange(
        server->port(),
        Post("/v1/completions", bomb, std::string("Content-Encoding: ") + enc + "\r\n"));
    EXPECT_EQ(StatusOf(r), 415) << enc << ": " << r.substr(0, 300);
    EXPECT_EQ(BodyOf(r)["error"]["code"], "unsupported_content_encoding") << r;
  }
  EXPECT_LT(server->RssKiB() - rss0, 32 * 1024) << "RSS grew by more than 32 MiB";
  EXPECT_TRUE(server->Answers()) << server->Log();
#endif
}

TEST(ServerRobustnessTest, ChunkedAndLengthlessBodiesHoldTheBodyLimit) {
  ServeProcessOptions o;
  o.extra_args = {"--max-body-bytes", "1048576"};
  auto server = ServeProcess::Start(o);
  ASSERT_NE(server, nullptr);
  const long rss0 = server->RssKiB();
  // 64 MiB chunked: refused once the raw bytes pass 2 x the limit, long before the end.
  {
    const int fd = Connect(server->port());
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendAll(fd, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                            "application/json\r\nTransfer-Encoding: chunked\r\n\r\n"));
    const std::string piece(64u << 10, 'a');
    char head[32];
    std::snprintf(head, sizeof head, "%zx\r\n", piece.size());
    std::string chunk = std::string(head) + piece + "\r\n";
    size_t sent = 0;
    for (int i = 0; i < 1024; ++i) {
      if (!SendAll(fd, chunk)) break;  // the server closed after its 413
      sent += piece.size();
    }
    EXPECT_LT(sent, 64u << 20) << "the whole 64 MiB chunked body was accepted";
    const std::string r = ReadAll(fd, 5);
    if (!r.empty()) EXPECT_EQ(StatusOf(r), 413) << r.substr(0, 300);
    ::close(fd);
  }
  // A chunked body over the limit but under the raw cap: the exact decoded check answers 413.
  {
    std::string body = "{\"prompt\": [1, 2], \"max_tokens\": 1, \"user\": \"" +
                       std::string(1200u << 10, 'b') + "\"}";
    std::string req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
    for (size_t off = 0; off < body.size(); off += 60000) {
      const std::string part = body.substr(off, 60000);
      char head[32];
      std::snprintf(head, sizeof head, "%zx\r\n", part.size());
      req += head + part + "\r\n";
    }
    req += "0\r\n\r\n";
    const std::string r = RawExchange(server->port(), req);
    EXPECT_EQ(StatusOf(r), 413) << r.substr(0, 300);
  }
  // Content-Length beyond the limit: 413 before the body is read.
  {
    const int fd = Connect(server->port());
    ASSERT_GE(fd, 0);
    const auto t0 = Clock::now();
    SendAll(fd, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n{");
    const std::string r = ReadAll(fd, 5);
    EXPECT_EQ(StatusOf(r), 413) << r;
    EXPECT_LT(SecondsSince(t0), 3.0);
    ::close(fd);
  }
  EXPECT_LT(server->RssKiB() - rss0, 32 * 1024) << "RSS grew by more than 32 MiB";
  EXPECT_TRUE(server->Answers()) << server->Log();
}

TEST(ServerRobustnessTest, HugeHeadersAre431WithoutGrowingMemory) {
  auto server = ServeProcess::Start();
  ASSERT_NE(server, nullptr);
  const long rss0 = server->RssKiB();
  // Too many header fields.
  {
    std::string req = "GET /health HTTP/1.1\r\nHost: x\r\n";
    for (int i = 0; i < 300; ++i) req += "X-Filler-" + std::to_string(i) + ": v\r\n";
    req += "\r\n";
    const std::string r = RawExchange(server->port(), req);
    EXPECT_EQ(StatusOf(r), 431) << r.substr(0, 300);
    EXPECT_EQ(BodyOf(r)["error"]["code"], "request_header_fields_too_large") << r;
  }
  // One endless header line: 128 MiB sent, the server must stop reading after its limit.
  {
    const int fd = Connect(server->port());
    ASSERT_GE(fd, 0);
    SendAll(fd, "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ");
    const std::string piece(1u << 20, 'h');
    size_t sent = 0;
    for (int i = 0; i < 128; ++i) {
      if (!SendAll(fd, piece)) break;
      sent += piece.size();
    }
    EXPECT_LT(sent, 128u << 20) << "the server kept reading a 128 MiB header line";
    ::close(fd);
  }
  // An endless request line: 414.
  {
    const std::string r =
        RawExchange(server->port(), "GET /" + std::string(40000, 'u') + " HTTP/1.1\r\n\r\n");
    EXPECT_EQ(StatusOf(r), 414) << r.substr(0, 300);
  }
  EXPECT_LT(server->RssKiB() - rss0, 32 * 1024) << "RSS grew by more than 32 MiB";
  EXPECT_TRUE(server->Answers()) << server->Log();
}

// ---- item 6: slow clients, connection cap, bounded shutdown ----

// Opens `n` connections that send a request line and then one header byte every 300 ms.
class SlowLoris {
 public:
  SlowLoris(int port, int n) {
    for (int i = 0; i < n; ++i) {
      const int fd = Connect(port);
      if (fd < 0) continue;
      SendAll(fd, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ");
      fds_.push_back(fd);
    }
    thread_ = std::thread([this] {
      while (!quit_.load()) {
        for (int fd : fds_) (void)::send(fd, "a", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        for (int i = 0; i < 6 && !quit_.load(); ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
      }
    });
  }
  ~SlowLoris() {
    quit_.store(true);
    thread_.join();
    for (int fd : fds_) ::close(fd);
  }
  const std::vector<int>& fds() const { return fds_; }

 private:
  std::vector<int> fds_;
  std::atomic<bool> quit_{false};
  std::thread thread_;
};

TEST(ServerRobustnessTest, SlowLorisGetsTimedOutAndExtraConnectionsAClearRefusal) {
  ServeProcessOptions o;
  o.extra_args = {"--http-threads", "8", "--request-header-timeout", "2"};
  auto server = ServeProcess::Start(o);
  ASSERT_NE(server, nullptr);
  SlowLoris loris(server->port(), 20);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // A second wave takes any slot that the start-up health checks still held during the first.
  SlowLoris more(server->port(), 4);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // Every worker is held by a trickling client: a new request is refused at once, clearly.
  {
    auto cli = server->Client(5);
    const auto t0 = Clock::now();
    auto r = Get(cli, "/v1/models");
    EXPECT_LT(SecondsSince(t0), 2.0);
    EXPECT_EQ(r.status, 503) << r.body;
    EXPECT_EQ(r.json["error"]["code"], "too_many_connections") << r.body;
  }
  // The header deadline frees the workers, although the trickle never stops.
  const auto t0 = Clock::now();
  bool answered = false;
  while (SecondsSince(t0) < 8 && !answered) {
    auto cli = server->Client(5);
    answered = Get(cli, "/v1/models").status == 200;
    if (!answered) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_TRUE(answered) << "no worker was freed from the slow clients within 8 s";
  // The slow clients that were being served were told why.
  int timed_out = 0;
  for (int fd : loris.fds()) {
    const std::string r = ReadAll(fd, 0.2);
    if (StatusOf(r) == 408) ++timed_out;
  }
  EXPECT_GE(timed_out, 1);
  EXPECT_TRUE(server->Answers()) << server->Log();
}

TEST(ServerRobustnessTest, ShutdownIsBoundedWithTricklingClientsAndInFlightStreams) {
  ServeProcessOptions o;
  o.extra_args = {"--max-seq-len", "4096"};
  auto server = ServeProcess::Start(o);
  ASSERT_NE(server, nullptr);
  SlowLoris loris(server->port(), 4);
  // A stream in flight when SIGTERM arrives ends with an error event and [DONE].
  SseResult stream;
  std::atomic<int> seen{0};
  std::thread client([&] {
    auto cli = server->Client(30);
    stream = PostStream(cli, "/v1/completions",
                        {{"prompt", {5, 6, 7, 8}}, {"max_tokens", 4000}, {"temperature", 0},
                         {"ignore_eos", true}, {"stream", true}},
                        [&](const std::string&) {
                          ++seen;
                          return true;
                        });
  });
  while (seen.load() < 3) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  const double took = server->SignalAndWait(SIGTERM, 15);
  client.join();
  EXPECT_GE(took, 0) << "serve did not exit within 15 s of SIGTERM";
  EXPECT_LT(took, 5.0) << "serve took " << took << " s to stop";
  ASSERT_GE(stream.data.size(), 2u) << stream.raw.substr(0, 300);
  EXPECT_EQ(stream.data.back(), "[DONE]");
  const json err = json::parse(stream.data[stream.data.size() - 2], nullptr, false);
  EXPECT_TRUE(err.contains("error")) << stream.data[stream.data.size() - 2];
  EXPECT_TRUE(server->exit_info().exited) << server->exit_info().ToString();
}

// ---- item 7: a non-streaming client that disconnects is cancelled ----

double AbortCount(ServeProcess& server) {
  auto cli = server.Client();
  auto r = cli.Get("/metrics");
  if (!r) return -1;
  const std::string key = "finished_reason=\"abort\"} ";
  const size_t at = r->body.find(key);
  return at == std::string::npos ? -1 : std::atof(r->body.c_str() + at + key.size());
}

TEST(ServerRobustnessTest, DroppedNonStreamingRequestsAreCancelled) {
  ServeProcessOptions o;
  o.extra_args = {"--max-seq-len", "4096", "--max-batch", "2"};
  auto server = ServeProcess::Start(o);
  ASSERT_NE(server, nullptr);
  const double aborts0 = AbortCount(*server);
  ASSERT_GE(aborts0, 0);
  // Eight long non-streaming requests whose clients hang up right after sending.
  for (int i = 0; i < 8; ++i) {
    const std::string body =
        json{{"prompt", {5 + i, 6, 7}}, {"max_tokens", 4000}, {"temperature", 0},
             {"ignore_eos", true}}
            .dump();
    const int fd = Connect(server->port());
    ASSERT_GE(fd, 0);
    SendAll(fd, Post("/v1/completions", body));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ::close(fd);
  }
  // They end as aborted (not as finished-by-length), and their pages come back.
  const auto t0 = Clock::now();
  double aborts = aborts0;
  int used = -1;
  auto cli = server->Client();
  while (SecondsSince(t0) < 10) {
    aborts = AbortCount(*server);
    used = KvPagesUsed(cli);
    if (aborts - aborts0 >= 8 && used == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(aborts - aborts0, 8) << "dropped requests were not cancelled";
  EXPECT_EQ(used, 0);
  EXPECT_TRUE(server->Answers()) << server->Log();
}


// ---- item 11: exposure warning and API keys that do not show in `ps` ----

TEST(ServerRobustnessTest, ApiKeyFromFileOrEnvironmentAndAWarningForOpenHosts) {
  const json body = {{"prompt", {5, 6, 7}}, {"max_tokens", 1}};
  {
    ServeProcessOptions o;
    o.extra_args = {"--host", "0.0.0.0"};
    auto server = ServeProcess::Start(o);
    ASSERT_NE(server, nullptr);
    EXPECT_NE(server->Log().find("warning: --host 0.0.0.0"), std::string::npos) << server->Log();
  }
  {
    ServeProcessOptions o;
    o.extra_args = {"--host", "0.0.0.0"};
    o.env = {"DECODELAB_API_KEY=env-sekrit"};
    auto server = ServeProcess::Start(o);
    ASSERT_NE(server, nullptr);
    EXPECT_EQ(server->Log().find("warning: --host"), std::string::npos) << server->Log();
    auto cli = server->Client();
    EXPECT_EQ(PostJson(cli, "/v1/completions", body).status, 401);
    EXPECT_EQ(PostJson(cli, "/v1/completions", body, "env-sekrit").status, 200);
  }
  {
    const std::string dir = TinyModelCopy("");
    const std::string key_file = dir + "/../api.key";
    std::ofstream(key_file) << "file-sekrit\n";
    ServeProcessOptions o;
    o.extra_args = {"--api-key-file", key_file};
    auto server = ServeProcess::Start(o);
    ASSERT_NE(server, nullptr);
    auto cli = server->Client();
    EXPECT_EQ(PostJson(cli, "/v1/completions", body).status, 401);
    EXPECT_EQ(PostJson(cli, "/v1/completions", body, "file-sekrit").status, 200);
    // The key is not on the command line.
    std::ifstream in("/proc/" + std::to_string(server->pid()) + "/cmdline", std::ios::binary);
    const std::string cmdline(std::istreambuf_iterator<char>(in), {});
    EXPECT_EQ(cmdline.find("file-sekrit"), std::string::npos);
  }
  // Two sources at once are refused.
  comm::SpawnSpec spec;
  spec.exe = DecodelabBinary();
  spec.argv = {spec.exe, "serve", "--model", TinyModelDir(), "--backend", "cpu", "--port", "0",
               "--api-key", "a"};
  spec.env = comm::EnvironmentWith({"DECODELAB_API_KEY=b"});
  auto exit = comm::RunToCompletion(spec, 30);
  ASSERT_TRUE(exit.ok());
  EXPECT_TRUE(exit->exited && exit->code == 2) << exit->ToString();
}

}  // namespace
}  // namespace dl::test
