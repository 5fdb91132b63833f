"""flash_attn.modules.mlp, .block and .embedding against direct PyTorch compositions."""
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flash_attn
from flash_attn.modules.block import Block, DropPath, ParallelBlock
from flash_attn.modules.embedding import BertEmbeddings, GPT2Embeddings
from flash_attn.modules.mha import MHA
from flash_attn.modules.mlp import FusedMLP, GatedMlp, Mlp
from flash_attn.ops.triton.layer_norm import RMSNorm

D = 64
ATOL = 1e-5


@pytest.fixture(autouse=True)
def torch_ops():
    with flash_attn.use_backend("torch"):  # fused ops on their PyTorch path (the interpreter is slow)
        yield


def randomize(module, seed=0):
    torch.manual_seed(seed)
    for p in module.parameters():
        nn.init.normal_(p, mean=1.0 if p.dim() == 1 and p.shape[0] == D else 0.0, std=0.2)
    return module


# ------------------------------------------------------------------------------------------------ MLPs
@pytest.mark.parametrize("activation", [F.gelu, F.relu, partial(F.gelu, approximate="tanh")],
                         ids=["gelu", "relu", "gelu_tanh"])
def test_mlp(activation):
    m = randomize(Mlp(D, activation=activation, bias2=False))
    assert m.fc1.weight.shape == (4 * D, D) and m.fc2.bias is None
    x = torch.randn(3, 5, D)
    torch.testing.assert_close(m(x), m.fc2(activation(m.fc1(x))), atol=ATOL, rtol=0)


@pytest.mark.parametrize("activation", [F.sigmoid, F.silu, F.gelu, F.relu], ids=["glu", "swiglu", "geglu", "reglu"])
def test_gated_mlp(activation):
    m = randomize(GatedMlp(D, activation=activation, multiple_of=32))
    assert m.fc1.weight.shape == (2 * 192, D)  # int(8 * 64 / 3) = 170, rounded up to a multiple of 32
    x = torch.randn(3, 5, D)
    value, gate = m.fc1(x).chunk(2, dim=-1)
    torch.testing.assert_close(m(x), m.fc2(value * activation(gate)), atol=ATOL, rtol=0)


def test_gated_mlp_gradients_match_composition():
    m = randomize(GatedMlp(D, hidden_features=96, activation=F.silu, multiple_of=1))
    x = torch.randn(2, 4, D, requires_grad=True)
    m(x).square().sum().backward()
    grads = [x.grad] + [p.grad for p in m.parameters()]
    x2 = x.detach().clone().requires_grad_()
    m.zero_grad()
    value, gate = m.fc1(x2).chunk(2, dim=-1)
    m.fc2(value * F.silu(gate)).square().sum().backward()
    for a, b in zip(grads, [x2.grad] + [p.grad for p in m.parameters()]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("activation, fn", [("gelu_approx", partial(F.gelu, approximate="tanh")),
                                            ("relu", F.relu), ("sqrelu", lambda t: F.relu(t).square())],
                         ids=["gelu_approx", "relu", "sqrelu"])
@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
def test_fused_mlp_matches_mlp(activation, fn, checkpoint_lvl):
    fused = randomize(FusedMLP(D, hidden_features=96, activation=activation, checkpoint_lvl=checkpoint_lvl))
    plain = Mlp(D, hidden_features=96, activation=fn)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(2, 7, D)
    xf, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = fused(xf)
    torch.testing.assert_close(out, plain(xp), atol=ATOL, rtol=0)
    out.square().sum().backward()
    plain(xp).square().sum().backward()
    for a, b in zip([xf.grad] + [p.grad for p in fused.parameters()], [xp.grad] + [p.grad for p in plain.parameters()]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("cls", [Mlp, GatedMlp, FusedMLP])
def test_mlp_return_residual(cls):
    m = cls(D, return_residual=True)
    x = torch.randn(2, 3, D)
    out, residual = m(x)
    assert residual is x and out.shape == x.shape


@pytest.mark.parametrize("make", [
    lambda: Mlp(D, activation="gelu"),
    lambda: GatedMlp(D, multiple_of=0),
    lambda: FusedMLP(D, activation="tanh"),
    lambda: FusedMLP(D, checkpoint_lvl=3),
])
def test_mlp_invalid_arguments(make):
    with pytest.raises((ValueError, TypeError)):
        make()


# ------------------------------------------------------------------------------------------------ blocks
def make_block(prenorm=True, norm_cls=nn.LayerNorm, seed=0, **kwargs):
    block = Block(D, mixer_cls=partial(MHA, num_heads=4, causal=True), mlp_cls=partial(Mlp, hidden_features=96),
                  norm_cls=norm_cls, prenorm=prenorm, **kwargs)
    return randomize(block, seed).eval()


def test_prenorm_block_matches_composition():
    b = make_block()
    h, r = torch.randn(2, 6, D), torch.randn(2, 6, D)
    out, residual = b(h, r)
    r1 = h + r
    r2 = b.mixer(b.norm1(r1)) + r1
    torch.testing.assert_close(residual, r2, atol=ATOL, rtol=0)
    torch.testing.assert_close(out, b.mlp(b.norm2(r2)), atol=ATOL, rtol=0)


def test_prenorm_block_first_layer_has_no_residual():
    b = make_block()
    h = torch.randn(2, 6, D)
    out, residual = b(h)
    r2 = b.mixer(b.norm1(h)) + h
    torch.testing.assert_close(residual, r2, atol=ATOL, rtol=0)
    torch.testing.assert_close(out, b.mlp(b.norm2(r2)), atol=ATOL, rtol=0)


def test_postnorm_block_matches_composition():
    b = make_block(prenorm=False)
    x = torch.randn(2, 6, D)
    h = b.norm1(x + b.mixer(x))
    torch.testing.assert_close(b(x), b.norm2(h + b.mlp(h)), atol=ATOL, rtol=0)


def test_postnorm_block_return_residual():
    block = Block(D, mixer_cls=partial(MHA, num_heads=4, return_residual=True),
                  mlp_cls=partial(Mlp, hidden_features=96, return_residual=True), prenorm=False,
                  return_residual=True)
    randomize(block).eval()
    plain = make_block(prenorm=False)
    plain.mixer.causal = plain.mixer.inner_attn.causal = plain.mixer.inner_cross_attn.causal = False
    plain.load_state_dict(block.state_dict())
    x = torch.randn(2, 6, D)
    torch.testing.assert_close(block(x), plain(x), atol=ATOL, rtol=0)


def test_mixer_kwargs_reach_the_mixer():
    b = make_block()
    h = torch.randn(2, 6, D)
    mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    out, _ = b(h, mixer_kwargs={"key_padding_mask": mask})
    out_nomask, _ = b(h)
    torch.testing.assert_close(out[0], out_nomask[0], atol=ATOL, rtol=0)
    assert (out[1, 3:] - out_nomask[1, 3:]).abs().max() > 1e-3


def test_block_mixer_subset_slices_residual():
    block = Block(D, mixer_cls=partial(MHA, num_heads=4, cross_attn=True), mlp_cls=partial(Mlp, hidden_features=96))
    randomize(block).eval()
    h, r = torch.randn(2, 6, D), torch.randn(2, 6, D)
    subset = torch.tensor([1, 4])
    out, residual = block(h, r, mixer_subset=subset)
    full_out, full_residual = block(h, r)
    torch.testing.assert_close(residual, full_residual[:, subset], atol=ATOL, rtol=0)
    torch.testing.assert_close(out, full_out[:, subset], atol=ATOL, rtol=0)


def test_residual_in_fp32():
    b = make_block(residual_in_fp32=True).to(torch.bfloat16)
    out, residual = b(torch.randn(2, 6, D, dtype=torch.bfloat16))
    assert residual.dtype == torch.float32 and out.dtype == torch.bfloat16


@pytest.mark.parametrize("prenorm", [True, False], ids=["prenorm", "postnorm"])
@pytest.mark.parametrize("norm_cls", [nn.LayerNorm, RMSNorm], ids=["layernorm", "rmsnorm"])
def test_fused_dropout_add_ln_matches_unfused(prenorm, norm_cls):
    ref = make_block(prenorm=prenorm, norm_cls=norm_cls)
    fused = make_block(prenorm=prenorm, norm_cls=norm_cls, fused_dropout_add_ln=True)
    fused.load_state_dict(ref.state_dict())
    x, r = torch.randn(2, 6, D), torch.randn(2, 6, D)
    if prenorm:
        for a, b in zip(fused(x, r), ref(x, r)):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    else:
        torch.testing.assert_close(fused(x), ref(x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_drop_path_drops_whole_samples(fused):
    # mixer and MLP replaced by zero maps: the residual output is exactly drop_path(x) + residual.
    block = Block(D, mixer_cls=lambda d: ZeroMap(), mlp_cls=lambda d: ZeroMap(), drop_path1=0.5,
                  fused_dropout_add_ln=fused).train()
    torch.manual_seed(0)
    x, r = torch.randn(64, 3, D), torch.zeros(64, 3, D)
    _, residual = block(x, r)
    kept = residual.flatten(1).abs().sum(-1) > 0
    assert 10 < int(kept.sum()) < 54
    torch.testing.assert_close(residual[kept], 2 * x[kept], atol=ATOL, rtol=0)
    assert torch.all(residual[~kept] == 0)


class ZeroMap(nn.Module):
    def forward(self, x, **kwargs):
        return torch.zeros_like(x)


def test_drop_path_identity_in_eval():
    d = DropPath(0.7).eval()
    x = torch.randn(4, 3)
    assert d(x) is x
    with pytest.raises(ValueError):
        DropPath(1.0)


def test_block_argument_errors():
    with pytest.raises(ValueError, match="return_residual"):
        Block(D, prenorm=True, return_residual=True)
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        Block(D, mark_shared_params=True)
    b = make_block(prenorm=False)
    with pytest.raises(ValueError, match="residual"):
        b(torch.randn(1, 2, D), torch.randn(1, 2, D))


def make_parallel(tied_norm=False, norm_cls=nn.LayerNorm, **kwargs):
    block = ParallelBlock(D, mixer_cls=partial(MHA, num_heads=4, causal=True),
                          mlp_cls=partial(Mlp, hidden_features=96), norm_cls=norm_cls, tied_norm=tied_norm, **kwargs)
    return randomize(block).eval()


@pytest.mark.parametrize("tied_norm", [False, True], ids=["two_norms", "tied"])
def test_parallel_block_matches_composition(tied_norm):
    b = make_parallel(tied_norm)
    h1, h2, r = torch.randn(2, 6, D), torch.randn(2, 6, D), torch.randn(2, 6, D)
    o1, o2, residual = b(h1, h2, r)
    r1 = h1 + h2 + r
    torch.testing.assert_close(residual, r1, atol=ATOL, rtol=0)
    torch.testing.assert_close(o1, b.mixer(b.norm1(r1)), atol=ATOL, rtol=0)
    torch.testing.assert_close(o2, b.mlp((b.norm1 if tied_norm else b.norm2)(r1)), atol=ATOL, rtol=0)


@pytest.mark.parametrize("tied_norm", [False, True], ids=["two_norms", "tied"])
@pytest.mark.parametrize("norm_cls", [nn.LayerNorm, RMSNorm], ids=["layernorm", "rmsnorm"])
def test_parallel_block_fused_matches_unfused(tied_norm, norm_cls):
    ref = make_parallel(tied_norm, norm_cls)
    fused = make_parallel(tied_norm, norm_cls, fused_dropout_add_ln=True)
    fused.load_state_dict(ref.state_dict())
    h1, h2, r = torch.randn(2, 6, D), torch.randn(2, 6, D), torch.randn(2, 6, D)
    for a, b in zip(fused(h1, h2, r), ref(h1, h2, r)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------------ embeddings
def test_gpt2_embeddings():
    e = GPT2Embeddings(D, 50, 16)
    ids = torch.randint(0, 50, (2, 7))
    torch.testing.assert_close(e(ids), e.word_embeddings(ids) + e.position_embeddings.weight[:7], atol=0, rtol=0)
    pos = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])
    torch.testing.assert_close(e(ids, pos), e.word_embeddings(ids) + e.position_embeddings(pos), atol=0, rtol=0)


def test_gpt2_embeddings_without_positions_and_with_projection():
    e = GPT2Embeddings(D, 50, 0, word_embed_proj_dim=16)
    assert not hasattr(e, "position_embeddings") and e.word_embeddings.weight.shape == (50, 16)
    ids = torch.randint(0, 50, (2, 7))
    torch.testing.assert_close(e(ids), e.project_in(e.word_embeddings(ids)), atol=0, rtol=0)


def test_bert_embeddings():
    e = BertEmbeddings(D, 50, 16, 2)
    ids = torch.randint(0, 50, (2, 7))
    types = torch.randint(0, 2, (2, 7))
    base = e.word_embeddings(ids) + e.position_embeddings.weight[:7]
    torch.testing.assert_close(e(ids, token_type_ids=types), base + e.token_type_embeddings(types), atol=ATOL,
                               rtol=0)
    torch.testing.assert_close(e(ids), base + e.token_type_embeddings.weight[0], atol=ATOL, rtol=0)


def test_embedding_argument_errors():
    with pytest.raises(ValueError):
        GPT2Embeddings(D, 50, -1)
    with pytest.raises(ValueError):
        BertEmbeddings(D, 50, 16, -2)
