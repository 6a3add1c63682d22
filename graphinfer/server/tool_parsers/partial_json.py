"""JSON read as it streams in, re-written in one canonical form (`json.dumps(value, ensure_ascii=False)`'s).

A tool call's arguments are sent as a JSON string, in pieces while they are generated. `parse_partial` reads a
value that may be cut off anywhere; `canonical` writes the part of it that is certain. What it writes for a text
is always a prefix of what it writes for any longer text the model may go on to produce, and for a complete
value it equals `json.dumps(json.loads(text), ensure_ascii=False)` (keys in the order written), so the pieces
streamed add up to exactly the arguments of the one-shot parse.
"""
import json
import re
from dataclasses import dataclass, field

_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("+-.0123456789eE")
_LITERALS = ("true", "false", "null")
# a string's characters: anything but a quote, a backslash or a control character, or an escape
_STRING_BODY = re.compile(r'(?:[^"\\\x00-\x1f]+|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*')
_ESCAPE_START = re.compile(r'\\(?:u[0-9a-fA-F]{0,3})?')  # an escape cut off by the end of the text
_HIGH_SURROGATE = re.compile(r'\\u[dD][89abAB][0-9a-fA-F]{2}')
MAX_DEPTH = 128  # deeper nesting is refused (a recursion guard; json.loads itself stops near 1000)


class MalformedJSON(ValueError):
    """The text is not (a prefix of) one JSON value."""


@dataclass
class Node:
    """A JSON value as far as it was read. kind: object / array / string / number / literal. value: a string's
    characters decoded so far, a number's or literal's text. items: an object's [(key, Node)] or an array's [Node]
    (only the last may be incomplete). key: an object's key whose value has not begun yet."""
    kind: str
    complete: bool = False
    value: object = None
    key: str | None = None
    items: list = field(default_factory=list)

    def get(self, key: str) -> "Node | None":
        """An object's member (the first of that name)."""
        return next((v for k, v in self.items if k == key), None)


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def parse_partial(s: str, i: int = 0, depth: int = 0) -> tuple[Node | None, int]:
    """The value starting at s[i] (after whitespace) and the index after it. None: nothing but whitespace yet.
    A value cut off by the end of s comes back incomplete with index len(s). Raises MalformedJSON."""
    i = skip_ws(s, i)
    if i == len(s):
        return None, i
    if depth > MAX_DEPTH:
        raise MalformedJSON(f"nested deeper than {MAX_DEPTH}")
    c = s[i]
    if c == "{":
        return _parse_object(s, i + 1, depth)
    if c == "[":
        return _parse_array(s, i + 1, depth)
    if c == '"':
        return _parse_string(s, i + 1)
    if c in "-0123456789":
        j = i
        while j < len(s) and s[j] in _NUMBER_CHARS:
            j += 1
        if j == len(s):  # more digits may follow
            return Node("number", False, s[i:j]), j
        if not _NUMBER.fullmatch(s, i, j):
            raise MalformedJSON(f"bad number {s[i:j]!r}")
        try:  # written as json.dumps writes it (1E5 -> 100000.0); 1e999 stays as written, not as Infinity
            text = json.dumps(json.loads(s[i:j]))
        except ValueError:  # more digits than Python converts
            raise MalformedJSON(f"number too long at {i}") from None
        return Node("number", True, text if "Infinity" not in text else s[i:j]), j
    for lit in _LITERALS:
        if s.startswith(lit, i):
            return Node("literal", True, lit), i + len(lit)
        if lit.startswith(s[i:]):
            return Node("literal", False, s[i:]), len(s)
    raise MalformedJSON(f"unexpected {c!r} at {i}")


def _parse_string(s: str, i: int) -> tuple[Node, int]:
    """The string whose opening quote is s[i - 1]. Decoded by json's own scanner (C speed: a stream re-reads
    long arguments at every delta); a cut-off end leaves out an unfinished escape, or a surrogate pair's half."""
    j = _STRING_BODY.match(s, i).end()
    if j < len(s) and s[j] == '"':
        return Node("string", True, json.loads(s[i - 1:j + 1])), j + 1
    if j < len(s) and not _ESCAPE_START.fullmatch(s, j):
        raise MalformedJSON(f"bad character or escape in a string at {j}")
    body = s[i:j]
    if _HIGH_SURROGATE.fullmatch(body, len(body) - 6) and _escapes(body, len(body) - 6):  # its low half may follow
        body = body[:-6]
    return Node("string", False, json.loads(f'"{body}"')), len(s)


def _escapes(body: str, k: int) -> bool:
    """Whether the backslash at body[k] begins an escape (an even number of backslashes before it)."""
    n = k
    while n > 0 and body[n - 1] == "\\":
        n -= 1
    return (k - n) % 2 == 0


def _parse_object(s: str, i: int, depth: int) -> tuple[Node, int]:
    node = Node("object")
    i = skip_ws(s, i)
    if i < len(s) and s[i] == "}":
        node.complete = True
        return node, i + 1
    while True:
        i = skip_ws(s, i)
        if i == len(s):
            return node, i
        if s[i] != '"':
            raise MalformedJSON(f"expected a key at {i}")
        key, i = _parse_string(s, i + 1)
        if not key.complete:
            return node, i
        i = skip_ws(s, i)
        if i == len(s):
            node.key = key.value
            return node, i
        if s[i] != ":":
            raise MalformedJSON(f"expected ':' at {i}")
        value, i = parse_partial(s, i + 1, depth + 1)
        if value is None:
            node.key = key.value
            return node, i
        node.items.append((key.value, value))
        if not value.complete:
            return node, i
        done, i = _after_item(s, i, node, "}")
        if done:
            return node, i


def _parse_array(s: str, i: int, depth: int) -> tuple[Node, int]:
    node = Node("array")
    i = skip_ws(s, i)
    if i < len(s) and s[i] == "]":
        node.complete = True
        return node, i + 1
    while True:
        value, i = parse_partial(s, i, depth + 1)
        if value is None:
            return node, i
        node.items.append(value)
        if not value.complete:
            return node, i
        done, i = _after_item(s, i, node, "]")
        if done:
            return node, i


def _after_item(s: str, i: int, node: Node, close: str) -> tuple[bool, int]:
    """After a complete item of an object / array: (True, i) at the text's end or past `close` (node complete), else
    (False, the index past the ',')."""
    i = skip_ws(s, i)
    if i == len(s):
        return True, i
    if s[i] == close:
        node.complete = True
        return True, i + 1
    if s[i] != ",":
        raise MalformedJSON(f"expected ',' or '{close}' at {i}")
    return False, i + 1


def _dumps(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def canonical(node: Node | None) -> str:
    """The certain part of `node` written as json.dumps(..., ensure_ascii=False) writes it."""
    if node is None:
        return ""
    if node.kind == "string":
        return _dumps(node.value) if node.complete else _dumps(node.value)[:-1]
    if node.kind in ("number", "literal"):
        return node.value if node.complete else ""
    if node.kind == "object":
        parts = [f"{_dumps(k)}: {canonical(v)}" for k, v in node.items]
        if node.key is not None:  # a key whose value has not begun
            parts.append(f"{_dumps(node.key)}: ")
        return "{" + ", ".join(parts) + ("}" if node.complete else "")
    parts = [canonical(v) for v in node.items]
    return "[" + ", ".join(parts) + ("]" if node.complete else "")
