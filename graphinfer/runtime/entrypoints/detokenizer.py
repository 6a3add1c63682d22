"""Incremental detokenisation and stop-string matching.

IncrementalDetokenizer is vLLM's prefix_offset/read_offset algorithm, run on token ids through the Rust
tokenizer's own decode (not convert_ids_to_tokens): that is what `tokenizer.decode` runs, so skipped special
tokens, byte-level merging and decoder quirks come out identical to a full decode.
"""

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output, as vLLM, so decoders see the left context


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self._tok = getattr(tokenizer, "backend_tokenizer", tokenizer)  # the tokenizers.Tokenizer of an HF fast one
        self._skip = skip_special_tokens
        self._ids = self._context(list(prompt_token_ids))
        self._prefix_offset = 0  # ids[prefix:read] is already-emitted text, decoded again only as left context
        self._read_offset = len(self._ids)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _context(self, prompt: list[int]) -> list[int]:
        # The context must decode cleanly: a multi-byte char cut at its start or end would turn into U+FFFD
        # and shift the text. Widen to get a clean start; a prompt ending mid-char gets no context at all.
        for n in range(min(_CONTEXT_TOKENS, len(prompt)), min(len(prompt), 4 * _CONTEXT_TOKENS) + 1):
            ctx = prompt[len(prompt) - n:]
            if _REPLACEMENT not in self._decode(ctx):
                return ctx
        return []

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the newly final text ("" while a multi-byte char is incomplete)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit any held-back text (an incomplete trailing char decodes to U+FFFD, as in a full decode).

        Call once the sequence has finished; afterwards output_text == tokenizer.decode(output_ids).
        """
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        # Hold back while the tail may be an unfinished UTF-8 sequence (byte-level / byte-fallback tokens).
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.output_text += delta
        return delta


def find_stop_string(
    text: str, new_chars: int, stop_strings: list[str], include_stop_str_in_output: bool
) -> tuple[str, str] | None:
    """Find the earliest stop string in `text` that overlaps its last `new_chars` characters.

    Returns (text truncated before the stop string, or after it when include_stop_str_in_output, the stop
    string), or None. Only the tail that can hold such an overlap is searched.
    """
    if new_chars <= 0 or not stop_strings:
        return None
    best = None
    for stop in stop_strings:
        # A match must end inside the new chars, so it starts at or after this.
        i = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    if best is None:
        return None
    i, stop = best
    return text[: i + len(stop) if include_stop_str_in_output else i], stop
