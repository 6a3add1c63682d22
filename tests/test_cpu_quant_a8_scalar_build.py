"""wo_linear_a8 and wo_linear compiled for a CPU without AVX (-march=x86-64: the scalar paths only, as on a machine
the vector builds do not fit), loaded in a fresh process, against the reference op. Slow: it compiles."""
import subprocess
import sys
import textwrap

import pytest
import torch

from graphinfer.ops.cpu import ext


@pytest.mark.slow
def test_scalar_build(tmp_path):
    from torch.utils import cpp_extension

    lib_dir = f"{torch.__path__[0]}/lib"
    lib = tmp_path / "scalar.so"
    flags = ["g++", "-O2", "-march=x86-64", "-fopenmp", "-std=c++20", "-fPIC", "-shared",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-DCPU_CAPABILITY=DEFAULT",
             *(f"-I{p}" for p in cpp_extension.include_paths())]
    sources = [str(ext.SOURCE_DIR / name) for name in ("quant_linear.cpp", "quant_linear_a8.cpp")]
    subprocess.run([*flags, *sources, f"-L{lib_dir}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{lib_dir}",
                    "-o", str(lib)], check=True)
    script = textwrap.dedent(f"""
        import torch
        from graphinfer.ops.quant import dequantize_weight, pack_int4, wo_linear
        torch.ops.load_library({str(lib)!r})
        op = torch.ops.graphinfer_cpu_quant
        assert op.wo_linear_a8_isa() == 0
        torch.manual_seed(0)
        for bits in (4, 8):
            q = pack_int4(torch.randint(0, 16, (40, 128))) if bits == 4 else torch.randint(-128, 128, (40, 128)).to(torch.int8)
            s, z = (torch.rand(40, 4) * 0.02).half(), (-torch.rand(40, 4) * 0.1).half()
            w = dequantize_weight(q, s, z, bits)
            for t in (1, 9, 64):
                x = torch.randn(t, 128)
                exact = wo_linear.reference(x, q, s, z, bits, None)
                assert torch.allclose(op.wo_linear(x, q, s, z, bits, None), exact, atol=1e-4, rtol=1e-5)
                xb = x.view(t, 4, 32); d = xb.abs().amax(-1, keepdim=True) / 127
                bound = (d / 2).expand(-1, -1, 32).reshape(t, 128) @ w.abs().T + 1e-4
                assert ((op.wo_linear_a8(x, q, s, z, None) - exact).abs() <= bound).all()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
