#include "tests/server/server_test_util.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>

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
                                     .enable_prefix_caching = c.prefix_caching});
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

}  // namespace dl::test
