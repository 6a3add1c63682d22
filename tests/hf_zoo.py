"""A zoo of tiny random-weight HF decoders, saved by transformers, for the `model_impl="transformers"` path.

Every entry is built from its transformers config class (no hub access: nothing is downloaded), in fp32, under a fixed
seed, with the parameters that init leaves at a constant (norm gains and biases, linear biases, router and
score-correction biases, attention sinks) perturbed away from it, and saved with `save_pretrained` as safetensors.
HF transformers' own modeling code on the saved weights (fp32, eager attention) is the oracle: `hf_greedy`,
`hf_logits`, `greedy_matches_hf`.

The weights are drawn wider than HF's init (initializer_range 0.1, not 0.02): at 0.02 a 64-wide model's attention
scores are ~0.03, attention is uniform, and a wrong sliding window, softcap, sink or scaling would not change a
token. Sliding windows are 8 or 16 tokens so the prompts of ZOO_PROMPTS (5, 23, 41, 67 tokens) cross them; softcaps
are lowered to where a tiny model's scores reach them. Prompts are token ids: no tokenizer is shipped.

name          HF class (config class)                       what it exercises
----------------------------------------------------------------------------------------------------------------------
gemma3        Gemma3ForCausalLM (Gemma3TextConfig)          (1 + w) RMSNorm x4 per layer, q/k-norm, embeddings *
                                                            sqrt(hidden), query_pre_attn_scalar (24 != head_dim 16),
                                                            sliding (window 8) / full layers with their own rope (10k
                                                            / 1M + linear x8), gelu-tanh GLU, tied
gemma2        Gemma2ForCausalLM (Gemma2Config)              (1 + w) RMSNorm x4 per layer, attention logit softcap
                                                            (2.0) and final logit softcap (1.0), sliding (8) / full
                                                            alternating, query_pre_attn_scalar 24, tied
mistral       MistralForCausalLM (MistralConfig)            sliding window (16) on every layer (Mistral-7B-v0.1
                                                            style), GQA, untied
mixtral       MixtralForCausalLM (MixtralConfig)            MoE: 4 experts, top-2 softmax routing renormalised, rope
                                                            1e6, untied; saved as sharded safetensors
phi3          Phi3ForCausalLM (Phi3Config)                  fused qkv_proj and gate_up_proj in the checkpoint, partial
                                                            rotary 0.75 and longrope (short/long factors, attention
                                                            factor) as Phi-4-mini, tied as Phi-4-mini
phi3_rope     Phi3ForCausalLM (Phi3Config)                  Phi-3-mini-4k / Phi-4 style: fused qkv_proj and gate_up_proj,
                                                            default rope with partial rotary 0.75, untied
olmo2         Olmo2ForCausalLM (Olmo2Config)                norms after attention and MLP (no pre-norm), q/k RMSNorm
                                                            over the whole projected width (heads * head_dim), untied
glm4          Glm4ForCausalLM (Glm4Config)                  partial rotary 0.5 with interleaved (GPT-J) pairs, q/k/v
                                                            bias (no o bias), fused gate_up_proj, extra post-attention
                                                            / post-MLP norms (4 per layer), untied
smollm3       SmolLM3ForCausalLM (SmolLM3Config)            NoPE layers (every 4th layer has no rope), rope theta 2e6,
                                                            tied
ernie4_5      Ernie4_5ForCausalLM (Ernie4_5Config)          interleaved rotary, rope 5e5, tied
ernie4_5_moe  Ernie4_5_MoeForCausalLM (Ernie4_5_MoeConfig)  MoE from layer 1 (layer 0 dense), shared expert,
                                                            e_score_correction_bias in expert choice only,
                                                            renormalised top-k with norm_min, interleaved rotary, tied
gpt_oss       GptOssForCausalLM (GptOssConfig)              attention sinks, sliding (8) / full alternating, q/k/v/o
                                                            biases, yarn rope, MoE with router bias, softmax over the
                                                            top-k, experts stored stacked with interleaved gate/up
                                                            columns and biases, clamped swiglu ((up + 1) * gate *
                                                            sigmoid(1.702 gate)), untied
cohere2       Cohere2ForCausalLM (Cohere2Config)            mean-subtracting LayerNorm (no bias), parallel attention +
                                                            MLP off one norm, interleaved rotary on sliding layers and
                                                            NoPE on full layers, sliding (8) 2:1, logit_scale 0.0625,
                                                            tied
qwen2_moe     Qwen2MoeForCausalLM (Qwen2MoeConfig)          MoE: 4 experts top-2 not renormalised, shared expert with
                                                            a sigmoid gate, q/k/v bias, untied
granitemoe    GraniteMoeForCausalLM (GraniteMoeConfig)      MoE (4 experts top-2, stacked input_linear /
                                                            output_linear), embedding_multiplier 12,
                                                            residual_multiplier 0.22, attention_multiplier 1/head_dim
                                                            (replaces 1/sqrt(head_dim)), logits divided by
                                                            logits_scaling 6, untied
starcoder2    Starcoder2ForCausalLM (Starcoder2Config)      LayerNorm with bias, GELU (tanh) MLP c_fc/c_proj with
                                                            biases, q/k/v/o biases, sliding window 16 on every layer,
                                                            tied
granite       GraniteForCausalLM (GraniteConfig)            dense Granite-3 multipliers (embedding 12, residual 0.22,
                                                            attention 1/head_dim, logits / 8), untied

Tied models get their embeddings scaled by 0.25 after init (ZooSpec.embed_init_scale): tied and at full size, the
token's own embedding wins the LM head's dot product and greedy decoding repeats one token.

Sliding windows are HF's: a query at position i attends keys j with i - window < j <= i (the window counts the
query itself).

Unsupported (for the refusal tests), in UNSUPPORTED: a T5 encoder-decoder (T5ForConditionalGeneration) and a Mamba
(MambaForCausalLM, state-space layers, no attention).

Every architecture of the requested list exists in transformers 5.17 and builds offline; none had to be left out.
Family values that were changed for the tiny models are said in each spec's notes (softcaps, windows, multipliers).

HF quirks met on the way (transformers 5.17):
- generate() fills every field left None in the GenerationConfig it is given from the model's own
  generation_config, so eos_token_id=None does not turn EOS off; min_new_tokens would mask EOS's logit (another
  greedy token wherever EOS is the argmax). hf_greedy clears EOS on the model's generation_config for the call.
- Phi3Config with longrope logs "set the `factor` field ... instead" for original_max_position_embeddings: harmless,
  the Phi-3/4 checkpoints are written that way; HF takes factor = max_position_embeddings / original (4 here). HF
  switches to long_factor when a sequence passes original_max_position_embeddings (256): no zoo prompt does.
- Gemma 3's rope_parameters is a dict per layer type; an override must give both types.
- Starcoder2Config's defaults put bos/eos (50256) outside its own vocab (49152): every zoo config sets ids 1/2/0.
- In fp32 no zoo model has an exact top-2 tie along 16 greedy tokens of ZOO_PROMPTS (smallest relative gap 1.4e-4,
  qwen2_moe); in bf16 such gaps are ties (bf16's ulp is 2**-8 relative), so 16-bit comparisons need a bf16-sized
  tie tolerance, not greedy_matches_hf's default 1e-5.

DEEPSEEK: tiny DeepSeek-V2/V3 checkpoints for the native DeepSeek model, in their own dict (not in ZOO, whose entries
the transformers path's tests run); fixtures deepseek_checkpoint(name) and deepseek_mtp_checkpoint(). Built, perturbed
and saved as the zoo is (fp32, safetensors, INIT_RANGE 0.1, norm gains incl. q_a_layernorm / kv_a_layernorm 1 + 0.3
randn), untied as DeepSeek ships, hidden 64, vocab 256, 512 positions, 3 layers: layer 0 dense (MLP 128), layers 1-2
MoE (8 routed experts of 32 in 4 groups, plus shared experts). MLA: 4 heads (num_key_value_heads 4: HF expands the
latent to every head), q/k head 16 nope + 8 rope = 24, v head 16, kv latent 32. The routers are drawn 3x wider than
HF's init (normal 0.3, DS_ROUTER_INIT_SCALE) and V3's e_score_correction_bias (a buffer: perturb_constants does not see
it) as 0.3 randn (DS_SCORE_BIAS_SCALE); seed 5 (DS_SEED), where every routing choice along ZOO_PROMPTS and their 16
greedy tokens wins by >= 1e-3 (deepseek_routing_margins; seed 0 had a 1e-5 one). Zeroing the correction bias, or
keeping every group (topk_group = n_group), changes HF's greedy tokens (DEEPSEEK_TOKEN_MUTATIONS).

name                  HF class (config class)                   what it exercises
----------------------------------------------------------------------------------------------------------------------
deepseek_v3           DeepseekV3ForCausalLM (DeepseekV3Config)  q LoRA (rank 32, q_a_layernorm), YaRN x4 over 128
                                                                (mscale = mscale_all_dim = 1), interleaved rotary,
                                                                sigmoid routing with e_score_correction_bias, top-2 of
                                                                4 groups, top-2 experts renormalised x 2.5, 1 shared
                                                                expert; num_nextn_predict_layers 0
deepseek_v3_no_qlora  DeepseekV3ForCausalLM (DeepseekV3Config)  deepseek_v3 with one q_proj (no q LoRA) and default rope
deepseek_v2           DeepseekV2ForCausalLM (DeepseekV2Config)  one q_proj (V2-Lite), YaRN x4 over 128 (mscale =
                                                                mscale_all_dim = 0.707, V2-Lite's), complex-pair rotary,
                                                                softmax routing, group_limited_greedy (top-2 of 4
                                                                groups, top-3 experts), not renormalised, x 16, 2 shared
                                                                experts (one MLP of 64)

config.json also carries DeepSeek's own routing keys, which HF's config keeps but V3's code does not read: V3
scoring_func "sigmoid", topk_method "noaux_tc"; V2 scoring_func "softmax" (V2's code reads topk_method).

What transformers 5.17 computes (the oracle a native model must match):
- Rotary on the 8 rope dims only (q_pe from q's last 8 per head, k_pe the last 8 of kv_a_proj_with_mqa, one k_pe
  shared by every head), as interleaved (GPT-J) pairs (2i, 2i + 1) at frequency inv_freq[i], dim = qk_rope_head_dim.
  V3 with rope_interleave True (HF's default, DeepSeek's layout) rotates x[0::2], x[1::2] and writes the result
  de-interleaved (cat(even', odd')): the same permutation of q_pe and k_pe, so the same scores. V2 multiplies complex
  pairs (view_as_complex over the last dim) by cos + i sin. Queries are cat(q_nope, q_pe), keys cat(k_nope, k_pe).
- Softmax scale: qk_head_dim**-0.5 (24 here), times mscale**2 where mscale = 0.1 * mscale_all_dim * ln(factor) + 1
  whenever rope_type is not default and mscale_all_dim is non-zero (V3 here 1.1386**2, V2 1.0980**2). cos/sin are
  multiplied by YaRN's attention factor get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim): 1 for both
  (mscale = mscale_all_dim, as every DeepSeek release). YaRN's inv_freq: beta_fast 32 / beta_slow 1 over
  original_max_position_embeddings 128, correction range floored / ceiled (truncate defaults True); all positions use
  it (no switch at 128).
- V3 routing (DeepseekV3TopkRouter, fp32): s = sigmoid(x W^T); choice = s + e_score_correction_bias; a group's score
  is the sum of its best two choice scores; keep the topk_group best groups; top-k experts by choice score among them;
  weights = s (unbiased) of those, / (sum + 1e-20) if norm_topk_prob, x routed_scaling_factor; plus the shared
  experts' MLP (n_shared_experts x moe_intermediate_size wide) on every token.
- V2 routing (DeepseekV2TopkRouter): p = softmax(x W^T) in fp32; topk_method "greedy": top-k of p;
  "group_limited_greedy": a group's score is its max p, keep the topk_group best groups, p of the others set to 0,
  top-k of that; weights = p of the chosen, x routed_scaling_factor; norm_topk_prob is never read (V2 and V2-Lite ship
  False); any other topk_method fails (topk_weights unbound). With top-2 of groups ranked by their max, keeping two
  groups never changes the choice: hence top-3 here.

make_mtp_checkpoint(src, dst, seed) appends one MTP layer to a deepseek_v3 checkpoint, DeepSeek's names at index
num_hidden_layers (model.layers.3.*: a whole MoE decoder layer, enorm, hnorm, eh_proj [64, 128], shared_head.norm,
and embed_tokens / shared_head.head as copies of the main embedding / lm_head, as DeepSeek stores them), config
num_nextn_predict_layers 1. DeepseekV3ForCausalLM ignores the layer (it lists its tensors as unexpected: its own
ignore pattern names layer 61 only) and gives the same tokens. transformers 5.17's generic MtpModel (generate(use_mtp=
True)) loads every tensor of it once told the layer's index (load_hf_mtp); hf_mtp_logits gives its draft logits.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import warnings
from dataclasses import dataclass, field

import torch

INIT_RANGE = 0.1  # see the docstring: wide enough that attention is not uniform
ZOO_PROMPT_LENGTHS = (5, 23, 41, 67)
ZOO_MIN_VOCAB = 256

# Shared tiny shape: hidden 64, 4 query heads / 2 kv heads of 16, MLP 128, 512 positions, ids in range.
_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=INIT_RANGE, use_cache=True,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)


@dataclass(frozen=True)
class ZooSpec:
    model_cls: str  # transformers class name (AutoModelForCausalLM picks it from the config; checked in the tests)
    config_cls: str
    kwargs: dict
    notes: str
    moe: bool = False
    sliding_window: int | None = None  # the window of the model's sliding layers, None if it has none
    shard: str | None = None  # max_shard_size for save_pretrained (several safetensors files), None: one file
    exercises: tuple = field(default_factory=tuple)  # short tags: "sliding", "softcap", "sinks", ...
    # Input embeddings scaled after init; None: 0.25 where tied, else 1. With tied embeddings the residual stream's
    # token embedding wins the LM head's dot product, and greedy output repeats one token; smaller embeddings let the
    # layers decide. Granite's multiplier 12 is undone (1/12).
    embed_init_scale: float | None = None
    # DeepSeek (DEEPSEEK only; the defaults leave every ZOO entry as it was): the routers' weights (`mlp.gate.weight`,
    # HF's init normal(0, initializer_range)) multiplied by router_init_scale, and the e_score_correction_bias buffers
    # (zeros at init, and buffers, so perturb_constants does not see them) drawn as score_bias_scale * randn.
    router_init_scale: float = 1.0
    score_bias_scale: float | None = None
    seed: int = 0  # build_model's and make_checkpoint's default seed

    def config(self):
        import transformers

        return getattr(transformers, self.config_cls)(**{**_BASE, **self.kwargs})


def _rope(theta, **extra):
    return {"rope_type": "default", "rope_theta": theta, **extra}


ZOO: dict[str, ZooSpec] = {
    "gemma3": ZooSpec(
        "Gemma3ForCausalLM", "Gemma3TextConfig",
        dict(num_hidden_layers=3, head_dim=16, vocab_size=512, query_pre_attn_scalar=24, sliding_window=8,
             layer_types=["sliding_attention", "sliding_attention", "full_attention"],
             rope_parameters={"sliding_attention": _rope(10000.0),
                              "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}},
             hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
        "Gemma 3 text: (1 + w) RMSNorm (input, post-attention, pre- and post-feedforward), q/k RMSNorm, embeddings "
        "scaled by sqrt(hidden), scores scaled by query_pre_attn_scalar**-0.5 (24, not head_dim), sliding layers "
        "(window 8; the family's 5:1 pattern as 2:1) with rope 10k, full layers with rope 1M and linear scaling x8 "
        "(the 4B+ models'), no softcap, tied. vocab 512.",
        sliding_window=8, exercises=("one_plus_w_norm", "qk_norm", "sliding", "per_layer_rope", "query_pre_attn_scalar",
                                     "embed_scale", "tied")),
    "gemma2": ZooSpec(
        "Gemma2ForCausalLM", "Gemma2Config",
        dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             attn_logit_softcapping=2.0, final_logit_softcapping=1.0, rope_parameters=_rope(10000.0),
             hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
        "Gemma 2: (1 + w) RMSNorm x4 per layer, attention logits softcapped (tanh) at 2.0 and final logits at 1.0 (the "
        "family's 50 / 30 are never reached by a tiny model's scores; its logits here are within about +-0.8), "
        "sliding (8) / full alternating, query_pre_attn_scalar 24, embeddings * sqrt(hidden), tied.",
        sliding_window=8, exercises=("one_plus_w_norm", "softcap", "sliding", "query_pre_attn_scalar", "embed_scale",
                                     "tied")),
    "mistral": ZooSpec(
        "MistralForCausalLM", "MistralConfig",
        dict(head_dim=16, sliding_window=16, rope_parameters=_rope(10000.0), tie_word_embeddings=False),
        "Mistral-7B-v0.1 style: a sliding window (16) on every layer, GQA, rope 10k, untied.",
        sliding_window=16, exercises=("sliding",)),
    "mixtral": ZooSpec(
        "MixtralForCausalLM", "MixtralConfig",
        dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, rope_parameters=_rope(1000000.0),
             sliding_window=None, tie_word_embeddings=False),
        "Mixtral: sparse MoE in every layer (4 experts, top-2 of a softmax, renormalised), experts stored stacked, "
        "rope 1e6, no sliding window, untied. Saved as sharded safetensors (several files and an index).",
        moe=True, shard="60KB", exercises=("moe", "sharded")),
    "phi3": ZooSpec(
        "Phi3ForCausalLM", "Phi3Config",
        dict(max_position_embeddings=1024, original_max_position_embeddings=256,
             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                              "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                              "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]},
             tie_word_embeddings=True),
        "Phi-4-mini shape on Phi3ForCausalLM: qkv_proj and gate_up_proj fused in the checkpoint, partial rotary 0.75 "
        "(12 of 16 dims), longrope (prompts under original_max_position_embeddings 256 use the short factors; the "
        "attention factor sqrt(1 + ln 4 / ln 256) scales cos/sin), tied (Phi-3 itself is untied).",
        exercises=("fused_qkv", "fused_gate_up", "partial_rotary", "longrope", "tied")),
    "phi3_rope": ZooSpec(
        "Phi3ForCausalLM", "Phi3Config",
        dict(rope_parameters=_rope(10000.0, partial_rotary_factor=0.75), tie_word_embeddings=False),
        "Phi-3-mini-4k / Phi-4 (no longrope) on Phi3ForCausalLM: qkv_proj and gate_up_proj fused in the checkpoint, "
        "partial rotary 0.75 (12 of 16 dims), untied.",
        exercises=("fused_qkv", "fused_gate_up", "partial_rotary")),
    "olmo2": ZooSpec(
        "Olmo2ForCausalLM", "Olmo2Config",
        dict(num_key_value_heads=4, rope_parameters=_rope(500000.0), tie_word_embeddings=False),
        "OLMo-2: RMSNorm after attention and after the MLP (post_attention_layernorm, post_feedforward_layernorm; no "
        "pre-norm), q/k RMSNorm over the whole projected width (64, not per head), MHA, rope 5e5, untied.",
        exercises=("post_norm", "qk_norm_full_width")),
    "glm4": ZooSpec(
        "Glm4ForCausalLM", "Glm4Config",
        dict(head_dim=16, attention_bias=True, partial_rotary_factor=0.5,
             rope_parameters=_rope(10000.0, partial_rotary_factor=0.5), rms_norm_eps=1e-5, tie_word_embeddings=False),
        "GLM-4: partial rotary (half of head_dim) with interleaved pairs (x[0::2], x[1::2]), q/k/v bias (no o_proj "
        "bias), fused gate_up_proj, four RMSNorms per layer (input; post_self_attn on the attention output; "
        "post_attention before the MLP; post_mlp on its output), untied.",
        exercises=("partial_rotary", "interleaved_rotary", "qkv_bias", "fused_gate_up", "post_norm")),
    "smollm3": ZooSpec(
        "SmolLM3ForCausalLM", "SmolLM3Config",
        dict(num_hidden_layers=4, rope_parameters=_rope(2000000.0), no_rope_layer_interval=4, use_sliding_window=False,
             tie_word_embeddings=True),
        "SmolLM3: NoPE layers (no_rope_layers [1, 1, 1, 0]: the 4th layer applies no rope), rope 2e6, tied.",
        exercises=("nope_layers", "tied")),
    "ernie4_5": ZooSpec(
        "Ernie4_5ForCausalLM", "Ernie4_5Config",
        dict(head_dim=16, rope_parameters=_rope(500000.0), use_bias=False, tie_word_embeddings=True),
        "ERNIE-4.5 dense (0.3B shape): interleaved rotary (cos/sin repeat-interleaved, rotate_half on pairs), rope "
        "5e5, tied.",
        exercises=("interleaved_rotary", "tied")),
    "ernie4_5_moe": ZooSpec(
        "Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig",
        dict(num_hidden_layers=3, head_dim=16, rope_parameters=_rope(500000.0), use_bias=False,
             moe_intermediate_size=32, moe_k=2, moe_num_experts=4, moe_num_shared_experts=1, moe_layer_start_index=1,
             moe_layer_end_index=2, moe_layer_interval=1, tie_word_embeddings=True),
        "ERNIE-4.5 MoE: layer 0 dense, layers 1-2 sparse (4 experts top-2 of a softmax, renormalised with "
        "moe_norm_min, experts chosen by softmax + e_score_correction_bias but weighted without it) plus one shared "
        "expert, interleaved rotary, tied.",
        moe=True, exercises=("moe", "score_correction_bias", "shared_expert", "dense_first_layer",
                             "interleaved_rotary", "tied")),
    "gpt_oss": ZooSpec(
        "GptOssForCausalLM", "GptOssConfig",
        dict(head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
             layer_types=["sliding_attention", "full_attention"], attention_bias=True,
             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
             max_position_embeddings=131072, tie_word_embeddings=False),
        "gpt-oss: a learned attention sink per head (an extra softmax logit), sliding (8) / full alternating, q/k/v/o "
        "biases, yarn rope (factor 32, truncate False, attention factor), MoE in every layer (router with bias, top-2 "
        "then softmax over the two), experts stacked [E, in, out] with interleaved gate/up columns and biases, "
        "activation (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = clamp(gate, max 7), untied. "
        "max_position_embeddings is the family's 131072 (yarn's factor is relative to the original 4096).",
        moe=True, sliding_window=8, exercises=("sinks", "sliding", "attn_bias", "yarn", "moe", "router_bias",
                                               "clamped_swiglu")),
    "cohere2": ZooSpec(
        "Cohere2ForCausalLM", "Cohere2Config",
        dict(num_hidden_layers=3, head_dim=16, sliding_window=8, logit_scale=0.0625,
             layer_types=["sliding_attention", "sliding_attention", "full_attention"],
             rope_parameters=_rope(50000.0), tie_word_embeddings=True),
        "Command R7B / Cohere 2: LayerNorm that subtracts the mean (weight only, no bias), one norm feeding attention "
        "and MLP in parallel (x + attn(n) + mlp(n)), interleaved rotary on sliding layers (window 8, the family's 3:1 "
        "as 2:1) and no rope at all on the full layer, logits * logit_scale 0.0625, tied.",
        sliding_window=8, exercises=("layernorm", "parallel_block", "interleaved_rotary", "nope_layers", "sliding",
                                     "logit_scale", "tied")),
    "qwen2_moe": ZooSpec(
        "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
        dict(moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
             norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True,
             rope_parameters=_rope(1000000.0), use_sliding_window=False, tie_word_embeddings=False),
        "Qwen1.5/2-MoE: 4 experts top-2 of a softmax, not renormalised, plus a shared expert scaled by "
        "sigmoid(shared_expert_gate(x)), q/k/v bias, untied.",
        moe=True, exercises=("moe", "shared_expert_gate", "qkv_bias")),
    "granitemoe": ZooSpec(
        "GraniteMoeForCausalLM", "GraniteMoeConfig",
        dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
             residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=6.0,
             rope_parameters=_rope(10000.0), tie_word_embeddings=False),
        "Granite-3.0 MoE (1b-a400m's multipliers): embeddings * 12, each residual branch * 0.22, attention scores * "
        "1/head_dim (0.0625; the release's 0.015625 is 1/64 of its head_dim 64) instead of 1/sqrt(head_dim), logits "
        "/ 6, MoE 4 experts top-2 (softmax over the top-k) stored as input_linear (gate and up stacked) / "
        "output_linear. Untied (GraniteMoeConfig's default; the releases tie: tied, a tiny random Granite repeats "
        "one token).",
        moe=True, exercises=("multipliers", "moe", "tied"), embed_init_scale=1 / 12),
    "starcoder2": ZooSpec(
        "Starcoder2ForCausalLM", "Starcoder2Config",
        dict(sliding_window=16, use_bias=True, hidden_act="gelu_pytorch_tanh", rope_parameters=_rope(100000.0),
             tie_word_embeddings=True),
        "StarCoder2: LayerNorm with bias, non-gated MLP c_fc -> gelu(tanh) -> c_proj with biases, q/k/v/o biases, a "
        "sliding window (16) on every layer, rope 1e5, tied.",
        sliding_window=16, exercises=("layernorm_bias", "gelu_mlp", "attn_bias", "sliding", "tied")),
    "granite": ZooSpec(
        "GraniteForCausalLM", "GraniteConfig",
        dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=8.0,
             rope_parameters=_rope(10000.0), tie_word_embeddings=False),
        "Granite-3.0 dense (2b's multipliers): embeddings * 12, residual branches * 0.22, attention scores * "
        "1/head_dim (0.0625, as the release's 1/64 for head_dim 64), logits / 8. Untied (GraniteConfig's default; "
        "the releases tie, but tied, a tiny random Granite repeats one token).",
        exercises=("multipliers", "tied"), embed_init_scale=1 / 12),
}


@dataclass(frozen=True)
class UnsupportedSpec:
    model_cls: str
    config_cls: str
    kwargs: dict
    reason: str  # what a user should be told (the refusal's message should contain it)

    def config(self):
        import transformers

        return getattr(transformers, self.config_cls)(**self.kwargs)


UNSUPPORTED: dict[str, UnsupportedSpec] = {
    "t5": UnsupportedSpec(
        "T5ForConditionalGeneration", "T5Config",
        dict(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
             decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, initializer_factor=1.0),
        "encoder-decoder"),
    "mamba": UnsupportedSpec(
        "MambaForCausalLM", "MambaConfig",
        dict(vocab_size=256, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
             bos_token_id=1, eos_token_id=2, pad_token_id=0),
        "Mamba / state-space layers"),
}


# --- DeepSeek (a native model's material: not in ZOO, whose entries run through the transformers path's tests)

# MLA and DeepSeekMoE at a tiny size: 4 heads (num_key_value_heads = heads: HF expands the latent to every head),
# q/k head 16 nope + 8 rope, v head 16, kv latent 32; layer 0 dense (intermediate 128), layers 1-2 MoE: 8 routed
# experts of 32 in 4 groups, top-2 (V2: top-3) from the best 2 groups, plus shared experts. Untied, as DeepSeek ships.
_DS_MLA = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
               moe_intermediate_size=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
               first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
               rms_norm_eps=1e-6, tie_word_embeddings=False)
_DS_V3 = dict(_DS_MLA, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5, scoring_func="sigmoid",
              topk_method="noaux_tc", num_nextn_predict_layers=0)
# DeepSeek-V3's YaRN (factor 40 over 4096, mscale = mscale_all_dim = 1.0, beta 32 / 1) scaled down: factor 4 over 128
# positions (max_position_embeddings 512 = 4 x 128).
_DS_V3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
               "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0}
# DeepSeek-V2-Lite's YaRN (factor 40 over 4096, mscale = mscale_all_dim = 0.707) scaled down the same way.
_DS_V2_YARN = dict(_DS_V3_YARN, mscale=0.707, mscale_all_dim=0.707)
DS_ROUTER_INIT_SCALE = 3.0  # routers normal(0, 0.3): sigmoid / softmax scores spread, routing not uniform
DS_SCORE_BIAS_SCALE = 0.3  # e_score_correction_bias ~ 0.3 randn: of the order of the sigmoid scores' spread
# Seed 5, not 0: at seed 0 a routing choice along ZOO_PROMPTS' greedy continuations is decided by 1e-5 (an fp32
# reordering away from a flip); at 5 every choice of the three entries has a margin of 1e-3 (deepseek_routing_margins).
DS_SEED = 5

DEEPSEEK: dict[str, ZooSpec] = {
    "deepseek_v3": ZooSpec(
        "DeepseekV3ForCausalLM", "DeepseekV3Config",
        dict(_DS_V3, q_lora_rank=32, rope_parameters=_DS_V3_YARN),
        "DeepSeek-V3 / R1: MLA with a q LoRA (q_a_proj -> q_a_layernorm -> q_b_proj, rank 32) and the kv latent "
        "(kv_a_proj_with_mqa -> 32 latent + 8 rope dims; kv_a_layernorm; kv_b_proj -> per-head k_nope 16 and v 16), "
        "interleaved rotary on the 8 rope dims (rope_interleave True, HF's default), YaRN (factor 4, mscale = "
        "mscale_all_dim = 1: cos/sin unscaled, softmax scale 24**-0.5 * (1 + 0.1 ln 4)**2). Layer 0 dense, layers "
        "1-2 MoE: sigmoid scores; experts chosen on score + e_score_correction_bias, only within the top-2 of 4 "
        "groups (a group ranked by the sum of its best two biased scores); weights are the unbiased scores of the "
        "chosen two, renormalised (norm_topk_prob), times routed_scaling_factor 2.5; plus one shared expert. "
        "num_nextn_predict_layers 0 (make_mtp_checkpoint adds one MTP layer).",
        moe=True, router_init_scale=DS_ROUTER_INIT_SCALE, score_bias_scale=DS_SCORE_BIAS_SCALE, seed=DS_SEED,
        exercises=("mla", "q_lora", "interleaved_rotary", "yarn", "moe", "sigmoid_routing", "score_correction_bias",
                   "group_limited_routing", "shared_expert", "dense_first_layer")),
    "deepseek_v3_no_qlora": ZooSpec(
        "DeepseekV3ForCausalLM", "DeepseekV3Config",
        dict(_DS_V3, q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "deepseek_v3 without the q LoRA (one q_proj, as V2-Lite and the small V3-architecture models) and with "
        "default rope (no YaRN: softmax scale 24**-0.5). Routing as deepseek_v3.",
        moe=True, router_init_scale=DS_ROUTER_INIT_SCALE, score_bias_scale=DS_SCORE_BIAS_SCALE, seed=DS_SEED,
        exercises=("mla", "interleaved_rotary", "moe", "sigmoid_routing", "score_correction_bias",
                   "group_limited_routing", "shared_expert", "dense_first_layer")),
    "deepseek_v2": ZooSpec(
        "DeepseekV2ForCausalLM", "DeepseekV2Config",
        dict(_DS_MLA, q_lora_rank=None, num_experts_per_tok=3, n_shared_experts=2, topk_method="group_limited_greedy",
             scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=16.0, rope_parameters=_DS_V2_YARN),
        "DeepSeek-V2 routing on V2-Lite's attention: MLA with one q_proj (no q LoRA), rotary on the 8 rope dims as "
        "complex pairs (interleaved), YaRN as V2-Lite (factor 4, mscale = mscale_all_dim = 0.707: cos/sin unscaled, "
        "softmax scale 24**-0.5 * (1 + 0.0707 ln 4)**2). Layer 0 dense, layers 1-2 MoE: softmax scores, "
        "group_limited_greedy (the top-2 of 4 groups ranked by their best score, then the top-3 experts in them: "
        "with top-2 a group limit of 2 could never bind), weights the softmax scores not renormalised, times "
        "routed_scaling_factor 16 (V2's; V2-Lite's is 1), plus 2 shared "
        "experts (one MLP of 2 x 32). No correction bias.",
        moe=True, router_init_scale=DS_ROUTER_INIT_SCALE, seed=DS_SEED,
        exercises=("mla", "interleaved_rotary", "yarn", "moe", "softmax_routing", "group_limited_routing",
                   "shared_expert", "dense_first_layer")),
}


def _draw_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, ZOO_MIN_VOCAB, (n,), generator=g).tolist() for n in ZOO_PROMPT_LENGTHS]


ZOO_PROMPTS: list[list[int]] = _draw_prompts()  # ids in [3, 256): within every zoo vocab, no bos/eos/pad


# --- building


@contextlib.contextmanager
def one_thread():
    """torch on one intra-op thread for the block (restored after). The zoo's matmuls are tiny: a second thread only
    adds OpenMP hand-offs, and on a loaded 2-core machine spinning threads made this file's run 7x slower (60 s vs
    9 s). The oracle helpers run under it, so HF's numbers do not depend on the caller's thread count."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def constant_at_init(model: torch.nn.Module, name: str) -> float | None:
    """The perturbation scale of parameter `name` if init leaves it constant (norm weights and biases 0.3, gpt-oss's
    sinks 1.0, every other bias 0.1: linear, router, expert, e_score_correction_bias), else None."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if "norm" in type(owner).__name__.lower() or "norm" in owner_name.rpartition(".")[2].lower():
        return 0.3
    if leaf == "sinks":
        return 1.0
    if "bias" in leaf:
        return 0.1
    return None


@torch.no_grad()
def perturb_constants(model: torch.nn.Module, seed: int = 1) -> list[str]:
    """Move every parameter that init leaves constant away from it (constant_at_init: + scale * randn), so a reader
    that ignores it, or reads it the wrong way ((1 + w) vs w, a missing bias), gives other logits. Norm gains become
    1 + 0.3 randn for ones-init norms and 0.3 randn around Gemma's zero init (a gain of 1 + 0.3 randn). Returns the
    names touched."""
    g = torch.Generator().manual_seed(seed)
    touched = []
    for name, p in model.named_parameters():
        scale = constant_at_init(model, name)
        if scale is not None:
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))
            touched.append(name)
    return touched


@torch.no_grad()
def perturb_routing(model: torch.nn.Module, router_scale: float = 1.0, score_bias_scale: float | None = None,
                    seed: int = 2) -> list[str]:
    """DeepSeek's routing made decisive: every router weight (a `.mlp.gate` module's `weight`) multiplied by
    router_scale, and every `e_score_correction_bias` buffer drawn as score_bias_scale * randn (a fixed generator).
    A no-op with the defaults (every ZOO entry). Returns the names touched."""
    touched = []
    if router_scale != 1.0:
        for name, mod in model.named_modules():
            if name.endswith(".mlp.gate") and isinstance(getattr(mod, "weight", None), torch.Tensor):
                mod.weight.mul_(router_scale)
                touched.append(f"{name}.weight")
    if score_bias_scale is not None:
        g = torch.Generator().manual_seed(seed)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(score_bias_scale * torch.randn(buf.shape, generator=g, dtype=torch.float32))
                touched.append(name)
    return touched


def zoo_spec(name: str):
    """ZOO[name], DEEPSEEK[name] or UNSUPPORTED[name] (the three have no name in common)."""
    for table in (ZOO, DEEPSEEK, UNSUPPORTED):
        if name in table:
            return table[name]
    raise KeyError(name)


@one_thread()
def build_model(name: str, seed: int | None = None):
    """ZOO[name] (or DEEPSEEK[name], UNSUPPORTED[name]) as an in-memory fp32 model in eval mode, eager attention,
    constants perturbed: exactly what make_checkpoint saves. seed None: the spec's (0 but for the DEEPSEEK entries)."""
    import transformers

    spec = zoo_spec(name)
    if seed is None:
        seed = getattr(spec, "seed", 0)
    config = spec.config()
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if config.is_encoder_decoder:
            model = getattr(transformers, spec.model_cls)(config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                                  attn_implementation="eager")
    assert type(model).__name__ == spec.model_cls, (type(model).__name__, spec.model_cls)
    scale = getattr(spec, "embed_init_scale", None)
    if scale is None:
        scale = 0.25 if config.tie_word_embeddings else 1.0
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(scale)
    perturb_constants(model, seed + 1)
    perturb_routing(model, getattr(spec, "router_init_scale", 1.0), getattr(spec, "score_bias_scale", None), seed + 2)
    return model.eval()


@one_thread()
def make_checkpoint(name: str, directory: str, seed: int | None = None) -> str:
    """Build ZOO[name] (or DEEPSEEK[name], UNSUPPORTED[name]) tiny, perturb its constants, save it into `directory`
    (made if missing) with save_pretrained as safetensors (sharded where the spec says). Returns `directory`."""
    spec = zoo_spec(name)
    model = build_model(name, seed)
    os.makedirs(directory, exist_ok=True)
    kw = {"max_shard_size": spec.shard} if getattr(spec, "shard", None) else {}
    model.save_pretrained(directory, safe_serialization=True, **kw)
    return directory


# --- features that must matter


@dataclass(frozen=True)
class Mutation:
    """A way to get an architecture's feature wrong: config overrides for from_pretrained and/or an in-place edit of
    the loaded model. test_hf_zoo checks each changes HF's logits on ZOO_PROMPTS, so a path that ignores the feature
    cannot match HF on this material."""
    label: str
    config: dict = field(default_factory=dict)
    edit: object = None  # callable(model) -> None, under no_grad


def _norm_gain_read_as_w(model):  # a (1 + w) RMSNorm read as a plain w gain: 1 + (w - 1) = w
    for mod in model.modules():
        if "rmsnorm" in type(mod).__name__.lower():
            mod.weight.sub_(1.0)


def _no_sinks(model):
    for mod in model.modules():
        if hasattr(mod, "sinks"):
            mod.sinks.fill_(-1e30)


def _no_score_correction(model):
    for mod in model.modules():
        if hasattr(mod, "e_score_correction_bias"):
            mod.e_score_correction_bias.zero_()


def _no_shared_expert_gate(model):  # sigmoid(0): the shared expert always at half weight
    for mod in model.modules():
        if hasattr(mod, "shared_expert_gate"):
            mod.shared_expert_gate.weight.zero_()


def _no_biases(model):
    for name, p in model.named_parameters():
        if name.endswith("proj.bias") or name.endswith("c_fc.bias"):
            p.zero_()


_NO_WINDOW = Mutation("no sliding window", {"sliding_window": 4096})
FEATURE_MUTATIONS: dict[str, list[Mutation]] = {
    "gemma3": [_NO_WINDOW, Mutation("query_pre_attn_scalar = head_dim", {"query_pre_attn_scalar": 16}),
               Mutation("norm gain w, not 1 + w", edit=_norm_gain_read_as_w),
               Mutation("the local layers' rope on every layer", {"rope_parameters": {
                   "sliding_attention": _rope(10000.0), "full_attention": _rope(10000.0)}})],
    "gemma2": [_NO_WINDOW, Mutation("no attention softcap", {"attn_logit_softcapping": None}),
               Mutation("no final softcap", {"final_logit_softcapping": None}),
               Mutation("query_pre_attn_scalar = head_dim", {"query_pre_attn_scalar": 16})],
    "mistral": [_NO_WINDOW],
    "phi3": [Mutation("full rotary, no longrope", {"rope_parameters": _rope(10000.0, partial_rotary_factor=1.0)})],
    "glm4": [Mutation("full rotary", {"partial_rotary_factor": 1.0,
                                      "rope_parameters": _rope(10000.0, partial_rotary_factor=1.0)})],
    "smollm3": [Mutation("rope on every layer", {"no_rope_layers": [1, 1, 1, 1]})],
    "ernie4_5_moe": [Mutation("no e_score_correction_bias", edit=_no_score_correction)],
    "gpt_oss": [_NO_WINDOW, Mutation("no sinks", edit=_no_sinks)],
    "cohere2": [_NO_WINDOW, Mutation("logit_scale 1", {"logit_scale": 1.0})],
    "qwen2_moe": [Mutation("shared expert gate ignored (0.5)", edit=_no_shared_expert_gate)],
    "granitemoe": [Mutation("residual_multiplier 1", {"residual_multiplier": 1.0}),
                   Mutation("attention scaled 1/sqrt(head_dim)", {"attention_multiplier": 0.25})],
    "starcoder2": [_NO_WINDOW, Mutation("no linear biases", edit=_no_biases)],
    "granite": [Mutation("residual_multiplier 1", {"residual_multiplier": 1.0}),
                Mutation("embedding_multiplier 1", {"embedding_multiplier": 1.0}),
                Mutation("attention scaled 1/sqrt(head_dim)", {"attention_multiplier": 0.25}),
                Mutation("logits_scaling 1", {"logits_scaling": 1.0})],
}


def _softmax_scale_without_mscale(model):  # YaRN's mscale_all_dim**2 factor left out of the softmax scale
    for mod in model.modules():
        if hasattr(mod, "qk_head_dim") and hasattr(mod, "scaling"):
            mod.scaling = mod.qk_head_dim ** -0.5


def _latent_norm_gains_one(model):  # q_a_layernorm / kv_a_layernorm gains ignored
    for name, mod in model.named_modules():
        if name.endswith(("q_a_layernorm", "kv_a_layernorm")):
            mod.weight.fill_(1.0)


_DS_DEFAULT_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
_DS_ALL_GROUPS = Mutation("no group limit (topk_group = n_group)", {"topk_group": 4})
_DS_NO_BIAS = Mutation("no e_score_correction_bias", edit=_no_score_correction)
# DeepSeek features that must change HF's greedy tokens on at least one of ZOO_PROMPTS (16 tokens): a path that
# routes without the groups or without the correction bias does not give HF's tokens on this material.
DEEPSEEK_TOKEN_MUTATIONS: dict[str, list[Mutation]] = {
    "deepseek_v3": [_DS_ALL_GROUPS, _DS_NO_BIAS],
    "deepseek_v3_no_qlora": [_DS_ALL_GROUPS, _DS_NO_BIAS],
    "deepseek_v2": [_DS_ALL_GROUPS, Mutation("topk_method greedy", {"topk_method": "greedy"})],
}
# ... and features that must move HF's logits (as FEATURE_MUTATIONS).
_DS_COMMON = [Mutation("routed_scaling_factor 1", {"routed_scaling_factor": 1.0}),
              Mutation("latent norm gains 1", edit=_latent_norm_gains_one)]
DEEPSEEK_MUTATIONS: dict[str, list[Mutation]] = {
    "deepseek_v3": _DS_COMMON + [
        Mutation("default rope, not YaRN", _DS_DEFAULT_ROPE),
        Mutation("softmax scale without YaRN mscale", edit=_softmax_scale_without_mscale),
        Mutation("rotary not interleaved", {"rope_interleave": False}),
        Mutation("norm_topk_prob False", {"norm_topk_prob": False})],
    "deepseek_v3_no_qlora": _DS_COMMON + [
        Mutation("rotary not interleaved", {"rope_interleave": False}),
        Mutation("norm_topk_prob False", {"norm_topk_prob": False})],
    "deepseek_v2": _DS_COMMON + [
        Mutation("default rope, not YaRN", _DS_DEFAULT_ROPE),
        Mutation("softmax scale without YaRN mscale", edit=_softmax_scale_without_mscale)],
}


@torch.no_grad()
@one_thread()
def mutated_logits(path: str, mutation: Mutation, token_ids: list[int]) -> torch.Tensor:
    """HF's fp32 logits [T, vocab] for token_ids from the checkpoint at `path` loaded with `mutation` applied."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                     **mutation.config).eval()
    if mutation.edit is not None:
        mutation.edit(model)
    return model(torch.tensor([token_ids]), use_cache=False).logits[0].float()


@torch.no_grad()
@one_thread()
def mutated_greedy(path: str, mutation: Mutation, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF's greedy continuations (as hf_greedy) from the checkpoint at `path` loaded with `mutation` applied."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                     **mutation.config).eval()
    if mutation.edit is not None:
        mutation.edit(model)
    return greedy_of(model, prompts, max_new_tokens)


# --- the oracle


@functools.lru_cache(maxsize=None)
def load_hf(path: str):
    """HF's own fp32 load of a saved zoo checkpoint, eager attention (the reference for sinks and softcaps),
    eval mode. Cached per path: treat it as read-only."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _generation_config(model, max_new_tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, use_cache=True,
                            num_beams=1, pad_token_id=model.config.pad_token_id or 0)


@torch.no_grad()
@one_thread()
def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF's greedy continuation (fp32, KV cache on, EOS not a stop) of each prompt, one at a time (no padding):
    exactly max_new_tokens ids per prompt.

    EOS is off by clearing it on the model's own generation_config for the call: generate() fills every field left
    None in the config it is given from the model's (so eos_token_id=None there does not switch EOS off), and
    min_new_tokens would mask EOS's logit instead (a different greedy token where EOS is the argmax)."""
    return greedy_of(load_hf(path), prompts, max_new_tokens)


@torch.no_grad()
@one_thread()
def greedy_of(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """hf_greedy's continuation from an already loaded HF model (mutated_greedy's, a test's own)."""
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.eos_token_id = None
    out = []
    try:
        for prompt in prompts:
            ids = torch.tensor([prompt])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                gen = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     generation_config=_generation_config(model, max_new_tokens))
            new = gen[0, len(prompt):].tolist()
            assert len(new) == max_new_tokens, f"HF stopped after {len(new)} of {max_new_tokens} tokens"
            out.append(new)
    finally:
        model.generation_config = saved
    return out


@torch.no_grad()
@one_thread()
def hf_logits(path: str, token_ids: list[int], all_positions: bool = False) -> torch.Tensor:
    """HF's fp32 logits for one sequence (no cache): the last position's [vocab], or every position's [T, vocab]."""
    logits = load_hf(path)(torch.tensor([token_ids]), use_cache=False).logits[0].float()
    return logits if all_positions else logits[-1]


def top2_gap(logits: torch.Tensor) -> tuple[int, int, float]:
    """(top-1 id, top-2 id, relative gap (l1 - l2) / max(|l1|, |l2|, 1e-30)) of one position's logits."""
    vals, idx = torch.topk(logits.float(), 2)
    l1, l2 = vals.tolist()
    return idx[0].item(), idx[1].item(), (l1 - l2) / max(abs(l1), abs(l2), 1e-30)


def is_tie(logits: torch.Tensor, a: int, b: int, rel: float = 1e-5) -> bool:
    """Whether tokens a and b are both acceptable greedy picks at this position: one is the argmax and the other's
    logit is within `rel` (relative to the larger magnitude) of it."""
    top = int(torch.argmax(logits))
    if top not in (a, b):
        return False
    la, lb = logits[a].item(), logits[b].item()
    return abs(la - lb) <= rel * max(abs(la), abs(lb), 1e-30)


def greedy_matches_hf(path: str, prompt: list[int], expected: list[int], got: list[int],
                      rel: float = 1e-5) -> tuple[bool, str]:
    """Tie-aware comparison of a greedy continuation with HF's (`expected`, from hf_greedy): equal, or equal up to a
    first difference where HF's logits (recomputed on the common prefix) tie the two tokens within `rel`; after it
    the sequences may legitimately diverge. Returns (ok, a description for the assertion message)."""
    if len(got) != len(expected):
        return False, f"{len(got)} tokens, HF has {len(expected)}"
    if got == expected:
        return True, "identical"
    pos = next(i for i, (x, y) in enumerate(zip(expected, got)) if x != y)
    logits = hf_logits(path, prompt + expected[:pos])
    t1, t2, gap = top2_gap(logits)
    ok = is_tie(logits, expected[pos], got[pos], rel)
    what = "tie" if ok else "mismatch"
    return ok, (f"{what} at generated position {pos}: HF {expected[pos]} ({logits[expected[pos]].item():.6g}), got "
                f"{got[pos]} ({logits[got[pos]].item():.6g}); HF top-2 {t1}/{t2}, relative gap {gap:.3g}")


# --- DeepSeek helpers


@torch.no_grad()
@one_thread()
def assert_engine_matches_hf(llm, path: str, expected: list[list[int]], runs=("cold", "prefix hits")) -> None:
    """graphinfer's greedy tokens on ZOO_PROMPTS (len(expected[0]) each, EOS ignored) are HF's `expected`, tie-aware,
    on every run (the second finds the prompts' full blocks in the prefix cache)."""
    from graphinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=len(expected[0]), ignore_eos=True)
    for run in runs:
        outs = llm.generate(ZOO_PROMPTS, params, use_tqdm=False)
        checks = [greedy_matches_hf(path, p, e, o.outputs[0].token_ids) for p, e, o in zip(ZOO_PROMPTS, expected, outs)]
        assert all(ok for ok, _ in checks), (run, [why for _, why in checks])


def deepseek_routing_margins(path: str, token_ids: list[int]) -> dict[str, float]:
    """How decisively HF routes `token_ids` (one cache-free forward) through the checkpoint at `path`: the smallest,
    over every token and MoE layer, of the gap between the last group kept and the first dropped ("group"; inf where
    every group is kept) and between the last expert chosen (within the kept groups) and the first not ("expert").
    Gaps are where the choice is made: V3 on sigmoid + e_score_correction_bias (a group's score the sum of its best
    two), V2 on the router logits (softmax keeps their order; a group's score its best). A gap near fp32 noise (1e-6)
    means another correct implementation may route that token otherwise: look here when tokens part from HF's."""
    model = load_hf(path)
    gaps = {"group": float("inf"), "expert": float("inf")}

    def hook(mod, args, _out):
        h = args[0].reshape(-1, mod.hidden_dim).float()
        logits = torch.nn.functional.linear(h, mod.weight.float())
        groups, per = mod.num_group, mod.num_experts // mod.num_group
        if hasattr(mod, "e_score_correction_bias"):  # V3: noaux_tc
            score = logits.sigmoid() + mod.e_score_correction_bias.float()
            group_score = score.view(-1, groups, per).topk(2, dim=-1)[0].sum(-1)
            kept = mod.topk_group
        else:  # V2: greedy or group_limited_greedy
            score = logits
            group_score = score.view(-1, groups, per).max(-1).values
            kept = mod.topk_group if mod.topk_method == "group_limited_greedy" else groups
        if kept < groups:
            ranked = group_score.sort(-1, descending=True).values
            gaps["group"] = min(gaps["group"], (ranked[:, kept - 1] - ranked[:, kept]).min().item())
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(kept, dim=-1)[1], True)
        allowed = score.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
        ranked = allowed.sort(-1, descending=True).values
        gaps["expert"] = min(gaps["expert"], (ranked[:, mod.top_k - 1] - ranked[:, mod.top_k]).min().item())

    hooks = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__.endswith("TopkRouter")]
    try:
        model(torch.tensor([token_ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return gaps


# The tensors of an MTP layer besides a decoder layer's, as DeepSeek-V3 ships them (model.layers.61.* there).
MTP_EXTRA_TENSORS = ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                     "shared_head.head.weight")


@torch.no_grad()
@one_thread()
def make_mtp_checkpoint(src_dir: str, dst_dir: str, seed: int = 1) -> str:
    """Copy the deepseek_v3-type checkpoint at src_dir (make_checkpoint's: one model.safetensors) into dst_dir with one
    MTP layer appended under DeepSeek's names, model.layers.<N>.* for N = num_hidden_layers: a full decoder layer
    (self_attn.*, the MoE mlp.* with per-expert tensors, e_score_correction_bias and shared experts, input_layernorm,
    post_attention_layernorm) drawn as the DEEPSEEK entries are (random, norms and bias perturbed, routers widened),
    enorm / hnorm / shared_head.norm (1 + 0.3 randn), eh_proj [H, 2H] (INIT_RANGE randn), and embed_tokens /
    shared_head.head as copies of model.embed_tokens / lm_head (DeepSeek stores the shared embedding and head again in
    the MTP layer). config.json gets num_nextn_predict_layers 1; every other tensor and file is the source's.
    transformers' DeepseekV3ForCausalLM ignores the layer (it reports its tensors as unexpected). Returns dst_dir."""
    import json
    import shutil
    import tempfile

    import transformers
    from safetensors.torch import load_file, save_file

    with open(os.path.join(src_dir, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "deepseek_v3":
        raise ValueError(f"make_mtp_checkpoint: a deepseek_v3 checkpoint, not {cfg.get('model_type')}")
    if not os.path.exists(os.path.join(src_dir, "model.safetensors")):
        raise ValueError("make_mtp_checkpoint: a single-file checkpoint (model.safetensors)")
    n, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    if n < cfg["first_k_dense_replace"]:
        raise ValueError("make_mtp_checkpoint: the MTP layer is MoE; this checkpoint has no MoE layer to mirror")

    # The decoder part: layer n of a fresh (n + 1)-layer model, drawn as build_model draws, saved by transformers (so
    # the experts come out per expert, as the other layers' do).
    config = transformers.AutoConfig.from_pretrained(src_dir)
    config.num_hidden_layers = n + 1
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_constants(model, seed + 1)
    perturb_routing(model, DS_ROUTER_INIT_SCALE, DS_SCORE_BIAS_SCALE, seed + 2)
    prefix = f"model.layers.{n}."
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        block = {k: v.clone() for k, v in load_file(os.path.join(tmp, "model.safetensors")).items()
                 if k.startswith(prefix)}

    tensors = load_file(os.path.join(src_dir, "model.safetensors"))
    assert not [k for k in tensors if k.startswith(prefix)], "the source already has a layer at the MTP index"
    g = torch.Generator().manual_seed(seed + 3)

    def gain():
        return 1.0 + 0.3 * torch.randn(hidden, generator=g)

    block.update({prefix + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                  prefix + "enorm.weight": gain(),
                  prefix + "hnorm.weight": gain(),
                  prefix + "eh_proj.weight": INIT_RANGE * torch.randn(hidden, 2 * hidden, generator=g),
                  prefix + "shared_head.norm.weight": gain(),
                  prefix + "shared_head.head.weight": tensors["lm_head.weight"].clone()})

    os.makedirs(dst_dir, exist_ok=True)
    for name in os.listdir(src_dir):
        if name not in ("model.safetensors", "config.json") and os.path.isfile(os.path.join(src_dir, name)):
            shutil.copy2(os.path.join(src_dir, name), os.path.join(dst_dir, name))
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file({**tensors, **block}, os.path.join(dst_dir, "model.safetensors"), metadata={"format": "pt"})
    return dst_dir


@functools.lru_cache(maxsize=None)
def load_hf_mtp(path: str):
    """(main model, HF's own MtpModel) for a make_mtp_checkpoint checkpoint, fp32, eval mode, cached per path:
    transformers 5.17's generic MTP module (the one generate(use_mtp=True) drafts with) loaded from the layer at index
    num_hidden_layers. Its loader only looks under the model class's _keys_to_ignore_on_load_unexpected, which for
    DeepseekV3 names layer 61 only (the full model's): this main model gets the tiny checkpoint's index instead."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{main.config.num_hidden_layers}\..*"]
        mtp = MtpModel.from_pretrained(main)  # raises if any MTP tensor is missing
    return main, mtp.eval()


@torch.no_grad()
@one_thread()
def hf_mtp_logits(path: str, token_ids: list[int]) -> torch.Tensor:
    """HF's MTP draft logits [T - 1, vocab] for one sequence of T tokens (cache-free, causal): row i predicts token
    i + 2 from token i + 1's embedding and the main model's final hidden state at position i, as transformers 5.17's
    MtpModel computes it: h = model.norm(last layer's output) (the post-norm state), x = eh_proj(cat(enorm(embed(t[i +
    1])), hnorm(h[i]))), then one decoder layer (MLA + MoE, causal over the shifted sequence, rope at positions i + 1;
    rope is relative, so positions i give the same), shared_head.norm, and the main model's lm_head (the checkpoint's
    shared_head.head is a copy of it; HF does not read it). Row i's argmax is the token MTP drafts after position
    i + 1."""
    from transformers.masking_utils import create_causal_mask

    main, mtp = load_hf_mtp(path)
    ids = torch.tensor([token_ids])
    hidden = main(ids, output_hidden_states=True, use_cache=False).hidden_states[-1]  # post-norm: HF ties it
    shifted = ids[:, 1:]
    positions = torch.arange(1, len(token_ids)).unsqueeze(0)
    embeds = mtp.embed_tokens(shifted)
    mask = create_causal_mask(config=mtp.config, inputs_embeds=embeds, attention_mask=None, past_key_values=None,
                              position_ids=positions)
    out = mtp.layers[0](embeds, hidden[:, :-1], position_embeddings=mtp.rotary_emb(embeds, position_ids=positions),
                        attention_mask=mask, position_ids=positions, past_key_values=None)
    return mtp.shared_head(out)[0].float()


# --- fixtures


def hf_zoo_checkpoint_factory(tmp_path_factory):
    """The body of conftest's session fixture `hf_zoo_checkpoint`: name -> path, each built once per session."""
    cache: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in cache:
            cache[name] = make_checkpoint(name, str(tmp_path_factory.mktemp(f"hf-zoo-{name}")))
        return cache[name]

    return make


def deepseek_mtp_checkpoint_factory(tmp_path_factory, base):
    """The body of conftest's session fixture `deepseek_mtp_checkpoint`: name (a deepseek_v3-type DEEPSEEK entry,
    default "deepseek_v3") -> path of make_mtp_checkpoint over base(name) (the `deepseek_checkpoint` fixture), each
    built once per session."""
    cache: dict[str, str] = {}

    def make(name: str = "deepseek_v3") -> str:
        if name not in cache:
            cache[name] = make_mtp_checkpoint(base(name), str(tmp_path_factory.mktemp(f"deepseek-mtp-{name}")))
        return cache[name]

    return make
