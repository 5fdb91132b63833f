"""The training step as CUDA graphs (``train.cuda_graph=true``).

An eager step spends host time on every kernel it launches (Python, autograd, the launchers): ~1,000
kernels for a GPT-2 medium step, and where the host is slower than the GPU the GPU waits. Replaying a
captured graph launches all of them at once. The step is split in graphs sharing one memory pool:

  first   forward + loss + backward of the step's first micro-batch, read from static input tensors; it
          writes the gradients (captured with the gradients unset, so autograd hands its results over as
          ``.grad`` instead of adding them to zeroed buffers: one fp32 add per parameter saved)
  accum   the same for the further micro-batches of a gradient accumulation (grad_accum > 1), adding into
          those ``.grad`` tensors
  update  gradient clipping (its scale rides in fused AdamW's grad_scale) and AdamW

The losses land in static tensors. Capture needs static addresses: AdamW keeps its step counters and
learning rate on the device (``capturable``, the learning rate a tensor the scheduler ``fill_``s), so the
replayed update follows the schedule. The first ``WARMUP_STEPS`` steps of a process run eagerly on a side
stream (they compile the kernels and create AdamW's state, as PyTorch's CUDA graph notes ask), the next one
is captured, then replayed, and every later step is a replay.

What a graph cannot hold is refused where the config is read (torch.compile, dropout, whose fused kernels
draw their seeds on the host) or here (more than one process, a CPU device). A kernel that synchronises
with the host fails the capture with PyTorch's error, re-raised naming this option.
"""
import torch

WARMUP_STEPS = 2


class GraphedStep:
    """Runs Trainer steps: eager warmups, then a capture, then replays. ``step(batches)`` takes the
    micro-batches (x, y) on the device and returns (mean loss tensor, grad norm tensor or None)."""

    def __init__(self, trainer):
        rt = trainer.rt
        if rt.device.type != "cuda":
            raise ValueError("train.cuda_graph needs a CUDA device (train.device=cuda), got "
                             f"{rt.device.type!r}")
        if rt.strategy != "none" or rt.world > 1:
            raise ValueError(f"train.cuda_graph runs one process only (dist.strategy={rt.strategy!r}, "
                             f"{rt.world} processes)")
        self.trainer = trainer
        self.warmups_left = WARMUP_STEPS
        self.graphs = None  # {"first", "accum" (grad_accum > 1), "update"} once captured
        self.static_x = self.static_y = self.static_norm = None
        self.static_loss = {}
        self.replays = 0  # micro-batch graph replays (tests check the graphs are what runs)
        self.side = torch.cuda.Stream(rt.device)

    def _make_capturable(self):
        dev = self.trainer.rt.device
        for group in self.trainer.optimizer.param_groups:
            group["capturable"] = True
            lr = group["lr"]
            if not (torch.is_tensor(lr) and lr.device == dev):
                group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=dev)
        for state in self.trainer.optimizer.state.values():  # eager AdamW without fused keeps them on the CPU
            if torch.is_tensor(state.get("step")) and state["step"].device != dev:
                state["step"] = state["step"].to(dev)

    def _capture(self):
        t = self.trainer
        self._make_capturable()
        t.optimizer.zero_grad(set_to_none=True)  # "first" creates the gradients in the graphs' pool
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the graphs get their own pool: give the warmups' cached blocks back
        graphs = {"first": torch.cuda.CUDAGraph()}
        if t.cfg.train.grad_accum > 1:
            graphs["accum"] = torch.cuda.CUDAGraph()
        graphs["update"] = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
        try:
            for name in graphs:
                with torch.cuda.graph(graphs[name], pool=pool):
                    if name == "update":
                        self.static_norm = t.update(zero_grad=False)
                    else:
                        self.static_loss[name] = t.micro_step(self.static_x, self.static_y)
        except Exception as e:
            raise RuntimeError(f"train.cuda_graph: capturing the training step failed ({e}); an op of the "
                               "step synchronises with the host or cannot be captured. Run with "
                               "train.cuda_graph=false.") from e
        self.graphs = graphs

    # -------------------------------------------------------------------------------- the step
    def step(self, batches):
        t = self.trainer
        total = torch.zeros((), device=t.rt.device)
        if self.warmups_left > 0:
            self.warmups_left -= 1
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                for x, y in batches:
                    total += t.micro_step(x, y)
                norm = t.update()
            torch.cuda.current_stream().wait_stream(self.side)
            return total / len(batches), norm
        for i, (x, y) in enumerate(batches):
            if self.static_x is None:
                self.static_x, self.static_y = x.clone(), y.clone()
            else:
                self.static_x.copy_(x, non_blocking=True)
                self.static_y.copy_(y, non_blocking=True)
            if self.graphs is None:
                self._capture()  # records without running: the replays below do this step
            name = "first" if i == 0 else "accum"
            self.graphs[name].replay()
            self.replays += 1
            total += self.static_loss[name]
        self.graphs["update"].replay()
        norm = None if self.static_norm is None else self.static_norm.clone()
        return total / len(batches), norm


def plain_state(optim_state, sched_state):
    """The optimizer and scheduler state dicts as an eager run keeps them (learning rates as floats,
    capturable off), so a graphed run's checkpoint resumes into either kind of run. Copies: the live
    param groups keep the tensors the graph reads."""
    groups = []
    for group in optim_state.get("param_groups", []):
        group = dict(group, capturable=False)
        if torch.is_tensor(group.get("lr")):
            group["lr"] = float(group["lr"])
        groups.append(group)
    optim_state = dict(optim_state, param_groups=groups)
    sched_state = dict(sched_state, _last_lr=[float(v) for v in sched_state.get("_last_lr", [])])
    return optim_state, sched_state
