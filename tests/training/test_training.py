"""flash_attn.training on the CPU: config, data, the loop, checkpoints and resume, outputs, generate, CLI."""
import os

import numpy as np
import pytest
import torch

from flash_attn.training import checkpoint as ckpt
from flash_attn.training.cli import main
from flash_attn.training.config import CONFIG_DIR, ConfigError, load_config
from flash_attn.training.data import (ByteTokenizer, WindowSampler, load_splits, prepare_tokens, read_tokens,
                                      synthetic_corpus)
from flash_attn.training.metrics import read_jsonl
from flash_attn.training.model import build_model, count_params
from flash_attn.training.trainer import Trainer, lr_at, train

# 2 layers, width 64, sequences of 64: a few milliseconds a step on one core.
TINY = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.n_positions=64", "train.seq_len=64",
        "train.micro_batch_size=8", "data.synthetic_chars=200000", "log.progress=off", "log.plot=false",
        "train.eval_batches=2", "train.eval_interval=0", "checkpoint.every=0", "log.interval=1"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared CI core they spin and stall."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(tmp_path, *overrides, sub="run"):
    return load_config("tiny", TINY + [f"out_dir={tmp_path / sub}", *overrides])


def losses(result):
    return [loss for _, loss in result.losses]


# ------------------------------------------------------------------------------------------ training
def test_tiny_trains_50_steps_and_loss_falls(tmp_path):
    cfg = tiny(tmp_path, "train.max_steps=50", "optim.lr=3e-3", "optim.warmup_steps=5", "train.eval_interval=25")
    result = train(cfg)
    curve = losses(result)
    assert len(curve) == 50 and result.final_step == 50
    # Uniform over 256 bytes is ln 256 = 5.55; 50 steps must learn the byte statistics at least.
    assert curve[0] > 5.0
    assert np.mean(curve[-5:]) < 3.0
    assert [s for s, _ in result.val_losses] == [25, 50]
    assert result.val_losses[1][1] < result.val_losses[0][1] < 4.0
    records = read_jsonl(os.path.join(cfg.out_dir, "metrics.jsonl"))
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, 51))
    assert result.checkpoint == os.path.join(cfg.out_dir, "checkpoints", "step_0000050.pt")


def test_resume_continues_the_exact_loss_curve(tmp_path):
    # Dropout and gradient accumulation on, so the RNG state and the data position must both be restored.
    common = ["train.max_steps=20", "model.dropout=0.1", "train.grad_accum=2", "train.micro_batch_size=4"]
    full = losses(train(tiny(tmp_path, *common, sub="full")))
    first = train(tiny(tmp_path, *common, "train.stop_at=10", sub="split"))
    assert first.final_step == 10 and first.checkpoint.endswith("step_0000010.pt")
    second = train(tiny(tmp_path, *common, sub="split"))
    assert second.start_step == 10 and second.final_step == 20
    assert losses(first) + losses(second) == full
    records = read_jsonl(os.path.join(tmp_path, "split", "metrics.jsonl"))
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, 21))


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_run_checkpointed_and_the_same_command_resumes(tmp_path, monkeypatch, sig):
    """SIGTERM or Ctrl-C during `flash-attn train`: the current step finishes, is checkpointed, the run returns (the
    CLI exits 128 + the signal's number), and the same command resumes where it stopped, on the loss curve of an
    uninterrupted run; a second Ctrl-C stops at once."""
    import signal

    common = ["train.max_steps=8", "model.dropout=0.1"]
    full = losses(train(tiny(tmp_path, *common, sub="full")))
    real_step = Trainer.train_step

    def step_then_signal(self):
        out = real_step(self)
        if self.step == 3:
            os.kill(os.getpid(), getattr(signal, sig))
        return out

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    first = train(tiny(tmp_path, *common, sub="split"))
    monkeypatch.setattr(Trainer, "train_step", real_step)
    assert first.interrupted == sig and first.final_step == 3 and first.checkpoint.endswith("step_0000003.pt")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are restored
    second = train(tiny(tmp_path, *common, sub="split"))
    assert second.start_step == 3 and second.final_step == 8 and second.interrupted is None
    assert losses(first) + losses(second) == full

    def step_then_two_interrupts(self):
        out = real_step(self)
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(Trainer, "train_step", step_then_two_interrupts)
    with pytest.raises(KeyboardInterrupt):
        train(tiny(tmp_path, *common, sub="twice"))


def test_cli_exit_code_of_a_run_a_signal_stopped(tmp_path, monkeypatch):
    from flash_attn.training import trainer
    from flash_attn.training.trainer import TrainResult

    monkeypatch.setattr(trainer, "train", lambda cfg: TrainResult(losses=[(3, 1.0)], final_step=3,
                                                                  interrupted="SIGTERM"))
    assert main(["train", "--config", "tiny", f"out_dir={tmp_path}"]) == 128 + 15


def test_resume_none_starts_over(tmp_path):
    train(tiny(tmp_path, "train.max_steps=3"))
    again = train(tiny(tmp_path, "train.max_steps=3", "checkpoint.resume=none"))
    assert again.start_step == 0 and len(again.losses) == 3


def test_grad_accumulation_matches_one_big_batch(tmp_path):
    big = losses(train(tiny(tmp_path, "train.max_steps=5", sub="big")))
    accumulated = losses(train(tiny(tmp_path, "train.max_steps=5", "train.micro_batch_size=2",
                                    "train.grad_accum=4", sub="acc")))
    # Same sequences per step; only the fp32 summation order differs.
    torch.testing.assert_close(accumulated, big, rtol=1e-5, atol=0)


def test_activation_checkpointing_recomputes_and_keeps_losses(tmp_path):
    def run(extra, sub):
        trainer = Trainer(tiny(tmp_path, "train.max_steps=3", *extra, sub=sub))
        calls = []
        trainer.model.transformer.layers[0].mixer.register_forward_hook(lambda *a: calls.append(1))
        result = trainer.run()
        return losses(result), len(calls)

    plain, plain_calls = run([], "plain")
    ckpt_losses, ckpt_calls = run(["train.activation_checkpointing=true"], "ckpt")
    assert ckpt_losses == plain
    # Evaluation adds eval_batches forwards; training recomputes each layer once in the backward pass.
    assert ckpt_calls - plain_calls == 3


def test_gradients_are_clipped_before_the_update(tmp_path):
    trainer = Trainer(tiny(tmp_path, "train.max_steps=1", "optim.grad_clip=0.01"))
    norms = []

    def record(optimizer, args, kwargs):
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    trainer.optimizer.register_step_pre_hook(record)
    _, grad_norm = trainer.train_step()
    assert float(grad_norm) > 0.1  # the unclipped norm, as reported
    assert norms[0] == pytest.approx(0.01, rel=1e-4)


def test_fused_adamw_clips_inside_its_step(tmp_path):
    # With fused AdamW the clip factor rides in the optimizer's grad_scale instead of a pass over the
    # gradients; the update must equal clip_grad_norm_ followed by the same optimizer's step.
    trainers = [Trainer(tiny(tmp_path, "train.max_steps=2", "optim.grad_clip=0.05", f"optim.fused={f}",
                             sub=f)) for f in ("on", "off")]
    fused, plain = trainers
    assert fused.optimizer.defaults["fused"] and not plain.optimizer.defaults["fused"]
    for _ in range(2):
        (_, n_fused), (_, n_plain) = fused.train_step(), plain.train_step()
        assert float(n_fused) == pytest.approx(float(n_plain), rel=1e-5) and float(n_fused) > 0.05
        assert float(fused.optimizer.grad_scale) == pytest.approx(float(n_fused) / 0.05, rel=1e-5)
        for a, b in zip(fused.model.parameters(), plain.model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_warmup_then_cosine_schedule(tmp_path):
    cfg = tiny(tmp_path, "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=4")
    o = cfg.optim
    assert [lr_at(s, o, 20) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lr_at(4, o, 20) == pytest.approx(1e-3)
    assert lr_at(12, o, 20) == pytest.approx(5.5e-4)  # half way down the cosine
    assert lr_at(20, o, 20) == pytest.approx(1e-4)
    result_cfg = tiny(tmp_path, "train.max_steps=6", "optim.warmup_steps=4", "optim.lr=1e-3")
    train(result_cfg)
    records = read_jsonl(os.path.join(result_cfg.out_dir, "metrics.jsonl"))
    # The lr logged after step s is the one the next step uses: lr_at(s).
    assert [r["lr"] for r in records if r["split"] == "train"] == pytest.approx(
        [lr_at(s, result_cfg.optim, 6) for s in range(1, 7)])


def test_vocab_too_small_for_the_data_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="token id 1[0-9][0-9].*model.vocab_size is 64"):
        Trainer(tiny(tmp_path, "model.vocab_size=64"))


# ------------------------------------------------------------------------------------------ checkpoints
def test_checkpoints_every_n_steps_keep_the_newest(tmp_path):
    cfg = tiny(tmp_path, "train.max_steps=12", "checkpoint.every=3", "checkpoint.keep=2")
    train(cfg)
    folder = os.path.join(cfg.out_dir, "checkpoints")
    assert sorted(os.listdir(folder)) == ["latest", "step_0000009.pt", "step_0000012.pt"]
    state = ckpt.load_checkpoint(cfg.out_dir)
    assert state["step"] == 12 and state["data"]["samples_seen"] == 12 * 8
    assert set(state) >= {"model", "optimizer", "scheduler", "rng", "config", "model_shape"}


def test_a_crash_while_saving_leaves_latest_intact(tmp_path, monkeypatch):
    cfg = tiny(tmp_path, "train.max_steps=4", "checkpoint.every=2")
    trainer = Trainer(cfg)
    real_save = torch.save

    def crash_half_way(obj, f, *args, **kwargs):
        if trainer.step == 4:
            f.write(b"half a checkpoint")
            raise KeyboardInterrupt("killed while saving")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", crash_half_way)
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    monkeypatch.setattr(torch, "save", real_save)
    folder = os.path.join(cfg.out_dir, "checkpoints")
    assert ckpt.latest_checkpoint(folder).endswith("step_0000002.pt")
    assert not os.path.exists(os.path.join(folder, "step_0000004.pt"))
    resumed = train(cfg)
    assert resumed.start_step == 2 and resumed.final_step == 4


def test_checkpoint_from_another_model_shape_is_refused(tmp_path):
    train(tiny(tmp_path, "train.max_steps=2"))
    with pytest.raises(ConfigError, match=r"different model shape: model.n_layer: checkpoint 2 vs config 3"):
        Trainer(tiny(tmp_path, "train.max_steps=4", "model.n_layer=3"))


def test_not_a_checkpoint_is_refused(tmp_path):
    bogus = tmp_path / "bogus.pt"
    torch.save({"weights": torch.zeros(2)}, bogus)
    with pytest.raises(ConfigError, match="not a flash_attn.training checkpoint"):
        Trainer(tiny(tmp_path, f"checkpoint.resume={bogus}"))
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        Trainer(tiny(tmp_path, f"checkpoint.resume={tmp_path / 'missing.pt'}"))


# ------------------------------------------------------------------------------------------ outputs
def test_csv_metrics_mirror_the_jsonl(tmp_path):
    cfg = tiny(tmp_path, "train.max_steps=3", "log.csv=true")
    train(cfg)
    import csv

    with open(os.path.join(cfg.out_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["step"]), r["split"]) for r in rows] == [(1, "train"), (2, "train"), (3, "train"), (3, "val")]
    jsonl = read_jsonl(os.path.join(cfg.out_dir, "metrics.jsonl"))
    assert [float(r["loss"]) for r in rows] == pytest.approx([r["loss"] for r in jsonl])


def _installed(name):
    try:
        __import__(name)
        return True
    except ImportError:
        return False


def test_loss_plot_written_when_matplotlib_is_installed(tmp_path):
    cfg = tiny(tmp_path, "train.max_steps=3", "log.plot=true")
    train(cfg)
    png = os.path.join(cfg.out_dir, "loss.png")
    if _installed("matplotlib"):
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    else:
        assert not os.path.exists(png)


def test_tensorboard_on_needs_tensorboard(tmp_path):
    cfg = tiny(tmp_path, "train.max_steps=2", "log.tensorboard=on")
    if _installed("tensorboard"):
        train(cfg)
        assert os.listdir(os.path.join(cfg.out_dir, "tensorboard"))
    else:
        with pytest.raises(RuntimeError, match="needs the tensorboard package"):
            train(cfg)


def test_progress_lines_show_loss_and_throughput(tmp_path, capsys):
    train(tiny(tmp_path, "train.max_steps=2", "log.progress=lines", "train.peak_tflops=1.0"))
    err = capsys.readouterr().err
    assert "step 2/2 | loss " in err and "tok/s" in err and "MFU " in err
    assert "validation loss" in err


# ------------------------------------------------------------------------------------------ generate
def test_generate_from_a_checkpoint_matches_a_plain_greedy_loop(tmp_path):
    from flash_attn.training.generate import generate, load_model

    cfg = tiny(tmp_path, "train.max_steps=30", "optim.lr=3e-3")
    train(cfg)
    model, tokenizer, _ = load_model(cfg.out_dir)
    text = generate(cfg.out_dir, "the red ", max_new_tokens=12, top_k=1, model=model, tokenizer=tokenizer)
    ids = torch.as_tensor(tokenizer.encode("the red "))[None]
    with torch.no_grad():
        for _ in range(12):  # no KV cache: the whole sequence every step
            logits = model(ids).logits[0, -1, :256]
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    assert text == tokenizer.decode(ids[0, 8:].tolist())
    assert len(text.encode()) == 12 or "\ufffd" in text


# ------------------------------------------------------------------------------------------ config
def test_override_typo_names_the_field_and_suggests(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config field 'optim.lrr'.*did you mean 'lr'"):
        load_config("tiny", ["optim.lrr=1e-3"])
    with pytest.raises(ConfigError, match=r"unknown config field 'trian'.*did you mean 'train'"):
        load_config("tiny", ["trian.max_steps=3"])


def test_yaml_typo_names_the_field_and_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  n_layers: 4\n")
    with pytest.raises(ConfigError, match=rf"unknown config field 'model.n_layers' in {path}.*'n_layer'"):
        load_config(str(path))


def test_config_value_errors():
    with pytest.raises(ConfigError, match="'model.n_layer'.*must be int, got 2.5"):
        load_config("tiny", ["model.n_layer=2.5"])
    with pytest.raises(ConfigError, match="'train.dtype'.*must be one of"):
        load_config("tiny", ["train.dtype=fp8"])
    with pytest.raises(ConfigError, match="'model' .*is a section"):
        load_config("tiny", ["model=3"])
    with pytest.raises(ConfigError, match="must look like section.field=value"):
        load_config("tiny", ["train.max_steps"])
    with pytest.raises(ConfigError, match="n_embd .* must be a multiple of model.n_head"):
        load_config("tiny", ["model.n_head=5"])
    with pytest.raises(ConfigError, match="config file 'nope' not found"):
        load_config("nope")


def test_overrides_are_typed():
    cfg = load_config("tiny", ["optim.lr=1e-3", "train.compile=true", "model.n_head_kv=2", "model.n_inner=null",
                               "optim.grad_clip=2"])
    assert cfg.optim.lr == 1e-3 and cfg.train.compile is True and cfg.model.n_head_kv == 2
    assert cfg.model.n_inner is None and isinstance(cfg.optim.grad_clip, float)


@pytest.mark.parametrize("name, millions", [("tiny", 0.86), ("gpt2-small", 124.4), ("gpt2-medium", 354.8),
                                            ("llama-1b", 1235.8)])
def test_bundled_configs_build_the_models_they_name(name, millions):
    cfg = load_config(name)
    model = build_model(cfg.model, "meta")  # shapes only, no memory
    assert count_params(model) / 1e6 == pytest.approx(millions, abs=0.05)


def test_every_bundled_config_is_tested():
    bundled = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))
    assert bundled == ["gpt2-medium", "gpt2-small", "llama-1b", "tiny"]


# ------------------------------------------------------------------------------------------ data
def test_synthetic_corpus_is_deterministic_ascii():
    a = synthetic_corpus(50_000, seed=1)
    assert a == synthetic_corpus(50_000, seed=1) and len(a) == 50_000
    assert a != synthetic_corpus(50_000, seed=2)
    assert a.isascii()
    # Every sum in the corpus is right: the structure is there to be learned.
    sums = [line for line in a.splitlines()[:-1] if " + " in line]
    assert len(sums) > 100
    for line in sums:
        left, right = line.rstrip(".").split(" = ")
        x, y = left.split(" + ")
        assert int(x) + int(y) == int(right)


def test_window_sampler_visits_every_window_once_per_epoch():
    tokens = np.arange(8 * 10 + 1)
    sampler = WindowSampler(tokens, seq_len=8, seed=3)
    assert sampler.num_windows == 10
    x, y = sampler.batch(0, 10)
    assert sorted(x[:, 0].tolist()) == list(range(0, 80, 8))
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    x2, _ = sampler.batch(10, 10)  # epoch 1: the same windows, another order
    assert sorted(x2[:, 0].tolist()) == sorted(x[:, 0].tolist()) and not torch.equal(x2, x)
    assert torch.equal(WindowSampler(tokens, seq_len=8, seed=3).batch(4, 3)[0], x[4:7])


def test_text_file_is_tokenized_byte_level(tmp_path):
    text = "héllo world\n" * 400
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    cfg = load_config("tiny", [f"data.train={path}", "data.val_fraction=0.25"]).data
    train_tokens, val_tokens, tok = load_splits(cfg)
    assert isinstance(tok, ByteTokenizer)
    assert np.concatenate([train_tokens, val_tokens]).tolist() == list(text.encode("utf-8"))
    assert len(val_tokens) == len(text.encode()) - int(len(text.encode()) * 0.75)


def _word_tokenizer(tmp_path, words):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    return path


def test_tokenizers_json_file_tokenizes_and_trains(tmp_path):
    words = ["the", "cat", "sat", "on", "mat", "."]
    tok_path = _word_tokenizer(tmp_path, words)
    text_path = tmp_path / "cats.txt"
    text_path.write_text("the cat sat on the mat . " * 300)
    cfg = tiny(tmp_path, f"data.train={text_path}", f"data.tokenizer={tok_path}", "model.vocab_size=8",
               "train.seq_len=16", "train.max_steps=20", "optim.lr=1e-2")
    train_tokens, _, _ = load_splits(cfg.data)
    assert train_tokens[:7].tolist() == [1, 2, 3, 4, 1, 5, 6]
    curve = losses(train(cfg))
    assert curve[-1] < 0.5 * curve[0]  # a period-6 sequence is easy


def test_token_files_are_memory_mapped(tmp_path):
    tokens = (np.arange(5000) * 7 % 251).astype(np.uint16)
    np.save(tmp_path / "t.npy", tokens)
    tokens.astype(np.uint32).tofile(tmp_path / "t.bin")
    npy = read_tokens(str(tmp_path / "t.npy"))
    assert isinstance(npy, np.memmap) and npy.dtype == np.uint16
    bin_ = read_tokens(str(tmp_path / "t.bin"), "uint32")
    assert isinstance(bin_, np.memmap) and bin_.tolist() == tokens.tolist()
    with pytest.raises(ConfigError, match="not a multiple of uint32"):
        (tmp_path / "odd.bin").write_bytes(b"\x00" * 6)
        read_tokens(str(tmp_path / "odd.bin"), "uint32")
    result = train(tiny(tmp_path, f"data.train={tmp_path / 't.bin'}", "data.token_dtype=uint32",
                        f"data.val={tmp_path / 't.npy'}", "train.max_steps=2"))
    assert result.final_step == 2


def test_prepare_writes_a_token_file(tmp_path):
    text = "".join(f"line {i}\n" for i in range(2000))
    (tmp_path / "in.txt").write_text(text)
    n = prepare_tokens(str(tmp_path / "in.txt"), str(tmp_path / "out.npy"), chunk_chars=1000)
    out = np.load(tmp_path / "out.npy")
    assert n == len(text) and out.dtype == np.uint16 and bytes(out.astype(np.uint8)) == text.encode()


def test_missing_data_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="text file not found: '.*nope.txt'"):
        Trainer(tiny(tmp_path, f"data.train={tmp_path / 'nope.txt'}"))
    with pytest.raises(FileNotFoundError, match="token file not found"):
        Trainer(tiny(tmp_path, f"data.train={tmp_path / 'nope.npy'}"))
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        Trainer(tiny(tmp_path, f"data.tokenizer={tmp_path / 'tok.json'}", "data.train=x.txt"))


def test_a_split_shorter_than_a_sequence_is_an_error(tmp_path):
    (tmp_path / "short.txt").write_text("x" * 1000)
    with pytest.raises(ConfigError, match="validation split has 50 tokens, fewer than train.seq_len"):
        Trainer(tiny(tmp_path, f"data.train={tmp_path / 'short.txt'}"))


# ------------------------------------------------------------------------------------------ CLI
def test_cli_trains_and_reports_config_errors(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["train", "--config", "tiny", *TINY, f"out_dir={out}", "train.max_steps=2"]) == 0
    assert "trained steps 0->2" in capsys.readouterr().err
    assert main(["train", "--config", "tiny", "model.n_layr=3"]) == 2
    assert "unknown config field 'model.n_layr'" in capsys.readouterr().err
    assert main(["generate", str(out), "--prompt", "the", "--max-new-tokens", "5", "--top-k", "1"]) == 0
    assert capsys.readouterr().out.startswith("the")
    assert main(["generate", str(tmp_path / "none"), "--prompt", "x"]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
    (tmp_path / "in.txt").write_text("abc\n" * 10)
    assert main(["prepare", str(tmp_path / "in.txt"), str(tmp_path / "out.npy")]) == 0
    assert "wrote 40 tokens" in capsys.readouterr().err
    assert main(["prepare", str(tmp_path / "missing.txt"), str(tmp_path / "out.npy")]) == 2


def test_print_config_shows_the_resolved_values(capsys):
    assert main(["train", "--config", "tiny", "--print-config", "optim.lr=0.5"]) == 0
    printed = capsys.readouterr().out
    assert "lr: 0.5" in printed and "n_layer: 4" in printed


# ------------------------------------------------------------------------------------------ variants
def test_llama_style_model_trains_resumes_and_generates(tmp_path):
    # RMSNorm, SwiGLU, rotary, grouped-query attention, untied head: the llama-1b recipe in miniature.
    from flash_attn.ops.triton import backend
    from flash_attn.training.generate import generate

    arch = ["model.arch=llama", "model.n_head_kv=2", "model.tie_word_embeddings=false", "optim.lr=3e-3",
            "optim.warmup_steps=2", "train.max_steps=20"]
    # RMSNorm's PyTorch path: under the tests' TRITON_INTERPRET=1 the Triton kernel would be interpreted.
    with backend("torch"):
        full = losses(train(tiny(tmp_path, *arch, sub="full")))
        assert full[-1] < full[0] - 1.0
        train(tiny(tmp_path, *arch, "train.stop_at=10", sub="split"))
        rest = train(tiny(tmp_path, *arch, sub="split"))
        assert losses(rest) == full[10:]
        text = generate(str(tmp_path / "split"), "the ", max_new_tokens=8, top_k=1)
    assert isinstance(text, str) and text


def test_non_finite_loss_stops_the_run(tmp_path):
    trainer = Trainer(tiny(tmp_path, "train.max_steps=3"))
    trainer.loss_fn = lambda logits, targets: logits.float().sum() * float("nan")
    with pytest.raises(FloatingPointError, match="loss is nan at step 1"):
        trainer.run()


@pytest.mark.slow
def test_torch_compile_trains_the_same(tmp_path):
    eager = losses(train(tiny(tmp_path, "train.max_steps=4", sub="eager")))
    trainer = Trainer(tiny(tmp_path, "train.max_steps=4", "train.compile=true", sub="compiled"))
    assert type(trainer.forward_model).__name__ == "OptimizedModule"
    compiled = losses(trainer.run())
    # Inductor may fuse and reorder fp32 reductions; nothing else may differ.
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)


@pytest.mark.gpu
def test_gpu_bf16_fused_run_trains(tmp_path):
    cfg = tiny(tmp_path, "train.device=cuda", "train.max_steps=30", "optim.lr=3e-3")
    trainer = Trainer(cfg)
    assert trainer.dtype == torch.bfloat16 and trainer.model.transformer.layers[0].fused_dropout_add_ln
    assert trainer.optimizer.defaults["fused"]
    curve = losses(trainer.run())
    assert np.mean(curve[-5:]) < curve[0] - 1.5


def test_fused_loss_takes_the_padded_logits_and_writes_their_gradient_in_place():
    """The trainer's fused loss sees the model's (B, S, padded vocab) logits as they are (no slice to the
    real vocab, whose odd row stride would make every kernel access scalar, and no copy) and its
    gradient overwrites them: the lm_head's backward receives the logits' own storage."""
    from flash_attn.ops.triton import backend, triton_runs_on
    from flash_attn.training.trainer import make_loss_fn

    if not triton_runs_on("cpu"):
        pytest.skip("needs TRITON_INTERPRET=1 (the fused loss runs the Triton kernels)")
    cfg = load_config("tiny", TINY + ["model.vocab_size=250"])
    model = build_model(cfg.model)
    x = torch.randint(0, 250, (2, 16))
    with backend("triton"):
        logits = model(x).logits
        assert logits.shape == (2, 16, 256) and logits.is_contiguous()
        seen = []
        logits.register_hook(lambda g: seen.append((g.data_ptr(), g.shape)))
        ptr = logits.data_ptr()
        make_loss_fn("fused", torch.device("cpu"))(logits, torch.roll(x, -1, 1)).backward()
    assert seen == [(ptr, logits.shape)]
