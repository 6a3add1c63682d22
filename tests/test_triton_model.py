"""The Triton kernels inside whole models, on CPU under Triton's interpreter (kernels="triton").

The kernel tests compare each kernel with its reference op; this checks what they are given by the real
graph (strided q/k/v slices of the fused projection, chunked prefill over cached blocks, mixed batches):
greedy tokens with the Triton kernels equal those with the reference ops, also when decode steps replay
padded buckets. A subprocess, because triton reads TRITON_INTERPRET when kernels are defined and op
registration is process-wide.
"""
import os
import subprocess
import sys

import pytest
from cpu_env import cpu_subprocess_env

SCRIPT = """
import sys
sys.path.insert(0, {tests_dir!r})
import graphinfer.runtime.entrypoints.llm_engine as llm_engine
from graphinfer import LLM, SamplingParams
from capture_standin import OpTapePlatform

prompts = [[1, 5, 9, 3], [7] * 11, list(range(2, 28)), [4, 4, 8]]  # 26 tokens: two chunks over cached blocks
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 5, 5, 6)]
# Small token budget and blocks: prompts are chunked and decodes share steps with prefill chunks. max_model_len
# sizes the captured block tables (the decode kernel's splits): 128 gives two splits, the second one empty.
kw = dict(max_num_seqs=8, num_gpu_blocks_override=64, block_size=4, dtype="float32", max_num_batched_tokens=16,
          max_model_len=128, device="cpu")
refs = {{m: [o.outputs[0].token_ids for o in LLM(m, **kw).generate(prompts, params, use_tqdm=False)]
        for m in {models!r}}}
refs_llm = LLM("tiny-qwen3", **kw)
# The Triton kernels with decode steps replayed through captured buckets (test_capture's CPU stand-in for device
# graphs): prefill and mixed steps run the graph eagerly, as do decode batches above the largest capture size.
llm_engine.platform_for_device = lambda device_type: OpTapePlatform()
for model in {models!r}:
    llm = LLM(model, kernels="triton", graph_mode="FULL_DECODE_ONLY", capture_sizes=[1, 3], **kw)
    runner, kinds = llm.llm_engine.worker.model_runner, set()
    full_graphs = runner._full_graphs

    def spy(h):
        graphs = full_graphs(h)
        replayed = graphs is not None
        q_lens = h.query_start_loc[1:] - h.query_start_loc[:-1]
        if (q_lens == 1).all() and not replayed:
            kinds.add("decode-eager")
        elif replayed:
            kinds.add("decode-replayed" if len(q_lens) in (1, 3) else "decode-padded")
        elif (q_lens == 1).any():
            kinds.add("mixed")
        if ((q_lens > 1) & (h.seq_lens > q_lens)).any():
            kinds.add("chunked")
        return graphs

    runner._full_graphs = spy
    tri = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    print(model, refs[model] == tri, *sorted(kinds), refs[model], tri)
# Speculative decoding on the same kernels (attention with 1 + k query rows, eager and in the verify graphs, and
# rejection_sample): repetitive prompts, so that lookup finds drafts; greedy tokens as the reference ops' without it.
spec_prompts = [[5, 6, 7] * 6, [9, 10] * 8, [11, 12, 13, 14] * 4]
spec_params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
spec_ref = [o.outputs[0].token_ids for o in refs_llm.generate(spec_prompts, spec_params, use_tqdm=False)]
spec = {{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}}
llm = LLM("tiny-qwen3", kernels="triton", graph_mode="FULL_DECODE_ONLY", capture_sizes=[1, 3], speculative_config=spec,
          **kw)
verify, replays = llm.llm_engine.worker.model_runner.dispatcher.verify_graphs, []
replay = verify.replay
verify.replay = lambda *a, **k: replays.append(1) or replay(*a, **k)
tri = [o.outputs[0].token_ids for o in llm.generate(spec_prompts, spec_params, use_tqdm=False)]
print("spec", spec_ref == tri, bool(replays), llm.llm_engine.spec_decode_stats()["num_accepted_tokens"] > 0)
"""


@pytest.mark.slow  # 115 s of whole models under the interpreter; each kernel has its own tests in the suite
def test_triton_kernels_give_reference_tokens_in_models():
    """One Triton engine per model (FULL_DECODE_ONLY on the stand-in) runs every kind of step: chunked prefill
    over cached blocks and mixed steps (eager), a decode batch above the largest capture size (eager), decode
    batches replayed at their own size and padded to a larger bucket. The script says which kinds it saw. Then
    ngram speculative decoding on the same kernels, verify graphs replayed, gives the reference's greedy tokens."""
    models = ["tiny-qwen3", "tiny-qwen3-moe"]
    env = cpu_subprocess_env()  # on CPU also on a GPU machine (the GPU runs them compiled: tools/gpu_check.py)
    script = SCRIPT.format(models=models, tests_dir=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    kinds = ["chunked", "decode-eager", "decode-padded", "decode-replayed", "mixed"]
    lines = out.stdout.strip().splitlines()
    assert [line.split()[:7] for line in lines[:-1]] == [[m, "True", *kinds] for m in models], out.stdout
    assert lines[-1].split() == ["spec", "True", "True", "True"], out.stdout  # same tokens, verify graphs, accepted


def test_triton_kernels_on_cpu_need_the_interpreter(monkeypatch):
    from graphinfer.errors import InvalidConfigError
    from graphinfer.platforms.cpu import CpuPlatform

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InvalidConfigError, match="set TRITON_INTERPRET=1"):
        CpuPlatform().op_impls("triton")
    with pytest.raises(InvalidConfigError, match="use one of inductor, eager, reference, triton"):
        CpuPlatform().op_impls("torch_npu")


SKINNY_SCRIPT = """
import os
from graphinfer import LLM, SamplingParams
from graphinfer.compiler.skinny_gemm import SkinnyLinear

prompts = [[1, 5, 9, 3], [7] * 6, [4, 4, 8]]
params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True) for _ in prompts]
kw = dict(max_num_seqs=4, num_gpu_blocks_override=64, block_size=4, dtype="float32", max_num_batched_tokens=16,
          device="cpu")
os.environ["GRAPHINFER_SKINNY_GEMM"] = "0"
ref_llm = LLM("tiny-qwen3", **kw)
assert ref_llm.llm_engine.worker.compiled.skinny_gemm is None
ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, params, use_tqdm=False)]
os.environ["GRAPHINFER_SKINNY_GEMM"] = "force"
llm = LLM("tiny-qwen3", **kw)  # the cpu ops, the linears on the interpreted kernel
engine = llm.llm_engine
skinny = sum(isinstance(m, SkinnyLinear) for m in engine.worker.model_runner.graph.modules())
tri = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
print("NONE", ref == tri, skinny, engine.worker.compiled.skinny_gemm.mode, ref, tri)
"""


def test_skinny_gemm_linears_give_reference_tokens():
    """GRAPHINFER_SKINNY_GEMM=force: every linear of the graph on the skinny GEMM kernel for steps of <= 4 rows
    (decodes, short prompts), the same greedy tokens as the reference ops. (Not in test_capture's device-graph
    stand-in: it records torch ops, and this kernel is launched by the module, as a CUDA graph records it.)"""
    env = cpu_subprocess_env()  # on CPU also on a GPU machine (the GPU runs them compiled: tools/gpu_check.py)
    out = subprocess.run([sys.executable, "-c", SKINNY_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1].split()
    assert line[:2] == ["NONE", "True"] and int(line[2]) > 0 and line[3] == "force", out.stdout


QUANT_SCRIPT = """
from graphinfer import LLM, SamplingParams

prompts = [[1, 5, 9, 3], [7] * 11, list(range(2, 28)), [4, 4, 8]]
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 5, 5, 6)]
kw = dict(max_num_seqs=8, num_gpu_blocks_override=64, block_size=4, dtype="float32", max_num_batched_tokens=16,
          max_model_len=128, graph_mode="NONE", device="cpu")
for scheme in ("w8a8", "int8_wo", "int4_wo"):
    ref = [o.outputs[0].token_ids for o in LLM("tiny-qwen3", quantization=scheme, **kw).generate(prompts, params,
                                                                                                 use_tqdm=False)]
    llm = LLM("tiny-qwen3", quantization=scheme, kernels="triton", **kw)
    tri = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    print(scheme, ref == tri, ref, tri)
"""


@pytest.mark.slow
def test_quantized_models_on_the_triton_quant_kernels():
    """Each online scheme's model (w8a8: dynamic_quant / scaled_mm and the fused norm / activation + quant ops after
    the quant passes; int8_wo / int4_wo: wo_linear) gives the reference kernels' greedy tokens (~2 min)."""
    env = cpu_subprocess_env()  # on CPU also on a GPU machine (the GPU runs them compiled: tools/gpu_check.py)
    out = subprocess.run([sys.executable, "-c", QUANT_SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line.split()[:2] for line in out.stdout.strip().splitlines()] == [
        [s, "True"] for s in ("w8a8", "int8_wo", "int4_wo")], out.stdout

