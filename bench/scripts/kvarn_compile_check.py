"""Compile the KVarN Triton kernels for sm86 (RTX 3090) and sm90 (H100/H200) without a GPU; print their resources.

For each kernel at the shapes and launch options kernels/kvarn/kvarn_triton.py uses for this model
(4 KV heads x 256, 24 query heads, 128-token groups), triton compiles to PTX and triton's bundled
ptxas reports registers and spills; the shared memory is triton's. What it catches before a GPU
run: a kernel that does not compile for an arch, spills, or needs more shared memory than the
arch has (sm86: 99 KiB per block, sm90: 227 KiB). CPU work only (about a minute on 2 cores).

    python bench/scripts/kvarn_compile_check.py [--arch 86,90]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARED_LIMIT = {86: 99 * 1024, 90: 227 * 1024}


def load_kernels():
    """kernels/kvarn/kvarn_triton.py as a module (compiled mode: TRITON_INTERPRET must be unset)."""
    spec = importlib.util.spec_from_file_location("rig_kernel_kvarn_triton", ROOT / "kernels/kvarn/kvarn_triton.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def ptxas_usage(ptx: str, target: int) -> str:
    """ptxas -v's register and spill lines for ``ptx`` on sm_<target>."""
    from triton.backends.nvidia.compiler import get_ptxas

    found = get_ptxas(target)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        arch = f"sm_{target}a" if target == 90 else f"sm_{target}"
        run = subprocess.run([getattr(found, "path", found), "-v", f"--gpu-name={arch}", str(src), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
    return "; ".join(ln.split("info    :")[-1].strip() for ln in run.stderr.splitlines()
                     if "Used" in ln or "spill" in ln)


def specs(kt) -> list[tuple[str, object, dict, dict, dict]]:
    """(label, kernel, argument types, constexprs, options): what the entry points launch for this model."""
    lay, r = kt.MODEL_LAYOUT, kt.reference
    page = {"pages_ptr": "*i32", "u8_ptr": "*u8", "f16_ptr": "*fp16", "page_bytes": "i32", "codes_off": "i32",
            "ts_off": "i32", "to_off": "i32", "cs_off": "i32"}
    quant = dict(HEADS=4, T=128, D=256, NORMALIZE=True, ITERS=r.NORM_ITERS, TINY=r.TINY,
                 CH_LO=r.CHANNEL_RANGE[0], CH_HI=r.CHANNEL_RANGE[1])
    offs = dict(K_CODES=lay.k_codes, K_TS=lay.k_ts, K_TO=lay.k_to, K_CS=lay.k_cs, V_CODES=lay.v_codes,
                V_TS=lay.v_ts, V_TO=lay.v_to, V_CS=lay.v_cs)
    split = {"qr_ptr": "*fp32", "u8_ptr": "*u8", "f16_ptr": "*fp16", "bt_ptr": "*i32", "stride_bt": "i32",
             "ngroups_ptr": "*i32", "o_ptr": "*fp32", "ml_ptr": "*fp32", "page_bytes": "i32", "gps": "i32"}
    combine = {"o_ptr": "*fp32", "ml_ptr": "*fp32", "qp_ptr": "*fp32", "tk_ptr": "*bf16", "tv_ptr": "*bf16",
               "tail_len_ptr": "*i32", "stride_ts": "i32", "stride_tt": "i32", "rot_ptr": "*fp32", "plain_ptr": "*fp32"}
    rot = {"x_ptr": "*fp32", "s_ptr": "*fp16", "add_ptr": "*fp32", "o_ptr": "*bf16", "M": "i32", "inv_sqrt_d": "fp32"}
    return [
        ("rotate", kt._rotate_kernel, rot, dict(D=256, BM=32, BN=64, HAS_ADD=True), {"num_warps": 4}),
        ("quantize K", kt._quantize_kernel, {"y_ptr": "*fp32", **page}, dict(quant, BITS=4), {"num_warps": 16}),
        ("quantize V", kt._quantize_kernel, {"y_ptr": "*fp32", **page}, dict(quant, BITS=2), {"num_warps": 16}),
        ("dequant K", kt._dequant_kernel, {**page, "o_ptr": "*fp32"}, dict(HEADS=4, T=128, D=256, BITS=4),
         {"num_warps": 8}),
        ("decode split", kt._decode_split_kernel, split, dict(offs, HKV=4, QPK=6, D=256, T=128, NSPLIT=33,
                                                             BLOCK_G=16, BLOCK_T=32), {"num_warps": 8}),
        ("decode combine", kt._decode_combine_kernel, combine, dict(HKV=4, QPK=6, D=256, T=128, NSPLIT=33,
                                                                   NSPLIT_P2=64, TAIL_T=16), {"num_warps": 4}),
    ]


def compile_one(kernel, types: dict, constexprs: dict, options: dict, target: int):
    """triton.compile for sm_<target> with 16-byte-aligned pointers (what the JIT assumes for torch tensors)."""
    import triton
    from triton.backends.compiler import GPUTarget

    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: ("constexpr" if n in constexprs else types[n]) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    src = triton.compiler.ASTSource(kernel, sig, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", target, 32), options=options)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="86,90", help="compute capabilities, e.g. 86,90")
    a = ap.parse_args()
    kt = load_kernels()
    import triton

    print(f"KVarN kernels compiled without a GPU, triton {triton.__version__}")
    print("\n| kernel | arch | shared bytes | within the arch's shared memory | ptxas |\n|---|---|---:|---|---|")
    bad = 0
    for target in (int(x) for x in a.arch.split(",")):
        for label, kernel, types, constexprs, options in specs(kt):
            try:
                k = compile_one(kernel, types, constexprs, options, target)
            except Exception as e:  # noqa: BLE001 - a failed compile is the finding, reported in the table
                bad += 1
                print(f"| {label} | sm{target} | - | - | FAILED: {type(e).__name__}: {str(e)[:200]} |")
                continue
            fits = k.metadata.shared <= SHARED_LIMIT.get(target, 0)
            bad += not fits
            print(f"| {label} | sm{target} | {k.metadata.shared:,} | {'yes' if fits else 'NO'} | "
                  f"{ptxas_usage(k.asm['ptx'], target)} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
