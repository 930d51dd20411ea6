"""Kernel builds (rig/kernels, `inv kernels.build`): deterministic bytes, manifests, preflight, fingerprint.

CPU (everywhere; nvcc is on every CI machine of this kind — tests that compile skip, naming it,
where it is absent): two builds of kernels/int8-prefill-attn from copies in different folders into
different build folders give identical bytes; a changed source makes a build stale; an altered or
missing artefact, a build for another arch, a missing build are each refused by serve's preflight,
naming the kernel and `inv kernels.build --arch ...`; another nvcc release is refused by name;
a host without nvcc keeps a fresh CUDA build and refuses a stale one; Triton's ahead-of-time
compile works on a host without a GPU (toy kernels in a temp folder) and a cubin too big for the
RTX 3090's shared memory is refused; kernel.toml errors name the file and the key.

GPU (marked ``gpu``): the CUDA pre-pass (smooth_quant.cu through rig.kernels.cubin) equals the torch
spec ``reference.smooth_quant`` bit for bit on ragged batches, bf16 and fp16, head_dim 64/128/256
(quant's 16-byte path) and 72/100/512 (its general path).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import textwrap
from pathlib import Path

import pytest

from rig import paths
from rig.kernels import build as kbuild
from rig.kernels import load_file, manifest, toolchain
from rig.kernels import spec as kspec
from rig.plan import resolve

KERNEL = "int8-prefill-attn"
needs_nvcc = pytest.mark.skipif(toolchain.find_nvcc() is None,
                                reason="nvcc is not on PATH, in $CUDA_HOME/bin or at /usr/local/cuda/bin")
needs_triton = pytest.mark.skipif(toolchain.triton_version() is None, reason="triton is not installed here")


def _sha_tree(root: Path) -> dict[str, str]:
    """sha256 of every file under root, by relative path."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _copy_kernel(dest_root: Path, name: str = KERNEL) -> Path:
    """A copy of a kernel folder of this checkout under dest_root/<name> (sources only, as declared)."""
    src = paths.KERNELS / name
    spec = kspec.load(src)
    for f in spec.inputs():
        (dest_root / name / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / f, dest_root / name / f)
    return dest_root


def _int8_plan(**sets: str):
    return resolve("batch", (), "gpu", environ={}, sets={"PREFILL_ATTN": "int8", **sets})


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory) -> tuple[Path, Path]:
    """The real kernel built twice: from copies in two folders (different path lengths) into two build roots."""
    if toolchain.find_nvcc() is None:
        pytest.skip("nvcc is not on PATH, in $CUDA_HOME/bin or at /usr/local/cuda/bin")
    roots = []
    for label in ("a", "a-much-longer-folder-name/nested"):
        base = tmp_path_factory.mktemp("kbuild") / label
        src = _copy_kernel(base / "src")
        out = base / "state" / "kernels"
        kbuild.build(KERNEL, kernels_root=src, build_root=out)
        roots.append(out)
    return roots[0], roots[1]


@pytest.fixture
def state_with_build(two_builds, tmp_path, monkeypatch) -> Path:
    """RIG_STATE_DIR in tmp holding a copy of the real kernel's fresh build (the test may alter it)."""
    state = tmp_path / "state"
    shutil.copytree(two_builds[0], state / "kernels")
    monkeypatch.setenv("RIG_STATE_DIR", str(state))
    return state / "kernels" / KERNEL


# ----------------------------------------------------------------------------- determinism


def test_two_builds_in_different_folders_are_byte_identical(two_builds):
    """Every artefact and the manifest itself: same bytes from different source and output folders."""
    a, b = (_sha_tree(r / KERNEL) for r in two_builds)
    assert a == b, "a kernel build depends on where it was made"
    m = manifest.read(two_builds[0] / KERNEL)
    parts = {p.part: p for p in m.parts}
    assert parts["cuda"].built and [x.path for x in parts["cuda"].artefacts] == ["fat/smooth_quant.fatbin"]
    assert set(parts["cuda"].archs) == {"sm86", "sm90"} and "-lineinfo" not in parts["cuda"].flags
    if toolchain.triton_version() is None:
        assert not parts["triton"].built and "triton" in parts["triton"].why_not
    else:  # head_dim 256 x {bf16, fp16} for each arch, as attn.py's aot_specs() lists them
        assert {tuple(x.archs) for x in parts["triton"].artefacts} == {("sm86",), ("sm90",)}
        assert all(x.meta["shared_bytes"] <= kbuild.SHARED_BYTES_PER_BLOCK[x.archs[0]]
                   for x in parts["triton"].artefacts)
    for root in two_builds:  # no trace of where it was built, in any artefact
        for f in (root / KERNEL).rglob("*"):
            if f.is_file():
                assert str(root.parent.parent).encode() not in f.read_bytes(), f


def test_the_manifest_records_every_input_and_the_hashes_of_what_it_wrote(two_builds):
    out = two_builds[0] / KERNEL
    m = manifest.read(out)
    cuda = m.part("cuda")
    assert set(cuda.sources) == {"kernel.toml", "smooth_quant.cu"}
    assert cuda.sources["smooth_quant.cu"] == hashlib.sha256((paths.KERNELS / KERNEL / "smooth_quant.cu")
                                                             .read_bytes()).hexdigest()
    assert cuda.toolchain["nvcc"].startswith(toolchain.pinned_cuda() + ".")
    assert set(m.part("triton").sources) == {"kernel.toml", "attn.py", "reference.py"}
    for pb in m.parts:
        for art in pb.artefacts:
            data = (out / art.path).read_bytes()
            assert (len(data), hashlib.sha256(data).hexdigest()) == (art.size_bytes, art.sha256)
    assert m.input_sha256 == manifest.combined_hash(m.parts)
    entry_points = kspec.load(paths.KERNELS / KERNEL).cuda[0].entry_points
    assert all(e.encode() in (out / "fat/smooth_quant.fatbin").read_bytes() for e in entry_points)


# ----------------------------------------------------------------------------- toy kernels

TOY_CU = textwrap.dedent("""\
    extern "C" __global__ void rig_toy_scale(float* x, float a, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) x[i] = x[i] * a;
    }
""")


def _toy_cuda(root: Path, entry_points: str = '["rig_toy_scale"]', archs: str = '["sm86", "sm90"]') -> Path:
    folder = root / "toy-cuda"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "toy.cu").write_text(TOY_CU)
    (folder / "kernel.toml").write_text(textwrap.dedent(f"""\
        schema_version = 1
        kind = "kernel"
        name = "toy-cuda"
        description = "a test kernel"
        archs = {archs}
        [[cuda]]
        source = "toy.cu"
        entry_points = {entry_points}
    """))
    return folder


TOY_TRITON = textwrap.dedent('''\
    import triton
    import triton.language as tl


    @triton.jit
    def toy_matmul(A, B, C, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        m = tl.arange(0, BM)
        n = tl.arange(0, BN)
        k = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for i in range(0, 4):
            a = tl.load(A + m[:, None] * BK + k[None, :] + i * BM * BK)
            b = tl.load(B + k[:, None] * BN + n[None, :] + i * BK * BN)
            acc = tl.dot(a, b, acc)
        tl.store(C + m[:, None] * BN + n[None, :], acc)


    @triton.jit
    def byte_copy(src, dst, off, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(dst + i, tl.load(src + off + i))


    TILE = {TILE}
    DEPTH = {DEPTH}
    STAGES = {STAGES}


    def aot_specs():
        sig = {{"A": "*fp16", "B": "*fp16", "C": "*fp32", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}}
        return [{{"fn": toy_matmul, "signature": sig, "constexprs": {{"BM": TILE, "BN": TILE, "BK": DEPTH}},
                  "options": {{"num_warps": 4, "num_stages": STAGES}}, "arch": arch, "target": cc,
                  "name": f"toy_matmul_{{arch}}"}} for arch, cc in (("sm86", 86), ("sm90", 90))]
''')


def _toy_triton(root: Path, tile: int = 32, depth: int = 32) -> Path:
    folder = root / "toy-triton"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "toy.py").write_text(TOY_TRITON.format(TILE=tile, DEPTH=depth, STAGES=2))
    (folder / "kernel.toml").write_text(textwrap.dedent("""\
        schema_version = 1
        kind = "kernel"
        name = "toy-triton"
        description = "a test kernel"
        archs = ["sm86", "sm90"]
        [[triton]]
        module = "toy.py"
    """))
    return folder


@needs_nvcc
def test_a_changed_source_makes_the_build_stale_and_a_rebuild_fresh(tmp_path):
    _toy_cuda(tmp_path / "src")
    out = tmp_path / "out"
    first = kbuild.build("toy-cuda", kernels_root=tmp_path / "src", build_root=out)
    assert manifest.problems("toy-cuda", "sm86", tmp_path / "src", out) == []
    cu = tmp_path / "src" / "toy-cuda" / "toy.cu"
    cu.write_text(cu.read_text().replace("x[i] * a", "x[i] * a + 1.0f"))
    assert manifest.problems("toy-cuda", "sm86", tmp_path / "src", out) == ["stale: toy.cu changed since the build"]
    second = kbuild.build("toy-cuda", kernels_root=tmp_path / "src", build_root=out)
    assert manifest.problems("toy-cuda", "sm86", tmp_path / "src", out) == []
    assert second.input_sha256 != first.input_sha256
    assert second.parts[0].artefacts[0].sha256 != first.parts[0].artefacts[0].sha256


@needs_nvcc
def test_a_declared_entry_point_the_source_lacks_is_refused(tmp_path):
    _toy_cuda(tmp_path, entry_points='["rig_toy_scale", "rig_toy_missing"]')
    with pytest.raises(kbuild.BuildError, match="toy.cu does not define the entry points rig_toy_missing"):
        kbuild.build("toy-cuda", kernels_root=tmp_path, build_root=tmp_path / "out")
    assert not (tmp_path / "out" / "toy-cuda" / manifest.MANIFEST).exists()


def test_another_nvcc_release_is_refused_by_name(tmp_path, monkeypatch):
    """A real executable named nvcc that reports CUDA 12.4, first on PATH: the build names it and its version."""
    fake = tmp_path / "bin" / "nvcc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    _toy_cuda(tmp_path / "src")
    with pytest.raises(kbuild.BuildError, match=f"{fake} is nvcc 12.4.131; rig builds kernels with nvcc "
                                                f"{toolchain.pinned_cuda()} only"):
        kbuild.build("toy-cuda", kernels_root=tmp_path / "src", build_root=tmp_path / "out")


@needs_nvcc
def test_without_nvcc_a_fresh_cuda_build_is_kept_and_a_stale_one_refused(tmp_path, monkeypatch):
    """A GPU host without nvcc runs a build made elsewhere: kept while fresh (also for a subset of its archs)."""
    src = tmp_path / "src"
    _toy_cuda(src)
    out = tmp_path / "out"
    made = kbuild.build("toy-cuda", kernels_root=src, build_root=out)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr(toolchain, "NVCC_FALLBACKS", ())
    assert toolchain.find_nvcc() is None
    kept = kbuild.build("toy-cuda", "sm90", kernels_root=src, build_root=out)
    assert kept.parts[0] == made.parts[0] and manifest.problems("toy-cuda", "sm90", src, out) == []
    (src / "toy-cuda" / "toy.cu").write_text(TOY_CU + "// edited\n")
    with pytest.raises(kbuild.BuildError, match="nvcc not found.*no fresh build of it"):
        kbuild.build("toy-cuda", kernels_root=src, build_root=out)


@needs_triton
def test_triton_compiles_ahead_of_time_without_a_gpu_for_both_archs(tmp_path):
    _toy_triton(tmp_path / "src")
    m = kbuild.build("toy-triton", kernels_root=tmp_path / "src", build_root=tmp_path / "out")
    [part] = m.parts
    assert part.built and part.toolchain == {"triton": toolchain.triton_version()}
    assert [a.path for a in part.artefacts] == ["triton/sm86/toy_matmul_sm86.cubin",
                                                "triton/sm90/toy_matmul_sm90.cubin"]
    for a in part.artefacts:
        assert a.meta["kernel"] == "toy_matmul" and a.meta["num_warps"] == 4 and a.meta["shared_bytes"] > 0
        assert (tmp_path / "out" / "toy-triton" / a.path).read_bytes()[:4] == b"\x7fELF"
        assert str(tmp_path).encode() not in (tmp_path / "out" / "toy-triton" / a.path).read_bytes()


@needs_triton
def test_a_triton_kernel_too_big_for_the_3090s_shared_memory_is_refused(tmp_path):
    """A 256 x 128 and a 128 x 256 fp16 tile in shared memory: 128 KB, more than sm86's 99 KB a block."""
    _toy_triton(tmp_path, tile=256, depth=128)
    with pytest.raises(kbuild.BuildError, match=r"toy_matmul_sm86 needs \d+ bytes of shared memory; sm86 allows "
                                                r"101376 per block"):
        kbuild.build("toy-triton", kernels_root=tmp_path, build_root=tmp_path / "out")


@needs_triton
def test_compile_check_reports_registers_and_an_instruction_mix_that_tells_byte_loads_from_wide_ones(tmp_path):
    """The toy matmul compiled for sm86 and sm90 without a GPU: ptxas's registers, and a SASS mix with its tensor-core
    instructions; a byte copy whose offset is not known to be a multiple of 16 loads bytes one at a time, the same copy
    with the offset declared divisible by 16 loads 16 at a time (what the KVarN compile check's page_bytes is for)."""
    mod = load_file(_toy_triton(tmp_path) / "toy.py", "rig_test_toy_sass")
    checks = list(kbuild.compile_check(mod.aot_specs(), sass=True))
    assert [c.arch for c in checks] == ["sm86", "sm90"] and not any(c.error for c in checks)
    for c in checks:
        assert "registers" in c.ptxas and c.sass.get("HMMA.16816.F32", 0) > 0, (c.arch, c.ptxas, c.sass)
        assert 0 < c.usage["registers"] <= 255 and f"Used {c.usage['registers']} registers" in c.ptxas, c.usage
        assert c.sass_summary().startswith(f"{sum(c.sass.values())} instructions: ") and "LDG" in c.sass_summary()
    sig = {"src": "*u8", "dst": "*u8", "off": "i32", "N": "constexpr"}
    base = {"fn": mod.byte_copy, "signature": sig, "constexprs": {"N": 512}, "options": {"num_warps": 1},
            "arch": "sm90", "target": 90, "name": "copy"}
    aligned = {**base, "attrs": kbuild.pointer_attrs(sig, multiples_of_16=["off"])}
    plain, wide = (c.sass for c in kbuild.compile_check([{**base, "attrs": kbuild.pointer_attrs(sig)}, aligned],
                                                          sass=True))
    assert plain.get("LDG.E.U8", 0) == 16 and "LDG.E.128" not in plain, plain  # 16 bytes a thread
    assert wide.get("LDG.E.128", 0) >= 1 and "LDG.E.U8" not in wide, wide


# ----------------------------------------------------------------------------- kernel.toml


@pytest.mark.parametrize("edit, message", [
    (lambda t: "colour = 'blue'\n" + t, "kernel.toml: colour: Extra inputs are not permitted"),
    (lambda t: t.replace('["sm86", "sm90"]', '["sm80"]'), "kernel.toml: archs[0]: Input should be 'sm86' or 'sm90'"),
    (lambda t: t.replace('source = "toy.cu"', 'source = "other.cu"'),
     "kernel.toml: declares other.cu, which the folder does not have"),
    (lambda t: t.replace('source = "toy.cu"', 'source = "../toy.cu"'), "kernel.toml: cuda[0].source: Value error"),
    (lambda t: t.replace('name = "toy-cuda"', 'name = "toy"'), "kernel.toml: name: 'toy' must equal the folder"),
    (lambda t: t.replace("[[cuda]]", "[[cuda"), "kernel.toml: not valid TOML"),
    (lambda t: t.replace('entry_points = ["rig_toy_scale"]', 'entry_points = ["not a name"]'),
     "kernel.toml: cuda[0].entry_points: Value error, ['not a name'] are not C identifiers"),
], ids=["unknown key", "arch", "missing file", "outside the folder", "name", "toml", "entry point"])
def test_a_bad_kernel_toml_is_an_error_naming_file_and_key(tmp_path, edit, message):
    folder = _toy_cuda(tmp_path)
    (folder / "kernel.toml").write_text(edit((folder / "kernel.toml").read_text()))
    with pytest.raises(kspec.KernelSpecError) as e:
        kspec.load_named("toy-cuda", tmp_path)
    assert str(e.value).startswith(str(folder / "kernel.toml")) and message in str(e.value), str(e.value)


def test_unknown_kernels_and_archs_are_named(tmp_path):
    _toy_cuda(tmp_path)
    with pytest.raises(kspec.KernelSpecError, match="unknown kernel 'nope'.*kernels in this checkout: toy-cuda"):
        kspec.load_named("nope", tmp_path)
    with pytest.raises(kbuild.BuildError, match="--arch sm80: kernel toy-cuda is built for sm86, sm90"):
        kbuild.build("toy-cuda", "sm86,sm80", kernels_root=tmp_path, build_root=tmp_path / "out")
    assert kbuild.parse_archs("", kspec.load_named("toy-cuda", tmp_path)) == ["sm86", "sm90"]
    assert toolchain.nvcc_flags(["sm90", "sm86"])[-2:] == ["-gencode=arch=compute_86,code=sm_86",
                                                          "-gencode=arch=compute_90,code=[sm_90,compute_90]"]


def test_the_repo_kernel_toml_is_valid_and_load_returns_its_attn_module_once():
    spec = kspec.load_named(KERNEL)
    assert spec.archs == ["sm86", "sm90"] and spec.cuda[0].source == "smooth_quant.cu"
    assert KERNEL in kspec.available()
    pytest.importorskip("triton")
    from rig import kernels

    attn = kernels.load(KERNEL)
    assert attn is kernels.load(KERNEL) and callable(attn.aot_specs) and attn.__name__.endswith("_attn")


# ----------------------------------------------------------------------------- preflight, verify


def test_preflight_refuses_a_kernel_that_is_not_built(tmp_path, monkeypatch):
    from rig import verify
    from rig.serve import PreflightError, check_kernels

    monkeypatch.setenv("RIG_STATE_DIR", str(tmp_path))
    with pytest.raises(PreflightError, match=r"kernel int8-prefill-attn \(sm86\): not built \(no .*manifest.json\); "
                                             r"run `inv kernels.build --arch sm86`"):
        check_kernels(_int8_plan())
    with pytest.raises(RuntimeError, match="not built"):
        verify.check_kernels(_int8_plan())


def test_preflight_passes_a_fresh_build_and_verify_says_so(state_with_build):
    from rig import verify
    from rig.serve import PreflightError, check_kernels

    if toolchain.triton_version() is None:  # built CUDA-only: the Triton kernels cannot run here
        with pytest.raises(PreflightError, match="the Triton part was not built"):
            check_kernels(_int8_plan())
        return
    assert check_kernels(_int8_plan()) == ["int8-prefill-attn: built for sm86, fresh, artefacts verified"]
    assert check_kernels(_int8_plan(GPU_ARCH="sm90")) == [
        "int8-prefill-attn: built for sm90, fresh, artefacts verified"]
    assert verify.check_kernels(_int8_plan()) == "int8-prefill-attn: built for sm86, fresh, artefacts verified"
    assert check_kernels(resolve("batch", (), "gpu", environ={})) == []


@pytest.mark.parametrize("damage, message", [
    ("tamper", r"fat/smooth_quant.fatbin differs from the build's record \(sha256 [0-9a-f]{12}…\): altered"),
    ("remove", r"fat/smooth_quant.fatbin is missing"),
    ("stale", r"stale: smooth_quant.cu changed since the build"),
    ("manifest", r"its manifest is unreadable"),
])
def test_preflight_refuses_an_altered_or_stale_build(state_with_build, damage, message):
    from rig.serve import PreflightError, check_kernels

    fatbin = state_with_build / "fat" / "smooth_quant.fatbin"
    if damage == "tamper":
        data = bytearray(fatbin.read_bytes())
        data[len(data) // 2] ^= 0x01
        fatbin.write_bytes(bytes(data))
    elif damage == "remove":
        fatbin.unlink()
    elif damage == "stale":  # the build recorded another smooth_quant.cu than the checkout's
        doc = json.loads((state_with_build / manifest.MANIFEST).read_text())
        doc["parts"][0]["sources"]["smooth_quant.cu"] = "0" * 64
        (state_with_build / manifest.MANIFEST).write_text(json.dumps(doc))
    else:
        (state_with_build / manifest.MANIFEST).write_text("{")
    with pytest.raises(PreflightError, match=rf"kernel int8-prefill-attn \(sm86\): .*{message}.*"
                                             r"run `inv kernels.build --arch sm86`"):
        check_kernels(_int8_plan())


@needs_nvcc
def test_preflight_refuses_a_build_for_another_arch(tmp_path, monkeypatch):
    from rig.serve import PreflightError, check_kernels

    monkeypatch.setenv("RIG_STATE_DIR", str(tmp_path))
    kbuild.build(KERNEL, "sm90")
    with pytest.raises(PreflightError, match=r"the CUDA part is built for sm90, not sm86.*"
                                             r"`inv kernels.build --arch sm86`"):
        check_kernels(_int8_plan())


def test_preflight_names_the_knob_for_a_kernel_this_checkout_does_not_have(tmp_path, monkeypatch):
    from rig.serve import PreflightError, check_kernels

    monkeypatch.setenv("RIG_STATE_DIR", str(tmp_path))
    plan = resolve("batch", (), "gpu", environ={}, sets={"PREFILL_ATTN": "int8"})
    assert plan.kernels == ["int8-prefill-attn"]
    plan = plan.model_copy(update={"kernels": ["int8-prefill-attn", "no-such-kernel"]})
    with pytest.raises(PreflightError, match=r"kernel no-such-kernel: unknown kernel 'no-such-kernel': "
                                             r"kernels/no-such-kernel/kernel.toml does not exist .*; choose a plan "
                                             r"without it"):
        check_kernels(plan)


# ----------------------------------------------------------------------------- plan env, fingerprint


def test_the_plan_points_the_server_at_the_kernels_and_their_build(tmp_path, monkeypatch):
    """The plan holds checkout-relative paths (plans do not depend on where the checkout lies); the server
    gets them absolute. A state folder outside the checkout is absolute in the plan too."""
    from rig import kernels
    from rig.serve import server_for

    monkeypatch.delenv("RIG_STATE_DIR", raising=False)
    plan = _int8_plan()
    assert plan.env[kernels.ENV_DIR] == "kernels" and plan.env[kernels.ENV_BUILD] == ".rig/kernels"
    assert kernels.ENV_DIR not in resolve("batch", (), "gpu", environ={}).env
    server = server_for(plan, "k" * 32, tmp_path / "log")
    assert server.env[kernels.ENV_DIR] == str(paths.KERNELS)
    assert server.env[kernels.ENV_BUILD] == str(paths.ROOT / ".rig" / "kernels")
    monkeypatch.setenv("RIG_STATE_DIR", str(tmp_path / "state"))
    assert _int8_plan().env[kernels.ENV_BUILD] == str(tmp_path / "state" / "kernels")


def test_the_fingerprint_carries_the_builds_artefact_hashes(state_with_build):
    from rig import fingerprint
    from rig.repro import diff

    fp = fingerprint.collect(_int8_plan())
    m = manifest.read(state_with_build)
    expected = {a.path: a.sha256 for p in m.parts for a in p.artefacts}
    assert fp["kernels"][KERNEL] == {"input_sha256": m.input_sha256, **expected}
    assert fingerprint.collect(resolve("batch", (), "gpu", environ={}))["kernels"] == {}
    keys = [k for k in diff.leaves(fp) if k.startswith("kernels.")]
    assert keys and all(diff.rule(k).group == "kernels" for k in keys)
    other = json.loads(json.dumps(fp))
    other["kernels"][KERNEL]["fat/smooth_quant.fatbin"] = "f" * 64
    assert "kernels.int8-prefill-attn.fat/smooth_quant.fatbin" in [d.key for d in diff.compare(fp, other).differences]


# ----------------------------------------------------------------------------- the command line


def test_cli_build_and_status(inv, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RIG_STATE_DIR", str(tmp_path))
    assert inv("kernels.status", "--arch", "sm86") == 1
    assert "int8-prefill-attn: not built" in capsys.readouterr().out
    assert inv("kernels.build", "--kernel", "nope") == 2
    assert "unknown kernel 'nope'" in capsys.readouterr().err
    assert inv("kernels.build", "--arch", "sm75") == 2
    assert "--arch sm75: kernel int8-prefill-attn is built for sm86, sm90" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the CUDA pre-pass


def test_build_arch_maps_a_gpu_to_the_code_that_runs_on_it():
    from rig.kernels.cubin import build_arch

    assert [build_arch(c) for c in ((8, 6), (8, 9), (9, 0), (8, 0), (12, 0))] == ["sm86", "sm86", "sm90", None, None]


def test_the_cuda_prepass_refuses_inputs_it_would_misread():
    torch = pytest.importorskip("torch")
    from rig.kernels import cubin

    q, k = torch.zeros(4, 2, 64, dtype=torch.bfloat16), torch.zeros(4, 1, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="q is on cpu: the CUDA pre-pass runs on a CUDA device"):
        cubin.smooth_quant(q, k, cu, 4)
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        cubin.smooth_quant(q, k, cu.long(), 4)


class _FakeDriver:
    """libcuda's calls cubin.py makes, recorded instead of run: the launches' grids and arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.names: dict[int, str] = {}

    def cuCtxGetCurrent(self, cur):
        cur._obj.value = 1234
        self.calls.append(("cuCtxGetCurrent",))
        return 0

    def cuDeviceGet(self, dev, ordinal):
        return 0

    def cuDevicePrimaryCtxRetain(self, ctx, dev):
        ctx._obj.value = 1234
        return 0

    def cuCtxSetCurrent(self, ctx):
        return 0

    def cuModuleLoadData(self, mod, image):
        mod._obj.value = 7
        self.calls.append(("cuModuleLoadData",))
        return 0

    def cuModuleGetFunction(self, fn, mod, name):
        fn._obj.value = 100 + len(self.names)
        self.names[fn._obj.value] = name.decode()
        return 0

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        import ctypes

        name = self.names[fn.value]
        ints = 3  # every entry point ends with (heads, dim, block)
        count = {"rig_sq_block_sums_bf16": 6, "rig_sq_k_mean": 6, "rig_sq_quant_bf16": 8}[name]
        args = [ctypes.c_void_p.from_address(params[j]).value for j in range(count - ints)]
        args += [ctypes.c_int.from_address(params[j]).value for j in range(count - ints, count)]
        self.calls.append(("cuLaunchKernel", name, (gx, gy, gz), (bx, by, bz), shared, stream.value, args))
        return 0


def test_the_cuda_prepass_queues_its_four_kernels_with_the_arguments_smooth_quant_cu_takes(tmp_path, monkeypatch):
    """Without a GPU: the driver recorded, not called. One context check and one module load for two
    calls; per call block_sums -> k_mean -> quant(q) -> quant(k - mean) on torch's current stream, with
    the grids and parameter order smooth_quant.cu declares, the workspace and mean passed along."""
    torch = pytest.importorskip("torch")
    import contextlib
    import types

    from rig.kernels import cubin

    drv = _FakeDriver()
    monkeypatch.setattr(cubin, "_driver", lambda: drv)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=4242))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    fatbin = tmp_path / "smooth_quant.fatbin"
    fatbin.write_bytes(b"not a real fatbin: the driver is fake")
    lens, hq, hkv, dim = [1, 64, 130], 6, 2, 128
    tokens, block = sum(lens), 64
    q, k = torch.zeros(tokens, hq, dim, dtype=torch.bfloat16), torch.zeros(tokens, hkv, dim, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1, 65, 195], dtype=torch.int32)
    first = ["cuCtxGetCurrent", "cuModuleLoadData", "cuCtxGetCurrent"]
    for others in (first, ["cuCtxGetCurrent"]):
        drv.calls.clear()
        q_i8, q_scale, k_i8, k_scale = cubin.smooth_quant(q, k, cu, 130, fatbin=fatbin)
        launches = [c for c in drv.calls if c[0] == "cuLaunchKernel"]
        assert [c[0] for c in drv.calls if c[0] != "cuLaunchKernel"] == others
        blocks, batch, threads = 3, 3, (128, 1, 1)
        ptr = lambda t: t.data_ptr()  # noqa: E731
        sums, mean, quant_q, quant_k = launches
        assert sums[1:6] == ("rig_sq_block_sums_bf16", (blocks, hkv, batch), threads, 0, 4242)
        assert sums[6][:2] == [ptr(k), ptr(cu)] and sums[6][3:] == [hkv, dim, block]
        ws = sums[6][2]
        assert mean[1:6] == ("rig_sq_k_mean", (hkv, batch, 1), threads, 0, 4242)
        assert mean[6][:2] == [ptr(cu), ws] and mean[6][3:] == [hkv, dim, block]
        k_mean = mean[6][2]
        assert quant_q[1:6] == ("rig_sq_quant_bf16", (blocks, hq, batch), threads, 0, 4242)
        assert quant_q[6] == [ptr(q), None, ptr(cu), ptr(q_i8), ptr(q_scale), hq, dim, block]
        assert quant_k[1:6] == ("rig_sq_quant_bf16", (blocks, hkv, batch), threads, 0, 4242)
        assert quant_k[6] == [ptr(k), k_mean, ptr(cu), ptr(k_i8), ptr(k_scale), hkv, dim, block]
        assert len({ws, k_mean, ptr(q), ptr(k)}) == 4


def test_a_checked_call_skips_only_what_its_caller_checked(monkeypatch):
    """``checked=True`` (int8_prefill_attention ran check_varlen and the cu_seqlens checks): the pre-pass's
    own checks still refuse a CPU tensor or a dtype it cannot read."""
    torch = pytest.importorskip("torch")
    from rig.kernels import cubin

    q, k = torch.zeros(4, 2, 64, dtype=torch.bfloat16), torch.zeros(4, 1, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="q is on cpu: the CUDA pre-pass runs on a CUDA device"):
        cubin.smooth_quant(q, k, cu, 4, checked=True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    with pytest.raises(ValueError, match="q and k must both be bfloat16 or both float16"):
        cubin.smooth_quant(q.float(), k, cu, 4, checked=True)


def _fatbin_for_gpu(tmp_path: Path, arch: str) -> Path:
    """A fatbin to test: built here when nvcc is present, else the build folder's when its CUDA part is
    fresh for ``arch`` (a GPU host without nvcc runs a build carried from one with it)."""
    from rig.kernels import build_folder

    if toolchain.find_nvcc() is not None:
        kbuild.build(KERNEL, build_root=tmp_path, kernels_root=None)
        return tmp_path / KERNEL / "fat" / "smooth_quant.fatbin"
    out = build_folder(KERNEL)
    try:
        part = manifest.read(out).part("cuda")
    except (FileNotFoundError, ValueError):
        part = None
    if part is None or manifest.part_problems(kspec.load_named(KERNEL), paths.KERNELS / KERNEL, out, part, arch):
        pytest.skip(f"no nvcc here and no fresh CUDA build for {arch} in {out}: run `inv kernels.build` on a host "
                    "with nvcc and carry .rig/kernels here")
    return out / "fat" / "smooth_quant.fatbin"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("heads, dim", [((24, 4), 256), ((8, 4), 256), ((4, 2), 128), ((2, 1), 64),
                                        ((3, 1), 72), ((2, 1), 100), ((2, 1), 512)])
def test_the_cuda_prepass_equals_the_torch_spec_bit_for_bit(tmp_path, dtype_name, heads, dim):
    """head_dim 64..256 take quant's 16-byte path; 72 (9 lanes in 96 threads), 100 (not whole lanes) and
    512 (a block of 64 does not fit its registers) take the general one."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from rig import kernels
    from rig.kernels import cubin

    ref = kernels.load(KERNEL, "reference")
    fatbin = _fatbin_for_gpu(tmp_path, cubin.build_arch(torch.cuda.get_device_capability()))
    dtype = getattr(torch, dtype_name)
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    lens = [1, 63, 64, 65, 0, 300, 1000, 129]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    tokens = sum(lens)
    q = torch.randn(tokens, heads[0], dim, generator=gen).mul(3).to(dtype)
    k = torch.randn(tokens, heads[1], dim, generator=gen).to(dtype)
    k[:, :, ::37] += 40.0  # outlier channels shared by every token: what the smoothing removes
    expected = ref.smooth_quant(q, k, cu, max(lens))
    dev = torch.device("cuda")
    poison = (torch.full(q.shape, 99, dtype=torch.int8, device=dev), torch.full(q.shape[:2], float("nan"), device=dev),
              torch.full(k.shape, 99, dtype=torch.int8, device=dev), torch.full(k.shape[:2], float("nan"), device=dev))
    got = cubin.smooth_quant(q.to(dev), k.to(dev), cu.to(dev), max(lens), out=poison, fatbin=fatbin)
    torch.cuda.synchronize()
    names = ("q_i8", "q_scale", "k_i8", "k_scale")
    for name, g, e in zip(names, got, expected, strict=True):
        g = g.cpu()
        same = torch.equal(g.view(torch.int32), e.view(torch.int32)) if g.dtype == torch.float32 else torch.equal(g, e)
        assert same, (f"{name} differs from reference.smooth_quant (seed {seed}, {dtype_name}, heads {heads}, "
                      f"dim {dim}): {(g != e).sum().item()} of {g.numel()} elements")
    # the negative control: a max_seqlen shorter than the longest sequence leaves tokens unwritten
    short = tuple(t.clone().fill_(99 if t.dtype == torch.int8 else float("nan")) for t in poison)
    cubin.smooth_quant(q.to(dev), k.to(dev), cu.to(dev), 64, out=short, fatbin=fatbin)
    assert not torch.equal(short[0].cpu(), expected[0])


@pytest.mark.gpu
def test_the_cuda_prepass_at_65536_tokens_equals_the_spec_on_the_gpu(tmp_path):
    """One 64k-token sequence at the model's shape: the reference run on the GPU too (the CPU one is slow)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from rig import kernels
    from rig.kernels import cubin

    ref = kernels.load(KERNEL, "reference")
    fatbin = _fatbin_for_gpu(tmp_path, cubin.build_arch(torch.cuda.get_device_capability()))
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(int.from_bytes(os.urandom(4), "little"))
    q = torch.randn(65536, 24, 256, generator=gen, device=dev).to(torch.bfloat16)
    k = (torch.randn(65536, 4, 256, generator=gen, device=dev) + 10.0).to(torch.bfloat16)
    cu = torch.tensor([0, 65536], dtype=torch.int32, device=dev)
    expected = ref.smooth_quant(q, k, cu, 65536)
    got = cubin.smooth_quant(q, k, cu, 65536, fatbin=fatbin)
    for name, g, e in zip(("q_i8", "q_scale", "k_i8", "k_scale"), got, expected, strict=True):
        assert torch.equal(g, e), f"{name}: {(g != e).sum().item()} of {g.numel()} elements differ"


def test_innermost_loop_is_the_shortest_backward_branch_span_of_real_length():
    """A listing shaped like cuobjdump's: an outer loop holding an inner one (with a forward branch inside it) and a
    3-instruction spin loop. innermost_loop counts the inner loop's body, branch included, not the spin loop (too
    short to be work), not the outer one, and nothing for a listing without a backward branch; loop_head the outer
    loop's instructions before the inner one, and nothing where no loop encloses the inner."""
    def line(addr: int, text: str) -> str:
        return f"        /*{addr:04x}*/                   {text} ;   /* 0x0000000000000000 */"

    body = [line(0x00, "MOV R1, c[0x0][0x28]"), line(0x10, "IADD3 R2, R2, 0x1, RZ")]           # outer loop from 0x10
    inner = [line(0x20 + 16 * i, "HMMA.16816.F32 R4, R8, R12, R4") for i in range(5)]       # inner loop from 0x20
    inner += [line(0x70, "@P1 BRA 0x90"), line(0x80, "FMUL R4, R4, R5"), line(0x90, "LOP3.LUT R6, R6, 0xf, RZ, 0xc0"),
              line(0xa0, "@P0 BRA 0x20")]
    spin = [line(0xb0, "NOP"), line(0xc0, "@P2 BRA 0xb0")]
    tail = [line(0xd0, "@P3 BRA 0x10"), line(0xe0, "EXIT")]
    sass = "\n".join(["code for sm_90", *body, *inner, *spin, *tail])
    assert kbuild.innermost_loop(sass, least=4) == {"HMMA.16816.F32": 5, "BRA": 2, "FMUL": 1, "LOP3.LUT": 1}
    assert kbuild.innermost_loop(sass, least=20) == {}
    assert kbuild.innermost_loop("\n".join(body)) == {}
    # the outer loop's part before the inner one (a decode kernel's group start): the IADD3 at 0x10 alone
    assert kbuild.loop_head(sass, least=4) == {"IADD3": 1}
    assert kbuild.loop_head("\n".join(["code for sm_90", *inner]), least=4) == {}   # no enclosing loop
