"""Typed errors a user can cause. Each message says what to do about it.

They subclass the builtin a vLLM user would catch (ValueError, FileNotFoundError), so
`except ValueError` keeps working.
"""


class GraphinferError(Exception):
    """Base class of every error graphinfer raises on purpose."""


class ModelNotFoundError(GraphinferError, FileNotFoundError):
    """The model path does not exist or holds no loadable checkpoint."""


class UnsupportedArchitectureError(GraphinferError, ValueError):
    """The checkpoint's architecture has no graphinfer model class."""


class InvalidConfigError(GraphinferError, ValueError):
    """An engine argument (dtype, block_size, max_model_len, ...) is out of range."""


class InvalidSamplingParamsError(GraphinferError, ValueError):
    """A SamplingParams field is out of range."""


class PromptTooLongError(GraphinferError, ValueError):
    """The prompt does not leave room for one generated token within max_model_len."""


class KVCacheTooSmallError(GraphinferError, ValueError):
    """A request needs more KV-cache blocks than the whole pool has, so it could never run."""


class ArtifactMismatchError(GraphinferError, ValueError):
    """A compile artifact is damaged, or was made for other weights, versions, platform or dtype."""


class InvalidRequestError(GraphinferError, ValueError):
    """A request's content is malformed: chat messages the template cannot render, bad token ids, ..."""


class UnsupportedQuantizationError(UnsupportedArchitectureError):
    """The checkpoint is quantized in a form graphinfer cannot run (a compressed-tensors scheme or format, a GGUF
    tensor type); the message names the field and what is supported."""


class InvalidStructuredOutputError(InvalidRequestError):
    """A request's structured outputs (JSON schema, regex, choice, grammar, structural tag) cannot be compiled into a
    grammar, or the model cannot take one (no tokenizer); the message names the problem."""


class CpuKernelsMissingError(GraphinferError, RuntimeError):
    """The cpu platform's default kernels need their C++ library (graphinfer/ops/cpu/_cpu_kernels.so), and it is
    missing, stale or failed to load while GRAPHINFER_REQUIRE_CPU_KERNELS=1 refuses the PyTorch fallbacks."""


class GraphCaptureError(GraphinferError, RuntimeError):
    """A graph of the forward cannot be captured on this platform (the cpu platform's traced decode graphs: the
    forward reads a tensor's value on the host); the steps it would have replayed run eagerly."""


class LoRAAdapterError(InvalidRequestError):
    """A LoRA adapter cannot be loaded: its directory or files are missing, its adapter_config.json asks for
    something graphinfer does not run (DoRA, LoRA on the embeddings or LM head, modules_to_save, bias), or its
    weights do not fit the base model or --max-lora-rank; the message names the adapter path, the field or module,
    and the fix."""
