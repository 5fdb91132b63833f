"""flash_attn's cross entropy beyond the kernels: the module's defaults and the arguments it forwards, the torch
path's vocab shard arithmetic (a rank's class offset, the split loss terms) and row chunks, the path choice, and
every argument error's message."""
import pytest
import torch
import torch.nn.functional as F

import flash_attn
from flash_attn.losses.cross_entropy import CrossEntropyLoss
from flash_attn.ops.triton import cross_entropy as ce
from flash_attn.ops.triton.cross_entropy import cross_entropy_loss


@pytest.fixture(autouse=True)
def torch_path():
    with flash_attn.use_backend("torch"):
        yield


def _data(rows=6, vocab=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[1] = -100
    return logits, labels


# ----------------------------------------------------------------------------------------------------
# The module


def test_module_defaults():
    m = CrossEntropyLoss()
    assert (m.ignore_index, m.reduction, m.label_smoothing, m.logit_scale, m.lse_square_scale, m.inplace_backward,
            m.process_group, m.return_z_loss) == (-100, "mean", 0.0, 1.0, 0.0, False, None, False)
    logits, labels = _data()
    torch.testing.assert_close(m(logits, labels), F.cross_entropy(logits, labels))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_module_forwards_every_argument(reduction):
    logits, labels = _data()
    labels[1], labels[3] = 2, 7  # row 3 is the ignored one here
    kw = dict(ignore_index=7, label_smoothing=0.1, logit_scale=0.5, lse_square_scale=0.01)
    m = CrossEntropyLoss(reduction=reduction, return_z_loss=True, **kw)
    loss, z = m(logits, labels)
    want, want_z = cross_entropy_loss(logits, labels, **kw)
    valid = labels != 7
    if reduction == "mean":
        want, want_z = want.sum() / valid.sum(), want_z.sum() / valid.sum()
    elif reduction == "sum":
        want, want_z = want.sum(), want_z.sum()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(z, want_z)
    ref = F.cross_entropy(0.5 * logits[valid], labels[valid], reduction="none", label_smoothing=0.1)
    lse = torch.logsumexp(0.5 * logits[valid], dim=-1)
    per_row = ref + 0.01 * lse.square()
    if reduction == "none":
        torch.testing.assert_close(loss[valid], per_row)
        assert (loss[~valid] == 0).all()


def test_module_precomputed_lse_is_used():
    logits, labels = _data()
    m = CrossEntropyLoss(reduction="none")
    wrong = torch.logsumexp(logits, dim=-1) + 1.0  # the module must use the given lse, not recompute it
    torch.testing.assert_close(m(logits, labels, precomputed_lse=wrong),
                               torch.where(labels != -100, F.cross_entropy(logits, labels, reduction="none") + 1.0,
                                           0.0))


def test_module_inplace_backward_writes_the_gradient_over_the_logits():
    logits, labels = _data()
    ref = logits.clone().requires_grad_()
    F.cross_entropy(ref, labels, reduction="sum").backward()
    x = logits.clone().requires_grad_()
    y = x * 1.0  # a non-leaf whose storage takes the gradient
    CrossEntropyLoss(reduction="sum", inplace_backward=True)(y, labels).backward()
    torch.testing.assert_close(x.grad, ref.grad)
    torch.testing.assert_close(y.detach(), ref.grad)  # the logits now hold their gradient
    y2 = logits.clone().requires_grad_() * 1.0
    CrossEntropyLoss(reduction="sum")(y2, labels).backward()
    torch.testing.assert_close(y2.detach(), logits)  # without inplace_backward they are untouched


# ----------------------------------------------------------------------------------------------------
# The vocab shard arithmetic of the torch path (what each rank of a process group computes)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_two_shards_add_up_to_the_whole_vocab(smoothing):
    logits, labels = _data(rows=5, vocab=8)
    n = 4
    lses, parts = [], []
    for rank in range(2):
        shard = logits[:, rank * n:(rank + 1) * n].contiguous()
        lse, losses, z = (torch.empty(5, dtype=torch.float32) for _ in range(3))
        ce._ce_fwd_torch(shard, labels, lse, losses, z, False, smoothing, 1.0, 0.0, -100, 8, rank * n, True)
        torch.testing.assert_close(lse, torch.logsumexp(shard, -1).float())
        lses.append(lse)
        parts.append(losses)
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    total = lse + parts[0] + parts[1]
    valid = labels != -100
    want = F.cross_entropy(logits.float(), labels, reduction="none", label_smoothing=smoothing)
    torch.testing.assert_close(total[valid], want[valid])
    # and the gradient of each shard, from the global lse
    full = logits.clone().requires_grad_()
    F.cross_entropy(full, labels, reduction="sum", label_smoothing=smoothing).backward()
    for rank in range(2):
        shard = logits[:, rank * n:(rank + 1) * n].contiguous()
        d = torch.empty_like(shard)
        ce._ce_bwd_torch(d, shard, torch.ones(5), lse, labels, smoothing, 1.0, 0.0, -100, 8, rank * n)
        torch.testing.assert_close(d, full.grad[:, rank * n:(rank + 1) * n])


def test_one_class_vocab_with_an_ignored_row():
    logits = torch.randn(3, 1)
    labels = torch.tensor([0, -100, 0])
    losses, _ = cross_entropy_loss(logits, labels)
    assert losses.tolist() == [0.0, 0.0, 0.0]


def test_backward_builds_its_column_index_on_the_logits_device():
    d = torch.empty(2, 4, device="meta")
    ce._ce_bwd_torch(d, torch.empty(2, 4, device="meta"), torch.empty(2, device="meta"),
                     torch.empty(2, device="meta"), torch.zeros(2, dtype=torch.long, device="meta"),
                     0.0, 1.0, 0.0, -100, 4, 0)


def test_row_chunks():
    big = ce.TORCH_CHUNK_ELEMS
    assert list(ce._row_chunks(5, 2 * big)) == [(i, i + 1) for i in range(5)]  # wider than a chunk: a row each
    assert list(ce._row_chunks(big + 1, 1)) == [(0, big), (big, big + 1)]
    assert list(ce._row_chunks(3, 0)) == [(0, 3)]
    assert list(ce._row_chunks(0, 5)) == []


def test_the_torch_path_is_picked_off_the_gpu_backends():
    x = torch.empty(2, 3)
    fwd = ce._pick(ce._ce_fwd_op, ce._ce_fwd_launch, ce._ce_fwd_torch, x)
    assert fwd is ce._ce_fwd_torch
    with flash_attn.use_backend("triton"):
        assert ce._pick(ce._ce_fwd_op, ce._ce_fwd_launch, ce._ce_fwd_torch, x) is ce._ce_fwd_launch


# ----------------------------------------------------------------------------------------------------
# Errors


def test_argument_messages():
    logits = torch.randn(3, 10)
    labels = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^logits must be a floating-point tensor \(batch, vocab_size\), got shape "
                                         r"\(3,\) torch.float32$"):
        cross_entropy_loss(torch.randn(3), labels)
    with pytest.raises(ValueError, match=r"^logits must be a floating-point tensor \(batch, vocab_size\)$"):
        cross_entropy_loss([[1.0]], labels)
    with pytest.raises(ValueError, match=r"^labels must be an integer tensor \(3,\) \(one class per row of logits\), "
                                         r"got torch.int64 \(4,\)$"):
        cross_entropy_loss(logits, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^labels must be an integer tensor \(3,\) \(one class per row of "
                                         r"logits\)$"):
        cross_entropy_loss(logits, [0, 0, 0])
    with pytest.raises(ValueError, match=r"^labels must be on the logits' device cpu, got meta$"):
        cross_entropy_loss(logits, labels.to("meta"))
    with pytest.raises(ValueError, match=r"^label_smoothing must be in \[0, 1\), got -0.1$"):
        cross_entropy_loss(logits, labels, label_smoothing=-0.1)
    with pytest.raises(ValueError, match=r"^lse_square_scale must be >= 0, got -1.0$"):
        cross_entropy_loss(logits, labels, lse_square_scale=-1.0)
    with pytest.raises(NotImplementedError, match=r"^precomputed_lse is supported without label_smoothing and "
                                                  r"process_group$"):
        cross_entropy_loss(logits, labels, precomputed_lse=torch.zeros(3), label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"^precomputed_lse must have shape \(3,\), got \(2,\)$"):
        cross_entropy_loss(logits, labels, precomputed_lse=torch.zeros(2))
    with pytest.raises(NotImplementedError, match=r"^reduction must be 'mean', 'sum' or 'none', got 'avg'$"):
        CrossEntropyLoss(reduction="avg")


# ----------------------------------------------------------------------------------------------------
# The vocab-parallel forward in one process: two threads play the ranks of a process group whose collectives
# exchange tensors through shared memory (the gloo test in test_cross_entropy.py runs real processes)


class _ThreadGroup:
    def __init__(self, world):
        import threading

        self.world, self.local = world, threading.local()
        self.barrier = threading.Barrier(world)
        self.slots = [None] * world

    def rank(self, group=None):
        return self.local.rank

    def size(self, group=None):
        return self.world

    def _exchange(self, t):
        self.slots[self.local.rank] = t.clone()
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got

    def all_gather(self, out, t, group=None):
        for o, g in zip(out, self._exchange(t)):
            o.copy_(g)

    def all_reduce(self, t, op=None, group=None):
        assert op == torch.distributed.ReduceOp.SUM
        t.copy_(torch.stack(self._exchange(t)).sum(0))


@pytest.mark.parametrize("smoothing,zloss", [(0.0, 0.0), (0.1, 0.01)])
def test_vocab_parallel_forward_and_backward_in_threads(monkeypatch, smoothing, zloss):
    import threading

    pg = _ThreadGroup(2)
    monkeypatch.setattr(torch.distributed, "get_rank", pg.rank)
    monkeypatch.setattr(torch.distributed, "get_world_size", pg.size)
    monkeypatch.setattr(torch.distributed, "all_gather", pg.all_gather)
    monkeypatch.setattr(torch.distributed, "all_reduce", pg.all_reduce)
    logits, labels = _data(rows=5, vocab=12)
    labels[2], labels[3] = 1, 9  # one label on each shard
    results, errors = [None, None], []

    def rank_main(rank):
        try:
            pg.local.rank = rank
            with flash_attn.use_backend("torch"):
                x = logits[:, rank * 6:(rank + 1) * 6].clone().requires_grad_()
                loss, z = cross_entropy_loss(x, labels, label_smoothing=smoothing, lse_square_scale=zloss,
                                             process_group=object())
                (dx,) = torch.autograd.grad(loss.sum(), x)
            results[rank] = (loss.detach(), z, dx)
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            pg.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    x = logits.clone().requires_grad_()
    valid = labels != -100
    lse = torch.logsumexp(x, -1)
    ref = torch.where(valid, F.cross_entropy(x, labels, reduction="none", label_smoothing=smoothing)
                      + zloss * lse.square(), 0.0)
    (dref,) = torch.autograd.grad(ref.sum(), x)
    for rank, (loss, z, dx) in enumerate(results):
        torch.testing.assert_close(loss, ref.detach())
        torch.testing.assert_close(z, torch.where(valid, zloss * lse.square(), 0.0).detach())
        torch.testing.assert_close(dx, dref[:, rank * 6:(rank + 1) * 6])


def test_strided_and_meta_logits():
    logits, labels = _data()
    t = logits.t().contiguous().t()  # stride(-1) != 1
    assert t.stride(-1) != 1
    torch.testing.assert_close(cross_entropy_loss(t, labels)[0], cross_entropy_loss(logits, labels)[0])
    losses, z = cross_entropy_loss(logits.to("meta"), labels.to("meta"))
    assert losses.device.type == "meta" and z.device.type == "meta" and losses.dtype == torch.float32


class _OwnGroup(_ThreadGroup):
    """A thread group whose collectives take only the group itself: a call on the default group (None) fails here,
    as on a real job it would reach the ranks of another group."""

    def rank(self, group=None):
        assert group is self, group
        return super().rank(group)

    def size(self, group=None):
        assert group is self, group
        return super().size(group)

    def all_gather(self, out, t, group=None):
        assert group is self, group
        super().all_gather(out, t, group)

    def all_reduce(self, t, op=None, group=None):
        assert group is self, group
        super().all_reduce(t, op, group)


def test_module_vocab_parallel_uses_its_process_group(monkeypatch):
    import threading

    pg = _OwnGroup(2)
    monkeypatch.setattr(torch.distributed, "get_rank", pg.rank)
    monkeypatch.setattr(torch.distributed, "get_world_size", pg.size)
    monkeypatch.setattr(torch.distributed, "all_gather", pg.all_gather)
    monkeypatch.setattr(torch.distributed, "all_reduce", pg.all_reduce)
    logits, labels = _data(rows=5, vocab=12)
    labels[2], labels[3] = 1, 9  # one label on each shard
    results, errors = [None, None], []

    def rank_main(rank):
        try:
            pg.local.rank = rank
            with flash_attn.use_backend("torch"):
                x = logits[:, rank * 6:(rank + 1) * 6].clone().requires_grad_()
                loss = CrossEntropyLoss(reduction="none", lse_square_scale=0.01, process_group=pg)(x, labels)
                (dx,) = torch.autograd.grad(loss.sum(), x)
            results[rank] = (loss.detach(), dx)
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            pg.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    x = logits.clone().requires_grad_()
    valid = labels != -100
    ref = torch.where(valid, F.cross_entropy(x, labels, reduction="none") + 0.01 * torch.logsumexp(x, -1).square(), 0.0)
    (dref,) = torch.autograd.grad(ref.sum(), x)
    for rank, (loss, dx) in enumerate(results):
        torch.testing.assert_close(loss, ref.detach())
        torch.testing.assert_close(dx, dref[:, rank * 6:(rank + 1) * 6])


def test_precomputed_lse_with_a_process_group_is_refused():
    logits, labels = _data()
    with pytest.raises(NotImplementedError, match=r"^precomputed_lse is supported without label_smoothing and "
                                                  r"process_group$"):
        cross_entropy_loss(logits, labels, precomputed_lse=torch.zeros(6), process_group=object())


def test_autograd_function_defaults_are_the_functions():
    """CrossEntropyLossFn.apply(logits, labels) (FA2's autograd class) takes cross_entropy_loss's defaults: no
    smoothing, scale 1, no z-loss, ignore_index -100, and the logits left as they are by the backward."""
    logits, labels = _data()
    y = logits.clone().requires_grad_() * 1.0
    losses, z = ce.CrossEntropyLossFn.apply(y, labels)
    ref = torch.where(labels != -100, F.cross_entropy(logits, labels, reduction="none"), 0.0)
    torch.testing.assert_close(losses, ref)
    assert not z.any()
    losses.sum().backward()
    torch.testing.assert_close(y.detach(), logits)
    y2 = logits.clone().requires_grad_() * 1.0
    cross_entropy_loss(y2, labels)[0].sum().backward()
    torch.testing.assert_close(y2.detach(), logits)  # the function's default: not in place either


def test_inplace_backward_writes_over_row_strided_logits():
    # Rows padded to 16 columns (stride(-1) == 1): the gradient goes over the logits' own storage, not a copy.
    logits, labels = _data()
    ref = logits.clone().requires_grad_()
    F.cross_entropy(ref, labels, reduction="sum").backward()
    base = torch.zeros(6, 16)
    base[:, :10] = logits
    y = (base.requires_grad_() * 1.0)[:, :10]
    assert y.stride() == (16, 1)
    CrossEntropyLoss(reduction="sum", inplace_backward=True)(y, labels).backward()
    torch.testing.assert_close(y.detach(), ref.grad)
    torch.testing.assert_close(base.grad[:, :10], ref.grad)


def test_aligned_labels_pass_through_and_unaligned_ones_are_copied():
    # The Triton launch reads int64 labels at 16-byte alignment: a view 8 bytes into its storage is copied.
    for n in (9, 17, 33, 65, 129):
        labels = torch.arange(n)
        assert labels.data_ptr() % 16 == 0 and ce._aligned(labels) is labels
        view = labels[1:]
        got = ce._aligned(view)
        assert got.data_ptr() % 16 == 0 and torch.equal(got, view)
