"""Model fingerprint for compile artifacts: what the graph was compiled for (config and weights).

Weights are hashed in full (sha256 over the files' bytes), once per file version: the digest is cached
under the graphinfer cache dir keyed by (path, size, mtime), so multi-GB checkpoints are read only once.
"""
import glob
import hashlib
import json
import os

from graphinfer.config import cache_dir
from graphinfer.models.presets import INIT_VERSION, preset_config


def file_sha256(path: str) -> str:
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = os.path.join(cache_dir(), "hashes", key)
    if os.path.isfile(memo):
        with open(memo) as f:
            digest = f.read().strip()
        if len(digest) == 64:
            return digest
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    try:  # written aside and renamed: another process (a tensor-parallel rank) may be reading the memo right now
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        tmp = f"{memo}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(digest)
        os.replace(tmp, memo)
    except OSError:  # a read-only cache dir only costs a re-hash next time
        pass
    return digest


def _combined(digests: list[str]) -> str:
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()


def model_fingerprint(model: str, hf_config, seed: int = 0) -> dict:
    """{"path", "config_sha256", "weights_sha256"} of an HF directory, a .gguf file or a named preset.
    The config hash covers the parsed HF config (the same for a directory's config.json or a GGUF's metadata)."""
    # Private keys (_name_or_path, _commit_hash) and the transformers version say where it came from, not what it is.
    config = {k: v for k, v in hf_config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    config_sha = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    if preset_config(model) is not None:  # random weights: the preset name, seed and init scheme determine them
        return {"path": model, "config_sha256": config_sha,
                "weights_sha256": hashlib.sha256(f"{model}\0{seed}\0init{INIT_VERSION}".encode()).hexdigest()}
    path = os.path.abspath(model)
    files = [path] if path.endswith(".gguf") else sorted(glob.glob(os.path.join(path, "*.safetensors")))
    return {"path": path, "config_sha256": config_sha, "weights_sha256": _combined([file_sha256(f) for f in files])}


def describe(fingerprint: dict) -> str:
    return json.dumps({k: (v[:12] if k.endswith("sha256") else v) for k, v in fingerprint.items()})
