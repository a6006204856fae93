"""A random-weight OLMoE checkpoint with the layer shapes of allenai/OLMoE-1B-7B-0924 (hidden
2048, 16 heads, 64 experts of width 1024 per layer, top-8, vocabulary 50304) and fewer layers,
for decode-latency and bytes benchmarks of decoder-only models. One expert is 3 × 2048 × 1024 =
6.3 M weights (12.6 MB in bf16); four layers hold 256 of them (3.2 GB).

Routing in random weights is not realistic (near-uniform, uncorrelated across layers and
tokens): hit ratios here are a floor, not what a trained model gets. The tokenizer is the tiny
test fixture's (its ids fit the vocabulary): prompts are text, their meaning is irrelevant.

Usage (pinned versions in tests/fixtures/requirements.txt; written into an ignored folder):
    .venv/bin/python benches/make_big_decoder.py target/big/olmoe-4l --layers 4
"""

import argparse
import json
import os
import shutil

import torch
import transformers
from transformers import GenerationConfig, OlmoeConfig, OlmoeForCausalLM

assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
assert transformers.__version__ == "5.23.0", transformers.__version__


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                            "fixtures", "tiny-olmoe", "tokenizer.json"))
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    config = OlmoeConfig(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=args.layers,
        num_attention_heads=16, num_key_value_heads=16, num_experts=args.experts,
        num_experts_per_tok=8, norm_topk_prob=False, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=0,
        pad_token_id=0,
    )
    # bf16 as the released checkpoint; built in bf16 to halve the memory it takes.
    torch.set_default_dtype(torch.bfloat16)
    with torch.no_grad():
        model = OlmoeForCausalLM(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=0, pad_token_id=0,
                                               max_new_tokens=32)
    model.save_pretrained(args.out, max_shard_size="2GB")
    shutil.copy(args.tokenizer, os.path.join(args.out, "tokenizer.json"))
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    print(json.dumps({"out": args.out, "parameters": params, "expert_parameters": experts}))


if __name__ == "__main__":
    main()
