"""Random-weight Switch Transformers checkpoints with the exact shapes of google/switch-base-8
and google/switch-base-16 (d_model 768, d_ff 3072, 12 + 12 blocks, MoE every second block,
expert = 2 × 768 × 3072 = 4.7 M weights), for bytes-and-latency benchmarks.

Routing in random weights is not realistic (near-uniform and uncorrelated across layers): hit
ratios and dictionary accuracy on these models say nothing about a trained model — the trained
demo model is the reference for those. These checkpoints measure bytes moved and latency.

Usage (pinned versions in tests/fixtures/requirements.txt; written into an ignored folder):
    .venv/bin/python benches/make_big_switch.py target/big/switch-base-8 --experts 8
    .venv/bin/python benches/make_big_switch.py target/big/switch-8-narrow --d-model 256 --d-ff 512 --heads 4
"""

import argparse
import json
import os
import shutil

import torch
import transformers
from transformers import GenerationConfig, SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
assert transformers.__version__ == "5.23.0", transformers.__version__


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    # Narrower layers keep the block structure (12 + 12 blocks, MoE every second one, N experts)
    # for routing and cache studies that do not need switch-base-8's bytes.
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--d-ff", type=int, default=3072)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--tokenizer", default=os.path.join(os.path.dirname(__file__), "..", "models",
                                                            "switch-samsum-tiny", "tokenizer.json"))
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    config = SwitchTransformersConfig(
        vocab_size=32128, d_model=args.d_model, d_kv=args.d_model // args.heads, d_ff=args.d_ff,
        num_heads=args.heads, num_layers=12,
        num_decoder_layers=12, num_experts=args.experts, encoder_sparse_step=2, decoder_sparse_step=2,
        expert_capacity=64, router_bias=False, tie_word_embeddings=True, dropout_rate=0.0,
        decoder_start_token_id=0, eos_token_id=1, pad_token_id=0,
    )
    with torch.no_grad():
        model = SwitchTransformersForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(decoder_start_token_id=0, eos_token_id=1, pad_token_id=0,
                                               max_new_tokens=64)
    model.save_pretrained(args.out)
    shutil.copy(args.tokenizer, os.path.join(args.out, "tokenizer.json"))
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    print(json.dumps({"out": args.out, "parameters": params, "expert_parameters": experts}))


if __name__ == "__main__":
    main()
