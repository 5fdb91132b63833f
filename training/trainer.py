"""The training loop: one process, or many under torchrun with DDP or FSDP2 (``fully_shard``).

Every step consumes one global batch of micro_batch_size * grad_accum * world_size sequences: global sample
k of the step goes to micro-step k // (micro_batch_size * world_size) on rank (k // micro_batch_size) %
world_size. Each rank's loss is a mean over equally many tokens and DDP / FSDP average gradients over ranks,
so a step is the same update whatever the number of processes (up to floating-point summation order).
"""
import contextlib
import functools
import math
import os
import random
import signal
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flash_attn.training import checkpoint as ckpt
from flash_attn.training.config import ConfigError
from flash_attn.training.data import WindowSampler, load_splits, max_token
from flash_attn.training.metrics import MetricsWriter, Progress, peak_tflops, plot_losses
from flash_attn.training.model import build_model, check_shape, count_params, flops_per_token, shape_signature

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Runtime:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    strategy: str = "none"
    owns_process_group: bool = False

    @property
    def is_main(self):
        return self.rank == 0


@dataclass
class TrainResult:
    """What a run did: losses are (step, loss) pairs of the logged steps, all-reduced over ranks."""

    losses: list = field(default_factory=list)
    val_losses: list = field(default_factory=list)
    start_step: int = 0
    final_step: int = 0
    checkpoint: str = None
    is_main: bool = True  # rank 0 (the one that writes files)
    tokens_per_s: float = 0.0
    mfu: float = None
    out_dir: str = ""
    interrupted: str = None  # the signal (SIGINT, SIGTERM) that stopped the run early, after a checkpoint


class _StopRequests:
    """While a run lasts, SIGINT (Ctrl-C) and SIGTERM ask it to stop after the current step, checkpointed; a second
    SIGINT stops at once (KeyboardInterrupt). Only the main thread can take signals: elsewhere nothing changes."""

    def __init__(self):
        self.signal = None
        self._previous = {}

    def _handler(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread
                break
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# ------------------------------------------------------------------------------------------ setup
def setup_runtime(cfg):
    """Device and process group from the config and torchrun's environment (RANK, WORLD_SIZE, ...)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available")
    use_cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    strategy = cfg.dist.strategy
    if strategy == "auto":
        strategy = "ddp" if world > 1 else "none"
    if world > 1 and strategy == "none":
        raise ConfigError(f"WORLD_SIZE={world} needs dist.strategy ddp or fsdp, got 'none'")
    if world == 1 and strategy != "none" and "MASTER_ADDR" not in os.environ and not dist.is_initialized():
        # A config written for torchrun (dist.strategy=fsdp) still runs as one plain process.
        strategy = "none"
    rt = Runtime(rank=rank, world=world, local_rank=local_rank, device=device, strategy=strategy)
    if strategy != "none" and not dist.is_initialized():
        backend = cfg.dist.backend
        if backend == "auto":
            backend = "nccl" if use_cuda else "gloo"
        dist.init_process_group(backend=backend, device_id=device if use_cuda else None)
        rt.owns_process_group = True
    if strategy != "none":
        rt.rank, rt.world = dist.get_rank(), dist.get_world_size()
    return rt


def autocast_dtype(cfg, device):
    name = cfg.train.dtype
    if name == "auto":
        name = "bf16" if device.type == "cuda" else "fp32"
    return _DTYPES[name]


def make_loss_fn(kind, device):
    """logits (B, S, V), targets (B, S) long -> mean token cross-entropy (fp32 scalar)."""
    if kind == "fused" or (kind == "auto" and device.type == "cuda"):
        try:
            from flash_attn.losses.cross_entropy import CrossEntropyLoss
        except ImportError as e:
            raise ConfigError(f"train.loss=fused needs flash_attn.losses.cross_entropy: {e}") from e
        # The logits are not needed after the loss, so their gradient may overwrite them: one fewer
        # (tokens x vocab) buffer, the largest activation of a GPT-2-sized model.
        ce = CrossEntropyLoss(inplace_backward=True)

        def fused(logits, targets):
            return ce(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return fused

    def plain(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    return plain


def transformer_layers(model):
    """The repeated layers: GPTLMHeadModel's transformer.layers (or HF GPT-2's transformer.h, LLaMA's
    model.layers, for models passed to Trainer directly)."""
    for path in ("transformer.layers", "transformer.h", "model.layers"):
        obj = model
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if isinstance(obj, torch.nn.ModuleList):
            return list(obj)
    raise TypeError(f"cannot find the transformer layers of {type(model).__name__} (looked for "
                    "transformer.layers, transformer.h, model.layers)")


def enable_activation_checkpointing(model):
    """Recompute each transformer layer's activations in the backward pass instead of storing them.

    The layer's own forward is wrapped (the module and its parameter names stay), so FSDP's hooks still
    run around the whole layer and the recomputation sees the gathered parameters.
    """
    from torch.utils.checkpoint import checkpoint

    for layer in transformer_layers(model):
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


def wrap_model(model, rt, dtype):
    """DDP or FSDP2 around the model (each transformer layer its own FSDP unit); the model itself for none."""
    if rt.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None)
    if rt.strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # FSDP2 warns that a layer returns a view; that is only unsafe if the caller modifies the output in
        # place, and the GPT blocks' residual adds are all out of place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        mesh = init_device_mesh(rt.device.type, (rt.world,))
        # Gather parameters in the compute dtype (half the traffic) but reduce gradients in fp32.
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in transformer_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def make_optimizer(model, ocfg, device):
    """AdamW; matrices and embeddings decay, biases and norm weights (1-D) do not. A muP model (its config has
    ``mup_width_scale``, as model.arch=btlm builds) gets muP's groups: the hidden matrices' rate is
    ``lr * mup_width_scale`` (flash_attn.models.btlm.mup_param_groups)."""
    config = getattr(getattr(model, "module", model), "config", None)
    if getattr(config, "mup_width_scale", None) is not None:
        from flash_attn.models.btlm import mup_param_groups

        groups = mup_param_groups(model, ocfg.lr, ocfg.weight_decay)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": ocfg.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = ocfg.fused == "on" or (ocfg.fused == "auto" and device.type == "cuda")
    return torch.optim.AdamW(groups, lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, fused=fused or None)


def clip_gradients(model, optimizer, max_norm, rt):
    """Clip the gradients to a global L2 norm of max_norm (as clip_grad_norm_) and return that norm.

    With fused AdamW the scaling rides in the optimizer's own kernel: it divides every gradient by
    ``optimizer.grad_scale`` before the update (the hook GradScaler unscales through), so clipping costs
    the norm's read of the gradients and not another read + write of all of them (~0.7 ms of a GPT-2
    medium step on an H200). FSDP2's gradients are DTensors and keep clip_grad_norm_.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if not optimizer.defaults.get("fused") or rt.strategy == "fsdp":
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    # clip_grad_norm_ multiplies by min(1, max_norm / (norm + 1e-6)); dividing by its inverse is the same
    optimizer.grad_scale = torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)
    return norm


def lr_at(step, ocfg, max_steps):
    """Linear warmup over warmup_steps, then cosine decay from lr to min_lr at max_steps."""
    if step < ocfg.warmup_steps:
        return ocfg.lr * (step + 1) / ocfg.warmup_steps
    span = max(1, max_steps - ocfg.warmup_steps)
    progress = min(1.0, (step - ocfg.warmup_steps) / span)
    return ocfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (ocfg.lr - ocfg.min_lr)


def make_scheduler(optimizer, ocfg, max_steps):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, ocfg, max_steps) / ocfg.lr)


def _rng_state(device):
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state, device):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _all_mean(value, rt):
    if rt.strategy != "none" and rt.world > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= rt.world
    return value


def _to_float(t):
    full = getattr(t, "full_tensor", None)  # FSDP2 returns a DTensor norm
    return float(full() if full is not None else t)


# ------------------------------------------------------------------------------------------ loop
class Trainer:
    """Builds everything from a Config, then ``run()`` trains (resuming when a checkpoint is found)."""

    def __init__(self, cfg, model=None):
        """model: train this module instead of building one from cfg.model (fp32, on the CPU or the run's
        device; forward(input_ids (B, S)) must return an object with .logits (B, S, V)). Checkpoints of such
        a run hold its state dict but cannot be resumed into a model built from the config."""
        self.cfg = cfg
        self.rt = setup_runtime(cfg)
        rt = self.rt
        self.dtype = autocast_dtype(cfg, rt.device)
        tc = cfg.train

        train_tokens, val_tokens, self.tokenizer = load_splits(cfg.data)
        largest = max(max_token(train_tokens), max_token(val_tokens))
        if largest >= cfg.model.vocab_size:
            raise ConfigError(f"the data holds token id {largest}, but model.vocab_size is {cfg.model.vocab_size}")
        self.num_train_tokens = len(train_tokens)
        self.train_sampler = WindowSampler(train_tokens, tc.seq_len, seed=tc.seed, shuffle=True, name="train")
        self.val_sampler = WindowSampler(val_tokens, tc.seq_len, shuffle=False, name="validation")

        torch.manual_seed(tc.seed)  # same initial weights on every rank
        model = build_model(cfg.model, rt.device) if model is None else model.to(rt.device)
        self.n_params = count_params(model)
        self.flops_per_token = flops_per_token(model, cfg.model, tc.seq_len)
        if tc.activation_checkpointing:
            enable_activation_checkpointing(model)
        model = wrap_model(model, rt, self.dtype)
        self.model = model  # DDP / FSDP / plain: what checkpoints are gathered from
        self.forward_model = torch.compile(model) if tc.compile else model
        self.optimizer = make_optimizer(model, cfg.optim, rt.device)
        self.scheduler = make_scheduler(self.optimizer, cfg.optim, tc.max_steps)
        self.loss_fn = make_loss_fn(tc.loss, rt.device)
        self.graphed = None  # GraphedStep with train.cuda_graph
        if tc.cuda_graph:
            from flash_attn.training.graphs import GraphedStep

            try:
                self.graphed = GraphedStep(self)
            except ValueError as e:
                raise ConfigError(str(e)) from e
        self.step = 0
        self.samples_seen = 0
        # Dropout masks differ between ranks but repeat across runs with the same seed.
        torch.manual_seed(tc.seed + 1 + rt.rank)
        random.seed(tc.seed + rt.rank)
        self.ckpt_dir = os.path.join(cfg.out_dir, "checkpoints")
        self.resumed_from = self._maybe_resume()

    # ---------------------------------------------------------------------------------- checkpoints
    def _resume_path(self):
        how = self.cfg.checkpoint.resume
        if how == "none":
            return None
        if how == "auto":
            return ckpt.latest_checkpoint(self.ckpt_dir)
        return ckpt.resolve_checkpoint(how)

    def _maybe_resume(self):
        """Load the checkpoint to resume from, if any. Under DDP/FSDP only rank 0 reads the file: the
        tensors are broadcast (and sharded) by PyTorch's state-dict helpers, the rest by one object
        broadcast, so N processes do not hold N copies of the full state in host memory."""
        rt = self.rt
        distributed = rt.strategy != "none" and rt.world > 1
        state, error = None, None
        if rt.is_main:
            try:
                path = self._resume_path()
                if path is not None:
                    state = ckpt.load_checkpoint(path)
                    check_shape(state["model_shape"], self.cfg.model, state["path"])
            except (ConfigError, FileNotFoundError) as e:
                error = e  # raised on every rank below, so none is left waiting in a collective
        meta = None if state is None else {k: v for k, v in state.items() if k not in ("model", "optimizer")}
        if distributed:
            shared = [meta, error]
            dist.broadcast_object_list(shared, src=0)
            meta, error = shared
        if error is not None:
            raise error
        if meta is None:
            return None
        ckpt.load_model_state(self.model, state["model"] if state else {}, broadcast=distributed)
        ckpt.load_optimizer_state(self.model, self.optimizer, state["optimizer"] if state else {},
                                  broadcast=distributed)
        self.scheduler.load_state_dict(meta["scheduler"])
        self.step = meta["step"]
        self.samples_seen = meta["data"]["samples_seen"]
        if meta["data"]["num_train_tokens"] != self.num_train_tokens:
            warnings.warn(f"resuming from {meta['path']} on different training data "
                          f"({meta['data']['num_train_tokens']} tokens then, {self.num_train_tokens} now); the "
                          "data position is kept")
        rngs = meta["rng"]
        if len(rngs) == rt.world:
            _set_rng_state(rngs[rt.rank], rt.device)
        else:
            warnings.warn(f"checkpoint has RNG states of {len(rngs)} processes, this run has {rt.world}; "
                          "dropout masks will differ from an uninterrupted run")
        return meta["path"]

    def save(self):
        """Checkpoint the current step (collective under DDP/FSDP: every rank must call it)."""
        model_state = ckpt.gather_model_state(self.model)
        optim_state = ckpt.gather_optimizer_state(self.model, self.optimizer)
        sched_state = self.scheduler.state_dict()
        if self.graphed is not None:
            from flash_attn.training.graphs import plain_state

            optim_state, sched_state = plain_state(optim_state, sched_state)
        rng = _rng_state(self.rt.device)
        if self.rt.strategy != "none" and self.rt.world > 1:
            rngs = [None] * self.rt.world
            dist.all_gather_object(rngs, rng)
        else:
            rngs = [rng]
        path = None
        if self.rt.is_main:
            state = {
                "config": self.cfg.to_dict(), "model_shape": shape_signature(self.cfg.model),
                "model": model_state, "optimizer": optim_state, "scheduler": sched_state,
                "step": self.step,
                "data": {"samples_seen": self.samples_seen, "num_train_tokens": self.num_train_tokens},
                "rng": rngs,
            }
            path = ckpt.save_checkpoint(self.ckpt_dir, self.step, state, keep=self.cfg.checkpoint.keep)
        if self.rt.strategy != "none" and self.rt.world > 1:
            dist.barrier()
        return path

    # ---------------------------------------------------------------------------------- steps
    def _autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.rt.device.type, dtype=self.dtype)

    def _grad_sync(self, sync):
        """DDP/FSDP all-reduce gradients only on the last micro-step of an accumulation."""
        if self.rt.strategy == "ddp" and not sync:
            return self.model.no_sync()
        if self.rt.strategy == "fsdp":
            self.model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def _batch(self, sampler, first, count):
        x, y = sampler.batch(first, count)
        if self.rt.device.type == "cuda":
            x, y = x.pin_memory().to(self.rt.device, non_blocking=True), y.pin_memory().to(self.rt.device,
                                                                                          non_blocking=True)
        return x, y

    def micro_step(self, x, y):
        """Forward, loss and backward of one micro-batch (the loss scaled for the accumulation, so the
        gradients of grad_accum micro-steps add up to the step's); returns the unscaled loss."""
        with self._autocast():
            loss = self.loss_fn(self.forward_model(x).logits, y)
        (loss / self.cfg.train.grad_accum).backward()
        return loss.detach()

    def update(self, zero_grad=True):
        """Gradient clipping and the optimizer step, then (zero_grad) the gradients set to None; returns
        the gradient norm before clipping (None without clipping)."""
        grad_norm = None
        if self.cfg.optim.grad_clip > 0:
            grad_norm = clip_gradients(self.model, self.optimizer, self.cfg.optim.grad_clip, self.rt)
        self.optimizer.step()
        if zero_grad:
            self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def train_step(self):
        """One optimizer step over one global batch; returns (loss tensor on this rank, grad norm or None)."""
        tc, rt = self.cfg.train, self.rt
        mb = tc.micro_batch_size
        batches = [self._batch(self.train_sampler, self.samples_seen + (micro * rt.world + rt.rank) * mb, mb)
                   for micro in range(tc.grad_accum)]
        if self.graphed is not None:
            loss, grad_norm = self.graphed.step(batches)
        else:
            total = torch.zeros((), device=rt.device)
            for micro, (x, y) in enumerate(batches):
                with self._grad_sync(micro == tc.grad_accum - 1):
                    total += self.micro_step(x, y)
            loss, grad_norm = total / tc.grad_accum, self.update()
        self.scheduler.step()
        self.samples_seen += mb * tc.grad_accum * rt.world
        self.step += 1
        return loss, grad_norm

    @torch.no_grad()
    def evaluate(self):
        """Mean loss over the first eval_batches global batches of the validation split."""
        tc, rt = self.cfg.train, self.rt
        self.model.eval()
        total = torch.zeros((), device=rt.device)
        for b in range(tc.eval_batches):
            x, y = self._batch(self.val_sampler, (b * rt.world + rt.rank) * tc.micro_batch_size,
                               tc.micro_batch_size)
            with self._autocast():
                total += self.loss_fn(self.forward_model(x).logits, y).float()
        self.model.train()
        return _to_float(_all_mean(total / tc.eval_batches, rt))

    def run(self):
        """Train to train.stop_at (or max_steps); returns a TrainResult."""
        cfg, tc, rt = self.cfg, self.cfg.train, self.rt
        end = tc.stop_at or tc.max_steps
        result = TrainResult(start_step=self.step, out_dir=cfg.out_dir, is_main=rt.is_main)
        writer = MetricsWriter(cfg.out_dir, self.step, cfg.log.csv, cfg.log.tensorboard) if rt.is_main else None
        progress = Progress(tc.max_steps, self.step, cfg.log.progress if rt.is_main else "off")
        peak = peak_tflops(rt.device, self.dtype, tc.peak_tflops)
        tokens_per_step = tc.micro_batch_size * tc.grad_accum * rt.world * tc.seq_len
        progress.message(
            f"{cfg.name}: {self.n_params / 1e6:.2f}M parameters, {rt.world} process(es) ({rt.strategy}) on "
            f"{rt.device.type}, {str(self.dtype).replace('torch.', '')}, {tokens_per_step} tokens/step, steps "
            f"{self.step}->{end} of {tc.max_steps}" + (f", resumed from {self.resumed_from}"
                                                        if self.resumed_from else ""))
        self.model.train()
        t_last, step_last = time.perf_counter(), self.step
        stops = _StopRequests()
        try:
            with stops:
                self._loop(end, result, writer, progress, peak, tokens_per_step, t_last, step_last, stops)
        finally:
            progress.close()
            if writer is not None:
                writer.close()
        result.final_step = self.step
        if writer is not None and cfg.log.plot:
            png = os.path.join(cfg.out_dir, "loss.png")
            if plot_losses(writer.records, png, cfg.name):
                progress.message(f"loss plot: {png}")
            else:
                progress.message("loss plot skipped: matplotlib is not installed (pip install matplotlib)")
        return result

    def _stop_requested(self, stops):
        """Whether the run stops here: a signal this process took (under DDP / FSDP, any rank's, agreed at the
        logged steps, where the ranks meet anyway)."""
        rt = self.rt
        if rt.strategy == "none" or rt.world == 1:
            return stops.signal is not None
        if self.step % self.cfg.log.interval:
            return False
        flag = torch.tensor([stops.signal is not None], dtype=torch.int32, device=rt.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and stops.signal is None:
            stops.signal = "a signal to another rank"
        return bool(flag.item())

    def _loop(self, end, result, writer, progress, peak, tokens_per_step, t_last, step_last, stops):
        cfg, tc, rt = self.cfg, self.cfg.train, self.rt
        while self.step < end:
            loss, grad_norm = self.train_step()
            if self.step % cfg.log.interval == 0 or self.step == end:
                loss_value = _to_float(_all_mean(loss, rt))  # .item() also waits for the GPU
                now = time.perf_counter()
                tokens_per_s = tokens_per_step * (self.step - step_last) / (now - t_last)
                t_last, step_last = now, self.step
                mfu = (self.flops_per_token * tokens_per_s / (peak * 1e12 * rt.world)) if peak else None
                if not math.isfinite(loss_value):
                    raise FloatingPointError(f"loss is {loss_value} at step {self.step}; lower optim.lr or "
                                             "check the data")
                result.losses.append((self.step, loss_value))
                result.tokens_per_s, result.mfu = tokens_per_s, mfu
                if writer is not None:
                    writer.write({"step": self.step, "split": "train", "loss": loss_value,
                                  # the schedule's base rate (muP's groups run multiples of it)
                                  "lr": _to_float(self.scheduler.get_last_lr()[0])
                                  / self.optimizer.param_groups[0].get("lr_multiplier", 1.0),
                                  "grad_norm": None if grad_norm is None else _to_float(grad_norm),
                                  "tokens": self.step * tokens_per_step, "tokens_per_s": tokens_per_s,
                                  "mfu": mfu, "elapsed_s": now - progress.t0})
                progress.update(self.step, loss_value, tokens_per_s, mfu)
            if (tc.eval_interval and self.step % tc.eval_interval == 0) or self.step == end:
                val = self.evaluate()
                result.val_losses.append((self.step, val))
                if writer is not None:
                    writer.write({"step": self.step, "split": "val", "loss": val,
                                  "tokens": self.step * tokens_per_step})
                progress.message(f"step {self.step}: validation loss {val:.4f}")
                t_last = time.perf_counter()  # evaluation time is not training throughput
            every = cfg.checkpoint.every
            if (every and self.step % every == 0) or (self.step == end and cfg.checkpoint.save_final):
                result.checkpoint = self.save()
                t_last = time.perf_counter()
            if self.step < end and self._stop_requested(stops):
                result.checkpoint = self.save()
                result.interrupted = stops.signal
                progress.message(f"stopped by {stops.signal} at step {self.step}: checkpoint {result.checkpoint}; "
                                 "the same command resumes from it (checkpoint.resume=auto)")
                return

    def close(self, clean=True):
        """Release the process group (when this trainer made it). clean: the run finished on every rank,
        so the ranks meet at a barrier first (after an error a peer may be stuck in another collective)."""
        if self.rt.owns_process_group and dist.is_initialized():
            # Every rank finishes its collectives (rank 0 may still be plotting) and DDP's reducer, which
            # holds the group, goes first: tearing the group down under a peer's pending work aborted a
            # gloo rank at exit ("terminate called without an active exception"; once in three CI runs).
            try:
                if clean:
                    dist.barrier()
            finally:
                self.model = self.forward_model = None
                dist.destroy_process_group()


def train(cfg):
    """Train with a Config (see flash_attn.training.config) and return a TrainResult."""
    trainer = Trainer(cfg)
    try:
        result = trainer.run()
    except BaseException:
        trainer.close(clean=False)
        raise
    trainer.close()
    return result
