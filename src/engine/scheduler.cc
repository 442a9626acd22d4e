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
  // The context: the prompt, then every token emitted so far. Positions below kv.length() are in
  // the cache; the rest run through the model (all of it after a preemption).
  std::vector<int32_t> tokens;
  int32_t cached = 0;
  int32_t generated = 0;
  int32_t registered_blocks = 0;
  std::vector<uint64_t> block_hashes;  // chained hashes of the prompt's whole pages
  uint64_t key = 0;
  bool done = false;
  uint64_t stamp = 0;  // prefix-cache recency of this request
  Clock::time_point arrival, admitted, last_emit;
  // This step's rows (set while planning), and its drafts when it verifies (rows = 1 + drafts).
  int32_t step_rows = 0;
  int32_t first_row = 0;  // of this step's rows in the batch
  std::vector<int32_t> drafts;
  // The drafter's state of this sequence (0: none yet; dropped on preemption and finish).
  uint64_t draft_seq = 0;
  int32_t computed() const { return kv.length(); }
};

Scheduler::Scheduler(Engine& engine, SchedulerOptions options)
    : engine_(engine), options_(options) {
  options_.max_batch = std::max(1, options_.max_batch);
  options_.max_batch = std::min(options_.max_batch, std::max(1, engine.runner->max_outputs()));
  options_.max_tokens_per_step =
      std::clamp(options_.max_tokens_per_step, options_.max_batch, std::max(1, engine.runner->max_rows()));
  options_.prefill_chunk = std::clamp(options_.prefill_chunk, 1, options_.max_tokens_per_step);
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
  if (options_.enable_prefix_caching && options_.drafter && !options_.drafter->hidden_taps().empty()) {
    // A cached prompt page is never run, so the drafter would get no hidden states for it.
    return Unimplemented("prefix caching with the {} drafter is not supported (the drafter needs the target's hidden "
                         "states of every prompt position; cached pages skip that forward)",
                         options_.drafter->name());
  }
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
  s->tokens = s->req.prompt;
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

    // Requests cancelled while queued never touch the model; cancelled running ones leave now.
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if ((*it)->state->cancelled()) {
        FinishSequence(**it, FinishReason::kCancelled, Status(StatusCode::kCancelled, "cancelled"));
        it = waiting_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto& s : running_) {
      if (s->state->cancelled()) {
        FinishSequence(*s, FinishReason::kCancelled, Status(StatusCode::kCancelled, "cancelled"));
      }
    }
    running_.erase(std::remove_if(running_.begin(), running_.end(), [](const auto& s) { return s->done; }),
                   running_.end());
    Admit();
    if (!running_.empty()) Step();
    running_.erase(std::remove_if(running_.begin(), running_.end(), [](const auto& s) { return s->done; }),
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

namespace {

// Pages a sequence needs for positions [0, n) in each group the cache has (the most a first chunk of
// n tokens can take).
bool FirstChunkFits(const KvCache& kv, int32_t n) {
  const int32_t pages = (n + kv.spec().page_size - 1) / kv.spec().page_size;
  for (KvGroup g : {KvGroup::kFull, KvGroup::kSliding}) {
    if (!kv.has_group(g)) continue;
    if (kv.total_pages(g) - kv.used_pages(g) < pages) return false;
  }
  return true;
}

}  // namespace

void Scheduler::Admit() {
  KvCache& kv = *engine_.kv;
  while (static_cast<int32_t>(running_.size()) < options_.max_batch && !waiting_.empty()) {
    Sequence& next = *waiting_.front();
    const int32_t first_chunk =
        std::min<int32_t>(options_.prefill_chunk, static_cast<int32_t>(next.tokens.size()));
    // With sequences running, a new one waits until its first chunk fits (otherwise the step would
    // preempt it straight away); alone, it is admitted and the step says if it cannot fit at all.
    if (!running_.empty() && !FirstChunkFits(kv, first_chunk)) {
      while (EvictOneBlock() && !FirstChunkFits(kv, first_chunk)) {
      }
      if (!FirstChunkFits(kv, first_chunk)) break;
    }
    auto s = std::move(waiting_.front());
    waiting_.pop_front();
    if (s->generated == 0) {  // a preempted sequence keeps its first admission's timings
      s->admitted = Clock::now();
      std::lock_guard slock(stats_mu_);
      stats_.queue_time.Observe(Seconds(s->arrival, s->admitted));
    }
    s->stamp = ++use_clock_;
    if (options_.enable_prefix_caching) {
      Status st = AttachCachedPrefix(*s);
      if (!st.ok()) spdlog::warn("prefix cache: {}", st.message());
    }
    s->state->SetPromptInfo(static_cast<int32_t>(s->req.prompt.size()), s->cached);
    running_.push_back(std::move(s));
  }
}

Status Scheduler::ReserveForStep(Sequence& s, int32_t n, size_t index) {
  KvCache& kv = *engine_.kv;
  while (true) {
    Status st = kv.Reserve(s.kv, n);
    s.has_kv = true;
    if (st.ok() || st.code() != StatusCode::kResourceExhausted) return st;
    if (EvictOneBlock()) continue;
    // Preempt the newest running sequence that is not yet in this step.
    size_t victim = running_.size();
    for (size_t i = running_.size(); i-- > 0;) {
      if (i != index && !running_[i]->done && running_[i]->step_rows == 0) {
        victim = i;
        break;
      }
    }
    if (victim == running_.size()) return st;
    Preempt(victim);
  }
}

void Scheduler::Preempt(size_t index) {
  Sequence& s = *running_[index];
  if (s.has_kv) {
    Status st = engine_.kv->Release(s.kv);
    if (!st.ok()) spdlog::error("request {}: releasing KV pages: {}", s.state->id(), st.message());
    s.has_kv = false;
  }
  s.cached = 0;
  s.registered_blocks = 0;
  s.block_hashes.clear();
  s.step_rows = 0;
  s.drafts.clear();
  if (s.draft_seq != 0) {
    options_.drafter->Forget(s.draft_seq);  // recomputation feeds the drafter again from position 0
    s.draft_seq = 0;
  }
  {
    std::lock_guard slock(stats_mu_);
    ++stats_.preemptions_total;
  }
  spdlog::debug("request {} preempted (KV pages exhausted): it will be recomputed", s.state->id());
  // Back to the front of the queue; `done` marks the running slot for removal.
  auto moved = std::move(running_[index]);
  moved->done = false;
  waiting_.push_front(std::move(moved));
  running_[index] = std::make_unique<Sequence>();
  running_[index]->done = true;
}

void Scheduler::Step() {
  KvCache& kv = *engine_.kv;
  ModelRunner& runner = *engine_.runner;
  ForwardBatch batch;
  std::vector<Sequence*> in_batch;
  int32_t budget = options_.max_tokens_per_step;
  bool any_prefill = false;
  bool any_verify = false;
  // Rows and outputs drafts may take: what is left after one row and one output for every running
  // sequence (drafts never push a decode row or a finishing prompt's output out of the step).
  int32_t active = 0, decoders_left = 0;
  for (auto& s : running_) {
    s->step_rows = 0;
    s->drafts.clear();
    if (s->done) continue;
    ++active;
    if (static_cast<int32_t>(s->tokens.size()) - s->computed() == 1) ++decoders_left;
  }
  // Whether `rows` positions for s leave a free page in each group for each of `others` decode rows
  // still to plan: drafts only take pages nobody in this step needs, so they never cause a preemption.
  auto draft_pages_fit = [&](const Sequence& s, int32_t rows, int32_t others) {
    const int32_t page = kv.spec().page_size;
    const int32_t pages = (s.kv.length() + rows + page - 1) / page;
    for (KvGroup g : {KvGroup::kFull, KvGroup::kSliding}) {
      if (!kv.has_group(g)) continue;
      const int32_t need = std::max(0, pages - static_cast<int32_t>(s.kv.block_table(g).size()));
      if (kv.total_pages(g) - kv.used_pages(g) - need < others) return false;
    }
    return true;
  };
  // A drafter that reads the target's hidden states: every forward returns them, and each sequence
  // gets a drafter state before its first forward.
  const bool speculate = options_.drafter && options_.num_draft_tokens > 0;
  if (speculate) batch.hidden_taps = options_.drafter->hidden_taps();
  int32_t spare_rows = budget - active;
  int32_t spare_outputs = runner.max_outputs() - active;
  // Two passes in admission order: decode rows first (one each, plus drafts), then prefill chunks
  // from what is left of the budget.
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
      Sequence& s = *running_[i];
      if (s.done) continue;
      const int32_t remaining = static_cast<int32_t>(s.tokens.size()) - s.computed();
      const bool decode = remaining == 1;
      if (decode != (pass == 0)) continue;
      int32_t n = decode ? 1 : std::min({remaining, options_.prefill_chunk, budget});
      Status st = Status::Ok();
      bool reserved = false;
      if (decode) --decoders_left;
      if (speculate && s.draft_seq == 0) s.draft_seq = options_.drafter->NewSequence();
      if (decode && speculate) {
        // At most the tokens the request still needs after this step's first one, so a verify
        // never writes past prompt + max_tokens - 1 (within the context limit Submit checked).
        const int32_t room = std::min({options_.num_draft_tokens, s.req.sampling.max_tokens - s.generated - 1,
                                       spare_rows, spare_outputs});
        if (room > 0) {
          const auto t0 = Clock::now();
          auto drafts = options_.drafter->ProposeFor(s.draft_seq, s.tokens, room);
          {
            std::lock_guard slock(stats_mu_);
            stats_.spec.drafter_seconds += Seconds(t0, Clock::now());
          }
          if (!drafts.ok()) {
            spdlog::error("request {}: drafter: {}", s.state->id(), drafts.status().message());
            FinishSequence(s, FinishReason::kError, drafts.status().WithContext("speculative drafter"));
            continue;
          }
          s.drafts = std::move(drafts).value();
          if (static_cast<int32_t>(s.drafts.size()) > room) s.drafts.resize(static_cast<size_t>(room));
        }
        // Short of pages: fewer drafts (halving), never a preemption for the sake of drafts.
        while (!s.drafts.empty()) {
          const int32_t rows = 1 + static_cast<int32_t>(s.drafts.size());
          if (draft_pages_fit(s, rows, decoders_left) && kv.Reserve(s.kv, rows).ok()) {
            reserved = true;
            break;
          }
          s.drafts.resize(s.drafts.size() / 2);
        }
        n = 1 + static_cast<int32_t>(s.drafts.size());
        spare_rows -= n - 1;
        spare_outputs -= n - 1;
      }
      if (!reserved) st = ReserveForStep(s, n, i);
      if (!st.ok()) {
        if (st.code() == StatusCode::kResourceExhausted && !in_batch.empty()) {
          Preempt(i);  // others hold the pages: wait for them, recomputing later
          continue;
        }
        spdlog::error("request {}: {}", s.state->id(), st.message());
        FinishSequence(s, FinishReason::kError,
                       st.code() == StatusCode::kResourceExhausted
                           ? ResourceExhausted("the KV cache cannot hold this request: {}", st.message())
                           : st);
        continue;
      }
      s.step_rows = n;
      if (!s.drafts.empty()) {
        // A verify: the last token and the drafts, an output on every row. Row j samples token
        // number generated + j as if drafts [0, j) had been emitted: the same key and step, and
        // logit processors over the same generated tokens, as plain decoding would give it.
        std::vector<int32_t> rows = {s.tokens.back()};
        rows.insert(rows.end(), s.drafts.begin(), s.drafts.end());
        const int32_t first = batch.AddSequence(s.kv, rows, static_cast<int32_t>(s.req.prompt.size()));
        s.first_row = first;
        const SamplingParams& p = s.req.sampling;
        const size_t prompt_len = s.req.prompt.size();
        // The generated tokens only matter to logit processors: copied only when there are some.
        const bool processors = HasLogitProcessors(p);
        std::vector<int32_t> generated;
        if (processors) generated.assign(s.tokens.begin() + static_cast<std::ptrdiff_t>(prompt_len), s.tokens.end());
        for (int32_t j = 0; j < n; ++j) {
          if (j > 0 && processors) generated.push_back(s.drafts[static_cast<size_t>(j - 1)]);
          OutputRequest& out = batch.AddOutput(first + j);
          out.sampling = RowSamplingFor(p, s.key, static_cast<uint64_t>(s.generated + j),
                                        std::span<const int32_t>(s.req.prompt), generated);
          out.want_logits = p.logprobs >= 0;
        }
        any_verify = true;
        in_batch.push_back(&s);
        budget -= n;
        continue;
      }
      const int32_t first =
          batch.AddSequence(s.kv, std::span<const int32_t>(s.tokens.data() + s.computed(), static_cast<size_t>(n)),
                            static_cast<int32_t>(s.req.prompt.size()));
      s.first_row = first;
      if (s.computed() + n == static_cast<int32_t>(s.tokens.size())) {
        OutputRequest& out = batch.AddOutput(first + n - 1);
        const SamplingParams& p = s.req.sampling;
        const std::span<const int32_t> context(s.tokens);
        const size_t prompt_len = s.req.prompt.size();
        out.sampling = RowSamplingFor(p, s.key, static_cast<uint64_t>(s.generated), context.first(prompt_len),
                                      context.subspan(prompt_len));
        out.want_logits = p.logprobs >= 0;
      }
      any_prefill = any_prefill || !decode;
      in_batch.push_back(&s);
      budget -= n;
    }
  }
  if (in_batch.empty()) return;
  batch.mode = any_prefill ? ForwardMode::kPrefill : (any_verify ? ForwardMode::kVerify : ForwardMode::kDecode);
  ForwardResult result;
  Status st = runner.Launch(batch);
  if (st.ok()) st = runner.Wait(&result);
  if (!st.ok()) {
    spdlog::error("step of {} sequences failed: {}", in_batch.size(), st.message());
    for (Sequence* s : in_batch) FinishSequence(*s, FinishReason::kError, st);
    return;
  }
  {
    std::lock_guard slock(stats_mu_);
    ++stats_.steps_total;
    if (options_.record_step_times && !any_prefill && !any_verify && stats_.decode_steps.size() < (1u << 20)) {
      stats_.decode_steps.emplace_back(batch.num_rows(), static_cast<float>(result.device_ms));
    }
  }
  size_t out = 0;
  for (Sequence* s : in_batch) {
    const int32_t begin = s->computed();
    if (!s->drafts.empty()) {
      const RowResult* rows = &result.rows[out];
      out += static_cast<size_t>(s->step_rows);
      // Accept while row j's token equals draft j; row `accepted` gives the next token. Only the
      // kept rows' KV is committed: the rejected rows' pages stay reserved and are written again.
      int32_t accepted = 0;
      while (accepted < static_cast<int32_t>(s->drafts.size()) && rows[accepted].finite &&
             rows[accepted].token == s->drafts[static_cast<size_t>(accepted)]) {
        ++accepted;
      }
      {
        std::lock_guard slock(stats_mu_);
        stats_.spec.Record(static_cast<int32_t>(s->drafts.size()), accepted);
      }
      if (options_.enable_prefix_caching) RegisterPromptBlocks(*s, begin, begin + 1 + accepted);
      if (Status cst = kv.Commit(s->kv, 1 + accepted); !cst.ok()) {
        FinishSequence(*s, FinishReason::kError, cst);
        continue;
      }
      // The drafter sees the kept rows only: the anchor and the accepted drafts.
      if (Status dst = ObserveRows(*s, begin, result, 1 + accepted); !dst.ok()) {
        FinishSequence(*s, FinishReason::kError, dst.WithContext("speculative drafter"));
        continue;
      }
      // Emitted one by one with plain decoding's stop checks: a stop or max_tokens inside the
      // accepted run ends the sequence there (its pages are released with the rest).
      for (int32_t j = 0; j <= accepted && !s->done; ++j) Emit(*s, rows[j]);
      continue;
    }
    // Register before Commit: Commit lets go of sliding pages the cache may want to keep.
    if (options_.enable_prefix_caching) RegisterPromptBlocks(*s, begin, begin + s->step_rows);
    Status cst = kv.Commit(s->kv, s->step_rows);
    const bool has_output = s->computed() == static_cast<int32_t>(s->tokens.size());
    const RowResult* row = has_output ? &result.rows[out++] : nullptr;
    if (!cst.ok()) {
      FinishSequence(*s, FinishReason::kError, cst);
      continue;
    }
    if (speculate) {
      if (Status dst = ObserveRows(*s, begin, result, s->step_rows); !dst.ok()) {
        FinishSequence(*s, FinishReason::kError, dst.WithContext("speculative drafter"));
        continue;
      }
    }
    if (row != nullptr) Emit(*s, *row);
  }
}

Status Scheduler::ObserveRows(Sequence& s, int32_t position, const ForwardResult& result, int32_t rows) {
  const auto t0 = Clock::now();
  Status st = options_.drafter->Observe(s.draft_seq, position, result, s.first_row, rows);
  std::lock_guard slock(stats_mu_);
  stats_.spec.drafter_seconds += Seconds(t0, Clock::now());
  return st;
}

void Scheduler::Emit(Sequence& s, const RowResult& row) {
  const SamplingParams& p = s.req.sampling;
  if (!row.finite) {
    // The backend checked the row's logits (on the device for CUDA): none came back to check here.
    FinishSequence(s, FinishReason::kError,
                   DataLoss("token {}: the model produced non-finite logits (NaN or Inf)", s.generated));
    return;
  }
  if (!row.logits.empty()) {
    if (Status st = CheckFiniteLogits(row.logits, fmt::format("token {}", s.generated)); !st.ok()) {
      FinishSequence(s, FinishReason::kError, st);
      return;
    }
  }
  TokenEvent ev;
  ev.token = row.token;
  if (p.logprobs >= 0) ComputeLogprobs(row.logits, ev.token, p.logprobs, &ev);
  const int32_t tok = ev.token;
  const auto now = Clock::now();
  ev.emitted = now;
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
  s.tokens.push_back(tok);
  s.state->PushToken(std::move(ev));
  const auto& eos = engine_.config().eos_token_ids;
  const bool is_eos = !p.ignore_eos && std::find(eos.begin(), eos.end(), tok) != eos.end();
  const bool is_stop = std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), tok) !=
                       p.stop_token_ids.end();
  if (is_eos || is_stop) {
    FinishSequence(s, FinishReason::kStop);
  } else if (s.generated >= p.max_tokens) {
    FinishSequence(s, FinishReason::kLength);
  }
}

void Scheduler::FinishSequence(Sequence& s, FinishReason reason, Status error) {
  if (s.done) return;
  s.done = true;
  if (s.draft_seq != 0) {
    options_.drafter->Forget(s.draft_seq);
    s.draft_seq = 0;
  }
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
