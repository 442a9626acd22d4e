#include "tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace dl {

struct Regex::Code {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Code() { pcre2_code_free(code); }
};

namespace {

std::string PcreErrorText(int err) {
  PCRE2_UCHAR buf[256];
  if (pcre2_get_error_message(err, buf, sizeof(buf)) < 0) return fmt::format("PCRE2 error {}", err);
  return reinterpret_cast<const char*>(buf);
}

// Per-thread match state: one match-data block (one ovector pair is all we read) and a JIT stack
// large enough for look-ahead over long whitespace runs. Shared by every Regex on the thread.
struct ThreadScratch {
  pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* mctx = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* jit_stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
  ThreadScratch() {
    if (mctx != nullptr && jit_stack != nullptr) pcre2_jit_stack_assign(mctx, nullptr, jit_stack);
  }
  ~ThreadScratch() {
    pcre2_match_data_free(md);
    pcre2_match_context_free(mctx);
    pcre2_jit_stack_free(jit_stack);
  }
};

ThreadScratch& Scratch() {
  thread_local ThreadScratch scratch;
  return scratch;
}

}  // namespace

Result<Regex> Regex::Compile(std::string_view pattern, bool literal) {
  // MULTILINE: Oniguruma's ^ and $ are always line anchors.
  const uint32_t options =
      literal ? (PCRE2_UTF | PCRE2_LITERAL) : (PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE);
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   options, &err, &err_offset, nullptr);
  if (code == nullptr) {
    return InvalidArgument("cannot compile regex '{}' at offset {}: {}", pattern, err_offset,
                           PcreErrorText(err));
  }
  auto holder = std::make_shared<Code>();
  holder->code = code;
  holder->jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  Regex re;
  re.code_ = std::move(holder);
  re.pattern_ = std::string(pattern);
  return re;
}

Status Regex::FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const {
  ThreadScratch& scratch = Scratch();
  if (scratch.md == nullptr) return ResourceExhausted("cannot allocate PCRE2 match data");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t search_from = 0;
  bool have_last = false;
  size_t last_end = 0;
  while (search_from <= text.size()) {
    uint32_t opts = PCRE2_NO_UTF_CHECK;
    int rc =
        pcre2_match(code_->code, subject, text.size(), search_from, opts, scratch.md, scratch.mctx);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      // Interpreter fallback keeps its backtracking frames on the heap.
      rc = pcre2_match(code_->code, subject, text.size(), search_from, opts | PCRE2_NO_JIT,
                       scratch.md, nullptr);
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      return Internal("regex '{}' failed on a {}-byte input: {}", pattern_, text.size(),
                      PcreErrorText(rc));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(scratch.md);
    const size_t start = ov[0], end = ov[1];
    if (start == end && have_last && last_end == end) {
      // Oniguruma's iterator: no empty match where the previous one ended; step one character.
      if (search_from >= text.size()) break;
      size_t step = 1;
      while (search_from + step < text.size() &&
             (static_cast<uint8_t>(text[search_from + step]) & 0xC0) == 0x80) {
        ++step;
      }
      search_from += step;
      continue;
    }
    out.emplace_back(start, end);
    have_last = true;
    last_end = end;
    search_from = end;
    if (start == end && end >= text.size()) break;
  }
  return Status::Ok();
}

}  // namespace dl
