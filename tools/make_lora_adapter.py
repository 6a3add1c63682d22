#!/usr/bin/env python
"""Write a PEFT LoRA adapter with random weights for a model graphinfer loads: no hub, no training.

    python tools/make_lora_adapter.py MODEL OUT --rank R [--alpha A] [--targets q_proj,v_proj,...] [--seed S]
        [--dtype float32|bfloat16|float16] [--count N]

MODEL: an HF checkpoint dir, a .gguf (e.g. the bundled SmolLM2; "" picks it), or a preset name (qwen3-0.6b,
tiny-llama, ...). OUT gets what PEFT's save_pretrained writes for a LoRA adapter: adapter_config.json and
adapter_model.safetensors with `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r] for every
targeted projection (HF's module paths: model.layers.N.self_attn.q_proj, model.layers.N.mlp.down_proj, ...).

The modules and their shapes come from graphinfer's own model of MODEL (built on the meta device from its config, no
weights read): every Linear whose name is one of --targets (default: the seven projections graphinfer's lora pass
adapts), MoE experts excepted (no LoRA on them). The weights are drawn as PEFT's init_lora_weights=False does
(kaiming-uniform with a=sqrt(5): A ~ U(+-1/sqrt(in)), B ~ U(+-1/sqrt(r))), so the adapter changes the model's outputs
(PEFT's default B = 0 would not). --alpha defaults to the rank (scaling alpha / r = 1). For benchmarks and tests only:
the adapter means nothing.

--count N writes N adapters (seeds S, S+1, ...) to OUT/lora-1 ... OUT/lora-N in one process (the model's shapes read
once) and prints them as `--lora-modules` arguments (lora-1=OUT/lora-1 ...) for `graphinfer bench throughput`.
"""
import argparse
import json
import math
import os
import sys

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PREFIX = "base_model.model."


def target_shapes(model: str, targets=TARGETS) -> dict[str, tuple[int, int]]:
    """module path -> (in_features, out_features) of MODEL's Linears named one of `targets` (graphinfer's model of it,
    on the meta device; MoE experts left out). Raises ValueError when a target matches nothing."""
    import torch

    from graphinfer.models.loader import load_config, meta_model

    config = load_config(model)
    shapes = {}
    for name, module in meta_model(config).named_modules():
        leaf = name.rpartition(".")[2]
        if leaf in targets and isinstance(module, torch.nn.Linear) and ".experts." not in name:
            shapes[name] = (module.in_features, module.out_features)
    missing = [t for t in targets if not any(n.rpartition(".")[2] == t for n in shapes)]
    if missing:
        raise ValueError(f"{model or 'the bundled model'}: no Linear named {', '.join(missing)} (MoE experts are not "
                         f"adapted); its targetable projections are {sorted({n.rpartition('.')[2] for n in shapes})}")
    return shapes


def make_adapter(model: str, out: str, rank: int, alpha: float | None = None, targets=TARGETS, seed: int = 0,
                 dtype: str = "float32", shapes: dict | None = None) -> dict:
    """Write the adapter to `out`; returns its adapter_config. shapes: target_shapes(model, targets), if known."""
    import torch
    from safetensors.torch import save_file

    if rank < 1:
        raise ValueError(f"--rank {rank}: must be >= 1")
    model = model or _bundled()
    targets = list(dict.fromkeys(targets))
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise ValueError(f"--targets {', '.join(bad)}: graphinfer adapts only {', '.join(TARGETS)}")
    shapes = shapes or target_shapes(model, targets)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, (fan_in, fan_out) in sorted(shapes.items()):
        a = (torch.rand(rank, fan_in, generator=gen) * 2 - 1) / math.sqrt(fan_in)
        b = (torch.rand(fan_out, rank, generator=gen) * 2 - 1) / math.sqrt(rank)
        tensors[f"{PREFIX}{path}.lora_A.weight"] = a.to(getattr(torch, dtype)).contiguous()
        tensors[f"{PREFIX}{path}.lora_B.weight"] = b.to(getattr(torch, dtype)).contiguous()
    config = {  # the fields PEFT's LoraConfig.save_pretrained writes that matter here; PEFT fills the rest
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": model, "revision": None,
        "r": rank, "lora_alpha": alpha if alpha is not None else rank, "lora_dropout": 0.0,
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": False, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True,
    }
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
    return config


def _bundled() -> str:
    from graphinfer.config import bundled_model_path

    return bundled_model_path()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help='HF checkpoint dir, .gguf, or preset name ("": the bundled SmolLM2)')
    p.add_argument("out", help="directory to write the adapter to")
    p.add_argument("--rank", "-r", type=int, required=True)
    p.add_argument("--alpha", type=float, default=None, help="lora_alpha (default: the rank, scaling 1)")
    p.add_argument("--targets", default=",".join(TARGETS),
                   help="comma-separated projections (default: all seven)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--count", type=int, default=1, help="N > 1: N adapters OUT/lora-1..N, seeds S..S+N-1")
    args = p.parse_args(argv)
    alpha = int(args.alpha) if args.alpha is not None and args.alpha == int(args.alpha) else args.alpha
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    model = args.model or _bundled()
    outs = [args.out] if args.count <= 1 else [os.path.join(args.out, f"lora-{i}") for i in range(1, args.count + 1)]
    try:
        shapes = target_shapes(model, targets) if set(targets) <= set(TARGETS) else None
        for i, out in enumerate(outs):
            config = make_adapter(model, out, args.rank, alpha, targets, args.seed + i, args.dtype, shapes)
            print(f"wrote {out}: rank {config['r']}, alpha {config['lora_alpha']}, "
                  f"{', '.join(config['target_modules'])} (seed {args.seed + i}, {args.dtype})", file=sys.stderr)
    except ValueError as e:
        print(f"make_lora_adapter: error: {e}", file=sys.stderr)
        return 2
    if args.count > 1:  # stdout: the bench's --lora-modules arguments
        print(" ".join(f"{os.path.basename(o)}={o}" for o in outs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
