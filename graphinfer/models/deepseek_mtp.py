"""DeepSeek-V3's multi-token prediction (MTP) layer as a draft model (vLLM's DeepSeekMTP), written plainly like
transformers' MtpLayer.

A checkpoint with num_nextn_predict_layers > 0 holds the layer as model.layers.<L>.* (L = num_hidden_layers): enorm,
hnorm, eh_proj [H, 2H], a whole decoder layer (MLA + DeepSeekMoE: MTP layers are MoE whatever first_k_dense_replace
says, as transformers' get_mtp_config and vLLM build them), shared_head.norm, shared_head.head and embed_tokens. One
draft step:

    h' = layer(eh_proj(cat(enorm(embed(next_token)), hnorm(previous_hidden))))      forward
    logits = shared_head.head(shared_head.norm(h'))                                  compute_logits

previous_hidden is, for the first step, the target's hidden state AFTER its final norm at the position before
next_token's (what the target's forward returns; transformers' MtpModel reads the same state), and for a further
step the previous step's h' (pre-norm, as vLLM chains it). vLLM zeroes the embedding at position 0; transformers does
not, and neither does this module (its tests compare with transformers' MTP logits).

The embedding and head are the target's modules when the checkpoint's copies are absent or equal to them (DeepSeek
ships copies of both; vLLM shares them the same way), so they cost no memory. Checkpoints with several MTP layers
(none shipped so far): only the first is read, and every step reuses it, as vLLM's proposer does.
"""
import torch
from torch import Tensor, nn

from graphinfer.errors import InvalidConfigError, ModelNotFoundError
from graphinfer.models.checkpoint_tensor import as_checkpoint_tensor
from graphinfer.models.deepseek_v2 import DeepseekV2Attention, DeepseekV2MoE
from graphinfer.models.layers import AttentionMetadata, RMSNorm, init_buffers
from graphinfer.models.llama import LlamaDecoderLayer, LlamaMLP
from graphinfer.models.loader import _safetensors_weights, _skip_init, load_weights
from graphinfer.models.parallel_layers import ParallelLMHead, VocabParallelEmbedding, num_experts

MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM",)  # what transformers builds an MtpModel for; DeepSeek-V2 ships none
_OWN = ("enorm", "hnorm", "eh_proj", "shared_head")  # the MTP layer's tensors beside its decoder layer's
_SHARED = ("embed_tokens", "shared_head.head")  # copies of the target's embedding / LM head in DeepSeek's checkpoints


class SharedHead(nn.Module):
    """shared_head.norm and shared_head.head (head: the target's LM head module when shared)."""

    def __init__(self, config):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head: nn.Module | None = None  # set by load_deepseek_mtp


class DeepSeekMultiTokenPredictorLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        H = config.hidden_size
        self.enorm = RMSNorm(H, config.rms_norm_eps)
        self.hnorm = RMSNorm(H, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.shared_head = SharedHead(config)
        mlp = DeepseekV2MoE(config, v3=True) if num_experts(config) else LlamaMLP(config)
        self.mtp_block = LlamaDecoderLayer(config, DeepseekV2Attention(config), mlp)

    def forward(self, inputs_embeds: Tensor, positions: Tensor, previous_hidden_states: Tensor,
                md: AttentionMetadata) -> Tensor:
        x = torch.cat((self.enorm(inputs_embeds), self.hnorm(previous_hidden_states)), dim=-1)
        return self.mtp_block(positions, self.eh_proj(x), md)


class DeepSeekMTP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.mtp_start_layer_idx = config.num_hidden_layers
        self.embed_tokens: nn.Module | None = None  # set by load_deepseek_mtp
        self.layers = nn.ModuleDict({str(self.mtp_start_layer_idx): DeepSeekMultiTokenPredictorLayer(config)})

    @property
    def layer(self) -> DeepSeekMultiTokenPredictorLayer:
        return self.layers[str(self.mtp_start_layer_idx)]

    def forward(self, input_ids: Tensor, positions: Tensor, previous_hidden_states: Tensor,
                md: AttentionMetadata) -> Tensor:
        """input_ids, positions [T], previous_hidden_states [T, H] -> the layer's output h' [T, H] (pre-norm)."""
        return self.layer(self.embed_tokens(input_ids), positions, previous_hidden_states, md)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        head = self.layer.shared_head
        return head.head(head.norm(hidden_states))


def num_mtp_layers(config) -> int:
    return getattr(config, "num_nextn_predict_layers", 0) or 0


def check_mtp_config(config, what: str) -> None:
    """Refuse a model without an MTP layer graphinfer can run, saying what would work (what: the model's name)."""
    archs = getattr(config, "architectures", None) or []
    if not any(a in MTP_ARCHITECTURES for a in archs):
        raise InvalidConfigError(
            f"speculative_config method 'mtp' drafts with a DeepSeek-V3 checkpoint's own MTP layers; {what} is "
            f"{archs or 'of unknown architecture'}. Use method 'ngram' or a draft model ({{\"model\": DRAFT}}).")
    if num_mtp_layers(config) < 1:
        raise InvalidConfigError(
            f"speculative_config method 'mtp': {what} has no MTP layers (num_nextn_predict_layers = "
            f"{num_mtp_layers(config)}; its checkpoint holds no model.layers.{config.num_hidden_layers}.*). Use a "
            f"checkpoint that ships them (DeepSeek-V3 / R1 do), method 'ngram', or a draft model.")


def mtp_parameter(name: str, layer: int) -> str | None:
    """The DeepSeekMTP parameter a checkpoint tensor loads into (vLLM's _rewrite_spec_layer_name: the decoder layer's
    tensors under mtp_block), or None: not the MTP layer's."""
    prefix = f"model.layers.{layer}."
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    if rest.startswith("embed_tokens."):
        return rest
    if rest.split(".")[0] in _OWN:
        return f"layers.{layer}.{rest}"
    return f"layers.{layer}.mtp_block.{rest}"


@torch.no_grad()
def load_deepseek_mtp(path: str, config, target: nn.Module, dtype: torch.dtype, device) -> DeepSeekMTP:
    """The MTP layer of the checkpoint directory `path` (config: its config) beside the loaded target model, whose
    embedding and LM head it shares where the checkpoint's copies equal them."""
    check_mtp_config(config, "this checkpoint")
    L = config.num_hidden_layers
    with torch.device("meta"), _skip_init():
        model = DeepSeekMTP(config)
    model.to_empty(device=device).to(dtype)
    init_buffers(model, device)
    copies, found = {}, []

    def own_weights():  # streamed: each file closes once its tensors are read
        for name, tensor in _safetensors_weights(path):
            if (param := mtp_parameter(name, L)) is None:
                continue
            found.append(name)
            shared = next((s for s in _SHARED if param in (f"{s}.weight", f"layers.{L}.{s}.weight")), None)
            if shared is not None:
                copies[shared] = as_checkpoint_tensor(tensor).read()
            else:
                yield param, tensor

    try:
        load_weights(model, own_weights(), tied=False)
    except ModelNotFoundError:
        if not found:
            raise ModelNotFoundError(f"The checkpoint has no model.layers.{L}.* tensors, though its config declares "
                                     f"num_nextn_predict_layers = {num_mtp_layers(config)}.") from None
        raise
    model.embed_tokens = _shared_or_own(copies.get("embed_tokens"), target.model.embed_tokens, dtype, device,
                                        lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size))
    model.layer.shared_head.head = _shared_or_own(copies.get("shared_head.head"), target.lm_head, dtype, device,
                                                  lambda: ParallelLMHead(config.hidden_size, config.vocab_size))
    return model.eval()


def _shared_or_own(copy: Tensor | None, target_module: nn.Module, dtype, device, make) -> nn.Module:
    """The target's module when the checkpoint has no copy or an equal one, else a module holding the copy."""
    if copy is None:
        return target_module
    value = copy.to(device=device, dtype=dtype)
    weight = getattr(target_module, "weight", None)
    if weight is not None and weight.shape == value.shape and torch.equal(weight, value):
        return target_module
    with torch.device("meta"), _skip_init():
        module = make()
    module.to_empty(device=device).to(dtype)
    module.weight_loader("weight", module.weight, as_checkpoint_tensor(value), "embed/head copy")
    return module
