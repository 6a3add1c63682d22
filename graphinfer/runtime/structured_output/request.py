"""What a request's StructuredOutputsParams compile to: the (kind, spec) key of the grammar cache (vLLM's
get_structured_output_key), with a choice turned into the EBNF grammar vLLM builds for it."""
import json

from graphinfer.errors import InvalidStructuredOutputError
from graphinfer.sampling_params import StructuredOutputsParams


def structured_output_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, spec): kind one of json, json_object, regex, choice, grammar, structural_tag; spec the text compiled
    (a JSON schema as JSON text, a choice list as its grammar). Equal keys share one compiled grammar."""
    kind = params.kind
    if kind == "json":
        spec = params.json
        if not isinstance(spec, str):
            try:
                spec = json.dumps(spec)  # key order kept: xgrammar emits the properties in it
            except (TypeError, ValueError) as e:
                raise InvalidStructuredOutputError(f"structured outputs' json must be a JSON schema (a dict or its "
                                                   f"JSON text): {e}") from None
        return kind, spec
    if kind == "json_object":
        return kind, ""
    if kind == "choice":
        return kind, choice_as_grammar(params.choice)
    return kind, getattr(params, kind)


def choice_as_grammar(choice: list[str]) -> str:
    """root ::= "a" | "b" ... (vLLM's), each choice a JSON string literal, which xgrammar's EBNF reads with the same
    escapes (quotes, backslashes, newlines)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


class CompileTimeout(Exception):
    """A constraint did not compile within the time a request waits (StructuredOutputManager turns it into
    InvalidStructuredOutputError naming the setting)."""

    def __init__(self, timeout: float | None):
        super().__init__(f"not compiled within {timeout} s")
        self.timeout = timeout
