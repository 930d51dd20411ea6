"""The trained tiny hybrid (rig.models.train): its recipe file, the committed weights, and that the recipe
still trains the way the committed model was trained."""

from __future__ import annotations

import json
import shutil

import pytest

from rig import paths
from rig.models import tiny
from rig.models import train as tr


def _recipe_text(**changes: str) -> str:
    text = tr.DEFAULT_RECIPE.read_text()
    for key, value in changes.items():
        lines = [f"{key} = {value}" if line.startswith(f"{key} =") else line for line in text.splitlines()]
        text = "\n".join(lines) + "\n"
    return text


def test_recipe_errors_name_the_file_and_every_bad_key(tmp_path):
    bad = tmp_path / "bad-train.toml"
    bad.write_text(_recipe_text(steps="0", lr="2") + "colour = 'red'\n")
    with pytest.raises(tr.TrainError) as e:
        tr.load_recipe(bad)
    msg = str(e.value)
    assert str(bad) in msg and "steps:" in msg and "lr:" in msg and "colour:" in msg
    bad.write_text("steps = [")
    with pytest.raises(tr.TrainError, match="not valid TOML"):
        tr.load_recipe(bad)


def test_inv_model_train_refuses_bad_input_before_training(inv, tmp_path, capsys):
    assert inv("model.train", "--recipe", str(tmp_path / "missing.toml"), "--out", str(tmp_path / "o")) == 2
    assert "cannot read it" in capsys.readouterr().err
    assert inv("model.train", "--device", "tpu", "--out", str(tmp_path / "o")) == 2
    assert "--device 'tpu'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_committed_model_is_this_recipes_and_intact():
    """Every file's sha256 and the digest of recipe + training code: an edit to either without retraining fails."""
    folder = tr.committed()
    assert folder == paths.ROOT / "models" / "trained" / "tiny-hybrid"
    assert (folder / "model.safetensors").stat().st_size <= 16 * 10**6  # the bound, decimal MB
    config = json.loads((folder / "config.json").read_text())
    random_shape = tiny._hybrid_config(tiny.TinySpec(), {"<|endoftext|>": 0, "<|im_end|>": 1})
    same = [k for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "layer_types",
                        "linear_num_value_heads", "linear_value_head_dim", "mtp_num_hidden_layers")]
    assert {k: config[k] for k in same} == {k: random_shape[k] for k in same}


def test_an_altered_file_or_recipe_is_refused_naming_the_fix(tmp_path, monkeypatch):
    src = tr.committed()
    copy = tmp_path / "repo"
    shutil.copytree(src, copy / "m")
    recipe = tmp_path / "r-train.toml"
    recipe.write_text(_recipe_text(output='"m"'))
    monkeypatch.setattr(paths, "ROOT", copy)
    with pytest.raises(tr.TrainError, match="another recipe"):  # same files, the recipe's output moved: digest
        tr.committed(recipe)
    (copy / "m" / "config.json").write_text("{}")
    with pytest.raises(tr.TrainError, match="inv model.train --recipe"):
        tr.committed(recipe)


@pytest.mark.filterwarnings("ignore:The value of the smallest subnormal")  # numpy, while denormals are flushed
def test_the_recipe_still_trains_like_the_committed_model():
    """The recipe's first 26 steps on this CPU reproduce the committed model's recorded loss curve (steps 0 and
    25): same data, tokenizer, init and batches. Training all of it takes ~50 min on 2 cores (the manifest's
    `training.seconds`); the committed file is what that run wrote."""
    record = json.loads((tr.committed() / tiny.MANIFEST).read_text())
    recorded = {row["step"]: row for row in record["curve"]}
    result = tr.train(tr.load_recipe(tr.DEFAULT_RECIPE), steps=26, device="cpu", log=lambda _: None)
    assert result["stats"]["rows"] == record["training"]["rows"]
    for row in result["curve"]:
        want = recorded[row["step"]]
        assert row["loss"] == pytest.approx(want["loss"], rel=0.02), (row, want)
        assert row["mtp_loss"] == pytest.approx(want["mtp_loss"], rel=0.02), (row, want)


def test_the_mtp_layer_sees_only_the_past():
    """Token t's MTP logits must not change when a later token does (vLLM's MTP layer is causal)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = tiny.TinySpec(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=64, linear_num_key_heads=1, linear_num_value_heads=2, vocab_size=64)
    config = tiny._hybrid_config(spec, {"<|endoftext|>": 0, "<|im_end|>": 1})
    base = {k: v for k, v in config.items() if k not in ("mtp_num_hidden_layers", "torch_dtype", "dtype")}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**base), dtype=torch.float32)
    mtp = tr._mtp_modules(config)
    x = torch.randint(0, 64, (1, 24))
    y = x.clone()

    def loss_at(ids, pos):
        labels = torch.full_like(ids, -100)
        labels[0, pos + 2] = y[0, pos + 2]
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        return tr._mtp_loss(model, mtp, ids, labels, hidden).item()

    before = loss_at(x, 5)
    later = x.clone()
    later[0, 12:] = (later[0, 12:] + 1) % 64
    assert loss_at(later, 5) == pytest.approx(before, abs=1e-6)
    earlier = x.clone()
    earlier[0, 3] = (earlier[0, 3] + 1) % 64
    assert loss_at(earlier, 5) != pytest.approx(before, abs=1e-6)
