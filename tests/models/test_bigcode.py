"""flash_attn.models.bigcode: tiny random HF GPTBigCode models (no downloads; multi-query and multi-head) converted
to GPTLMHeadModel must give HF's hidden states and logits in fp32 on CPU (both attention paths), greedy generation
must match HF's, the state-dict remap must round-trip in both directions, and cross-attention configs are refused."""
import pytest
import torch
from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

import flash_attn
from flash_attn.models.bigcode import (bigcode_config_to_gpt2_config, inv_remap_state_dict_hf_bigcode,
                                       remap_state_dict_hf_bigcode)
from flash_attn.models.gpt import GPTLMHeadModel

ATOL = 2e-5
VOCAB = 101


@pytest.fixture(autouse=True)
def torch_ops():
    with flash_attn.use_backend("torch"):  # fused ops on their PyTorch path (the interpreter is slow)
        yield


def tiny_bigcode(multi_query=True, seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs = {"n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": VOCAB, "n_positions": 64, "n_inner": 96,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 1,
              "multi_query": multi_query, **kwargs}
    model = GPTBigCodeForCausalLM(GPTBigCodeConfig(**kwargs)).eval()
    for name, p in model.named_parameters():  # non-trivial LayerNorms and biases
        is_norm = ".ln_" in name
        if is_norm or name.endswith("bias"):
            torch.nn.init.normal_(p, mean=1.0 if is_norm and name.endswith("weight") else 0.0, std=0.1)
    return model


def convert(hf, **overrides):
    config = bigcode_config_to_gpt2_config(hf.config)
    for k, v in overrides.items():
        setattr(config, k, v)
    model = GPTLMHeadModel(config).eval()
    model.load_state_dict(remap_state_dict_hf_bigcode(hf.state_dict(), config))
    return model


@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])
@pytest.mark.parametrize("multi_query", [True, False], ids=["mqa", "mha"])
def test_matches_hf(multi_query, use_flash_attn):
    hf = tiny_bigcode(multi_query)
    model = convert(hf, use_flash_attn=use_flash_attn)
    assert model.transformer.layers[0].mixer.num_heads_kv == (1 if multi_query else 4)
    ids = torch.randint(0, VOCAB, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(model.transformer(ids), hf.transformer(ids).last_hidden_state, atol=ATOL, rtol=0)
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)


def test_untied_head_padded_vocab_relu():
    hf = tiny_bigcode(tie_word_embeddings=False, activation_function="relu")
    torch.nn.init.normal_(hf.lm_head.weight, std=0.05)
    model = convert(hf, pad_vocab_size_multiple=8)
    assert model.lm_head.weight.shape[0] == 104
    assert model.lm_head.weight is not model.transformer.embeddings.word_embeddings.weight
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[..., :VOCAB], hf(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("multi_query", [True, False], ids=["mqa", "mha"])
def test_greedy_generation_matches_hf(multi_query):
    hf = tiny_bigcode(multi_query)
    model = convert(hf)
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    out = model.generate(ids, max_length=20, return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        ref = hf.generate(ids, max_length=20, do_sample=False, pad_token_id=1, output_scores=True,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), atol=ATOL, rtol=0)


@pytest.mark.parametrize("multi_query", [True, False], ids=["mqa", "mha"])
def test_remap_round_trip_is_exact(multi_query):
    hf = tiny_bigcode(multi_query)
    config = bigcode_config_to_gpt2_config(hf.config)
    ref = hf.state_dict()
    back = inv_remap_state_dict_hf_bigcode(remap_state_dict_hf_bigcode(ref, config), config)
    assert set(back) == set(ref)
    for k in ref:
        assert torch.equal(back[k], ref[k]), k


@pytest.mark.parametrize("multi_query", [True, False], ids=["mqa", "mha"])
def test_our_weights_load_into_hf(multi_query):
    hf = tiny_bigcode(multi_query)
    config = bigcode_config_to_gpt2_config(hf.config)
    config.pad_vocab_size_multiple = 8
    torch.manual_seed(1)
    model = GPTLMHeadModel(config).eval()
    for name, p in model.named_parameters():  # GPT-2 init zeroes the biases: make the q/k/v order visible
        if name.endswith("bias"):
            torch.nn.init.normal_(p, std=0.1)
    hf.load_state_dict(inv_remap_state_dict_hf_bigcode(model.state_dict(), config))
    ids = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits[..., :VOCAB], atol=ATOL, rtol=0)


def test_config_conversion():
    hf = tiny_bigcode(activation_function="gelu_pytorch_tanh", layer_norm_epsilon=1e-4)
    config = bigcode_config_to_gpt2_config(hf.config)
    assert (config.n_embd, config.n_head, config.n_head_kv, config.n_layer, config.n_inner) == (64, 4, 1, 2, 96)
    assert config.n_positions == 64 and config.tie_word_embeddings and config.layer_norm_epsilon == 1e-4
    assert config.activation_function == "gelu_pytorch_tanh" and config.scale_attn_weights
    assert bigcode_config_to_gpt2_config(GPTBigCodeConfig(n_embd=64, n_head=4, n_inner=None)).n_inner == 256


def test_cross_attention_is_refused():
    config = GPTBigCodeConfig(n_embd=64, n_head=4, n_layer=1, vocab_size=VOCAB, multi_query=False,
                              add_cross_attention=True)
    with pytest.raises(NotImplementedError, match="add_cross_attention"):
        bigcode_config_to_gpt2_config(config)


def test_remap_rejects_unknown_keys():
    hf = tiny_bigcode()
    config = bigcode_config_to_gpt2_config(hf.config)
    state_dict = dict(hf.state_dict())
    state_dict["transformer.h.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="extra"):
        remap_state_dict_hf_bigcode(state_dict, config)
