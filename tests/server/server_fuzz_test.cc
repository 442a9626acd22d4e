// JSON and chat-template fuzzing of a real `decodelab serve` process (issue 21): a fixed seed drives
// random, mutated and hostile request bodies (tests/common/fuzz_gen.h) at every route, and random
// chat templates served by their own processes. The server must answer every request with an HTTP
// status (never a 500 for client input) and stay alive throughout. About a minute in total.
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <map>

#include <gtest/gtest.h>

#include "tests/common/fuzz_gen.h"
#include "tests/server/server_test_util.h"

namespace dl::test {
namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kSeed = 0x21;

// A template that walks everything a request can carry: messages, tool calls, tools and kwargs.
constexpr const char* kKitchenSinkTemplate = R"TPL(
{%- set ns = namespace(system='', n=0) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{%- set ns.system = ns.system ~ (m.content|string)|trim -%}{%- endif -%}
  {%- set ns.n = ns.n + 1 -%}
{%- endfor -%}
<system>{{ ns.system|default('You are helpful.') }}</system>
{%- if tools -%}<tools>{{ tools|tojson }}{% for t in tools if t is mapping %}{{ t.get('function', {}).get('name', '')|string|upper }}{% endfor %}</tools>{%- endif -%}
{%- for m in messages -%}
  <{{ m.role }}>{{ m.content|string|replace('<', '&lt;') }}
  {%- if m.tool_calls is defined and m.tool_calls is iterable %}{% for c in m.tool_calls %}{{ c|tojson(indent=1) }}{% endfor %}{% endif -%}
  </{{ m.role }}>
{%- endfor -%}
{%- if extra is defined %}{{ extra|string|length }}{{ extra|tojson|length }}{% endif -%}
{%- if items is defined and items is iterable and items is not string %}{{ items|map('string')|unique|sort|join(',') }}{% endif -%}
{%- if add_generation_prompt %}<assistant>{% endif -%})TPL";

std::vector<int32_t> RandomIds(fuzz::Rng& r) {
  std::vector<int32_t> ids;
  for (int64_t i = 0, n = r.Int(1, 12); i < n; ++i) ids.push_back(static_cast<int32_t>(r.Int(3, 500)));
  return ids;
}

ojson RandomMessages(fuzz::Rng& r) {
  static const std::vector<std::string> roles = {"system", "user", "assistant", "tool", "developer"};
  ojson ms = ojson::array();
  for (int64_t i = 0, n = r.Int(1, 4); i < n; ++i) {
    ojson m = {{"role", r.Pick(roles)}, {"content", fuzz::RandomText(r, 12)}};
    if (r.Chance(0.2)) m["content"] = ojson::array({{{"type", "text"}, {"text", fuzz::RandomText(r)}}});
    if (r.Chance(0.1)) m["content"] = fuzz::RandomJson(r);
    if (r.Chance(0.15)) {
      m["tool_calls"] = ojson::array({{{"type", "function"},
                                       {"function", {{"name", "f"}, {"arguments", fuzz::RandomJson(r)}}}}});
    }
    if (r.Chance(0.1)) m["extra_field"] = fuzz::RandomJson(r);
    ms.push_back(m);
  }
  return ms;
}

// A request body: mostly well formed with random field values, sometimes damaged bytes.
std::string RandomBody(fuzz::Rng& r, bool chat, bool* stream) {
  ojson b = ojson::object();
  if (chat) {
    b["messages"] = RandomMessages(r);
  } else {
    b["prompt"] = r.Chance(0.6) ? ojson(RandomIds(r)) : ojson(fuzz::RandomText(r, 8));
  }
  b["max_tokens"] = r.Int(1, 4);
  if (r.Chance(0.5)) b["temperature"] = r.Chance(0.5) ? 0.0 : 0.7;
  static const std::vector<std::string> fields = {
      "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
      "stop", "stop_token_ids", "logprobs", "top_logprobs", "n", "best_of", "echo", "suffix",
      "ignore_eos", "stream_options", "tools", "chat_template_kwargs", "user", "messages",
      "prompt"};
  for (int64_t i = 0, n = r.Int(0, 4); i < n; ++i) b[r.Pick(fields)] = fuzz::RandomJson(r);
  if (chat && r.Chance(0.3)) b["tools"] = ojson::array({{{"type", "function"},
                                                          {"function", {{"name", fuzz::RandomText(r, 3)},
                                                                        {"parameters", fuzz::RandomJson(r)}}}}});
  if (chat && r.Chance(0.3)) {
    b["chat_template_kwargs"] = {{"extra", fuzz::RandomJson(r)}, {"items", fuzz::RandomJson(r)}};
  }
  *stream = r.Chance(0.25);
  if (*stream) {
    b["stream"] = true;
    if (r.Chance(0.5)) b["stream_options"] = {{"include_usage", true}};
  }
  std::string text = b.dump();
  if (r.Chance(0.3)) text = fuzz::Mutate(r, text);
  return text;
}

// A raw HTTP exchange with random header damage; returns the status line's code (0: none).
int RawRequest(int port, fuzz::Rng& r, const std::string& body) {
  const int fd = Connect(port);
  if (fd < 0) return -1;
  static const std::vector<std::string> lines = {
      "Content-Encoding: gzip\r\n", "Transfer-Encoding: chunked\r\n", "Content-Length: -5\r\n",
      "Content-Length: 99999999999999999999\r\n", "Expect: 100-continue\r\n",
      "Range: bytes=0-1\r\n", "Connection: close\r\n", "X-\xff\xfe: \xc3\r\n",
      "Authorization: Bearer \x01\r\n", "Host:\r\n", "\r\n"};
  std::string req = r.Pick(std::vector<std::string>{"POST /v1/completions", "POST /v1/chat/completions",
                                                    "GET /v1/models", "GET /%FF%00", "PUT /v1/completions",
                                                    "DELETE /health", "OPTIONS *", "POST /v1/../x"}) +
                    r.Pick(std::vector<std::string>{" HTTP/1.1\r\n", " HTTP/1.0\r\n", " HTTP/9\r\n", "\r\n"});
  for (int64_t i = 0, n = r.Int(0, 3); i < n; ++i) req += r.Pick(lines);
  req += "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  (void)SendAll(fd, req);
  ::shutdown(fd, SHUT_WR);
  const std::string out = ReadAll(fd, 15);
  ::close(fd);
  return StatusOf(out);
}

TEST(ServerFuzzTest, RandomAndMutatedRequestsNeverTakeTheServerDown) {
  ServeProcessOptions o;
  o.model_dir = TinyModelCopy(kKitchenSinkTemplate);
  ASSERT_FALSE(o.model_dir.empty());
  auto server = ServeProcess::Start(o);
  ASSERT_NE(server, nullptr);
  fuzz::Rng r(kSeed);
  std::map<int, int> statuses;
  const auto t0 = Clock::now();
  // A fixed sequence; on a slow machine only its prefix that fits the time cap runs.
  constexpr int kRequests = 10000;
  constexpr double kMaxSeconds = 90;
  std::string last;
  int done = 0;
  for (int i = 0; i < kRequests && std::chrono::duration<double>(Clock::now() - t0).count() < kMaxSeconds;
       ++i, ++done) {
    const int64_t kind = r.Int(0, 19);
    int status = 0;
    if (kind < 2) {
      bool unused = false;
      const std::string body = RandomBody(r, r.Chance(0.5), &unused);
      last = "raw #" + std::to_string(i) + ": " + body.substr(0, 200);
      status = RawRequest(server->port(), r, body);
    } else if (kind < 3) {
      auto cli = server->Client(30);
      const std::string path = r.Pick(std::vector<std::string>{
          "/v1/models", "/health", "/metrics", "/v1/decodelab/state", "/v1/" + fuzz::RandomText(r, 3)});
      last = "GET " + path;
      auto res = Get(cli, path);
      status = res.status;
    } else {
      const bool chat = kind < 12;
      bool stream = false;
      const std::string body = RandomBody(r, chat, &stream);
      const std::string route = chat ? "/v1/chat/completions" : "/v1/completions";
      last = route + " #" + std::to_string(i) + ": " + body.substr(0, 300);
      auto cli = server->Client(30);
      if (stream) {
        httplib::Request req;
        req.method = "POST";
        req.path = route;
        req.body = body;
        req.set_header("Content-Type", "application/json");
        std::string raw;
        req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
          raw.append(d, n);
          return true;
        };
        auto res = cli.send(req);
        status = res ? res->status : 0;
        // A mutation may have removed "stream": only an event stream must end with [DONE].
        if (status == 200 && raw.rfind("data: ", 0) == 0) {
          EXPECT_NE(raw.find("data: [DONE]"), std::string::npos) << last << "\n" << raw.substr(0, 300);
        }
      } else {
        auto res = PostRaw(cli, route, body);
        status = res.status;
        if (status >= 400) {
          EXPECT_TRUE(res.json.is_object() && res.json.contains("error")) << last << "\n" << res.body;
        }
      }
    }
    ++statuses[status];
    EXPECT_NE(status, 500) << "a 500 for client input: " << last;
    if (i % 100 == 99) {
      ASSERT_TRUE(server->Alive()) << "server down after " << last << "\n" << server->Log();
    }
  }
  std::string summary;
  for (const auto& [s, n] : statuses) summary += " " + std::to_string(s) + ":" + std::to_string(n);
  std::printf("seed %llu: %d requests in %.1f s; statuses%s\n", static_cast<unsigned long long>(kSeed),
              done, std::chrono::duration<double>(Clock::now() - t0).count(), summary.c_str());
  EXPECT_GT(statuses[200], done / 20) << "the fuzzer must reach generation, not only errors";
  EXPECT_TRUE(server->Answers()) << server->Log();
}

TEST(ServerFuzzTest, RandomChatTemplatesNeverTakeTheServerDown) {
  fuzz::Rng r(kSeed + 1);
  fuzz::TemplateGen gen(r);
  const auto t0 = Clock::now();
  int served = 0, templates = 0;
  for (int t = 0; t < 120 && std::chrono::duration<double>(Clock::now() - t0).count() < 60; ++t) {
    ++templates;
    const std::string tmpl = gen.Template();
    ServeProcessOptions o;
    o.model_dir = TinyModelCopy(tmpl);
    ASSERT_FALSE(o.model_dir.empty());
    auto server = ServeProcess::Start(o);
    ASSERT_NE(server, nullptr) << "template " << t << ":\n" << tmpl;
    auto cli = server->Client(30);
    for (int k = 0; k < 8; ++k) {
      bool stream = false;
      const std::string body = RandomBody(r, true, &stream);
      auto res = PostRaw(cli, "/v1/chat/completions", body);
      EXPECT_NE(res.status, 0) << "template " << t << ", body " << body.substr(0, 200);
      EXPECT_NE(res.status, 500) << "template " << t << ":\n" << tmpl << "\nbody " << body.substr(0, 200)
                                 << "\n" << res.body;
      served += res.status == 200;
      ASSERT_TRUE(server->Alive()) << "template " << t << " took the server down:\n" << tmpl << "\n"
                                   << server->Log();
    }
    EXPECT_TRUE(server->Answers()) << "template " << t;
  }
  std::printf("seed %llu: %d templates x 8 chats in %.1f s, %d answered 200\n",
              static_cast<unsigned long long>(kSeed + 1), templates,
              std::chrono::duration<double>(Clock::now() - t0).count(), served);
}

}  // namespace
}  // namespace dl::test
