"""torch.compile(fullgraph=True) traces through the attention ops (custom ops with fake kernels and an
autograd formula): no graph breaks, same results as eager."""
import pytest
import torch

import flash_attn
from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache


class TinyAttention(torch.nn.Module):
    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        B, S, E = x.shape
        qkv = self.qkv(x).view(B, S, 3, self.heads, E // self.heads)  # (B, S, 3, H, D)
        o = flash_attn.flash_attn_qkvpacked_func(qkv, causal=True)
        return self.out(o.reshape(B, S, E))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_module_compiles_fullgraph_with_backward(backend):
    torch.manual_seed(0)
    model = TinyAttention()
    x = torch.randn(2, 9, 32, requires_grad=True)
    eager = model(x)
    (gx_eager,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    out = compiled(x)
    (gx,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gx_eager, rtol=1e-5, atol=1e-5)


def test_varlen_and_lse_compile_fullgraph():
    q = torch.randn(10, 2, 16, requires_grad=True)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)

    def f(q):
        out, lse, _ = flash_attn_varlen_func(q, q, q, cu, cu, 7, 7, causal=True, return_attn_probs=True)
        return out.sum() + lse.sum()

    eager = f(q)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q)
    torch.testing.assert_close(compiled, eager)
    compiled.backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_dropout_compiles_fullgraph_and_is_seeded():
    q = torch.randn(1, 12, 2, 16)
    f = torch.compile(lambda q: flash_attn_func(q, q, q, dropout_p=0.5), fullgraph=True, backend="aot_eager")
    torch.manual_seed(7)
    a = f(q)
    b = f(q)
    torch.manual_seed(7)
    c = f(q)
    assert not torch.equal(a, b)  # a fresh mask each call, not one baked into the graph
    assert torch.equal(a, c)


def test_kvcache_compiles_fullgraph_and_mutates_cache():
    k_cache = torch.zeros(1, 8, 1, 16)
    v_cache = torch.zeros(1, 8, 1, 16)
    q, k, v = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    seqlens = torch.tensor([3], dtype=torch.int32)

    def step(q, k, v):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True)

    out = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(k_cache[0, 3], k[0, 0]) and torch.equal(v_cache[0, 3], v[0, 0])
    torch.testing.assert_close(out, flash_attn_func(q, k_cache[:, :4], v_cache[:, :4], causal=True))


def _fwd_args(q, k, v, causal=False, dropout_p=0.0, cu=None, max_s=0):
    from flash_attn.dropout import new_rng_state
    rng = new_rng_state() if dropout_p > 0 else None
    return (q, k, v, cu, cu, max_s, max_s, None, q.shape[-1] ** -0.5, causal, -1, 0 if causal else -1, 0.0,
            None, dropout_p, rng, False, False)


@pytest.mark.parametrize("case", ["dense", "causal_dropout", "varlen"])
def test_opcheck_fwd(case):
    # fake kernel vs real shapes/strides, schema, autograd registration
    g = torch.Generator().manual_seed(0)
    if case == "varlen":
        q = torch.randn(10, 2, 16, generator=g, requires_grad=True)
        args = _fwd_args(q, q.detach().clone(), q.detach().clone(),
                         cu=torch.tensor([0, 3, 10], dtype=torch.int32), max_s=7)
    else:
        q = torch.randn(1, 6, 2, 16, generator=g, requires_grad=True)
        k = torch.randn(1, 6, 1, 16, generator=g, requires_grad=True)
        args = _fwd_args(q, k, k.detach().clone().requires_grad_(), causal=case != "dense",
                         dropout_p=0.2 if case != "dense" else 0.0, max_s=6)
    torch.library.opcheck(torch.ops.flash_attn.fwd.default, args)


def test_opcheck_kvcache():
    q = torch.randn(2, 1, 2, 16)
    k_cache, v_cache = torch.zeros(2, 8, 1, 16), torch.zeros(2, 8, 1, 16)
    k, v = torch.randn(2, 1, 1, 16), torch.randn(2, 1, 1, 16)
    seqlens = torch.tensor([2, 5], dtype=torch.int32)
    args = (q, k_cache, v_cache, k, v, None, None, seqlens, None, None, None, 0.25, True, -1, 0, 0.0, True,
            None, 0)
    torch.library.opcheck(torch.ops.flash_attn.fwd_kvcache.default, args)


def test_rotary_gpt_compiles_fullgraph_in_training_mode():
    from transformers import GPT2Config

    from flash_attn.models.gpt import GPTLMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=128, n_positions=64, rotary_emb_fraction=0.5, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    model = GPTLMHeadModel(cfg).train()
    x = torch.randint(0, 128, (2, 16))
    loss_eager = model(x).logits.float().logsumexp(-1).mean()
    loss = torch.compile(lambda x: model(x).logits.float().logsumexp(-1).mean(), fullgraph=True,
                         backend="aot_eager")(x)
    torch.testing.assert_close(loss, loss_eager)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
