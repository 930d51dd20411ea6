"""Servers for `inv bench`: one per distinct plan, started on demand, reused while the plan fits.

A protocol asks for knobs (raw: SPEC=off, PREFIX_CACHE=0; shared-prefix: one server per
variant). The pool resolves profile + overlays + the user's --set + those knobs into a plan,
reuses the running server when the plan is the same, and otherwise stops it and starts the new
one through ``rig.serve.start`` (preflight, readiness burst). A knob the user --set and a
protocol needs differently is an error before anything starts.

Servers with prefix caching get ``VLLM_SERVER_DEV_MODE=1``: vLLM 0.28 serves
``POST /reset_prefix_cache`` only then, and the bench resets the cache before each protocol.
They listen on loopback unless the plan says otherwise, behind the API key like any rig server.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rig import paths
from rig.bench.protocols import BenchError
from rig.bench.runner import Target
from rig.plan import Plan, resolve
from rig.server import free_port


def knob_sets(knobs: Mapping[str, Any]) -> dict[str, str]:
    """Knob values as --set strings (booleans and ints the way the knob parser reads them)."""
    return {k: str(int(v)) if isinstance(v, bool) else str(v) for k, v in knobs.items()}


def conflicts(user_sets: Mapping[str, str], required: Mapping[str, Any], what: str) -> list[str]:
    """--set values that contradict what a protocol needs."""
    need = knob_sets(required)
    return [f"{what} needs {k}={v}, but --set {k}={user_sets[k]} was given; drop that --set to run it"
            for k, v in need.items() if k in user_sets and user_sets[k] != v]


class ServerPool:
    """Starts, reuses and stops bench servers; ``acquire`` is a runner.Acquire."""

    def __init__(self, profile: str, overlays: Sequence[str] = (), platform: str | None = None,
                 sets: Mapping[str, str] | None = None, log_dir: Path | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.profile, self.overlays, self.platform = profile, list(overlays), platform
        self.sets = dict(sets or {})
        self.environ = environ
        self.log_dir = log_dir or paths.logs_dir()
        self.current: tuple[str, Any, Target] | None = None
        self.started = 0

    def plan_for(self, knobs: Mapping[str, Any], port: int | None = None) -> Plan:
        """The plan a protocol needing these knobs runs on (PlanError when invalid)."""
        sets = {**self.sets, **knob_sets(knobs)}
        if port is not None:
            sets["PORT"] = str(port)
        return resolve(self.profile, self.overlays, self.platform, environ=self.environ, sets=sets)

    @staticmethod
    def _key(plan: Plan) -> str:
        return repr(sorted((k, v) for k, v in plan.knobs.items() if k != "PORT"))

    @contextmanager
    def acquire(self, knobs: dict[str, Any]) -> Iterator[Target]:
        bad = conflicts(self.sets, knobs, "this protocol")
        if bad:
            raise BenchError("; ".join(bad))
        key = self._key(self.plan_for(knobs))
        if self.current is None or self.current[0] != key:
            self.close()
            # a free port unless the user chose one: never collide with a server already on 18020
            plan = self.plan_for(knobs, None if "PORT" in self.sets else free_port())
            self.current = (key, *self._start(plan))
        yield self.current[2]

    def _start(self, plan: Plan) -> tuple[Any, Target]:
        from rig.serve import start

        if plan.knobs.get("PREFIX_CACHE"):
            plan = plan.model_copy(update={"env": {**plan.env, "VLLM_SERVER_DEV_MODE": "1"}})
        log = self.log_dir / f"bench-{plan.profile}-{plan.knobs['PORT']}.log"
        server = start(plan, log_path=log)
        self.started += 1
        return server, Target.of(server, plan)

    def close(self) -> None:
        if self.current is not None:
            self.current[1].stop()
            self.current = None

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
