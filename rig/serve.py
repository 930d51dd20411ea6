"""`serve`: preflight every precondition, start the plan's server, prove it answers, keep it up.

Everything that can be checked before a process starts is checked first (plan, vLLM's parser,
device, capacity, model, patches, port, API key), so bad input costs seconds and leaves nothing behind.
After /health turns green a 1-token completion and a burst of MAX_SEQS tiny requests run:
out-of-memory failures of a GPU server show up there, not with the first real user.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from rig import paths, running
from rig.plan import LOOPBACK, Plan, PlanError
from rig.server import ServerError, VllmServer, log_tail, port_in_use


class PreflightError(RuntimeError):
    """A precondition of serving is not met; the message says what to do."""


@dataclass(frozen=True)
class Device:
    """What the plan will run on."""

    platform: str
    name: str
    arch: str
    free_gib: float | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None


def nvml_device() -> Device:
    """GPU 0 through NVML (name, arch, total and free memory), with no plan: the one probe that serve's
    preflight, the GPU tier and the GPU benches share. Raises what NVML or its import raises."""
    import pynvml

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        name = pynvml.nvmlDeviceGetName(h)
    finally:
        pynvml.nvmlShutdown()
    return Device("gpu", str(name), f"sm{major}{minor}", mem.free / 2**30, int(mem.total), int(mem.free))


def probe_device(plan: Plan) -> Device:
    """The CUDA device through NVML (its arch and free memory) or the CPU fallback."""
    if plan.platform == "cpu":
        import platform as pf

        return Device("cpu", pf.processor() or pf.machine(), "cpu")
    try:
        dev = nvml_device()
    except Exception as e:
        raise PreflightError(f"no CUDA GPU answers NVML ({e}); on a CPU host use the cpu overlay "
                             "(the default there)") from None
    if dev.arch != plan.knobs["GPU_ARCH"]:
        print(f"rig: warning: the plan targets {plan.knobs['GPU_ARCH']}, this GPU is {dev.arch} ({dev.name}); "
              f"set GPU_ARCH={dev.arch} to validate for it", file=sys.stderr)
    planned = plan.knobs.get("GPU_MEM") or dev.total_bytes
    if planned > dev.total_bytes:
        raise PreflightError(f"GPU_MEM={planned / 2**30:.1f} GiB: this GPU has {dev.total_bytes / 2**30:.1f} GiB in "
                             "all; lower GPU_MEM or leave it 0 (the whole card)")
    need = plan.knobs["GPU_UTIL"] * planned / 2**30
    if dev.free_gib < need * 0.98:
        raise PreflightError(f"GPU has {dev.free_gib:.1f} GiB free, GPU_UTIL={plan.knobs['GPU_UTIL']} needs "
                             f"{need:.1f} GiB: stop what else uses it (nvidia-smi) or lower GPU_UTIL")
    return dev


def device_argv(plan: Plan, dev: Device) -> list[str]:
    """The plan's argv for this device: with GPU_MEM, ``--gpu-memory-utilization`` becomes a share of this card.

    vLLM sizes everything from a fraction of the card's total memory; GPU_MEM says how many bytes
    to plan for, so the fraction is GPU_UTIL x GPU_MEM / total — known only once NVML has answered,
    which is why the plan (host-independent) keeps GPU_UTIL and the conversion happens here.
    """
    argv = list(plan.argv)
    if not plan.knobs.get("GPU_MEM") or dev.total_bytes is None:
        return argv
    i = argv.index("--gpu-memory-utilization")
    share = plan.knobs["GPU_UTIL"] * plan.knobs["GPU_MEM"] / dev.total_bytes
    argv[i + 1] = f"{share:.6f}"
    print(f"rig: GPU_MEM={plan.knobs['GPU_MEM'] / 2**30:.2f} GiB of this {dev.total_bytes / 2**30:.1f} GiB "
          f"{dev.name}: --gpu-memory-utilization {argv[i + 1]} (GPU_UTIL {plan.knobs['GPU_UTIL']} of GPU_MEM)",
          file=sys.stderr, flush=True)
    return argv


def ensure_model(plan: Plan) -> Path:
    """The plan's model folder, built when it is a tiny model, verified when it has a manifest."""
    folder = Path(plan.model)
    folder = folder if folder.is_absolute() else paths.ROOT / folder
    if plan.knobs["MODEL"].startswith("tiny:"):
        from rig.models.tiny import TinySpec, build

        return build(TinySpec(arch=plan.knobs["MODEL"].split(":", 1)[1]), folder)
    if plan.knobs["MODEL"].startswith("fixture:"):
        from rig.models import fixture

        spec = fixture.FixtureSpec(plan.knobs["MODEL"].split(":", 1)[1])
        if not fixture.verify(folder):
            print(f"rig: building the benchmark fixture {spec.name} (random weights, "
                  f"{fixture.weights_bytes(spec) / 2**30:.1f} GiB) into {folder}", file=sys.stderr, flush=True)
        return fixture.build(spec, folder)
    if not (folder / "config.json").is_file():
        raise PreflightError(f"MODEL={plan.knobs['MODEL']!r}: no checkpoint at {folder} (config.json missing); "
                             "put the W4A16 AutoRound checkpoint there or set MODEL=/path/to/it")
    from rig.models.tiny import MANIFEST, verify

    if (folder / MANIFEST).exists() and not verify(folder):
        raise PreflightError(f"{folder}: files differ from its {MANIFEST}; re-download or rebuild it")
    return folder


def check_checkpoints(plan: Plan) -> None:
    """A checkpoint folder with a committed manifest (models/manifests/) is hashed against it before a start:
    a truncated or altered shard fails here, naming the file, instead of as a load error minutes later."""
    from rig.models import fetch, manifest

    try:
        checks = fetch.preflight(plan)
    except (manifest.ManifestError, manifest.VerifyError) as e:
        raise PreflightError(f"{e}; move the folder away and run `inv model.fetch --profile {plan.profile}`") from None
    for check in checks:
        print(f"rig: {check.detail}", file=sys.stderr, flush=True)


def ensure_api_key(plan: Plan) -> tuple[Path, str]:
    """Read the key file (mode 0600 required) or generate one; returns (path, key)."""
    path = Path(plan.api_key_file)
    path = path if path.is_absolute() else paths.ROOT / path
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise PreflightError(f"API_KEY_FILE {path} has mode {mode:o}: it must be readable by you only "
                             f"(`chmod 600 {path}`)")
    key = path.read_text().strip()
    if len(key) < 16:
        raise PreflightError(f"API_KEY_FILE {path}: the key is shorter than 16 characters; delete the file to "
                             "generate a new one")
    return path, key


def check_patches(plan: Plan) -> None:
    """The patches the plan relies on must be applied to the installed vLLM."""
    from rig import patches

    states = {p.name: p.state for p in patches.state().patches}
    unknown = [n for n in plan.patches if n not in states]
    if unknown:
        raise PreflightError(f"the plan needs patches {', '.join(unknown)}, which patches/series does not have")
    missing = [n for n in plan.patches if states[n] != patches.APPLIED]
    if missing:
        raise PreflightError(f"vLLM patches not applied: {', '.join(missing)}; run `inv patch.apply`")


# The knob value that runs without each kernel: named when a kernel cannot be had at all.
WITHOUT_KERNEL = {"int8-prefill-attn": "PREFILL_ATTN=auto"}


def check_kernels(plan: Plan) -> list[str]:
    """Every kernel the plan needs is built, fresh, for the plan's GPU_ARCH, its artefacts the recorded bytes.

    Refused with every problem and the command that fixes it (a kernel this checkout does not have,
    or has for other archs only, gets the knob value that runs without it instead). Returns one line
    per kernel that passed.
    """
    from rig.kernels import manifest, spec

    arch = plan.knobs["GPU_ARCH"]
    errors, ok = [], []
    for name in plan.kernels:
        problems = manifest.problems(name, arch)
        if not problems:
            ok.append(f"{name}: built for {arch}, fresh, artefacts verified")
        elif not spec.buildable(name, arch):
            errors.append(f"kernel {name}: {problems[0]}; choose {WITHOUT_KERNEL.get(name, 'a plan without it')}")
        else:
            errors.append(f"kernel {name} ({arch}): {'; '.join(problems)}; run `inv kernels.build --arch {arch}`")
    if errors:
        raise PreflightError("\n".join(errors))
    return ok


def check_capacity(plan: Plan, dev: Device) -> None:
    """The capacity planner's verdict: refuse a plan that cannot start or cannot hold its own seats,
    with the numbers; warn near a cliff, naming the knob and the value that fits. On the cpu
    platform it reads nothing of the host (the pool is KV_MEM bytes), so CI hosts agree."""
    from rig.capacity import cards, report, shape

    card = cards.from_device(dev.name, dev.total_bytes, dev.free_bytes) if dev.total_bytes else None
    try:
        b = report.for_plan(plan, card).budget
    except shape.ShapeError as e:
        raise PreflightError(str(e)) from None
    for w in b.warnings:
        print(f"rig: warning: {w}", file=sys.stderr, flush=True)
    if b.errors:
        raise PreflightError("the capacity plan cannot start (inv plan shows it whole):\n  " + "\n  ".join(b.errors))


def check_host_memory(plan: Plan, model: Path) -> None:
    """On CPU the KV cache is host RAM: refuse a server that would not fit what the host has free."""
    if plan.platform != "cpu":
        return
    from rig.capacity import host

    why = host.refusal(plan.knobs, model)
    if why:
        raise PreflightError(why)


def connect_host(plan: Plan) -> str:
    """Where we reach the server: its HOST, or loopback when it binds every interface."""
    return "127.0.0.1" if plan.knobs["HOST"] in ("0.0.0.0", "::") else plan.knobs["HOST"]


def preflight(plan: Plan) -> tuple[Device, Path, Path, str]:
    """Every check that needs no server: (device, model folder, key path, key)."""
    from rig.plan import check_with_vllm

    check_with_vllm(plan.argv)
    check_kernels(plan)
    dev = probe_device(plan)
    check_capacity(plan, dev)
    check_patches(plan)
    port = plan.knobs["PORT"]
    if port_in_use(port, connect_host(plan)):
        raise PreflightError(f"PORT={port} is in use: stop what listens there or set PORT to a free port")
    model = ensure_model(plan)
    check_checkpoints(plan)
    check_host_memory(plan, model)
    key_path, key = ensure_api_key(plan)
    return dev, model, key_path, key


def vllm_command() -> list[str]:
    """This environment's `vllm`: the venv's script beside the interpreter, else vLLM's CLI module.

    A `pip install --target` (an offline GPU host, docs/gpu.md) puts no script beside the
    interpreter; running the CLI module with the same interpreter is the same program.
    """
    script = Path(sys.executable).with_name("vllm")
    return [str(script)] if script.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def server_for(plan: Plan, key: str, log_path: Path, echo: bool = False,
               argv: list[str] | None = None) -> VllmServer:
    """A VllmServer for a plan (or its device argv): the venv's vllm, caches in the project, the key in the env."""
    argv = [*vllm_command(), *(argv or plan.argv)[1:]]
    from rig.kernels import server_env

    env = {**paths.cache_env(), **server_env(plan.env), "VLLM_API_KEY": key}
    return VllmServer(argv=argv, env=env, log_path=log_path, host=connect_host(plan), port=plan.knobs["PORT"],
                      api_key=key, served_name=plan.served_name, echo=echo)


async def _burst(server: VllmServer, n: int) -> list[str]:
    """n tiny concurrent requests; returns the errors (empty when all succeeded)."""
    body = {"model": server.served_name, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    async with httpx.AsyncClient(timeout=300.0, headers=server.headers()) as client:
        async def one(i: int) -> str | None:
            try:
                r = await client.post(f"{server.url}/v1/completions", json=body)
                return None if r.status_code == 200 else f"request {i}: HTTP {r.status_code} {r.text[:200]}"
            except httpx.HTTPError as e:
                return f"request {i}: {e!r}"

        results = await asyncio.gather(*(one(i) for i in range(n)))
    return [r for r in results if r]


def burst(server: VllmServer, n: int) -> None:
    errors = asyncio.run(_burst(server, n))
    if errors or not server.alive():
        raise ServerError(f"readiness burst of {n} requests failed: {errors[:3]}\n{log_tail(server.log_path)}")


def start(plan: Plan, echo: bool = False, log_path: Path | None = None, ready_timeout: float = 900.0) -> VllmServer:
    """Preflight, start, wait until a completion and a MAX_SEQS burst succeed; returns the running server."""
    dev, model, key_path, key = preflight(plan)
    log_path = log_path or paths.logs_dir() / f"serve-{plan.profile}-{time.strftime('%Y%m%dT%H%M%S')}.log"
    server = server_for(plan, key, log_path, echo=echo, argv=device_argv(plan, dev))
    server.start()
    try:
        server.wait_ready(timeout=ready_timeout)
        burst(server, plan.knobs["MAX_SEQS"])
    except BaseException:
        server.stop()
        raise
    return server


def run_foreground(plan: Plan) -> int:
    """`inv serve`: start, print where it is, stay up until Ctrl-C / SIGTERM / SIGHUP, then stop the whole tree."""
    if plan.platform == "cpu":
        print("rig: no CUDA GPU here: serving on vLLM's CPU backend with the tiny hybrid model "
              f"({plan.model}) — the same profile ({plan.profile}), scaled to this host", flush=True)
    for w in plan.warnings:
        print(f"rig: warning: {w}", file=sys.stderr, flush=True)
    stopping = {"sig": None}

    def on_signal(signum, _frame):
        stopping["sig"] = signum
        raise KeyboardInterrupt

    # SIGHUP too: a closed terminal would otherwise end serve alone, leaving vLLM (its own process
    # group, not the terminal's foreground) running and holding the GPU, with a record that looks live.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    server = None
    record = None
    try:
        server = start(plan, echo=True)
        record = running.write(plan, server)
        key_file = Path(plan.api_key_file)
        print(f"\nrig: ready — {server.url}/v1  model: {plan.served_name}  API key: {key_file} (mode 0600)\n"
              f"rig: log: {server.log_path}   stop: Ctrl-C\n"
              f"rig: recorded in {record}: `inv bench --running`, `inv quality --running` and "
              f"`inv verify --running` measure this server", flush=True)
        if plan.knobs["HOST"] not in LOOPBACK:
            print(f"rig: listening on {plan.knobs['HOST']}: reachable from the network, API key required", flush=True)
        while server.alive():
            time.sleep(0.5)
        print(f"rig: error: vllm serve exited with code {server.proc.returncode}:\n{log_tail(server.log_path)}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nrig: stopping the server and all its processes", flush=True)
        return 0
    except (PreflightError, PlanError, ServerError, running.RunningError) as e:
        print(f"rig: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, PreflightError | PlanError) else 1
    finally:
        if record is not None:
            running.remove(record, server.proc.pid)
        if server is not None:
            server.stop()
