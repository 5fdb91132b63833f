"""flash_attn.models.falcon: tiny random HF Falcon models (no downloads) converted to GPTLMHeadModel must give
HF's hidden states and logits in fp32 on CPU (new decoder architecture with one or two LayerNorms, parallel
multi-query, parallel per-head and sequential layers; both attention paths), greedy generation must match
HF's, the state-dict remap must round-trip, and ALiBi Falcons must be refused."""
import pytest
import torch
from transformers import FalconConfig, FalconForCausalLM

import flash_attn
from flash_attn.models.falcon import (falcon_config_to_gpt2_config, inv_remap_state_dict_hf_falcon,
                                      remap_state_dict_hf_falcon)
from flash_attn.models.gpt import GPTLMHeadModel
from flash_attn.modules.block import Block, ParallelBlock

ATOL = 2e-5
VOCAB = 101

VARIANTS = {  # name -> FalconConfig kwargs
    "new-2ln": {"new_decoder_architecture": True, "num_kv_heads": 2},
    "new-1ln": {"new_decoder_architecture": True, "num_kv_heads": 2, "num_ln_in_parallel_attn": 1},
    "multi-query": {"multi_query": True, "parallel_attn": True},
    "per-head": {"multi_query": False, "parallel_attn": True},
    "sequential": {"multi_query": True, "parallel_attn": False},
}


@pytest.fixture(autouse=True)
def torch_ops():
    with flash_attn.use_backend("torch"):  # rotary on its PyTorch path (the interpreter is slow)
        yield


def tiny_falcon(variant="new-2ln", seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": VOCAB,
              "ffn_hidden_size": 96, "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 1,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}, **VARIANTS[variant], **kwargs}
    model = FalconForCausalLM(FalconConfig(**kwargs)).eval()
    for name, p in model.named_parameters():  # non-trivial LayerNorms and biases
        is_norm = "ln" in name.split(".")[-2] or "layernorm" in name
        if is_norm or name.endswith("bias"):
            torch.nn.init.normal_(p, mean=1.0 if is_norm and name.endswith("weight") else 0.0, std=0.1)
    return model


def convert(hf, **overrides):
    config = falcon_config_to_gpt2_config(hf.config)
    for k, v in overrides.items():
        setattr(config, k, v)
    model = GPTLMHeadModel(config).eval()
    model.load_state_dict(remap_state_dict_hf_falcon(hf.state_dict(), config))
    return model


@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_hf(variant, use_flash_attn):
    hf = tiny_falcon(variant)
    model = convert(hf, use_flash_attn=use_flash_attn)
    block_cls = Block if variant == "sequential" else ParallelBlock
    assert all(type(layer) is block_cls for layer in model.transformer.layers)
    ids = torch.randint(0, VOCAB, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(model.transformer(ids), hf.transformer(ids).last_hidden_state, atol=ATOL, rtol=0)
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["new-2ln", "per-head"])
def test_biases_untied_head_padded_vocab(variant):
    hf = tiny_falcon(variant, bias=True, tie_word_embeddings=False, activation="relu")
    torch.nn.init.normal_(hf.lm_head.weight, std=0.05)
    model = convert(hf, pad_vocab_size_multiple=8)
    assert model.transformer.layers[0].mixer.Wqkv.bias is not None
    assert model.lm_head.weight.shape[0] == 104
    assert model.lm_head.weight is not model.transformer.embeddings.word_embeddings.weight
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[..., :VOCAB], hf(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["new-2ln", "multi-query", "sequential"])
def test_greedy_generation_matches_hf(variant):
    hf = tiny_falcon(variant)
    model = convert(hf)
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    out = model.generate(ids, max_length=20, return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        ref = hf.generate(ids, max_length=20, do_sample=False, pad_token_id=1, output_scores=True,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_remap_round_trip_is_exact(variant):
    hf = tiny_falcon(variant, bias=True)
    config = falcon_config_to_gpt2_config(hf.config)
    ref = hf.state_dict()
    back = inv_remap_state_dict_hf_falcon(remap_state_dict_hf_falcon(ref, config), config)
    assert set(back) == set(ref)
    for k in ref:
        assert torch.equal(back[k], ref[k]), k


def test_our_weights_load_into_hf():
    hf = tiny_falcon("new-2ln", bias=True)
    config = falcon_config_to_gpt2_config(hf.config)
    config.pad_vocab_size_multiple = 8
    torch.manual_seed(1)
    model = GPTLMHeadModel(config).eval()
    hf.load_state_dict(inv_remap_state_dict_hf_falcon(model.state_dict(), config))
    ids = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits[..., :VOCAB], atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant, n_head_kv, parallel, tied", [
    ("new-2ln", 2, True, False), ("new-1ln", 2, True, True), ("multi-query", 1, True, True),
    ("per-head", 4, True, True), ("sequential", 1, False, False)])
def test_config_conversion(variant, n_head_kv, parallel, tied):
    config = falcon_config_to_gpt2_config(tiny_falcon(variant).config)
    assert (config.n_embd, config.n_head, config.n_layer, config.n_inner) == (64, 4, 2, 96)
    assert config.n_head_kv == n_head_kv and config.parallel_block == parallel
    assert config.parallel_block_tied_norm == tied
    assert config.rotary_emb_fraction == 1.0 and config.rotary_emb_base == 1000.0
    assert not config.rotary_emb_interleaved and config.rotary_emb_scaling is None
    assert config.n_positions == 0 and config.tie_word_embeddings and not config.lm_head_bias
    assert not config.qkv_proj_bias and not config.mlp_fc1_bias and config.activation_function == "gelu"


def test_alibi_is_refused():
    config = FalconConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=VOCAB, alibi=True)
    with pytest.raises(NotImplementedError, match="alibi"):
        falcon_config_to_gpt2_config(config)


def test_remap_rejects_unknown_keys():
    hf = tiny_falcon()
    config = falcon_config_to_gpt2_config(hf.config)
    state_dict = hf.state_dict()
    state_dict["transformer.h.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="extra"):
        remap_state_dict_hf_falcon(state_dict, config)
