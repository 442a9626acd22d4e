#include "engine/scheduler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include <spdlog/spdlog.h>

#include "base/rng.h"

namespace dl {

using Clock = std::chrono::steady_clock;

namespace {

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// vLLM's bucket edges (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read ours.
std::vector<double> TtftBuckets() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
          2.5,   5.0,   7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
}
std::vector<double> ItlBuckets() {
  return {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
          20.0, 40.0, 80.0};
}
std::vector<double> E2eBuckets() {
  return {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
          120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
}

uint64_t HashBlock(uint64_t parent, const int32_t* tokens, int32_t n) {
  uint64_t h = 0xcbf29ce484222325ull ^ SplitMix64(parent);
  for (int32_t i = 0; i < n; ++i) {
    h ^= static_cast<uint32_t>(tokens[i]);
    h *= 0x100000001b3ull;
  }
  return SplitMix64(h);
}

}  // namespace

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "none";
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
    case FinishReason::kCancelled: return "abort";
    case FinishReason::kError: return "error";
  }
  return "none";
}

void Histogram::Observe(double v) {
  size_t i = std::lower_bound(bounds.begin(), bounds.end(), v) - bounds.begin();
  ++counts[i];
  sum += v;
  ++count;
}

// ---- RequestState ----

bool RequestState::Poll(Update* out, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return !pending_.empty() || finished_; });
  out->tokens.clear();
  out->tokens.swap(pending_);
  out->finished = finished_;
  out->reason = reason_;
  out->error = error_;
  out->prompt_tokens = prompt_tokens_;
  out->cached_tokens = cached_tokens_;
  return !out->tokens.empty() || finished_;
}

void RequestState::PushToken(TokenEvent event) {
  {
    std::lock_guard lock(mu_);
    pending_.push_back(std::move(event));
  }
  cv_.notify_all();
}

void RequestState::Finish(FinishReason reason, Status error) {
  {
    std::lock_guard lock(mu_);
    if (finished_) return;
    finished_ = true;
    reason_ = reason;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

void RequestState::SetPromptInfo(int32_t prompt_tokens, int32_t cached_tokens) {
  std::lock_guard lock(mu_);
  prompt_tokens_ = prompt_tokens;
  cached_tokens_ = cached_tokens;
}

// ---- Scheduler ----

struct Scheduler::Sequence {
  std::shared_ptr<RequestState> state;
  GenerationRequest req;
  SequenceKv kv;
  bool has_kv = false;
  int32_t prefilled = 0;  // prompt positions whose KV is written (or attached from the cache)
  int32_t cached = 0;
  int32_t generated = 0;
  std::vector<int32_t> generated_ids;  // for the penalties
  int32_t last_token = -1;
  int32_t registered_blocks = 0;
  std::vector<uint64_t> block_hashes;  // chained hashes of the prompt's whole pages
  std::vector<float> logits;
  std::vector<float> processed;  // logits after ApplyLogitProcessors
  uint64_t key = 0;
  bool done = false;
  uint64_t stamp = 0;  // prefix-cache recency of this request
  Clock::time_point arrival, admitted, last_emit;
};

Scheduler::Scheduler(Engine& engine, SchedulerOptions options)
    : engine_(engine), options_(options) {
  options_.max_batch = std::max(1, options_.max_batch);
  options_.prefill_chunk =
      std::clamp(options_.prefill_chunk, 1, std::max(1, engine.options.prefill_chunk));
  stats_.ttft = Histogram(TtftBuckets());
  stats_.itl = Histogram(ItlBuckets());
  stats_.e2e = Histogram(E2eBuckets());
  stats_.queue_time = Histogram(E2eBuckets());
}

Scheduler::~Scheduler() { Stop(); }

void Scheduler::Start() {
  std::lock_guard lock(mu_);
  if (started_) return;
  started_ = true;
  thread_ = std::thread([this] { Loop(); });
}

void Scheduler::Stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // Never started, or requests that arrived after the loop exited.
  std::deque<std::unique_ptr<Sequence>> left;
  {
    std::lock_guard lock(mu_);
    left.swap(incoming_);
  }
  for (auto& s : left) FinishSequence(*s, FinishReason::kCancelled, Unavailable("server shutting down"));
}

Result<std::shared_ptr<RequestState>> Scheduler::Submit(GenerationRequest r) {
  const ModelConfig& cfg = engine_.config();
  const SamplingParams& p = r.sampling;
  if (r.prompt.empty()) return InvalidArgument("the prompt is empty");
  for (size_t i = 0; i < r.prompt.size(); ++i) {
    if (r.prompt[i] < 0 || r.prompt[i] >= cfg.vocab_size) {
      return InvalidArgument("prompt token {} (at index {}) is outside the vocabulary [0, {})",
                             r.prompt[i], i, cfg.vocab_size);
    }
  }
  if (p.max_tokens < 1) return InvalidArgument("max_tokens must be at least 1 (got {})", p.max_tokens);
  const int64_t total = static_cast<int64_t>(r.prompt.size()) + p.max_tokens;
  if (total > max_context()) {
    return InvalidArgument(
        "this model's maximum context length is {} tokens; the request asks for {} ({} in the "
        "prompt + {} to generate)",
        max_context(), total, r.prompt.size(), p.max_tokens);
  }
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) {
    return InvalidArgument("temperature must be >= 0");
  }
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return InvalidArgument("top_p must be in (0, 1]");
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) return InvalidArgument("min_p must be in [0, 1]");
  if (!(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f)) {
    return InvalidArgument("presence_penalty must be in [-2, 2]");
  }
  if (!(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f)) {
    return InvalidArgument("frequency_penalty must be in [-2, 2]");
  }
  if (!(p.repetition_penalty > 0.0f) || !std::isfinite(p.repetition_penalty)) {
    return InvalidArgument("repetition_penalty must be > 0 (1 = off)");
  }
  for (const auto& [t, bias] : p.logit_bias) {
    if (t < 0 || t >= cfg.vocab_size) {
      return InvalidArgument("logit_bias token id {} is outside the vocabulary [0, {})", t,
                             cfg.vocab_size);
    }
    if (std::isnan(bias)) return InvalidArgument("logit_bias for token {} is not a number", t);
  }
  for (int32_t t : p.stop_token_ids) {
    if (t < 0 || t >= cfg.vocab_size) {
      return InvalidArgument("stop token id {} is outside the vocabulary [0, {})", t, cfg.vocab_size);
    }
  }
  auto s = std::make_unique<Sequence>();
  s->state = std::make_shared<RequestState>();
  s->arrival = Clock::now();
  const uint64_t seed = p.seed ? *p.seed : (static_cast<uint64_t>(std::random_device{}()) << 32) ^
                                               std::random_device{}();
  s->key = StreamKey(seed, "decodelab-sampling-v1");
  s->req = std::move(r);
  s->state->SetPromptInfo(static_cast<int32_t>(s->req.prompt.size()), 0);
  auto state = s->state;
  {
    std::lock_guard lock(mu_);
    if (stop_) return Unavailable("the server is shutting down");
    std::lock_guard slock(stats_mu_);
    if (static_cast<int64_t>(incoming_.size()) + stats_.waiting >= options_.max_waiting) {
      return ResourceExhausted("the server is overloaded: {} requests are already waiting",
                               options_.max_waiting);
    }
    state->id_ = next_id_++;
    incoming_.push_back(std::move(s));
  }
  cv_.notify_all();
  return state;
}

SchedulerStats Scheduler::Stats() const {
  std::lock_guard lock(stats_mu_);
  SchedulerStats s = stats_;
  return s;
}

int32_t Scheduler::prefix_cache_pages() const { return cache_pages_.load(); }

void Scheduler::ClearPrefixCache() {
  clear_cache_.store(true);
  cv_.notify_all();
}

void Scheduler::Loop() {
  while (true) {
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] {
        return stop_ || !incoming_.empty() || !running_.empty() || !waiting_.empty() ||
               clear_cache_.load();
      });
      if (stop_) break;
      while (!incoming_.empty()) {
        waiting_.push_back(std::move(incoming_.front()));
        incoming_.pop_front();
      }
    }
    if (clear_cache_.exchange(false)) DropPrefixCacheLocked();

    // Requests cancelled while queued never touch the model.
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if ((*it)->state->cancelled()) {
        FinishSequence(**it, FinishReason::kCancelled, Status(StatusCode::kCancelled, "cancelled"));
        it = waiting_.erase(it);
      } else {
        ++it;
      }
    }
    // Admission: join the running set between steps.
    while (static_cast<int32_t>(running_.size()) < options_.max_batch && !waiting_.empty()) {
      auto s = std::move(waiting_.front());
      waiting_.pop_front();
      s->admitted = Clock::now();
      s->stamp = ++use_clock_;
      {
        std::lock_guard slock(stats_mu_);
        stats_.queue_time.Observe(Seconds(s->arrival, s->admitted));
      }
      if (options_.enable_prefix_caching) {
        Status st = AttachCachedPrefix(*s);
        if (!st.ok()) spdlog::warn("prefix cache: {}", st.message());
      }
      s->state->SetPromptInfo(static_cast<int32_t>(s->req.prompt.size()), s->cached);
      running_.push_back(std::move(s));
    }
    // One step: one Forward per running sequence.
    for (auto& s : running_) {
      if (s->state->cancelled()) {
        FinishSequence(*s, FinishReason::kCancelled, Status(StatusCode::kCancelled, "cancelled"));
        continue;
      }
      Status st = Step(*s);
      if (!st.ok()) {
        spdlog::error("request {}: {}", s->state->id(), st.message());
        FinishSequence(*s, FinishReason::kError, st);
      }
    }
    running_.erase(std::remove_if(running_.begin(), running_.end(),
                                  [](const auto& s) { return s->done; }),
                   running_.end());
    PublishStats();
  }
  // Shutdown: nothing hangs; every stream learns why it ended.
  for (auto& s : running_) {
    FinishSequence(*s, FinishReason::kCancelled, Unavailable("server shutting down"));
  }
  for (auto& s : waiting_) {
    FinishSequence(*s, FinishReason::kCancelled, Unavailable("server shutting down"));
  }
  running_.clear();
  waiting_.clear();
  DropPrefixCacheLocked();
  PublishStats();
}

Status Scheduler::ReserveWithEviction(Sequence& s, int32_t n) {
  while (true) {
    Status st = engine_.kv->Reserve(s.kv, n);
    s.has_kv = true;
    if (st.ok() || st.code() != StatusCode::kResourceExhausted) return st;
    if (!EvictOneBlock()) return st;
  }
}

Status Scheduler::Step(Sequence& s) {
  KvCache& kv = *engine_.kv;
  ModelRunner& runner = *engine_.runner;
  const int32_t prompt_len = static_cast<int32_t>(s.req.prompt.size());
  if (s.prefilled < prompt_len) {
    const int32_t n = std::min(options_.prefill_chunk, prompt_len - s.prefilled);
    DL_RETURN_IF_ERROR(ReserveWithEviction(s, n));
    std::span<const int32_t> chunk(s.req.prompt.data() + s.prefilled, static_cast<size_t>(n));
    DL_RETURN_IF_ERROR(runner.Forward(s.kv, chunk, false, &s.logits));
    // Register before Commit: Commit lets go of sliding pages the cache may want to keep.
    if (options_.enable_prefix_caching) RegisterPromptBlocks(s, s.prefilled, s.prefilled + n);
    DL_RETURN_IF_ERROR(kv.Commit(s.kv, n));
    s.prefilled += n;
    if (s.prefilled < prompt_len) return Status::Ok();
  } else {
    DL_RETURN_IF_ERROR(ReserveWithEviction(s, 1));
    DL_RETURN_IF_ERROR(runner.Forward(s.kv, std::span<const int32_t>(&s.last_token, 1), false,
                                      &s.logits));
    DL_RETURN_IF_ERROR(kv.Commit(s.kv, 1));
  }
  const SamplingParams& p = s.req.sampling;
  TokenEvent ev;
  std::span<const float> logits = s.logits;
  if (HasLogitProcessors(p)) {
    s.processed.assign(s.logits.begin(), s.logits.end());
    ApplyLogitProcessors(s.processed, p, s.req.prompt, s.generated_ids);
    logits = s.processed;
  }
  ev.token = SampleToken(logits, p, s.key, static_cast<uint64_t>(s.generated));
  if (p.logprobs >= 0) ComputeLogprobs(s.logits, ev.token, p.logprobs, &ev);
  const int32_t tok = ev.token;
  const auto now = Clock::now();
  {
    std::lock_guard slock(stats_mu_);
    if (s.generated == 0) {
      stats_.ttft.Observe(Seconds(s.arrival, now));
    } else {
      stats_.itl.Observe(Seconds(s.last_emit, now));
    }
    ++stats_.generation_tokens_total;
  }
  s.last_emit = now;
  ++s.generated;
  s.generated_ids.push_back(tok);
  s.state->PushToken(std::move(ev));
  const auto& eos = engine_.config().eos_token_ids;
  const bool is_eos = !p.ignore_eos && std::find(eos.begin(), eos.end(), tok) != eos.end();
  const bool is_stop = std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), tok) !=
                       p.stop_token_ids.end();
  if (is_eos || is_stop) {
    FinishSequence(s, FinishReason::kStop);
  } else if (s.generated >= p.max_tokens) {
    FinishSequence(s, FinishReason::kLength);
  } else {
    s.last_token = tok;
  }
  return Status::Ok();
}

void Scheduler::FinishSequence(Sequence& s, FinishReason reason, Status error) {
  if (s.done) return;
  s.done = true;
  if (s.has_kv && engine_.kv) {
    Status st = engine_.kv->Release(s.kv);
    if (!st.ok()) spdlog::error("request {}: releasing KV pages: {}", s.state->id(), st.message());
  }
  {
    std::lock_guard slock(stats_mu_);
    ++stats_.finished_total[FinishReasonName(reason)];
    if (reason == FinishReason::kLength || reason == FinishReason::kStop) {
      stats_.e2e.Observe(Seconds(s.arrival, Clock::now()));
      stats_.prompt_tokens_total += s.req.prompt.size();
      stats_.cached_prompt_tokens_total += static_cast<uint64_t>(s.cached);
    }
  }
  s.state->Finish(reason, std::move(error));
}

void Scheduler::PublishStats() {
  KvCache& kv = *engine_.kv;
  std::lock_guard slock(stats_mu_);
  stats_.running = static_cast<int32_t>(running_.size());
  stats_.waiting = static_cast<int32_t>(waiting_.size());
  stats_.kv_usage = kv.usage();
  stats_.kv_pages_used = kv.used_pages(KvGroup::kFull) + kv.used_pages(KvGroup::kSliding);
  stats_.kv_pages_total = kv.total_pages(KvGroup::kFull) + kv.total_pages(KvGroup::kSliding);
  stats_.prefix_cache_blocks = static_cast<int32_t>(blocks_.size());
  ++stats_.steps_total;
}

// ---- prefix cache ----

Status Scheduler::AttachCachedPrefix(Sequence& s) {
  KvCache& kv = *engine_.kv;
  const int32_t page = kv.spec().page_size;
  const int32_t prompt_len = static_cast<int32_t>(s.req.prompt.size());
  const int32_t whole = prompt_len / page;
  s.block_hashes.resize(static_cast<size_t>(whole));
  uint64_t parent = 0x5eed;
  for (int32_t i = 0; i < whole; ++i) {
    parent = HashBlock(parent, s.req.prompt.data() + static_cast<size_t>(i) * page, page);
    s.block_hashes[i] = parent;
  }
  // At least one prompt token must run through the model to give the first token's logits.
  const int32_t max_blocks = (prompt_len - 1) / page;
  int32_t m = 0;
  while (m < max_blocks && blocks_.count(s.block_hashes[m])) ++m;
  const bool sliding = kv.has_group(KvGroup::kSliding);
  const int32_t w = kv.spec().sliding_window;
  auto first_needed = [&](int32_t blocks) { return std::max(0, blocks * page - w + 1) / page; };
  // A sliding-window layer needs the window's keys before the prefix end: shrink the match until
  // every block in that window still has its sliding page.
  while (m > 0 && sliding) {
    bool ok = true;
    for (int32_t i = first_needed(m); i < m; ++i) {
      if (blocks_[s.block_hashes[i]].sliding_page < 0) {
        ok = false;
        break;
      }
    }
    if (ok) break;
    --m;
  }
  if (m == 0) return Status::Ok();
  std::vector<int32_t> full, slide;
  const int32_t first = first_needed(m);
  for (int32_t i = 0; i < m; ++i) {
    CachedBlock& b = blocks_[s.block_hashes[i]];
    b.last_use = s.stamp;
    if (kv.has_group(KvGroup::kFull)) full.push_back(b.full_page);
    if (sliding) slide.push_back(i >= first ? b.sliding_page : -1);
  }
  DL_RETURN_IF_ERROR(kv.AttachPrefix(s.kv, m * page, full, slide));
  s.has_kv = true;
  s.prefilled = m * page;
  s.cached = m * page;
  s.registered_blocks = m;
  return Status::Ok();
}

void Scheduler::RegisterPromptBlocks(Sequence& s, int32_t /*begin*/, int32_t end) {
  KvCache& kv = *engine_.kv;
  const int32_t page = kv.spec().page_size;
  const int32_t upto = std::min<int32_t>(end / page, static_cast<int32_t>(s.block_hashes.size()));
  for (int32_t i = s.registered_blocks; i < upto; ++i) {
    const uint64_t h = s.block_hashes[i];
    auto it = blocks_.find(h);
    if (it != blocks_.end()) {
      it->second.last_use = s.stamp;
      continue;
    }
    CachedBlock b;
    const auto& ft = s.kv.block_table(KvGroup::kFull);
    const auto& st = s.kv.block_table(KvGroup::kSliding);
    if (i < static_cast<int32_t>(ft.size()) && ft[i] >= 0) b.full_page = ft[i];
    if (i < static_cast<int32_t>(st.size()) && st[i] >= 0) b.sliding_page = st[i];
    if (kv.has_group(KvGroup::kFull) && b.full_page < 0) break;  // cannot happen: full pages stay
    if (b.full_page >= 0 && kv.RetainPage(KvGroup::kFull, b.full_page).ok()) ++cache_pages_;
    if (b.sliding_page >= 0 && kv.RetainPage(KvGroup::kSliding, b.sliding_page).ok()) ++cache_pages_;
    b.last_use = s.stamp;
    b.depth = i;
    blocks_.emplace(h, b);
  }
  s.registered_blocks = std::max(s.registered_blocks, upto);
}

bool Scheduler::EvictOneBlock() {
  KvCache& kv = *engine_.kv;
  auto frees = [&](const CachedBlock& b) {
    return (b.full_page >= 0 && kv.page_refs(KvGroup::kFull, b.full_page) == 1) ||
           (b.sliding_page >= 0 && kv.page_refs(KvGroup::kSliding, b.sliding_page) == 1);
  };
  auto victim = blocks_.end();
  for (auto it = blocks_.begin(); it != blocks_.end(); ++it) {
    if (!frees(it->second)) continue;
    if (victim == blocks_.end() || it->second.last_use < victim->second.last_use ||
        (it->second.last_use == victim->second.last_use && it->second.depth > victim->second.depth)) {
      victim = it;
    }
  }
  if (victim == blocks_.end()) return false;
  DropBlock(victim);
  return true;
}

void Scheduler::DropBlock(std::unordered_map<uint64_t, CachedBlock>::iterator it) {
  KvCache& kv = *engine_.kv;
  if (it->second.full_page >= 0) {
    (void)kv.ReleasePage(KvGroup::kFull, it->second.full_page);
    --cache_pages_;
  }
  if (it->second.sliding_page >= 0) {
    (void)kv.ReleasePage(KvGroup::kSliding, it->second.sliding_page);
    --cache_pages_;
  }
  blocks_.erase(it);
}

void Scheduler::DropPrefixCacheLocked() {
  while (!blocks_.empty()) DropBlock(blocks_.begin());
}

}  // namespace dl
