"""flash_attn.models.bert: a tiny random HF BertForPreTraining (no downloads) converted with remap_state_dict must
give HF's hidden states, pooled output, logits and loss in fp32 on CPU, with padding, for both attention paths
(the flash path unpads once and runs the varlen kernels) and the masked-token subset of the last layer."""
import pytest
import torch
from transformers import BertConfig
from transformers import BertForPreTraining as HFBertForPreTraining

import flash_attn
from flash_attn.models.bert import BertForPreTraining, BertModel, remap_state_dict

ATOL = 2e-5
VOCAB = 100


@pytest.fixture(autouse=True)
def torch_ops():
    with flash_attn.use_backend("torch"):  # fused ops on their PyTorch path (the interpreter is slow)
        yield


def bert_config(**kwargs):
    base = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2,
                vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)
    base.update(kwargs)
    return BertConfig(**base)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    model = HFBertForPreTraining(bert_config()).eval()
    for name, p in model.named_parameters():
        if "LayerNorm" in name or name.endswith("bias"):
            torch.nn.init.normal_(p, mean=1.0 if ("LayerNorm" in name and name.endswith("weight")) else 0.0,
                                  std=0.1)
    return model


@pytest.fixture(scope="module")
def batch():
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    types = torch.randint(0, 2, (3, 12))
    labels = torch.zeros(3, 12, dtype=torch.long)  # FA2 convention: 0 = not predicted
    for b, positions in enumerate([[2, 5, 11], [1, 6], [2]]):
        labels[b, positions] = torch.randint(1, VOCAB, (len(positions),))
    return ids, mask, types, labels


def convert(hf, **config_kwargs):
    config = bert_config(**config_kwargs)
    model = BertForPreTraining(config).eval()
    model.load_state_dict(remap_state_dict(hf.state_dict(), config))
    return model


paths = pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])


@paths
def test_bert_model_matches_hf_with_padding(hf_model, batch, use_flash_attn):
    ids, mask, types, _ = batch
    model = convert(hf_model, use_flash_attn=use_flash_attn)
    with torch.no_grad():
        ref = hf_model.bert(ids, attention_mask=mask, token_type_ids=types)
        out = model.bert(ids, attention_mask=mask, token_type_ids=types)
    valid = mask.bool()
    torch.testing.assert_close(out.last_hidden_state[valid], ref.last_hidden_state[valid], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.pooler_output, ref.pooler_output, atol=ATOL, rtol=0)


@paths
def test_pretraining_logits_and_loss_match_hf(hf_model, batch, use_flash_attn):
    ids, mask, types, labels = batch
    model = convert(hf_model, use_flash_attn=use_flash_attn)
    nsp = torch.tensor([0, 1, 1])
    with torch.no_grad():
        ref = hf_model(ids, attention_mask=mask, token_type_ids=types, labels=labels.masked_fill(labels == 0, -100),
                       next_sentence_label=nsp)
        out = model(ids, attention_mask=mask, token_type_ids=types, labels=labels, next_sentence_label=nsp)
    valid = mask.bool()
    torch.testing.assert_close(out.prediction_logits[valid], ref.prediction_logits[valid], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.seq_relationship_logits, ref.seq_relationship_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.loss, ref.loss, atol=ATOL, rtol=0)


@paths
@pytest.mark.parametrize("last_layer_subset", [False, True], ids=["dense_seq_output", "last_layer_subset"])
def test_masked_token_subset_matches_hf(hf_model, batch, use_flash_attn, last_layer_subset):
    # Only masked tokens (and [CLS] for the pooler) are computed in the last layer / prediction head.
    ids, mask, types, labels = batch
    model = convert(hf_model, use_flash_attn=use_flash_attn, dense_seq_output=True,
                    last_layer_subset=last_layer_subset)
    if last_layer_subset:
        assert model.bert.encoder.layers[-1].mixer.cross_attn
    nsp = torch.tensor([1, 0, 1])
    with torch.no_grad():
        ref = hf_model(ids, attention_mask=mask, token_type_ids=types, labels=labels.masked_fill(labels == 0, -100),
                       next_sentence_label=nsp)
        out = model(ids, attention_mask=mask, token_type_ids=types, labels=labels, next_sentence_label=nsp)
    masked = labels > 0
    assert out.prediction_logits.shape == (int(masked.sum()), VOCAB)
    torch.testing.assert_close(out.prediction_logits, ref.prediction_logits[masked], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.seq_relationship_logits, ref.seq_relationship_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.loss, ref.loss, atol=ATOL, rtol=0)


def test_padded_vocab(hf_model, batch):
    ids, mask, types, _ = batch
    model = convert(hf_model, pad_vocab_size_multiple=8)
    assert model.bert.embeddings.word_embeddings.weight.shape[0] == 104
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    with torch.no_grad():
        ref = hf_model(ids, attention_mask=mask, token_type_ids=types).prediction_logits
        out = model(ids, attention_mask=mask, token_type_ids=types).prediction_logits
    valid = mask.bool()
    torch.testing.assert_close(out[..., :VOCAB][valid], ref[valid], atol=ATOL, rtol=0)


@paths
def test_fused_dropout_add_ln_and_fused_mlp_match(hf_model, batch, use_flash_attn):
    ids, mask, types, _ = batch
    model = convert(hf_model, use_flash_attn=use_flash_attn, fused_dropout_add_ln=True, fused_mlp=True)
    with torch.no_grad():
        ref = hf_model.bert(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        out = model.bert(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    valid = mask.bool()
    torch.testing.assert_close(out[valid], ref[valid], atol=ATOL, rtol=0)


def test_remap_accepts_bert_model_keys_and_old_layernorm_names(hf_model):
    config = bert_config()
    state_dict = {k[len("bert."):]: v for k, v in hf_model.state_dict().items() if k.startswith("bert.")}
    state_dict = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
                  for k, v in state_dict.items()}
    model = BertModel(config)
    remapped = {k[len("bert."):]: v for k, v in remap_state_dict(state_dict, config).items()}
    model.load_state_dict(remapped)  # strict: every key present, nothing extra


def test_remap_rejects_unknown_layer_keys(hf_model):
    state_dict = dict(hf_model.state_dict())
    state_dict["bert.encoder.layer.0.attention.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="extra"):
        remap_state_dict(state_dict, bert_config())


def test_bad_configs_raise():
    with pytest.raises(ValueError, match="hidden_act"):
        BertModel(bert_config(hidden_act="swish"))
    with pytest.raises(ValueError, match="dense_seq_output"):
        BertForPreTraining(bert_config(last_layer_subset=True))
    with pytest.raises(NotImplementedError, match="position_embedding_type"):
        BertModel(bert_config(position_embedding_type="relative_key"))
