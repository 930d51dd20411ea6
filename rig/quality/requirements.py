"""What the battery needs from a server, and the check that refuses one not started that way.

``prompt_logprobs`` materialises vocabulary-sized logits for every prompt token, so the server must
leave memory for them (GPU_UTIL 0.93 instead of the batch default 0.972: it OOMs otherwise), and a
cached prefix returns no prompt logprobs at all, so prefix caching must be off. The quality overlay
(profiles/overlays/quality.toml) sets both; the battery starts its own server with it, or checks a
running server's real configuration — vLLM exports its cache config on /metrics as
``vllm:cache_config_info{enable_prefix_caching="False",gpu_memory_utilization="0.93",...} 1.0``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rig.plan import Plan

INFO = re.compile(r'^vllm:cache_config_info\{(?P<labels>.*)\}\s+\S+\s*$', re.M)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Needs:
    """The server settings the battery relies on."""

    prefix_caching: bool
    max_gpu_util: float

    @classmethod
    def of_overlay(cls) -> Needs:
        """From profiles/overlays/quality.toml itself — not from a plan, where --set could override them."""
        from rig import profiles

        knobs = profiles.load_file("quality", "overlay").knobs
        return cls(prefix_caching=bool(knobs["PREFIX_CACHE"]), max_gpu_util=float(knobs["GPU_UTIL"]))


def cache_config(metrics_text: str) -> dict[str, str]:
    """The labels of vllm:cache_config_info (engine 0); empty when the server does not export it."""
    m = INFO.search(metrics_text)
    return dict(LABEL.findall(m.group("labels"))) if m else {}


def plan_refusals(plan: Plan, needs: Needs, fix: str = "drop that --set") -> list[str]:
    """Why the battery will not measure this plan's server; each reason ends with ``fix``.

    Its own server: a --set that undoes the quality overlay. A recorded server: a plan started without
    the overlay — judged on the plan because with GPU_MEM the server's /metrics show GPU_UTIL as a share
    of the whole card (0.972 of 24 GiB on a 140 GiB H200 reads about 0.17), which passes the /metrics check while
    the 24 GiB budget leaves no room for prompt_logprobs.
    """
    out = []
    if bool(plan.knobs["PREFIX_CACHE"]) != needs.prefix_caching:
        out.append(f"PREFIX_CACHE={plan.knobs['PREFIX_CACHE']} (from {plan.sources.get('PREFIX_CACHE')}): the battery "
                   f"needs {int(needs.prefix_caching)}, cached prefixes return no prompt logprobs; {fix}")
    if plan.knobs["GPU_UTIL"] > needs.max_gpu_util:
        of = (f" of GPU_MEM={plan.knobs['GPU_MEM'] / 2**30:g} GiB" if plan.knobs.get("GPU_MEM") else "")
        out.append(f"GPU_UTIL={plan.knobs['GPU_UTIL']}{of} (from {plan.sources.get('GPU_UTIL')}): the battery needs "
                   f"<= {needs.max_gpu_util} (room for prompt_logprobs); {fix}")
    return out


def refusals(metrics_text: str, needs: Needs,
             how: str = "start it with the quality overlay (`inv quality` does that when given no --url)") -> list[str]:
    """Why this server cannot be measured (empty: it can). Each reason ends with ``how`` to start it instead."""
    cfg = cache_config(metrics_text)
    if not cfg:
        return [f"the server's /metrics has no vllm:cache_config_info, so its cache settings cannot be verified; {how}"]
    out = []
    pc = cfg.get("enable_prefix_caching", "?")
    if pc != str(needs.prefix_caching):
        out.append(f"enable_prefix_caching={pc}, the battery needs {needs.prefix_caching}: cached prefixes return "
                   f"no prompt logprobs, so perplexity would be computed on part of each window; {how}")
    try:
        util = float(cfg.get("gpu_memory_utilization", "nan"))
    except ValueError:
        util = float("nan")
    if not util <= needs.max_gpu_util:
        out.append(f"gpu_memory_utilization={cfg.get('gpu_memory_utilization')}, the battery needs <= "
                   f"{needs.max_gpu_util}: prompt_logprobs needs that headroom for vocabulary-sized logits; {how}")
    return out
