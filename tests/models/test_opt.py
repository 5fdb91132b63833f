"""flash_attn.models.opt: tiny random HF OPT models (no downloads) converted to GPTLMHeadModel must give HF's
hidden states and logits in fp32 on CPU (both attention paths, with and without project_in/project_out,
biases on and off), greedy generation must match HF's, the state-dict remap must round-trip, and the variants
GPTLMHeadModel cannot express must be refused."""
import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM

from flash_attn.models.gpt import GPTLMHeadModel
from flash_attn.models.opt import inv_remap_state_dict_hf_opt, opt_config_to_gpt2_config, remap_state_dict_hf_opt

ATOL = 2e-5
VOCAB = 101


def tiny_opt(seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs = {"hidden_size": 64, "num_attention_heads": 4, "ffn_dim": 96, "num_hidden_layers": 2,
              "vocab_size": VOCAB, "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 1,
              "pad_token_id": 1, "dropout": 0.0, **kwargs}
    model = OPTForCausalLM(OPTConfig(**kwargs)).eval()
    for name, p in model.named_parameters():  # non-trivial LayerNorms and biases
        if "layer_norm" in name or name.endswith("bias"):
            is_norm_weight = "layer_norm" in name and name.endswith("weight")
            torch.nn.init.normal_(p, mean=1.0 if is_norm_weight else 0.0, std=0.1)
    return model


def convert(hf, **overrides):
    config = opt_config_to_gpt2_config(hf.config)
    for k, v in overrides.items():
        setattr(config, k, v)
    model = GPTLMHeadModel(config).eval()
    model.load_state_dict(remap_state_dict_hf_opt(hf.state_dict(), config))
    return model


@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])
@pytest.mark.parametrize("word_embed_proj_dim", [None, 32], ids=["same-width", "projected"])
def test_matches_hf(use_flash_attn, word_embed_proj_dim):
    hf = tiny_opt(word_embed_proj_dim=word_embed_proj_dim)
    model = convert(hf, use_flash_attn=use_flash_attn)
    assert (model.project_out is None) == (word_embed_proj_dim is None)
    ids = torch.randint(2, VOCAB, (2, 19))
    with torch.no_grad():
        ref = hf(ids)
        hidden = model.transformer(ids)
        if model.project_out is not None:
            hidden = model.project_out(hidden)
        torch.testing.assert_close(hidden, hf.model(ids).last_hidden_state, atol=ATOL, rtol=0)
        torch.testing.assert_close(model(ids).logits, ref.logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("activation_function", ["relu", "gelu"])
def test_other_activation_and_no_bias(activation_function):
    hf = tiny_opt(activation_function=activation_function, enable_bias=False)
    model = convert(hf)
    layer = model.transformer.layers[0]
    assert layer.mixer.Wqkv.bias is None and layer.mlp.fc1.bias is None
    ids = torch.randint(2, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)


def test_untied_head_and_padded_vocab():
    hf = tiny_opt(tie_word_embeddings=False)
    torch.nn.init.normal_(hf.lm_head.weight, std=0.05)
    assert hf.lm_head.weight is not hf.model.decoder.embed_tokens.weight
    model = convert(hf, pad_vocab_size_multiple=8)
    assert model.lm_head.weight.shape[0] == 104
    assert model.lm_head.weight is not model.transformer.embeddings.word_embeddings.weight
    ids = torch.randint(2, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[..., :VOCAB], hf(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("word_embed_proj_dim", [None, 32], ids=["same-width", "projected"])
def test_greedy_generation_matches_hf(word_embed_proj_dim):
    hf = tiny_opt(word_embed_proj_dim=word_embed_proj_dim)
    model = convert(hf)
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    out = model.generate(ids, max_length=20, return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        ref = hf.generate(ids, max_length=20, do_sample=False, pad_token_id=1, output_scores=True,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), atol=ATOL, rtol=0)


@pytest.mark.parametrize("word_embed_proj_dim", [None, 32], ids=["same-width", "projected"])
def test_remap_round_trip(word_embed_proj_dim):
    hf = tiny_opt(word_embed_proj_dim=word_embed_proj_dim)
    config = opt_config_to_gpt2_config(hf.config)
    ref = hf.state_dict()
    back = inv_remap_state_dict_hf_opt(remap_state_dict_hf_opt(ref, config), config)
    assert set(back) == set(ref)
    for k in ref:
        if k == "model.decoder.embed_positions.weight":  # the two unread leading rows come back as zeros
            assert torch.equal(back[k][2:], ref[k][2:]) and not back[k][:2].any()
        else:
            assert torch.equal(back[k], ref[k]), k


def test_remap_accepts_opt_model_keys():
    hf = tiny_opt()
    config = opt_config_to_gpt2_config(hf.config)
    bare = {k[len("model."):]: v for k, v in hf.state_dict().items() if k.startswith("model.")}
    remapped = remap_state_dict_hf_opt(bare, config)
    assert set(remapped) == set(remap_state_dict_hf_opt(hf.state_dict(), config))


def test_our_weights_load_into_hf():
    hf = tiny_opt(word_embed_proj_dim=32)
    config = opt_config_to_gpt2_config(hf.config)
    config.pad_vocab_size_multiple = 8
    torch.manual_seed(1)
    model = GPTLMHeadModel(config).eval()
    hf.load_state_dict(inv_remap_state_dict_hf_opt(model.state_dict(), config))
    ids = torch.randint(2, VOCAB, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits[..., :VOCAB], atol=ATOL, rtol=0)


def test_config_conversion():
    hf = tiny_opt(word_embed_proj_dim=32, dropout=0.1, attention_dropout=0.05)
    config = opt_config_to_gpt2_config(hf.config)
    assert (config.n_embd, config.n_head, config.n_layer, config.n_inner) == (64, 4, 2, 96)
    assert config.n_positions == 64 and config.word_embed_proj_dim == 32
    assert config.resid_pdrop == config.embd_pdrop == 0.1 and config.attn_pdrop == 0.05
    assert config.tie_word_embeddings and not config.lm_head_bias and config.activation_function == "relu"
    assert config.qkv_proj_bias and config.out_proj_bias and config.mlp_fc1_bias and config.mlp_fc2_bias
    assert getattr(config, "rotary_emb_fraction", 0.0) == 0.0 and not getattr(config, "parallel_block", False)
    assert opt_config_to_gpt2_config(tiny_opt().config).word_embed_proj_dim is None


@pytest.mark.parametrize("kwargs, match", [
    ({"do_layer_norm_before": False}, "post-norm"),
    ({"_remove_final_layer_norm": True}, "_remove_final_layer_norm"),
    ({"layer_norm_elementwise_affine": False}, "elementwise_affine"),
])
def test_unsupported_variants_are_refused(kwargs, match):
    config = OPTConfig(hidden_size=64, num_attention_heads=4, ffn_dim=96, num_hidden_layers=2, vocab_size=VOCAB)
    for k, v in kwargs.items():
        setattr(config, k, v)
    with pytest.raises(NotImplementedError, match=match):
        opt_config_to_gpt2_config(config)


def test_remap_rejects_unknown_keys():
    hf = tiny_opt()
    config = opt_config_to_gpt2_config(hf.config)
    state_dict = hf.state_dict()
    state_dict["model.decoder.layers.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="extra"):
        remap_state_dict_hf_opt(state_dict, config)
