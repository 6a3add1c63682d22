from setuptools import find_packages, setup

setup(
    name="graphinfer",
    version="0.1.0",
    description="Compiler-centric, graph-mode LLM inference runtime (torch.fx passes, Triton kernels, device graphs)",
    packages=find_packages(include=["graphinfer", "graphinfer.*"]),
    python_requires=">=3.10",
    # Ranges, not pins: the package must install beside a GPU image's own torch. The Makefile pins for CI.
    install_requires=[
        "torch>=2.5",  # SDPA enable_gqa, torch.library.infer_schema
        "transformers>=4.56",
        "tokenizers>=0.21",
        "safetensors",
        "gguf>=0.10",
        "numpy",
        "tqdm",
        "jinja2",
        "xgrammar>=0.2.8",  # structured outputs (runtime/structured_output/, imported at the first structured request)
    ],
    # Reading compressed-tensors checkpoints (graphinfer/quantization/compressed_tensors.py, imported when one is
    # loaded); an extra because compressed-tensors 0.20 needs torch>=2.10. The Makefile pins it for CI.
    extras_require={"compressed-tensors": ["compressed-tensors>=0.20"]},
    entry_points={"console_scripts": ["graphinfer=graphinfer.cli:main"]},
)
