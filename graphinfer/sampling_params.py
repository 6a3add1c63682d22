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


# Bounds on the per-request logits processors' sizes (each costs host work in every step of the request).
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_BAD_WORDS = 1024  # bad_words strings
LOGIT_BIAS_CLAMP = 100.0  # OpenAI's range of a bias: the server clamps to it, as vLLM does

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
    # vLLM's; with a fast (Rust) tokenizer, which graphinfer's detokenizer always decodes with, it changes nothing (as
    # in vLLM's fast-tokenizer path)
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, repr=False)
    # bad_words as token ids (InputProcessor: update_from_tokenizer); an init field so that replace() keeps it
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)

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
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases; got "
                    f"{len(self.logit_bias) if isinstance(self.logit_bias, dict) else type(self.logit_bias).__name__}.")
            for t, b in self.logit_bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    bad(f"logit_bias: {t!r} is not a token id (a non-negative integer).")
                if not isinstance(b, (int, float)) or isinstance(b, bool) or not math.isfinite(b):
                    bad(f"logit_bias[{t}]={b!r} must be a finite number.")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                bad("allowed_token_ids must be a non-empty list of token ids (leave it out to allow every token).")
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids):
                bad("allowed_token_ids must be non-negative token ids.")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_BAD_WORDS:
                bad(f"bad_words must be a list of at most {MAX_BAD_WORDS} strings.")
            if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                bad("bad_words must be non-empty strings.")
        if self.truncate_prompt_tokens is not None and (
                not isinstance(self.truncate_prompt_tokens, int) or self.truncate_prompt_tokens == 0
                or self.truncate_prompt_tokens < -1):
            bad(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {self.truncate_prompt_tokens!r}.")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64):
            bad(f"seed={self.seed!r} must be an integer in [-2**63, 2**64).")

    @property
    def num_candidates(self) -> int:
        """Sequences sampled per prompt: best_of, or n where best_of is unset."""
        return self.n if self.best_of is None else self.best_of

    def update_from_tokenizer(self, tokenizer) -> None:
        """bad_words -> token id sequences, as vLLM: each word (leading spaces stripped) alone and after a space, the
        latter kept where it tokenizes to as many tokens as the former but starts with another token."""
        if not self.bad_words:
            return
        words: list[list[int]] = []
        for word in self.bad_words:
            for prefix in ("", " "):
                ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
                if not ids:
                    continue
                if not prefix or (words and ids[0] != words[-1][0] and len(ids) == len(words[-1])):
                    words.append(ids)
        self._bad_words_token_ids = words

    @property
    def has_logits_processors(self) -> bool:
        """Whether the sampler masks or biases this request's logits (logit_bias, allowed_token_ids, bad_words)."""
        return bool(self.logit_bias or self.allowed_token_ids or self._bad_words_token_ids)

    @property
    def reads_output_tokens(self) -> bool:
        """Whether sampling reads the generated tokens (so async scheduling must have them on the host): penalties,
        and bad words of more than one token."""
        return self.has_penalties or any(len(w) > 1 for w in self._bad_words_token_ids or ())

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the generated tokens (so async scheduling must have them on the host)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
