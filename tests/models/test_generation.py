"""flash_attn.utils.generation: greedy decoding with our KV cache must reproduce HF ``generate`` token for token on
the same tiny random models (CPU, fp32); the sampling filters must agree with HF's logits warpers."""
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TopKLogitsWarper, TopPLogitsWarper)

import flash_attn
from flash_attn.models.gpt import CausalLMOutput, GPTLMHeadModel, remap_state_dict_hf_gpt2
from flash_attn.models.llama import llama_config_to_gpt2_config, remap_state_dict_hf_llama
from flash_attn.utils.generation import (InferenceParams, decode, modify_logit_for_repetition_penalty,
                                         modify_logits_for_min_p_filtering, modify_logits_for_top_k_filtering,
                                         modify_logits_for_top_p_filtering, sample)

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


def gpt2_pair(use_flash_attn, **config_kwargs):
    torch.manual_seed(0)
    config = GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1, **config_kwargs)
    hf = GPT2LMHeadModel(config).eval()
    config.use_flash_attn = use_flash_attn
    model = GPTLMHeadModel(config).eval()
    model.load_state_dict(remap_state_dict_hf_gpt2(hf.state_dict(), config))
    return hf, model


def llama_pair():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                         num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
                         eos_token_id=1, pad_token_id=1)
    hf = LlamaForCausalLM(config).eval()
    ours = llama_config_to_gpt2_config(config)
    ours.use_flash_attn = True
    model = GPTLMHeadModel(ours).eval()
    model.load_state_dict(remap_state_dict_hf_llama(hf.state_dict(), ours))
    return hf, model


def prompt(batch=3, seqlen=7, seed=2):
    return torch.randint(2, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def hf_greedy(hf, ids, max_length, **kwargs):
    with torch.no_grad():
        return hf.generate(ids, max_length=max_length, do_sample=False, pad_token_id=1, output_scores=True,
                           return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])
def test_greedy_matches_hf_gpt2(use_flash_attn):
    hf, model = gpt2_pair(use_flash_attn)
    ids = prompt()
    out = model.generate(ids, max_length=25, return_dict_in_generate=True, output_scores=True)
    ref = hf_greedy(hf, ids, 25)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), atol=2e-5, rtol=0)


def test_greedy_matches_hf_llama_gqa():
    hf, model = llama_pair()
    ids = prompt(batch=2, seqlen=9)
    out = model.generate(ids, max_length=30)
    assert torch.equal(out, hf_greedy(hf, ids, 30).sequences)


def test_eos_stops_like_hf():
    hf, model = gpt2_pair(True)
    ids = prompt()
    free = model.generate(ids, max_length=25)
    eos = int(free[0, ids.shape[1] + 2])  # a token sequence 0 emits at its third step
    out = model.generate(ids, max_length=25, eos_token_id=eos)
    ref = hf.generate(ids, max_length=25, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    assert torch.equal(out, ref)
    assert (out[0, ids.shape[1] + 2:] == eos).all()


def test_repetition_penalty_matches_hf():
    hf, model = gpt2_pair(False)
    ids = prompt()
    out = model.generate(ids, max_length=25, repetition_penalty=1.5)
    assert torch.equal(out, hf_greedy(hf, ids, 25, repetition_penalty=1.5).sequences)
    assert not torch.equal(out, model.generate(ids, max_length=25))


class PaddedVocab(torch.nn.Module):
    """Appends 11 padded-vocabulary logits that would always win the argmax."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, **kwargs):
        logits = self.model(input_ids, **kwargs).logits
        return CausalLMOutput(logits=torch.cat([logits, logits.new_full((*logits.shape[:-1], 11), 100.0)], -1))


def test_vocab_size_drops_padded_logits():
    hf, model = gpt2_pair(True)
    model = PaddedVocab(model)
    ids = prompt()
    out = decode(ids, model, 20, vocab_size=VOCAB, output_scores=True)
    assert torch.equal(out.sequences, hf_greedy(hf, ids, 20).sequences)
    assert out.scores[0].shape[-1] == VOCAB
    assert (decode(ids, model, ids.shape[1] + 1).sequences[:, -1] >= VOCAB).all()  # without it: padded ids


def test_sampling_is_seeded_and_respects_top_k():
    _, model = gpt2_pair(True)
    ids = prompt()
    torch.manual_seed(5)
    a = model.generate(ids, max_length=20, top_k=5, temperature=1.5, return_dict_in_generate=True,
                       output_scores=True)
    torch.manual_seed(5)
    b = model.generate(ids, max_length=20, top_k=5, temperature=1.5)
    assert torch.equal(a.sequences, b)
    for step, scores in enumerate(a.scores):
        top5 = scores.topk(5, dim=-1).indices
        token = a.sequences[:, ids.shape[1] + step]
        assert (top5 == token[:, None]).any(-1).all()


def test_generate_output_forms_and_timing(capsys):
    _, model = gpt2_pair(False)
    ids = prompt(batch=1)
    seqs = model.generate(ids, max_length=12)
    assert isinstance(seqs, torch.Tensor) and seqs.shape == (1, 12) and torch.equal(seqs[:, :7], ids)
    out = model.generate(ids, max_length=12, return_dict_in_generate=True, enable_timing=True)
    assert out.scores is None and torch.equal(out.sequences, seqs)
    assert out.timing["prefill_ms"] > 0 and out.timing["decode_ms_per_token"] > 0
    assert "ms/token" in capsys.readouterr().out


def test_teacher_forcing_feeds_given_tokens():
    # The scores at each step must be the model's logits given the teacher's prefix (a full forward pass).
    _, model = gpt2_pair(True)
    ids = prompt()
    teacher = torch.randint(2, VOCAB, (3, 16), generator=torch.Generator().manual_seed(9))
    teacher[:, :7] = ids
    out = decode(ids, model, 16, teacher_outputs=teacher, output_scores=True)
    assert torch.equal(out.sequences, teacher)
    with torch.no_grad():
        full = model(teacher).logits
    torch.testing.assert_close(torch.stack(out.scores, dim=1), full[:, 6:-1], atol=2e-5, rtol=0)


class RecordingStreamer:
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended = True


def test_streamer_receives_prompt_then_each_token():
    _, model = gpt2_pair(False)
    ids = prompt(batch=1)
    streamer = RecordingStreamer()
    out = model.generate(ids, max_length=12, streamer=streamer)
    assert streamer.ended and len(streamer.chunks) == 1 + 5
    assert torch.equal(streamer.chunks[0], ids)
    assert torch.equal(torch.cat(streamer.chunks[1:]), out[0, 7:])


def test_decode_argument_errors():
    _, model = gpt2_pair(False)
    ids = prompt(batch=1)
    with pytest.raises(ValueError, match="max_length"):
        decode(ids, model, 7)
    with pytest.raises(ValueError, match="CUDA"):
        decode(ids, model, 12, cg=True)
    with pytest.raises(ValueError, match="batch, seqlen"):
        decode(ids[0], model, 12)
    with pytest.raises(ValueError, match="temperature"):
        decode(ids, model, 12, top_k=0, temperature=0.0)


def test_inference_params_reset():
    params = InferenceParams(max_seqlen=8, max_batch_size=2, seqlen_offset=5,
                             lengths_per_sample=torch.tensor([5, 3], dtype=torch.int32))
    params.reset(16, 1)
    assert (params.max_seqlen, params.max_batch_size, params.seqlen_offset) == (16, 1, 0)
    assert params.lengths_per_sample.tolist() == [0, 0]


# ------------------------------------------------------------------------------------------------ sampling
def random_logits(seed=0, batch=4, vocab=50):
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_filter_matches_hf(top_p):
    logits = random_logits()
    ours = logits.clone()
    modify_logits_for_top_p_filtering(ours, top_p)
    ref = TopPLogitsWarper(top_p)(None, logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))


@pytest.mark.parametrize("top_k", [1, 3, 20])
def test_top_k_filter_matches_hf(top_k):
    logits = random_logits(1)
    ours = logits.clone()
    modify_logits_for_top_k_filtering(ours, top_k)
    assert torch.equal(torch.isinf(ours), torch.isinf(TopKLogitsWarper(top_k)(None, logits.clone())))


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_filter_matches_hf(min_p):
    logits = random_logits(2)
    ours = logits.clone()
    modify_logits_for_min_p_filtering(ours, min_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(MinPLogitsWarper(min_p)(None, logits.clone())))


def test_repetition_penalty_matches_hf_processor():
    logits = random_logits(3)
    prev = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(4))
    ours = modify_logit_for_repetition_penalty(logits.clone(), prev, 1.7)
    torch.testing.assert_close(ours, RepetitionPenaltyLogitsProcessor(1.7)(prev, logits.clone()), atol=0, rtol=0)


def test_sample_greedy_is_argmax():
    logits = random_logits(5)
    assert torch.equal(sample(logits, top_k=1, temperature=0.3), logits.argmax(-1))


def test_sample_top_p_small_is_greedy():
    logits = random_logits(6)
    torch.manual_seed(0)
    for _ in range(20):
        assert torch.equal(sample(logits, top_k=0, top_p=1e-6), logits.argmax(-1))


def test_sample_temperature_matches_distribution():
    # 20k draws from one row: empirical frequencies within 0.015 of softmax(logits / T) (~5 sigma).
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0]]).expand(20000, 5)
    torch.manual_seed(0)
    for temperature in (0.5, 2.0):
        draws = sample(logits, top_k=0, temperature=temperature)
        freq = torch.bincount(draws, minlength=5).float() / draws.numel()
        expected = torch.softmax(logits[0] / temperature, dim=-1)
        assert (freq - expected).abs().max() < 0.015, (temperature, freq, expected)


def test_sample_top_k_covers_exactly_the_top_k():
    logits = torch.tensor([[3.0, 2.9, 2.8, -5.0, 2.7, -4.0]]).expand(3000, 6)
    torch.manual_seed(0)
    drawn = set(sample(logits, top_k=4).tolist())
    assert drawn == {0, 1, 2, 4}


@pytest.mark.parametrize("kwargs", [dict(top_k=-1), dict(top_p=1.5), dict(min_p=-0.1), dict(top_k=0, temperature=-1.0)])
def test_sample_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        sample(random_logits(), **kwargs)


# ------------------------------------------------------------------------------------------------ CUDA graphs
def assert_scores_close(scores, ref_scores):
    # bf16: the graphed and eager steps may round differently; a wrong cache position or a stale input
    # buffer moves the logits by their own magnitude.
    scores, ref_scores = torch.stack(scores).float(), torch.stack(ref_scores).float()
    assert (scores - ref_scores).abs().max() <= 0.02 * ref_scores.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("model_kind", ["gpt2", "llama"])
def test_cuda_graph_decoding_matches_eager(model_kind):
    _, model = gpt2_pair(True) if model_kind == "gpt2" else llama_pair()
    model = model.cuda().to(torch.bfloat16)
    ids = prompt().cuda()
    eager = model.generate(ids, max_length=40, return_dict_in_generate=True, output_scores=True)
    # Teacher forcing with the eager tokens keeps both runs on the same sequence even after a bf16 near-tie.
    graphed = model.generate(ids, max_length=40, cg=True, teacher_outputs=eager.sequences,
                             return_dict_in_generate=True, output_scores=True)
    assert (3, 1) in model._decoding_cache.callables
    assert_scores_close(graphed.scores, eager.scores)
    # A second, shorter request reuses the captured graph and cache.
    eager2 = model.generate(ids[:, :5], max_length=30, return_dict_in_generate=True, output_scores=True)
    graphed2 = model.generate(ids[:, :5], max_length=30, cg=True, teacher_outputs=eager2.sequences,
                              return_dict_in_generate=True, output_scores=True)
    assert len(model._decoding_cache.callables) == 1
    assert_scores_close(graphed2.scores, eager2.scores)
