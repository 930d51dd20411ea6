"""Gates: the pass/fail judgement of one battery result.

Absolute gates need no reference: per suite, a perplexity ceiling and an lm-eval floor
(``quality/gates.toml`` ``[floors]``), and per profile the garbage and tool-call counts. A model
passes them on its own merits or not at all. Relative gates compare with a reference result of the
same model measured with the same battery (same text sets, byte for byte): perplexity may rise by a
bounded percentage, the lm-eval score may drop by a bounded number of points. A relative gate
without a reference fails — a quality number with nothing to compare it to is not a pass. In a run
that *is* the reference (``--save-reference``) the relative gates judge nothing: their verdict is
``reference``, never ``pass``, and the run passes only when every absolute gate does.

Whether the reference was measured on the same setup is ``rig.repro.diff``'s verdict, the one ``inv
repro`` and bench compare give (``check_setup``). The plan differs on purpose (the reference is the
known-good plan, e.g. without INT8 activations), the model's files may differ on purpose (another
quantization of the model; the degraded control), and rig's commit moves on after a reference is saved,
so those do not refuse; a GPU, engine (vLLM, torch, CUDA, transformers, lm-eval, Python) or patch series
that differ do: the relative gates would then measure the setup, not the plan or the weights. The whole
verdict is recorded in the result (``reference.fingerprint``) and printed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rig.quality.suite import Gates, SuiteFloors

Verdict = Literal["pass", "fail", "reference"]
REFERENCE_DETAIL = "this run is the reference: nothing to compare with"


class ReferenceMismatch(ValueError):
    """The reference was measured on something else; comparing would be meaningless."""


@dataclass(frozen=True)
class Gate:
    """One judged number. ``passed`` is None for a relative gate of the reference run (not judged)."""

    name: str
    value: float | None
    limit: str
    passed: bool | None
    detail: str = ""

    @property
    def verdict(self) -> Verdict:
        return "reference" if self.passed is None else "pass" if self.passed else "fail"

    def to_json(self) -> dict:
        return {"name": self.name, "value": self.value, "limit": self.limit, "passed": self.passed,
                "verdict": self.verdict, "detail": self.detail}


def check_reference(result: dict, ref: dict) -> None:
    """Same perplexity sets (sha256) and, when both ran one, the same lm-eval task; or ReferenceMismatch."""
    mine_task = (result.get("lmeval") or {}).get("task")
    ref_task = (ref.get("lmeval") or {}).get("task")
    if mine_task and ref_task and (mine_task, result["lmeval"]["limit"]) != (ref_task, ref["lmeval"]["limit"]):
        raise ReferenceMismatch(f"reference lm-eval {ref_task} x{ref['lmeval']['limit']}, "
                                f"this run {mine_task} x{result['lmeval']['limit']}")
    mine = {s["name"]: s["sha256"] for s in result["perplexity"]["sets"]}
    theirs = {s["name"]: s["sha256"] for s in ref.get("perplexity", {}).get("sets", [])}
    if mine != theirs:
        raise ReferenceMismatch(f"reference perplexity sets {theirs}, this run {mine}")


SETUP_GROUPS = ("GPU", "engine", "patches")


def setup_comparison(result_fp: dict | None, ref_fp: dict | None):
    """``rig.repro.diff.compare`` of the reference's fingerprint (A) with this run's (B); None when the
    reference records none (saved before references carried one)."""
    from rig.repro import diff

    if not result_fp or not ref_fp:
        return None
    return diff.compare(ref_fp, result_fp)


def check_setup(result_fp: dict | None, ref_fp: dict | None) -> None:
    """ReferenceMismatch when a difference in the measuring setup (``SETUP_GROUPS``) touches results."""
    cmp = setup_comparison(result_fp, ref_fp)
    bad = [d for d in cmp.touching if d.group in SETUP_GROUPS] if cmp else []
    if bad:
        raise ReferenceMismatch("measured on another setup (`inv repro` verdict: " + cmp.verdict + "): "
                                + "; ".join(f"{d.line()} ({d.why})" for d in bad))


def _relative_ppl(name: str, value: float, ref: float | None, pct: float, is_ref: bool) -> Gate:
    limit = f"<= ref x {1 + pct / 100:.3f}"
    if is_ref:
        return Gate(name, value, limit, None, REFERENCE_DETAIL)
    if ref is None:
        return Gate(name, value, limit, False, "no reference result (run a known-good plan with --save-reference)")
    change = 100 * (value / ref - 1)
    return Gate(name, value, f"<= {ref * (1 + pct / 100):.4g} (ref {ref:.4g} +{pct}%)", change <= pct,
                f"{change:+.2f}% vs reference")


def _lmeval(result: dict, gates: Gates, floors: SuiteFloors, ref: dict | None, is_ref: bool) -> list[Gate]:
    lm = result["lmeval"]
    score = lm["score"]
    out = []
    if floors.lmeval_min is not None:
        out.append(Gate("lmeval.absolute", score, f">= {floors.lmeval_min:g} points", score >= floors.lmeval_min,
                        f"{lm['task']} x{lm['limit']}, {lm.get('filter', '')}".rstrip(", ")))
    if floors.lmeval_format_min is not None:
        fmt = lm.get("format_pct")
        out.append(Gate("lmeval.format", fmt, f">= {floors.lmeval_format_min:g}% as '#### N'",
                        fmt is not None and fmt >= floors.lmeval_format_min,
                        "answers in the task's strict format, right or wrong"))
    rscore = (ref or {}).get("lmeval", {}) or {}
    limit = f">= ref - {gates.gsm8k_max_drop_points} points"
    if is_ref:
        out.append(Gate("lmeval.relative", score, limit, None, REFERENCE_DETAIL))
    elif "score" not in rscore:
        out.append(Gate("lmeval.relative", score, limit, False, "no reference lm-eval score"))
    else:
        drop = rscore["score"] - score
        out.append(Gate("lmeval.relative", score, f">= {rscore['score'] - gates.gsm8k_max_drop_points:g} "
                        f"(ref {rscore['score']:g} - {gates.gsm8k_max_drop_points:g})",
                        drop <= gates.gsm8k_max_drop_points, f"{-drop:+.2f} points vs reference"))
    return out


def judge(result: dict, gates: Gates, floors: SuiteFloors, ref: dict | None, is_ref: bool = False) -> list[Gate]:
    """Every gate of the result."""
    ppl = result["perplexity"]
    rppl = ref["perplexity"] if ref else {}
    out = [Gate("ppl.overall.absolute", ppl["overall"], f"<= {floors.ppl_max:g}", ppl["overall"] <= floors.ppl_max)]
    out.append(_relative_ppl("ppl.overall.relative", ppl["overall"], rppl.get("overall"),
                             gates.ppl_max_increase_pct, is_ref))
    if result.get("lmeval"):
        out += _lmeval(result, gates, floors, ref, is_ref)
    g = result["garbage"]
    out.append(Gate("garbage.greedy", g["greedy"]["flagged"], f"<= {gates.garbage_greedy_max} flagged",
                    g["greedy"]["flagged"] <= gates.garbage_greedy_max, f"of {g['greedy']['total']}"))
    pct = 100 * g["sampled"]["flagged"] / max(1, g["sampled"]["total"])
    out.append(Gate("garbage.sampled", round(pct, 2), f"<= {gates.garbage_sampled_max_pct}% flagged",
                    pct <= gates.garbage_sampled_max_pct, f"{g['sampled']['flagged']} of {g['sampled']['total']}"))
    if result.get("toolcall"):
        t = result["toolcall"]
        tp = 100 * t["passed"] / t["total"]
        out.append(Gate("toolcall.parsed", round(tp, 2), f">= {gates.toolcall_min_pct}%",
                        tp >= gates.toolcall_min_pct, f"{t['passed']} of {t['total']}"))
    return out


def verdict(judged: list[Gate]) -> tuple[bool, str]:
    """(passed, summary): a run passes when no gate failed and at least one gate was judged."""
    failed = [g.name for g in judged if g.passed is False]
    if failed:
        return False, f"failed: {', '.join(failed)}"
    if any(g.passed is None for g in judged):
        return True, "every absolute gate passed; relative gates not judged (this run is the reference)"
    return True, "every gate passed"
