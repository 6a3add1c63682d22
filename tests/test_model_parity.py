"""Tiny random-weight Llama / Qwen2 / Qwen3 checkpoints: graphinfer's logits vs HF transformers (fp32).

The logits are recorded at the sampler inside a real engine run, with a small token budget so prefills
are chunked and share steps with decodes, on a paged cache with small blocks.
"""
import pytest
import torch
from conftest import assert_cpu_default_bound

from graphinfer import LLM, SamplingParams


class _RecordingSampler:
    def __init__(self, sampler):
        self.sampler, self.records = sampler, []

    def __call__(self, logits, rows):
        for seq, row in zip(rows, logits):
            self.records.append((list(seq.token_ids), row.clone()))
        return self.sampler(logits, rows)


@pytest.mark.parametrize("arch,engine_kernels", [  # the cpu default kernels on two (rope scaling / qk-norm, head_dim 32)
    ("llama", "suite"), ("llama3", "suite"), ("qwen2", "suite"), ("qwen3", "suite"), ("llama3", "cpu-default"),
    ("qwen3", "cpu-default")], indirect=["engine_kernels"])
def test_logits_match_hf_through_prefill_and_decode(arch, tiny_checkpoint, engine_kernels):
    path, hf = tiny_checkpoint(arch)
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=16, max_model_len=256, **engine_kernels)
    assert_cpu_default_bound(llm, engine_kernels)
    runner = llm.llm_engine.worker.model_runner
    runner.sampler = rec = _RecordingSampler(runner.sampler)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 23, 11, 40)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)

    assert len(rec.records) == 4 * 6  # prefill + 5 decode steps per request
    worst = 0.0
    with torch.no_grad():
        for token_ids, logits in rec.records:
            ref = hf(torch.tensor([token_ids])).logits[0, -1]
            worst = max(worst, (logits - ref).abs().max().item())
        for prompt, out in zip(prompts, outs):
            ref_ids = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
            assert out.outputs[0].token_ids == ref_ids[0, len(prompt):].tolist()
    assert worst <= 1e-4, f"max |logit - HF| = {worst}"
    assert llm.llm_engine.local_core.scheduler.block_manager.num_free_blocks == runner.num_blocks


@pytest.mark.parametrize("arch,dtype", [("qwen3", torch.bfloat16), ("qwen3", torch.float16),
                                        ("qwen3_moe", torch.bfloat16)])
def test_half_precision_prefill_logits_close_to_hf(arch, dtype, tiny_checkpoint, engine_kernels):
    path, hf32 = tiny_checkpoint(arch)
    hf = type(hf32)(hf32.config).to(dtype).eval()
    hf.load_state_dict(hf32.state_dict())
    llm = LLM(path, dtype=str(dtype).split(".")[1], **engine_kernels)
    assert_cpu_default_bound(llm, engine_kernels)
    assert llm.llm_engine.worker.model.lm_head.weight.dtype == dtype
    assert all(p.dtype == dtype for p in llm.llm_engine.worker.model.parameters())  # stacked experts included
    runner = llm.llm_engine.worker.model_runner
    runner.sampler = rec = _RecordingSampler(runner.sampler)
    prompt = list(range(3, 40))
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].float()
    assert (rec.records[0][1].float() - ref).abs().max().item() < 0.05  # a few ulps of the logits' scale in 16-bit


def test_sharded_safetensors_checkpoint(tiny_checkpoint, tmp_path):
    _, hf = tiny_checkpoint("qwen2")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (17,), generator=g).tolist()
    out = LLM(str(tmp_path)).generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out[0].outputs[0].token_ids == ref[0, 17:].tolist()
