"""The `graphinfer generate` console script, run as a user would (a real subprocess, bundled SmolLM2): its printed
outputs, parsed, equal the offline API's for the same prompts and sampling parameters."""
import os
import subprocess
import sys

import pytest
from cli_output import expected_blocks, parse_generate

BIN = os.path.join(os.path.dirname(sys.executable), "graphinfer")


def _same(printed: list[dict], expected: list[dict]) -> None:
    """Equal blocks; logprobs printed to 4 decimals, compared to the in-process engine's within that rounding."""
    strip = [{k: v for k, v in b.items() if k != "logprobs"} for b in printed]
    assert strip == [{k: v for k, v in b.items() if k != "logprobs"} for b in expected]
    for p, e in zip(printed, expected):
        assert [t for t, _ in p["logprobs"]] == [t for t, _ in e["logprobs"]]
        assert [v for _, v in p["logprobs"]] == pytest.approx([v for _, v in e["logprobs"]], abs=2e-4)


def test_generate_prints_greedy_text(smollm2_llm):
    prompts = ["The capital of France is", "Hi"]
    res = subprocess.run([BIN, "generate", "--prompt", prompts[0], "--prompt", prompts[1],
                          "--temperature", "0", "--max-tokens", "12", "--dtype", "float32", "--logprobs", "1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    printed = parse_generate(res.stdout)
    greedy = smollm2_llm.generate(prompts, _greedy(12, logprobs=1), use_tqdm=False)
    _same(printed, expected_blocks(prompts, greedy))
    assert [len(b["logprobs"]) for b in printed] == [b["num_tokens"] for b in printed]
    assert printed[0]["text"].startswith(" Paris")


def test_generate_chat(smollm2_llm):
    prompt = "What is 2+2?"
    res = subprocess.run([BIN, "generate", "--chat", "--prompt", prompt, "--temperature", "0", "--max-tokens", "30",
                          "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    printed = parse_generate(res.stdout)
    chat = smollm2_llm.chat([[{"role": "user", "content": prompt}]], _greedy(30), use_tqdm=False)
    _same(printed, expected_blocks([prompt], chat))
    assert printed[0]["finish_reason"] == "stop" and "4" in printed[0]["text"].replace("2+2", "")


def _greedy(n, **kw):
    from graphinfer import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, **kw)
