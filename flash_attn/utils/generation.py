"""Autoregressive decoding with a KV cache (drop-in for FlashAttention 2's ``flash_attn.utils.generation``).

The prompt is processed in one forward pass that fills each attention layer's cache; every later step feeds
one token per sequence. With ``cg=True`` (CUDA only) the one-token step is captured once as a CUDA graph and
replayed: a decode step of a small model is dominated by kernel-launch latency, which replay removes. The
graph reads the current cache length from ``InferenceParams.lengths_per_sample`` (a device tensor) so the
same graph serves every position.

Sampling: greedy (top_k=1), top-k, nucleus / top-p (Holtzman et al. 2020), min-p, temperature and the
CTRL repetition penalty (Keskar et al. 2019), with the semantics of the ``transformers`` logits warpers.
"""
import gc
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor


@dataclass
class InferenceParams:
    """Decoding state passed to every layer of a model.

    max_seqlen / max_batch_size: cache capacity. seqlen_offset: tokens already in the cache (same for every
    sequence); lengths_per_sample: int32 (max_batch_size,) per-sequence cache lengths that, when set, take
    precedence (CUDA-graph decoding). batch_size_offset: first cache row used by this batch.
    key_value_memory_dict: layer_idx -> KV cache (max_batch_size, max_seqlen, 2, Hk, D).
    """

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: Optional[Tensor] = None

    def reset(self, max_seqlen, max_batch_size):
        """Start a new generation that reuses the allocated caches."""
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()


@dataclass
class DecodeOutput:
    """sequences (B, L) long, prompt included; scores: one (B, V) tensor of processed logits per new token;
    timing (enable_timing): {"prefill_ms", "decode_ms", "decode_ms_per_token"}."""

    sequences: Tensor
    scores: Optional[tuple] = None
    timing: Optional[dict] = None


# ------------------------------------------------------------------------------------------------ sampling
def modify_logits_for_top_k_filtering(logits, top_k):
    """In place: logits (B, V) below each row's top_k-th largest become -inf."""
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    logits.masked_fill_(logits < kth, float("-inf"))


def modify_logits_for_top_p_filtering(logits, top_p):
    """In place: keep the smallest set of most likely tokens whose probability reaches top_p (at least one)."""
    if top_p <= 0.0 or top_p >= 1.0:
        return
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    # Mass strictly before each token in descending order: a token is dropped once the tokens ahead of it
    # already reach top_p, so the most likely token always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    remove_sorted = mass_before >= top_p
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    logits.masked_fill_(remove, float("-inf"))


def modify_logits_for_min_p_filtering(logits, min_p):
    """In place: drop tokens whose probability is below min_p times the row's largest probability."""
    if min_p <= 0.0:
        return
    probs = torch.softmax(logits.float(), dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p
    logits.masked_fill_(probs < threshold, float("-inf"))


def modify_logit_for_repetition_penalty(logits, prev_output_tokens, repetition_penalty=1.0):
    """In place: logits (B, V) of tokens in prev_output_tokens (B, L) are divided by the penalty when positive,
    multiplied when negative (so a penalty > 1 always makes repeats less likely)."""
    if repetition_penalty == 1.0:
        return logits
    seen = torch.gather(logits, 1, prev_output_tokens)
    seen = torch.where(seen < 0, seen * repetition_penalty, seen / repetition_penalty)
    logits.scatter_(1, prev_output_tokens, seen)
    return logits


def sample(logits, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0):
    """Draw one token per row of logits (B, V) -> (B,) long.

    top_k=1 is greedy (argmax; the other arguments are ignored). top_k=0 means no top-k limit. Filters apply
    to logits / temperature: top-k, then top-p (0 or 1 = off), then min-p (0 = off).
    """
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1], got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0 (use top_k=1 for greedy decoding), got {temperature}")
    if top_k == 1:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k > 0:
        top_k = min(top_k, logits.shape[-1])
        logits, indices = torch.topk(logits, top_k, dim=-1)
    modify_logits_for_top_p_filtering(logits, top_p)
    modify_logits_for_min_p_filtering(logits, min_p)
    choice = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)
    if top_k > 0:
        choice = torch.gather(indices, -1, choice)
    return choice.squeeze(-1)


# ------------------------------------------------------------------------------------------------ decoding
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def decode(input_ids, model, max_length, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0,
           repetition_penalty=1.0, eos_token_id=None, teacher_outputs=None, vocab_size=None, cg=False,
           enable_timing=False, output_scores=False, streamer=None):
    """Generate from model until each sequence is max_length tokens long (prompt included) or, with
    eos_token_id, every sequence has produced it (later tokens of a finished sequence are eos_token_id).

    input_ids (B, S) long. The model's forward must take (input_ids, position_ids, inference_params,
    num_last_tokens) and return an object with ``logits`` (B, num_last_tokens, V); it must implement
    ``allocate_inference_cache`` for cg=True. teacher_outputs (B, >= S + n) long: feed these tokens instead
    of the sampled ones for the first n steps (teacher forcing; scores are still the model's).
    vocab_size: drop logits past it (padded vocabularies). cg: replay a CUDA graph of the one-token step
    (CUDA tensors, and attention layers that can be captured: use_flash_attn=True). output_scores: keep the
    processed logits of every step. streamer: an object with put(tokens) and end() (HF's streamers), given
    the prompt, then each new token (B,), on the CPU. Returns a DecodeOutput.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seqlen), got shape {tuple(input_ids.shape)}")
    batch_size, seqlen_og = input_ids.shape
    if seqlen_og == 0:
        raise ValueError("input_ids must hold at least one prompt token")
    if max_length <= seqlen_og:
        raise ValueError(f"max_length ({max_length}) must exceed the prompt length ({seqlen_og})")
    if repetition_penalty <= 0.0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    if cg:
        if input_ids.device.type != "cuda":
            raise ValueError("cg=True captures CUDA graphs and needs CUDA input_ids")
        model._decoding_cache = update_graph_cache(model, getattr(model, "_decoding_cache", None), batch_size,
                                                   seqlen_og, max_length)
        inference_params = model._decoding_cache.inference_params
        inference_params.reset(max_length, batch_size)
    else:
        inference_params = InferenceParams(max_seqlen=max_length, max_batch_size=batch_size)

    def next_logits(tokens):
        decoding = inference_params.seqlen_offset > 0
        position_ids = None
        if decoding:
            position_ids = torch.full((batch_size, 1), inference_params.seqlen_offset, dtype=torch.long,
                                      device=tokens.device)
        if cg and decoding:
            logits = model._decoding_cache.run(tokens, position_ids, inference_params.seqlen_offset)
        else:
            logits = model(tokens, position_ids=position_ids, inference_params=inference_params,
                           num_last_tokens=1).logits
        logits = logits[:, -1]
        return logits[..., :vocab_size] if vocab_size is not None else logits

    device = input_ids.device
    if enable_timing:
        _sync(device)
        start = time.perf_counter()
    if streamer is not None:
        streamer.put(input_ids.cpu())
    sequences, scores = input_ids, []
    finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
    tokens = input_ids
    prefill_end = None
    while True:
        logits = next_logits(tokens)
        inference_params.seqlen_offset += tokens.shape[1]
        if enable_timing and prefill_end is None:
            _sync(device)
            prefill_end = time.perf_counter()
        if repetition_penalty != 1.0:
            logits = modify_logit_for_repetition_penalty(logits.clone(), sequences, repetition_penalty)
        if output_scores:
            scores.append(logits)
        step = sequences.shape[1]
        if teacher_outputs is not None and step < teacher_outputs.shape[1]:
            token = teacher_outputs[:, step]
        else:
            token = sample(logits, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature)
        if eos_token_id is not None:
            token = token.masked_fill(finished, eos_token_id)
            finished |= token == eos_token_id
        sequences = torch.cat([sequences, token[:, None]], dim=1)
        if streamer is not None:
            streamer.put(token.cpu())
        if sequences.shape[1] >= max_length or (eos_token_id is not None and bool(finished.all())):
            break
        tokens = token[:, None]
    if streamer is not None:
        streamer.end()
    timing = None
    if enable_timing:
        _sync(device)
        end = time.perf_counter()
        steps = sequences.shape[1] - seqlen_og - 1
        timing = {"prefill_ms": (prefill_end - start) * 1e3, "decode_ms": (end - prefill_end) * 1e3,
                  "decode_ms_per_token": (end - prefill_end) * 1e3 / max(steps, 1)}
        print(f"Prompt processing: {timing['prefill_ms']:.1f} ms, decoding: {timing['decode_ms']:.1f} ms "
              f"({timing['decode_ms_per_token']:.2f} ms/token)")
    return DecodeOutput(sequences=sequences, scores=tuple(scores) if output_scores else None, timing=timing)


class GenerationMixin:
    """Adds ``generate`` to a model whose forward follows :func:`decode`'s contract."""

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must implement allocate_inference_cache")

    def generate(self, input_ids, max_length, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0,
                 return_dict_in_generate=False, output_scores=False, **kwargs):
        """input_ids (B, S) -> sequences (B, <= max_length), or a DecodeOutput with return_dict_in_generate.
        kwargs go to :func:`decode` (eos_token_id, repetition_penalty, teacher_outputs, vocab_size, cg,
        enable_timing, streamer)."""
        output = decode(input_ids, self, max_length, top_k=top_k, top_p=top_p, min_p=min_p,
                        temperature=temperature, output_scores=output_scores, **kwargs)
        return output if return_dict_in_generate else output.sequences


# ------------------------------------------------------------------------------------------------ CUDA graphs
@dataclass
class DecodingCGCache:
    """Captured decode-step graphs of one model, keyed by (batch_size, decoding_seqlen), sharing one KV cache
    and one memory pool."""

    max_batch_size: int = 0
    max_seqlen: int = 0
    device: Optional[torch.device] = None
    dtype: Optional[torch.dtype] = None
    callables: dict = field(default_factory=dict)
    mempool: Optional[tuple] = None
    inference_params: Optional[InferenceParams] = None
    run: Optional[Callable] = None


@torch.no_grad()
def update_graph_cache(model, cache, batch_size, seqlen_og, max_seqlen, decoding_seqlens=(1,), dtype=None,
                       n_warmups=2):
    """Make sure cache holds graphs for batch_size and each decoding_seqlens entry, and a KV cache of at least
    (batch_size, max_seqlen); reallocates (dropping old graphs) when the model's device/dtype changed or the
    request outgrows it. Returns the (possibly new) DecodingCGCache."""
    if cache is None:
        cache = DecodingCGCache()
    param = next(iter(model.parameters()))
    device = param.device
    dtype = param.dtype if dtype is None else dtype
    if device.type != "cuda":
        raise ValueError(f"CUDA-graph decoding needs the model on a CUDA device, got {device}")
    if ((device, dtype) != (cache.device, cache.dtype) or batch_size > cache.max_batch_size
            or max_seqlen > cache.max_seqlen):
        cache.callables = {}
        cache.mempool = None
        cache.inference_params = None
        gc.collect()  # free the old graphs' pool before allocating the new cache
        cache.device, cache.dtype = device, dtype
        cache.max_batch_size, cache.max_seqlen = batch_size, max_seqlen
        cache.inference_params = InferenceParams(
            max_seqlen=max_seqlen, max_batch_size=batch_size, seqlen_offset=seqlen_og,
            key_value_memory_dict=model.allocate_inference_cache(batch_size, max_seqlen, dtype),
            lengths_per_sample=torch.full((batch_size,), seqlen_og, dtype=torch.int32, device=device))
        cache.mempool = torch.cuda.graphs.graph_pool_handle()
    for decoding_seqlen in decoding_seqlens:
        if (batch_size, decoding_seqlen) not in cache.callables:
            cache.callables[batch_size, decoding_seqlen] = capture_graph(
                model, cache.inference_params, batch_size, max_seqlen, decoding_seqlen=decoding_seqlen,
                mempool=cache.mempool, n_warmups=n_warmups)

    def dispatch(input_ids, position_ids, seqlen):
        return cache.callables[input_ids.shape[0], input_ids.shape[1]](input_ids, position_ids, seqlen)

    cache.run = dispatch
    cache.inference_params.seqlen_offset = 0
    return cache


def capture_graph(model, inference_params, batch_size, max_seqlen, decoding_seqlen=1, mempool=None,
                  n_warmups=2):
    """Capture model's forward on (batch_size, decoding_seqlen) tokens as a CUDA graph.

    Returns run(input_ids, position_ids, seqlen) -> logits (batch_size, decoding_seqlen, V) (a copy), which
    sets every sequence's cache length to seqlen, copies the inputs into the graph's static buffers and
    replays it.
    """
    device = next(iter(model.parameters())).device
    input_ids = torch.zeros((batch_size, decoding_seqlen), dtype=torch.long, device=device)
    position_ids = torch.zeros((batch_size, decoding_seqlen), dtype=torch.long, device=device)
    seqlen_offset_og = inference_params.seqlen_offset
    # Capture at the largest offset so anything sized by the current length (e.g. rotary tables) is already
    # allocated at full size and never reallocated during replay.
    inference_params.seqlen_offset = max_seqlen - decoding_seqlen
    inference_params.lengths_per_sample[:] = inference_params.seqlen_offset

    def step():
        return model(input_ids, position_ids=position_ids, inference_params=inference_params,
                     num_last_tokens=decoding_seqlen).logits

    # Warm up on a side stream (lazy inits, allocator, autotuning) so none of it lands in the graph.
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(n_warmups):
            step()
        side.synchronize()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool):
        logits = step()

    def run(new_input_ids, new_position_ids, seqlen):
        inference_params.lengths_per_sample[:] = seqlen
        input_ids.copy_(new_input_ids)
        position_ids.copy_(new_position_ids)
        graph.replay()
        return logits.clone()

    inference_params.seqlen_offset = seqlen_offset_og
    return run
