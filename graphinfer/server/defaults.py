"""Serving defaults, importable without the server's dependencies (the CLI shows them in `serve --help`)."""
import logging

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # seconds a SIGTERM / SIGINT drain waits for requests in flight
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024  # a 128k-token prompt is ~1 MB as token ids, ~0.5-2 MB as text
# --tool-call-parser's choices: the names server/tool_parsers registers (kept here so that the CLI need not import them)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "llama4_json")

# max_num_batched_tokens when serving. Every step gives each running stream one token and carries at most this
# many tokens, so the budget bounds a stream's inter-token gap while a long prompt is prefilled, at some cost to
# that prompt's time to first token; vLLM too serves with a smaller budget than its offline LLM class.
# cuda / npu: vLLM's online defaults (8192 on GPUs with >= 70 GiB other than the A100, else 2048; the Ascend
# 910B's 64 GB is the 2048 case). cpu: measured with tools/serve_fairness.py (docs/benchmarks.md): on 2 vCPUs
# SmolLM2's prefill throughput is within 5-16% of its plateau from 128 tokens a step on, while the step (a running
# stream's gap) grows linearly, 128 tokens costing ~9-10 decode steps (~1 s on one thread).
SERVE_BATCHED_TOKENS = {"cpu": 128, "cuda_large": 8192, "cuda": 2048, "npu": 2048, "other": 2048}
SERVE_BATCHED_TOKENS_HELP = ("default when serving: 128 on cpu; on cuda 8192 with >= 70 GiB of device memory (H100, "
                             "H200; not A100), else 2048; 2048 on npu (offline, generate and bench: 8192)")


def serve_batched_tokens(device: str) -> int:
    """serve's default max_num_batched_tokens on the platform `device` ("auto", "cpu", "cuda:1", ...) selects."""
    from graphinfer.platforms import current_platform, platform_for_device

    platform = current_platform() if device == "auto" else platform_for_device(device.split(":")[0])
    if platform.name == "cuda":
        import torch

        props = torch.cuda.get_device_properties(int(device.split(":")[1]) if ":" in device else 0)
        large = props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower()
        return SERVE_BATCHED_TOKENS["cuda_large" if large else "cuda"]
    return SERVE_BATCHED_TOKENS.get(platform.name, SERVE_BATCHED_TOKENS["other"])


def resolve_serve_engine_args(engine_args: dict) -> dict:
    """serve's engine arguments: max_num_batched_tokens from the platform unless given, and max_num_seqs at most
    that (as vLLM: every running request needs a token each step, and the scheduler serves the running ones in
    order, so beyond the budget the last ones would wait for the first ones to finish)."""
    from graphinfer.engine_args import default

    args = dict(engine_args)
    if args.get("max_num_batched_tokens") is None:
        args["max_num_batched_tokens"] = serve_batched_tokens(args.get("device") or "auto")
    budget = args["max_num_batched_tokens"]
    max_num_seqs = args.get("max_num_seqs", default("max_num_seqs"))
    if max_num_seqs > budget:
        logger.info("max_num_seqs %d -> %d: no more requests run at once than a step (max_num_batched_tokens) has "
                    "tokens", max_num_seqs, budget)
        args["max_num_seqs"] = budget
    return args
