"""train.cuda_graph: the training step replayed as CUDA graphs (flash_attn.training.graphs).

CPU: the config refuses what a graph cannot hold, naming the option. GPU: graphed runs follow the eager
loss curve (exactly with the plain PyTorch attention, whose kernels are deterministic; closely with the
cute/Triton kernels, whose dQ accumulation order varies), with gradient accumulation, the learning-rate
schedule and clipping inside the replayed update, and resume from a graphed run's checkpoint."""
import numpy as np
import pytest
import torch

from flash_attn import settings
from flash_attn.training.config import ConfigError, load_config
from flash_attn.training.graphs import WARMUP_STEPS
from flash_attn.training.trainer import Trainer, lr_at

# Head dim 64 (the cute kernels on Hopper), bf16 autocast, fused AdamW with clipping.
SMALL = ["model.n_layer=2", "model.n_embd=128", "model.n_head=2", "model.n_positions=128", "train.seq_len=128",
         "train.micro_batch_size=4", "data.synthetic_chars=300000", "log.progress=off", "log.plot=false",
         "train.eval_batches=1", "train.eval_interval=0", "checkpoint.every=0", "log.interval=1",
         "optim.lr=3e-3", "optim.warmup_steps=3", "optim.grad_clip=0.5"]


def small(tmp_path, *overrides, sub="run"):
    return load_config("tiny", SMALL + [f"out_dir={tmp_path / sub}", *overrides])


def curve(result):
    return [loss for _, loss in result.losses]


def test_config_refuses_compile_and_dropout_with_graphs():
    with pytest.raises(ConfigError, match="train.cuda_graph and train.compile"):
        load_config("tiny", ["train.cuda_graph=true", "train.compile=true"])
    with pytest.raises(ConfigError, match=r"train.cuda_graph needs model.dropout=0 \(got 0.1\)"):
        load_config("tiny", ["train.cuda_graph=true", "model.dropout=0.1"])
    assert load_config("tiny", ["train.cuda_graph=true"]).train.cuda_graph


def test_graphs_on_a_cpu_are_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="train.cuda_graph needs a CUDA device"):
        Trainer(small(tmp_path, "train.device=cpu", "train.cuda_graph=true"))


def _run(cfg, backend=None, monkeypatch=None):
    if backend is not None:
        monkeypatch.setattr(settings, "current", settings.current)  # restored, with the variable, at the test's end
        monkeypatch.setenv("FLASH_ATTN_BACKEND", backend)
        settings.reload()
    trainer = Trainer(cfg)
    result = trainer.run()
    return trainer, curve(result)


@pytest.mark.gpu
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_graphed_run_equals_the_eager_run_with_torch_attention_on_gpu(tmp_path, monkeypatch, grad_accum):
    common = ["train.device=cuda", "train.max_steps=8", f"train.grad_accum={grad_accum}"]
    _, eager = _run(small(tmp_path, *common, sub="eager"), "torch", monkeypatch)
    trainer, graphed = _run(small(tmp_path, *common, "train.cuda_graph=true", sub="graph"), "torch", monkeypatch)
    assert trainer.graphed.replays == (8 - WARMUP_STEPS) * grad_accum
    # The same kernels in the same order: only AdamW's learning rate travels as an fp32 tensor instead of
    # a Python float once captured.
    np.testing.assert_allclose(graphed, eager, rtol=1e-6, atol=0)
    lr = trainer.optimizer.param_groups[0]["lr"]
    assert torch.is_tensor(lr) and lr.is_cuda  # the scheduler fills the tensor the graph reads
    assert float(lr) == pytest.approx(lr_at(8, trainer.cfg.optim, 8), rel=1e-6)


LLAMA = ["model.arch=llama", "model.n_head_kv=1", "model.tie_word_embeddings=false"]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", [[], LLAMA], ids=["gpt2", "llama"])
def test_graphed_run_follows_the_eager_run_with_the_default_kernels_on_gpu(tmp_path, arch):
    # gpt2: LayerNorm, bias-GELU MLP, learned positions; llama: RMSNorm, SwiGLU, rotary, grouped-query heads
    common = ["train.device=cuda", "train.max_steps=12", *arch]
    eager_trainer, eager = _run(small(tmp_path, *common, sub="eager"))
    _, eager2 = _run(small(tmp_path, *common, sub="eager2"))
    trainer, graphed = _run(small(tmp_path, *common, "train.cuda_graph=true", sub="graph"))
    assert trainer.graphed.replays == 12 - WARMUP_STEPS
    assert graphed[-1] < graphed[0] - 1.0  # it trains
    # Atomic dQ accumulation in the attention backward reorders fp32 sums between runs, so two eager runs
    # differ too: the graphed run may differ from an eager one by at most twice that, plus bf16 rounding.
    eager, eager2, graphed = map(np.array, (eager, eager2, graphed))
    noise = np.abs(eager2 - eager)
    assert np.all(np.abs(graphed - eager) <= 2 * noise + 2 ** -8 * np.abs(eager)), (graphed, eager, eager2)


@pytest.mark.gpu
def test_graphed_run_resumes_the_exact_loss_curve_on_gpu(tmp_path, monkeypatch):
    common = ["train.device=cuda", "train.max_steps=10", "train.cuda_graph=true"]
    _, full = _run(small(tmp_path, *common, sub="full"), "torch", monkeypatch)
    _, first = _run(small(tmp_path, *common, "train.stop_at=6", sub="split"), "torch", monkeypatch)
    trainer, second = _run(small(tmp_path, *common, sub="split"), "torch", monkeypatch)
    assert trainer.resumed_from.endswith("step_0000006.pt") and trainer.graphed.replays == 4 - WARMUP_STEPS
    np.testing.assert_allclose(first + second, full, rtol=1e-6, atol=0)
