"""PEFT adapters for the LoRA tests, made by peft itself on a transformers model (the reference nobody here wrote)."""
import copy

import torch


def make_peft_adapter(hf, out_dir: str, seed: int, **lora_kwargs):
    """Save a random LoRA adapter of hf (LoraConfig(**lora_kwargs), non-zero B, scaled x4 so that it changes greedy
    tokens) to out_dir; returns hf with it merged by peft (merge_and_unload: W + scaling B A), in eval mode."""
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():  # peft's random B is small
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    peft_model.save_pretrained(out_dir)
    return PeftModel.from_pretrained(copy.deepcopy(hf), out_dir).merge_and_unload().eval()
