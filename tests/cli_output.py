"""Parse what `graphinfer generate` prints, so tests compare its outputs exactly instead of searching stdout.

Per prompt:  --- prompt: 'P'\\nTEXT\\n--- [N tokens, finish_reason=R]  then, with --logprobs, one line per token:
  'tok': -1.2345
"""
import ast
import re

_BLOCK = re.compile(r"--- prompt: (?P<prompt>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\n(?P<text>.*?)\n"
                    r"--- \[(?P<n>\d+) tokens, finish_reason=(?P<reason>\w+)\]\n(?P<logprobs>(?:  [^\n]*: -?(?:[\d.]+|inf)\n)*)",
                    re.S)


def parse_generate(stdout: str) -> list[dict]:
    """[{prompt, text, num_tokens, finish_reason, logprobs: [(decoded token, logprob)]}] in printed order; the
    blocks must cover all of stdout before an optional pass report."""
    out, pos = [], 0
    for m in _BLOCK.finditer(stdout):
        assert m.start() == pos, f"unparsed output before a prompt block: {stdout[pos:m.start()]!r}"
        pos = m.end()
        lps = [line.strip().rsplit(": ", 1) for line in m["logprobs"].splitlines()]
        out.append(dict(prompt=ast.literal_eval(m["prompt"]), text=m["text"], num_tokens=int(m["n"]),
                        finish_reason=m["reason"], logprobs=[(ast.literal_eval(t), float(v)) for t, v in lps]))
    rest = stdout[pos:]
    assert not rest.strip() or rest.lstrip().startswith("## Pass report"), f"unparsed output: {rest!r}"
    return out


def expected_blocks(prompts: list[str], outputs) -> list[dict]:
    """What parse_generate should give for these prompts and RequestOutputs (of an engine run in this process)."""
    blocks = []
    for p, o in zip(prompts, outputs):
        c = o.outputs[0]
        lps = [(e[t].decoded_token, round(e[t].logprob, 4)) for t, e in zip(c.token_ids, c.logprobs)] if c.logprobs else []
        blocks.append(dict(prompt=p, text=c.text, num_tokens=len(c.token_ids), finish_reason=c.finish_reason,
                           logprobs=lps))
    return blocks
