"""flash_attn.training with model.arch=btlm: BTLM-shaped models train with muP's rules (flash_attn.models.btlm):
muP's init, AdamW groups with the hidden matrices at optim.lr * mup_width_scale, the base rate logged, exact resume
with those groups, and the config checks around the muP fields."""
import math
import os

import pytest
import torch

from flash_attn.training.config import ConfigError, load_config
from flash_attn.training.metrics import read_jsonl
from flash_attn.training.model import build_model
from flash_attn.training.trainer import Trainer, lr_at, train

TINY = ["model.arch=btlm", "model.n_layer=2", "model.n_embd=64", "model.n_head=4", "train.seq_len=32",
        "train.micro_batch_size=4", "data.synthetic_chars=100000", "log.progress=off", "log.plot=false",
        "train.eval_batches=1", "train.eval_interval=0", "checkpoint.every=0", "log.interval=1",
        "model.mup_width_scale=0.25", "model.mup_embeddings_scale=4.0", "model.mup_output_alpha=2.0",
        "optim.lr=4e-3", "optim.warmup_steps=2"]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def btlm(tmp_path, *overrides, sub="run"):
    return load_config("tiny", TINY + [f"out_dir={tmp_path / sub}", *overrides])


def test_btlm_arch_builds_a_mup_model_with_mups_init(tmp_path):
    cfg = btlm(tmp_path, "model.n_embd=128", "model.initializer_range=0.04")
    model = build_model(cfg.model)
    c = model.config
    assert c.use_alibi and c.mup_scale_qk_dot_by_d and c.activation_function == "swiglu"
    assert (c.mup_width_scale, c.mup_embeddings_multiplier, c.mup_output_multiplier) == (0.25, 4.0, 2.0)
    layer = model.transformer.layers[0]
    hidden_std = 0.04 * math.sqrt(0.25)
    assert layer.mixer.Wqkv.weight.std().item() == pytest.approx(hidden_std, rel=0.05)
    assert layer.mlp.fc2.weight.std().item() == pytest.approx(hidden_std / math.sqrt(2 * 2), rel=0.05)
    assert model.transformer.embeddings.word_embeddings.weight.std().item() == pytest.approx(0.04, rel=0.05)


def test_trainer_uses_mups_learning_rates(tmp_path):
    cfg = btlm(tmp_path, "optim.weight_decay=0.05")
    trainer = Trainer(cfg)
    try:
        groups = {g["name"]: g for g in trainer.optimizer.param_groups}
        # LambdaLR scales each group's own initial rate, so the ratio stays w at every step
        assert groups["hidden"]["initial_lr"] == pytest.approx(4e-3 * 0.25)
        assert groups["embedding"]["initial_lr"] == groups["no_decay"]["initial_lr"] == pytest.approx(4e-3)
        assert (groups["hidden"]["weight_decay"], groups["no_decay"]["weight_decay"]) == (0.05, 0.0)
        hidden = {id(p) for p in groups["hidden"]["params"]}
        assert id(trainer.model.transformer.layers[1].mlp.fc1.weight) in hidden
        assert sum(len(g["params"]) for g in groups.values()) == len(list(trainer.model.parameters()))
    finally:
        trainer.close()


def test_gpt2_arch_keeps_its_two_groups(tmp_path):
    cfg = load_config("tiny", ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "log.progress=off",
                               "data.synthetic_chars=100000", f"out_dir={tmp_path}"])
    trainer = Trainer(cfg)
    try:
        assert [g["initial_lr"] for g in trainer.optimizer.param_groups] == [cfg.optim.lr] * 2
    finally:
        trainer.close()


def test_btlm_trains_logs_the_base_rate_and_resumes_exactly(tmp_path):
    full_cfg = btlm(tmp_path, "train.max_steps=12", sub="full")
    full = [loss for _, loss in train(full_cfg).losses]
    assert full[-1] < full[0] - 0.5
    records = [r for r in read_jsonl(os.path.join(full_cfg.out_dir, "metrics.jsonl")) if r["split"] == "train"]
    assert [r["lr"] for r in records] == pytest.approx([lr_at(s, full_cfg.optim, 12) for s in range(1, 13)])
    # The optimizer state (three groups, two rates) must come back as saved.
    train(btlm(tmp_path, "train.max_steps=12", "train.stop_at=6", sub="split"))
    rest = train(btlm(tmp_path, "train.max_steps=12", sub="split"))
    assert rest.start_step == 6 and [loss for _, loss in rest.losses] == full[6:]


@pytest.mark.parametrize("overrides, message", [
    (["model.mup_width_scale=0.5"], "applies to model.arch=btlm only"),
    (["model.arch=btlm", "model.mup_output_alpha=0"], "must be > 0"),
    (["model.arch=btlm", "model.n_head_kv=2"], "needs model.n_head_kv=None"),
    (["model.arch=btlm", "model.rotary_emb_fraction=0.5"], "needs model.rotary_emb_fraction=0.0"),
])
def test_mup_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides)
