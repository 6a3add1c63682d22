"""Write a random-weight Qwen3-MoE checkpoint (transformers) whose router prefers a few experts: a skewed expert load
for `graphinfer bench moe-balance --eplb` where no real MoE checkpoint is at hand (CPU).

The skew, as in tests/test_eplb.py: a small offset in hidden dimension 0 of every embedding row, and the router rows
of the --hot experts raised along that dimension, so most tokens pick them in every MoE layer; the experts' weights
are scaled up so that they, not the offset, steer the tokens.

    python tools/make_skewed_moe.py OUT_DIR [--num-experts 16 --hidden-size 256 --moe-intermediate-size 256
                                             --num-layers 4 --hot 12,13]
"""
import argparse

import torch


def main() -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--num-experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--moe-intermediate-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hot", default="12,13", help="comma-separated experts the router prefers (default: two of the "
                                                   "last quarter, i.e. of the last of 4 EP ranks)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    hot = [int(e) for e in args.hot.split(",")]
    torch.manual_seed(args.seed)
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                            num_hidden_layers=args.num_layers, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=args.hidden_size // 4, max_position_embeddings=2048,
                            moe_intermediate_size=args.moe_intermediate_size, num_experts=args.num_experts,
                            num_experts_per_tok=args.top_k, norm_topk_prob=True, tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight[:, 0] += 0.05
        for layer in hf.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(6.0)
            layer.mlp.experts.down_proj.mul_(6.0)
            for i, e in enumerate(hot):
                layer.mlp.gate.weight[e, 0] += 1.05 if i == 0 else 0.7
    hf.save_pretrained(args.out)
    print(f"wrote {args.out}: {args.num_experts} experts, top-{args.top_k}, hot {hot}")


if __name__ == "__main__":
    main()
