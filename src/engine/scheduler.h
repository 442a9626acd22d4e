// The serving scheduler: one engine thread owns the model runner and the KV cache; HTTP threads hand it
// parsed requests through a queue and read results back from a per-request RequestState (llama.cpp's
// server_context / server_queue split). `bench` drives the same loop in process, so what bench
// measures is what serve runs.
//
// Continuous batching: sequences join and leave the running set between steps, and each step is ONE
// forward (model/forward_batch.h) over every running sequence: a decode row for each sequence that has
// its whole context in the cache, then prefill chunks (at most `prefill_chunk` tokens of one
// sequence) in admission order while the step's token budget (`max_tokens_per_step`) lasts. A long
// prompt therefore costs the running streams at most one budget's worth of rows per step. Every
// backend computes each row on its own, so a sequence's tokens and logits do not depend on what else
// runs or on how its prompt was chunked: greedy outputs equal GenerateGreedy's for the same prompt.
//
// Speculative decoding (SchedulerOptions::drafter): a decoding sequence with drafts runs K + 1 rows
// (its last token and the drafts) with an output on each; the longest prefix of drafts equal to the
// rows' chosen tokens is accepted plus the next row's token, and only those rows' KV is committed.
// Several sequences verify in the same forward, beside plain decode rows and prefill chunks.
//
// KV pages are reserved per step and returned when a sequence finishes, fails or is cancelled
// (RequestState::Cancel, e.g. on client disconnect). When a step cannot get the pages it needs, the
// most recently admitted running sequences are preempted: their pages are returned and they go back
// to the front of the queue, to be recomputed from their prompt and the tokens they already produced
// (vLLM's recompute policy). Recomputation gives the same KV bit for bit, so a preempted request's
// output is unchanged; it only waits. Admission waits while the free pages would not hold a new
// sequence's first chunk. The waiting queue is bounded (Submit returns ResourceExhausted when it is
// full: HTTP 503).
//
// Prefix caching (off by default): whole prompt pages are registered in a block cache keyed by a
// chained hash of their tokens; a new prompt that starts with cached blocks attaches those pages
// (full-attention pages, and the sliding-window pages its window still needs) instead of
// recomputing them, and reports them as cached tokens.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/engine.h"
#include "engine/sampling.h"

namespace dl {

struct GenerationRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
};

enum class FinishReason { kNone, kLength, kStop, kCancelled, kError };
const char* FinishReasonName(FinishReason r);

// One request's mailbox between the engine thread (producer) and an HTTP thread (consumer).
class RequestState {
 public:
  struct Update {
    std::vector<TokenEvent> tokens;  // new since the last Poll
    bool finished = false;
    FinishReason reason = FinishReason::kNone;
    Status error;                    // when reason is kError / kCancelled
    int32_t prompt_tokens = 0;
    int32_t cached_tokens = 0;       // prompt tokens whose KV came from the prefix cache
  };

  // Waits up to `timeout` for news and moves it into `out`. Returns true when `out` holds tokens or
  // the final state.
  bool Poll(Update* out, std::chrono::milliseconds timeout);
  // Asks the engine to stop this request and return its pages (client gone, stop string matched).
  void Cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }
  uint64_t id() const { return id_; }

  // Engine side.
  void PushToken(TokenEvent event);
  void Finish(FinishReason reason, Status error = Status::Ok());
  void SetPromptInfo(int32_t prompt_tokens, int32_t cached_tokens);

 private:
  friend class Scheduler;
  uint64_t id_ = 0;
  std::atomic<bool> cancelled_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<TokenEvent> pending_;
  bool finished_ = false;
  bool finish_reported_ = false;
  FinishReason reason_ = FinishReason::kNone;
  Status error_;
  int32_t prompt_tokens_ = 0;
  int32_t cached_tokens_ = 0;
};

// A Prometheus histogram (cumulative buckets are computed when printing).
struct Histogram {
  std::vector<double> bounds;   // upper bounds, ascending
  std::vector<uint64_t> counts;  // per bucket (non-cumulative), plus one for +Inf
  double sum = 0.0;
  uint64_t count = 0;
  explicit Histogram(std::vector<double> b = {}) : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}
  void Observe(double v);
};

struct SchedulerStats {
  int32_t running = 0;
  int32_t waiting = 0;
  double kv_usage = 0.0;  // fraction of KV pages in use (prefix-cache pages included)
  int32_t kv_pages_used = 0;
  int32_t kv_pages_total = 0;
  int32_t prefix_cache_blocks = 0;
  uint64_t prompt_tokens_total = 0;
  uint64_t generation_tokens_total = 0;
  uint64_t cached_prompt_tokens_total = 0;
  uint64_t preemptions_total = 0;  // sequences sent back to the queue for lack of KV pages
  // With SchedulerOptions::record_step_times: each pure decode step's rows and device time (ms).
  std::vector<std::pair<int32_t, float>> decode_steps;
  std::map<std::string, uint64_t> finished_total;  // by finish reason
  uint64_t steps_total = 0;
  SpecStats spec;  // speculative decoding (vllm:spec_decode_*)
  Histogram ttft, itl, e2e, queue_time;
};

struct SchedulerOptions {
  int32_t max_batch = 8;       // running sequences at once (1 = one at a time, the rest queue)
  int32_t max_waiting = 1024;  // queued requests beyond which Submit refuses (503)
  int32_t prefill_chunk = 512;
  bool enable_prefix_caching = false;
  // Token rows of one forward (decode rows + prefill chunks); clamped to what the runner takes.
  int32_t max_tokens_per_step = 512;
  bool record_step_times = false;  // keep SchedulerStats::decode_steps (bench)
  // Speculative decoding (docs/speculative.md): a decoding sequence's step becomes a verify of its
  // last token plus up to num_draft_tokens drafts from `drafter`, sampled row by row with the same
  // (seed, token index) as plain decoding, so every request's output is unchanged. Drafts shrink
  // (to none) when the step's rows, outputs or free KV pages run short; they never preempt.
  std::shared_ptr<const Drafter> drafter = nullptr;
  int32_t num_draft_tokens = 0;
};

class Scheduler {
 public:
  // `engine` must outlive the scheduler; its KV pools must hold max_batch sequences of
  // engine.options.max_seq_len (EngineOptions.max_sequences >= max_batch).
  Scheduler(Engine& engine, SchedulerOptions options);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  void Start();
  // Ends every queued and running request with a kCancelled error ("server shutting down"),
  // returns their pages and joins the engine thread. Idempotent.
  void Stop();

  // Validates the request against the model (non-empty prompt, ids in the vocabulary, prompt +
  // max_tokens within the context) and queues it. InvalidArgument for bad input, ResourceExhausted
  // when the waiting queue is full, Unavailable after Stop.
  Result<std::shared_ptr<RequestState>> Submit(GenerationRequest request);

  SchedulerStats Stats() const;
  int32_t max_context() const { return engine_.options.max_seq_len; }
  const SchedulerOptions& options() const { return options_; }
  // Pages held by the prefix cache (for leak checks: used pages minus these must be 0 when idle).
  int32_t prefix_cache_pages() const;
  // Drops every prefix-cache entry (returns their pages). Runs on the engine thread at its next step.
  void ClearPrefixCache();

 private:
  struct Sequence;
  struct CachedBlock {
    int32_t full_page = -1;
    int32_t sliding_page = -1;
    int32_t depth = 0;       // block index in its prompt
    uint64_t last_use = 0;   // stamp of the last request that used it
  };

  void Loop();
  // Admits waiting sequences while the batch and the free KV pages allow.
  void Admit();
  // One step: plans the batch (reserving pages, preempting where they run out), runs it and emits
  // the sampled tokens.
  void Step();
  // Reserves n positions for s (running_[index]), evicting prefix-cache blocks and then preempting
  // the running sequences not yet planned into this step, newest first; ResourceExhausted when even
  // that cannot make room.
  Status ReserveForStep(Sequence& s, int32_t n, size_t index);
  void Preempt(size_t index);
  // Hands the drafter the `rows` committed rows of s (from `position`, at s.first_row of `result`),
  // timing it into the speculative stats.
  Status ObserveRows(Sequence& s, int32_t position, const ForwardResult& result, int32_t rows);
  // Emits the token sampled for s (and finishes it on a stop condition).
  void Emit(Sequence& s, const RowResult& row);
  void FinishSequence(Sequence& s, FinishReason reason, Status error = Status::Ok());
  Status AttachCachedPrefix(Sequence& s);
  void RegisterPromptBlocks(Sequence& s, int32_t begin, int32_t end);
  // Drops the least recently used block whose pages only the cache holds (deepest first, so a
  // chain loses its tail before its head). False when no block would free a page.
  bool EvictOneBlock();
  void DropBlock(std::unordered_map<uint64_t, CachedBlock>::iterator it);
  void DropPrefixCacheLocked();
  void PublishStats();

  Engine& engine_;
  SchedulerOptions options_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Sequence>> incoming_;
  bool stop_ = false;
  bool started_ = false;
  std::atomic<bool> clear_cache_{false};
  uint64_t next_id_ = 1;
  std::thread thread_;

  // Engine thread only.
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;
  std::unordered_map<uint64_t, CachedBlock> blocks_;  // chained hash of a page of tokens -> pages
  uint64_t use_clock_ = 0;

  mutable std::mutex stats_mu_;
  SchedulerStats stats_;
  std::atomic<int32_t> cache_pages_{0};
};

}  // namespace dl
