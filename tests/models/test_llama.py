"""flash_attn.models.llama: tiny random HF LLaMA models (no downloads) converted to GPTLMHeadModel must give HF's
hidden states and logits in fp32 on CPU, for both attention paths, GQA and RoPE scaling; the state-dict remap
must round-trip in both directions."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import flash_attn
from flash_attn.models.gpt import GPTLMHeadModel, rope_inv_freq
from flash_attn.models.llama import (inv_remap_state_dict_hf_llama, llama_config_to_gpt2_config,
                                     remap_state_dict_hf_llama)

ATOL = 2e-5

ROPE = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    # original_max_position_embeddings = 8 puts the head dim's wavelengths in all three llama3 regimes
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8},
}


@pytest.fixture(autouse=True)
def torch_ops():
    with flash_attn.use_backend("torch"):  # RMSNorm/rotary on their PyTorch path (the interpreter is slow)
        yield


def tiny_llama(num_key_value_heads=2, rope=None, seed=0, **kwargs):
    torch.manual_seed(seed)
    extra = {} if rope is None else {"rope_scaling": dict(rope)}
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=num_key_value_heads,
                         intermediate_size=96, num_hidden_layers=2, vocab_size=101, max_position_embeddings=64,
                         rope_theta=1000.0, **extra, **kwargs)
    model = LlamaForCausalLM(config).eval()
    for name, p in model.named_parameters():  # non-trivial norms and biases
        if "norm" in name or name.endswith("bias"):
            torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.1)
    return model


def convert(hf, **overrides):
    config = llama_config_to_gpt2_config(hf.config)
    for k, v in overrides.items():
        setattr(config, k, v)
    model = GPTLMHeadModel(config).eval()
    model.load_state_dict(remap_state_dict_hf_llama(hf.state_dict(), config))
    return model


@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])
@pytest.mark.parametrize("num_key_value_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_matches_hf(use_flash_attn, num_key_value_heads):
    hf = tiny_llama(num_key_value_heads)
    model = convert(hf, use_flash_attn=use_flash_attn)
    ids = torch.randint(0, 101, (2, 19))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        hidden = model.transformer(ids)
        logits = model(ids).logits
    torch.testing.assert_close(hidden, ref.hidden_states[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, ref.logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("rope", ["linear", "llama3"])
def test_rope_scaling_matches_hf(rope):
    # Sequences past original_max_position_embeddings so the scaled low frequencies matter.
    hf = tiny_llama(rope=ROPE[rope])
    model = convert(hf, use_flash_attn=True)
    unscaled = convert(tiny_llama(), use_flash_attn=True)
    ids = torch.randint(0, 101, (1, 40))
    with torch.no_grad():
        logits = model(ids).logits
        torch.testing.assert_close(logits, hf(ids).logits, atol=ATOL, rtol=0)
        assert (logits - unscaled(ids).logits).abs().max() > 1e-3


def test_rope_scaling_survives_bf16_cast():
    # The rotary tables are rebuilt from _compute_inv_freq when the module is cast: the scaling must stay.
    model = convert(tiny_llama(rope=ROPE["linear"])).to(torch.bfloat16)
    rotary = model.transformer.layers[0].mixer.rotary_emb
    expected = rope_inv_freq(16, 1000.0, ROPE["linear"])
    torch.testing.assert_close(rotary._compute_inv_freq(), expected, atol=0, rtol=0)


def test_unsupported_rope_scaling_raises():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, intermediate_size=96, num_hidden_layers=1,
                         vocab_size=101, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(NotImplementedError, match="dynamic"):
        llama_config_to_gpt2_config(config)


def test_attention_and_mlp_bias_match_hf():
    hf = tiny_llama(attention_bias=True, mlp_bias=True)
    model = convert(hf)
    ids = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)


def test_tied_embeddings_and_padded_vocab():
    hf = tiny_llama(tie_word_embeddings=True)
    model = convert(hf, pad_vocab_size_multiple=8)
    assert model.lm_head.weight is model.transformer.embeddings.word_embeddings.weight
    assert model.lm_head.weight.shape[0] == 104
    ids = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[..., :101], hf(ids).logits, atol=ATOL, rtol=0)


def test_remap_round_trip_is_exact():
    hf = tiny_llama(num_key_value_heads=2, attention_bias=True)
    config = llama_config_to_gpt2_config(hf.config)
    back = inv_remap_state_dict_hf_llama(remap_state_dict_hf_llama(hf.state_dict(), config), config)
    ref = hf.state_dict()
    assert set(back) == set(ref)
    for k in ref:
        assert torch.equal(back[k], ref[k]), k


def test_our_weights_load_into_hf():
    # Direction ours -> HF: a randomly initialised GPTLMHeadModel exported with the inverse remap.
    hf = tiny_llama(num_key_value_heads=2)
    config = llama_config_to_gpt2_config(hf.config)
    config.pad_vocab_size_multiple = 8
    torch.manual_seed(1)
    model = GPTLMHeadModel(config).eval()
    hf.load_state_dict(inv_remap_state_dict_hf_llama(model.state_dict(), config))
    ids = torch.randint(0, 101, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits[..., :101], atol=ATOL, rtol=0)


def test_config_conversion():
    hf = tiny_llama(num_key_value_heads=2, rope=ROPE["linear"])
    config = llama_config_to_gpt2_config(hf.config)
    assert (config.n_embd, config.n_head, config.n_head_kv, config.n_layer, config.n_inner) == (64, 4, 2, 2, 96)
    assert config.rms_norm and config.rotary_emb_interleaved and config.rotary_emb_fraction == 1.0
    assert config.rotary_emb_base == 1000.0 and config.rotary_emb_scaling["factor"] == 2.0
    assert config.activation_function == "swiglu" and config.n_positions == 0
    assert not (config.qkv_proj_bias or config.out_proj_bias or config.mlp_fc1_bias or config.mlp_fc2_bias)


def test_remap_rejects_unknown_keys():
    hf = tiny_llama()
    config = llama_config_to_gpt2_config(hf.config)
    state_dict = dict(hf.state_dict())
    state_dict["model.layers.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="extra"):
        remap_state_dict_hf_llama(state_dict, config)
