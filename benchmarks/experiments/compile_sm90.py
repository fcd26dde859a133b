"""Compile our tf32x3 kernels for sm_90 without a GPU and report their structure.

    python benchmarks/experiments/compile_sm90.py      # needs Triton (3.6 is what the H200 runs)

For the production Triton kernel, the Gluon tf32x3 kernels and the fp16x3 kernel: wgmma instructions
and ``wgmma.wait_group`` values in the PTX (how often the tensor cores are waited for per
K-tile), whether ptxas serialised the wgmma (its C7514/C7515 notes: it then waits after
every HGMMA, the DEPBAR count in the SASS), registers and spilled bytes from ``ptxas -v``,
and shared memory.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import gluon_tf32x3  # this folder's experiment
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from ase_tcfp32._kernels import fp16x3, triton_gemm

TARGET = GPUTarget("cuda", 90, 32)


def structure(kernel) -> str:
    ptx = kernel.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as cubin:
        log = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", cubin.name], capture_output=True, text=True
        ).stderr
        sass = subprocess.run([ptxas.replace("ptxas", "nvdisasm"), cubin.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    os.unlink(cubin.name)
    waits = re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx)
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    serialised = "serialised by ptxas (C7514/C7515)" if re.search(r"C751[45]", log) else "not serialised"
    depbars = len(re.findall(r"WARPGROUP\.DEPBAR", sass))
    return (
        f"wgmma={ptx.count('wgmma.mma_async')} waits={waits} HGMMA={sass.count('HGMMA')} DEPBAR={depbars} "
        f"{serialised} registers={regs} spill_bytes={spills} smem={kernel.metadata.shared}"
    )


def gluon_descriptor(block: list[int], dtype: str = "fp32") -> str:
    layout = gl.NVMMASharedLayout.get_default_for(block, {"fp32": gl.float32, "fp16": gl.float16}[dtype])
    return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout!r}>"


def main() -> None:
    c = triton_gemm.tile_config(768, 256)
    bm, bn, bk = c["BM"], c["BN"], c["BK"]
    signature = {
        "x_ptr": "*fp32",
        "x_desc": f"tensordesc<fp32[{bm}, {bk}]>",
        "w_ptr": "*fp32",
        "w_desc": f"tensordesc<fp32[{bn}, {bk}]>",
        "bias_ptr": "*fp32",
        "y_ptr": "*fp32",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "KP": "i32",
        "stride_xm": "i32",
        "stride_ym": "i32",
        "WORDS": "constexpr",
        "TMA": "constexpr",
        "HAS_BIAS": "constexpr",
        "BM": "constexpr",
        "BN": "constexpr",
        "BK": "constexpr",
        "GROUP_M": "constexpr",
    }
    constants = dict(WORDS=2, TMA=True, HAS_BIAS=True, BM=bm, BN=bn, BK=bk, GROUP_M=c["GROUP_M"])
    kernel = triton.compile(
        ASTSource(triton_gemm._linear_kernel, signature, constexprs=constants),
        target=TARGET,
        options=dict(num_warps=c["num_warps"], num_stages=c["num_stages"]),
    )
    print("triton tf32x3:", structure(kernel))

    g = gluon_tf32x3.CONFIG
    signature = {
        "x_desc": gluon_descriptor([g["BM"], g["BK"]]),
        "hi_desc": gluon_descriptor([g["BN"], g["BK"]]),
        "lo_desc": gluon_descriptor([g["BN"], g["BK"]]),
        "y_desc": gluon_descriptor([g["BM"], g["BN"]]),
        "bias_ptr": "*fp32",
        "M": "i32",
        "N": "i32",
        "HAS_BIAS": "constexpr",
        "STAGES": "constexpr",
        "GROUP_M": "constexpr",
        "num_warps": "constexpr",
    }
    variants = [("gluon", gluon_tf32x3._tf32x3_kernel, 32, 3, {}), ("gluon", gluon_tf32x3._tf32x3_kernel, 32, 4, {})]
    variants += [
        ("gluon, warp-specialised", gluon_tf32x3._tf32x3_ws_kernel, bk, stages, {}) for bk, stages in ((32, 4), (16, 8))
    ]
    for name, fn, bk, stages, extra in variants:
        sig = dict(
            signature,
            x_desc=gluon_descriptor([g["BM"], bk]),
            hi_desc=gluon_descriptor([g["BN"], bk]),
            lo_desc=gluon_descriptor([g["BN"], bk]),
            **{key: "constexpr" for key in extra},
        )
        constants = dict(HAS_BIAS=True, STAGES=stages, GROUP_M=g["GROUP_M"], num_warps=g["num_warps"], **extra)
        kernel = triton.compile(
            GluonASTSource(fn, sig, constexprs=constants), target=TARGET, options=dict(num_warps=g["num_warps"])
        )
        print(f"{name}, BK={bk}, {stages} stages:", structure(kernel))

    for bk, stages in ((32, 4), (64, 2)):
        kernel = compile_fp16x3(fp16x3._fp16x3_kernel, dict(fp16x3.CONFIG, BK=bk, STAGES=stages))
        print(f"fp16x3, BK={bk}, {stages} stages:", structure(kernel))


def compile_fp16x3(kernel, config: dict):
    """``kernel`` with the fp16x3 kernel's signature (``kernels/fp16x3.py``) under ``config``, for sm_90."""
    bm, bn, bk = config["BM"], config["BN"], config["BK"]
    signature = {
        "x_desc": gluon_descriptor([bm, bk]),
        "hi_desc": gluon_descriptor([bn, bk], "fp16"),
        "lo_desc": gluon_descriptor([bn, bk], "fp16"),
        "y_desc": gluon_descriptor([bm, bn]),
        "scale_ptr": "*fp32",
        "bias_ptr": "*fp32",
        "M": "i32",
        "N": "i32",
        "HAS_BIAS": "constexpr",
        "STAGES": "constexpr",
        "GROUP_M": "constexpr",
        "num_warps": "constexpr",
    }
    constants = dict(HAS_BIAS=True, STAGES=config["STAGES"], GROUP_M=config["GROUP_M"], num_warps=config["num_warps"])
    return triton.compile(
        GluonASTSource(kernel, signature, constexprs=constants),
        target=TARGET,
        options=dict(num_warps=config["num_warps"]),
    )


if __name__ == "__main__":
    main()
