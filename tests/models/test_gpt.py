"""flash_attn.models.gpt: tiny random HF GPT-2 models (no downloads) converted with remap_state_dict_hf_gpt2 must
match HF in fp32 on CPU; our FlashAttention path must train like the plain-PyTorch path (convergence test)."""
import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

import flash_attn
from flash_attn.models.gpt import GPTLMHeadModel, GPTModel, remap_state_dict_hf_gpt2
from flash_attn.utils.generation import InferenceParams

ATOL = 2e-5
VOCAB = 101


@pytest.fixture(autouse=True)
def torch_ops(request):
    # CPU tests: the backend switch sends the fused ops (and attention) to their PyTorch paths (the interpreter is
    # slow); GPU tests run the kernels
    if request.node.get_closest_marker("gpu"):
        yield
        return
    with flash_attn.use_backend("torch"):
        yield


def gpt2_config(**kwargs):
    base = dict(n_embd=64, n_head=4, n_layer=2, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1)
    base.update(kwargs)
    return GPT2Config(**base)


def tiny_gpt2(seed=0, **kwargs):
    torch.manual_seed(seed)
    hf = GPT2LMHeadModel(gpt2_config(**kwargs)).eval()
    for name, p in hf.named_parameters():  # non-trivial LayerNorm and bias values
        if "ln" in name or name.endswith("bias"):
            torch.nn.init.normal_(p, mean=1.0 if ("ln" in name and name.endswith("weight")) else 0.0, std=0.1)
    return hf


def convert(hf, **overrides):
    config = gpt2_config(**{k: getattr(hf.config, k) for k in ("scale_attn_by_inverse_layer_idx",
                                                                  "activation_function")})
    for k, v in overrides.items():
        setattr(config, k, v)
    model = GPTLMHeadModel(config).eval()
    model.load_state_dict(remap_state_dict_hf_gpt2(hf.state_dict(), config))
    return model


@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])
@pytest.mark.parametrize("activation_function", ["gelu_new", "gelu", "relu"])
def test_matches_hf_gpt2(use_flash_attn, activation_function):
    hf = tiny_gpt2(activation_function=activation_function)
    model = convert(hf, use_flash_attn=use_flash_attn)
    ids = torch.randint(0, VOCAB, (2, 23))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        torch.testing.assert_close(model.transformer(ids), ref.hidden_states[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(model(ids).logits, ref.logits, atol=ATOL, rtol=0)


def test_scale_attn_by_inverse_layer_idx_matches_hf():
    hf = tiny_gpt2(scale_attn_by_inverse_layer_idx=True)
    model = convert(hf, use_flash_attn=True)
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=ATOL, rtol=0)


def test_explicit_position_ids_match_hf():
    hf = tiny_gpt2()
    model = convert(hf)
    ids = torch.randint(0, VOCAB, (2, 6))
    pos = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 2, 4, 6, 8, 10]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids, position_ids=pos).logits, hf(ids, position_ids=pos).logits,
                                   atol=ATOL, rtol=0)


def test_padded_vocab_and_tied_head():
    hf = tiny_gpt2()
    model = convert(hf, pad_vocab_size_multiple=16)
    assert model.transformer.embeddings.word_embeddings.weight.shape == (112, 64)
    assert model.lm_head.weight is model.transformer.embeddings.word_embeddings.weight
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(logits[..., :VOCAB], hf(ids).logits, atol=ATOL, rtol=0)
    assert torch.all(logits[..., VOCAB:] == 0)  # padded rows are zero


def test_num_last_tokens():
    model = convert(tiny_gpt2())
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, num_last_tokens=3).logits, model(ids).logits[:, -3:], atol=1e-6,
                                   rtol=0)


def test_remap_drops_mask_buffers_and_rejects_unknown_keys():
    hf = tiny_gpt2()
    state_dict = dict(hf.state_dict())
    state_dict["transformer.h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
    state_dict["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e4)
    config = hf.config
    remapped = remap_state_dict_hf_gpt2(state_dict, config)
    assert not any("attn.bias" in k or "masked_bias" in k for k in remapped)
    state_dict["transformer.h.0.attn.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="extra"):
        remap_state_dict_hf_gpt2(state_dict, config)


@pytest.mark.parametrize("rms_norm", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("parallel_block", [False, True], ids=["sequential", "parallel"])
def test_fused_dropout_add_ln_matches_unfused(rms_norm, parallel_block):
    torch.manual_seed(0)
    config = gpt2_config(rms_norm=rms_norm, parallel_block=parallel_block, residual_in_fp32=True)
    ref = GPTLMHeadModel(config).eval()
    config.fused_dropout_add_ln = True
    fused = GPTLMHeadModel(config).eval()
    fused.load_state_dict(ref.state_dict())
    ids = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, ref(ids).logits, atol=ATOL, rtol=0)


def test_rotary_gqa_model_kv_cache_matches_full_forward():
    torch.manual_seed(0)
    config = gpt2_config(n_positions=0, rotary_emb_fraction=0.5, n_head_kv=2, use_flash_attn=True,
                         activation_function="swiglu", mlp_multiple_of=16, rms_norm=True)
    model = GPTLMHeadModel(config).eval()
    ids = torch.randint(0, VOCAB, (2, 12))
    params = InferenceParams(max_seqlen=12, max_batch_size=2)
    with torch.no_grad():
        full = model(ids).logits
        steps = [model(ids[:, :8], inference_params=params).logits]
        params.seqlen_offset = 8
        for t in range(8, 12):
            steps.append(model(ids[:, t:t + 1], inference_params=params).logits)
            params.seqlen_offset += 1
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)
    assert model.transformer.layers[0].mixer.rotary_emb_dim == 8


def test_torch_compile_fullgraph_matches_eager():
    # Every kernel is a torch.library op, so the whole model (rotary GQA attention, fused MLP and add-norm)
    # traces as one graph, forward and backward.
    torch.manual_seed(0)
    config = gpt2_config(n_positions=0, rotary_emb_fraction=0.5, n_head_kv=2, use_flash_attn=True,
                         fused_mlp=True, fused_dropout_add_ln=True, residual_in_fp32=True)
    # eval(): no dropout either way, and RotaryEmbedding's train-mode cache check (tensor.is_inference())
    # is a graph break; gradients still flow.
    model = GPTLMHeadModel(config).eval()
    ids = torch.randint(0, VOCAB, (2, 16))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (model, compiled):
        model.zero_grad()
        logits = fn(ids).logits
        logits.square().mean().backward()
        results.append([logits] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_word_embed_proj_dim():
    torch.manual_seed(0)
    config = gpt2_config(word_embed_proj_dim=32)
    model = GPTLMHeadModel(config).eval()
    assert model.lm_head.weight.shape == (VOCAB, 32)
    ids = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():
        hidden = model.transformer(ids)
        expected = model.lm_head(model.project_out(hidden))
        torch.testing.assert_close(model(ids).logits, expected, atol=0, rtol=0)


def test_init_rescales_residual_projections():
    torch.manual_seed(0)
    model = GPTModel(gpt2_config(n_embd=256, n_head=4, n_layer=8, initializer_range=0.02))
    std_out = model.layers[3].mixer.out_proj.weight.std().item()
    std_qkv = model.layers[3].mixer.Wqkv.weight.std().item()
    assert abs(std_qkv - 0.02) < 0.002
    assert abs(std_out - 0.02 / 4.0) < 0.0005  # 1 / sqrt(2 * n_layer)


@pytest.mark.parametrize("config_kwargs, error", [
    (dict(activation_function="gelu_weird"), ValueError),
    (dict(prenorm=False), NotImplementedError),
    (dict(rotary_emb_fraction=0.5, n_positions=0, rotary_emb_scaling={"rope_type": "yarn", "factor": 2.0}),
     NotImplementedError),
])
def test_bad_configs_raise(config_kwargs, error):
    with pytest.raises(error):
        GPTLMHeadModel(gpt2_config(**config_kwargs))


def test_config_must_be_gpt2_like():
    with pytest.raises(TypeError, match="n_embd"):
        GPTModel(object())


def train(use_flash_attn, steps=10):
    torch.manual_seed(0)
    config = gpt2_config(use_flash_attn=use_flash_attn, n_head_kv=2, rotary_emb_fraction=0.5)
    model = GPTLMHeadModel(config).train()
    # SGD, not Adam: Adam normalises near-zero gradients (e.g. the key bias, which softmax ignores) so rounding
    # noise would become lr-sized parameter differences.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ids = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):  # memorise one batch: the loss must fall fast
        logits = model(ids[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def test_convergence_flash_matches_torch_path():
    losses_flash, model_flash = train(True)
    losses_torch, model_torch = train(False)
    assert losses_flash[-1] < losses_flash[0] - 2.0  # it does learn
    for a, b in zip(losses_flash, losses_torch):
        assert abs(a - b) < 1e-4
    for (name, p), q in zip(model_flash.named_parameters(), model_torch.parameters()):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=0, msg=name)


@pytest.mark.gpu
def test_bf16_gpu_forward_within_pytorch_error():
    hf = tiny_gpt2().cuda()
    model = convert(hf, use_flash_attn=True).cuda().to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 61), device="cuda")  # n_positions is 64: longer ids index past it
    with torch.no_grad():
        ref = hf(ids).logits
        pt = hf.to(torch.bfloat16)(ids).logits
        out = model(ids).logits
    err, err_pt = (out.float() - ref).abs().max().item(), (pt.float() - ref).abs().max().item()
    assert err <= 2 * err_pt + 1e-2, (err, err_pt)
