"""flash_attn.ops.fused_dense's tensor-parallel layers on two gloo ranks (torchrun; this file run as a script is the
worker): each rank holds its shard of one full layer, and outputs and gradients must be the full layer's (rows of
them under sequence parallelism)."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from flash_attn.ops.fused_dense import ColumnParallelLinear, FusedDense, FusedMLP, ParallelFusedMLP, RowParallelLinear

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _params(module):
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)


@pytest.mark.slow
def test_two_ranks_under_torchrun():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               FLASH_ATTN_BACKEND="torch")
    env.pop("TRITON_INTERPRET", None)  # nothing here runs Triton; the interpreter only slows the import
    # Most of the time is two processes importing torch and flash_attn on a shared CPU.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.abspath(__file__)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("two-rank checks passed") == 2, proc.stdout[-3000:]


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _two_rank_worker():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    assert world == 2
    torch.manual_seed(0)  # the same full weights and inputs on both ranks
    D, Hd, M = 8, 12, 6
    ref = FusedMLP(D, Hd, D, activation="gelu_approx")
    _params(ref)
    full_x, g = torch.randn(M, D), torch.randn(M, D)
    x_ref = full_x.clone().requires_grad_()
    out_ref = ref(x_ref)
    (out_ref * g).sum().backward()
    cols = slice(rank * Hd // 2, (rank + 1) * Hd // 2)
    for sp in (True, False):
        rows = slice(rank * M // 2, (rank + 1) * M // 2) if sp else slice(None)
        for lvl in (0, 1, 2):
            par = ParallelFusedMLP(D, Hd, D, process_group=group, sequence_parallel=sp, checkpoint_lvl=lvl)
            assert (par.fc2.bias is not None) == (rank == 0)
            with torch.no_grad():
                par.fc1.weight.copy_(ref.fc1.weight[cols])
                par.fc1.bias.copy_(ref.fc1.bias[cols])
                par.fc2.weight.copy_(ref.fc2.weight[:, cols])
                if rank == 0:
                    par.fc2.bias.copy_(ref.fc2.bias)
            x = full_x[rows].clone().requires_grad_()
            out = par(x)
            _close(out, out_ref[rows])
            (out * g[rows]).sum().backward()
            _close(x.grad, x_ref.grad[rows])
            _close(par.fc1.weight.grad, ref.fc1.weight.grad[cols])
            _close(par.fc1.bias.grad, ref.fc1.bias.grad[cols])
            _close(par.fc2.weight.grad, ref.fc2.weight.grad[:, cols])
            if rank == 0:
                _close(par.fc2.bias.grad, ref.fc2.bias.grad)
    # FusedMLP / FusedDense given the group: x gathered along dim 0; FusedMLP's output reduce-scattered.
    shard = FusedMLP(D, Hd // 2, D)
    with torch.no_grad():
        shard.fc1.weight.copy_(ref.fc1.weight[cols])
        shard.fc1.bias.copy_(ref.fc1.bias[cols])
        shard.fc2.weight.copy_(ref.fc2.weight[:, cols])
        shard.fc2.bias.copy_(ref.fc2.bias / 2)  # each rank adds its bias before the sum
    rows = slice(rank * M // 2, (rank + 1) * M // 2)
    _close(shard(full_x[rows], process_group=group), out_ref[rows].detach())
    dense = FusedDense(D, 5)
    torch.testing.assert_close(dense(full_x[rows], process_group=group), dense(full_x), atol=0, rtol=0)
    # Uneven split: 3 units of 2 features -> 4 on rank 0, 2 on rank 1.
    torch.manual_seed(1)  # the shards drew unequal amounts of RNG (rank 0 alone has a row-parallel bias)
    full1, full2 = torch.nn.Linear(D, 6), torch.nn.Linear(6, D)
    col = ColumnParallelLinear(D, 6, group, multiple_of=2)
    row = RowParallelLinear(6, D, group, multiple_of=2)
    assert col.weight.shape[0] == row.weight.shape[1] == (4 if rank == 0 else 2)
    own = slice(0, 4) if rank == 0 else slice(4, 6)
    with torch.no_grad():
        col.weight.copy_(full1.weight[own])
        col.bias.copy_(full1.bias[own])
        row.weight.copy_(full2.weight[:, own])
        if rank == 0:
            row.bias.copy_(full2.bias)
    _close(row(col(full_x[rows])), full2(full1(full_x))[rows].detach())
    dist.destroy_process_group()
    print(f"rank {rank}: two-rank checks passed", flush=True)


if __name__ == "__main__":
    _two_rank_worker()
