"""Compile the KVarN Triton kernels for sm86 (RTX 3090) and sm90 (H100/H200) without a GPU; print their resources.

For each kernel at the shapes and launch options kernels/kvarn/kvarn_triton.py uses for this model
(4 KV heads x 256, 24 query heads, 128-token groups), triton compiles to PTX and triton's bundled
ptxas reports registers and spills; the shared memory is triton's. What it catches before a GPU
run: a kernel that does not compile for an arch, spills, or needs more shared memory than the
arch has (sm86: 99 KiB per block, sm90: 227 KiB). CPU work only (about a minute on 2 cores). The
compile loop is rig.kernels.build.compile_check, the one the int8 attention's report uses.

    python bench/scripts/kvarn_compile_check.py [--arch 86,90] [--only LABEL] [--sass] [--json PATH]

--sass adds each kernel's SASS instruction mix (rig.kernels.build.sass_mix: static counts), its innermost loop's
(rig.kernels.build.innermost_loop: for a split kernel, one token tile's instructions) and the enclosing loop's part
before it (rig.kernels.build.loop_head: a split kernel's group start): where the instructions go, without a GPU.
--json writes the rows as data too (name, arch, shared_bytes, fits, ptxas's figures as numbers, error, the three
mixes: sass, loop, head), for checks that read them.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rig.atomic import write_atomic  # noqa: E402
from rig.kernels import build as kbuild  # noqa: E402
from rig.kernels import load_file  # noqa: E402


def load_kernels():
    """kernels/kvarn/kvarn_triton.py as a module (compiled mode: TRITON_INTERPRET must be unset)."""
    return load_file(ROOT / "kernels/kvarn/kvarn_triton.py", "rig_kernel_kvarn_triton")


V3_CASES = [(128, 4, 3, "kv", 1, 0), (128, 8, 3, "kv", 1, 0), (128, 8, 1, "kv", 1, 0), (128, 8, 1, "kv", 2, 0),
            (128, 8, 1, "", 2, 0), (128, 8, 1, "kv", 1, 128), (128, 8, 1, "kv", 2, 128), (128, 8, 3, "kv", 0, 0),
            (128, 8, 3, "k", 1, 0), (64, 8, 3, "kv", 1, 0), (64, 4, 3, "kv", 1, 0), (64, 4, 1, "kv", 1, 128),
            (32, 4, 3, "kv", 1, 0)]
"""v3 split kernels checked: (block_t, warps, stages, precise, MAGIC (0 cvt, 1 magic, 2 ptx), maxnreg (0: none))."""


V5_CASES = [(2, "kv", 0, 0, 0, 0, 0, 0), (4, "kv", 0, 0, 0, 0, 0, 0), (4, "kv", 168, 0, 0, 0, 0, 0),
            (4, "kv", 128, 0, 0, 0, 0, 0), (2, "k", 0, 0, 0, 0, 0, 0), (2, "", 0, 0, 0, 0, 0, 0),
            (2, "k", 168, 0, 0, 0, 0, 0), (2, "", 168, 0, 0, 0, 0, 0), (2, "kv", 0, 1, 0, 0, 0, 0),
            (2, "k", 0, 1, 0, 0, 0, 0), (2, "", 168, 1, 0, 0, 0, 0), (2, "kv", 0, 1, 1, 0, 0, 0),
            (2, "k", 200, 1, 1, 0, 0, 0), (2, "kv", 0, 0, 0, 1, 0, 0), (2, "k", 0, 1, 1, 1, 0, 0),
            (2, "", 168, 1, 1, 1, 0, 0), (3, "kv", 0, 0, 0, 0, 1, 0), (3, "k", 0, 1, 1, 1, 1, 0),
            (3, "", 0, 1, 1, 1, 1, 0), (2, "kv", 0, 0, 0, 0, 0, 1), (2, "kv", 168, 0, 0, 0, 0, 1),
            (2, "k", 168, 0, 0, 0, 0, 1), (2, "k", 128, 0, 0, 0, 0, 1), (2, "k", 168, 1, 1, 0, 0, 1),
            (2, "k", 128, 1, 1, 0, 0, 1), (2, "kv", 0, 0, 0, 0, 0, 1, 1), (2, "k", 0, 1, 1, 1, 0, 1, 1),
            (2, "kv", 0, 0, 0, 0, 0, 1, 0, 1), (2, "kv", 0, 0, 0, 0, 0, 0, 0, 1), (2, "k", 0, 1, 1, 0, 0, 1, 0, 1),
            (3, "kv", 0, 0, 0, 0, 1, 1, 0, 1), (2, "k", 0, 1, 1, 0, 0, 1), (2, "kv", 168, 0, 0, 0, 0, 1, 0, 1),
            (2, "kv", 200, 0, 0, 0, 0, 1, 0, 1), (2, "k", 168, 1, 1, 0, 0, 1, 1, 1),
            (2, "kv", 168, 0, 0, 0, 0, 0, 0, 1), (2, "k", 168, 0, 0, 0, 0, 0, 0, 1), (2, "k", 168, 1, 1, 0, 0, 0, 1, 1)]
"""v5 split kernels checked: (stages, precise, maxnreg (0: none), subnormal unpack, lazy rescale, prefetch, skew,
the query in shared memory[, the in-place unpack[, the group start from shared memory]])."""


V6_CASES = [(2, "kv", 168), (2, "kv", 0), (2, "k", 168), (2, "kv", 128), (3, "kv", 168)]
"""v6 split kernels checked: (stages, precise, maxnreg: 168 is its default, labelled by none; 0: no cap, "nocap")."""


def v6_label(stages: int, precise: str, reg: int) -> str:
    """A v6 row's name: its ring, precise away from "kv" and its register cap away from the default (168)."""
    cap = "" if reg == 168 else " nocap" if not reg else f" r{reg}"
    return f"decode split v6 s{stages}" + (f" {precise or 'fp16'}" if precise != "kv" else "") + cap


def v5_suffix(precise: str, sub: int, lazy: int, prefetch: int, skew: int, qsmem: int = 0, inplace: int = 0,
              csmem: int = 0) -> str:
    """A v5 label's knobs away from the default: precise ("k", "v", "fp16" for neither), the subnormal unpack
    ("sub"), the lazy rescale ("lazy"), the scales' prefetch ("pf"), the skewed loop ("skew"), the query in
    shared memory ("qs"), the in-place unpack ("ip") and the group start from shared memory ("cs")."""
    return (f" {precise or 'fp16'}" if precise != "kv" else "") + (" sub" if sub else "") + \
        (" lazy" if lazy else "") + (" pf" if prefetch else "") + (" skew" if skew else "") + \
        (" qs" if qsmem else "") + (" ip" if inplace else "") + (" cs" if csmem else "")


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
    combine = {"o_ptr": "*fp32", "ml_ptr": "*fp32", "q_ptr": "*bf16", "q_scale": "fp32", "tk_ptr": "*bf16",
               "tv_ptr": "*bf16", "tail_len_ptr": "*i32", "tail_row_ptr": "*i32", "stride_ts": "i32",
               "stride_tt": "i32", "out_ptr": "*bf16", "s_ptr": "*fp16", "inv_sqrt_d": "fp32"}
    rot = {"x_ptr": "*fp32", "s_ptr": "*fp16", "o_ptr": "*bf16", "M": "i32", "inv_sqrt_d": "fp32"}
    return [
        ("rotate", kt._rotate_kernel, rot, dict(D=256, BM=32, BN=64), {"num_warps": 4}),
        ("quantize K", kt._quantize_kernel, {"y_ptr": "*fp32", **page}, dict(quant, BITS=4), {"num_warps": 16}),
        ("quantize V", kt._quantize_kernel, {"y_ptr": "*fp32", **page}, dict(quant, BITS=2), {"num_warps": 16}),
        ("dequant K", kt._dequant_kernel, {**page, "o_ptr": "*fp32"}, dict(HEADS=4, T=128, D=256, BITS=4),
         {"num_warps": 8}),
        ("decode split", kt._decode_split_kernel, split, dict(offs, HKV=4, QPK=6, D=256, T=128, NSPLIT=33,
                                                             BLOCK_G=16, BLOCK_T=32), {"num_warps": 8}),
        *[(f"decode split v2 t{bt} w{w} {pk or 'fp16'}", kt._decode_split_kernel_v2, split,
           dict(offs, HKV=4, QPK=6, D=256, T=128, NSPLIT=16, BLOCK_G=16, BLOCK_T=bt, PRECISE_K="k" in pk,
                PRECISE_V="v" in pk), {"num_warps": w})
          for bt, w, pk in ((32, 4, "kv"), (64, 4, "kv"), (64, 8, "kv"), (128, 4, "kv"), (128, 8, "kv"),
                            (128, 16, "kv"), (64, 8, "k"), (128, 8, "k"), (128, 16, "k"))],
        *[(f"decode split v3 t{bt} w{w} s{st} {pk or 'fp16'} {('cvt', 'magic', 'ptx')[mg]}{f' r{reg}' if reg else ''}",
           kt._decode_split_kernel_v3, split,
           dict(offs, HKV=4, QPK=6, D=256, T=128, NSPLIT=16, BLOCK_G=16, BLOCK_T=bt, PRECISE_K="k" in pk,
                PRECISE_V="v" in pk, MAGIC=mg), {"num_warps": w, "num_stages": st, **({"maxnreg": reg} if reg else {})})
          for bt, w, st, pk, mg, reg in V3_CASES],
        *[(f"decode split v4 {unpack}", kt._load_gluon().decode_split_v4, split,
           dict(offs, HKV=4, QPK=6, D=256, T=128, NSPLIT=64, PTX=unpack == "ptx"), {"num_warps": 1})
          for unpack in ("magic", "ptx")],
        *[(f"decode split v5 s{st}{v5_suffix(pk, sub, lazy, pf, sk, qs, ip, cm)}{f' r{reg}' if reg else ''}",
           kt._load_gluon().decode_split_v5, split,
           dict(offs, HKV=4, QPK=6, D=256, T=128, NSPLIT=64, STAGES=st, PRECISE_K="k" in pk, PRECISE_V="v" in pk,
                SUB=bool(sub), LAZY=bool(lazy), PREFETCH=bool(pf), SKEW=bool(sk), QSMEM=bool(qs),
                INPLACE=bool(ip), CSMEM=bool(cm)),
           {"num_warps": 1, **({"maxnreg": reg} if reg else {})})
          for st, pk, reg, sub, lazy, pf, sk, qs, ip, cm in ((*c, 0, 0)[:10] for c in V5_CASES)],
        *[(v6_label(st, pk, reg), kt._load_gluon().decode_split_v6, split,
           dict(offs, HKV=4, QPK=6, D=256, T=128, NSPLIT=64, STAGES=st, PRECISE_K="k" in pk, PRECISE_V="v" in pk),
           {"num_warps": 2, **({"maxnreg": reg} if reg else {})})
          for st, pk, reg in V6_CASES],
        ("decode combine", kt._decode_combine_kernel, combine, dict(HKV=4, QPK=6, D=256, T=128, NSPLIT=33,
                                                                   NSPLIT_P2=64, TAIL_T=16, TAIL_ROWS=True,
                                                                   ROTATED=True, BN=32),
         {"num_warps": 4}),
    ]


def entries(kt, targets: list[int]) -> Iterator[dict]:
    """specs() for each target as aot_specs()-shaped entries (what rig.kernels.build.compile_check compiles), with
    16-byte-aligned pointers (what the JIT assumes for torch tensors) and page_bytes known to be a multiple of 16
    (the JIT specializes an integer argument so: without it the page's code loads compile to byte loads, 96 of
    them a tile in the v3 split kernel on sm90, against 6 16-byte loads)."""
    for target in targets:
        for label, kernel, types, constexprs, options in specs(kt):
            names = list(inspect.signature(kernel.fn).parameters)
            sig = {n: ("constexpr" if n in constexprs else types[n]) for n in names}
            wide = ["page_bytes"] if "page_bytes" in sig and kt.MODEL_LAYOUT.page_bytes % 16 == 0 else []
            attrs = kbuild.pointer_attrs(sig, multiples_of_16=wide)
            yield {"name": label, "fn": kernel, "signature": sig, "constexprs": constexprs,
                   "attrs": attrs, "options": options, "target": target, "arch": f"sm{target}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="86,90", help="compute capabilities, e.g. 86,90")
    ap.add_argument("--only", default="", help="only the kernels whose label contains this, e.g. 'decode split'")
    ap.add_argument("--sass", action="store_true", help="also each kernel's SASS instruction mix (cuobjdump)")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON to this file (atomically)")
    a = ap.parse_args()
    kt = load_kernels()
    import triton

    print(f"KVarN kernels compiled without a GPU, triton {triton.__version__}")
    sass_col = (" SASS instruction mix | innermost loop (one iteration) | the loop around it, before it (a group's"
                " start) |", "---|---|---|") if a.sass else ("", "")
    print(f"\n| kernel | arch | shared bytes | within the arch's shared memory | ptxas |{sass_col[0]}\n"
          f"|---|---|---:|---|---|{sass_col[1]}")
    bad = 0
    rows = []
    chosen = (e for e in entries(kt, [int(x) for x in a.arch.split(",")]) if a.only in e["name"])
    for c in kbuild.compile_check(chosen, sass=a.sass):
        rows.append({"name": c.name, "arch": c.arch, "shared_bytes": c.shared_bytes, "fits": c.fits, **c.usage,
                     "ptxas": c.ptxas, "error": c.error, "sass": c.sass, "loop": c.loop, "head": c.head})
        if c.error:
            bad += 1
            print(f"| {c.name} | {c.arch} | - | - | FAILED: {c.error} |")
            continue
        bad += not c.fits
        mix = f" {c.sass_summary()} | {c.loop_summary()} | {c.head_summary()} |" if a.sass else ""
        print(f"| {c.name} | {c.arch} | {c.shared_bytes:,} | {'yes' if c.fits else 'NO'} | {c.ptxas} |{mix}")
    if a.json:
        write_atomic(a.json, json.dumps({"triton": triton.__version__, "rows": rows}, indent=2) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
