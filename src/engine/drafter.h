// Speculative decoding's drafters: given a sequence's tokens so far (prompt + generated), propose up
// to K tokens that may follow. The target model then checks them all in one verify forward (K + 1
// rows: the last accepted token and the drafts) and keeps the longest prefix it agrees with, plus the
// token of the first row that disagreed (docs/speculative.md). A drafter only changes how many
// forwards a sequence takes, never its tokens: whatever it proposes, the output equals plain decoding.
//
// The n-gram and test drafters are stateless functions of the context (so one drafter serves every
// sequence of a batch, and a preempted, recomputed sequence gets the same drafts). A drafter that
// reads the target's hidden states (DFlash, engine/dflash_drafter.h) keeps per-sequence state (its
// context K/V, like a KV cache): the engine gives each sequence an id (NewSequence), asks every
// forward of it for the drafter's hidden_taps, hands over the taps of the rows it commits (Observe,
// never a rejected draft's), drafts with ProposeFor and ends the state with Forget (finish,
// preemption). Drafters must be safe to call from the engine thread while tests hold them.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "model/forward_batch.h"

namespace dl {

enum class SpecMethod : uint8_t { kNone, kNgram, kDflash };
const char* SpecMethodName(SpecMethod m);

// The user's choice: `--spec`, `--spec-k`, `--spec-ngram-min`, `--spec-ngram-max`, `--spec-model`.
struct SpecOptions {
  SpecMethod method = SpecMethod::kNone;
  int32_t k = 4;          // draft tokens per verify step (at most)
  int32_t ngram_min = 2;  // shortest suffix n-gram the n-gram drafter matches
  int32_t ngram_max = 5;  // longest
  std::string model_dir;  // --spec-model: the DFlash drafter checkpoint (dflash only)
  // "none", "ngram" or "dflash".
  static Result<SpecMethod> ParseMethod(const std::string& name);
  // k in [1, 64], 1 <= ngram_min <= ngram_max <= 64; dflash needs model_dir and nothing else does
  // (only checked when a method is on; a model_dir without dflash is refused).
  Status Validate() const;
  bool enabled() const { return method != SpecMethod::kNone; }
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  // Up to `max_tokens` proposed continuations of `context` (prompt + generated so far, the last
  // entry the token the verify step's first row feeds). May return fewer, or none.
  virtual std::vector<int32_t> Propose(std::span<const int32_t> context, int32_t max_tokens) const = 0;
  virtual std::string name() const = 0;

  // ---- Drafters that read the target's hidden states (the defaults: a stateless drafter) ----
  // Target layers after which every forward of a speculating sequence returns the hidden state
  // (ForwardBatch::hidden_taps; ascending). Empty: none.
  virtual std::vector<int32_t> hidden_taps() const { return {}; }
  // A fresh id for one sequence's drafter state (never 0).
  virtual uint64_t NewSequence() const { return 1; }
  // The target committed positions [position, position + rows) of sequence `seq`; their hidden
  // states are rows [first_row, first_row + rows) of `result.hidden`.
  virtual Status Observe(uint64_t seq, int32_t position, const ForwardResult& result, int32_t first_row,
                         int32_t rows) const {
    (void)seq, (void)position, (void)result, (void)first_row, (void)rows;
    return Status::Ok();
  }
  // Propose for sequence `seq` (whose committed positions are context[0, size - 1): the last token
  // is the anchor the verify's first row feeds).
  virtual Result<std::vector<int32_t>> ProposeFor(uint64_t seq, std::span<const int32_t> context,
                                                  int32_t max_tokens) const {
    (void)seq;
    return Propose(context, max_tokens);
  }
  // Drops sequence `seq`'s state (finished, failed, preempted: a recomputed sequence starts over).
  virtual void Forget(uint64_t seq) const { (void)seq; }
};

// Prompt lookup (vLLM's ngram proposer): for n from ngram_max down to ngram_min, the context's last n
// tokens are searched for earlier in the context; at the longest n with a match, the most recent
// earlier occurrence is taken and the tokens that followed it are proposed (up to max_tokens, fewer
// when the context ends first). No model, no weights.
class NgramDrafter : public Drafter {
 public:
  NgramDrafter(int32_t ngram_min, int32_t ngram_max) : min_(ngram_min), max_(ngram_max) {}
  std::vector<int32_t> Propose(std::span<const int32_t> context, int32_t max_tokens) const override;
  std::string name() const override;

 private:
  int32_t min_, max_;
};

// The drafter `options` asks for; nullptr for SpecMethod::kNone. DFlash needs the loaded target
// (engine/dflash_drafter.h: MakeDflashDrafter); here it is refused.
Result<std::shared_ptr<const Drafter>> MakeDrafter(const SpecOptions& options);

// ---- Drafters for tests: they know the true continuation (a plain run's output) ----

// Holds full sequences (prompt + the plain run's tokens). For a context that is a prefix of one of
// them, `Truth` is what follows it there (empty when the context matches none).
class TruthTable {
 public:
  void Add(std::vector<int32_t> prompt, std::span<const int32_t> continuation);
  std::span<const int32_t> Truth(std::span<const int32_t> context) const;

 private:
  std::vector<std::vector<int32_t>> sequences_;
};

// Always right: proposes the true continuation.
class OracleDrafter : public Drafter {
 public:
  explicit OracleDrafter(TruthTable truth) : truth_(std::move(truth)) {}
  std::vector<int32_t> Propose(std::span<const int32_t> context, int32_t max_tokens) const override;
  std::string name() const override { return "oracle"; }

 private:
  TruthTable truth_;
};

// Always wrong: proposes max_tokens tokens, each differing from the true one ((t + 1) mod vocab; an
// arbitrary token where the truth has ended).
class WrongDrafter : public Drafter {
 public:
  WrongDrafter(TruthTable truth, int32_t vocab) : truth_(std::move(truth)), vocab_(vocab) {}
  std::vector<int32_t> Propose(std::span<const int32_t> context, int32_t max_tokens) const override;
  std::string name() const override { return "always-wrong"; }

 private:
  TruthTable truth_;
  int32_t vocab_;
};

// The truth with each proposed token replaced, with probability `p_corrupt`, by a random other token;
// a random number of drafts (0..max_tokens). Deterministic: a function of (seed, context length,
// draft index).
class CorruptingDrafter : public Drafter {
 public:
  CorruptingDrafter(TruthTable truth, int32_t vocab, double p_corrupt, uint64_t seed)
      : truth_(std::move(truth)), vocab_(vocab), p_(p_corrupt), seed_(seed) {}
  std::vector<int32_t> Propose(std::span<const int32_t> context, int32_t max_tokens) const override;
  std::string name() const override { return "random-corrupt"; }

 private:
  TruthTable truth_;
  int32_t vocab_;
  double p_;
  uint64_t seed_;
};

// Counters of speculative decoding, named as vLLM's (vllm:spec_decode_*): a draft is one verify of a
// sequence with at least one draft token.
struct SpecStats {
  uint64_t num_drafts = 0;
  uint64_t num_draft_tokens = 0;
  uint64_t num_accepted_tokens = 0;
  std::vector<uint64_t> accepted_per_pos;  // [k]: drafts whose token at this position was accepted
  // Host time spent in the drafter (proposing, and for DFlash feeding it the committed rows): the
  // part of a cycle's cost the verify forward's device time does not show.
  double drafter_seconds = 0;
  // Records one verify: `drafted` tokens proposed, the first `accepted` of them accepted.
  void Record(int32_t drafted, int32_t accepted);
  // Tokens per verify step: 1 + accepted / drafts (vLLM's mean acceptance length); 0 without drafts.
  double mean_acceptance_length() const;
  double acceptance_rate() const;  // accepted / drafted; 0 without drafts
};

}  // namespace dl
