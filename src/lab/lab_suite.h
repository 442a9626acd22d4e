// Suite files and teacher transcripts (lab.md §2). A suite names its prompts, the generated lengths
// of a screen and a suite, the checks to run, the calibration file and the teacher transcript; the
// teacher holds the control's tokens and its topology signature per rank (never hard-coded).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace dl::lab {

// The check names a suite may list, in the order they run.
const std::vector<std::string>& AllCheckNames();

struct SuitePrompt {
  std::string name;
  std::vector<int32_t> token_ids;  // empty when `text` is used
  std::string text;
  // "regular", "boundary" or "rollover". Boundary and rollover prompts may be computed from the
  // model's page size and sliding window ("computed": true), see ComputeBoundaryPrompt.
  std::string kind = "regular";
  bool computed = false;
};

struct Suite {
  std::string path;    // where it was read from
  std::string sha256;  // of the file's bytes
  std::string name;
  int screen_tokens = 128;  // M of a screen
  int suite_tokens = 512;   // M of a suite
  std::string kv_dtype = "fp8";
  std::vector<SuitePrompt> prompts;
  std::vector<std::string> checks;  // subset of AllCheckNames()
  std::string calibration;          // scales file (absolute, or empty: the lab makes one)
  std::string teacher;              // transcript path (absolute, or empty: the lab's cache)
  // Expected topology signature per rank, keyed by configuration label; empty = from the teacher.
  std::map<std::string, std::vector<std::string>> expected_topology;

  bool HasCheck(const std::string& name) const;
  // The largest M the suite uses, and the distinct Ms (screen and suite).
  std::vector<int> Ms() const;
};

// Parses a suite; relative calibration/teacher paths resolve against the suite file's folder.
Result<Suite> ParseSuite(const nlohmann::json& j, const std::string& path,
                         const std::string& sha256);
Result<Suite> ReadSuiteFile(const std::string& path);

// The built-in default suite (13 prompts of synthetic token ids, all below 500 so every model's
// vocabulary has them, plus a computed boundary and a computed rollover prompt);
// suites/default.json is this text.
std::string DefaultSuiteJson();

// Deterministic prompt ids of length `len`, all in [1, vocab_limit).
std::vector<int32_t> SyntheticPromptIds(int len, int salt, int vocab_limit);
// The boundary prompt fills whole KV pages (2 pages), so the first decoded token opens a page.
int BoundaryPromptLength(int page_size);
// The rollover prompt ends one token before a page boundary at or beyond the sliding window, so the
// first decode steps cross a KV page and run with the window ring already wrapped.
int RolloverPromptLength(int page_size, int sliding_window);

struct TeacherPrompt {
  std::string name;
  std::vector<int32_t> prompt;
  std::vector<int32_t> tokens;  // up to the largest M
  std::map<int, int32_t> next;  // M -> token M+1 from a re-prefill "next" request
};

struct Teacher {
  std::string suite_sha256;
  std::string control_identity;  // binary sha256 of the control
  std::string backend;
  std::string kv_dtype;
  std::vector<std::string> topology;  // per rank "N/C"; empty when not applicable (CPU)
  bool topology_applicable = false;
  std::vector<TeacherPrompt> prompts;

  const TeacherPrompt* Find(const std::string& name) const;
  nlohmann::json ToJson() const;
};
Result<Teacher> ParseTeacher(const nlohmann::json& j, const std::string& what);
Result<Teacher> ReadTeacherFile(const std::string& path);
Status WriteTeacherFile(const std::string& path, const Teacher& t);

// Reads a whole file / writes one atomically (temp + rename).
Result<std::string> ReadTextFile(const std::string& path);
// A JSON file's text (for hashing) and its parsed value; "<path>: not JSON: ..." when it does not parse.
struct JsonFile {
  std::string text;
  nlohmann::json value;
};
Result<JsonFile> ReadJsonFile(const std::string& path);
Status WriteTextFile(const std::string& path, const std::string& text);

// Checked readers for the lab's JSON files: a value that is not an integer (1.5), or is outside
// [lo, hi], is an error naming `what`, never truncated or wrapped.
Result<int64_t> JsonInt(const nlohmann::json& v, int64_t lo, int64_t hi, const std::string& what);
// j[key] when present and not null, else `def`.
Result<int64_t> JsonIntField(const nlohmann::json& j, const char* key, int64_t def, int64_t lo,
                             int64_t hi, const std::string& what);
// An array of token ids (integers in [0, 2^31)).
Result<std::vector<int32_t>> JsonTokenIds(const nlohmann::json& v, const std::string& what);
// The file format version this lab reads: a "version" field, when present, must be 1.
Status CheckVersion(const nlohmann::json& j, const std::string& what);

}  // namespace dl::lab
