"""`graphinfer bench throughput --structured-output json` (or --sweep structured-output=none,json): every request
constrained to a JSON schema, and what structured outputs cost per step (the engine's StructuredOutputManager
counters over the timed run: mask fill on the host, host -> device copy + apply on the device, the matchers accepting
the sampled tokens).

The schema is an array of at least 1,000 small records ({"id": 0..999, "name": up to 16 characters, "tag": one of
three}), so that no output can end before its max_tokens (the grammar cannot be complete sooner: the workload's
output lengths stay those of the unconstrained run, ignore_eos or not) and the masks cover every kind of JSON state:
structural ones that allow a few tokens, numbers, an enum, free string content. The model needs a tokenizer (a
preset's random weights have none: use a checkpoint, e.g. the bundled SmolLM2, --model "")."""
from graphinfer.errors import InvalidConfigError
from graphinfer.sampling_params import StructuredOutputsParams

KINDS = ("none", "json")
BENCH_SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "name": {"type": "string", "maxLength": 16},
                                     "tag": {"enum": ["alpha", "beta", "gamma"]}},
    "required": ["id", "name", "tag"]}}


def structured_params(kind: str | None) -> StructuredOutputsParams | None:
    if kind in (None, "none"):
        return None
    if kind == "json":
        return StructuredOutputsParams(json=BENCH_SCHEMA)
    raise InvalidConfigError(f"--structured-output {kind!r}: use one of {', '.join(KINDS)}.")


def snapshot(engine):
    """The engine's structured-output counters now (a data-parallel front end: replica 0's)."""
    return engine.structured_output.stats()


def delta(engine, before, num_steps: int, total_s: float) -> dict:
    """The counters since `before`, per engine step of the run and as shares of its wall time."""
    d = engine.structured_output.stats().since(before)
    per_step = lambda s: s / num_steps * 1e3 if num_steps else None  # noqa: E731
    return {**d, "masked_rows_per_step": d["rows"] / num_steps if num_steps else None,
            "fill_ms_per_step": per_step(d["fill_s"]), "apply_ms_per_step": per_step(d["apply_s"]),
            "accept_ms_per_step": per_step(d["accept_s"]),
            "host_fraction": (d["fill_s"] + d["accept_s"]) / total_s, "device_fraction": d["apply_s"] / total_s,
            "measure": "fill_s / accept_s: host wall time (xgrammar's batch fill into pinned memory; the matchers' "
                       "accept_token); apply_s: the bitmask's host -> device copy plus "
                       "graphinfer::apply_token_bitmask, timed with device events (on cpu the host's wall time); with "
                       "async scheduling the host part overlaps the step's forward on the device"}
