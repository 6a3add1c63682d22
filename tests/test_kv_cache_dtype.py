"""kv_cache_dtype (CacheConfig): an fp32 model over a bf16 / fp16 KV cache on cpu, and the settings refused elsewhere.

The C++ kernels (csrc/cpu/paged_attention.cpp) against the reference op over the same cache upcast to fp32; the cache
write against `.to(bfloat16)`; an engine's cache really in bf16, twice the blocks, and its greedy tokens against the
fp32-cache engine's."""
import sys

import pytest
import torch

import graphinfer.ops as ref_ops
from graphinfer.config import CacheConfig, kv_cache_torch_dtype
from graphinfer.errors import InvalidConfigError
from graphinfer.ops.cpu import ext
from graphinfer.ops.cpu.attention import paged_attention_cpu, reshape_and_cache_cpu
from conftest import need_cpu_kernels
from test_triton_kernels import _paged_batch

# decodes of different lengths (one padded row), a fresh prefill, chunks over a cached prefix
RAGGED_Q = [1, 1, 9, 1, 1, 6, 1, 13, 1, 4]
RAGGED_L = [3, 70, 9, 0, 40, 23, 41, 14, 5, 150]
FP32 = dict(atol=2e-5, rtol=2e-5)


def _mixed_batch(n_q, n_kv, head, block_size, cache_dtype, seed=0):
    """fp32 query over caches of cache_dtype; and the same caches upcast to fp32 (what the reference reads)."""
    q, kc, vc, *rest = _paged_batch(RAGGED_Q, RAGGED_L, n_q, n_kv, head, block_size, torch.float32, seed=seed)
    kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    return (q, kc, vc, *rest), (q, kc.float(), vc.float(), *rest)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
# GQA groups of 3, 4 and 2; heads of 64 and 128 (row scores), 32 and 72 (K transposed; 72: tail lanes)
@pytest.mark.parametrize("n_q,n_kv,head,block_size", [(9, 3, 64, 16), (4, 1, 32, 64), (4, 2, 128, 16),
                                                      (2, 1, 72, 64)])
@pytest.mark.parametrize("window", [0, 20])
def test_kernel_over_narrow_cache(n_q, n_kv, head, block_size, cache_dtype, window):
    """The C++ kernel with an fp32 query over bf16 / fp16 caches equals the reference over those caches upcast, to fp32
    tolerance: decode rows, prefill chunks, padding, with and without a sliding window."""
    need_cpu_kernels(ext.available())
    mixed, upcast = _mixed_batch(n_q, n_kv, head, block_size, cache_dtype)
    scale = head ** -0.5
    out = torch.empty_like(mixed[0])
    assert torch.ops.graphinfer_cpu.paged_attention(out, *mixed, scale, sys.maxsize, window) == 0
    ref = ref_ops.paged_attention.reference(*upcast, scale, window)
    torch.testing.assert_close(out, ref, **FP32)
    # the cpu op (the kernel up to its prefill limit) and the reference op over the narrow cache itself agree too
    torch.testing.assert_close(paged_attention_cpu(*mixed, scale, window), ref, **FP32)
    torch.testing.assert_close(ref_ops.paged_attention.reference(*mixed, scale, window), ref, **FP32)


def test_fallbacks_over_narrow_cache(monkeypatch):
    """Without the C++ library the cpu op's PyTorch paths (grouped decode, flash prefill) read a bf16 cache too."""
    monkeypatch.setattr(ext, "available", lambda: False)
    mixed, upcast = _mixed_batch(9, 3, 64, 16, torch.bfloat16)
    torch.testing.assert_close(paged_attention_cpu(*mixed, 0.125), ref_ops.paged_attention.reference(*upcast, 0.125),
                               **FP32)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_cache_write_narrows_like_to(cache_dtype):
    """reshape_and_cache (C++) writes fp32 rows into a bf16 / fp16 cache exactly as `.to(cache_dtype)` rounds (to
    nearest even: halfway values included), skipping slot -1; key and value are strided views of a fused output."""
    need_cpu_kernels(ext.available())
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(40, 5, 72, generator=g)
    # bf16 ties in [1, 2): the low 16 bits exactly half an ulp, the bf16 mantissa's last bit odd or even
    ties = (torch.randint(0, 128, (20, 5, 72), generator=g, dtype=torch.int32) << 16) | 0x3F800000 | 0x8000
    kv[::2] = ties.view(torch.float32)
    key, value = kv[:, 1:3], kv[:, 3:5]
    slots = torch.randperm(48, generator=g)[:40]
    slots[[3, 17]] = -1
    caches = [torch.zeros(3, 16, 2, 72, dtype=cache_dtype) for _ in range(2)]
    torch.ops.graphinfer_cpu.reshape_and_cache(key, value, *caches, slots)
    for cache, src in zip(caches, (key, value)):
        keep = slots >= 0
        want = torch.zeros_like(cache).view(-1, 2, 72)
        want[slots[keep]] = src[keep].to(cache_dtype)
        assert torch.equal(cache.view(-1, 2, 72).view(torch.int16), want.view(torch.int16))
    got = [torch.zeros_like(c) for c in caches]
    reshape_and_cache_cpu(key, value, *got, slots)  # the cpu op takes the same kernel
    assert all(torch.equal(a, b) for a, b in zip(got, caches))


def test_settings_refused():
    with pytest.raises(InvalidConfigError, match="fp8 KV caches are not supported.*auto, bfloat16, float16, float32"):
        CacheConfig(kv_cache_dtype="fp8_e4m3")
    with pytest.raises(InvalidConfigError, match="unknown value"):
        CacheConfig(kv_cache_dtype="int4")
    assert kv_cache_torch_dtype("auto", torch.float32) == torch.float32
    assert kv_cache_torch_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert kv_cache_torch_dtype("bfloat16", torch.bfloat16, "cuda", mixed=False) == torch.bfloat16  # = the model's
    refused = "kv_cache_dtype='bfloat16' with a float32 model runs on cpu only "
    with pytest.raises(InvalidConfigError, match=refused + ".*not on cuda;"):
        kv_cache_torch_dtype("bfloat16", torch.float32, "cuda", mixed=False)
    with pytest.raises(InvalidConfigError, match="MLA"):
        kv_cache_torch_dtype("bfloat16", torch.float32, mla=True)


def test_platforms_say_whether_they_convert():
    from graphinfer.platforms.cpu import CpuPlatform
    from graphinfer.platforms.interface import Platform

    assert CpuPlatform().supports_kv_cache_dtype("eager") and CpuPlatform().supports_kv_cache_dtype("reference")
    assert not CpuPlatform().supports_kv_cache_dtype("triton")
    assert not Platform.supports_kv_cache_dtype(None, "triton")  # cuda, npu: the interface's default


def test_engine_refuses_what_its_kernels_cannot_take(tiny_checkpoint):
    """At start-up: the Triton kernels (what cuda and npu run; here under the interpreter) and fp8 are refused."""
    from graphinfer import LLM

    path = tiny_checkpoint("llama")[0]
    refused = "kv_cache_dtype='bfloat16' with a float32 model runs on cpu only .*not on cpu with kernels='triton';"
    with pytest.raises(InvalidConfigError, match=refused):
        LLM(path, dtype="float32", kv_cache_dtype="bfloat16", kernels="triton", kv_cache_memory_bytes=8 << 20)
    with pytest.raises(InvalidConfigError, match="fp8 KV caches are not supported"):
        LLM(path, dtype="float32", kv_cache_dtype="fp8")


def test_engine_bf16_cache(smollm2_path):
    """SmolLM2 in fp32 on the cpu platform's C++ kernels, over an fp32 and over a bf16 cache of the same bytes: the
    bf16 cache really is bf16 and holds twice the blocks, and the greedy tokens mostly agree (SmolLM2's rounding noise
    flips near-ties: at this writing one prompt of seven diverges, at a 0.0002 margin, 194 of 224 tokens agree)."""
    from graphinfer import LLM, SamplingParams
    from graphinfer.platforms import get_platform
    from test_smollm2 import PROMPTS

    need_cpu_kernels(ext.available())
    budget, params = 64 << 20, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    runs = {}
    try:
        for kv_dtype in ("auto", "bfloat16"):
            llm = LLM(smollm2_path, dtype="float32", max_model_len=1024, kv_cache_dtype=kv_dtype,
                      kv_cache_memory_bytes=budget, device="cpu", kernels="eager")
            runner = llm.llm_engine.worker.model_runner
            caches = {runner.kv_cache.dtype, runner.attn_layers[0].k_cache.dtype, runner.attn_layers[-1].v_cache.dtype}
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            runs[kv_dtype] = caches, runner.num_blocks, runner.kv_cache[:, :, 0].nbytes, outs
            llm.shutdown()
    finally:
        get_platform("cpu").activate("reference")  # the suite's ops again (activation is process-wide)
    (caches32, blocks32, bytes32, outs32), (caches16, blocks16, bytes16, outs16) = runs["auto"], runs["bfloat16"]
    assert caches32 == {torch.float32} and caches16 == {torch.bfloat16}
    assert bytes16 * 2 == bytes32 and blocks32 == budget // bytes32 and blocks16 == budget // bytes16
    assert blocks16 >= 2 * blocks32
    same = sum(x == y for a, b in zip(outs16, outs32) for x, y in zip(a.outputs[0].token_ids, b.outputs[0].token_ids))
    total = sum(len(o.outputs[0].token_ids) for o in outs32)
    print(f"bf16 KV cache: {same}/{total} greedy tokens as with the fp32 cache")
    assert total == 32 * len(PROMPTS) and same >= 0.8 * total


def test_artifact_served_with_bf16_cache(tiny_checkpoint, tmp_path):
    """kv_cache_dtype is a runtime setting: an fp32 artifact (Qwen3: the fused qk_norm_rope_cache op writes the cache)
    served over a bf16 cache, on the suite's reference ops, agrees with the in-memory fp32 engine."""
    from graphinfer import LLM, SamplingParams
    from graphinfer.compiler.trace import op_histogram

    llm = LLM(tiny_checkpoint("qwen3")[0], dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert op_histogram(llm.llm_engine.worker.graph).get("graphinfer::qk_norm_rope_cache")
    llm.llm_engine.save_artifact(str(tmp_path / "art"))
    served = LLM(artifact=str(tmp_path / "art"), kv_cache_dtype="bfloat16", kv_cache_memory_bytes=8 << 20)
    runner = served.llm_engine.worker.model_runner
    assert runner.kv_cache.dtype == torch.bfloat16 and served.llm_engine.worker.model.model.norm.weight.dtype == \
        torch.float32
    assert runner.num_blocks == 2 * llm.llm_engine.worker.num_blocks
    prompts = [[5, 6, 7, 8, 9], list(range(40, 80)), [3]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want, got = ([o.outputs[0].token_ids for o in e.generate(prompts, params, use_tqdm=False)] for e in (llm, served))
    same = sum(x == y for a, b in zip(got, want) for x, y in zip(a, b))
    assert same >= 0.8 * 16 * len(prompts), (got, want)
