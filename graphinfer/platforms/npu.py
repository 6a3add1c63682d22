"""Ascend NPU: torch.npu devices and streams, ACL graphs (torch.npu.NPUGraph), HCCL, torch_npu fused ops.

torch_npu is imported only once this platform is used (activate(), or its device module), never by
detection: is_available() looks for the package and a sourced CANN toolkit without importing it. That
matters because torch >= 2.5 autoloads device backends at `import torch` (entry point group
torch.backends): with torch_npu installed but CANN not sourced, `import torch` itself fails unless
TORCH_DEVICE_BACKEND_AUTOLOAD=0; graphinfer then still loads torch_npu explicitly when npu is selected.

Kernels (CompileConfig.kernels / --kernels): None = torch_npu fused ops for every op they cover except
paged_attention and mla_latent_attention, which stay the Triton kernels (Triton-Ascend): they read their lengths on
device, so plain capture works; lora_shrink / lora_expand run their Triton kernels too (torch_npu has no LoRA op). "torch_npu" puts attention on FIA too (FULL_DECODE_ONLY then patches FIA's host lengths
before each replay, see graphinfer.ops.npu.ops.FiaGraphParams); "triton"; "reference"; or per-op overrides:
"torch_npu,paged_attention=triton", "rms_norm=triton". The sampler uses the fused Triton sampling kernel
whenever some op runs on Triton (the default), see Sampler.
Not run on NPU hardware by this project: written against the documented torch_npu APIs (docs/ascend.md).
"""
import contextlib
import importlib.util
import os
from collections.abc import Callable

import numpy as np

from graphinfer.errors import InvalidConfigError
from graphinfer.platforms.interface import Platform

CANN_ENV_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")  # set by CANN's set_env.sh
KERNEL_CHOICES = ("torch_npu", "triton", "reference")
# Attention stays on the Triton kernels by default: they read the lengths on device (plain capture works), and
# mla_latent_attention's FIA mapping is unverified (docs/ascend.md, MLA). The LoRA ops run Triton-Ascend by default:
# torch_npu has no LoRA op (vllm-ascend's are AscendC kernels of its own).
DEFAULT_TRITON_OPS = ("paged_attention", "mla_latent_attention", "lora_shrink", "lora_expand")


def import_torch_npu():
    """Import torch_npu (registers the "npu" device, torch.npu and the "hccl" backend) with a clear error."""
    try:
        import torch_npu
    except Exception as e:  # ImportError, or OSError / RuntimeError from missing CANN libraries
        raise InvalidConfigError(
            f"The npu platform needs torch_npu with a matching CANN toolkit ({type(e).__name__}: {e}). Install the "
            f"versions in docs/ascend.md and `source <CANN>/set_env.sh`, or pick another device.") from e
    return torch_npu


def _all_ops() -> tuple[str, ...]:
    import graphinfer.ops

    return tuple(graphinfer.ops.__all__)


def _triton_ops() -> dict:
    try:
        from graphinfer.ops.triton import TRITON_OPS
    except ImportError as e:
        raise InvalidConfigError(f"These kernels use Triton kernels (Triton-Ascend on npu), which do not import ({e}); "
                                 f"install triton-ascend (docs/ascend.md) or use kernels='torch_npu'.") from e
    return TRITON_OPS


def parse_kernels(spec: str | None, npu_ops: tuple[str, ...], triton_ops: Callable = _triton_ops) -> dict[str, str]:
    """CompileConfig.kernels -> {op: "torch_npu" | "triton"} (ops left out run the reference).

    spec: None (default), one base choice, and/or comma-separated per-op overrides "op=choice"."""
    ops = _all_ops()
    base, overrides = None, {}
    for item in [s.strip() for s in (spec or "").split(",") if s.strip()]:
        name, sep, choice = item.partition("=")
        name, choice = (name.strip(), choice.strip()) if sep else (None, name.strip())
        if choice not in KERNEL_CHOICES:
            raise InvalidConfigError(f"kernels={spec!r}: unknown kernel choice {choice!r}; use one of "
                                     f"{', '.join(KERNEL_CHOICES)}, optionally with per-op overrides like "
                                     f"'torch_npu,paged_attention=triton'.")
        if name is None:
            if base is not None:
                raise InvalidConfigError(f"kernels={spec!r}: give one base choice ({base!r} or {choice!r}), "
                                         f"then per-op overrides op=choice.")
            base = choice
        elif name not in ops:
            raise InvalidConfigError(f"kernels={spec!r}: unknown op {name!r}; graphinfer ops: {', '.join(ops)}.")
        else:
            overrides[name] = choice
    if base is None:  # the default: torch_npu fused ops, attention on the Triton kernel (device-side lengths)
        chosen = {op: "torch_npu" for op in npu_ops} | {op: "triton" for op in DEFAULT_TRITON_OPS}
    elif base == "reference":
        chosen = {}
    else:
        available = npu_ops if base == "torch_npu" else tuple(triton_ops())
        chosen = {op: base for op in available}
    for op, choice in overrides.items():
        chosen.pop(op, None)
        if choice == "reference":
            continue
        available = npu_ops if choice == "torch_npu" else tuple(triton_ops())
        if op not in available:
            raise InvalidConfigError(f"kernels={spec!r}: {op} has no {choice} implementation; choices for {op}: "
                                     f"{', '.join(_choices_for(op, npu_ops, triton_ops))}.")
        chosen[op] = choice
    return chosen


def _choices_for(op: str, npu_ops: tuple[str, ...], triton_ops: Callable) -> list[str]:
    try:
        has_triton = op in triton_ops()
    except InvalidConfigError:
        has_triton = False
    return [c for c, ok in (("torch_npu", op in npu_ops), ("triton", has_triton), ("reference", True)) if ok]


class NpuPlatform(Platform):
    name = "npu"
    device_type = "npu"
    dispatch_key = "PrivateUse1"  # torch_npu's device registers as the PrivateUse1 backend
    dist_backend = "hccl"  # registered with torch.distributed by `import torch_npu`
    supports_graph_capture = True
    # vllm-ascend's budget: ~2048 streams, 1,800 usable for graphs; a piecewise size costs a graph per piece.
    max_capture_graphs = 1800
    mc2_group = True  # ep_dispatch / ep_combine run MC2 ops, which need an HCCL communicator of their own

    def __init__(self, torch_npu=None):
        """torch_npu: the module to call (tests pass tests/npu_emulation.py); None: import it on first use."""
        super().__init__()
        self._torch_npu = torch_npu
        self._ops = None

    @classmethod
    def is_available(cls) -> bool:
        return importlib.util.find_spec("torch_npu") is not None and any(os.environ.get(v) for v in CANN_ENV_VARS)

    def capture_budget(self, comm_groups: int, graphs_per_size: int) -> int | None:
        """HCCL's collectives take streams inside the graphs too (vllm-ascend's update_aclgraph_sizes): with
        HCCL_OP_EXPANSION_MODE=AIV each group adds one stream per graph and a reserve of one size; by default
        (FFTS+ / AICPU unfolding) up to two per group and 40 streams per group."""
        budget = self.max_capture_graphs
        if comm_groups == 0:
            return budget
        if os.environ.get("HCCL_OP_EXPANSION_MODE") == "AIV":
            factor = 1 + comm_groups
            return (budget - factor * graphs_per_size) // factor
        return (budget - 40 * comm_groups) // (1 + 2 * comm_groups)

    @property
    def torch_npu(self):
        if self._torch_npu is None:
            self._torch_npu = import_torch_npu()
        return self._torch_npu

    @property
    def device_module(self):
        return self.torch_npu.npu  # the module torch_npu installs as torch.npu

    @property
    def ops(self):
        """The torch_npu adapters (graphinfer.ops.npu.ops.NpuOps) bound to this platform's torch_npu."""
        if self._ops is None:
            from graphinfer.ops.npu.ops import NpuOps

            self._ops = NpuOps(self._torch_npu)
        return self._ops

    def activate(self, kernels: str | None = None):
        self.torch_npu  # noqa: B018  (the npu device must exist before anything uses it)
        return super().activate(kernels)

    # ----- device graphs -----
    def graph_class(self) -> type:
        return self.device_module.NPUGraph

    @contextlib.contextmanager
    def graph_capture(self, graph, pool, stream):
        try:
            with self.device_module.graph(graph, pool=pool, stream=stream), self.ops.graph_params.capturing(graph):
                yield
        except RuntimeError as e:  # vllm-ascend's translations of the two usual capture failures
            msg = str(e).lower()
            if "207008" in msg or "stream resources are insufficient" in msg:
                raise InvalidConfigError(f"ACL graph capture ran out of NPU streams ({e}); capture fewer sizes "
                                         f"(--capture-sizes / lower --max-num-seqs).") from e
            if "alloc sq cq fail" in msg:
                raise InvalidConfigError(f"ACL graph capture failed ({e}); this needs Ascend HDK >= 25.5.1.") from e
            raise

    def before_graph_replay(self, graph, seq_lens: np.ndarray) -> None:
        if self._ops is not None:  # FIA tasks captured in `graph` get this step's KV lengths
            self._ops.graph_params.update(graph, seq_lens)

    # ----- ops -----
    def sampler_kernel(self, kernels: str | None = None):
        # Wherever Triton-Ascend runs graphinfer's kernels (the default: paged attention) it samples too.
        from graphinfer.ops.npu.ops import NPU_OPS

        if "triton" not in parse_kernels(kernels, NPU_OPS).values():
            return None
        from graphinfer.ops.triton.sampling import sample

        return sample

    def op_impls(self, kernels: str | None = None):
        from graphinfer.ops.npu.ops import NPU_OPS

        chosen = parse_kernels(kernels, NPU_OPS)
        npu_table = self.ops.table() if "torch_npu" in chosen.values() else {}
        triton_table = _triton_ops() if "triton" in chosen.values() else {}
        return {op: (npu_table if choice == "torch_npu" else triton_table)[op] for op, choice in chosen.items()}
