"""The output of `tool_choice="required"` or a named function, whose shape structured outputs enforced (vLLM's
serving_chat reads it the same way; these parsers are not selectable by --tool-call-parser)."""
from graphinfer.server.tool_parsers.abstract_tool_parser import ParsedText, PartialCall, ToolParser, call_from_object
from graphinfer.server.tool_parsers.partial_json import MalformedJSON, parse_partial, skip_ws


class RequiredToolParser(ToolParser):
    """`[{"name": ..., "parameters": {...}}, ...]`; the arguments are the parameters re-written by json.dumps."""

    def parse(self, text: str, final: bool) -> ParsedText:
        node, after = parse_partial(text)
        if node is None:
            if final:
                raise MalformedJSON("no tool calls")
            return ParsedText()
        if node.kind != "array":
            raise MalformedJSON("required tool calls come as a JSON array")
        if skip_ws(text, after) != len(text) or (final and not node.complete):
            raise MalformedJSON("not one complete JSON array")
        return ParsedText(calls=[call_from_object(item, ("parameters",)) for item in node.items])


class NamedToolParser(ToolParser):
    """The named function's arguments, the whole output as written (as vLLM returns them)."""

    def __init__(self, name: str, tokenizer=None):
        super().__init__(tokenizer)
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedText:
        return ParsedText(calls=[PartialCall(self.name, text, final)])
