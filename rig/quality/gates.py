"""Gates: the pass/fail judgement of one battery result.

Relative gates compare with a reference result of the same model measured with the same battery
(same text sets, byte for byte): perplexity may rise by a bounded percentage, the lm-eval score
may drop by a bounded number of points. Absolute gates need no reference: a perplexity ceiling
(a model near uniform over its vocabulary) and the garbage and tool-call counts. A relative gate
without a reference fails — a quality number with nothing to compare it to is not a pass — unless
the run *is* the reference (``--save-reference``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rig.quality.suite import Gates


class ReferenceMismatch(ValueError):
    """The reference was measured on something else; comparing would be meaningless."""


@dataclass(frozen=True)
class Gate:
    """One judged number."""

    name: str
    value: float | None
    limit: str
    passed: bool
    detail: str = ""

    def to_json(self) -> dict:
        return asdict(self)


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


def _relative_ppl(name: str, value: float, ref: float | None, pct: float, is_ref: bool) -> Gate:
    limit = f"<= ref x {1 + pct / 100:.3f}"
    if is_ref:
        return Gate(name, value, limit, True, "this run is the reference")
    if ref is None:
        return Gate(name, value, limit, False, "no reference result (run a known-good plan with --save-reference)")
    change = 100 * (value / ref - 1)
    return Gate(name, value, f"<= {ref * (1 + pct / 100):.4g} (ref {ref:.4g} +{pct}%)", change <= pct,
                f"{change:+.2f}% vs reference")


def judge(result: dict, gates: Gates, ref: dict | None, is_ref: bool = False) -> list[Gate]:
    """Every gate of the result."""
    ppl = result["perplexity"]
    rppl = ref["perplexity"] if ref else {}
    out = [Gate("ppl.overall.absolute", ppl["overall"], f"<= {gates.ppl_max_absolute}",
                ppl["overall"] <= gates.ppl_max_absolute)]
    out.append(_relative_ppl("ppl.overall.relative", ppl["overall"], rppl.get("overall"),
                             gates.ppl_max_increase_pct, is_ref))
    if result.get("lmeval"):
        score = result["lmeval"]["score"]
        rscore = (ref or {}).get("lmeval", {}) or {}
        limit = f">= ref - {gates.gsm8k_max_drop_points} points"
        if is_ref:
            out.append(Gate("lmeval.score", score, limit, True, "this run is the reference"))
        elif "score" not in rscore:
            out.append(Gate("lmeval.score", score, limit, False, "no reference lm-eval score"))
        else:
            drop = rscore["score"] - score
            out.append(Gate("lmeval.score", score, f">= {rscore['score'] - gates.gsm8k_max_drop_points:g} "
                            f"(ref {rscore['score']:g} - {gates.gsm8k_max_drop_points:g})",
                            drop <= gates.gsm8k_max_drop_points, f"{-drop:+.2f} points vs reference"))
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
