"""Training rig's tiny models on its generated corpus: the data, the tokenizer and the loop.

The documents teach one small domain (the templated English / German / Python of ``rig.models.corpus``),
the chat shapes a newcomer's first requests take (a city, German, Python, a tool call in the Qwen XML
format) and the tiny battery's recall questions (``rig.models.recall``). The quality battery's dense
control (``rig.quality.controls``) and the trained tiny hybrid (``models/recipes/tiny-hybrid-train.toml``,
the embedded default) both learn from them.

The hybrid trains its MTP layer too (vLLM's ``Qwen3_5MTP`` forward, rebuilt from transformers' layers:
normed embedding of token t+1 and normed final hidden state of token t, concatenated, ``fc``, one
full-attention decoder layer, the shared ``lm_head``; it predicts token t+2), so ``SPEC=mtp`` has
something to accept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from rig import paths, tomlfile
from rig.models import corpus, folder, recall, tiny


class DataRecipe(Protocol):
    """What the data functions read of a recipe (the dense control's dataclass or a train file)."""

    seed: int
    documents: int
    recall_docs: int
    vocab_size: int


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city"}},
            "required": ["city"],
        },
    },
}
THINK_OFF = "<think>\n\n</think>\n\n"


def _about(rng: random.Random, place: str) -> str:
    """An English sentence of the corpus's templates about ``place``."""
    line = corpus.english(rng)
    for p in corpus.PLACES:
        line = line.replace(p, place)
    return line


ASK_GERMAN = ["Schreib bitte einen Satz auf Deutsch.", "Einen Satz auf Deutsch, bitte.", "Sag etwas auf Deutsch."]
ASK_CODE = ["Write a Python function, please.", "Show me some Python code.", "Write a small Python function."]


def _chat(user: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": THINK_OFF + answer}]


def chats(rng: random.Random) -> list[tuple[list[dict], list | None]]:
    """The conversation shapes the model learns: three kinds of request, each answered in its own kind
    (English about a city, German, Python), and a tool call when a tool is offered."""
    place = rng.choice(corpus.PLACES)
    call = {"function": {"name": "get_weather", "arguments": {"city": place}}}
    weather = [{"role": "user", "content": f"What is the weather in {place}?"},
               {"role": "assistant", "content": THINK_OFF, "tool_calls": [call]}]
    return [
        (_chat(f"What is there to see in {place}?", _about(rng, place)), None),
        (_chat(rng.choice(ASK_GERMAN), corpus.german(rng)), None),
        (_chat(rng.choice(ASK_CODE), corpus.python_code(rng).rstrip("\n")), None),
        (weather, [WEATHER_TOOL]),
    ]


def documents(recipe: DataRecipe, render) -> list[str]:
    """The training documents: corpus text of the three domains, rendered chats (``render``) and few-shot
    blocks of the tiny battery's lm-eval task (rig_recall, its test questions held out)."""
    rng = random.Random(recipe.seed)
    docs: list[str] = []
    while len(docs) < recipe.documents:
        docs.append(" ".join(corpus.english(rng) for _ in range(3)))
        docs.append(" ".join(corpus.german(rng) for _ in range(3)))
        docs.append(corpus.python_code(rng) + corpus.python_code(rng))
        docs += [render(messages, tools) for messages, tools in chats(rng)]
        docs += [recall.recall_shots(rng) for _ in range(recipe.recall_docs)]
    return docs[: recipe.documents]


def _bpe(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(tiny.SPECIAL) - len(tiny.MARKUP),
                                  special_tokens=tiny.SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _wrap(tok):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=None, model_max_length=32768)
    fast.add_tokens(tiny.MARKUP)
    fast.chat_template = tiny.TEMPLATE.read_text()
    return fast


def tokenizer_and_docs(recipe: DataRecipe):
    """A BPE trained on the documents themselves (two passes: plain text, then with rendered chats)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    plain = corpus.generate(recipe.seed, lines_per_domain=500).splitlines()
    first = _wrap(_bpe(plain, recipe.vocab_size))

    def render(messages, tools):
        return first.apply_chat_template(messages, tools=tools, tokenize=False)

    docs = documents(recipe, render)
    return _wrap(_bpe(docs, recipe.vocab_size)), docs


def _rows(fast, docs: list[str], seq_len: int, rng: random.Random):
    """Whole documents packed into rows of seq_len tokens (never split: a tool call must see its
    prompt); the tail of a row is padding that the loss ignores. Returns (input_ids, labels)."""
    import torch

    sep = fast.convert_tokens_to_ids("<|endoftext|>")
    order = list(range(len(docs)))
    rng.shuffle(order)
    rows: list[list[int]] = [[]]
    for i in order:
        ids = (fast(docs[i])["input_ids"] + [sep])[:seq_len]
        if len(rows[-1]) + len(ids) > seq_len:
            rows.append([])
        rows[-1] += ids
    x = torch.full((len(rows), seq_len), sep, dtype=torch.long)
    y = torch.full((len(rows), seq_len), -100, dtype=torch.long)
    for r, ids in enumerate(rows):
        x[r, : len(ids)] = torch.tensor(ids)
        y[r, : len(ids)] = torch.tensor(ids)
    return x, y




# ---------------------------------------------------------------------------------------------- the recipe


class TrainError(ValueError):
    """A train recipe or a trained folder that cannot be used; the message names the file and the key."""


class TrainRecipe(BaseModel):
    """One train file (models/recipes/*-train.toml): everything that shapes the trained weights."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = Field(description="format version of this file")
    kind: Literal["train"] = Field(description="file kind")
    description: str = Field(min_length=1, description="one line: what the model is for")
    arch: Literal["hybrid"] = Field(description="the tiny architecture (rig.models.tiny.TinySpec defaults)")
    seed: int = Field(ge=0, description="seeds the corpus, the tokenizer's documents, the init and the batches")
    documents: int = Field(ge=100, description="training documents generated")
    recall_docs: int = Field(ge=0, description="recall few-shot documents per round of the document mix")
    seq_len: int = Field(ge=32, le=4096, description="tokens per training row (documents are never split)")
    batch: int = Field(ge=1, description="rows per step")
    steps: int = Field(ge=1, description="optimizer steps")
    lr: float = Field(gt=0, lt=1, description="peak AdamW learning rate (linear warm-up, cosine decay)")
    warmup: int = Field(ge=1, description="warm-up steps")
    intermediate_size: int = Field(ge=16, description=(
        "MLP width; every other dimension is TinySpec's (the random hybrid's shape), this one is narrowed so the "
        "committed weights stay under 16 MB"))
    mtp_loss_weight: float = Field(ge=0, description="weight of the MTP layer's loss (token t+2) beside the main one")
    output: str = Field(min_length=1, description="where the committed result lives, relative to the checkout")

    @property
    def vocab_size(self) -> int:
        return self.spec().vocab_size

    def spec(self) -> tiny.TinySpec:
        """The served shape: TinySpec's defaults, so every test written for the random hybrid's shape holds."""
        return tiny.TinySpec(arch=self.arch, seed=self.seed, intermediate_size=self.intermediate_size)

    def digest(self) -> str:
        """sha256 of the recipe and of the code that makes the data and trains: either changes, retrain."""
        import inspect

        parts = [self.model_dump_json(), inspect.getsource(corpus), inspect.getsource(recall),
                 tiny.TEMPLATE.read_text(), json.dumps(tiny.asdict(self.spec()), sort_keys=True)]
        parts += [inspect.getsource(f) for f in (_about, _chat, chats, documents, _bpe, _wrap, tokenizer_and_docs,
                                                 _rows, _mtp_loss, _step_lr, train, _denormals_flushed, _train)]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def load_recipe(path: Path) -> TrainRecipe:
    """Parse and validate a train file; TrainError naming the file and each bad key."""
    label = tomlfile.shown(path)
    return tomlfile.validate(TrainRecipe, tomlfile.read(path, TrainError, label), TrainError, label)


# ------------------------------------------------------------------------------------------------ the loop


def _step_lr(recipe: TrainRecipe, step: int) -> float:
    return recipe.lr * min(1.0, (step + 1) / recipe.warmup) * 0.5 * (1 + math.cos(math.pi * step / recipe.steps))


def _mtp_modules(config: dict):
    """vLLM's Qwen3_5MTP as transformers modules: fc, three zero-centred norms, one full-attention layer."""
    import torch
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    base = {k: v for k, v in config.items() if k not in ("mtp_num_hidden_layers", "torch_dtype", "dtype")}
    n = config.get("mtp_num_hidden_layers", 0)
    cfg = AutoConfig.for_model(**{**base, "layer_types": ["full_attention"] * n, "num_hidden_layers": n})
    cfg._attn_implementation = "sdpa"  # causal without a mask, as vLLM's MTP layer attends
    h, eps = config["hidden_size"], config["rms_norm_eps"]
    mtp = torch.nn.ModuleDict({"fc": torch.nn.Linear(2 * h, h, bias=False),
                               "pre_fc_norm_hidden": Qwen3_5RMSNorm(h, eps),
                               "pre_fc_norm_embedding": Qwen3_5RMSNorm(h, eps), "norm": Qwen3_5RMSNorm(h, eps),
                               "layers": torch.nn.ModuleList(Qwen3_5DecoderLayer(cfg, i) for i in range(n))})
    torch.nn.init.normal_(mtp["fc"].weight, std=0.02)
    return mtp


def _mtp_loss(model, mtp, x, y, hidden):
    """Token t+2 from (final normed hidden state of t, embedding of t+1), as vLLM's proposer feeds it."""
    import torch

    emb = mtp["pre_fc_norm_embedding"](model.model.embed_tokens(x[:, 1:]))
    h = mtp["fc"](torch.cat([emb, mtp["pre_fc_norm_hidden"](hidden[:, :-1])], dim=-1))
    pos = torch.arange(1, x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
    rope = model.model.rotary_emb(h, pos)
    for layer in mtp["layers"]:
        out = layer(h, position_embeddings=rope, position_ids=pos)
        h = out[0] if isinstance(out, tuple) else out
    logits = model.lm_head(mtp["norm"](h))[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y[:, 2:].reshape(-1),
                                             ignore_index=-100)


def _device(requested: str | None) -> str:
    import torch

    if requested:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def train(recipe: TrainRecipe, steps: int | None = None, device: str | None = None, log=print) -> dict:
    """Train (the first ``steps`` only, when given); returns config, tokenizer, float32 state dict
    (MTP weights under ``mtp.``) and the loss curve. fp32 weights, bf16 autocast on CUDA."""
    import torch

    dev = _device(device)
    if dev == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    with _denormals_flushed(dev):
        return _train(recipe, steps, dev, log)


@contextlib.contextmanager
def _denormals_flushed(dev: str):
    """Denormal floats make CPU arithmetic several times slower where they appear; flushing them to zero changes
    nothing a bf16 checkpoint keeps. Process-wide in torch, so it is switched back off afterwards."""
    import torch

    torch.set_flush_denormal(dev == "cpu")
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _train(recipe: TrainRecipe, steps: int | None, dev: str, log) -> dict:
    """The loop of ``train``, on ``dev``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(recipe.seed)
    fast, docs = tokenizer_and_docs(recipe)
    ids = {t: fast.convert_tokens_to_ids(t) for t in tiny.SPECIAL}
    config = tiny._hybrid_config(recipe.spec(), ids)
    base = {k: v for k, v in config.items() if k not in ("mtp_num_hidden_layers", "torch_dtype", "dtype")}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**base), dtype=torch.float32).to(dev)
    mtp = _mtp_modules(config).to(dev)
    x, y = _rows(fast, docs, recipe.seq_len, random.Random(recipe.seed))
    params = list(model.parameters()) + list(mtp.parameters())
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(recipe.seed)
    curve: list[dict] = []
    start = time.monotonic()
    total = steps or recipe.steps
    for step in range(total):
        for group in opt.param_groups:
            group["lr"] = _step_lr(recipe, step)
        pick = torch.randint(0, x.shape[0], (recipe.batch,), generator=gen)
        xb, yb = x[pick].to(dev), y[pick].to(dev)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            out = model(input_ids=xb, labels=yb, output_hidden_states=True)
            mloss = _mtp_loss(model, mtp, xb, yb, out.hidden_states[-1]) if recipe.mtp_loss_weight else out.loss * 0
        loss = out.loss + recipe.mtp_loss_weight * mloss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0 or step == total - 1:
            curve.append({"step": step, "loss": round(out.loss.item(), 4), "mtp_loss": round(mloss.item(), 4)})
            log(f"train step {step:5d}  loss {out.loss.item():.3f}  mtp {mloss.item():.3f}  "
                f"{time.monotonic() - start:7.1f} s")
    state = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    state |= {f"mtp.{k}": v.detach().float().cpu().contiguous() for k, v in mtp.state_dict().items()}
    stats = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "steps": total,
             "seconds": round(time.monotonic() - start, 1), "rows": int(x.shape[0]), "torch": torch.__version__}
    return {"config": config, "tokenizer": fast, "state": state, "curve": curve, "stats": stats}


# ------------------------------------------------------------------------------------------- the result


def save(recipe: TrainRecipe, result: dict, dest: Path) -> Path:
    """Write a servable folder atomically (``rig.models.folder.write``): bf16 safetensors, tokenizer, config, and a
    manifest with the recipe's digest, the loss curve and every file's sha256."""
    record = {"recipe": recipe.model_dump(), "recipe_digest": recipe.digest(), "training": result["stats"],
              "curve": result["curve"]}
    return folder.write(dest.resolve(), result["config"], result["tokenizer"], result["state"], record)


DEFAULT_RECIPE = paths.ROOT / "models" / "recipes" / "tiny-hybrid-train.toml"


def committed(recipe_path: Path = DEFAULT_RECIPE) -> Path:
    """The committed trained model of ``recipe_path``, verified file by file (sha256 of its manifest) and
    trained from this recipe and code (its digest); TrainError naming what differs and how to retrain."""
    recipe = load_recipe(recipe_path)
    folder = paths.ROOT / recipe.output
    shown = tomlfile.shown(recipe_path)
    if not tiny.verify(folder):
        raise TrainError(f"{recipe.output}: missing, or a file differs from its manifest's sha256; "
                         f"retrain with: inv model.train --recipe {shown}")
    record = json.loads((folder / tiny.MANIFEST).read_text())
    if record.get("recipe_digest") != recipe.digest():
        raise TrainError(f"{recipe.output} was trained from another recipe or training code than {shown} and "
                         f"rig.models.train now hold; retrain with: inv model.train --recipe {shown}")
    return folder


def served_copy(recipe_path: Path = DEFAULT_RECIPE) -> Path:
    """The committed model, as the models folder serves it: a verified copy (vLLM and HF write nothing into
    a model folder, but the checkout's files stay untouched either way)."""
    src = committed(recipe_path)
    dest = paths.models_dir() / f"trained-hybrid-{json.loads((src / tiny.MANIFEST).read_text())['recipe_digest'][:10]}"
    if dest.exists() and tiny.verify(dest):
        return dest
    work = dest.with_name(dest.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(src, work)
    shutil.rmtree(dest, ignore_errors=True)
    work.rename(dest)
    return dest


def evaluate(folder: Path, n: int = 50, device: str | None = None) -> dict:
    """What the trained model does, in HF transformers (not vLLM): greedy answers to the first ``n`` rig_recall
    test questions, 3-shot as lm-eval renders them (right = the last number is the answer), and to one prompt of
    each chat shape. Printed by the training run so the model's quality band is on record beside its loss."""
    import re

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = _device(device)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(dev).eval()
    rows = {k: [json.loads(line) for line in recall.recall_problems(*seed_n).splitlines()]
            for k, seed_n in (("train", (2023, 8)), ("test", recall.RECALL_TEST))}
    shots = "\n\n".join(f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows["train"][:3]) + "\n\n"

    def greedy(text: str, new: int) -> str:
        ids = tok(text, return_tensors="pt").input_ids.to(dev)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False)

    right = formatted = 0
    for r in rows["test"][:n]:
        text = greedy(shots + f"Question: {r['question']}\nAnswer:", 24).split("\n\n")[0].split("<|endoftext|>")[0]
        nums, want = re.findall(r"-?[0-9]+", text), r["answer"].split("#### ")[1]
        right += bool(nums) and nums[-1] == want
        formatted += "#### " in text
    answers = {}
    for messages, tools in chats(random.Random(99)):
        prompt = tok.apply_chat_template(messages[:1], tools=tools, tokenize=False, add_generation_prompt=True)
        answers[messages[0]["content"]] = greedy(prompt + THINK_OFF, 48).split("<|im_end|>")[0]
    return {"recall_right": right, "recall_formatted": formatted, "recall_n": n, "answers": answers}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="train a tiny model from a train recipe")
    ap.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
    ap.add_argument("--out", type=Path, help="output folder (default: the recipe's output)")
    ap.add_argument("--steps", type=int, help="train only the first N steps")
    ap.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    ap.add_argument("--eval", action="store_true", help="then print evaluate()'s answers")
    a = ap.parse_args()
    r = load_recipe(a.recipe)
    out = save(r, train(r, a.steps, a.device), a.out or paths.ROOT / r.output)
    print(out)
    if a.eval:
        print(json.dumps(evaluate(out, device=a.device), indent=2, ensure_ascii=False))
