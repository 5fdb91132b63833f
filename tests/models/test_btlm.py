"""flash_attn.models.btlm: BTLM is remote code (not in transformers), so this file holds a small plain-PyTorch reference
of the published architecture (GPT-2 layers with Conv1D weights, SwiGLU MLP with c_fc / c_fc2, ALiBi with its slopes
stored in the checkpoint, muP embedding / attention / output scaling) with the checkpoints' key names. Tiny random
references, converted, must give the reference's logits in fp32 on CPU (both attention paths, ALiBi and learned
positions), greedy generation through the KV cache must match the reference's, the remap must round-trip, and what
cannot be converted (ALiBi scaling, foreign slopes) must be refused. muP's training rules: a new model's init
statistics per parameter kind, AdamW groups with the width-scaled rate on hidden matrices, and one step's change of a
hidden layer's output staying width-independent under them."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flash_attn
from flash_attn.models.btlm import (btlm_config_to_gpt2_config, inv_remap_state_dict_hf_btlm, mup_init_,
                                   mup_param_groups, remap_state_dict_hf_btlm)
from flash_attn.models.gpt import GPTLMHeadModel

ATOL = 2e-5
VOCAB = 101
VARIANTS = {  # name -> config fields
    "btlm": {},  # the published architecture: ALiBi, SwiGLU, muP with scores / head_dim
    "learned-gelu": {"position_embedding_type": "learned", "activation_function": "gelu_new",
                     "mup_scale_qk_dot_by_d": False, "scale_attn_by_inverse_layer_idx": True},
}


@pytest.fixture(autouse=True)
def torch_ops():
    with flash_attn.use_backend("torch"):  # fused ops on their PyTorch path (the interpreter is slow)
        yield


def btlm_config(variant="btlm", **kwargs):
    # BTLMConfig's GPT-2 field names; 6 heads: not a power of two, so the ALiBi slopes take the interleaving branch
    fields = dict(vocab_size=VOCAB, n_positions=64, n_embd=96, n_layer=2, n_head=6, n_inner=160,
                  activation_function="swiglu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                  layer_norm_epsilon=1e-5, initializer_range=0.02, scale_attn_weights=True,
                  scale_attn_by_inverse_layer_idx=False, bos_token_id=0, eos_token_id=1, tie_word_embeddings=True,
                  position_embedding_type="alibi", mup_width_scale=0.5, mup_embeddings_scale=2.5,
                  mup_output_alpha=1.6, mup_scale_qk_dot_by_d=True, alibi_scaling=None)
    fields.update(VARIANTS[variant])
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


class Conv1D(nn.Module):
    """GPT-2's projection: weight (in, out)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.empty(n_in, n_out)), nn.Parameter(torch.empty(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class Attention(nn.Module):
    def __init__(self, c, layer_idx):
        super().__init__()
        self.c, self.layer_idx = c, layer_idx
        self.c_attn, self.c_proj = Conv1D(c.n_embd, 3 * c.n_embd), Conv1D(c.n_embd, c.n_embd)

    def forward(self, x, position_bias):
        b, s, dim = x.shape
        q, k, v = (t.reshape(b, s, self.c.n_head, -1).transpose(1, 2) for t in self.c_attn(x).split(dim, dim=-1))
        scores = q @ k.transpose(-1, -2) / v.shape[-1] ** (1.0 if self.c.mup_scale_qk_dot_by_d else 0.5)
        if self.c.scale_attn_by_inverse_layer_idx:
            scores = scores / (self.layer_idx + 1)
        if position_bias is not None:
            scores = scores + position_bias
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        return self.c_proj((probs @ v).transpose(1, 2).reshape(b, s, dim))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.swiglu = c.activation_function == "swiglu"
        self.c_fc = Conv1D(c.n_embd, c.n_inner)
        if self.swiglu:
            self.c_fc2 = Conv1D(c.n_embd, c.n_inner)
        self.c_proj = Conv1D(c.n_inner, c.n_embd)

    def forward(self, x):
        if self.swiglu:
            return self.c_proj(self.c_fc(x) * F.silu(self.c_fc2(x)))
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Layer(nn.Module):
    def __init__(self, c, layer_idx):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon), nn.LayerNorm(c.n_embd)
        self.ln_2.eps = c.layer_norm_epsilon
        self.attn, self.mlp = Attention(c, layer_idx), MLP(c)

    def forward(self, x, position_bias):
        x = x + self.attn(self.ln_1(x), position_bias)
        return x + self.mlp(self.ln_2(x))


class RelativePE(nn.Module):
    def __init__(self, n_head):
        super().__init__()
        self.slopes = nn.Parameter(torch.tensor(alibi_slopes(n_head))[:, None], requires_grad=False)  # (H, 1)

    def forward(self, s):
        distance = (torch.arange(s)[None, :] - torch.arange(s)[:, None]).abs()  # |key - query|
        return -self.slopes[:, :, None] * distance  # (H, S, S)


class Transformer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        if c.position_embedding_type == "learned":
            self.wpe = nn.Embedding(c.n_positions, c.n_embd)
        else:
            self.relative_pe = RelativePE(c.n_head)
        self.h = nn.ModuleList([Layer(c, i) for i in range(c.n_layer)])
        self.ln_f = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)

    def forward(self, ids):
        x = self.wte(ids)
        if hasattr(self, "wpe"):
            x = x + self.wpe(torch.arange(ids.shape[1]))
        x = x * self.c.mup_embeddings_scale
        position_bias = self.relative_pe(ids.shape[1]) if hasattr(self, "relative_pe") else None
        for layer in self.h:
            x = layer(x, position_bias)
        return self.ln_f(x)


class BTLMLMHeadModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c, self.transformer = c, Transformer(c)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, ids):
        return self.lm_head(self.transformer(ids)) * (self.c.mup_output_alpha * self.c.mup_width_scale)


def reference(variant="btlm", seed=0, **kwargs):
    torch.manual_seed(seed)
    c = btlm_config(variant, **kwargs)
    model = BTLMLMHeadModel(c).eval()
    for name, p in model.named_parameters():
        if name.endswith("slopes"):
            continue
        is_norm = ".ln_" in name
        nn.init.normal_(p, mean=1.0 if is_norm and name.endswith("weight") else 0.0, std=0.1 if is_norm else 0.05)
    return c, model


def convert(c, ref, **overrides):
    config = btlm_config_to_gpt2_config(c)
    for k, v in overrides.items():
        setattr(config, k, v)
    model = GPTLMHeadModel(config).eval()
    model.load_state_dict(remap_state_dict_hf_btlm(ref.state_dict(), config))
    return model


# --------------------------------------------------------------------------------------------------- tests
def test_reference_has_the_checkpoint_key_names():
    _, ref = reference()
    assert {"transformer.wte.weight", "transformer.relative_pe.slopes", "transformer.h.0.attn.c_attn.weight",
            "transformer.h.1.mlp.c_fc2.bias", "transformer.ln_f.weight", "lm_head.weight"} <= set(ref.state_dict())
    assert ref.state_dict()["transformer.h.0.attn.c_attn.weight"].shape == (96, 3 * 96)  # Conv1D: (in, out)


@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference(variant, use_flash_attn):
    c, ref = reference(variant)
    model = convert(c, ref, use_flash_attn=use_flash_attn)
    ids = torch.randint(0, VOCAB, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(model.transformer(ids), ref.transformer(ids), atol=ATOL, rtol=0)
        torch.testing.assert_close(model(ids).logits, ref(ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("field, value", [("mup_embeddings_scale", 1.0), ("mup_output_alpha", 1.0),
                                          ("mup_width_scale", 1.0), ("mup_scale_qk_dot_by_d", False)])
def test_each_mup_factor_matters(field, value):
    # The converted model must follow each muP field: with one of them reset in the conversion only, the
    # logits leave the reference's.
    c, ref = reference()
    model = convert(c, ref)
    c_off = btlm_config(**{field: value})
    off = GPTLMHeadModel(btlm_config_to_gpt2_config(c_off)).eval()
    off.load_state_dict(model.state_dict())
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids), atol=ATOL, rtol=0)
        assert (off(ids).logits - ref(ids)).abs().max() > 1e-3


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generation_matches_reference(variant):
    c, ref = reference(variant)
    model = convert(c, ref, use_flash_attn=True)
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
    c, ref = reference()
    model = convert(c, ref, pad_vocab_size_multiple=8)
    assert model.lm_head.weight.shape[0] == 104
    assert model.lm_head.weight is model.transformer.embeddings.word_embeddings.weight
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[..., :VOCAB], ref(ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_remap_round_trip_is_exact(variant):
    c, ref = reference(variant)
    config = btlm_config_to_gpt2_config(c)
    expected = ref.state_dict()
    back = inv_remap_state_dict_hf_btlm(remap_state_dict_hf_btlm(expected, config), config)
    assert set(back) == set(expected)
    for k in expected:
        assert torch.equal(back[k], expected[k]), k


def test_our_weights_load_into_reference():
    c, ref = reference()
    config = btlm_config_to_gpt2_config(c)
    torch.manual_seed(1)
    model = GPTLMHeadModel(config).eval()
    for name, p in model.named_parameters():  # GPT-2 init zeroes the biases: make their layout visible
        if name.endswith("bias"):
            nn.init.normal_(p, std=0.1)
    ref.load_state_dict(inv_remap_state_dict_hf_btlm(model.state_dict(), config))
    ids = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(ref(ids), model(ids).logits, atol=ATOL, rtol=0)


def test_config_conversion():
    config = btlm_config_to_gpt2_config(btlm_config())
    assert (config.n_embd, config.n_head, config.n_layer, config.n_inner) == (96, 6, 2, 160)
    assert config.use_alibi and config.n_positions == 0 and config.activation_function == "swiglu"
    assert (config.mup_width_scale, config.mup_embeddings_multiplier, config.mup_output_multiplier) == (0.5, 2.5, 1.6)
    assert config.mup_scale_qk_dot_by_d and config.mlp_multiple_of == 1 and config.tie_word_embeddings
    learned = btlm_config_to_gpt2_config(btlm_config("learned-gelu"))
    assert not learned.use_alibi and learned.n_positions == 64 and learned.scale_attn_by_inverse_layer_idx
    # hidden_size & co., as AutoConfig's attribute map also answers them
    aliases = SimpleNamespace(**{**vars(btlm_config()), "n_embd": None, "n_head": None, "n_layer": None,
                                 "hidden_size": 96, "num_attention_heads": 6, "num_hidden_layers": 2})
    assert btlm_config_to_gpt2_config(aliases).to_dict() == config.to_dict()


@pytest.mark.parametrize("field, value", [("alibi_scaling", {"type": "linear", "factor": 2.0}),
                                          ("position_embedding_type", "rotary"), ("add_cross_attention", True)])
def test_unsupported_configs_are_refused(field, value):
    with pytest.raises(NotImplementedError, match=field):
        btlm_config_to_gpt2_config(btlm_config(**{field: value}))


def test_foreign_alibi_slopes_are_refused():
    c, ref = reference()
    config = btlm_config_to_gpt2_config(c)
    state_dict = dict(ref.state_dict())
    state_dict["transformer.relative_pe.slopes"] = state_dict["transformer.relative_pe.slopes"] / 2
    with pytest.raises(ValueError, match="slopes"):
        remap_state_dict_hf_btlm(state_dict, config)
    state_dict["transformer.relative_pe.slopes"] = ref.state_dict()["transformer.relative_pe.slopes"].bfloat16()
    assert remap_state_dict_hf_btlm(state_dict, config)  # the paper's slopes, rounded to bf16, pass


def test_remap_rejects_unknown_keys():
    c, ref = reference()
    config = btlm_config_to_gpt2_config(c)
    state_dict = dict(ref.state_dict())
    state_dict["transformer.h.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="extra"):
        remap_state_dict_hf_btlm(state_dict, config)


# ------------------------------------------------------------------------------------------- muP training
# Wide enough that the sample std of every matrix is within ~1% of its population std (>= 24k entries).
MUP_WIDTH, MUP_SIGMA, MUP_SCALE = 256, 0.05, 0.25


def mup_model(width=MUP_WIDTH, width_scale=MUP_SCALE, seed=0, **kwargs):
    torch.manual_seed(seed)
    c = btlm_config(n_embd=width, n_head=4, n_inner=2 * width, initializer_range=MUP_SIGMA,
                    mup_width_scale=width_scale, **kwargs)
    return GPTLMHeadModel(btlm_config_to_gpt2_config(c))


def expected_std(name, width_scale=MUP_SCALE, n_layer=2):
    """BTLM's muP init, per parameter name: embeddings sigma, hidden matrices sigma * sqrt(w), out_proj / fc2
    additionally / sqrt(2 * n_layer)."""
    if "embeddings" in name or name.startswith("lm_head"):
        return MUP_SIGMA
    hidden = MUP_SIGMA * math.sqrt(width_scale)
    return hidden / math.sqrt(2 * n_layer) if ("out_proj" in name or "fc2" in name) else hidden


def check_mup_init(model, width_scale=MUP_SCALE):
    for name, p in model.named_parameters():
        if p.dim() == 2:
            assert p.mean().abs() < 0.05 * expected_std(name, width_scale), name
            assert p.std().item() == pytest.approx(expected_std(name, width_scale), rel=0.03), name
        elif name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("ln_f.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert name.endswith(".bias") and torch.equal(p, torch.zeros_like(p)), name


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_new_mup_model_starts_from_mup_init(tied):
    # The constructor applies the rules: a user training from scratch needs no extra call.
    model = mup_model(tie_word_embeddings=tied)
    check_mup_init(model)
    assert ("lm_head.weight" in dict(model.named_parameters())) is not tied


def test_mup_init_reinitialises_in_place():
    model = mup_model()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    torch.manual_seed(1)
    assert mup_init_(model) is model
    check_mup_init(model)


def test_mup_init_follows_the_width_scale():
    # Hidden matrices' std scales as sqrt(mup_width_scale); embeddings do not move.
    wide = mup_model(width_scale=0.0625)
    check_mup_init(wide, width_scale=0.0625)
    narrow = mup_model()
    hidden = wide.transformer.layers[0].mixer.Wqkv.weight.std() / narrow.transformer.layers[0].mixer.Wqkv.weight.std()
    assert hidden.item() == pytest.approx(math.sqrt(0.0625 / MUP_SCALE), rel=0.03)


def test_mup_param_groups_partition_the_parameters_with_mups_learning_rates():
    lr, wd = 3e-3, 0.1
    for tied in (True, False):
        model = mup_model(width=64, tie_word_embeddings=tied)
        groups = mup_param_groups(model, lr, weight_decay=wd)
        ids = [id(p) for g in groups for p in g["params"]]
        assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}
        names = {id(p): n for n, p in model.named_parameters()}
        by_name = {g["name"]: {names[id(p)] for p in g["params"]} for g in groups}
        matrices = {n for n, p in model.named_parameters() if p.dim() == 2}
        hidden = {n for n in matrices if any(k in n for k in ("Wqkv", "out_proj", "fc1", "fc2"))}
        assert by_name["hidden"] == hidden and len(hidden) == 4 * 2
        assert by_name["embedding"] == matrices - hidden  # word embedding (and the untied head)
        assert by_name["no_decay"] == {n for n, p in model.named_parameters() if p.dim() == 1}
        settings = {g["name"]: (g["lr"], g["weight_decay"]) for g in groups}
        assert settings == {"hidden": (lr * MUP_SCALE, wd), "embedding": (lr, wd), "no_decay": (lr, 0.0)}


def test_adamw_with_mup_groups_moves_hidden_matrices_by_the_scaled_rate():
    # Adam's first step moves every entry by lr * g / (|g| + eps) ~= lr: the group's rate, read off the update.
    model = mup_model(width=64)
    ids = torch.randint(0, VOCAB, (2, 9))
    F.cross_entropy(model(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr = 1e-2
    torch.optim.AdamW(mup_param_groups(model, lr, weight_decay=0.0), eps=1e-12).step()
    for name, p in model.named_parameters():
        moved = (p.detach() - before[name]).abs()
        moved = moved[p.grad.abs() > 1e-9]  # entries with a gradient
        rate = lr * MUP_SCALE if p.dim() == 2 and "embeddings" not in name else lr
        assert moved.numel() > 0 and torch.allclose(moved, torch.full_like(moved, rate), rtol=1e-3), name


def test_mup_param_groups_see_through_a_wrapper_and_refuse_unknown_parameters():
    model = mup_model(width=64)
    wrapper = nn.Module()
    wrapper.module = model  # as DistributedDataParallel keeps it
    assert [len(g["params"]) for g in mup_param_groups(wrapper, 1e-3)] == \
        [len(g["params"]) for g in mup_param_groups(model, 1e-3)]
    model.transformer.extra = nn.Conv1d(4, 4, 1)
    with pytest.raises(ValueError, match="extra"):
        mup_param_groups(model, 1e-3)


def fc1_output_change(width, mup, seed):
    """RMS change of layer 1's fc1 output on its own inputs after one AdamW step at base lr 1e-2, width-64 base."""
    model = mup_model(width=width, width_scale=64 / width, seed=seed)
    fc1 = model.transformer.layers[1].mlp.fc1
    seen = {}
    hook = fc1.register_forward_hook(lambda module, args, out: seen.update(x=args[0].detach()))
    ids = torch.randint(0, VOCAB, (1, 5))
    F.cross_entropy(model(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    hook.remove()
    groups = mup_param_groups(model, 1e-2) if mup else [{"params": list(model.parameters()), "lr": 1e-2}]
    before = fc1.weight.detach().clone()
    torch.optim.AdamW(groups, weight_decay=0.0).step()
    return (seen["x"] @ (fc1.weight.detach() - before).T).pow(2).mean().sqrt().item()


@pytest.mark.parametrize("seed", [0, 1])
def test_hidden_layer_update_is_width_independent_under_mup(seed):
    # Tensor Programs V's point: with muP's rates one step changes a hidden layer's output by the same amount at
    # every width, so a base lr tuned small transfers. Without the lr scaling the change grows with width (4x here:
    # Adam's update is ~lr per entry and the fc1 input is aligned with its own gradient).
    ratio_mup = fc1_output_change(256, True, seed) / fc1_output_change(64, True, seed)
    ratio_plain = fc1_output_change(256, False, seed) / fc1_output_change(64, False, seed)
    assert 0.75 < ratio_mup < 1.33
    assert ratio_plain > 3.0
