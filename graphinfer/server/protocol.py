"""Request bodies of the OpenAI API as vLLM serves it (pydantic; unknown fields are ignored).

Validated as vLLM validates them: a failure here is a 400 with OpenAI's error body (BadRequestError).
The checks that need the prompt's token count (max_tokens + prompt within max_model_len) are the server's.
"""
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from graphinfer.sampling_params import SamplingParams
from graphinfer.server.structured_outputs import StructuredOutputsFields


def _check_utf8(value) -> None:
    """JSON may carry lone surrogates ("\\ud800"), which no tokenizer or UTF-8 encoder accepts."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("strings must be valid Unicode (no lone surrogates)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_utf8(k)
            _check_utf8(v)
    elif isinstance(value, list):
        for v in value:
            _check_utf8(v)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(StructuredOutputsFields):  # + structured_outputs, guided_*, response_format
    # NaN / Infinity (Python's json reads them) slip through SamplingParams' range checks and poison sampling.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        _check_utf8(data)
        return data

    @model_validator(mode="before")
    @classmethod
    def _stream_options_need_stream(cls, data):
        # vLLM: "Stream options can only be defined when `stream=True`." (an empty or null one passes)
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise ValueError("stream_options can only be given when stream=true.")
        return data

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return None

    def to_sampling_params(self) -> SamplingParams:
        """Raises InvalidSamplingParamsError (-> 400) for out-of-range values."""
        def pick(value, default):
            return default if value is None else value

        return SamplingParams(
            n=self.n, temperature=pick(self.temperature, 1.0), top_p=pick(self.top_p, 1.0), top_k=pick(self.top_k, 0),
            min_p=pick(self.min_p, 0.0), presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0), repetition_penalty=pick(self.repetition_penalty, 1.0),
            seed=self.seed, max_tokens=self._max_tokens(), min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=self._logprobs(),
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_outputs_params())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False  # echoing the prompt back is not supported
    best_of: Literal[1] | None = None
    suffix: None = None  # insertion is not supported

    def _logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list:
        """A single prompt or a batch, each a string or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)) or not p:
            return [p]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]  # OpenAI's roles
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    function_call: Any | None = None

    @model_validator(mode="after")
    def _content_required(self):
        # OpenAI: content is required, except on an assistant message that carries tool_calls / function_call
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.function_call)):
            raise ValueError(f"a '{self.role}' message needs 'content' (a string or a list of text parts)"
                             + ("; an assistant message may leave it out only with tool_calls" if self.role == "assistant"
                                else ""))
        return self

    def to_template(self) -> dict:
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(part.text for part in self.content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        # vLLM: "when using `top_logprobs`, `logprobs` must be set to true." (top_logprobs=0 passes, as there)
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true.")
        return self

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
