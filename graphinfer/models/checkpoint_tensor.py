"""Checkpoint tensors read on demand: the whole tensor, or one slice along a dimension (a tensor-parallel
shard), so each rank reads only its part of the file (safetensors: get_slice over the memory map; GGUF:
gguf_loader.GGUFTensor, which dequantizes only the rows or blocks of the slice)."""
import torch
from torch import Tensor


class CheckpointTensor:
    shape: tuple[int, ...]

    def read(self, dim: int | None = None, start: int = 0, length: int | None = None) -> Tensor:
        """The tensor (dim None), or its elements start:start + length along dim."""
        raise NotImplementedError


class InMemoryTensor(CheckpointTensor):
    """A tensor already in memory (preset weights, transformers' in-memory layouts)."""

    def __init__(self, tensor: Tensor):
        self.tensor, self.shape = tensor, tuple(tensor.shape)

    def read(self, dim=None, start=0, length=None) -> Tensor:
        return self.tensor if dim is None else self.tensor.narrow(dim, start, length)


class SafetensorsTensor(CheckpointTensor):
    """One tensor of an open safetensors file (safe_open): a slice reads only its bytes."""

    def __init__(self, handle, name: str):
        self.slice = handle.get_slice(name)
        self.shape = tuple(self.slice.get_shape())
        self.handle, self.name = handle, name

    def read(self, dim=None, start=0, length=None) -> Tensor:
        if dim is None:
            return self.handle.get_tensor(self.name)
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self.slice[tuple(index)]


def as_checkpoint_tensor(t) -> CheckpointTensor:
    return t if isinstance(t, CheckpointTensor) else InMemoryTensor(torch.as_tensor(t))
