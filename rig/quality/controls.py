"""The battery's controls: a tiny model rig trains on CPU (positive) and a crudely degraded copy of it.

A gate that has never failed proves nothing, and one that has never passed proves nothing either.
The random-weight tiny model (``rig.models.tiny``) is the negative control. This module trains a
tiny model — in a couple of minutes on two cores — until it writes coherent text in one small
domain (the templated English / German / Python of ``rig.models.corpus``), answers each kind of
request (a city, German, Python) in its kind, calls a tool in the Qwen XML format when tools are
offered, and answers the tiny battery's lm-eval questions (``rig_recall``) in the task's format. It does
not learn to read the right number back in the recipe's 200 steps (it answered "26" to all 32 questions
of a greedy check): quality/gates.toml floors the tiny task's format, not its score. ``degrade`` makes a
copy with perturbed weights that the relative perplexity gate must catch.

Architecture: dense ``Qwen3ForCausalLM``, not the hybrid. ``python -m rig.quality.controls --measure``
times a forward+backward step at the recipe's width for both: on this 2-core host it printed 1.73 s
(dense) vs 7.18 s (hybrid), then 3.63 s vs 8.40 s, for 8 x 192 tokens — transformers runs Gated
DeltaNet through its reference PyTorch path without flash-linear-attention. At 2-4x the step time the
hybrid would not learn the task in the few-minute budget. vLLM serves the dense model through the same
engine, endpoints, parsers and chat template, which is what the battery checks.

Deterministic: a fixed seed, ``torch.use_deterministic_algorithms``, two threads; the result is
cached under ``models_dir()/trained-<hash of the recipe>`` and verified by the manifest's sha256s.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rig import paths
from rig.models import corpus, folder, tiny
from rig.models.train import (
    ASK_CODE,
    ASK_GERMAN,
    THINK_OFF,
    WEATHER_TOOL,
    _about,
    _bpe,
    _chat,
    _rows,
    _wrap,
    chats,
    documents,
    tokenizer_and_docs,
)
from rig.quality import lmeval


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the trained model's bytes (its hash names the cache folder)."""

    seed: int = 7
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    documents: int = 6000
    seq_len: int = 192
    batch: int = 8
    steps: int = 200
    lr: float = 4e-3
    warmup: int = 5
    threads: int = 2
    recall_docs: int = 2
    version: int = 2

    @property
    def name(self) -> str:
        """Hash of the numbers above and of the code that makes the data and trains: change either, retrain."""
        blob = json.dumps(asdict(self), sort_keys=True) + _code_digest()
        return f"trained-dense-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"

    def spec(self) -> tiny.TinySpec:
        return tiny.TinySpec(arch="dense", seed=self.seed, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                             intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                             num_attention_heads=self.num_attention_heads,
                             num_key_value_heads=self.num_key_value_heads, mtp_layers=0)


RECIPE = Recipe()


def _code_digest() -> str:
    """sha256 of what shapes the weights besides the Recipe: data, tokenizer, template, training loop."""
    import inspect

    parts = [inspect.getsource(corpus), tiny.TEMPLATE.read_text(),
             json.dumps([WEATHER_TOOL, THINK_OFF, ASK_GERMAN, ASK_CODE], sort_keys=True)]
    parts += [inspect.getsource(f) for f in (_about, _chat, chats, documents, _bpe, _wrap, tokenizer_and_docs,
                                             _rows, train, lmeval.recall_problem, lmeval.recall_shots)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def train(recipe: Recipe = RECIPE, log=print) -> tuple[dict, object, dict, dict]:
    """Train; returns (config, tokenizer, float32 state dict). Logs loss and time as it goes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    torch.use_deterministic_algorithms(True)
    fast, docs = tokenizer_and_docs(recipe)
    ids = {t: fast.convert_tokens_to_ids(t) for t in tiny.SPECIAL}
    config = tiny._dense_config(recipe.spec(), ids)
    base = {k: v for k, v in config.items() if k not in ("torch_dtype", "dtype")}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**base), dtype=torch.float32)
    x, y = _rows(fast, docs, recipe.seq_len, random.Random(recipe.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(recipe.seed)
    start = time.monotonic()
    for step in range(recipe.steps):
        lr = recipe.lr * min(1.0, (step + 1) / recipe.warmup) * 0.5 * (1 + math.cos(math.pi * step / recipe.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        pick = torch.randint(0, x.shape[0], (recipe.batch,), generator=gen)
        loss = model(input_ids=x[pick], labels=y[pick]).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == recipe.steps - 1:
            log(f"train step {step:4d}  loss {loss.item():.3f}  {time.monotonic() - start:6.1f} s")
    stats = {"final_loss": round(loss.item(), 4), "train_seconds": round(time.monotonic() - start, 1),
             "rows": int(x.shape[0])}
    return config, fast, {k: v.detach().contiguous() for k, v in model.state_dict().items()}, stats


def trained(recipe: Recipe = RECIPE, log=print) -> Path:
    """The trained model's folder: cached by the recipe's hash, trained (~2-3 min) when absent."""
    dest = paths.models_dir() / recipe.name
    if dest.exists() and tiny.verify(dest):
        return dest
    config, fast, state, stats = train(recipe, log)
    return folder.write(dest, config, fast, state, {"recipe": asdict(recipe), "training": stats})


def degrade(src: Path, noise: float = 1.0, seed: int = 0) -> Path:
    """A copy of ``src`` with every linear layer's weights perturbed: Gaussian noise of ``noise`` x the
    tensor's own standard deviation, seeded (cached next to it). The trained model shrugs off 0.5 (its
    perplexity moved +0.3% in vLLM); at 1.0 it is clearly worse, yet far from the random model: the
    relative gate is what must catch it."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    dest = src.with_name(f"{src.name}-noise{noise}-s{seed}")
    if dest.exists() and tiny.verify(dest):
        return dest
    gen = torch.Generator().manual_seed(seed)
    state = load_file(str(src / "model.safetensors"))
    out = {}
    for k in sorted(state):
        w = state[k].float()
        out[k] = w + noise * w.std() * torch.randn(w.shape, generator=gen) if k.endswith("proj.weight") else w
    config = json.loads((src / "config.json").read_text())
    how = f"gaussian noise {noise} x std per linear weight, seed {seed}"
    record = {"degraded_from": src.name, "degradation": how}
    return folder.write(dest, config, AutoTokenizer.from_pretrained(src), out, record)


def _measure(steps: int = 3) -> None:
    """Seconds per training step, hybrid vs dense, at the recipe's width (the architecture decision)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(RECIPE.threads)
    for arch in ("dense", "hybrid"):
        spec = tiny.TinySpec(arch=arch, hidden_size=RECIPE.hidden_size, intermediate_size=RECIPE.intermediate_size,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                             vocab_size=RECIPE.vocab_size, mtp_layers=0)
        ids = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
        cfg = (tiny._hybrid_config if arch == "hybrid" else tiny._dense_config)(spec, ids)
        cfg = {k: v for k, v in cfg.items() if k not in ("mtp_num_hidden_layers", "torch_dtype", "dtype")}
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
        x = torch.randint(0, RECIPE.vocab_size, (RECIPE.batch, RECIPE.seq_len))
        times = []
        for _ in range(steps):
            t = time.monotonic()
            model(input_ids=x, labels=x).loss.backward()
            times.append(time.monotonic() - t)
        print(f"{arch}: 4 layers, {RECIPE.batch}x{RECIPE.seq_len} tokens: "
              f"{min(times):.2f} s per step (best of {steps})")


def _recall_check(n: int = 32) -> None:
    """Greedy answers of the trained control (HF transformers, not vLLM) to the first ``n`` rig_recall test
    questions, 3-shot as lm-eval renders them: what the docs' statement about its recall score rests on."""
    import re

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = trained()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = {k: [json.loads(line) for line in (paths.QUALITY / "lmeval" / f"recall-{k}.jsonl").read_text().splitlines()]
            for k in ("train", "test")}
    shots = "\n\n".join(f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows["train"][:3]) + "\n\n"
    right = formatted = 0
    for r in rows["test"][:n]:
        ids = tok(shots + f"Question: {r['question']}\nAnswer:", return_tensors="pt").input_ids
        text = tok.decode(model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]).split("\n\n")[0]
        text = text.split("<|endoftext|>")[0]
        nums, want = re.findall(r"-?[0-9]+", text), r["answer"].split("#### ")[1]
        right += bool(nums) and nums[-1] == want
        formatted += "#### " in text
        print(f"{text!r}  (want {want})")
    print(f"{path.name}: {right} of {n} right, {formatted} of {n} with a '#### N' line")


if __name__ == "__main__":
    import sys

    if "--measure" in sys.argv:
        _measure()
    elif "--recall" in sys.argv:
        _recall_check(int(sys.argv[sys.argv.index("--recall") + 1]))
    else:
        print(trained())
