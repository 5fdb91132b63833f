"""flash_attn.integrations.transformers: HF models with attn_implementation="fa_dropin" must match the same models
on HF's sdpa attention (fp32, CPU): padding, KV-cache generation, sliding windows, packed sequences, encoders."""
import copy

import pytest
import torch
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

import flash_attn.integrations.transformers as integration

ATOL = 2e-5
VOCAB = 101


@pytest.fixture(scope="module")
def name():
    return integration.register()


def pair(model_cls, config, name, seed=0):
    """(sdpa model, our model) with the same weights; each gets its own config copy (HF writes the attention
    implementation into the config object)."""
    torch.manual_seed(seed)
    ref = model_cls._from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    ours = model_cls._from_config(copy.deepcopy(config), attn_implementation=name).eval()
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == name and ref.config._attn_implementation == "sdpa"
    return ref, ours


def llama_config(**kwargs):
    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                       num_hidden_layers=2, vocab_size=VOCAB, pad_token_id=0, **kwargs)


def left_padded_batch():
    ids = torch.randint(1, VOCAB, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :9] = 0
    return ids, mask


def test_our_attention_is_called(name, monkeypatch):
    calls = []
    original = integration.attention_forward

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(integration, "attention_forward", spy)
    integration.register(name)
    _, ours = pair(LlamaForCausalLM, llama_config(), name)
    with torch.no_grad():
        ours(torch.randint(1, VOCAB, (1, 5)))
    monkeypatch.undo()
    integration.register(name)
    assert calls == [torch.Size([1, 4, 5, 16])] * 2  # (B, H, S, D), once per layer


def test_llama_matches_sdpa(name):
    ref, ours = pair(LlamaForCausalLM, llama_config(), name)
    ids = torch.randint(1, VOCAB, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=ATOL, rtol=0)


def test_llama_left_padding_matches_sdpa(name):
    ref, ours = pair(LlamaForCausalLM, llama_config(), name)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        out, expected = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(out[valid], expected[valid], atol=ATOL, rtol=0)


def test_llama_generate_with_padding_matches_sdpa(name):
    ref, ours = pair(LlamaForCausalLM, llama_config(), name)
    ids, mask = left_padded_batch()
    kwargs = dict(attention_mask=mask, max_length=24, do_sample=False, output_scores=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        out, expected = ours.generate(ids, **kwargs), ref.generate(ids, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(expected.scores), atol=ATOL, rtol=0)


def test_gradients_match_sdpa(name):
    ref, ours = pair(LlamaForCausalLM, llama_config(), name)
    ids, mask = left_padded_batch()
    for model in (ref, ours):
        model.train()
        model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
    for (param_name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=param_name)


def test_sliding_window_matches_sdpa(name):
    config = MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                           num_hidden_layers=2, vocab_size=VOCAB, sliding_window=4, pad_token_id=0)
    ref, ours = pair(MistralForCausalLM, config, name)
    full, _ = pair(MistralForCausalLM, MistralConfig(**{**config.to_dict(), "sliding_window": None}), name)
    ids = torch.randint(1, VOCAB, (2, 12))
    with torch.no_grad():
        out = ours(ids).logits
        torch.testing.assert_close(out, ref(ids).logits, atol=ATOL, rtol=0)
        assert (out - full(ids).logits).abs().max() > 1e-3  # the window does change the result


def test_packed_sequences_match_separate_runs(name):
    ref, ours = pair(LlamaForCausalLM, llama_config(), name)
    a = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    b = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    packed = torch.cat([a, b], dim=1)
    position_ids = torch.cat([torch.arange(6), torch.arange(9)])[None]
    with torch.no_grad():
        out = ours(packed, position_ids=position_ids).logits
        torch.testing.assert_close(out[:, :6], ref(a).logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(out[:, 6:], ref(b).logits, atol=ATOL, rtol=0)


def test_bert_encoder_with_padding_matches_sdpa(name):
    config = BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2,
                        vocab_size=VOCAB, max_position_embeddings=32)
    ref, ours = pair(BertModel, config, name)
    ids = torch.randint(1, VOCAB, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 2:] = 0
    with torch.no_grad():
        out, expected = ours(ids, attention_mask=mask), ref(ids, attention_mask=mask)
    valid = mask.bool()
    torch.testing.assert_close(out.last_hidden_state[valid], expected.last_hidden_state[valid], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.pooler_output, expected.pooler_output, atol=ATOL, rtol=0)


def test_rejects_4d_masks_and_attention_sinks():
    q = torch.randn(1, 2, 3, 8)
    module = torch.nn.Module()
    with pytest.raises(NotImplementedError, match="4D"):
        integration.attention_forward(module, q, q, q, torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="s_aux"):
        integration.attention_forward(module, q, q, q, None, s_aux=torch.zeros(2))


@pytest.mark.parametrize("bad", ["", "my_flash_attn", 3])
def test_register_rejects_bad_names(bad):
    with pytest.raises(ValueError):
        integration.register(bad)

