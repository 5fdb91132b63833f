"""flash_attn.utils.distributed on gloo process groups on the CPU: one rank in this process (shapes, handles, in-place
rules, argument errors), and two spawned ranks (values of every collective and the gradients of their autograd
forms, shared-parameter broadcast, sequence-parallel gradient sums)."""
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flash_attn.utils import distributed as fd


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    init = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


# --- one rank ---

def test_raw_gather_and_scatter_of_one_rank_copy_the_input(group):
    x = torch.randn(3, 4)
    for op in (fd.all_gather_raw, fd.reduce_scatter_raw):
        out, handle = op(x, group)
        assert handle is None and out is not x
        torch.testing.assert_close(out, x, rtol=0, atol=0)


def test_raw_async_returns_a_handle(group):
    x = torch.randn(2, 5)
    for op in (fd.all_gather_raw, fd.reduce_scatter_raw, fd.all_reduce_raw):
        out, handle = op(x, group, async_op=True)
        handle.wait()
        torch.testing.assert_close(out, x, rtol=0, atol=0)


def test_raw_gather_takes_a_non_contiguous_input(group):
    x = torch.randn(4, 3).t()
    out, _ = fd.all_gather_raw(x, group)
    torch.testing.assert_close(out, x, rtol=0, atol=0)


def test_all_reduce_raw_is_in_place_on_a_contiguous_tensor_only(group):
    x = torch.randn(4, 3)
    assert fd.all_reduce_raw(x, group)[0] is x
    y = x.t()
    out, _ = fd.all_reduce_raw(y, group)
    assert out is not y and out.is_contiguous()
    torch.testing.assert_close(out, y, rtol=0, atol=0)


def test_autograd_forms_of_one_rank_pass_values_and_gradients(group):
    x = torch.randn(2, 3, requires_grad=True)
    g = torch.randn(2, 3)
    for op in (fd.all_gather, fd.reduce_scatter):
        x.grad = None
        out = op(x, group)
        torch.testing.assert_close(out, x.detach(), rtol=0, atol=0)
        out.backward(g)
        torch.testing.assert_close(x.grad, g, rtol=0, atol=0)


def test_all_reduce_marks_its_in_place_result_for_autograd(group):
    x = torch.randn(2, 3, requires_grad=True)
    y = x * 2
    out = fd.all_reduce(y, group)
    assert out is y and y._version > 0
    out.backward(torch.ones(2, 3))
    torch.testing.assert_close(x.grad, torch.full((2, 3), 2.0))
    # a leaf that requires grad cannot be overwritten: autograd says so instead of losing its value
    with pytest.raises(RuntimeError, match="leaf"):
        fd.all_reduce(x, group)


def test_bad_inputs_name_the_argument(group):
    with pytest.raises(TypeError, match="input_"):
        fd.all_gather_raw([1.0], group)
    with pytest.raises(ValueError, match="input_"):
        fd.reduce_scatter_raw(torch.tensor(1.0), group)
    with pytest.raises(TypeError, match="input_"):
        fd.all_reduce_raw(3.0, group)


def test_sequence_parallel_grad_without_a_gradient_names_the_parameter(group):
    model = torch.nn.Linear(2, 2)
    model.bias._sequence_parallel = True
    with pytest.raises(RuntimeError, match="bias"):
        fd.allreduce_sequence_parallel_grad(model, group)
    with pytest.raises(TypeError, match="model"):
        fd.sync_shared_params(object(), group)


# --- get_dim_for_local_rank (no process group) ---

@pytest.mark.parametrize("dim, world, multiple_of, shares", [
    (8, 4, 1, [2, 2, 2, 2]),
    (10, 4, 1, [3, 3, 2, 2]),
    (3, 4, 1, [1, 1, 1, 0]),
    (12, 4, 2, [4, 4, 2, 2]),
    (96, 5, 16, [32, 16, 16, 16, 16]),
    (0, 2, 1, [0, 0]),
])
def test_get_dim_for_local_rank_splits_in_units_with_the_remainder_first(dim, world, multiple_of, shares):
    assert [fd.get_dim_for_local_rank(dim, world, r, multiple_of) for r in range(world)] == shares


@pytest.mark.parametrize("args, error, match", [
    ((10, 4, 0, 3), ValueError, "multiple_of=3"),
    ((8, 4, 4), ValueError, "local_rank"),
    ((8, 0, 0), ValueError, "world_size"),
    ((8.0, 4, 0), TypeError, "must be ints"),
])
def test_get_dim_for_local_rank_rejects(args, error, match):
    with pytest.raises(error, match=match):
        fd.get_dim_for_local_rank(*args)


# --- two ranks ---

def _two_ranks(rank, init):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        _check_two_ranks(rank, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def _check_two_ranks(rank, pg):
    exact = dict(rtol=0, atol=0)
    rows = [torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(2)]  # each rank's (2, 3) shard

    out, handle = fd.all_gather_raw(rows[rank], pg, async_op=True)
    handle.wait()
    torch.testing.assert_close(out, torch.cat(rows), **exact)

    # all_gather: d(sum(out * coef_s) over ranks s) / d x_r = sum_s coef_s[rows of r]
    coefs = [torch.arange(12.0).reshape(4, 3) * (s + 1) for s in range(2)]
    x = rows[rank].clone().requires_grad_()
    out = fd.all_gather(x, pg)
    torch.testing.assert_close(out, torch.cat(rows), **exact)
    out.backward(coefs[rank])
    torch.testing.assert_close(x.grad, (coefs[0] + coefs[1])[2 * rank:2 * rank + 2], **exact)

    # reduce_scatter: rank r keeps rows of r of the sum; every rank's input gets all ranks' gradients, in order
    full = [torch.arange(12.0).reshape(4, 3) * (s + 1) for s in range(2)]
    out, handle = fd.reduce_scatter_raw(full[rank], pg, async_op=True)
    handle.wait()
    torch.testing.assert_close(out, (full[0] + full[1])[2 * rank:2 * rank + 2], **exact)
    x = full[rank].clone().requires_grad_()
    out = fd.reduce_scatter(x, pg)
    torch.testing.assert_close(out, (full[0] + full[1])[2 * rank:2 * rank + 2], **exact)
    grads = [torch.full((2, 3), s + 1.0) for s in range(2)]
    out.backward(grads[rank])
    torch.testing.assert_close(x.grad, torch.cat(grads), **exact)
    with pytest.raises(ValueError, match="not a multiple"):
        fd.reduce_scatter_raw(torch.ones(3, 2), pg)

    # all_reduce: the sum; the gradient passes through unchanged
    x = torch.full((3,), rank + 1.0, requires_grad=True)
    out = fd.all_reduce(x * 1, pg)
    torch.testing.assert_close(out, torch.full((3,), 3.0), **exact)
    out.backward(torch.full((3,), 10.0 * (rank + 1)))
    torch.testing.assert_close(x.grad, torch.full((3,), 10.0 * (rank + 1)), **exact)
    y = torch.full((2,), rank + 1.0)
    out, handle = fd.all_reduce_raw(y, pg, async_op=True)
    handle.wait()
    assert out is y
    torch.testing.assert_close(y, torch.full((2,), 3.0), **exact)

    # sync_shared_params: marked parameters take rank 0's values, the others keep their own
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    for p in model[1].parameters():
        torch.nn.init.normal_(p)
        p._shared_params = True
    model[0].weight._shared_params = True
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fd.sync_shared_params(model, pg)
    after = {n: fd.all_gather_raw(p.detach()[None], pg)[0] for n, p in model.named_parameters()}
    for name in ("0.weight", "1.weight", "1.bias"):
        torch.testing.assert_close(after[name][0], after[name][1], **exact)
        torch.testing.assert_close(after[name][rank], before[name] if rank == 0 else after[name][0], **exact)
    assert not torch.equal(after["0.bias"][0], after["0.bias"][1])

    # allreduce_sequence_parallel_grad: marked gradients (two dtypes) become the sums, the others stay
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(2, 3))
    model.b = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    model.c = torch.nn.Parameter(torch.zeros(5))
    model.d = torch.nn.Parameter(torch.zeros(3))
    for name in ("a", "b", "d"):
        getattr(model, name)._sequence_parallel = True
    for i, p in enumerate(model.parameters()):
        p.grad = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * (rank + 1) + i
    fd.allreduce_sequence_parallel_grad(model, pg)
    for i, (name, p) in enumerate(model.named_parameters()):
        base = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape)
        want = base * 3 + 2 * i if name != "c" else base * (rank + 1) + i
        torch.testing.assert_close(p.grad, want, **exact)


def test_two_ranks_values_and_gradients(tmp_path):
    mp.spawn(_two_ranks, args=(str(tmp_path / "store"),), nprocs=2, join=True)
