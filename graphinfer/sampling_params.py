"""SamplingParams: what to generate for one request, named and defaulted as in vLLM."""
import enum
import math
from dataclasses import dataclass, field

from graphinfer.errors import InvalidSamplingParamsError

_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """vLLM's: CUMULATIVE gives an output every step (streaming); FINAL_ONLY only when the request ends
    (LLM.generate uses it, saving a RequestOutput per request per step)."""
    CUMULATIVE = 0
    FINAL_ONLY = 2


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """vLLM's: constrain the output to a JSON schema (`json`, a dict or its JSON text), any JSON object
    (`json_object`), a regular expression (`regex`), one of some strings (`choice`), an EBNF / GBNF grammar
    (`grammar`) or a structural tag (`structural_tag`, xgrammar's JSON). Exactly one may be given. The grammar's
    token bitmask is applied to the logits before sampling (runtime/structured_output/)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self):
        given = [name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidSamplingParamsError(
                f"structured outputs take exactly one of json, regex, choice, grammar, json_object, structural_tag; "
                f"got {given or 'none'}.")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidSamplingParamsError("structured outputs' choice must be a non-empty list of strings.")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar", "json_object" or "structural_tag"."""
        return next(name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False))


@dataclass
class SamplingParams:
    """n: outputs per prompt. best_of (None: n): candidates sampled, of which the n with the highest cumulative
    logprob are returned, best first (vLLM's; runtime/parallel_sampling.py). A seeded request's i-th candidate samples
    with seed + i."""
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (plus the sampled one)
    # top-N logprobs per prompt token (plus the prompt's own token; -1: the whole vocabulary), vLLM's: the
    # RequestOutput's prompt_logprobs (None for the first prompt token, which nothing predicts)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self):
        def bad(msg):
            raise InvalidSamplingParamsError(msg)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):  # NaN would pass every range check below
                bad(f"{name}={getattr(self, name)} must be a finite number.")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            bad(f"n={self.n!r} must be an integer >= 1 (the number of outputs per prompt).")
        if self.best_of is not None:
            if not isinstance(self.best_of, int) or isinstance(self.best_of, bool) or self.best_of < self.n:
                bad(f"best_of={self.best_of!r} must be an integer >= n={self.n} (the candidates the n outputs are "
                    f"picked from); leave it unset for best_of = n.")
            if self.best_of > self.n and self.temperature < _GREEDY_EPS:
                bad(f"best_of={self.best_of} > n={self.n} with greedy sampling (temperature=0) would pick from "
                    f"identical candidates; use temperature > 0, or best_of = n.")
        if self.temperature < 0:
            bad(f"temperature={self.temperature} must be >= 0 (0 means greedy).")
        if not 0 < self.top_p <= 1:
            bad(f"top_p={self.top_p} must be in (0, 1]; use 1 to disable it.")
        if self.top_k < 0:
            bad(f"top_k={self.top_k} must be >= 1, or 0 / -1 to disable it.")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p={self.min_p} must be in [0, 1]; use 0 to disable it.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(f"{name}={getattr(self, name)} must be in [-2, 2]; use 0 to disable it.")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty={self.repetition_penalty} must be > 0; use 1 to disable it.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens={self.max_tokens} must be >= 1 (or None for as many as max_model_len allows).")
        if self.min_tokens < 0:
            bad(f"min_tokens={self.min_tokens} must be >= 0.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}.")
        if self.logprobs is not None and self.logprobs < 0:
            bad(f"logprobs={self.logprobs} must be >= 0 (the number of top alternatives to return).")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or
                                                 isinstance(self.prompt_logprobs, bool) or self.prompt_logprobs < -1):
            bad(f"prompt_logprobs={self.prompt_logprobs!r} must be an integer >= 0 (the number of top alternatives "
                f"to return per prompt token), or -1 for the whole vocabulary.")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            bad(f"stop={self.stop!r} must be a non-empty string or a list of non-empty strings.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids={self.stop_token_ids!r} must be non-negative token ids.")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64):
            bad(f"seed={self.seed!r} must be an integer in [-2**63, 2**64).")

    @property
    def num_candidates(self) -> int:
        """Sequences sampled per prompt: best_of, or n where best_of is unset."""
        return self.n if self.best_of is None else self.best_of

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the generated tokens (so async scheduling must have them on the host)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
