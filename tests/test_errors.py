"""Bad input raises a typed error whose message says what to do; nothing is left queued."""
import json
import os

import pytest

from graphinfer import LLM, SamplingParams
from graphinfer.cli import main
from graphinfer.errors import (InvalidConfigError, InvalidRequestError, InvalidSamplingParamsError,
                               ModelNotFoundError, PromptTooLongError, UnsupportedArchitectureError)


@pytest.fixture(scope="module")
def tiny_llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama")[0], max_model_len=64)


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist. Pass an HF checkpoint directory"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        LLM(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        LLM(str(tmp_path / "weights.bin"))
    assert issubclass(ModelNotFoundError, FileNotFoundError)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}))
    with pytest.raises(UnsupportedArchitectureError, match="Mamba / state-space layers"):  # the reason, at start-up
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"], "model_type": "nosuch"}))
    with pytest.raises(UnsupportedArchitectureError, match="'nosuch'.*transformers .* does not know"):
        LLM(str(tmp_path))


def test_checkpoint_without_weights(tmp_path, tiny_checkpoint):
    src = tiny_checkpoint("llama")[0]
    (tmp_path / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(n=0), "n=0"),
    (dict(n=3, best_of=2), "best_of=2"),
    (dict(temperature=float("nan")), "finite"),
    (dict(repetition_penalty=float("inf")), "finite"),
    (dict(seed=2**64), "seed"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(InvalidSamplingParamsError, match=match):
        SamplingParams(**kwargs)


def test_prompt_longer_than_max_model_len(tiny_llm):
    with pytest.raises(PromptTooLongError, match="max_model_len is 64.*Shorten the prompt or raise max_model_len"):
        tiny_llm.generate([[1, 2, 3], list(range(64))], use_tqdm=False)
    engine = tiny_llm.llm_engine
    assert not engine.local_core.scheduler.waiting and not engine.output_processor.requests  # the valid prompt was not queued either
    with pytest.raises(PromptTooLongError, match="empty"):
        tiny_llm.generate([[]], use_tqdm=False)


def test_bad_prompts_and_engine_args(tiny_llm, tiny_checkpoint):
    with pytest.raises(InvalidRequestError, match="ships no tokenizer: pass prompts as token ids"):
        tiny_llm.generate("hello", use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tiny_llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="token ids must be integers in"):
        tiny_llm.generate([[1, 10_000]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="stop_token_ids must be token ids in"):  # would crash the sampler
        tiny_llm.generate([[1, 2]], SamplingParams(stop_token_ids=[10**6], min_tokens=1), use_tqdm=False)
    with pytest.raises(InvalidConfigError, match="one per prompt"):
        tiny_llm.generate([[1], [2]], [SamplingParams()], use_tqdm=False)
    path = tiny_checkpoint("llama")[0]
    for kwargs, match in [(dict(dtype="int3"), "dtype"), (dict(block_size=12), "power of two"),
                          (dict(max_model_len=100_000), "exceeds the model's context length"),
                          (dict(max_num_seqs=0), "max_num_seqs"),
                          (dict(enable_chunked_prefill=False, max_num_batched_tokens=16), "chunked prefill")]:
        with pytest.raises(InvalidConfigError, match=match):
            LLM(path, **kwargs)


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphinfer: error:") and "does not exist" in err and "Traceback" not in err
    assert main(["generate", "--prompt", "hi", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
