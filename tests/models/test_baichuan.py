"""flash_attn.models.baichuan: Baichuan is remote code (not in transformers), so this file holds a small plain-PyTorch
reference of the published architecture (LLaMA layers with the fused W_pack q/k/v projection; rotate-half rotary
for 7B, ALiBi for 13B; Baichuan 2's normalized LM head) with the checkpoints' key names. Tiny random references of
the four published variants, converted, must give the reference's logits in fp32 on CPU (both attention paths),
greedy generation through the KV cache must match the reference's, the remap must round-trip, and the config rule
must pick what the published sizes have."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flash_attn
from flash_attn.models.baichuan import (baichuan_config_to_gpt2_config, inv_remap_state_dict_hf_baichuan,
                                        remap_state_dict_hf_baichuan)
from flash_attn.models.gpt import GPTLMHeadModel

ATOL = 2e-5
VOCAB = 101
VARIANTS = {  # name -> (use_alibi, norm_head)
    "baichuan-7b": (False, False), "baichuan-13b": (True, False),
    "baichuan2-7b": (False, True), "baichuan2-13b": (True, True),
}


@pytest.fixture(autouse=True)
def torch_ops():
    with flash_attn.use_backend("torch"):  # RMSNorm/rotary on their PyTorch path (the interpreter is slow)
        yield


def baichuan_config(**kwargs):
    # 6 heads: not a power of two, so ALiBi's slopes take the paper's interleaving branch
    fields = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
                  hidden_act="silu", rms_norm_eps=1e-6, initializer_range=0.02, bos_token_id=0, eos_token_id=1,
                  pad_token_id=0, tie_word_embeddings=False)
    fields.update(kwargs)
    return SimpleNamespace(**fields)


# ----------------------------------------------------------------------------------------- reference model
def alibi_slopes(n):
    """ALiBi slopes (Press et al. 2022, section 3): geometric from 2^(-8/n) for n a power of two; otherwise the
    slopes of the largest power of two below n, then every other slope of twice that."""
    def powers_of_two(m):
        return [2 ** (-8 * (i + 1) / m) for i in range(m)]
    below = 2 ** math.floor(math.log2(n))
    return powers_of_two(below) + powers_of_two(2 * below)[::2][:n - below]


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Rotary(nn.Module):
    def __init__(self, dim):
        super().__init__()
        # persistent, as in the published 7B code: the checkpoints carry it
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))

    def forward(self, x):  # x (B, H, S, D), rotate-half pairs (i, i + D/2)
        angles = torch.outer(torch.arange(x.shape[2], dtype=torch.float32), self.inv_freq)
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, c, alibi):
        super().__init__()
        self.heads, self.alibi = c.num_attention_heads, alibi
        self.W_pack = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=False)
        self.o_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        if not alibi:
            self.rotary_emb = Rotary(c.hidden_size // c.num_attention_heads)

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in self.W_pack(x).split(dim, dim=-1))
        if not self.alibi:
            q, k = self.rotary_emb(q), self.rotary_emb(k)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, S, S)
        if self.alibi:  # Baichuan's form: slope * key position (the softmax ignores the per-row offset)
            slopes = torch.tensor(alibi_slopes(self.heads))[:, None, None]
            scores = scores + slopes * torch.arange(s, dtype=torch.float32)
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(b, s, dim))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c, alibi):
        super().__init__()
        self.self_attn, self.mlp = Attention(c, alibi), MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, c, alibi):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([Layer(c, alibi) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class BaichuanForCausalLM(nn.Module):
    def __init__(self, c, alibi, norm_head):
        super().__init__()
        self.model, self.norm_head = Backbone(c, alibi), norm_head
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, ids):
        weight = F.normalize(self.lm_head.weight) if self.norm_head else self.lm_head.weight
        return self.model(ids) @ weight.t()


def reference(variant, seed=0, **kwargs):
    alibi, norm_head = VARIANTS[variant]
    torch.manual_seed(seed)
    c = baichuan_config(**kwargs)
    model = BaichuanForCausalLM(c, alibi, norm_head).eval()
    for name, p in model.named_parameters():
        std = 0.1 if "norm" in name else 0.3 if "lm_head" in name else 0.05
        nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=std)
    return c, model


def convert(variant, c, ref, **overrides):
    alibi, norm_head = VARIANTS[variant]
    config = baichuan_config_to_gpt2_config(c, use_alibi=alibi, norm_head=norm_head)
    for k, v in overrides.items():
        setattr(config, k, v)
    model = GPTLMHeadModel(config).eval()
    model.load_state_dict(remap_state_dict_hf_baichuan(ref.state_dict(), config))
    return model


# --------------------------------------------------------------------------------------------------- tests
def test_reference_has_the_checkpoint_key_names():
    _, ref = reference("baichuan-7b")
    keys = set(ref.state_dict())
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.W_pack.weight",
            "model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.1.mlp.up_proj.weight",
            "model.norm.weight", "lm_head.weight"} <= keys


@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference(variant, use_flash_attn):
    c, ref = reference(variant)
    model = convert(variant, c, ref, use_flash_attn=use_flash_attn)
    ids = torch.randint(0, VOCAB, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(model.transformer(ids), ref.model(ids), atol=ATOL, rtol=0)
        torch.testing.assert_close(model(ids).logits, ref(ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["baichuan-7b", "baichuan2-13b"])
def test_greedy_generation_matches_reference(variant):
    c, ref = reference(variant)
    model = convert(variant, c, ref, use_flash_attn=True)
    ids = torch.randint(2, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    out = model.generate(ids, max_length=16, return_dict_in_generate=True, output_scores=True)
    seq = ids
    with torch.no_grad():
        for step in range(16 - 5):
            logits = ref(seq)[:, -1]
            torch.testing.assert_close(out.scores[step], logits, atol=ATOL, rtol=0)
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out.sequences, seq)


def test_padded_vocab():
    c, ref = reference("baichuan2-13b")
    model = convert("baichuan2-13b", c, ref, pad_vocab_size_multiple=8)
    assert model.lm_head.weight.shape[0] == 104
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[..., :VOCAB], ref(ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["baichuan-7b", "baichuan2-13b"])
def test_remap_round_trip(variant):
    c, ref = reference(variant)
    alibi, norm_head = VARIANTS[variant]
    config = baichuan_config_to_gpt2_config(c, use_alibi=alibi, norm_head=norm_head)
    expected = {k: v for k, v in ref.state_dict().items() if not k.endswith("inv_freq")}
    back = inv_remap_state_dict_hf_baichuan(remap_state_dict_hf_baichuan(ref.state_dict(), config), config)
    assert set(back) == set(expected)
    for k in expected:
        assert torch.equal(back[k], expected[k]), k


def test_our_weights_load_into_reference():
    c, ref = reference("baichuan2-7b")
    config = baichuan_config_to_gpt2_config(c, use_alibi=False, norm_head=True)
    config.pad_vocab_size_multiple = 8
    torch.manual_seed(1)
    model = GPTLMHeadModel(config).eval()
    ref.load_state_dict(inv_remap_state_dict_hf_baichuan(model.state_dict(), config), strict=False)
    ids = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(ref(ids), model(ids).logits[..., :VOCAB], atol=ATOL, rtol=0)


@pytest.mark.parametrize("hidden_size, vocab_size, use_alibi, norm_head", [
    (4096, 64000, False, False), (5120, 64000, True, False), (4096, 125696, False, True), (5120, 125696, True, True)],
    ids=["Baichuan-7B", "Baichuan-13B", "Baichuan2-7B", "Baichuan2-13B"])
def test_config_rule_follows_the_published_sizes(hidden_size, vocab_size, use_alibi, norm_head):
    c = baichuan_config(hidden_size=hidden_size, vocab_size=vocab_size, num_attention_heads=hidden_size // 128)
    config = baichuan_config_to_gpt2_config(c)
    assert config.use_alibi == use_alibi and config.norm_head == norm_head
    assert config.rotary_emb_fraction == (0.0 if use_alibi else 1.0) and not config.rotary_emb_interleaved
    assert config.rms_norm and config.activation_function == "swiglu" and not config.tie_word_embeddings
    assert not (config.qkv_proj_bias or config.out_proj_bias or config.mlp_fc1_bias or config.mlp_fc2_bias)


def test_config_overrides_and_refusals():
    config = baichuan_config_to_gpt2_config(baichuan_config(), use_alibi=True, norm_head=True)
    assert config.use_alibi and config.norm_head and config.n_inner == 160 and config.mlp_multiple_of == 1
    with pytest.raises(NotImplementedError, match="hidden_act"):
        baichuan_config_to_gpt2_config(baichuan_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match="num_attention_heads"):
        baichuan_config_to_gpt2_config(baichuan_config(num_attention_heads=5))


def test_remap_rejects_unknown_keys():
    c, ref = reference("baichuan-7b")
    config = baichuan_config_to_gpt2_config(c, use_alibi=False, norm_head=False)
    state_dict = dict(ref.state_dict())
    state_dict["model.layers.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="extra"):
        remap_state_dict_hf_baichuan(state_dict, config)
