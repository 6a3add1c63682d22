"""Graph passes: each a small fx rewrite with a name, a description, a match count and a numeric check.

Writing one: subclass Pass; match with the helpers in graphinfer.passes.match (docs/passes.md)."""
from graphinfer.passes.base import Pass, PassCheckError, PassError, PassReport, PassReports
from graphinfer.passes.check import DEFAULT_TOLERANCES, CheckResult
from graphinfer.passes.manager import PassManager
from graphinfer.passes.registry import DEFAULT_PASSES, PluginWarning, available_passes, resolve_passes

__all__ = ["Pass", "PassReport", "PassReports", "PassManager", "PassError", "PassCheckError", "CheckResult",
           "DEFAULT_TOLERANCES", "DEFAULT_PASSES", "PluginWarning", "available_passes", "resolve_passes"]
