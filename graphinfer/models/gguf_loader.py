"""Load a llama.cpp GGUF file (config, weights, tokenizer) with HF names, using the `gguf` package directly.

Weights are dequantized by gguf.quants (numpy) rather than transformers' GGUF path, which builds a whole HF
model first; the result is bit-identical to it (tests/test_gguf_loader.py checks every tensor). A tensor-parallel
rank dequantizes only its slices (GGUFTensor).
"""
import hashlib
import os
import re
import shutil
import tempfile

import numpy as np
import torch
import transformers
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf.quants import dequantize

from graphinfer.config import cache_dir
from graphinfer.errors import UnsupportedArchitectureError
from graphinfer.models.checkpoint_tensor import CheckpointTensor

_ARCHS = {  # general.architecture -> (transformers config class name, HF architectures entry)
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _arch(reader: GGUFReader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported by graphinfer. "
            f"Supported GGUF architectures: {', '.join(_ARCHS)}.")
    return arch


def _heads(reader: GGUFReader, arch: str) -> tuple[int, int]:
    n_head = _field(reader, f"{arch}.attention.head_count")
    return n_head, _field(reader, f"{arch}.attention.head_count_kv", n_head)


class FastGGUFReader(GGUFReader):
    """gguf's reader with its metadata parsed faster (seconds a SmolLM2 load): _get slices a plain ndarray view of the
    file instead of the np.memmap itself, whose every slice runs memmap's __array_finalize__ (and np.empty for an item
    size), for each of the ~100k strings of the token and merge arrays. Same parts, dtypes and tensors
    (tests/test_gguf_loader.py compares them); gguf is pinned (requirements.txt)."""

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        dtype, count = np.dtype(dtype), int(count)
        arr = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr if order == "I" else arr.view(dtype.newbyteorder(order))


def _open(src: "str | GGUFReader") -> GGUFReader:
    # Parsing the metadata (the 49k-entry token arrays) costs a second: callers may pass one open reader.
    return src if isinstance(src, GGUFReader) else FastGGUFReader(src)


def load_gguf_config(src: "str | GGUFReader") -> transformers.PretrainedConfig:
    """The transformers config (LlamaConfig / Qwen2Config / Qwen3Config) described by the GGUF metadata."""
    reader = _open(src)
    arch = _arch(reader)

    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    # Scaled RoPE (linear/yarn/...) would need rope_parameters we do not build; refuse rather than run wrong.
    scaling = meta("rope.scaling.type", "none")
    if scaling != "none":
        raise UnsupportedArchitectureError(f"GGUF rope scaling {scaling!r} is not supported; only unscaled RoPE is.")
    hidden = meta("embedding_length")
    n_head, n_kv = _heads(reader, arch)
    config_cls, hf_arch = _ARCHS[arch]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    embd_rows = next((int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight"), None)
    kwargs = dict(
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=meta("attention.key_length", hidden // n_head),
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon"),  # stored as f32, kept as is (HF does the same)
        rope_parameters={"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 10000.0))},
        max_position_embeddings=meta("context_length"),
        vocab_size=meta("vocab_size") or (len(tokens.data) if tokens is not None else embd_rows),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        architectures=[hf_arch],
    )
    # No attention_bias for qwen2, as in HF's own Qwen2 configs: Qwen2 always has q/k/v biases and never an
    # o_proj bias, while attention_bias=True would mean an o_proj bias to modelling code that reads it.
    return getattr(transformers, config_cls)(**kwargs)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp's convert interleaves each head's rows for its rotary layout:
    #   w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape); this is its inverse.
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFTensor(CheckpointTensor):
    """One GGUF tensor in torch's layout, dequantized as it is read: a slice of rows dequantizes only those
    rows, a slice of columns only its quant blocks where it starts and ends on block boundaries (a
    row-parallel shard of a matrix whose width is a multiple of tp x the block size)."""

    def __init__(self, t, name: str, n_head: int | None = None):
        self.t, self.name, self.n_head = t, name, n_head  # n_head: llama's q / k rows to unpermute
        self.shape = tuple(reversed(t.shape.tolist()))

    def _dequantize(self, data) -> np.ndarray:
        try:
            out = dequantize(data, self.t.tensor_type)
        except NotImplementedError:
            raise UnsupportedArchitectureError(
                f"GGUF tensor {self.t.name!r} has type {self.t.tensor_type.name}, which the installed gguf package "
                f"cannot dequantize; use a GGUF quantized to e.g. Q8_0, Q4_K or F16.") from None
        return out if out.flags.writeable else out.copy()  # F32 comes back as a view of the read-only mmap

    def read(self, dim=None, start=0, length=None) -> torch.Tensor:
        data, shape = self.t.data, list(self.shape)  # data: [rows, bytes of a row] for quantized types
        heads = self.n_head
        if dim is not None:
            shape[dim] = length
        if dim == 0:
            data = data[start:start + length]
            heads = heads and heads * length // self.shape[0]  # whole heads: unpermuting commutes with the slice
        w = None
        if dim == 1:
            block, type_size = GGML_QUANT_SIZES[self.t.tensor_type]
            if data.dtype != np.uint8:  # F32 / F16: elements, not bytes
                block, type_size = 1, 1
            if start % block == 0 and length % block == 0:
                data = data[:, start // block * type_size:(start + length) // block * type_size]
            else:  # not on block boundaries: the whole rows, then the columns
                w = torch.from_numpy(self._dequantize(data)).reshape(self.shape).narrow(1, start, length)
        if w is None:
            w = torch.from_numpy(self._dequantize(data)).reshape(shape)
        return _unpermute(w, heads) if heads else w


def gguf_tensors(src: "str | GGUFReader"):
    """(HF name, GGUFTensor) for every tensor of the file (no lm_head when tied); nothing is read yet."""
    reader = _open(src)  # memory-maps the file
    arch = _arch(reader)
    n_head, n_kv = _heads(reader, arch)
    for t in reader.tensors:
        if t.name in _GLOBAL_NAMES:
            name, kind = _GLOBAL_NAMES[t.name], None
        elif (m := _BLOCK_RE.fullmatch(t.name)) and m[2] in _BLOCK_NAMES:
            name, kind = f"model.layers.{m[1]}.{_BLOCK_NAMES[m[2]]}.{m[3]}", m[2]
        else:  # e.g. llama3's rope_freqs: silently dropping it would give a wrong model
            raise UnsupportedArchitectureError(f"GGUF tensor {t.name!r} in {reader.data.filename} has no graphinfer equivalent.")
        heads = (n_head if kind == "attn_q" else n_kv) if arch == "llama" and kind in ("attn_q", "attn_k") else None
        yield name, GGUFTensor(t, name, heads)


def load_gguf_state_dict(src: "str | GGUFReader", dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every GGUF tensor dequantized, in torch shape and `dtype`, under its HF name (no lm_head when tied)."""
    return {name: t.read().to(dtype) for name, t in gguf_tensors(src)}


def _tokenizer_cache_dir(path: str) -> str:
    path = os.path.abspath(path)
    st = os.stat(path)
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:24]
    return os.path.join(cache_dir(), "tokenizers", key)


def load_gguf_tokenizer(path: str) -> transformers.PreTrainedTokenizerBase:
    """The HF fast tokenizer of a GGUF, with bos/eos/pad taken from the GGUF metadata; cached on disk."""
    AutoTokenizer = transformers.AutoTokenizer
    cache = _tokenizer_cache_dir(path)
    if os.path.isfile(os.path.join(cache, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(cache)
    directory, name = os.path.split(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)  # the slow (~10 s) GGUF -> tokenizers conversion
    # transformers' converter takes eos from the bos id (eos=1, <|im_start|> for SmolLM2) and sets no pad;
    # the GGUF metadata is authoritative.
    reader = GGUFReader(path)
    for attr, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id")):
        token_id = _field(reader, f"tokenizer.ggml.{key}")
        if token_id is not None:
            setattr(tok, attr, tok.convert_ids_to_tokens(int(token_id)))
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        tok.chat_template = template
    # Write to a temp dir and rename, so a concurrent or interrupted save never leaves a half cache behind.
    tmp = None
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cache), prefix=".tmp-")
        tok.save_pretrained(tmp)
        os.rename(tmp, cache)
    except OSError:  # another process won the race (the cache exists now) or the cache dir is not writable
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok
