"""flash_attn.models.gpt_neox: tiny random HF GPT-NeoX models (no downloads) converted to GPTLMHeadModel must give
HF's hidden states and logits in fp32 on CPU (parallel and sequential residual, partial and full rotary, both
attention paths), greedy generation must match HF's, and the state-dict remap must round-trip."""
import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

import flash_attn
from flash_attn.models.gpt import GPTLMHeadModel
from flash_attn.models.gpt_neox import (gpt_neox_config_to_gpt2_config, inv_remap_state_dict_hf_gpt_neox,
                                        remap_state_dict_hf_gpt_neox)
from flash_attn.modules.block import Block, ParallelBlock

ATOL = 2e-5
VOCAB = 101


@pytest.fixture(autouse=True)
def torch_ops():
    with flash_attn.use_backend("torch"):  # rotary on its PyTorch path (the interpreter is slow)
        yield


def tiny_neox(seed=0, rotary_pct=0.25, **kwargs):
    torch.manual_seed(seed)
    config = GPTNeoXConfig(hidden_size=64, num_attention_heads=4, intermediate_size=96, num_hidden_layers=2,
                           vocab_size=VOCAB, max_position_embeddings=64, rotary_pct=rotary_pct,
                           rotary_emb_base=1000, bos_token_id=0, eos_token_id=1, **kwargs)
    model = GPTNeoXForCausalLM(config).eval()
    for name, p in model.named_parameters():  # non-trivial LayerNorms and biases
        if "layernorm" in name or "layer_norm" in name or name.endswith("bias"):
            is_norm_weight = ("layernorm" in name or "layer_norm" in name) and name.endswith("weight")
            torch.nn.init.normal_(p, mean=1.0 if is_norm_weight else 0.0, std=0.1)
    return model


def hf_state_dict(hf):
    # Checkpoints name the head embed_out; transformers >= 5 calls the module lm_head. Use the checkpoint name
    # so the remap is tested on what real files hold.
    sd = dict(hf.state_dict())
    if "lm_head.weight" in sd:
        sd["embed_out.weight"] = sd.pop("lm_head.weight")
    return sd


def convert(hf, **overrides):
    config = gpt_neox_config_to_gpt2_config(hf.config)
    for k, v in overrides.items():
        setattr(config, k, v)
    model = GPTLMHeadModel(config).eval()
    model.load_state_dict(remap_state_dict_hf_gpt_neox(hf_state_dict(hf), config))
    return model


@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])
@pytest.mark.parametrize("rotary_pct", [0.25, 1.0])
@pytest.mark.parametrize("use_parallel_residual", [True, False], ids=["parallel", "sequential"])
def test_matches_hf(use_flash_attn, rotary_pct, use_parallel_residual):
    hf = tiny_neox(rotary_pct=rotary_pct, use_parallel_residual=use_parallel_residual)
    model = convert(hf, use_flash_attn=use_flash_attn)
    block_cls = ParallelBlock if use_parallel_residual else Block
    assert all(type(layer) is block_cls for layer in model.transformer.layers)
    assert model.transformer.layers[0].mixer.rotary_emb_dim == int(16 * rotary_pct)
    ids = torch.randint(0, VOCAB, (2, 19))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        torch.testing.assert_close(model.transformer(ids), ref.hidden_states[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(model(ids).logits, ref.logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("hidden_act", ["gelu_new", "relu"])
def test_other_activations_and_no_attention_bias(hidden_act):
    hf = tiny_neox(hidden_act=hidden_act, attention_bias=False)
    model = convert(hf)
    assert model.transformer.layers[0].mixer.Wqkv.bias is None
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)


def test_padded_vocab():
    hf = tiny_neox()
    model = convert(hf, pad_vocab_size_multiple=8)
    assert model.lm_head.weight.shape[0] == 104
    assert model.lm_head.weight is not model.transformer.embeddings.word_embeddings.weight
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[..., :VOCAB], hf(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("use_parallel_residual", [True, False], ids=["parallel", "sequential"])
def test_greedy_generation_matches_hf(use_parallel_residual):
    hf = tiny_neox(use_parallel_residual=use_parallel_residual)
    model = convert(hf)
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    out = model.generate(ids, max_length=20, return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        ref = hf.generate(ids, max_length=20, do_sample=False, pad_token_id=1, output_scores=True,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), atol=ATOL, rtol=0)


def test_remap_round_trip_is_exact():
    hf = tiny_neox()
    config = gpt_neox_config_to_gpt2_config(hf.config)
    ref = hf_state_dict(hf)
    back = inv_remap_state_dict_hf_gpt_neox(remap_state_dict_hf_gpt_neox(ref, config), config)
    assert set(back) == set(ref)
    for k in ref:
        assert torch.equal(back[k], ref[k]), k


def test_our_weights_load_into_hf():
    hf = tiny_neox(rotary_pct=0.5)
    config = gpt_neox_config_to_gpt2_config(hf.config)
    config.pad_vocab_size_multiple = 8
    torch.manual_seed(1)
    model = GPTLMHeadModel(config).eval()
    hf.load_state_dict(inv_remap_state_dict_hf_gpt_neox(model.state_dict(), config, lm_head_name="lm_head"))
    ids = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits[..., :VOCAB], atol=ATOL, rtol=0)


def test_config_conversion():
    hf = tiny_neox(rotary_pct=0.5, use_parallel_residual=True)
    config = gpt_neox_config_to_gpt2_config(hf.config)
    assert (config.n_embd, config.n_head, config.n_layer, config.n_inner) == (64, 4, 2, 96)
    assert config.rotary_emb_fraction == 0.5 and config.rotary_emb_base == 1000.0
    assert not config.rotary_emb_interleaved and config.rotary_emb_scaling is None
    assert config.parallel_block and not config.parallel_block_tied_norm
    assert config.n_positions == 0 and not config.tie_word_embeddings and not config.lm_head_bias
    assert config.qkv_proj_bias and config.out_proj_bias and config.activation_function == "gelu"


def test_remap_rejects_unknown_keys():
    hf = tiny_neox()
    config = gpt_neox_config_to_gpt2_config(hf.config)
    state_dict = hf_state_dict(hf)
    state_dict["gpt_neox.layers.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="extra"):
        remap_state_dict_hf_gpt_neox(state_dict, config)
