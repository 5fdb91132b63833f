"""Convergence: the same tiny GPT-2 trained 20 steps through flash_attn.training with our modules
(FlashAttention, fused dropout-add-LayerNorm, FusedMLP, fused cross-entropy) and as plain transformers
GPT2LMHeadModel (eager attention, nn.LayerNorm, torch cross-entropy), from the same weights on the same
batches, must give the same losses."""
import pytest
import torch

from flash_attn.models.gpt import remap_state_dict_hf_gpt2
from flash_attn.ops.triton import backend
from flash_attn.training.config import load_config
from flash_attn.training.trainer import Trainer

TINY = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.n_positions=64", "train.seq_len=64",
        "train.micro_batch_size=8", "data.synthetic_chars=200000", "log.progress=off", "log.plot=false",
        "train.eval_batches=2", "train.eval_interval=0", "checkpoint.save_final=false", "log.interval=1",
        "train.max_steps=20", "optim.lr=1e-3", "optim.warmup_steps=5", "checkpoint.resume=none"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared CI core they spin and stall."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new",
                        attn_implementation="eager")
    return GPT2LMHeadModel(config)


def train_ours(hf_state, out_dir, *overrides):
    trainer = Trainer(load_config("tiny", TINY + [f"out_dir={out_dir}", *overrides]))
    trainer.model.load_state_dict(remap_state_dict_hf_gpt2(hf_state, trainer.model.config))
    return trainer, [loss for _, loss in trainer.run().losses]


def train_hf(model, out_dir, *overrides):
    trainer = Trainer(load_config("tiny", TINY + [f"out_dir={out_dir}", "train.loss=torch", *overrides]), model=model)
    return [loss for _, loss in trainer.run().losses]


def test_our_modules_match_plain_pytorch_for_20_steps(tmp_path):
    hf = hf_gpt2()
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    # The fused ops' PyTorch paths: the Triton interpreter would take minutes for 20 steps on the CPU.
    with backend("torch"):
        trainer, ours = train_ours(state, tmp_path / "ours", "model.fused=on", "model.use_flash_attn=true",
                                   "train.loss=fused")
    block = trainer.model.transformer.layers[0]
    assert type(block.mlp).__name__ == "FusedMLP" and block.fused_dropout_add_ln and block.mixer.use_flash_attn
    plain = train_hf(hf, tmp_path / "hf")
    assert ours[0] > 5.0 and ours[-1] < ours[0] - 1.0  # it did train
    # fp32 on both sides: the two paths differ only in summation order (~1e-7 relative per step).
    torch.testing.assert_close(ours, plain, rtol=1e-5, atol=0)


@pytest.mark.gpu
def test_our_kernels_in_bf16_stay_as_close_to_fp32_as_pytorch_does(tmp_path):
    """On a GPU, bf16 with our kernels against the fp32 plain run: within twice the distance of the plain
    model's own bf16 run (STYLE.md's criterion for low precision), plus bf16's rounding of the loss."""
    hf = hf_gpt2()
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    cuda = ["train.device=cuda"]
    _, ours = train_ours(state, tmp_path / "ours", *cuda, "train.dtype=bf16", "train.loss=fused")
    ref32 = train_hf(hf_gpt2(), tmp_path / "hf32", *cuda, "train.dtype=fp32")
    ref16 = train_hf(hf_gpt2(), tmp_path / "hf16", *cuda, "train.dtype=bf16")
    ours, ref32, ref16 = map(torch.tensor, (ours, ref32, ref16))
    bound = 2 * (ref16 - ref32).abs().max() + ref32.abs().max() * 2.0 ** -8
    assert (ours - ref32).abs().max() <= bound
