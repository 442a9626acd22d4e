#!/usr/bin/env python3
"""Times transformers' LagunaForCausalLM at batch 1 on one GPU, as the side-by-side peer of
`decodelab bench` (issue 3, item 7).

The model is built in BF16 directly on the GPU from the Laguna-XS.2 config (random weights; ~67 GB),
never in FP32 on the host. Greedy decoding with a DynamicCache, end-of-sequence ignored; TPOT is the
median wall time of a decode step (torch.cuda.synchronize after each), excluding the first.

  python3 tools/peers/transformers_bench.py --prompt-len 1024 --gen-len 128 --json-out out.json
"""
import argparse
import json
import statistics
import sys
import time


def xs2_config(num_layers):
    from transformers import LagunaConfig

    L = num_layers
    return LagunaConfig(
        vocab_size=100352,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=L,
        num_attention_heads=48,
        num_attention_heads_per_layer=[48 if l % 4 == 0 else 64 for l in range(L)],
        num_key_value_heads=8,
        head_dim=128,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
        layer_types=["full_attention" if l % 4 == 0 else "sliding_attention" for l in range(L)],
        sliding_window=512,
        rope_parameters={
            "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 32.0,
                               "original_max_position_embeddings": 4096, "beta_fast": 64.0,
                               "beta_slow": 1.0, "attention_factor": 1.0,
                               "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 1.0},
        },
        gating=True,
        mlp_layer_types=["dense"] + ["sparse"] * (L - 1),
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        moe_routed_scaling_factor=2.5,
        tie_word_embeddings=False,
        bos_token_id=2,
        eos_token_id=[2, 24],
        pad_token_id=9,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=40)
    ap.add_argument("--attn", default=None, help="attn_implementation (default: the library's)")
    ap.add_argument("--experts", default=None, help="experts_implementation (default: the library's)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache

    torch.manual_seed(0)
    cfg = xs2_config(args.num_layers)
    kwargs = {}
    if args.attn:
        kwargs["attn_implementation"] = args.attn
    if args.experts:
        kwargs["experts_implementation"] = args.experts
    t0 = time.time()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, **kwargs)
    model.eval()
    torch.cuda.synchronize()
    build_s = time.time() - t0
    attn_impl = getattr(model.config, "_attn_implementation", None)
    experts_impl = getattr(model.config, "_experts_implementation", None)
    params = sum(p.numel() for p in model.parameters())
    print(f"built {params/1e9:.2f} B params in {build_s:.1f} s; attn={attn_impl} experts={experts_impl}",
          flush=True)

    g = torch.Generator(device="cpu").manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), generator=g).cuda()
    steps = []
    with torch.no_grad():
        cache = DynamicCache(config=cfg)
        torch.cuda.synchronize()
        t = time.time()
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        prefill_ms = (time.time() - t) * 1e3
        tok = out.logits[:, -1, :].argmax(-1, keepdim=True)
        for _ in range(args.gen_len):
            t = time.time()
            out = model(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
            tok = out.logits[:, -1, :].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            steps.append((time.time() - t) * 1e3)
    steps = steps[1:]
    q = statistics.quantiles(steps, n=10)
    result = {
        "engine": "transformers",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "attn_implementation": attn_impl,
        "experts_implementation": experts_impl,
        "num_layers": args.num_layers,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "prefill_ms": prefill_ms,
        "tpot_ms_median": statistics.median(steps),
        "tpot_ms_p10": q[0],
        "tpot_ms_p90": q[-1],
        "tok_s": 1e3 / statistics.median(steps),
    }
    print(json.dumps(result), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
