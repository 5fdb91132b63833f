"""flash_attn.models.gptj: tiny random HF GPT-J models (no downloads) converted to GPTLMHeadModel must give HF's
hidden states and logits in fp32 on CPU (partial and full interleaved rotary, both attention paths), greedy
generation must match HF's, and the state-dict remap must round-trip."""
import pytest
import torch
from transformers import GPTJConfig, GPTJForCausalLM

import flash_attn
from flash_attn.models.gpt import GPTLMHeadModel
from flash_attn.models.gptj import gptj_config_to_gpt2_config, inv_remap_state_dict_hf_gptj, remap_state_dict_hf_gptj
from flash_attn.modules.block import ParallelBlock

ATOL = 2e-5
VOCAB = 101


@pytest.fixture(autouse=True)
def torch_ops():
    with flash_attn.use_backend("torch"):  # rotary on its PyTorch path (the interpreter is slow)
        yield


def tiny_gptj(seed=0, rotary_dim=4, **kwargs):
    torch.manual_seed(seed)
    config = GPTJConfig(n_embd=64, n_head=4, n_layer=2, n_inner=96, vocab_size=VOCAB, n_positions=64,
                        rotary_dim=rotary_dim, bos_token_id=0, eos_token_id=1, **kwargs)
    model = GPTJForCausalLM(config).eval()
    for name, p in model.named_parameters():  # non-trivial LayerNorms and biases
        if "ln_" in name or name.endswith("bias"):
            torch.nn.init.normal_(p, mean=1.0 if ("ln_" in name and name.endswith("weight")) else 0.0, std=0.1)
    return model


def convert(hf, **overrides):
    config = gptj_config_to_gpt2_config(hf.config)
    for k, v in overrides.items():
        setattr(config, k, v)
    model = GPTLMHeadModel(config).eval()
    model.load_state_dict(remap_state_dict_hf_gptj(hf.state_dict(), config))
    return model


@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])
@pytest.mark.parametrize("rotary_dim", [4, 16])
def test_matches_hf(use_flash_attn, rotary_dim):
    hf = tiny_gptj(rotary_dim=rotary_dim)
    model = convert(hf, use_flash_attn=use_flash_attn)
    layer = model.transformer.layers[0]
    assert type(layer) is ParallelBlock and layer.tied_norm and not hasattr(layer, "norm2")
    assert layer.mixer.rotary_emb_dim == rotary_dim and layer.mixer.Wqkv.bias is None
    ids = torch.randint(0, VOCAB, (2, 19))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        torch.testing.assert_close(model.transformer(ids), ref.hidden_states[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(model(ids).logits, ref.logits, atol=ATOL, rtol=0)


def test_padded_vocab():
    hf = tiny_gptj()
    model = convert(hf, pad_vocab_size_multiple=8)
    assert model.lm_head.weight.shape[0] == 104 and model.lm_head.bias.shape[0] == 104
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[..., :VOCAB], hf(ids).logits, atol=ATOL, rtol=0)


def test_greedy_generation_matches_hf():
    hf = tiny_gptj()
    model = convert(hf)
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    out = model.generate(ids, max_length=20, return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        ref = hf.generate(ids, max_length=20, do_sample=False, pad_token_id=1, output_scores=True,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), atol=ATOL, rtol=0)


def test_remap_round_trip_is_exact():
    hf = tiny_gptj()
    config = gptj_config_to_gpt2_config(hf.config)
    ref = hf.state_dict()
    back = inv_remap_state_dict_hf_gptj(remap_state_dict_hf_gptj(ref, config), config)
    assert set(back) == set(ref)
    for k in ref:
        assert torch.equal(back[k], ref[k]), k


def test_our_weights_load_into_hf():
    hf = tiny_gptj(rotary_dim=8)
    config = gptj_config_to_gpt2_config(hf.config)
    config.pad_vocab_size_multiple = 8
    torch.manual_seed(1)
    model = GPTLMHeadModel(config).eval()
    torch.nn.init.normal_(model.lm_head.bias, std=0.1)
    hf.load_state_dict(inv_remap_state_dict_hf_gptj(model.state_dict(), config))
    ids = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits[..., :VOCAB], atol=ATOL, rtol=0)


def test_config_conversion():
    hf = tiny_gptj(rotary_dim=8)
    config = gptj_config_to_gpt2_config(hf.config)
    assert (config.n_embd, config.n_head, config.n_layer, config.n_inner) == (64, 4, 2, 96)
    assert config.rotary_emb_fraction == 0.5 and config.rotary_emb_interleaved
    assert config.parallel_block and config.parallel_block_tied_norm
    assert not (config.qkv_proj_bias or config.out_proj_bias) and config.lm_head_bias
    assert config.n_positions == 0 and not config.tie_word_embeddings


def test_remap_rejects_unknown_keys():
    hf = tiny_gptj()
    config = gptj_config_to_gpt2_config(hf.config)
    state_dict = dict(hf.state_dict())
    state_dict["transformer.h.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="extra"):
        remap_state_dict_hf_gptj(state_dict, config)
