"""Imports that third-party packages make eagerly, made lazy for graphinfer's processes (same behaviour, paid when used).

transformers' candidate_generator (assisted generation) runs `if is_sklearn_available(): from sklearn.metrics import
roc_curve` at module level, and every transformers config class imports it: the class's auto_docstring imports the
auto model classes, which import GenerationMixin. Where scikit-learn is installed (lm-eval brings it) that is ~1.2 s of
sklearn, scipy and pandas imports in each process that builds a config (a `graphinfer serve` front end, its engine
core, each tensor-parallel rank), for a function only assisted generation's adaptive threshold calls. defer_sklearn()
has that module load without it: once loaded, it gets the real is_sklearn_available back and a roc_curve that imports
sklearn's on its first call.
"""
import importlib.abc
import importlib.machinery
import sys

_CANDIDATE_GENERATOR = "transformers.generation.candidate_generator"


def _roc_curve(*args, **kwargs):
    from sklearn.metrics import roc_curve

    return roc_curve(*args, **kwargs)


def _sklearn_unavailable() -> bool:
    return False


class _DeferSklearnLoader(importlib.abc.Loader):
    """candidate_generator's own loader, run with transformers.utils.is_sklearn_available answering False."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):  # get_source, get_filename, ...: the file's loader answers
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        import transformers.utils as hf_utils

        real = hf_utils.is_sklearn_available
        hf_utils.is_sklearn_available = _sklearn_unavailable
        try:
            self._loader.exec_module(module)
        finally:
            hf_utils.is_sklearn_available = real
            for m in list(sys.modules.values()):  # candidate_generator, and anything it imported meanwhile
                names = getattr(m, "__dict__", None)  # never getattr(m, ...): transformers' lazy modules import on it
                if isinstance(names, dict) and names.get("is_sklearn_available") is _sklearn_unavailable:
                    m.is_sklearn_available = real
        if real() and "roc_curve" not in vars(module):
            module.roc_curve = _roc_curve


class _DeferSklearnFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _CANDIDATE_GENERATOR:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _DeferSklearnLoader(spec.loader)
        return spec


def defer_sklearn() -> None:
    """Install the finder (once; nothing where candidate_generator is imported already)."""
    if _CANDIDATE_GENERATOR in sys.modules or any(isinstance(f, _DeferSklearnFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _DeferSklearnFinder())
