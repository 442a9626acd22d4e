#include "tests/server/server_test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include <gtest/gtest.h>

#include "model/model_writer.h"
#include "model/shapes.h"
#include "template/chat_template.h"
#include "tokenizer/tokenizer_writer.h"

namespace dl::test {

namespace fs = std::filesystem;

namespace {

// A Laguna-shaped template (EOS as BOS, <system>/<user>/<assistant> blocks, generation prompt
// `<assistant></think>`): enough to exercise rendering, not Poolside's exact text.
constexpr const char* kChatTemplate =
    "{{- bos_token -}}<system>{% if messages[0].role == 'system' %}{{ messages[0].content }}"
    "{% else %}You are a helpful assistant.{% endif %}</system>\n"
    "{% for m in messages %}{% if m.role == 'user' %}<user>{{ m.content }}</user>\n"
    "{% elif m.role == 'assistant' %}<assistant></think>{{ m.content }}</assistant>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant></think>{% endif %}";

std::string MakeTinyModel() {
  char tmpl[] = "/tmp/decodelab-server-test-XXXXXX";
  const char* base = mkdtemp(tmpl);
  if (!base) return "";
  const std::string dir = std::string(base) + "/tiny";
  auto cfg = ShapeConfig("tiny");
  if (!cfg.ok()) return "";
  MakeModelOptions o;
  o.config = *cfg;
  o.seed = 11;
  o.out_dir = dir;
  auto r = WriteSyntheticModel(o);
  if (!r.ok()) {
    ADD_FAILURE() << r.status().message();
    return "";
  }
  if (!fs::exists(fs::path(dir) / "tokenizer.json")) {
    Status st = WriteSmallTokenizer(dir, static_cast<int32_t>(cfg->vocab_size));
    if (!st.ok()) {
      ADD_FAILURE() << st.message();
      return "";
    }
  }
  if (!fs::exists(fs::path(dir) / "chat_template.jinja")) {
    std::ofstream(fs::path(dir) / "chat_template.jinja") << kChatTemplate;
  }
  return dir;
}

}  // namespace

const std::string& TinyModelDir() {
  static std::once_flag once;
  static std::string dir;
  std::call_once(once, [] {
    dir = MakeTinyModel();
    // Remove it at exit: tests must not leave files behind.
    std::atexit([] {
      if (!dir.empty()) {
        std::error_code ec;
        fs::remove_all(fs::path(dir).parent_path(), ec);
      }
    });
  });
  return dir;
}

std::unique_ptr<TestServer> TestServer::Start(const ServerConfig& c) {
  auto ts = std::unique_ptr<TestServer>(new TestServer());
  EngineOptions o;
  o.model_dir = c.model_dir.empty() ? TinyModelDir() : c.model_dir;
  o.backend = BackendKind::kCpu;
  o.max_seq_len = c.max_seq_len;
  o.prefill_chunk = c.prefill_chunk;
  o.max_sequences = c.max_batch * (c.prefix_caching ? 2 : 1);
  o.max_batch = c.max_batch;
  o.max_draft_tokens = c.spec_ngram ? c.spec_k : 0;
  o.tp = c.tp;
  auto engine = LoadEngine(o);
  if (!engine.ok()) {
    ADD_FAILURE() << engine.status().message();
    return nullptr;
  }
  ts->engine_ = std::move(engine).value();
  ts->scheduler_ = std::make_unique<Scheduler>(
      *ts->engine_, SchedulerOptions{.max_batch = c.max_batch,
                                     .max_waiting = c.max_waiting,
                                     .prefill_chunk = c.prefill_chunk,
                                     .enable_prefix_caching = c.prefix_caching,
                                     .drafter = c.spec_ngram ? std::make_shared<NgramDrafter>(1, 3) : nullptr,
                                     .num_draft_tokens = c.spec_ngram ? c.spec_k : 0});
  ts->scheduler_->Start();
  auto tok = Tokenizer::FromFile(o.model_dir);
  EXPECT_TRUE(tok.ok()) << tok.status().message();
  std::optional<ChatTemplate> tmpl;
  if (c.with_chat_template) {
    auto t = LoadChatTemplateForModel(o.model_dir);
    EXPECT_TRUE(t.ok()) << t.status().message();
    if (t.ok()) tmpl = std::move(t).value();
  }
  ServerOptions so;
  so.host = "127.0.0.1";
  so.port = 0;
  so.api_key = c.api_key;
  so.max_body_bytes = c.max_body_bytes;
  so.http_threads = c.http_threads;
  so.served_model_name = c.served_model_name;
  so.model_root = o.model_dir;
  ts->server_ = std::make_unique<Server>(*ts->engine_, *ts->scheduler_, so,
                                         tok.ok() ? std::optional<Tokenizer>(*tok) : std::nullopt,
                                         std::move(tmpl), "this model has no chat template");
  Status st = ts->server_->Bind();
  if (!st.ok()) {
    ADD_FAILURE() << st.message();
    return nullptr;
  }
  ts->thread_ = std::thread([s = ts->server_.get()] { (void)s->Run(); });
  // Wait until /health answers.
  httplib::Client cli("127.0.0.1", ts->port());
  for (int i = 0; i < 200; ++i) {
    auto r = cli.Get("/health");
    if (r && r->status == 200) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return ts;
}

void TestServer::Stop() {
  if (server_) server_->Stop();
  if (thread_.joinable()) thread_.join();
}

TestServer::~TestServer() { Stop(); }

httplib::Client TestServer::Client() const {
  httplib::Client cli("127.0.0.1", port());
  cli.set_read_timeout(60, 0);
  return cli;
}

namespace {
HttpResult ToResult(const httplib::Result& r) {
  HttpResult out;
  if (!r) return out;
  out.status = r->status;
  out.body = r->body;
  out.json = nlohmann::json::parse(r->body, nullptr, false);
  return out;
}
httplib::Headers AuthHeaders(const std::string& key) {
  httplib::Headers h;
  if (!key.empty()) h.emplace("Authorization", "Bearer " + key);
  return h;
}
}  // namespace

HttpResult PostJson(httplib::Client& cli, const std::string& path, const nlohmann::json& body,
                    const std::string& api_key) {
  return ToResult(cli.Post(path.c_str(), AuthHeaders(api_key), body.dump(), "application/json"));
}

HttpResult PostRaw(httplib::Client& cli, const std::string& path, const std::string& body) {
  return ToResult(cli.Post(path.c_str(), body, "application/json"));
}

HttpResult Get(httplib::Client& cli, const std::string& path, const std::string& api_key) {
  return ToResult(cli.Get(path.c_str(), AuthHeaders(api_key)));
}

SseResult PostStream(httplib::Client& cli, const std::string& path, const nlohmann::json& body,
                     std::function<bool(const std::string&)> on_event) {
  SseResult out;
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  std::string pending;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    out.raw.append(data, n);
    pending.append(data, n);
    size_t pos;
    while ((pos = pending.find("\n\n")) != std::string::npos) {
      std::string event = pending.substr(0, pos);
      pending.erase(0, pos + 2);
      if (event.rfind("data: ", 0) == 0) {
        out.data.push_back(event.substr(6));
        if (on_event && !on_event(out.data.back())) {
          out.aborted = true;
          return false;
        }
      }
    }
    return true;
  };
  auto r = cli.send(req);
  if (r) {
    out.status = r->status;
    if (out.raw.empty()) out.raw = r->body;
  } else {
    out.error = httplib::to_string(r.error());
  }
  return out;
}

int KvPagesUsed(httplib::Client& cli) {
  auto r = Get(cli, "/v1/decodelab/state");
  if (r.status != 200) return -1;
  return r.json["kv_pages"]["used"].get<int>();
}

std::string DecodelabBinary() {
  // DECODELAB_TEST_BINARY runs the black-box tests against another build (e.g. an older one).
  if (const char* b = std::getenv("DECODELAB_TEST_BINARY"); b && *b) return b;
  return std::string(DECODELAB_BINARY_DIR) + "/bin/decodelab";
}

namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Temporary directories made by these helpers, removed at exit.
void RemoveAtExit(const std::string& dir) {
  static std::mutex mu;
  static std::vector<std::string>* dirs = nullptr;
  std::lock_guard lock(mu);
  if (!dirs) {
    dirs = new std::vector<std::string>();
    std::atexit([] {
      for (const auto& d : *dirs) {
        std::error_code ec;
        fs::remove_all(d, ec);
      }
    });
  }
  dirs->push_back(dir);
}

std::string MakeTempDir(const char* what) {
  std::string tmpl = std::string("/tmp/decodelab-") + what + "-XXXXXX";
  const char* d = mkdtemp(tmpl.data());
  if (!d) return "";
  RemoveAtExit(d);
  return d;
}

}  // namespace

std::string TinyModelCopy(const std::string& chat_template) {
  const std::string base = MakeTempDir("model-copy");
  if (base.empty() || TinyModelDir().empty()) return "";
  const std::string dir = base + "/tiny";
  std::error_code ec;
  fs::create_directories(dir, ec);
  for (const auto& e : fs::directory_iterator(TinyModelDir())) {
    if (e.path().filename() == "chat_template.jinja") continue;
    fs::copy(e.path(), fs::path(dir) / e.path().filename(), ec);
    if (ec) {
      ADD_FAILURE() << "copying " << e.path() << ": " << ec.message();
      return "";
    }
  }
  if (!chat_template.empty()) {
    std::ofstream(fs::path(dir) / "chat_template.jinja", std::ios::binary) << chat_template;
  }
  return dir;
}

std::unique_ptr<ServeProcess> ServeProcess::Start(const ServeProcessOptions& o) {
  auto sp = std::unique_ptr<ServeProcess>(new ServeProcess());
  sp->dir_ = MakeTempDir("serve");
  sp->log_path_ = sp->dir_ + "/serve.log";
  const std::string model = o.model_dir.empty() ? TinyModelDir() : o.model_dir;
  comm::SpawnSpec spec;
  spec.exe = DecodelabBinary();
  spec.argv = {spec.exe, "serve", "--model", model, "--backend", "cpu", "--port", "0"};
  // Defaults the test did not set itself.
  for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--host", "127.0.0.1"},
           {"--max-seq-len", "512"},
           {"--prefill-chunk", "16"},
           {"--max-batch", "4"}}) {
    if (std::find(o.extra_args.begin(), o.extra_args.end(), flag) == o.extra_args.end()) {
      spec.argv.insert(spec.argv.end(), {flag, value});
    }
  }
  spec.argv.insert(spec.argv.end(), o.extra_args.begin(), o.extra_args.end());
  spec.env = comm::EnvironmentWith(o.env);
  spec.output_path = sp->log_path_;
  auto child = comm::ChildProcess::Spawn(spec);
  if (!child.ok()) {
    ADD_FAILURE() << child.status().message();
    return nullptr;
  }
  sp->child_ = std::move(child).value();
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int>(o.ready_timeout_s * 1000));
  while (std::chrono::steady_clock::now() < deadline) {
    if (sp->child_.Poll()) {
      ADD_FAILURE() << "decodelab serve exited (" << sp->child_.exit_info().ToString()
                    << ") before it was ready:\n"
                    << sp->Log();
      return nullptr;
    }
    // "ready at http://HOST:PORT": the port follows the URL's last ':' (the host may be 0.0.0.0).
    const std::string log = sp->Log();
    const size_t at = log.find("ready at http://");
    if (at != std::string::npos) {
      const size_t end = log.find('\n', at);
      if (end != std::string::npos) {
        const size_t colon = log.rfind(':', end);
        if (colon != std::string::npos && colon > at) sp->port_ = std::atoi(log.c_str() + colon + 1);
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (sp->port_ <= 0) {
    ADD_FAILURE() << "decodelab serve did not print its URL:\n" << sp->Log();
    return nullptr;
  }
  for (int i = 0; i < 500; ++i) {
    if (sp->Alive()) return sp;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ADD_FAILURE() << "decodelab serve never answered /health:\n" << sp->Log();
  return nullptr;
}

ServeProcess::~ServeProcess() {
  if (child_.running()) (void)SignalAndWait(SIGTERM, 20);
}

httplib::Client ServeProcess::Client(int read_timeout_s) const {
  httplib::Client cli("127.0.0.1", port_);
  cli.set_read_timeout(read_timeout_s, 0);
  cli.set_connection_timeout(5, 0);
  return cli;
}

bool ServeProcess::Alive() {
  if (child_.Poll()) return false;
  httplib::Client cli("127.0.0.1", port_);
  cli.set_connection_timeout(2, 0);
  cli.set_read_timeout(5, 0);
  auto r = cli.Get("/health");
  return r && r->status == 200;
}

bool ServeProcess::Answers() {
  if (!Alive()) return false;
  auto cli = Client();
  auto r = PostJson(cli, "/v1/completions",
                    {{"prompt", {5, 6, 7}}, {"max_tokens", 2}, {"temperature", 0},
                     {"ignore_eos", true}});
  return r.status == 200 && r.json.is_object() &&
         r.json["choices"][0]["token_ids"].size() == 2u;
}

std::string ServeProcess::Log() const { return ReadAll(log_path_); }

long ServeProcess::RssKiB() const {
  std::ifstream f("/proc/" + std::to_string(child_.pid()) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

double ServeProcess::SignalAndWait(int sig, double timeout_s) {
  if (!child_.running()) return 0;
  const auto t0 = std::chrono::steady_clock::now();
  ::kill(child_.pid(), sig);
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < timeout_s) {
    if (child_.Poll()) {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  child_.KillAndReap();
  return -1;
}

int Connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool SendAll(int fd, const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

std::string ReadAll(int fd, double timeout_s) {
  std::string out;
  const auto t0 = std::chrono::steady_clock::now();
  char buf[8192];
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < timeout_s) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

int StatusOf(const std::string& response) {
  if (response.rfind("HTTP/1.1 ", 0) != 0) return 0;
  return std::atoi(response.c_str() + 9);
}

}  // namespace dl::test
