#!/usr/bin/env python3
"""Starts `decodelab serve` on a model, streams one greedy completion over HTTP and checks that its
token ids equal `decodelab generate` for the same prompt and backend. Standard library only.

  python3 tools/device/serve_check.py build/bin/decodelab --model DIR --backend cuda --kv-dtype bf16
"""
import json
import re
import subprocess
import sys
import time
import urllib.request


def main():
    binary, flags = sys.argv[1], sys.argv[2:]
    prompt = [2, 17, 42, 99, 5, 301, 7, 8, 120, 33, 64]
    n = 24
    gen = subprocess.run([binary, "generate", *flags, "--prompt-ids", ",".join(map(str, prompt)),
                          "--max-tokens", str(n), "--ignore-eos", "--json"],
                         capture_output=True, text=True, timeout=300)
    if gen.returncode != 0:
        print("generate failed:", gen.stderr[-2000:])
        return 1
    expected = json.loads(gen.stdout.strip().splitlines()[-1])["tokens"]
    srv = subprocess.Popen([binary, "serve", *flags, "--host", "127.0.0.1", "--port", "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = None
    deadline = time.time() + 300
    log = []
    while time.time() < deadline:
        line = srv.stdout.readline()
        if not line:
            break
        log.append(line)
        m = re.search(r"ready at (http://\S+)", line)
        if m:
            url = m.group(1).rstrip("/")
            break
    if not url:
        print("server did not become ready:\n" + "".join(log[-30:]))
        srv.kill()
        return 1
    models = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())
    body = json.dumps({"model": models["data"][0]["id"], "prompt": prompt, "max_tokens": n, "temperature": 0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    got, usage, events = [], None, 0
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                events += 1
                got.extend(c.get("token_ids", []))
    state = json.loads(urllib.request.urlopen(url + "/v1/decodelab/state", timeout=30).read())
    srv.terminate()
    srv.wait(timeout=30)
    ok = got == expected
    print(f"serve {' '.join(flags)}: streamed {len(got)} tokens in {events} events; "
          f"equal to generate: {ok}; usage {usage}; backend {state.get('backend')}; "
          f"topology {state.get('topology')}; fallback {state.get('fallback')}")
    if not ok:
        print("  generate:", expected)
        print("  serve:   ", got)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
