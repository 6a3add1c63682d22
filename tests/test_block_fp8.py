"""Block-FP8 checkpoints (DeepSeek-V3's; graphinfer/quantization/fp8.py), built here from the tiny DeepSeek-V3 by
tests/block_fp8_checkpoint.py with a dequantized twin: the FP8 checkpoint loads (dequantized at load, from the
safetensors slices) into exactly the twin's weights, whole and per tensor-parallel rank, with ragged edge blocks, and
generates the twin's greedy tokens and logprobs; other FP8 layouts and broken checkpoints are refused naming the
field or tensor."""
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from block_fp8_checkpoint import dequantize, make_block_fp8_checkpoint, quantize
from graphinfer import LLM, SamplingParams
from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import InvalidConfigError, UnsupportedQuantizationError
from graphinfer.model_loader import load_model
from graphinfer.quantization.fp8 import BlockFP8Tensor, block_fp8_weights, weight_block_size
from hf_zoo import ZOO_PROMPTS

KW = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=32, block_size=8)
CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
SCALES = "model-00002-of-00002.safetensors"


@pytest.fixture(scope="module")
def fp8_checkpoint(deepseek_checkpoint, tmp_path_factory):
    """fp8_checkpoint(block, dtype) -> (block-FP8 dir, dequantized twin dir) of the tiny DeepSeek-V3."""
    cache = {}

    def make(block=(16, 16), dtype=torch.float32):
        if (block, dtype) not in cache:
            d = tmp_path_factory.mktemp(f"fp8-{block[0]}x{block[1]}-{str(dtype)[6:]}")
            cache[block, dtype] = make_block_fp8_checkpoint(deepseek_checkpoint("deepseek_v3"), str(d / "fp8"),
                                                            str(d / "twin"), block, dtype)
        return cache[block, dtype]

    return make


def _params(path, rank=0, tp=1, dtype=torch.float32):
    with ps.layout(rank, tp):
        model, _ = load_model(path, dtype)
    return dict(model.named_parameters())


@pytest.mark.parametrize("block,dtype,tp", [((16, 16), torch.float32, 1), ((16, 16), torch.float32, 2),
                                            ((16, 24), torch.float32, 1), ((16, 16), torch.bfloat16, 1)],
                         ids=["16x16-tp1", "16x16-tp2", "16x24-ragged-tp1", "16x16-bf16"])
def test_loads_exactly_the_dequantized_twin(deepseek_checkpoint, fp8_checkpoint, block, dtype, tp):
    """Every parameter of every rank equals the twin's, bit for bit: the dense and MoE layers, each expert's slices.
    kv_a_proj_with_mqa is [40, 64]: ragged rows at 16 (3 blocks); 16 x 24 makes every K ragged too."""
    fp8, twin = fp8_checkpoint(block, dtype)
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert load_file(os.path.join(fp8, SCALES))[f"{kv_a}_scale_inv"].shape == (3, -(-64 // block[1]))
    source = load_file(os.path.join(deepseek_checkpoint("deepseek_v3"), "model.safetensors"))[kv_a]
    assert not torch.equal(load_file(os.path.join(twin, "model.safetensors"))[kv_a].float(), source)  # rounded
    for rank in range(tp):
        mine, theirs = _params(fp8, rank, tp, dtype), _params(twin, rank, tp, dtype)
        assert mine.keys() == theirs.keys()
        assert mine["model.layers.1.mlp.experts.w13_weight"].dtype == dtype
        assert [n for n in mine if not torch.equal(mine[n], theirs[n])] == []


@pytest.mark.parametrize("tp", [1, 2])
def test_other_native_families_load_it_too(tiny_checkpoint, tmp_path, tp):
    """Nothing is DeepSeek's: a tiny Qwen3 (Qwen3's FP8 releases use this layout) loads as its twin, per rank."""
    fp8, twin = make_block_fp8_checkpoint(tiny_checkpoint("qwen3")[0], str(tmp_path / "fp8"), str(tmp_path / "twin"))
    for rank in range(tp):
        mine, theirs = _params(fp8, rank, tp), _params(twin, rank, tp)
        assert [n for n in theirs if not torch.equal(mine[n], theirs[n])] == []


def _run(path, **kw):
    with LLM(path, **KW, **kw) as llm:
        outs = llm.generate(ZOO_PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3),
                            use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("tp", [1, 2])
def test_generates_the_twins_greedy_tokens_and_logprobs(fp8_checkpoint, tp):
    """The engine (absorb_mla, fused MoE; tp 2: gloo ranks) on the FP8 checkpoint gives the twin's tokens and top-3
    logprobs exactly in fp32: dequantization is deterministic (bf16 loads the twin's weights too: above)."""
    fp8, twin = fp8_checkpoint()
    assert _run(fp8, tensor_parallel_size=tp) == _run(twin, tensor_parallel_size=tp)


def test_slices_start_and_end_on_blocks_or_the_edge():
    """A [37, 50] weight in 16 x 16 blocks (ragged last row and column of blocks): every block-aligned slice, the
    ragged tail included, reads as the same slice of the whole (bf16 scales too); a slice that cuts a block is
    refused, named."""
    torch.manual_seed(0)
    block = (16, 16)
    q, s = quantize(torch.randn(37, 50), block)
    t = BlockFP8Tensor("x.weight", q, s, block)
    whole = t.read()
    assert torch.equal(whole, dequantize(q, s, block))
    for dim, n in ((0, 37), (1, 50)):
        for start in range(0, n, 16):
            for end in sorted({*range(start + 16, n, 16), n}):
                assert torch.equal(t.read(dim, start, end - start), whole.narrow(dim, start, end - start))
    bf16_scales = BlockFP8Tensor("x.weight", q, s.bfloat16(), block)  # as some releases store them: read in fp32
    assert torch.equal(bf16_scales.read(0, 16, 21), dequantize(q, s.bfloat16().float(), block)[16:])
    with pytest.raises(InvalidConfigError, match=r"x\.weight: .* 0:24 of dim 1 .* cuts a block of weight_block_size "
                                                 r"\[16, 16\].* multiples of 16"):
        t.read(1, 0, 24)


def test_a_tp_split_that_cuts_blocks_is_refused(fp8_checkpoint):
    """16 x 24 blocks at tp 2: the dense MLP's down_proj, 128 input columns, split into 64, not a multiple of 24."""
    fp8, _ = fp8_checkpoint((16, 24))
    with pytest.raises(InvalidConfigError, match=r"layers\.0\.mlp\.down_proj\.weight: .* 0:64 of dim 1 \(of 128\), "
                                                 r"cuts a block of weight_block_size \[16, 24\]"):
        _params(fp8, 0, 2)


def _broken(fp8, tmp_path, edit):
    """A copy of the FP8 checkpoint with `edit` applied to its scales file's tensors."""
    path = str(tmp_path / "broken")
    shutil.copytree(fp8, path)
    scales = load_file(os.path.join(path, SCALES))
    edit(scales)
    save_file(scales, os.path.join(path, SCALES))
    return path


KEY = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.mark.parametrize("edit,match", [
    (lambda s: s.pop(f"{KEY}_scale_inv"), rf"{KEY} is float8 but the checkpoint lacks {KEY}_scale_inv"),
    (lambda s: s.update({f"{KEY}_scale_inv": s[f"{KEY}_scale_inv"][:1]}),
     rf"{KEY}_scale_inv has shape \(1, 4\), expected \[2, 4\]"),
    (lambda s: s.update({"model.layers.0.self_attn.o_proj.weight_scale": torch.ones(1)}),
     r"o_proj\.weight_scale is another FP8 layout"),
    (lambda s: s.update({"model.layers.0.self_attn.extra.weight_scale_inv": torch.ones(1, 1)}),
     r"extra\.weight_scale_inv has no model\.layers\.0\.self_attn\.extra\.weight"),
], ids=["missing-scale", "scale-shape", "per-tensor-scale", "scale-without-weight"])
def test_broken_checkpoints_are_refused_naming_the_tensor(fp8_checkpoint, tmp_path, edit, match):
    fp8, _ = fp8_checkpoint()
    with pytest.raises(UnsupportedQuantizationError, match=match):
        load_model(_broken(fp8, tmp_path, edit), torch.float32)


def test_a_float_weight_beside_a_scale_is_refused():
    w = torch.randn(32, 32)
    _, s = quantize(w, (16, 16))
    with pytest.raises(UnsupportedQuantizationError, match=r"p\.weight is torch\.float32, expected float8_e4m3fn"):
        block_fp8_weights([("p.weight", w), ("p.weight_scale_inv", s)], CONFIG)


@pytest.mark.parametrize("change,match", [
    ({"weight_block_size": None}, r"weight_block_size=None .*\(per-tensor FP8"),
    ({"activation_scheme": "static"}, "activation_scheme='static'"),
    ({"fmt": "e5m2"}, "fmt='e5m2'"),
    ({"weight_block_size": [128]}, r"weight_block_size=\[128\] .*\(two positive integers"),
])
def test_other_fp8_layouts_are_refused(change, match):
    with pytest.raises(UnsupportedQuantizationError, match=match):
        weight_block_size({**CONFIG, **change})


def test_quantization_on_top_is_refused(fp8_checkpoint):
    fp8, _ = fp8_checkpoint()
    with pytest.raises(InvalidConfigError, match="block-FP8 checkpoint .* Leave quantization unset"):
        load_model(fp8, torch.float32, quantization="w8a8")
