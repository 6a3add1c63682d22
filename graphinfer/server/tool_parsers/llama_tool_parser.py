"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` ("arguments" also read), several separated by
`;`, optionally after `<|python_tag|>` (vLLM's `llama3_json`, for its tool_chat_template_llama3.1_json.jinja).

As vLLM: a whole output's calls may stand anywhere in it (the first `{` where valid calls begin; the text around
them is dropped, so content is None); a streamed output is read as calls only when it begins with `{` or the tag
(leading whitespace allowed), otherwise it streams as content.
"""
from graphinfer.server.protocol import ExtractedToolCallInformation, FunctionCall, ToolCall
from graphinfer.server.tool_parsers.abstract_tool_parser import (ParsedText, PartialCall, ToolParser, ToolParserManager,
                                                                 call_from_object)
from graphinfer.server.tool_parsers.partial_json import MalformedJSON, parse_partial, skip_ws

BOT = "<|python_tag|>"
_MAX_STARTS = 64  # `{` positions tried in a whole output (a bound on the work for text full of braces)


def calls_from(text: str, i: int, final: bool) -> list[PartialCall]:
    """The calls `{...}; {...}` starting at text[i] (a `{`). Text after the last call is ignored."""
    calls = []
    while True:
        node, after = parse_partial(text, i)
        if node is None:  # `;` and nothing after it yet
            if final:
                raise MalformedJSON("a ';' with no tool call after it")
            return calls
        call = call_from_object(node, ("arguments", "parameters"))
        if not call.complete:
            if final:
                raise MalformedJSON("a tool call's JSON is cut off")
            calls.append(call)
            return calls
        calls.append(call)
        k = skip_ws(text, after)
        if k == len(text) or text[k] != ";":
            return calls
        i = k + 1


@ToolParserManager.register_module(["llama3_json", "llama4_json"])
class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        i = len(BOT) if text.startswith(BOT) else 0
        if not i and not final and BOT.startswith(text):
            return ParsedText()  # maybe the tag, still arriving
        j = skip_ws(text, i)
        if j == len(text):
            return ParsedText(content=text if final else "")
        if text[j] != "{":
            return ParsedText(content=text)
        return ParsedText(calls=calls_from(text, j, final))

    def extract_tool_calls(self, model_output: str, request=None) -> ExtractedToolCallInformation:
        start = model_output.find("{")
        for _ in range(_MAX_STARTS):
            if start < 0:
                break
            try:
                calls = calls_from(model_output, start, final=True)
            except MalformedJSON:
                start = model_output.find("{", start + 1)
                continue
            return ExtractedToolCallInformation(tools_called=True, content=None, tool_calls=[
                ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls])
        return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
