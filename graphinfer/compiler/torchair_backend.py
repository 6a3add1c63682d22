"""Optional Ascend compiler: hand the fused fx GraphModule to torchair (`--npu-compiler torchair`).

torchair ships inside torch_npu (`import torchair` works once torch_npu is imported; newer stacks also have
the standalone `npugraph_ex` package). Its ACL-graph modes capture the graph themselves, one NPUGraph per
input shape, and patch the host lengths of the torch_npu attention ops they recognise:
  "npugraph_ex"      the current ACL-graph mode (CompilerConfig.mode = "npugraph_ex" / npugraph_ex backend);
  "reduce-overhead"  the older ACL-graph mode it replaces (vllm-ascend's legacy settings).
GE mode ("max-autotune") is not offered: it converts every op to Ascend IR, and graphinfer:: custom ops have
no converter. Inside graphinfer::paged_attention torchair cannot see FIA's host lengths, so with torchair keep
attention on the Triton kernel (the npu default) rather than kernels="torch_npu": compile_with_torchair refuses
that combination. Run it with graph_mode NONE: torchair captures, graphinfer's DecodeGraphs does not.
Not run on NPU hardware by this project.
"""
import torch
from torch import fx

from graphinfer.errors import InvalidConfigError

TORCHAIR_MODES = ("npugraph_ex", "reduce-overhead")


def _backend(mode: str):
    try:
        import torch_npu  # registers torch.npu and the lazy `torchair` module
    except Exception as e:
        raise InvalidConfigError(f"--npu-compiler torchair needs torch_npu with CANN ({type(e).__name__}: {e}); see "
                                 f"docs/ascend.md, or drop --npu-compiler.") from e
    torch_npu.npu.set_compile_mode(jit_compile=False)  # binary kernels, as vllm-ascend and torchair's docs use
    if mode == "npugraph_ex":
        try:  # the standalone package of newer stacks (vllm-ascend prefers it)
            import npugraph_ex

            return npugraph_ex.get_npu_backend(compiler_config=npugraph_ex.CompilerConfig())
        except ImportError:
            pass
    try:
        import torchair
    except ImportError as e:
        raise InvalidConfigError(f"--npu-compiler torchair: torchair is missing ({e}). It comes with torch_npu "
                                 f"builds that include it (docs/ascend.md lists a matching set); or drop "
                                 f"--npu-compiler.") from e
    config = torchair.CompilerConfig()
    config.mode = mode
    if mode == "reduce-overhead":  # vllm-ascend's legacy aclgraph settings: keep our in-place cache writes as written
        config.debug.aclgraph.disable_reinplace_inplaceable_ops_pass = True
    return torchair.get_npu_backend(compiler_config=config)


def compile_with_torchair(gm: fx.GraphModule, mode: str = "npugraph_ex", kernels: dict[str, str] | None = None,
                          dynamic: bool = True):
    """torch.compile(gm) with torchair's NPU backend in an ACL-graph `mode` (see TORCHAIR_MODES).

    kernels: the active platform's op -> implementation-module report (Platform.kernels), to refuse FIA attention.
    dynamic: one compiled graph for all token counts (torchair still captures one NPUGraph per shape)."""
    if mode not in TORCHAIR_MODES:
        raise InvalidConfigError(f"torchair mode {mode!r}: use one of {', '.join(TORCHAIR_MODES)}.")
    if kernels and kernels.get("paged_attention") == "graphinfer.ops.npu.ops":
        raise InvalidConfigError("torchair cannot patch the host lengths of the torch_npu (FIA) attention inside "
                                 "graphinfer::paged_attention; use the default kernels (Triton attention) or "
                                 "kernels='torch_npu,paged_attention=triton' with --npu-compiler torchair.")
    return torch.compile(gm, backend=_backend(mode), dynamic=dynamic, fullgraph=True)
