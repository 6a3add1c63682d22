"""Each tensor-parallel rank holds exactly its slice of every weight, read from the checkpoint as a slice (no
process group needed: parallel_state.layout builds one rank's model here)."""
import pytest
import torch
from gguf import GGUFReader

import graphinfer.models.gguf_loader as gguf_loader
from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import ModelNotFoundError
from graphinfer.model_loader import load_model
from graphinfer.models.gguf_loader import gguf_tensors


def _params(path: str, rank: int, tp: int) -> dict[str, torch.Tensor]:
    with ps.layout(rank, tp):
        model, _ = load_model(path, torch.float32)
    return dict(model.named_parameters())


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_each_rank_holds_its_slice(arch, tiny_checkpoint):
    path, _ = tiny_checkpoint(arch)
    full = _params(path, 0, 1)
    ranks = [_params(path, r, 2) for r in range(2)]
    for name, w in full.items():
        parts = [r[name] for r in ranks]
        if name.endswith(tuple(f"{p}.{t}" for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
                               for t in ("weight", "bias")) + ("embed_tokens.weight", "lm_head.weight")):
            assert torch.equal(torch.cat(parts, 0), w), name  # column parallel / vocab rows
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, 1), w), name  # row parallel
        elif name.endswith("w13_weight"):  # [E, 2I, H]: each rank's gate rows, then its up rows
            gate, up = w.chunk(2, 1)
            for r, p in enumerate(parts):
                assert torch.equal(p, torch.cat([gate.chunk(2, 1)[r], up.chunk(2, 1)[r]], 1)), name
        elif name.endswith("w2_weight"):
            assert torch.equal(torch.cat(parts, 2), w), name
        else:  # norms, the router, o_proj's bias: replicated
            assert all(torch.equal(p, w) for p in parts), name


def test_kv_heads_replicate_and_the_vocab_pads(tmp_path):
    """One KV head at tp 2: both ranks load it whole. A vocabulary of 251 rows: rank 1 holds 125 and a zero row."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import TINY
    LlamaForCausalLM(LlamaConfig(**{**TINY, "num_key_value_heads": 1, "vocab_size": 251})).save_pretrained(tmp_path)
    full = _params(str(tmp_path), 0, 1)
    r0, r1 = _params(str(tmp_path), 0, 2), _params(str(tmp_path), 1, 2)
    k = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(r0[k], full[k]) and torch.equal(r1[k], full[k])
    emb = "model.embed_tokens.weight"
    assert r0[emb].shape == r1[emb].shape == (126, 64)
    assert torch.equal(torch.cat([r0[emb], r1[emb][:125]]), full[emb]) and not r1[emb][125].any()


def test_a_checkpoint_of_other_shapes_is_refused_per_rank(tmp_path, tiny_checkpoint):
    from safetensors.torch import load_file, save_file

    path, _ = tiny_checkpoint("llama")
    state = load_file(f"{path}/model.safetensors")
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(96, 64)
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(open(f"{path}/config.json").read())
    with pytest.raises(ModelNotFoundError, match=r"q_proj.weight' has shape \(96, 64\), the model expects \(32, 64\) per rank"):
        _params(str(tmp_path), 1, 2)


def test_gguf_slices_dequantize_only_their_rows_and_blocks(smollm2_path, monkeypatch):
    """Quantized SmolLM2 tensors (Q4_1 / Q8_0): a row slice dequantizes those rows only, a column slice on block
    boundaries only its blocks, one off them the rows then the columns; all equal the full tensor's slice (llama's
    q / k rows unpermuted per head, which commutes with whole-head slices)."""
    reader = GGUFReader(smollm2_path)
    wanted = {f"model.layers.3.{n}" for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                               "self_attn.o_proj.weight", "mlp.down_proj.weight")}
    wanted.add("model.embed_tokens.weight")
    tensors = {name: t for name, t in gguf_tensors(reader) if name in wanted}
    full = {name: t.read() for name, t in tensors.items()}
    seen = []
    dequantize = gguf_loader.dequantize
    monkeypatch.setattr(gguf_loader, "dequantize", lambda data, qtype: seen.append(data.shape) or dequantize(data, qtype))
    for name, t in tensors.items():
        w = full[name]
        for dim, parts in ((0, 3), (1, 3)):
            if dim == 1 and w.shape[1] == 49152:
                continue
            n = w.shape[dim] // parts
            for i in range(parts):
                seen.clear()
                assert torch.equal(t.read(dim, i * n, n), w.narrow(dim, i * n, n)), (name, dim, i)
                rows, width = seen[0]
                bytes_per_row = t.t.data.shape[1]
                assert (rows, width) == ((n, bytes_per_row) if dim == 0 else (w.shape[0], bytes_per_row // parts))
    seen.clear()
    o = tensors["model.layers.3.self_attn.o_proj.weight"]
    assert torch.equal(o.read(1, 8, 40), full[o.name].narrow(1, 8, 40)) and seen[0][1] == o.t.data.shape[1]
