"""Score mods and mask mods for tests/cute/test_cute_score_mod.py, each with its plain-PyTorch meaning (FA4's calling
convention, flash_attn/cute/score_mod.py): a CuTeDSL function and ``*_torch`` (on (B, H, Sq, Sk) fp32 scores
already multiplied by the softmax scale, or the boolean mask to keep). Importing this module imports CuTeDSL."""
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Uint32

from flash_attn.cute import utils

SOFTCAP = 30.0
REL_SCALE = 0.01
WINDOW = 64


# score mods: (score, batch, head, q_idx=, kv_idx=, seqlen_info=, aux_tensors=) -> score, TensorSSA in and out

@cute.jit
def identity(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return score


@cute.jit
def rel_bias(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    rel = (kv_idx - q_idx).to(Float32)
    return score + rel * cute.full_like(score, REL_SCALE)


@cute.jit
def softcap(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    capped = cute.math.tanh(score * cute.full_like(score, 1.0 / SOFTCAP), fastmath=True)
    return capped * cute.full_like(score, SOFTCAP)


@cute.jit
def scaled(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars):
    """score * aux_scalars[0] (a Float32): FA4's aux scalars."""
    return score * cute.full_like(score, Float32(aux_scalars[0]))


@cute.jit
def scalar_limit_mask(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars):
    """Causal and kv < the last aux scalar (an Int32; the call's one list is shared with the score_mod's)."""
    return (kv_idx[0] <= q_idx[0]) & (kv_idx[0] < cutlass.Int32(aux_scalars[len(aux_scalars) - 1]))


@cute.jit
def alibi_aux(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """ALiBi with a slope per query head read from aux_tensors[0] (H,) fp32: score - slope * |q - kv|."""
    slopes = aux_tensors[0]
    slope = cute.full_like(score, 0.0) + Float32(slopes[h_idx[0]])
    dist = (q_idx - kv_idx).to(Float32)
    zero = cute.full_like(dist, 0.0)
    dist = cute.where(dist < zero, zero - dist, dist)
    return score - slope * dist


# score_mod_bwd: (grad, score, batch, head, q_idx, kv_idx, seqlen_info, aux_tensors) -> the gradient with respect to
# the score the score_mod saw (FA4's convention)

@cute.jit
def additive_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """identity, rel_bias, alibi_aux: score + something independent of it."""
    return grad


@cute.jit
def softcap_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    t = cute.math.tanh(score * cute.full_like(score, 1.0 / SOFTCAP), fastmath=True)
    return grad * (cute.full_like(t, 1.0) - t * t)


@cute.jit
def scaled_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars):
    return grad * cute.full_like(grad, Float32(aux_scalars[0]))


# mask mods: (batch, head, q_idx, kv_idx, seqlen_info, aux_tensors) -> keep (a Boolean or a one-element TensorSSA)

@cute.jit
def global_scaled_squared(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """aux_tensors[0][global key] * score^2, the key's global row kv_idx + seqlen_info.offset_k (FA4's varlen test
    mod): a varlen call's aux read at packed rows."""
    scale = aux_tensors[0]
    rows = cute.make_rmem_tensor(1, cutlass.Int32)
    rows.store(kv_idx + seqlen_info.offset_k)
    val = cute.make_rmem_tensor(1, scale.element_type)
    val[0] = scale[rows[0]]
    return val.load().to(Float32) * score * score


@cute.jit
def global_scaled_squared_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    scale = aux_tensors[0]
    rows = cute.make_rmem_tensor(1, cutlass.Int32)
    rows.store(kv_idx + seqlen_info.offset_k)
    val = cute.make_rmem_tensor(1, scale.element_type)
    val[0] = scale[rows[0]]
    return grad * cute.full_like(grad, 2.0) * val.load().to(Float32) * score


@cute.jit
def causal_mask(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """Bottom-right causal: key j <= i + Sk - Sq."""
    return kv_idx[0] <= q_idx[0] + seqlen_info.seqlen_k - seqlen_info.seqlen_q


@cute.jit
def window_mask(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """|q - kv| <= WINDOW (positions, not aligned), as a TensorSSA."""
    diff = q_idx - kv_idx
    return (diff <= cute.full_like(diff, WINDOW)) & (diff >= cute.full_like(diff, -WINDOW))


@cute.jit
def document_mask(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """Same document: aux_tensors[0] (B, S) int32 document ids of the batch entry's positions (Sq == Sk)."""
    docs = aux_tensors[0]
    return docs[b_idx[0], q_idx[0]] == docs[b_idx[0], kv_idx[0]]


@cute.jit
def document_causal_mask(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """Causal within a document: kv <= q and the same id in aux_tensors[0] (B, S) int32 (Sq == Sk)."""
    docs = aux_tensors[0]
    same = docs[b_idx[0], q_idx[0]] == docs[b_idx[0], kv_idx[0]]
    return same & (kv_idx[0] <= q_idx[0])


@cute.jit
def shift_mask(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    """FA4's mod helpers (flash_attn.cute.utils) with counts past 31: keep iff kv % 40 < 32 or q % 37 >= 32 (a shift
    by 32 or more gives 0, as PTX's)."""
    low = utils.shr_u32(Uint32(0xFFFFFFFF), Uint32(kv_idx[0] % 40)) & Uint32(1)
    high = utils.shl_u32(Uint32(1), Uint32(q_idx[0] % 37))
    one, zero = utils.scalar_to_ssa(1, Uint32), utils.scalar_to_ssa(0, Uint32)
    return (utils.scalar_to_ssa(low, Uint32) == one) | (utils.scalar_to_ssa(high, Uint32) == zero)


# Their plain-PyTorch meaning. Scores s: (B, H, Sq, Sk) fp32 scaled; masks broadcast to it.

def _pos(Sq, Sk, device):
    q = torch.arange(Sq, device=device).view(-1, 1)
    k = torch.arange(Sk, device=device).view(1, -1)
    return q, k


def identity_torch(s, aux=None):
    return s


def rel_bias_torch(s, aux=None):
    q, k = _pos(s.shape[-2], s.shape[-1], s.device)
    return s + (k - q).float() * REL_SCALE


def softcap_torch(s, aux=None):
    return SOFTCAP * torch.tanh(s / SOFTCAP)


def alibi_aux_torch(s, aux):
    q, k = _pos(s.shape[-2], s.shape[-1], s.device)
    return s - aux[0].float().view(1, -1, 1, 1) * (q - k).abs().float()


def causal_mask_torch(Sq, Sk, device, aux=None):
    q, k = _pos(Sq, Sk, device)
    return k <= q + Sk - Sq


def window_mask_torch(Sq, Sk, device, aux=None):
    q, k = _pos(Sq, Sk, device)
    return (q - k).abs() <= WINDOW


def document_mask_torch(Sq, Sk, device, aux):
    docs = aux[0]  # (B, S)
    return (docs[:, :Sq, None] == docs[:, None, :Sk])[:, None]  # (B, 1, Sq, Sk)


def shift_mask_torch(Sq, Sk, device, aux=None):
    q, k = _pos(Sq, Sk, device)
    return (k % 40 < 32) | (q % 37 >= 32)


SCORE_MODS = {"identity": (identity, identity_torch), "rel_bias": (rel_bias, rel_bias_torch),
              "softcap": (softcap, softcap_torch), "alibi_aux": (alibi_aux, alibi_aux_torch)}
SCORE_MOD_BWDS = {"identity": additive_bwd, "rel_bias": additive_bwd, "softcap": softcap_bwd,
                  "alibi_aux": additive_bwd}
MASK_MODS = {"causal": (causal_mask, causal_mask_torch), "window": (window_mask, window_mask_torch),
             "document": (document_mask, document_mask_torch), "shift": (shift_mask, shift_mask_torch)}


def assert_close_to_oracle(got, refs, lps, names="oqkv", where=()):
    """FlashAttention's criterion per tensor: max |got - fp32 oracle| <= 2 x the max error of the same computation in
    PyTorch at the input dtype (lps) + the dtype's rounding of the oracle's largest value (bf16: 2^-8)."""
    for name, g, r, lp in zip(names, got, refs, lps):
        err = (g.float() - r).abs().max().item()
        bound = 2 * (lp - r).abs().max().item() + r.abs().max().item() * 2 ** -8
        assert err <= bound, (*where, name, err, bound)

