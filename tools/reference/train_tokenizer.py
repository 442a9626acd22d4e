#!/usr/bin/env python3
"""Train a small byte-level BPE tokenizer with Laguna's exact structure and write reference encodings.

Run on a machine that has the Hugging Face `tokenizers` library (written against 0.23; no network
needed, only `tokenizers` and `json` are used). It takes a few seconds:

    python3 tools/reference/train_tokenizer.py --out tests/data/tokenizer/trained

writes
    <out>/tokenizer.json             the trained tokenizer (vocabulary ~3000)
    <out>/reference_encodings.json   [{"text", "ids", "decoded", "decoded_skip_special"}, ...] for
                                     TEST_STRINGS, produced by `tokenizers` itself
    <out>/manifest.json              tokenizers version, sizes, settings

and, for every `--check-tokenizer NAME=PATH` given, <out>/<NAME>/tokenizer.json (a copy) and
<out>/<NAME>/reference_encodings.json: the same test strings encoded by that existing file (use it to
check a hand-made or C++-written tokenizer.json against the reference library).

The structure follows shared/design/laguna-checkpoints.md §3.1: no normalizer; pre-tokenizer
Sequence[Split(newline runs, merged_with_next), Split(Qwen2-style pattern, single digits,
isolated), ByteLevel(add_prefix_space=False, use_regex=False)]; ByteLevel decoder; BPE without
byte fallback; added tokens at low ids (1 〈|CODE_START|〉, 2 〈|EOS|〉, 3 〈|CODE_END|〉, 9 pad,
12 mask, 24 </assistant>, chat markers). The pattern is used as shipped (no "Mistral regex fix").
The ids and flags must stay identical to LagunaStyleAddedTokens() in
src/tokenizer/tokenizer_writer.cc.
"""

import argparse
import json
import os
import shutil
import sys
import time

import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

NEWLINE_RUN_PATTERN = r"(?:\r?\n)+(?!\r?\n)"
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (id, content, special). Ids are the list positions; the BPE trainer assigns them in this order.
ADDED_TOKENS = [
    (0, "〈|UNK|〉", True),
    (1, "〈|CODE_START|〉", True),
    (2, "〈|EOS|〉", True),
    (3, "〈|CODE_END|〉", True),
    (4, "〈|FIM_START|〉", True),
    (5, "〈|FIM_MIDDLE|〉", True),
    (6, "〈|FIM_SUFFIX|〉", True),
    (7, "〈|META_START|〉", True),
    (8, "〈|META_END|〉", True),
    (9, "〈|PAD|〉", True),
    (10, "〈|RESERVED_10|〉", True),
    (11, "〈|RESERVED_11|〉", True),
    (12, "〈|MASK|〉", True),
    (13, "<system>", False),
    (14, "</system>", False),
    (15, "<user>", False),
    (16, "</user>", False),
    (17, "<think>", False),
    (18, "</think>", False),
    (19, "<tool_call>", False),
    (20, "</tool_call>", False),
    (21, "<arg_key>", False),
    (22, "</arg_key>", False),
    (23, "<assistant>", False),
    (24, "</assistant>", False),
    (25, "<arg_value>", False),
    (26, "</arg_value>", False),
    (27, "<tool_response>", False),
    (28, "</tool_response>", False),
    (29, "<available_tools>", False),
    (30, "</available_tools>", False),
]

# ---------------------------------------------------------------------------------------------
# Training corpus: varied on purpose (code with indentation, CJK, emoji, numbers, mixed case,
# contractions, newline and space runs, tabs, punctuation runs, URLs). Deterministic.

PROSE = [
    "The quick brown fox jumps over the lazy dog, and the dog doesn't even notice.",
    "It's a truth universally acknowledged that a model in possession of good data must want more.",
    "I'm sure we'll find that they've done what you'd expect; I'll check what's left tomorrow.",
    "She said: \"Don't worry, it isn't broken, it's just slow.\" He replied, 'We'll see.'",
    "Large language models predict the next token given all the previous tokens in the context.",
    "Mixture-of-experts layers route each token to a few experts chosen by a learned router.",
    "Please summarize the following article in three bullet points, then suggest a title.",
    "The results were surprising: accuracy improved from 71.3% to 84.9% after fine-tuning.",
    "My eBay order of NaOH arrived; the pH meter and the iPhone charger are still in transit.",
    "McDonald's, YouTube, JavaScript, TypeScript, GitHub, macOS, iOS, PostgreSQL and OpenAI.",
    "In 1969, Apollo 11 landed on the Moon; 384,400 km away, 600 million people watched.",
    "Version 2.3.14 fixes bug #4521 (a NULL pointer dereference) reported on 2023-11-07.",
    "Contact us at support@example.com or call +1 (555) 010-2030 between 9:00 and 17:30.",
    "Read the docs at https://docs.example.org/v1/guide/install.html?lang=en#requirements.",
    "WARNING!!! Do NOT run `rm -rf /` ... seriously?! -- the admins",
    "Temperatures range from -40°C to +85°C; tolerance is ±0.5 mm; cost €1,299.99 or £1.099.",
]

CJK = [
    "人工智能正在改变我们的生活方式。机器学习是人工智能的一个重要分支。",
    "今天天气很好，我们去公园散步吧。这个函数返回一个整数列表。",
    "日本語の文章も含めます。東京は日本の首都で、人口が非常に多い都市です。",
    "ひらがなとカタカナ、そして漢字を混ぜた文です。プログラミングは楽しい。",
    "한국어 문장도 포함합니다. 서울은 대한민국의 수도입니다. 감사합니다!",
    "繁體中文：電腦程式設計需要耐心與練習。",
]

EMOJI = [
    "Great job! 🎉🎉 Let's ship it 🚀 — thanks 🙏",
    "Family: 👨‍👩‍👧‍👦, thumbs: 👍 👍🏻 👍🏽 👍🏿, flags: 🇫🇷 🇯🇵 🇧🇷, hearts: ❤️ 💙 💚",
    "Weather: ☀️ ⛅ 🌧️ ❄️; food: 🍕🍣🍜; faces: 😀😂🥲😎🤖",
]

PYTHON = '''import json
import os
from dataclasses import dataclass


@dataclass
class Config:
    name: str
    layers: int = 12
    hidden_size: int = 768

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2)


def load_configs(directory):
    """Load every config file in a directory."""
    configs = []
    for entry in sorted(os.listdir(directory)):
        if not entry.endswith(".json"):
            continue
        with open(os.path.join(directory, entry), encoding="utf-8") as f:
            data = json.load(f)
        configs.append(Config(**data))
    return configs


if __name__ == "__main__":
    for cfg in load_configs("./configs"):
        print(f"{cfg.name}: {cfg.layers} layers, hidden {cfg.hidden_size}")
'''

CPP = '''#include <algorithm>
#include <cstdint>
#include <vector>

namespace demo {

// Returns the indices of the k largest values, largest first.
std::vector<int32_t> TopK(const std::vector<float>& values, int k) {
  std::vector<int32_t> idx(values.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>(i);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int32_t a, int32_t b) { return values[a] > values[b]; });
  idx.resize(k);
  return idx;
}

}  // namespace demo
'''

RUST = '''use std::collections::HashMap;

pub fn word_counts(text: &str) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for word in text.split_whitespace() {
        *counts.entry(word.to_lowercase()).or_insert(0) += 1;
    }
    counts
}

#[cfg(test)]
mod tests {
    #[test]
    fn counts_words() {
        let c = super::word_counts("a b a");
        assert_eq!(c["a"], 2);
    }
}
'''

JS = '''export async function fetchJson(url, { retries = 3 } = {}) {
  for (let attempt = 0; attempt < retries; attempt++) {
    try {
      const response = await fetch(url);
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      return await response.json();
    } catch (err) {
      console.warn(`attempt ${attempt + 1} failed:`, err);
    }
  }
  return null;
}
'''

GO = '''package main

import (
\t"fmt"
\t"strings"
)

func main() {
\tnames := []string{"alice", "bob", "carol"}
\tfor i, n := range names {
\t\tfmt.Printf("%d: %s\\n", i, strings.ToUpper(n))
\t}
}
'''

SHELL_SQL_HTML = '''#!/usr/bin/env bash
set -euo pipefail
for f in data/*.csv; do
    echo "==> $f"
    wc -l "$f" | awk '{print $1}'
done

SELECT u.id, u.name, COUNT(o.id) AS orders
FROM users u LEFT JOIN orders o ON o.user_id = u.id
WHERE u.created_at >= '2024-01-01'
GROUP BY u.id, u.name
ORDER BY orders DESC
LIMIT 10;

<!DOCTYPE html>
<html lang="en">
  <head><meta charset="utf-8"><title>Demo</title></head>
  <body>
    <p class="note">Hello &amp; welcome!</p>
  </body>
</html>
'''

CHAT = [
    "<system>You are a helpful assistant.</system>\n<user>What is the capital of France?</user>\n"
    "<assistant><think>Simple geography.</think>The capital of France is Paris.</assistant>\n",
    "<user>List the files.</user>\n<assistant></think><tool_call>list_files<arg_key>path</arg_key>"
    "<arg_value>.</arg_value></tool_call></assistant>\n<tool_response>a.txt\nb.txt</tool_response>\n",
]


def build_corpus():
    texts = []
    texts += PROSE * 4 + CJK * 4 + EMOJI * 4
    texts += [PYTHON, CPP, RUST, JS, GO, SHELL_SQL_HTML] * 3
    texts += CHAT * 3
    # Numbers and tables: long digit runs, decimals, dates, hex.
    for i in range(200):
        texts.append(f"row {i:04d}\t{i * 7919 % 100003}\t{i / 7:.5f}\t0x{i * 2654435761 % (1 << 32):08X}\n")
    for i in range(60):
        texts.append(f"On 20{i % 25:02d}-{1 + i % 12:02d}-{1 + i % 28:02d} we sold {i * 1234567} units "
                     f"for ${i * 31.25:,.2f}.")
    # Whitespace shapes: runs of spaces, tabs, blank lines, CRLF, trailing spaces.
    for n in range(1, 9):
        texts.append("x" + " " * n + "y" + "\t" * (n % 4) + "z" + "\n" * n + "w   \n")
        texts.append("line one\r\n" * n + "\r\n\r\nend\r\n")
        texts.append("    " * n + "indented(" + str(n) + ")\n")
    # Punctuation runs and URLs.
    texts += ["!!! ??? ... --- *** ### === ;;; ::: ((( ))) [[[ ]]] {{{ }}} <<< >>> /// ||| &&& %%%"] * 5
    for host in ["example.com", "github.com", "huggingface.co", "docs.python.org", "en.wikipedia.org"]:
        for path in ["", "/", "/index.html", "/a/b/c?x=1&y=2", "/search?q=tokenizer#results"]:
            texts.append(f"See https://{host}{path} and http://www.{host}{path} for details.")
    # Pseudo-words from syllables (a fixed linear congruential sequence) so that the trainer finds
    # enough distinct frequent pairs to approach the requested vocabulary.
    syllables = ["ka", "lo", "mi", "nu", "pe", "ra", "si", "to", "ve", "zu", "qua", "str", "ing", "tion",
                 "er", "an", "th", "ou", "ch", "sh", "Ex", "Pro", "Con", "De"]
    state = 12345
    for line in range(600):
        words = []
        for _ in range(12):
            n = 1 + state % 4
            word = ""
            for _ in range(n):
                state = (state * 1103515245 + 12345) % (1 << 31)
                word += syllables[(state >> 16) % len(syllables)]
            words.append(word)
        texts.append(" ".join(words) + (".\n" if line % 3 else "\n\n"))
    return texts


# ---------------------------------------------------------------------------------------------
# Test strings: different from the corpus, with edge cases.

TEST_STRINGS = [
    "",
    " ",
    "  ",
    "     ",
    "\n",
    "\n\n\n",
    "\r\n",
    "\r\n\r\n",
    "\r",
    "\t",
    "\t\t\tx",
    " \n \n ",
    "a\n\n\n\nb",
    "a.\nb",
    "a  \nb",
    "end of line   \nnext",
    "Hello world",
    "hello   world  ",
    "  leading spaces",
    "trailing spaces   ",
    "I'm sure they'll say it's fine, don't you think? I'M SURE YOU'LL SEE. We'd've.",
    "eBay NaOH pH iPhone McDonald's camelCaseIdentifier snake_case_name XMLHttpRequest",
    "1234567",
    "3.14159 1,000,000 -42 +7 1e-9 0xDEADBEEF 2024-03-15T10:30:00Z",
    "The year 2025 had 365 days and 8760 hours.",
    "def square(x):\n    return x * x\n\n\nprint(square(12))\n",
    "if (a < b && c >= d) {\n\tfoo(a, b);\n} else {\n\tbar();\n}\n",
    "const f = (x) => x ?? 0; // nullish\n",
    "机器学习很有趣。",
    "こんにちは世界！",
    "안녕하세요, 세계!",
    "Mixed 中文 and English 和 日本語 text.",
    "😀",
    "👨‍👩‍👧‍👦",
    "🇺🇸🇩🇪",
    "👍🏽 ok",
    "🤖🚀✨ done",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛",
    "𠀀𠀁𠀂",
    "<user>Hello</user>\n<assistant><think>hmm</think>ok</assistant>\n",
    "text〈|EOS|〉text",
    "〈|EOS|〉〈|EOS|〉",
    "a〈|CODE_START|〉b〈|CODE_END|〉c",
    "〈|EOS|〉<system>sys</system>\n<user>hi</user>\n<assistant></think>",
    "<user >not a token</user >",
    "<<user>>",
    "</assistant>\n",
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
    "<available_tools>\n{\"name\": \"f\"}\n</available_tools>",
    "〈|EOS| and <think without closing",
    "〈|PAD|〉〈|PAD|〉 padded",
    " 〈|MASK|〉 ",
    "\ufffd",
    "\u200b\u200c\u200d",
    "e\u0301 n\u0303",
    "\u0085",
    "\u00a0",
    "a\u3000b",
    "\u2028\u2029",
    "\x00\x01\x7f",
    "\\xff\\xfe",
    "%E4%BD%A0",
    "\ue000\uf8ff",
    "\U0010fffd",
    "\U000e0001",
    "!!!???...",
    "-----",
    "==> <== <=> !==",
    "x;\n\ny",
    "foo(){\n\treturn;\n}\n",
    "https://example.com/path/to/page?q=1&r=two#frag",
    "mailto:someone@example.org",
    "a" * 300,
    " " * 50 + "x",
    "\n" * 20,
    "word " * 40,
]


def reference_encodings(tok):
    out = []
    for text in TEST_STRINGS:
        ids = tok.encode(text, add_special_tokens=False).ids
        out.append({
            "text": text,
            "ids": ids,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
        })
    return out


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


def train(vocab_size):
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(NEWLINE_RUN_PATTERN), behavior="merged_with_next", invert=False),
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[content for _, content, _ in ADDED_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(build_corpus(), trainer=trainer)

    # The trainer makes every added token special; the chat markers are plain added tokens (so that
    # decoding with skip_special_tokens keeps them visible to reasoning/tool parsers).
    data = json.loads(tok.to_str())
    special = {content: sp for _, content, sp in ADDED_TOKENS}
    for entry in data["added_tokens"]:
        entry["special"] = special[entry["content"]]
        entry["normalized"] = False
    tok = Tokenizer.from_str(json.dumps(data, ensure_ascii=False))

    for want_id, content, _ in ADDED_TOKENS:
        got = tok.token_to_id(content)
        if got != want_id:
            sys.exit(f"error: added token {content!r} got id {got}, expected {want_id}")
    return tok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--vocab-size", type=int, default=3000, help="target vocabulary (default 3000)")
    ap.add_argument("--check-tokenizer", action="append", default=[], metavar="NAME=PATH",
                    help="also write reference encodings of an existing tokenizer.json into <out>/NAME/")
    args = ap.parse_args()

    start = time.time()
    os.makedirs(args.out, exist_ok=True)
    tok = train(args.vocab_size)
    tok_path = os.path.join(args.out, "tokenizer.json")
    tok.save(tok_path, pretty=True)
    print(f"wrote {tok_path} ({os.path.getsize(tok_path)} bytes, vocabulary {tok.get_vocab_size()})")
    refs = reference_encodings(Tokenizer.from_file(tok_path))  # exactly what was written
    write_json(os.path.join(args.out, "reference_encodings.json"), refs)
    write_json(os.path.join(args.out, "manifest.json"), {
        "tokenizers_version": tokenizers.__version__,
        "vocab_size_requested": args.vocab_size,
        "vocab_size": tok.get_vocab_size(),
        "num_test_strings": len(TEST_STRINGS),
        "newline_run_pattern": NEWLINE_RUN_PATTERN,
        "split_pattern": SPLIT_PATTERN,
    })

    for spec in args.check_tokenizer:
        name, _, path = spec.partition("=")
        if not name or not path:
            sys.exit(f"error: --check-tokenizer expects NAME=PATH, got {spec!r}")
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        sub = os.path.join(args.out, name)
        os.makedirs(sub, exist_ok=True)
        shutil.copyfile(path, os.path.join(sub, "tokenizer.json"))
        write_json(os.path.join(sub, "reference_encodings.json"), reference_encodings(Tokenizer.from_file(path)))

    print(f"done in {time.time() - start:.1f}s with tokenizers {tokenizers.__version__}")


if __name__ == "__main__":
    main()
