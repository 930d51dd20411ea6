"""``inv kernels.build``: compile a kernel folder's CUDA sources and Triton kernels, deterministically.

Same inputs, same bytes: nvcc runs on copies of the declared sources in a fresh temporary folder,
called with relative paths and the pinned flags (rig.kernels.toolchain), so neither the checkout's
location nor the build folder's reaches the output; Triton compiles ahead of time for each arch
(``triton.compile`` with a ``GPUTarget`` — no GPU needed, its bundled ptxas does the work) with
line information off, into a throw-away cache. The tests build twice into different folders and
compare every artefact's sha256.

Each part is compiled into a staging folder first; only when everything compiled does the
build folder change: the old manifest goes first, then the artefacts are moved in (each an
atomic rename), then the new manifest is written atomically. A build that stops half-way leaves
no manifest, which preflight reports as "not built" — never a manifest describing other bytes.

A host without Triton builds the CUDA part only and says so; a host without nvcc (a GPU host
running a build made elsewhere) keeps a CUDA part that is still fresh and refuses otherwise.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rig.atomic import write_atomic
from rig.kernels import build_folder, load, manifest, toolchain
from rig.kernels import spec as kspec

SHARED_BYTES_PER_BLOCK = {"sm86": 101_376, "sm90": 232_448}
"""Most shared memory one thread block may use (CUDA C++ Programming Guide, "Technical Specifications per
Compute Capability": 99 KB on 8.6, 227 KB on 9.0). Without a GPU nothing else checks a cubin built for
the RTX 3090 against its limit before it fails to launch there."""

Progress = Callable[[str], None]


class BuildError(RuntimeError):
    """A build cannot be made; the message names the kernel, the file or tool, and what to do."""


@dataclass
class Staged:
    """One part compiled into the staging folder: its manifest entry and the files to move into place."""

    part: manifest.PartBuild
    files: dict[str, Path] = field(default_factory=dict)


def parse_archs(text: str, spec: kspec.KernelSpec) -> list[str]:
    """``--arch sm86,sm90`` -> the archs to build; empty text means every arch the kernel.toml declares."""
    if not text.strip():
        return list(spec.archs)
    archs = list(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    bad = [a for a in archs if a not in spec.archs]
    if bad:
        raise BuildError(f"--arch {','.join(bad)}: kernel {spec.name} is built for {', '.join(spec.archs)} "
                         f"(its {kspec.SPEC_FILE})")
    return archs


def _hash_inputs(folder: Path, spec: kspec.KernelSpec, part: manifest.Part) -> dict[str, str]:
    return manifest.source_hashes(folder, manifest.inputs_of(spec, part))


def _artefact(path: Path, rel: str, archs: list[str], source: str, meta: dict | None = None) -> manifest.Artefact:
    return manifest.Artefact(path=rel, sha256=manifest.sha256_file(path), size_bytes=path.stat().st_size,
                             archs=sorted(archs), source=source, meta=meta or {})


def _stage(stage: Path, rel: str, data: bytes) -> Path:
    """Write one artefact's bytes to ``rel`` under the staging folder; returns its path there (what
    ``install`` moves to ``rel`` in the build folder)."""
    dest = stage / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)
    return dest


def compile_cuda(spec: kspec.KernelSpec, folder: Path, archs: list[str], stage: Path, say: Progress) -> Staged:
    """nvcc each [[cuda]] source to one fatbin (SASS per arch, PTX of the newest) in a temp folder of copies."""
    nvcc, version = toolchain.pinned_nvcc()
    flags = toolchain.nvcc_flags(archs)
    sources = _hash_inputs(folder, spec, "cuda")
    staged = Staged(manifest.PartBuild(part="cuda", built=True, archs=sorted(archs), sources=sources, flags=flags,
                                       toolchain={"nvcc": version},
                                       input_sha256=manifest.input_hash("cuda", archs, sources, flags,
                                                                        {"nvcc": version})))
    artefacts = []
    for c in spec.cuda:
        say(f"nvcc {version}: {c.source} for {', '.join(archs)}")
        out_name = f"{Path(c.source).stem}.fatbin"
        with tempfile.TemporaryDirectory(prefix="rig-nvcc-") as tmp:
            for f in (c.source, *c.headers):
                (Path(tmp) / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(folder / f, Path(tmp) / f)
            cmd = [str(nvcc), *flags, "-o", out_name, c.source]
            r = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, env=toolchain.nvcc_env())
            if r.returncode != 0:
                raise BuildError(f"kernel {spec.name}: nvcc failed on {c.source} (exit {r.returncode}):\n"
                                 f"{(r.stderr or r.stdout).strip()}")
            data = (Path(tmp) / out_name).read_bytes()
        missing = [e for e in c.entry_points if e.encode() not in data]
        if missing:
            raise BuildError(f"kernel {spec.name}: {c.source} does not define the entry points {', '.join(missing)} "
                             f"its {kspec.SPEC_FILE} declares (extern \"C\" __global__)")
        rel = f"fat/{out_name}"
        staged.files[rel] = dest = _stage(stage, rel, data)
        artefacts.append(_artefact(dest, rel, archs, c.source))
    staged.part = staged.part.model_copy(update={"artefacts": artefacts})
    return staged


@contextlib.contextmanager
def _triton_settings() -> Iterator[None]:
    """Triton's compile settings for a reproducible build: no line info (it embeds the module's absolute
    path), a throw-away cache (never a cubin some other setting produced, nothing written to ~/.triton)."""
    import triton

    with tempfile.TemporaryDirectory(prefix="rig-triton-cache-") as cache, triton.knobs.cache.scope(), \
            triton.knobs.compilation.scope():
        triton.knobs.cache.dir = cache
        triton.knobs.compilation.disable_line_info = True
        yield


def _target(aot: dict, arch: str) -> int:
    """The compute capability an aot_specs() entry compiles for: its ``target``, else the arch's number."""
    return int(aot.get("target", arch.removeprefix("sm")))


def _compile(aot: dict, arch: str):
    """``triton.compile`` of one aot_specs() entry for its target (no GPU needed): the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource
    if getattr(aot["fn"], "is_gluon", lambda: False)():  # a Gluon kernel (triton.experimental.gluon): own front end
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn=aot["fn"], signature=aot["signature"], constexprs=aot.get("constexprs", {}),
                 attrs=aot.get("attrs", {}))
    options = {"enable_fp_fusion": True, **aot.get("options", {})}
    return triton.compile(src, target=GPUTarget("cuda", _target(aot, arch), 32), options=options)


def compile_spec(aot: dict, arch: str) -> tuple[bytes, dict[str, int | str]]:
    """One entry of ``aot_specs()`` compiled for its arch: (cubin bytes, metadata the launcher needs)."""
    compiled = _compile(aot, arch)
    md = compiled.metadata
    meta = {"kernel": md.name, "shared_bytes": int(md.shared), "num_warps": int(md.num_warps),
            "num_stages": int(md.num_stages)}
    return compiled.asm["cubin"], meta


def pointer_attrs(signature: dict[str, str], multiples_of_16: Iterable[str] = ()) -> dict[tuple[int], list[list]]:
    """16-byte alignment for every pointer argument of a Triton signature: what the JIT assumes for torch's
    allocations, so a kernel compiled ahead of time (or checked) is the one the JIT would build. The JIT also
    specializes an integer argument whose value is a multiple of 16; name those in ``multiples_of_16`` (an
    offset or stride so declared lets loads through it be 16 bytes wide)."""
    names = list(signature)
    wide = set(multiples_of_16)
    return {(names.index(n),): [["tt.divisibility", 16]] for n, ty in signature.items()
            if ty.startswith("*") or n in wide}


def ptxas_usage(ptx: str, target: int) -> str:
    """ptxas -v's register and spill lines for ``ptx`` on sm_<target> (Triton's bundled ptxas), or ''."""
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


_SASS_OP = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


def sass_text(cubin: bytes) -> str:
    """A cubin's SASS listing by Triton's bundled cuobjdump; '' where it cannot run."""
    from triton import knobs

    try:
        tool = knobs.nvidia.cuobjdump
    except (AttributeError, RuntimeError):  # a Triton without the knob, or without its bundled binary
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.cubin"
        src.write_bytes(cubin)
        return subprocess.run([tool.path, "-sass", str(src)], capture_output=True, text=True).stdout


def sass_mix(cubin: bytes) -> dict[str, int]:
    """How many of each SASS instruction (with its width suffixes, e.g. LDG.E.128, LDS.U8) a cubin holds,
    by Triton's bundled cuobjdump; {} where it cannot run. Static counts: a loop body's instructions count
    once, which for a kernel whose work is one loop is its mix per iteration. What it shows without a GPU: byte
    loads where 16-byte ones were meant, barriers, shared-memory round trips, conversions."""
    return _counts(sass_text(cubin))


def _counts(sass: str) -> dict[str, int]:
    """Each SASS instruction's count in a listing (with its width suffixes)."""
    return dict(Counter(m.group(1) for line in sass.splitlines() if (m := _SASS_OP.match(line))))


_SASS_ADDR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s")


def innermost_loop(sass: str, least: int = 64) -> dict[str, int]:
    """The SASS mix of a listing's innermost loop: the shortest span from a backward branch's target to the branch,
    of at least ``least`` instructions (shorter ones are spin or tail loops). Where a kernel's work is a token loop,
    this is one iteration's instructions, what a static count of the whole kernel blurs with its prologue and
    once-a-group work. Branches inside the loop (a rarely taken rescale) count as if taken. {} without a loop."""
    lines, inner, _ = _loops(sass, least)
    return _mix_between(lines, *inner) if inner else {}


def loop_head(sass: str, least: int = 64) -> dict[str, int]:
    """The SASS mix of the loop around the innermost one (innermost_loop's), from its start to the inner loop's: what
    runs once an outer iteration before the inner loop — a decode kernel's group start, where it loads a group's
    scales and readies the query. {} without an enclosing loop."""
    lines, inner, outer = _loops(sass, least)
    return _mix_between(lines, outer[0], inner[0] - 1) if outer else {}


def _loops(sass: str, least: int) -> tuple[list[tuple[int, str]], tuple[int, int] | None, tuple[int, int] | None]:
    """A listing's (address, line) pairs, its innermost loop's span of at least ``least`` instructions and the
    shortest span that encloses it (each a backward branch's target and address; None where there is none)."""
    lines = [(int(m.group(1), 16), line) for line in sass.splitlines() if (m := _SASS_ADDR.match(line))]
    spans = [(int(b.group(1), 16), at) for at, line in lines
             if (b := re.search(r"\bBRA (0x[0-9a-f]+)", line)) and int(b.group(1), 16) < at]
    spans = [(a, b) for a, b in spans if sum(a <= at <= b for at, _ in lines) >= least]
    if not spans:
        return lines, None, None
    inner = min(spans, key=lambda span: span[1] - span[0])
    around = [(a, b) for a, b in spans if a < inner[0] and b > inner[1]]
    return lines, inner, min(around, key=lambda span: span[1] - span[0]) if around else None


def _mix_between(lines: list[tuple[int, str]], a: int, b: int) -> dict[str, int]:
    """The instruction mix of the lines at addresses a ... b."""
    return dict(Counter(m.group(1) for at, line in lines if a <= at <= b and (m := _SASS_OP.match(line))))


_PTXAS_FIGURES = {"registers": r"Used (\d+) registers", "barriers": r"used (\d+) barriers",
                  "stack": r"(\d+) bytes stack frame", "spill_stores": r"(\d+) bytes spill stores",
                  "spill_loads": r"(\d+) bytes spill loads"}
"""ptxas -v's wording of each figure CompileCheck.usage reads."""


@dataclass(frozen=True)
class CompileCheck:
    """One aot_specs()-shaped entry compiled for its arch: the shared memory Triton reserves, ptxas's
    registers and spills and the SASS instruction mix (sass_mix), or why it did not compile."""

    name: str
    arch: str
    options: dict
    shared_bytes: int | None = None
    ptxas: str = ""
    error: str = ""
    sass: dict[str, int] = field(default_factory=dict)
    loop: dict[str, int] = field(default_factory=dict)
    """innermost_loop's mix: one iteration of the kernel's innermost loop."""
    head: dict[str, int] = field(default_factory=dict)
    """loop_head's mix: the enclosing loop's part before the innermost one (a decode kernel's group start)."""

    def sass_summary(self, top: int = 12) -> str:
        """The instruction count and the ``top`` opcodes (suffixes folded), then global/shared loads and stores
        and barriers with their widths: where a kernel's instructions go."""
        return _mix_summary(self.sass, top)

    def loop_summary(self, top: int = 8) -> str:
        """sass_summary of the innermost loop (one iteration); '' without one."""
        return _mix_summary(self.loop, top)

    def head_summary(self, top: int = 8) -> str:
        """sass_summary of the enclosing loop's part before the innermost one; '' without one."""
        return _mix_summary(self.head, top)

    @property
    def usage(self) -> dict[str, int]:
        """ptxas's figures as numbers (registers, barriers, stack, spill_stores, spill_loads; those it printed),
        so a check reads a resource rather than a sentence."""
        return {key: int(m.group(1)) for key, pattern in _PTXAS_FIGURES.items()
                if (m := re.search(pattern, self.ptxas))}

    @property
    def fits(self) -> bool:
        """Compiled, and within the arch's shared memory per block (an arch rig has no limit for never fits)."""
        return self.shared_bytes is not None and self.shared_bytes <= SHARED_BYTES_PER_BLOCK.get(self.arch, 0)


def _mix_summary(mix: dict[str, int], top: int) -> str:
    """A SASS mix as 'N instructions: the top opcodes (suffixes folded); loads, stores and barriers by width'."""
    if not mix:
        return ""
    base: Counter[str] = Counter()
    for op, n in mix.items():
        base[op.split(".")[0]] += n
    mem = {op: n for op, n in sorted(mix.items()) if op.split(".")[0] in ("LDG", "STG", "LDS", "STS", "BAR")}
    tops = ", ".join(f"{op} {n}" for op, n in base.most_common(top))
    return f"{base.total()} instructions: {tops}; " + ", ".join(f"{op} {n}" for op, n in mem.items())


def compile_check(aots: Iterable[dict], sass: bool = False) -> Iterator[CompileCheck]:
    """Compile each entry (aot_specs()'s shape: name, fn, signature, constexprs, attrs, options, arch/target) for
    its arch without a GPU, one at a time as the caller iterates. What it catches before a GPU run: a kernel that
    does not compile for an arch (its ``error``: the finding, reported beside the others, not raised), spills,
    or needs more shared memory than the arch has; with ``sass``, its instruction mix too. Used by kernels' own
    reports and bench scripts alike."""
    for aot in aots:
        arch = _spec_arch(aot, "compile_check")
        options = aot.get("options", {})
        try:
            compiled = _compile(aot, arch)
        except Exception as e:  # noqa: BLE001 - a failed compile is the finding
            yield CompileCheck(aot["name"], arch, options, error=f"{type(e).__name__}: {str(e)[:200]}")
            continue
        text = sass_text(compiled.asm["cubin"]) if sass else ""
        yield CompileCheck(aot["name"], arch, options, int(compiled.metadata.shared),
                           ptxas_usage(compiled.asm["ptx"], _target(aot, arch)),
                           sass=_counts(text), loop=innermost_loop(text), head=loop_head(text))


def _spec_arch(aot: dict, module: str) -> str:
    """The arch an aot_specs() entry is for: its ``arch``, else from its ``target`` compute capability."""
    arch = aot.get("arch") or (f"sm{aot['target']}" if "target" in aot else None)
    if arch is None or "name" not in aot or "fn" not in aot or "signature" not in aot:
        raise BuildError(f"{module}: an aot_specs() entry lacks name, fn, signature or arch/target: {sorted(aot)}")
    return arch


def compile_triton(spec: kspec.KernelSpec, folder: Path, archs: list[str], stage: Path, say: Progress,
                   root: Path | None) -> Staged:
    """Every aot_specs() entry of every [[triton]] module for the requested archs, as cubin + metadata."""
    version = toolchain.triton_version()
    sources = _hash_inputs(folder, spec, "triton")
    flags = list(toolchain.TRITON_SETTINGS)
    versions = {"triton": version or "none"}
    part = manifest.PartBuild(part="triton", built=False, archs=sorted(archs), sources=sources, flags=flags,
                              toolchain=versions,
                              input_sha256=manifest.input_hash("triton", archs, sources, flags, versions))
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return Staged(part.model_copy(update={"why_not": f"triton is not importable here: {e}"}))
    artefacts, files = [], {}
    with _triton_settings():
        for t in spec.triton:
            module = load(spec.name, Path(t.module).stem, root, fresh=True)
            if not hasattr(module, "aot_specs"):
                raise BuildError(f"kernel {spec.name}: {t.module} has no aot_specs() (what to compile ahead of time)")
            for aot in module.aot_specs():
                arch = _spec_arch(aot, t.module)
                if arch not in archs:
                    continue
                say(f"triton {version}: {aot['name']} ({arch})")
                cubin, meta = compile_spec(aot, arch)
                limit = SHARED_BYTES_PER_BLOCK[arch]
                if meta["shared_bytes"] > limit:
                    raise BuildError(f"kernel {spec.name}: {aot['name']} needs {meta['shared_bytes']} bytes of shared "
                                     f"memory; {arch} allows {limit} per block: smaller tiles or fewer stages")
                rel = f"triton/{arch}/{aot['name']}.cubin"
                files[rel] = dest = _stage(stage, rel, cubin)
                artefacts.append(_artefact(dest, rel, [arch], t.module, meta))
    unlisted = sorted(set(archs) - {a for x in artefacts for a in x.archs})
    if unlisted:
        raise BuildError(f"kernel {spec.name}: aot_specs() lists nothing for {', '.join(unlisted)}")
    return Staged(part.model_copy(update={"built": True, "artefacts": sorted(artefacts, key=lambda a: a.path)}), files)


def _reuse_cuda(name: str, spec: kspec.KernelSpec, folder: Path, archs: list[str], out_dir: Path,
                why: str) -> Staged:
    """Without nvcc: keep the existing CUDA part when it is fresh and covers these archs (a fatbin built
    elsewhere and carried here), else refuse naming nvcc."""
    try:
        old = manifest.read(out_dir).part("cuda")
    except (FileNotFoundError, ValueError):
        old = None
    if old is not None and old.built and set(archs) <= set(old.archs):
        if not manifest.part_problems(spec, folder, out_dir, old, archs[0]):
            return Staged(old, {a.path: out_dir / a.path for a in old.artefacts})
    raise BuildError(f"kernel {name}: {why}; the CUDA part cannot be built here and no fresh build of it "
                     f"for {', '.join(archs)} exists in {out_dir}")


def install(out_dir: Path, staged: list[Staged], m: manifest.Manifest) -> None:
    """Replace the build folder's content: manifest out, artefacts in (atomic renames), leftovers out, manifest in."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / manifest.MANIFEST).unlink(missing_ok=True)
    keep = set()
    for s in staged:
        for rel, src in s.files.items():
            keep.add(rel)
            dest = out_dir / rel
            if src.resolve() == dest.resolve():
                continue
            write_atomic(dest, src.read_bytes())
    for old in sorted(out_dir.rglob("*"), reverse=True):
        rel = old.relative_to(out_dir).as_posix()
        if old.is_file() and rel not in keep and rel != manifest.MANIFEST:
            old.unlink()
        elif old.is_dir() and not any(old.iterdir()):
            old.rmdir()
    write_atomic(out_dir / manifest.MANIFEST, m.to_json().encode())


def build(name: str, archs_text: str = "", kernels_root: Path | None = None, build_root: Path | None = None,
          say: Progress = lambda _msg: None) -> manifest.Manifest:
    """Build kernel ``name`` for the archs of ``--arch`` (default: all it declares); returns its manifest."""
    spec = kspec.load_named(name, kernels_root)
    folder = kspec.folder_of(name, kernels_root)
    archs = parse_archs(archs_text, spec)
    out_dir = build_folder(name, build_root)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".stage-{name}-", dir=out_dir.parent) as tmp:
        stage = Path(tmp)
        staged = []
        if spec.cuda:
            try:
                staged.append(compile_cuda(spec, folder, archs, stage, say))
            except toolchain.ToolchainError as e:
                if toolchain.find_nvcc() is not None:  # an nvcc that is not the pinned one: refuse, naming it
                    raise BuildError(f"kernel {name}: {e}") from None
                say(f"{e}: keeping the CUDA part built before, if it is still fresh")
                staged.append(_reuse_cuda(name, spec, folder, archs, out_dir, str(e)))
        if spec.triton:
            part = compile_triton(spec, folder, archs, stage, say, kernels_root)
            if not part.part.built:
                say(f"{part.part.why_not}: the Triton part is not built (serve's preflight will refuse it here)")
            staged.append(part)
        parts = [s.part for s in staged]
        m = manifest.Manifest(kernel=name, archs=sorted(archs), input_sha256=manifest.combined_hash(parts),
                              parts=parts)
        install(out_dir, staged, m)
    return m


def build_all(names: list[str], archs_text: str = "", kernels_root: Path | None = None,
              build_root: Path | None = None, say: Progress = lambda _msg: None) -> list[manifest.Manifest]:
    """Build each named kernel (every kernel of the checkout when ``names`` is empty)."""
    names = names or kspec.available(kernels_root)
    if not names:
        raise BuildError(f"no kernel folder with a {kspec.SPEC_FILE} under {kernels_root or 'kernels/'}")
    return [build(n, archs_text, kernels_root, build_root, say) for n in names]


def summary(m: manifest.Manifest, root: Path | None = None) -> str:
    """What a build made, one line per artefact (path, size, sha256), as `inv kernels.build` prints it."""
    lines = [f"{m.kernel}: input {m.input_sha256[:16]}  archs {','.join(m.archs)}  -> {build_folder(m.kernel, root)}"]
    for pb in m.parts:
        if not pb.built:
            lines.append(f"  {pb.part}: not built ({pb.why_not})")
            continue
        tools = " ".join(f"{k} {v}" for k, v in sorted(pb.toolchain.items()))
        lines.append(f"  {pb.part} ({tools}):")
        for a in pb.artefacts:
            extra = (f"  shared {a.meta['shared_bytes']} B, {a.meta['num_warps']} warps" if "shared_bytes" in a.meta
                     else "")
            lines.append(f"    {a.path}  {a.size_bytes:,} B  sha256 {a.sha256[:16]}{extra}")
    return "\n".join(lines)
