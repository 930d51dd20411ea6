"""Run a built fatbin's kernels from Python: the CUDA driver API through ctypes, on torch's current stream.

Why not a torch C++ extension: that would compile against torch's headers on every host, at the
first request or at install, and tie the artefact to one torch build. The fatbin built by
``inv kernels.build`` depends on nothing but the driver: ``cuModuleLoadData`` loads it into the
device's primary context (the one torch uses), ``cuModuleGetFunction`` finds an ``extern "C"``
entry point by name, ``cuLaunchKernel`` queues it on ``torch.cuda.current_stream()`` so it is
ordered with torch's own work and CUDA graphs capture it like any other kernel.

``smooth_quant`` is the int8-prefill-attn pre-pass (``kernels/int8-prefill-attn/smooth_quant.cu``;
its spec is ``reference.smooth_quant``); ``smooth_quant_or_none`` is what that kernel's ``attn.py``
asks for: the pre-pass when a fresh build for this GPU exists, else None (attn.py then falls back to
the torch pre-pass and says so).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rig.kernels import ENV_BUILD, build_folder

KERNEL = "int8-prefill-attn"
FATBIN = "fat/smooth_quant.fatbin"
MAX_GRID_YZ = 65_535
"""CUDA's limit on gridDim.y and gridDim.z (heads and sequences here)."""


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


@functools.cache
def _driver() -> ctypes.CDLL:
    """libcuda.so.1 with the prototypes this module calls (loaded once, on first use)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CudaDriverError(f"cannot load the CUDA driver (libcuda.so.1): {e}") from None
    vp, u, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
    protos = {
        "cuGetErrorName": [i, ctypes.POINTER(ctypes.c_char_p)],
        "cuDeviceGet": [ctypes.POINTER(i), i],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), i],
        "cuCtxGetCurrent": [ctypes.POINTER(vp)],
        "cuCtxSetCurrent": [vp],
        "cuModuleLoadData": [ctypes.POINTER(vp), ctypes.c_char_p],
        "cuModuleGetFunction": [ctypes.POINTER(vp), vp, ctypes.c_char_p],
        "cuLaunchKernel": [vp, u, u, u, u, u, u, u, vp, ctypes.POINTER(vp), ctypes.POINTER(vp)],
    }
    for name, args in protos.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, i
    return lib


def _check(result: int, call: str) -> None:
    """Raise CudaDriverError naming ``call`` and the driver's error name unless ``result`` is CUDA_SUCCESS."""
    if result == 0:
        return
    name = ctypes.c_char_p()
    _driver().cuGetErrorName(result, ctypes.byref(name))
    raise CudaDriverError(f"{call} failed: {(name.value or b'CUDA error').decode()} ({result})")


class Module:
    """One fatbin loaded into each device's primary context on first use there, with its functions by name."""

    def __init__(self, image: bytes, label: str) -> None:
        self.image = image
        self.label = label
        self._lock = threading.Lock()
        self._per_device: dict[int, tuple[ctypes.c_void_p, ctypes.c_void_p, dict[str, ctypes.c_void_p]]] = {}

    def _bind(self, device: int) -> tuple[ctypes.c_void_p, dict[str, ctypes.c_void_p]]:
        """Make ``device``'s primary context current on this thread (torch's threads may have none yet);
        load the module there the first time. Returns (module handle, function cache)."""
        drv = _driver()
        with self._lock:
            if device not in self._per_device:
                dev = ctypes.c_int()
                _check(drv.cuDeviceGet(ctypes.byref(dev), device), f"cuDeviceGet({device})")
                ctx = ctypes.c_void_p()
                _check(drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
                self._set_current(ctx)
                mod = ctypes.c_void_p()
                _check(drv.cuModuleLoadData(ctypes.byref(mod), self.image), f"cuModuleLoadData({self.label})")
                self._per_device[device] = (ctx, mod, {})
            ctx, mod, fns = self._per_device[device]
        self._set_current(ctx)
        return mod, fns

    @staticmethod
    def _set_current(ctx: ctypes.c_void_p) -> None:
        cur = ctypes.c_void_p()
        _check(_driver().cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
        if cur.value != ctx.value:
            _check(_driver().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def functions(self, device: int, names: Sequence[str]) -> tuple[ctypes.c_void_p, ...]:
        """The entry points ``names`` (extern "C" kernels) in ``device``'s copy of the module, with that
        device's context made current on this thread: one bind for all the launches of a call."""
        mod, fns = self._bind(device)
        for name in names:
            if name not in fns:
                fn = ctypes.c_void_p()
                _check(_driver().cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()),
                       f"cuModuleGetFunction({self.label}: {name})")
                fns[name] = fn
        return tuple(fns[name] for name in names)

    def function(self, device: int, name: str) -> ctypes.c_void_p:
        """The entry point ``name`` (an extern "C" kernel) in ``device``'s copy of the module."""
        return self.functions(device, (name,))[0]

    def launch(self, device: int, name: str, grid: Sequence[int], block: Sequence[int], args: Sequence[Any],
               stream: int) -> None:
        """Queue kernel ``name`` on ``stream``; ``args`` are ctypes values in the kernel's parameter order."""
        launch(self.function(device, name), grid, block, args, ctypes.c_void_p(stream), f"{self.label}: {name}")


def launch(fn: ctypes.c_void_p, grid: Sequence[int], block: Sequence[int], args: Sequence[Any],
           stream: ctypes.c_void_p, label: str) -> None:
    """Queue the kernel ``fn`` (from ``Module.functions``, whose device context is current) on ``stream``."""
    params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
    result = _driver().cuLaunchKernel(fn, *grid, *block, 0, stream, params, None)
    if result:
        _check(result, f"cuLaunchKernel({label}, grid {tuple(grid)}, block {tuple(block)})")


@functools.cache
def module(path: str) -> Module:
    """The fatbin at ``path``, read once per process."""
    return Module(Path(path).read_bytes(), Path(path).name)


def build_arch(capability: tuple[int, int]) -> str | None:
    """The built arch whose code runs on a GPU of this compute capability: sm90 on Hopper; sm86's SASS on
    Ampere 8.6 and Ada 8.9 (SASS runs on later minors of its major); None for anything else."""
    major, minor = capability
    if major == 9:
        return "sm90"
    if major == 8 and minor >= 6:
        return "sm86"
    return None


@functools.cache
def _reference():
    """The kernel's reference module: the pre-pass spec, QUANT_BLOCK and the input checks live there.

    Looked up once: ``load`` parses kernel.toml (~0.2 ms), and the pre-pass runs once per attention
    layer per prefill step."""
    from rig.kernels import load

    return load(KERNEL, "reference")


def check_inputs(q, k, cu_seqlens, max_seqlen: int, block: int, *, varlen: bool = True) -> None:
    """Refuse what the CUDA pre-pass would misread, naming the tensor (a kernel cannot raise).

    ``varlen=False``: the caller has already run ``reference.check_varlen`` on these inputs and checked
    that ``cu_seqlens`` is contiguous on the CUDA device (``int8_prefill_attention`` does, once per
    call); only what this kernel needs beyond that is checked here.
    """
    import torch

    if varlen:
        _reference().check_varlen(q, k, None, cu_seqlens, max_seqlen)
    for name, t in (("q", q), ("k", k), ("cu_seqlens", cu_seqlens)) if varlen else (("q", q), ("k", k)):
        if not t.is_cuda:
            raise ValueError(f"{name} is on {t.device}: the CUDA pre-pass runs on a CUDA device")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel derives its strides from the shapes)")
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype:
        raise ValueError(f"q and k must both be bfloat16 or both float16; got q {q.dtype}, k {k.dtype}")
    if block < 1:
        raise ValueError(f"block must be >= 1; got {block}")
    if q.shape[1] > MAX_GRID_YZ or cu_seqlens.numel() - 1 > MAX_GRID_YZ:
        raise ValueError(f"at most {MAX_GRID_YZ} heads and sequences per call; got {q.shape[1]} heads, "
                         f"{cu_seqlens.numel() - 1} sequences")


def _outputs(q, k, out):
    """(q_i8, q_scale, k_i8, k_scale): ``out`` checked, or fresh tensors."""
    import torch

    want = [(q.shape, torch.int8), (q.shape[:2], torch.float32), (k.shape, torch.int8), (k.shape[:2], torch.float32)]
    if out is None:
        return tuple(torch.empty(s, dtype=d, device=q.device) for s, d in want)
    names = ("q_i8", "q_scale", "k_i8", "k_scale")
    for name, t, (shape, dtype) in zip(names, out, want, strict=True):
        if t.shape != shape or t.dtype != dtype or t.device != q.device or not t.is_contiguous():
            raise ValueError(f"out {name} must be contiguous {dtype} {tuple(shape)} on {q.device}; "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    return tuple(out)


@functools.cache
def _fatbin_at(build_env: str | None, state_env: str | None, cwd: str | None) -> str:
    """The build's fatbin path for these values of the variables that move it (and the working
    directory, when one of them is relative)."""
    return str((build_folder(KERNEL) / FATBIN).absolute())


def default_fatbin() -> str:
    """The fatbin ``inv kernels.build`` made, resolved once per value of ``VLLM_RIG_KERNELS_BUILD`` and
    ``RIG_STATE_DIR`` (the pre-pass runs once per attention layer per prefill step; resolving the
    state folder is a realpath of its own)."""
    build, state = os.environ.get(ENV_BUILD), os.environ.get("RIG_STATE_DIR")
    relative = any(v and not os.path.isabs(v) for v in (build, state))
    return _fatbin_at(build, state, os.getcwd() if relative else None)


@dataclass
class Prepared:
    """One pre-pass call made ready: its outputs and workspace allocated, the entry points found in
    the device's copy of the module (whose context is current), the stream. ``launch_mean`` then
    ``launch_quant`` queue its four kernels; they are separate so a profile can time each."""

    q: Any
    k: Any
    cu_seqlens: Any
    outputs: tuple
    ws: Any
    mean: Any
    fns: tuple  # block_sums, k_mean, quant: handles for q's dtype
    stream: ctypes.c_void_p
    block: int
    blocks: int
    threads: tuple[int, int, int]
    label: str

    def launch_mean(self) -> None:
        """K's per-sequence channel means into ``mean``: block sums, then their ordered total / length."""
        p, i = (lambda t: ctypes.c_void_p(t.data_ptr())), ctypes.c_int
        hkv, dim, batch = self.k.shape[1], self.k.shape[2], self.cu_seqlens.numel() - 1
        sums, k_mean, _ = self.fns
        launch(sums, (self.blocks, hkv, batch), self.threads,
               [p(self.k), p(self.cu_seqlens), p(self.ws), i(hkv), i(dim), i(self.block)], self.stream,
               f"{self.label}: block_sums")
        launch(k_mean, (hkv, batch, 1), self.threads,
               [p(self.cu_seqlens), p(self.ws), p(self.mean), i(hkv), i(dim), i(self.block)], self.stream,
               f"{self.label}: k_mean")

    def launch_quant(self) -> None:
        """Q, then K minus its mean, to int8 per block with the block's scale (after ``launch_mean``)."""
        p, i = (lambda t: ctypes.c_void_p(t.data_ptr())), ctypes.c_int
        q_i8, q_scale, k_i8, k_scale = self.outputs
        dim, batch = self.q.shape[2], self.cu_seqlens.numel() - 1
        quant = self.fns[2]
        for x, mean, x_i8, scale in ((self.q, ctypes.c_void_p(None), q_i8, q_scale),
                                     (self.k, p(self.mean), k_i8, k_scale)):
            heads = x.shape[1]
            launch(quant, (self.blocks, heads, batch), self.threads,
                   [p(x), mean, p(self.cu_seqlens), p(x_i8), p(scale), i(heads), i(dim), i(self.block)],
                   self.stream, f"{self.label}: quant")


def prepare(q, k, cu_seqlens, max_seqlen: int, block: int, out: Sequence | None = None,
            fatbin: Path | str | None = None) -> Prepared:
    """Everything before the launches of one (checked, non-empty) pre-pass call; run it with
    ``torch.cuda.device(q.device)`` entered, as ``smooth_quant`` does (binding sets the driver context)."""
    import torch

    tokens, _, dim = q.shape
    hkv, batch = k.shape[1], cu_seqlens.numel() - 1
    outputs = _outputs(q, k, out)
    mod = module(str(fatbin) if fatbin is not None else default_fatbin())
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    suffix = "bf16" if q.dtype == torch.bfloat16 else "f16"
    fns = mod.functions(dev, (f"rig_sq_block_sums_{suffix}", "rig_sq_k_mean", f"rig_sq_quant_{suffix}"))
    ws = torch.empty(tokens // block + batch, hkv, dim, dtype=torch.float32, device=q.device)
    mean = torch.empty(batch, hkv, dim, dtype=torch.float32, device=q.device)
    stream = ctypes.c_void_p(torch.cuda.current_stream(q.device).cuda_stream)
    return Prepared(q, k, cu_seqlens, outputs, ws, mean, fns, stream, block,
                    blocks=(int(max_seqlen) + block - 1) // block, threads=(min(256, (dim + 31) // 32 * 32), 1, 1),
                    label=mod.label)


def smooth_quant(q, k, cu_seqlens, max_seqlen: int, block: int | None = None, out: Sequence | None = None,
                 fatbin: Path | None = None, *, checked: bool = False):
    """The pre-pass on the GPU: (q_i8 [T,Hq,D], q_scale fp32 [T,Hq], k_i8 [T,Hkv,D], k_scale fp32 [T,Hkv]).

    Bit-for-bit ``reference.smooth_quant`` (tests/test_kernels_build.py checks it on a GPU).
    ``max_seqlen`` must be at least the longest sequence (tokens past it are not written);
    ``out`` takes the four output tensors to write into; ``fatbin`` defaults to the build's.
    ``checked``: the caller has run ``reference.check_varlen`` and checked ``cu_seqlens``
    (``check_inputs(varlen=False)`` says what); the rest is checked here either way.
    """
    import torch

    block = _reference().QUANT_BLOCK if block is None else int(block)
    check_inputs(q, k, cu_seqlens, max_seqlen, block, varlen=not checked)
    if q.shape[0] == 0:
        return _outputs(q, k, out)
    with torch.cuda.device(q.device):
        call = prepare(q, k, cu_seqlens, max_seqlen, block, out, fatbin)
        call.launch_mean()
        call.launch_quant()
    return call.outputs


def smooth_quant_or_none(kernel: str = KERNEL) -> Callable | None:
    """``smooth_quant`` when a fresh, intact build of ``kernel`` exists for this process's GPU, else None.

    None without a CUDA device or without a build; a build that exists but is stale or altered
    is also None, with a warning naming what is wrong (serve's preflight refuses such a plan
    before a server starts, so this is a kernel used outside rig's serve).
    """
    import torch

    from rig.kernels import manifest

    if kernel != KERNEL or not torch.cuda.is_available():
        return None
    arch = build_arch(torch.cuda.get_device_capability())
    if arch is None or not (build_folder(kernel) / manifest.MANIFEST).is_file():
        return None
    problems = manifest.problems(kernel, arch)
    if problems:
        warnings.warn(f"{kernel}: the CUDA pre-pass build is not usable ({'; '.join(problems)}); "
                      f"`inv kernels.build --arch {arch}` rebuilds it", RuntimeWarning, stacklevel=2)
        return None
    return smooth_quant
