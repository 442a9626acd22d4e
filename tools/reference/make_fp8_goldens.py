#!/usr/bin/env python3
"""FP32 goldens for an FP8 Laguna checkpoint from transformers' own FP8 path (issue 18).

    decodelab make-model --shape tiny --dtype fp8 --fp8-format native --fp8-layout all-linear \
        --fp8-scales tensor --seed 7 --out DIR
    python3 tools/reference/make_fp8_goldens.py --model DIR [--out FILE]

transformers' FP8 linear layers quantise their inputs to FP8 at run time (docs/fp8.md); its
`FineGrainedFP8Config(dequantize=True)` path instead turns every FP8 weight into `code.float() *
scale` at load time and runs the model in the load dtype. That is the model decodelab's CPU backend
runs (exact dequantisation, FP32), so these transcripts are its oracle. Loaded in float32 on the CPU
with eager attention and eager experts, as make_goldens.py's FP32 goldens.

Checks before anything is written (each stops the run with a message):
  * every FP8 tensor of the file, dequantised here by hand (code -> float32, times its scale
    broadcast over its block), equals the parameter transformers loaded, bit for bit, through the
    on-disk -> in-memory mapping of make_goldens.py (fused gate_up_proj, per-expert slices);
  * every BF16 tensor equals its parameter;
  * the FP32 transcripts have at least MIN_COMPARED_STEPS clear-margin steps per prompt (prompt seeds
    are retried as in make_goldens.py).
Writes OUT (default DIR/goldens_fp32.json) in make_goldens.py's format (tools/reference/README.md),
with "fp8_load" describing what was loaded. The per-block case needs dimensions divisible by the
block (transformers requires it); the tiny shape's are not, so its golden uses per-tensor scales.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_goldens as mg  # noqa: E402  (the transcript and bookkeeping helpers)

PROMPT_SEED_BASE = 770000


def dequantize_by_hand(torch, codes, scale, block):
    """code.float() * scale with the scale broadcast over its block (None: per tensor or per row)."""
    w = codes.to(torch.float32)
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return w * s.reshape(())
    if block is None:  # per output channel
        return w * s.reshape(-1, 1)
    br, bc = block
    rows = torch.arange(w.shape[0]) // br
    cols = torch.arange(w.shape[1]) // bc
    return w * s[rows][:, cols]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an FP8 checkpoint written by decodelab make-model --dtype fp8")
    ap.add_argument("--out", default=None, help="goldens file (default MODEL/goldens_fp32.json)")
    ap.add_argument("--max-prompt-attempts", type=int, default=40)
    ap.add_argument("--allow-version-mismatch", action="store_true")
    args = ap.parse_args()
    out_path = args.out or os.path.join(args.model, "goldens_fp32.json")

    torch, transformers, _, LagunaForCausalLM = mg.import_reference(args.allow_version_mismatch)
    from safetensors import safe_open
    from transformers import FineGrainedFP8Config

    with open(os.path.join(args.model, "config.json")) as f:
        c = json.load(f)
    q = c.get("quantization_config") or {}
    mg.require(q.get("quant_method") == "fp8", f"{args.model}: quant_method {q.get('quant_method')!r}, expected 'fp8' "
                                               "(the native format; compressed-tensors needs its own package)")
    block = q.get("weight_block_size")
    ignored = q.get("ignored_layers") or q.get("modules_to_not_convert") or []
    mg.log(f"[fp8] {args.model}: weight_block_size {block}, {len(ignored)} modules not converted")
    qc = FineGrainedFP8Config(weight_block_size=block, modules_to_not_convert=ignored, dequantize=True)
    loaded = LagunaForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager",
                                               experts_implementation="eager", quantization_config=qc,
                                               output_loading_info=True)
    model, info = loaded if isinstance(loaded, tuple) else (loaded, None)
    model.eval()
    if isinstance(info, dict):
        for k, v in info.items():
            if v:
                mg.log(f"  loading info {k}: {list(v)[:10]}")
                mg.require(k not in ("missing_keys", "unexpected_keys", "mismatched_keys"),
                           f"transformers reported {k}: {list(v)[:10]}")
    L = c["num_hidden_layers"]
    n_sparse = sum(1 for t in c["mlp_layer_types"] if t == "sparse")
    mg.verify_implementations(model, L, n_sparse, "fp8 dequantised")
    mem = {k: v.detach() for k, v in model.state_dict().items()}
    kept = sorted({str(v.dtype).replace("torch.", "") for v in mem.values() if v.dtype != torch.float32})
    if kept:  # e.g. the router's correction bias, a BF16 buffer: its values are the file's either way
        mg.log(f"  tensors not in float32 after loading: dtypes {kept} (compared by value below)")

    # Every tensor of the file against what transformers loaded.
    F = c["moe_intermediate_size"]
    fp8_count = bf16_count = 0
    bad = []
    with safe_open(os.path.join(args.model, "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        for k in sorted(keys):
            if k.endswith("_scale_inv"):
                continue
            t = f.get_tensor(k)
            if t.dtype == torch.float8_e4m3fn:
                want = dequantize_by_hand(torch, t, f.get_tensor(k + "_scale_inv"), block)
                fp8_count += 1
            else:
                want = t.to(torch.float32)
                bf16_count += 1
            mname, sl = mg.on_disk_to_memory(k, F)
            if mname not in mem:
                bad.append(f"{k}: no loaded parameter {mname}")
                continue
            got = mem[mname] if sl is None else sl(mem[mname])
            if t.dtype == torch.float8_e4m3fn and got.dtype != torch.float32:
                bad.append(f"{k}: dequantised into {got.dtype}, expected float32")
                continue
            got = got.to(torch.float32)
            if tuple(got.shape) != tuple(want.shape) or not torch.equal(got, want):
                diff = (got - want).abs().max().item() if tuple(got.shape) == tuple(want.shape) else "shape"
                bad.append(f"{k}: loaded {mname} differs from code x scale (max abs diff {diff})")
    mg.require(not bad, "transformers' dequantised weights are not code x scale:\n  " + "\n  ".join(bad[:20]))
    mg.log(f"  {fp8_count} FP8 tensors equal code x scale bit for bit; {bf16_count} BF16 tensors equal")

    tracker = mg.RouterGapTracker(torch, model, c["num_experts"], c["num_experts_per_tok"])
    eos = c["eos_token_id"] if isinstance(c["eos_token_id"], list) else [c["eos_token_id"]]
    banned = {c["bos_token_id"], c["pad_token_id"], *eos}
    prompts = []
    for pi, length in enumerate(mg.PROMPT_LENGTHS):
        rec, _ = mg.clear_margin_transcript(torch, model, c, pi, length, PROMPT_SEED_BASE, args.max_prompt_attempts,
                                            tracker, banned)
        mg.log(f"  prompt {pi} (len {length}, seed {rec['prompt_seed']}): tokens {rec['tokens'][:12]}..., "
               f"first small margin {rec['first_small_margin_step']}, min margin {min(rec['margins']):.3g}")
        prompts.append(rec)
    tracker.remove()

    golden = mg.header(torch, transformers, model, os.path.basename(os.path.normpath(args.model)), "float32", "cpu")
    golden["fp8_load"] = {
        "quantization_config": {k: v for k, v in q.items() if k != "ignored_layers"},
        "transformers_config": "FineGrainedFP8Config(dequantize=True): every FP8 weight = code.float() * scale, "
                               "model run in float32 (no activation quantisation)",
        "fp8_tensors": fp8_count,
        "bf16_tensors": bf16_count,
        "dequantised_equal_code_times_scale": True,
    }
    golden["prompts"] = prompts
    mg.write_json(out_path, golden)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except mg.GoldenError as e:
        mg.log(f"FAILED: {e}")
        sys.exit(1)
