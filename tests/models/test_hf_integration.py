"""flash_attn.integrations.transformers: HF models with attn_implementation="fa_dropin" must match the same models
on HF's sdpa attention (fp32, CPU): padding, KV-cache generation, sliding windows, packed sequences, encoders."""
import copy
import os

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



_HF_FA2_SCRIPT = r'''
import copy, functools, json, os, sys
import torch
import flash_attn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import import_utils

assert import_utils.is_flash_attn_2_available(), "transformers does not take this flash_attn as FA2"
calls = []
real = {n: getattr(flash_attn, n) for n in ("flash_attn_func", "flash_attn_varlen_func")}

def counting(name, fn):  # wraps keeps fn's signature visible: transformers passes what inspect.signature lists
    @functools.wraps(fn)
    def wrapper(*a, **k):
        calls.append(name)
        return fn(*a, **k)
    return wrapper


for n, fn in real.items():  # transformers imports them from flash_attn at first use
    setattr(flash_attn, n, counting(n, fn))
config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                     num_hidden_layers=2, vocab_size=101, pad_token_id=0)
torch.manual_seed(0)
ref = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="sdpa").cuda().eval()
models = {}
for impl, dtype in (("flash_attention_2", torch.bfloat16), ("sdpa", torch.bfloat16)):
    # a config per model: _from_config records the implementation on the config it is given
    m = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=impl).cuda().eval()
    assert m.config._attn_implementation == impl, (impl, m.config._attn_implementation)
    m.load_state_dict(ref.state_dict())
    models[impl] = m.to(dtype)
ids = torch.randint(1, 101, (3, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
mask = torch.ones_like(ids)
mask[1, :7] = 0
mask[2, :31] = 0
result = {}
with torch.no_grad():
    for name, kw in (("dense", {}), ("padded", {"attention_mask": mask})):
        want = ref(ids, **kw).logits.float()
        valid = mask.bool() if kw else torch.ones_like(mask, dtype=torch.bool)
        err = {impl: float((m(ids, **kw).logits.float() - want)[valid].abs().max()) for impl, m in models.items()}
        result[name] = err
m = models["flash_attention_2"].train()
loss = m(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
loss.backward()
result["loss_finite"] = bool(torch.isfinite(loss).item())
result["grads_finite"] = all(bool(torch.isfinite(p.grad).all()) for p in m.parameters() if p.grad is not None)
result["calls"] = sorted(set(calls))
print(json.dumps(result))
'''


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_transformers_flash_attention_2_runs_our_kernels(tmp_path):
    """A tiny Llama with attn_implementation="flash_attention_2" (transformers' own FA2 integration, which imports
    flash_attn_func / flash_attn_varlen_func from this package) on the GPU: transformers takes the package as FA2
    when its distribution metadata says flash-attn >= 2.3.3 (tests/api/test_packaging.py checks the wheel's; here a
    dist-info beside the checkout stands for it), both functions run (varlen for a padded batch), the logits are as
    close to the fp32 model's as bf16 SDPA's are (FlashAttention's criterion: within 2x, plus bf16 rounding), and a
    training step gives finite gradients."""
    import json
    import subprocess
    import sys

    import flash_attn

    dist = tmp_path / f"flash_attn-{flash_attn.__version__}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flash-attn\nVersion: {flash_attn.__version__}\n")
    (dist / "top_level.txt").write_text("flash_attn\n")
    (dist / "RECORD").write_text("flash_attn/__init__.py,,\n")
    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), root, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _HF_FA2_SCRIPT], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["calls"] == ["flash_attn_func", "flash_attn_varlen_func"], got
    for case in ("dense", "padded"):
        ours, sdpa = got[case]["flash_attention_2"], got[case]["sdpa"]
        assert ours <= 2 * sdpa + 1e-2, (case, got[case])
    assert got["loss_finite"] and got["grads_finite"], got
