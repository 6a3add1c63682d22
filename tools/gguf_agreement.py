"""Greedy agreement of GGUF engines with the GGUF dequantized to fp32 (free-running, EOS ignored).

    PYTHONPATH=. .venv/bin/python tools/gguf_agreement.py gguf:int8:float32,gguf:fp32:float32,none:fp32:bfloat16

Each comma-separated item is quantization:activations:dtype: quantization "gguf" (kept quantized) or "none"
(dequantized), activations GRAPHINFER_CPU_WO_ACTIVATIONS (int8 / fp32), dtype the engine's. Prompts: the 8 chat
prompts of graphinfer/bench/accuracy_text.py through the chat template, and 16 random-id prompts of the CPU peer
workload (tools/cpu_peers.py); --new-tokens greedy tokens each. Prints one JSON line: per engine and prompt set,
(share of positions with the reference's token, sequences identical throughout). Free-running greedy diverges
for good after the first different token, so these shares are lower than teacher-forced ones.
"""
import argparse
import json
import os
import sys

from graphinfer import LLM, SamplingParams
from graphinfer.bench.accuracy_text import PROMPTS
from graphinfer.config import bundled_model_path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_peers import agreement, workload  # noqa: E402


def run(model: str, quant: str | None, activations: str, dtype: str, n_new: int) -> dict:
    os.environ["GRAPHINFER_CPU_WO_ACTIVATIONS"] = activations  # read when the engine's platform activates
    llm = LLM(model, dtype=dtype, quantization=quant, enable_prefix_caching=False, max_model_len=1024)
    tok = llm.get_tokenizer()
    chat = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    outs = {}
    for name, prompts in (("chat", chat), ("random", workload(16))):
        res = llm.generate([p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        outs[name] = [list(o.outputs[0].token_ids) for o in res]
    llm.shutdown()
    return outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("engines", help="quantization:activations:dtype, comma-separated")
    p.add_argument("--model", default="", help="a .gguf file (default: the bundled SmolLM2)")
    p.add_argument("--new-tokens", type=int, default=32)
    a = p.parse_args()
    model = a.model or bundled_model_path()
    ref = run(model, None, "fp32", "float32", a.new_tokens)
    rows = {}
    for item in a.engines.split(","):
        quant, activations, dtype = item.split(":")
        got = run(model, None if quant == "none" else quant, activations, dtype, a.new_tokens)
        rows[item] = {k: agreement(ref[k], got[k]) for k in ref}
    print(json.dumps({"model": model, "new_tokens": a.new_tokens, "prompts": {"chat": len(PROMPTS), "random": 16},
                      "reference": "none:fp32:float32", "rows": rows}))


if __name__ == "__main__":
    main()
