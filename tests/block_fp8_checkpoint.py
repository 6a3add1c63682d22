"""Block-FP8 test checkpoints from a float HF checkpoint, quantized as DeepSeek-V3's are: every Linear's weight
[N, K] (attention's q_a / q_b / kv_a_proj_with_mqa / kv_b / o_proj, the MLPs, each routed and shared expert) cut
into bn x bk blocks (the edge blocks ragged where bn / bk does not divide N / K), weight_scale_inv =
amax(|block|) / 448 in fp32 and weight = (w / weight_scale_inv) cast to float8_e4m3fn (DeepSeek's
inference/kernel.py weight_quant); norms, embeddings, the router (`mlp.gate`) and lm_head stay unquantized.
config.json gets DeepSeek's quantization_config with the block size.

Beside it, the dequantized twin: the same checkpoint with each quantized weight replaced by weight * its block's
weight_scale_inv (computed here independently of graphinfer, by repeat_interleave), no quantization_config.
`dtype`: what the twin's weights and both checkpoints' unquantized tensors are stored in (fp32 for exact
comparisons, bf16 as DeepSeek ships them; V3's e_score_correction_bias stays fp32)."""
import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8_MAX = 448.0


def is_quantized(name: str, t: torch.Tensor) -> bool:
    """A 2-D weight (norms are 1-D) but the embedding, the LM heads, the router and MTP's eh_proj: DeepSeek's
    inference/bf16_cast_fp8.py's SKIP_QUANT_PATTERNS."""
    return t.dim() == 2 and name.endswith(".weight") and \
        not name.endswith(("embed_tokens.weight", "lm_head.weight", ".head.weight", "gate.weight", "eh_proj.weight"))


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn codes [N, K], fp32 weight_scale_inv [ceil(N / bn), ceil(K / bk)])."""
    bn, bk = block
    N, K = w.shape
    nb, kb = -(-N // bn), -(-K // bk)
    padded = torch.zeros(nb * bn, kb * bk)
    padded[:N, :K] = w.float()
    scale_inv = (padded.view(nb, bn, kb, bk).abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (w.float() / expand(scale_inv, block, N, K)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv


def expand(scale_inv: torch.Tensor, block: tuple[int, int], N: int, K: int) -> torch.Tensor:
    return scale_inv.repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    return q.float() * expand(scale_inv, block, *q.shape)


def make_block_fp8_checkpoint(src: str, dst: str, twin: str, block: tuple[int, int] = (16, 16),
                              dtype: torch.dtype = torch.float32) -> tuple[str, str]:
    """Write the block-FP8 checkpoint to `dst` and its dequantized twin to `twin`; returns (dst, twin). The FP8
    checkpoint is two files and their index, the scales in the second (a weight and its scale in different shards)."""
    tensors = {}
    for file in sorted(f for f in os.listdir(src) if f.endswith(".safetensors")):
        with safe_open(os.path.join(src, file), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    weights, scales, twins = {}, {}, {}
    for name, t in tensors.items():
        if is_quantized(name, t):
            q, s = quantize(t, block)
            weights[name], scales[f"{name}_scale_inv"] = q, s
            twins[name] = dequantize(q, s, block).to(dtype)
        else:
            keep = t if name.endswith("e_score_correction_bias") else t.to(dtype)
            weights[name] = twins[name] = keep
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    for path, config_of in ((dst, {**config, "quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}}),
            (twin, config)):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config_of, f, indent=2)
        for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            if os.path.exists(os.path.join(src, extra)):
                shutil.copy(os.path.join(src, extra), path)
    files = {"model-00001-of-00002.safetensors": weights, "model-00002-of-00002.safetensors": scales}
    for file, part in files.items():
        save_file(part, os.path.join(dst, file))
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: file for file, part in files.items() for n in part}}, f)
    save_file(twins, os.path.join(twin, "model.safetensors"))
    return dst, twin
