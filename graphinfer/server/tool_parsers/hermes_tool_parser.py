"""Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them.

As vLLM's `hermes` parser: the content is the text before the first call; text between and after the calls is
dropped; a last call may lack its closing tag (the output ended); malformed JSON leaves the whole output as content.
"""
from graphinfer.server.tool_parsers.abstract_tool_parser import ParsedText, ToolParser, ToolParserManager, call_from_object
from graphinfer.server.tool_parsers.partial_json import MalformedJSON, parse_partial, skip_ws

START, END = "<tool_call>", "</tool_call>"


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        first = text.find(START)
        if first < 0:
            return ParsedText(content=text if final else text[:len(text) - held_back(text, START)])
        parsed = ParsedText(content=text[:first])
        pos = first
        while (start := text.find(START, pos)) >= 0:
            body_start = start + len(START)
            end = text.find(END, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            node, after = parse_partial(body)
            if node is None:  # nothing but whitespace in the call yet
                if final:
                    raise MalformedJSON("an empty tool call")
                break
            call = call_from_object(node, ("arguments",))
            rest = body[skip_ws(body, after):]
            if rest and (end >= 0 or final or not END.startswith(rest)):
                raise MalformedJSON(f"text after a tool call's JSON: {rest[:20]!r}")
            if final and not call.complete:
                raise MalformedJSON("a tool call's JSON is cut off")
            parsed.calls.append(call)
            if end < 0:
                break
            pos = end + len(END)
        return parsed
