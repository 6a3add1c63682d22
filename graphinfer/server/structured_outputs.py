"""The structured-output fields of a completions / chat request, as vLLM's server takes them: `structured_outputs`
(vLLM's StructuredOutputsParams), the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` /
`guided_whitespace_pattern`, and OpenAI's `response_format` (`text`, `json_object`, `json_schema`). Whatever names
them, a request carries at most one constraint; two are a 400."""
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from graphinfer.errors import InvalidStructuredOutputError
from graphinfer.sampling_params import STRUCTURED_OUTPUT_KINDS as _CONSTRAINTS, StructuredOutputsParams


class StructuredOutputsRequest(BaseModel):
    """vLLM's StructuredOutputsParams as a request field (an unknown key is a 400, so a typo is not ignored)."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False  # vLLM's; xgrammar is the only backend here, there is nothing to fall back to


class JsonSchemaResponseFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


class StructuredOutputsFields(BaseModel):
    """The request fields; structured_outputs_params() merges them."""
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    response_format: ResponseFormat | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's one constraint (None without one). Raises InvalidStructuredOutputError (a 400) when fields
        name two, or a json_schema response_format has no schema."""
        found: dict[str, tuple[str, Any]] = {}  # constraint or option -> (the field that set it, value)

        def add(name: str, source: str, value) -> None:
            if value is None or value is False:
                return
            if name in _CONSTRAINTS and (other := next((s for n, (s, _) in found.items() if n in _CONSTRAINTS), None)):
                raise InvalidStructuredOutputError(
                    f"structured outputs take one constraint, but the request gives {other} and {source}; send one "
                    f"of them.")
            found[name] = (source, value)

        so = self.structured_outputs
        if so is not None:
            for name in _CONSTRAINTS + _OPTIONS:
                add(name, f"structured_outputs.{name}", getattr(so, "json_" if name == "json" else name))
        for name in ("json", "regex", "choice", "grammar", "whitespace_pattern"):
            add(name, f"guided_{name}", getattr(self, f"guided_{name}"))
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            add("json_object", "response_format json_object", True)
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise InvalidStructuredOutputError(
                    'response_format {"type": "json_schema"} needs "json_schema": {"name": ..., "schema": {...}}.')
            add("json", "response_format json_schema", rf.json_schema.json_schema)
        if not any(name in _CONSTRAINTS for name in found):
            if found:
                raise InvalidStructuredOutputError(
                    f"{', '.join(s for s, _ in found.values())} given without a constraint (json, regex, choice, "
                    f"grammar, json_object or structural_tag); add one, or leave the option out.")
            return None
        return StructuredOutputsParams(**{name: value for name, (_, value) in found.items()})
