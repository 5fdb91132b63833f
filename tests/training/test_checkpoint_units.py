"""flash_attn.training.checkpoint, function by function: file names, the ``latest`` pointer, pruning to the newest
``keep``, atomic writes (no temporary left), how a path resolves to a checkpoint, and the errors for what is not
one of ours."""
import copy
import os

import pytest
import torch

from flash_attn.training import checkpoint as ckpt
from flash_attn.training.config import ConfigError


def _steps(folder):
    return sorted(f for f in os.listdir(folder) if f.startswith("step_"))


def test_save_names_the_step_and_points_latest_at_it(tmp_path):
    d = str(tmp_path / "ck")
    path = ckpt.save_checkpoint(d, 7, {"x": torch.ones(2)})
    assert path == os.path.join(d, "step_0000007.pt")
    assert open(os.path.join(d, "latest")).read() == "step_0000007.pt\n"
    assert sorted(os.listdir(d)) == ["latest", "step_0000007.pt"]  # no .tmp left behind
    state = torch.load(path, weights_only=True)
    assert state["format"] == ckpt.FORMAT and torch.equal(state["x"], torch.ones(2))
    assert ckpt.save_checkpoint(d, 12345678, {}).endswith("step_12345678.pt")


def test_keep_prunes_to_the_newest(tmp_path):
    d = str(tmp_path)
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(d, step, {}, keep=2)
    assert _steps(d) == ["step_0000003.pt", "step_0000004.pt"]
    ckpt.save_checkpoint(d, 5, {}, keep=1)
    assert _steps(d) == ["step_0000005.pt"]
    for step in (6, 7):
        ckpt.save_checkpoint(d, step, {}, keep=0)
    assert _steps(d) == ["step_0000005.pt", "step_0000006.pt", "step_0000007.pt"]


def test_keep_never_deletes_the_checkpoint_just_written(tmp_path):
    d = str(tmp_path)
    ckpt.save_checkpoint(d, 9, {})
    ckpt.save_checkpoint(d, 3, {}, keep=1)  # an older step number written last (a restart from step 3)
    assert "step_0000003.pt" in _steps(d)
    assert ckpt.latest_checkpoint(d).endswith("step_0000003.pt")


def test_keep_ignores_other_files(tmp_path):
    d = str(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "step_12.pt").write_text("not a step file name")
    for step in (1, 2):
        ckpt.save_checkpoint(d, step, {}, keep=1)
    assert sorted(os.listdir(d)) == ["latest", "notes.txt", "step_0000002.pt", "step_12.pt"]


def test_latest_checkpoint(tmp_path):
    d = str(tmp_path)
    assert ckpt.latest_checkpoint(d) is None
    assert ckpt.latest_checkpoint(str(tmp_path / "missing")) is None
    ckpt.save_checkpoint(d, 2, {})
    assert ckpt.latest_checkpoint(d) == os.path.join(d, "step_0000002.pt")
    (tmp_path / "latest").write_text("  step_0000002.pt \n")  # whitespace around the name is fine
    assert ckpt.latest_checkpoint(d) == os.path.join(d, "step_0000002.pt")
    (tmp_path / "latest").write_text("step_0000009.pt\n")
    with pytest.raises(ConfigError, match=r"names 'step_0000009.pt', which is not a checkpoint in"):
        ckpt.latest_checkpoint(d)
    (tmp_path / "latest").write_text("../etc/passwd\n")
    with pytest.raises(ConfigError, match=r"names '../etc/passwd', which is not a checkpoint"):
        ckpt.latest_checkpoint(d)


def test_resolve_checkpoint(tmp_path):
    run = tmp_path / "run"
    folder = str(run / "checkpoints")
    path = ckpt.save_checkpoint(folder, 4, {})
    assert ckpt.resolve_checkpoint(path) == path
    assert ckpt.resolve_checkpoint(folder) == path
    assert ckpt.resolve_checkpoint(str(run)) == path
    with pytest.raises(FileNotFoundError, match=r"^no checkpoint in '.*empty' \(looked for latest there and in "
                                                r"checkpoints/\)$"):
        os.makedirs(tmp_path / "empty")
        ckpt.resolve_checkpoint(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match=r"^checkpoint not found: '.*nowhere'$"):
        ckpt.resolve_checkpoint(str(tmp_path / "nowhere"))


def test_load_checkpoint(tmp_path):
    path = ckpt.save_checkpoint(str(tmp_path), 3, {"step": 3, "w": torch.arange(3)})
    state = ckpt.load_checkpoint(str(tmp_path))
    assert state["step"] == 3 and torch.equal(state["w"], torch.arange(3)) and state["path"] == path
    assert state["w"].device.type == "cpu"
    other = tmp_path / "other.pt"
    torch.save({"format": "something else"}, other)
    with pytest.raises(ConfigError, match=r"is not a flash_attn.training checkpoint \(format "
                                          r"'flash_attn.training/1'\)$"):
        ckpt.load_checkpoint(str(other))
    torch.save([1, 2], other)
    with pytest.raises(ConfigError, match="is not a flash_attn.training checkpoint"):
        ckpt.load_checkpoint(str(other))
    other.write_bytes(b"garbage")
    with pytest.raises(ConfigError, match=r"^cannot read checkpoint '.*other.pt': "):
        ckpt.load_checkpoint(str(other))


class _Payload:
    """Not a tensor nor a plain value: the safe unpickler must refuse it."""


def test_load_checkpoint_refuses_arbitrary_objects(tmp_path):
    path = tmp_path / "step_0000001.pt"
    torch.save({"format": ckpt.FORMAT, "obj": _Payload()}, path)
    with pytest.raises(ConfigError, match=r"^cannot read checkpoint"):
        ckpt.load_checkpoint(str(path))


def test_save_keeps_every_checkpoint_by_default(tmp_path):
    for step in (1, 2, 3):
        ckpt.save_checkpoint(str(tmp_path), step, {})
    assert _steps(str(tmp_path)) == ["step_0000001.pt", "step_0000002.pt", "step_0000003.pt"]


def test_atomic_write_of_a_file_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt._atomic_write("plain.bin", lambda f: f.write(b"abc"))
    assert sorted(os.listdir(tmp_path)) == ["plain.bin"] and (tmp_path / "plain.bin").read_bytes() == b"abc"


def test_model_and_optimizer_state_round_trip_in_one_process():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    m_state, o_state = ckpt.gather_model_state(model), ckpt.gather_optimizer_state(model, opt)
    assert set(m_state) == {"weight", "bias"} and "weight" in o_state["state"]  # keyed by parameter name
    other = torch.nn.Linear(3, 2)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    ckpt.load_model_state(other, m_state)  # no process group: the default loads without a broadcast
    ckpt.load_optimizer_state(other, other_opt, o_state)
    torch.testing.assert_close(other.weight, model.weight)
    torch.testing.assert_close(other_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_fsdp_states_are_gathered_in_full_in_a_world_of_one(tmp_path):
    """FSDP2 (fully_shard) in this process, on a gloo group of world size 1: the parameters are DTensors, and the
    gathered model and optimizer states hold plain CPU tensors (full, not sharded), which load back into a fresh
    sharded model with and without the broadcast from rank 0. (Two ranks run in test_training_dist.py's spawned
    processes.)"""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model, opt = build()
        model(torch.randn(5, 3)).sum().backward()
        opt.step()
        assert isinstance(model[0].weight, DTensor)
        m_state, o_state = ckpt.gather_model_state(model), ckpt.gather_optimizer_state(model, opt)
        tensors = list(m_state.values()) + [t for s in o_state["state"].values() for t in s.values()]
        assert set(m_state) == {"0.weight", "0.bias", "1.weight", "1.bias"} and len(tensors) == 4 + 4 * 3
        assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors)
        for broadcast in (False, True):
            other, other_opt = build()
            # (the loads turn the dicts' tensors into DTensors in place: each load gets a copy)
            ckpt.load_model_state(other, copy.deepcopy(m_state), broadcast=broadcast)
            ckpt.load_optimizer_state(other, other_opt, copy.deepcopy(o_state), broadcast=broadcast)
            for name, p in other.named_parameters():
                assert torch.equal(p.full_tensor(), m_state[name]), name
                assert torch.equal(other_opt.state[p]["exp_avg"].full_tensor(), o_state["state"][name]["exp_avg"])
    finally:
        dist.destroy_process_group()
