"""The greedy digest: a hash of greedy outputs for fixed prompts, for the reproducibility check.

Same host + same plan (same vLLM, patches, model, knobs) -> the same digest is what we expect and
record; a changed digest says "the numerics changed", not "the model got worse". vLLM does not
promise bit-identical greedy output across runs in general: without batch-invariant kernels
(``VLLM_BATCH_INVARIANT``, not used here) a request's logits depend on what else shares its batch,
and chunked prefill splits long prompts at budget boundaries that depend on the queue. The digest
therefore sends its prompts one at a time, each prompt shorter than one prefill chunk, on a server
the battery has otherwise drained — the conditions under which repeated runs on one host agree.
Across GPUs, drivers, kernels or thread counts (CPU) near-tied logits may flip and the digest differs.
"""

from __future__ import annotations

import hashlib
import json


def run(client, suite) -> dict:
    """Greedy completions of the suite's prompts, sequentially; the digest and the texts."""
    texts = []
    for prompt in suite.prompts:
        body = {"prompt": prompt, "max_tokens": suite.max_tokens, "temperature": 0, "seed": 0}
        texts.append(client.completion(body)["choices"][0]["text"])
    return {"digest": digest(suite.prompts, texts), "prompts": len(texts), "max_tokens": suite.max_tokens,
            "texts": texts}


def digest(prompts: list[str], texts: list[str]) -> str:
    """sha256 over the canonical JSON of (prompt, output) pairs."""
    blob = json.dumps(list(zip(prompts, texts, strict=True)), ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()
