"""Graph passes: each a small fx rewrite with a name, a description, a match count and a numeric self-check."""
from graphinfer.passes.base import Pass, PassReport
from graphinfer.passes.manager import PassManager
from graphinfer.passes.registry import DEFAULT_PASSES, available_passes, resolve_passes

__all__ = ["Pass", "PassReport", "PassManager", "DEFAULT_PASSES", "available_passes", "resolve_passes"]
