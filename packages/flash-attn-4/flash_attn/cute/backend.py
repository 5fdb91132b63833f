"""The root dispatcher's view of flash_attn.cute (the contract is in flash_attn/backends/__init__.py).

Serves forward calls on Hopper (sm_90): fp16/bf16, head dims 64, 96, 128, 192, 256 (v's equal to q's, or the pair
192 / 128 of config.HEAD_DIM_PAIRS), causal or not, sliding windows, softcap, GQA/MQA, dense, varlen (cu_seqlens)
or paged. The backward kernel (flash_bwd_sm90.py) has head dims 64, 96 and 128 (v's equal to q's) and serves dense
calls (sliding windows, varlen and softcap under the plan rules bwd_window / bwd_varlen / bwd_softcap) without ALiBi or
dropout (its dQ is a sum of fp32 TMA reduce-adds from the key blocks' CTAs in whatever order they finish, so it varies
in the last bits run to run, as FA2's default backward does; deterministic calls without a window, at the head dims
the plan rule bwd_deterministic admits, add in key-block order); every other backward goes to the next backend that
has one (Triton, else the reference), which consumes this forward's out and lse. FLASH_ATTN_CUTE_DISABLE
(settings.py) switches off the backward ("bwd"), the paged and Dv != D kernels, and head dims 96 / 192 / 256
("d96", ...: the forward, and d96's backward too): those calls then go to the next backend. The dispatcher caches its
choices per kind of call, so a change takes effect in a new process.

Paged varlen forward calls (flash_attn_varlen_func's block_table; cu_seqlens_k then counts each sequence's keys) run
the paged kernel (launch.forward_varlen with the page table, each sequence's key count as seqused_k); pages the
kernel cannot box (config.paged_block_n) are gathered into contiguous keys for the unpaged kernel.

Inference calls (lse dropped), dense or varlen, of up to _DECODE_ROWS query rows per sequence (decoding) run with a GQA
group packed and split-KV where the grid leaves SMs idle (_decode_plan: the FA4 API's num_splits=0 choice).

flash_attn_with_kvcache (``fwd_kvcache``, under the plan rule kvcache, off until a GPU run decides it): kvcache.py, the
varlen kernels over the caches in place.

A learnable sink (``sink=``, fp32 (H,)) goes to the kernels built with one (FwdConfig.sink), dense, varlen and paged.
The backward needs no sink: its kernel computes P from the forward's lse, which includes it.
"""
import torch

from flash_attn.cute import settings

NAME = "cute"
_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_DIMS = (64, 128)  # forward and backward, always
_GATED_FWD_HEAD_DIMS = (96, 192, 256)  # forward; FLASH_ATTN_CUTE_DISABLE=d96,... sends them on
_GATED_BWD_HEAD_DIMS = (96,)  # backward; the same switch (d96) sends it on
_WIDE_BWD_HEAD_DIMS = (192, 256)  # backward under the plan rules bwd_wide_d / bwd_d256 (the split-D kernel)
_ARCHS = {(9, 0): "sm_90a"}
_unavailable = []
BWD_OUT = True  # bwd() takes grads=(dq, dk, dv)
LSE_SCRATCH = True  # fwd() takes lse_scratch=True (launch._lse_scratch)


def unavailable_reason():
    if not _unavailable and getattr(torch.version, "hip", None) is not None:
        # AMD GPUs answer the same capability query, and an MI200 (gfx90a) says (9, 0), Hopper's
        _unavailable.append("a ROCm build of torch: the CuTeDSL kernels run on NVIDIA GPUs only")
    if not _unavailable:
        try:
            import cutlass.cute  # noqa: F401
        except Exception as e:  # ImportError, or a broken CUDA toolkit under it
            _unavailable.append(f"nvidia-cutlass-dsl does not import ({type(e).__name__}: {e})")
        else:
            _unavailable.append(None if torch.cuda.is_available() else "no CUDA device")
    return _unavailable[0]


def norm_backward():
    """The CuTeDSL LayerNorm / RMSNorm backward for wide rows (module norm_bwd) that the root's fused norm ops use."""
    from flash_attn.cute import norm_bwd

    return norm_bwd


_FWD_DIMS = [None, ()]  # (the settings object they were read from, the head dims)


def forward_head_dims():
    """The head dims whose forward the dispatcher may send here: 64, 128 and those of 96 / 192 / 256 that
    FLASH_ATTN_CUTE_DISABLE does not name (d96, d192, d256); read again only when the settings are (settings.reload)."""
    if _FWD_DIMS[0] is not settings.current:
        _FWD_DIMS[1] = tuple(sorted(_HEAD_DIMS + tuple(d for d in _GATED_FWD_HEAD_DIMS if not settings.disabled(f"d{d}"))))
        _FWD_DIMS[0] = settings.current
    return _FWD_DIMS[1]


def backward_head_dims():
    """The head dims whose backward the dispatcher (and flash_attn.cute's own autograd) may send to the kernel: 64,
    128 and 96 unless FLASH_ATTN_CUTE_DISABLE names d96; 192 under the plan rule bwd_wide_d and 256 unless bwd_d256 is
    "off" (d256_bwd_takes then decides by the mask), unless it names them."""
    rules = _rules()
    gated = (_GATED_BWD_HEAD_DIMS + ((192,) if rules.bwd_wide_d else ())
             + ((256,) if rules.bwd_d256 != "off" else ()))
    return tuple(sorted(_HEAD_DIMS + tuple(d for d in gated if not settings.disabled(f"d{d}"))))


def d256_bwd_takes(causal):
    """Whether a d256 backward call goes to the kernel under the plan rule bwd_d256 ("causal": causal calls only)."""
    return _rules().bwd_d256 == "on" or (causal and _rules().bwd_d256 == "causal")


def unsupported_reason(call):
    if call.device_type != "cuda":
        return f"device {call.device_type}"
    if call.arch not in _ARCHS:
        return f"compute capability {call.arch}: only Hopper (sm_90) kernels exist"
    if call.dtype not in _DTYPES:
        return f"dtype {call.dtype} (fp16/bf16 only)"
    head_dims = backward_head_dims() if call.backward else forward_head_dims()
    pair = False  # v's head dim != q's: a pair of config.HEAD_DIM_PAIRS (the backward's under bwd_wide_d)
    if call.head_dim_v != call.head_dim and call.head_dim in head_dims:
        from flash_attn.cute.config import HEAD_DIM_PAIRS

        pair = (call.head_dim, call.head_dim_v) in HEAD_DIM_PAIRS
        if pair and settings.disabled("hdim_v"):
            return f"head dims {call.head_dim}/{call.head_dim_v}: {settings.DISABLE} names hdim_v"
    if not pair and (call.head_dim not in head_dims or call.head_dim_v != call.head_dim):
        why = f"head dims {call.head_dim}/{call.head_dim_v} not in {head_dims} (equal for q/k and v)"
        gated = _GATED_BWD_HEAD_DIMS if call.backward else _GATED_FWD_HEAD_DIMS
        if call.head_dim in gated and call.head_dim_v == call.head_dim:
            why += f"; {settings.DISABLE} names d{call.head_dim}"
        elif call.backward and call.head_dim in _WIDE_BWD_HEAD_DIMS and call.head_dim_v == call.head_dim:
            why += f"; plan rule bwd_wide_d / bwd_d256 off, or {settings.DISABLE} names d{call.head_dim}"
        return why
    if call.paged:
        if call.backward:
            return "backward with paged KV"
        if settings.disabled("paged"):
            return f"paged KV: {settings.DISABLE} names paged"
    for what in ("alibi", "dropout", "return_probs"):
        if getattr(call, what):
            return what
    if call.kvcache and not _kvcache():
        return "kvcache (plan rule kvcache off)"
    if call.backward:
        if settings.disabled("bwd"):
            return f"backward (switched off: {settings.DISABLE} names bwd)"
        if call.head_dim == 256 and not d256_bwd_takes(call.causal):
            return f"d256 backward without a causal mask (plan rule bwd_d256={_rules().bwd_d256})"
        for what in ("varlen", "local", "softcap", "deterministic"):
            ruled = ((what == "local" and _window_bwd()) or (what == "varlen" and _varlen_bwd())
                     or (what == "deterministic" and _deterministic_bwd(call.head_dim) and not call.local)
                     or (what == "softcap" and _softcap_bwd()))
            if getattr(call, what) and not ruled:
                return f"backward with {what}"
    return None


_launch = None  # flash_attn.cute.launch, imported on the first call (importing this module stays cheap)


def _load_launch():
    global _launch
    from flash_attn.cute import launch

    _launch = launch
    return launch


def fwd(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, alibi_slopes, rng_state,
        sink=None, lse_scratch=False):
    launch = _launch or _load_launch()
    wl, wr = call.window_left, call.window_right
    if (wl < 0 and (wr < 0 or call.causal) and block_table is None and cu_seqlens_q is None and sink is None
            and not call.softcap and call.head_dim_v == call.head_dim):
        # The common call (dense, causal or not, no other window, softcap or sink): launch._forward_plain straight
        # away, the per-call path the FA4 API's own common call takes; decoding shapes (a split or packed plan) and
        # kernels not yet in memory take the general path below.
        B, Sq, H, D = q.shape
        Sk = k.shape[1]
        if B * Sq * H and Sk:
            if lse_scratch and Sq <= _DECODE_ROWS:
                # decoding: its (pack, splits) plan on the parts and combine launch reused per kind of call
                Hk = k.shape[2]
                pack, splits = _decoding(q, B, Sq, H, Sk, Hk, launch._UNBOUNDED, launch._UNBOUNDED if wr < 0 else wr)
                res = launch._forward_decode(q, k, v, B, Sq, H, D, Sk, Hk, call.softmax_scale, call.causal, "sm_90a",
                                             pack, splits)
            else:
                res = launch._forward_plain(q, k, v, B, Sq, H, D, Sk, k.shape[2], call.softmax_scale, call.causal,
                                            "sm_90a", lse_scratch)
            if res:
                return res[0], res[1], None
    # the contract's -1 (no limit) is the kernels' UNBOUNDED
    if wl < 0:
        wl = launch._UNBOUNDED
    if wr < 0:
        wr = launch._UNBOUNDED
    causal, scale, softcap = call.causal, call.softmax_scale, call.softcap
    # unsupported_reason admitted only sm_90
    if block_table is None and cu_seqlens_q is None:
        if sink is not None:
            sink = sink.to(torch.float32).contiguous()  # (the kernels' layout; the core sends it so already)
        B, Sq, H = q.shape[:3]
        pack = splits = 1
        if lse_scratch and Sq <= _DECODE_ROWS:
            # an inference call (lse dropped: no gradient follows) of a few query rows (decoding)
            pack, splits = _decoding(q, B, Sq, H, k.shape[1], k.shape[2], wl, wr)
        out, lse = launch.forward(q, k, v, scale, causal, "sm_90a", wl, wr, softcap, sink, pack=pack, splits=splits,
                                  lse_scratch=lse_scratch)
        return out, lse, None
    if sink is not None:
        sink = sink.to(torch.float32).contiguous()
    if block_table is not None:
        if not _boxes_pages(call, k.shape[1]):
            # pages that fill no TMA box: gathered into contiguous keys for the unpaged kernel (as the FA4 API does)
            kc, vc, cu_k, _ = launch._gather_pages(k, v, block_table)
            out, lse = launch.forward_varlen(q, kc, vc, cu_seqlens_q, cu_k, cu_seqlens_k[1:] - cu_seqlens_k[:-1],
                                             max_seqlen_q, scale, causal, "sm_90a", wl, wr, softcap,
                                             fill_unused_rows=True, sink=sink)
            return out, lse, None
        # (block_table's entries were checked to be pages: flash_attn._ops._check_values)
        out, lse = launch.forward_varlen(q, k, v, cu_seqlens_q, None, cu_seqlens_k[1:] - cu_seqlens_k[:-1],
                                         max_seqlen_q, scale, causal, "sm_90a", wl, wr, softcap,
                                         fill_unused_rows=True, sink=sink, page_table=block_table)
    else:
        pack = splits = 1
        batch, H = cu_seqlens_q.shape[0] - 1, q.shape[1]
        if lse_scratch and max_seqlen_q <= _DECODE_ROWS:  # as the dense call's
            pack, splits = _decoding(q, batch, max_seqlen_q, H, max_seqlen_k, k.shape[1], wl, wr)
        out, lse = launch.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, None, max_seqlen_q, scale, causal,
                                         "sm_90a", wl, wr, softcap, fill_unused_rows=True, sink=sink, pack=pack,
                                         splits=splits)
    return out, lse, None


# Decoding: at most this many query rows per sequence (a token, or a few of speculative decoding): one query tile per
# head, so the grid is batch x heads and the keys are all the work. Longer queries keep the unsplit kernels, whose
# choice the forward benchmarks measured; the split rule was measured on decoding shapes only.
_DECODE_ROWS = 16


_decode_plans: dict = {}  # (device, B, Sq, H, Sk, Hk, window) -> _decode_plan's answer under _decode_plans_of[0]
_decode_plans_of = [None]  # the settings those answers were given under


def _decoding(q, B, Sq, H, Sk, Hk, window_left, window_right):
    """_decode_plan's answer, remembered per kind of call (varlen: B sequences, Sq / Sk the longest)."""
    if _decode_plans_of[0] is not settings.current:  # FLASH_ATTN_CUTE_DISABLE may name split / pack_gqa
        _decode_plans.clear()
        _decode_plans_of[0] = settings.current
    key = (q.device, B, Sq, H, Sk, Hk, window_left, window_right)
    plan = _decode_plans.get(key)
    if plan is None:
        plan = _decode_plan(q, B, Sq, H, Sk, Hk, window_left, window_right)
        if len(_decode_plans) >= 256:
            _decode_plans.clear()
        _decode_plans[key] = plan
    return plan


def _decode_plan(q, B, Sq, H, Sk, Hk, window_left, window_right):
    """(pack_gqa group, split-KV parts) of an inference call, dense or varlen, of a few query rows per head (decoding):
    the query heads of a GQA group packed where the packed tiles hold more real queries (plan._pack_helps; each K / V
    tile then serves the whole group: half the time of the unpacked kernel at 8 x 8k keys, H 32 / Hk 8), split-KV
    parts by flash_attn.cute's num_splits=0 choice (1 where the grid fills the SMs); unsplit and unpacked, small
    grids ran up to 9x SDPA's time (benchmarks/results/h200/decode_dense.md). Calls that keep their lse (a gradient
    follows) stay unsplit."""
    from flash_attn.cute import plan

    group = H // Hk if Hk else 1
    pack = plan._pack_group(True, H, Hk, Sq) if group > 1 and plan._pack_helps(group, Sq) else 1
    return pack, plan._tile_splits(0, pack, B, Sq, H, Hk, Sk, window_left, window_right, q)


_BOXED = {}  # (dtype, D, Dv, causal, local, softcap, page size) -> whether the paged kernel takes those pages


def _boxes_pages(call, page_size):
    """Whether the paged kernel of this call has a key block that pages of page_size rows fill in whole TMA boxes
    (its config exists: config.paged_block_n of the config's block_n)."""
    from flash_attn.cute import kernels

    local = call.local
    key = (call.dtype, call.head_dim, call.head_dim_v, call.causal and not local, local, call.softcap > 0.0,
           page_size)
    ok = _BOXED.get(key)
    if ok is None:
        try:
            kernels.fwd_config(call.dtype, key[1], key[3], "sm_90a", local=local, softcap=key[5], varlen=True,
                               dv=key[2], paged=page_size)
            ok = True
        except NotImplementedError:
            ok = False
        _BOXED[key] = ok
    return ok


def fwd_kvcache(call, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                block_table, alibi_slopes, rotary_interleaved, num_splits, sink=None):
    """FA2's flash_attn_with_kvcache on the varlen kernels (kvcache.py; under the plan rule kvcache)."""
    from flash_attn.cute import kvcache

    if alibi_slopes is not None:  # (unsupported_reason refused it: a direct caller gets an error, not a wrong answer)
        raise NotImplementedError("flash_attn.cute's kvcache path takes no ALiBi")
    return kvcache.fwd_kvcache(call, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                               cache_batch_idx, cache_leftpad, block_table, rotary_interleaved, num_splits,
                               None if sink is None else sink.to(torch.float32).contiguous(), _decoding,
                               lambda page_size: _boxes_pages(call, page_size))


def bwd(call, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
        alibi_slopes, rng_state, grads=None, dlse=None):
    from flash_attn.cute import launch

    from flash_attn.cute.plan import _UNBOUNDED

    # unsupported_reason admitted only uncapped, non-deterministic calls on sm_90 (windowed ones with the plan rule
    # bwd_window, varlen ones with bwd_varlen); a direct caller gets an error rather than a wrong gradient
    if (block_table is not None or (call.softcap > 0.0 and not _softcap_bwd()) or alibi_slopes is not None
            or call.dropout_p > 0.0
            or (call.deterministic and (call.local or not _deterministic_bwd(call.head_dim)))
            or (call.local and not _window_bwd())
            or (cu_seqlens_q is not None and not _varlen_bwd())):
        raise NotImplementedError("flash_attn.cute's backward handles calls without paged KV, ALiBi or dropout "
                                  "(windows with the plan rule bwd_window, varlen with bwd_varlen, determinism "
                                  "without a window with bwd_deterministic, softcap with bwd_softcap)")
    window = None
    if call.local:  # the contract's -1 (no limit) is the kernels' _UNBOUNDED; causal arrives as window_right 0
        window = tuple(_UNBOUNDED if w < 0 else w for w in (call.window_left, call.window_right))
    if cu_seqlens_q is not None:
        return launch.backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, None, None, max_seqlen_q,
                                      max_seqlen_k, call.softmax_scale, call.causal, "sm_90a", grads=grads, dlse=dlse,
                                      window=window, deterministic=call.deterministic, softcap=call.softcap)
    return launch.backward(dout, q, k, v, out, lse, call.softmax_scale, call.causal, "sm_90a", grads=grads,
                           dlse=dlse, window=window, deterministic=call.deterministic, softcap=call.softcap)


def _kvcache():
    from flash_attn.cute import config

    return config.plan_rules().kvcache


def _rules():
    from flash_attn.cute import config

    return config.plan_rules()


def _window_bwd():
    from flash_attn.cute import config

    return config.plan_rules().bwd_window


def _varlen_bwd():
    from flash_attn.cute import config

    return config.plan_rules().bwd_varlen


def _deterministic_bwd(head_dim):
    """Whether the plan rule bwd_deterministic admits a deterministic backward at ``head_dim``."""
    from flash_attn.cute import config

    rule = config.plan_rules().bwd_deterministic
    return rule == "on" or (rule == "writer" and config.BWD_DQ_TMA.get(head_dim, False))


def _softcap_bwd():
    from flash_attn.cute import config

    return config.plan_rules().bwd_softcap
