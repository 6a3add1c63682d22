"""`graphinfer bench accuracy`: how far each quantization scheme moves a model from its unquantized self.

For every scheme, against the unquantized model (same checkpoint, dtype and device), teacher-forced: the
unquantized model's greedy continuation of each fixed prompt (accuracy_text.PROMPTS; for a model without a
tokenizer, random token ids from the seed) is scored by both models, giving
- agreement: the share of positions where the scheme's greedy token is the unquantized model's,
- kl: the mean KL(unquantized || scheme) of the next-token distributions over those positions;
and, for a model with a tokenizer, the perplexity of accuracy_text.PERPLEXITY_TEXT (a fixed text shipped with
graphinfer). Also the bytes of the weights the graph reads. JSON out; nothing is hidden: a scheme that loses
shows it in these numbers.
"""
import math

import torch
import torch.nn.functional as F

from graphinfer.bench import common
from graphinfer.bench.accuracy_text import PERPLEXITY_TEXT, PROMPTS
from graphinfer.errors import InvalidConfigError
from graphinfer.models.layers import AttentionMetadata


@torch.inference_mode()
def score(llm, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(token_ids), V] of one sequence through the engine's compiled graph (one prefill written
    into KV blocks 0..n of the idle engine: run with prefix caching off, so no cached block is overwritten)."""
    runner = llm.llm_engine.worker.model_runner
    device, bs, n = runner.device, runner.block_size, len(token_ids)
    blocks = -(-n // bs)
    if blocks > runner.num_blocks:
        raise InvalidConfigError(f"a {n}-token sequence needs {blocks} KV blocks; the engine has {runner.num_blocks}.")
    md = AttentionMetadata(torch.arange(n, device=device), torch.arange(blocks, dtype=torch.int32, device=device)[None],
                           torch.tensor([0, n], dtype=torch.int32, device=device),
                           torch.tensor([n], dtype=torch.int32, device=device))
    ids = torch.tensor(token_ids, device=device)
    hidden = runner.graph(ids, torch.arange(n, device=device), md)
    return runner.model.compute_logits(hidden).float()


def weight_bytes(llm) -> int:
    """Bytes of the tensors the graph reads (each once: a tied head is the embedding's)."""
    engine = llm.llm_engine
    graph = engine.worker.graph if isinstance(engine.worker.graph, torch.nn.Module) else engine.worker.model
    seen = {(t.data_ptr(), t.numel()): t.numel() * t.element_size()
            for t in list(graph.parameters()) + list(engine.worker.model.parameters())}
    return sum(seen.values())


def _sequences(base, num_prompts: int, max_tokens: int, seed: int) -> list[list[int]]:
    """prompt + the unquantized model's greedy continuation, per prompt."""
    from graphinfer import SamplingParams

    tok = base.get_tokenizer()
    if tok is not None:
        chat = getattr(tok, "chat_template", None)
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                 if chat else p for p in PROMPTS[:num_prompts]]
        prompts = [tok(t, add_special_tokens=not chat).input_ids for t in texts]
    else:
        g = torch.Generator().manual_seed(seed)
        vocab = base.llm_engine.hf_config.vocab_size
        prompts = [torch.randint(0, vocab, (16 + 4 * i,), generator=g).tolist() for i in range(num_prompts)]
    outs = base.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


def _perplexity(llm, chunk: int) -> float | None:
    tok = llm.get_tokenizer()
    if tok is None:
        return None
    ids = tok(PERPLEXITY_TEXT).input_ids
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start:start + chunk + 1]
        logp = F.log_softmax(score(llm, piece[:-1]), -1)
        nll -= logp.gather(1, torch.tensor(piece[1:], device=logp.device)[:, None]).sum().item()
        count += len(piece) - 1
    return math.exp(nll / count)


def _compare(base_logits: list[torch.Tensor], logits: list[torch.Tensor]) -> dict:
    agree = total = 0
    kl = 0.0
    for a, b in zip(base_logits, logits):
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        total += a.shape[0]
        kl += F.kl_div(F.log_softmax(b, -1), F.log_softmax(a, -1), log_target=True, reduction="sum").item()
    return {"agreement": agree / total, "kl": kl / total, "positions": total}


def run(model: str = "", *, schemes: list[str], dtype: str = "auto", device: str = "auto", num_prompts: int = 8,
        max_tokens: int = 32, ppl_chunk: int = 256, seed: int = 0, output_json: str | None = None,
        **engine_kwargs) -> dict:
    from graphinfer import LLM

    kw = dict(dtype=dtype, device=device, seed=seed, enable_prefix_caching=False, **engine_kwargs)
    rows = []
    base = LLM(model, **kw)
    seqs = _sequences(base, num_prompts, max_tokens, seed)

    def logits_of(llm):  # the positions that predict the continuation's tokens
        return [score(llm, p + c[:-1])[len(p) - 1:] for p, c in seqs]

    base_logits = logits_of(base)
    base_bytes = weight_bytes(base)
    rows.append({"scheme": "none", "weight_bytes": base_bytes, "weight_fraction": 1.0, "agreement": 1.0, "kl": 0.0,
                 "positions": sum(len(c) for _, c in seqs), "perplexity": _perplexity(base, ppl_chunk)})
    base.shutdown()
    del base
    for scheme in schemes:
        llm = LLM(model, quantization=scheme, **kw)
        nbytes = weight_bytes(llm)
        rows.append({"scheme": scheme, "weight_bytes": nbytes, "weight_fraction": nbytes / base_bytes,
                     **_compare(base_logits, logits_of(llm)), "perplexity": _perplexity(llm, ppl_chunk)})
        llm.shutdown()
    result = {"model": model, "dtype": dtype, "device": device, "num_prompts": len(seqs), "max_tokens": max_tokens,
              "environment": common.environment(torch.device(rows and device if device != "auto" else "cpu")),
              "runs": rows}
    print(table(rows))
    common.write_json(output_json, result)
    return result


def table(rows: list[dict]) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    return common.markdown_table(
        ["scheme", "weights MB", "of unquantized", "greedy agreement", "mean KL", "perplexity"],
        [[r["scheme"], f"{r['weight_bytes'] / 1e6:.1f}", f"{r['weight_fraction']:.1%}", f"{r['agreement']:.1%}",
          f"{r['kl']:.4f}", fmt(r["perplexity"], ".3f")] for r in rows])
