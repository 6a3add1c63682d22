"""The `graphinfer generate` console script, run as a user would (a real subprocess, bundled SmolLM2)."""
import os
import subprocess
import sys

BIN = os.path.join(os.path.dirname(sys.executable), "graphinfer")


def test_generate_prints_greedy_text(smollm2_llm):
    res = subprocess.run([BIN, "generate", "--prompt", "The capital of France is", "--prompt", "Hi",
                          "--temperature", "0", "--max-tokens", "12", "--dtype", "float32", "--logprobs", "1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    greedy = smollm2_llm.generate(["The capital of France is", "Hi"], _greedy(12), use_tqdm=False)
    for out in greedy:
        assert out.outputs[0].text in res.stdout
    assert "--- prompt: 'The capital of France is'" in res.stdout and "finish_reason=" in res.stdout
    assert "Paris" in res.stdout


def test_generate_chat(smollm2_llm):
    res = subprocess.run([BIN, "generate", "--chat", "--prompt", "What is 2+2?", "--temperature", "0",
                          "--max-tokens", "30"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "4" in res.stdout and "finish_reason=stop" in res.stdout


def _greedy(n):
    from graphinfer import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n)
