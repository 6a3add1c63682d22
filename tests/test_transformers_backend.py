"""model_impl="transformers": transformers' own modeling code captured by TorchDynamo, run on graphinfer's paged
attention and runtime; judged against HF's own greedy tokens on the same weights (fp32)."""
import pytest
import torch

from graphinfer import LLM, SamplingParams
from graphinfer.errors import UnsupportedArchitectureError

PROMPTS = [[(7 * i + 3 * n) % 250 + 1 for i in range(n)] for n in (5, 23, 41, 67)]
NEW = 8


def _hf_greedy(hf, prompts, n=NEW):
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def _greedy(llm, prompts, n=NEW):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "qwen3_moe"])
def test_transformers_path_gives_hf_greedy_tokens(tiny_checkpoint, arch):
    path, hf = tiny_checkpoint(arch)
    llm = LLM(path, dtype="float32", model_impl="transformers", max_model_len=256)
    assert type(llm.llm_engine.worker.model).__name__ == "TransformersForCausalLM"
    assert _greedy(llm, PROMPTS) == _hf_greedy(hf, PROMPTS)


def test_chunked_prefill_prefix_hits_and_async_scheduling(tiny_checkpoint):
    path, hf = tiny_checkpoint("qwen3")
    expected = _hf_greedy(hf, PROMPTS)
    llm = LLM(path, dtype="float32", model_impl="transformers", max_model_len=256, max_num_batched_tokens=16,
              block_size=4, async_scheduling=True)
    assert _greedy(llm, PROMPTS) == expected  # prompts chunked into 16-token steps, sharing steps with decodes
    again = _greedy(llm, PROMPTS[2:])  # the same prompts again: their full blocks come from the prefix cache
    assert again == expected[2:]


def test_auto_keeps_the_native_model(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen2")
    assert type(LLM(path, dtype="float32").llm_engine.worker.model).__name__ == "Qwen2ForCausalLM"


def test_graphinfer_impl_refuses_an_architecture_it_lacks(tmp_path):
    from transformers import AutoModelForCausalLM, MistralConfig

    hf = AutoModelForCausalLM.from_config(MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=1, num_attention_heads=2,
                                                        num_key_value_heads=1, max_position_embeddings=128))
    hf.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="has no graphinfer model.*model_impl='auto' or 'transformers'"):
        LLM(str(tmp_path), model_impl="graphinfer")
