"""flash_attn.utils.pretrained.state_dict_from_pretrained on tiny checkpoints written here: save_pretrained folders
(one safetensors file, shards with their index), pickled ones (one file, shards), and a Hugging Face hub cache laid
out as huggingface_hub lays it out, read offline. Nothing is downloaded."""
import json
import os
import subprocess
import sys

import pytest
import torch

from flash_attn.utils.pretrained import state_dict_from_pretrained

transformers = pytest.importorskip("transformers")
hub_constants = pytest.importorskip("huggingface_hub.constants")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny GPT-2 saved four ways; returns (folders by layout, the weights save_pretrained writes)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    root = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(root / "safe")
    model.save_pretrained(root / "safe_sharded", max_shard_size="20KB")
    # the tied head is not saved: the checkpoint holds every other entry of the state dict
    expected = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    write_pickled(root / "bin", expected)
    write_pickled(root / "bin_sharded", expected, shards=3)
    return root, expected


def write_pickled(folder, state, shards=1):
    """The pickle layout transformers wrote before safetensors: pytorch_model.bin, or shards and their index."""
    folder.mkdir()
    if shards == 1:
        torch.save(state, folder / "pytorch_model.bin")
        return
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: state[k] for k in names[i::shards]}
        torch.save(part, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def fake_hub_cache(cache, repo_id, folder):
    """huggingface_hub's cache layout for one repo at one commit: blobs, a snapshot of links to them, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(folder))):
        blob = repo / "blobs" / f"{i:040x}"
        blob.write_bytes((folder / name).read_bytes())
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty hub cache, offline; huggingface_hub read its environment at import, so its constants are set."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return cache


def assert_same(actual, expected):
    assert sorted(actual) == sorted(expected)
    for k, v in expected.items():
        assert actual[k].dtype == v.dtype, k
        torch.testing.assert_close(actual[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("layout", ["safe", "safe_sharded", "bin", "bin_sharded"])
def test_folder_layouts_load_the_saved_weights(saved, layout):
    root, expected = saved
    assert_same(state_dict_from_pretrained(str(root / layout)), expected)


def test_sharded_folders_have_several_shards(saved):
    root, _ = saved
    safe = json.loads((root / "safe_sharded" / "model.safetensors.index.json").read_text())
    assert len(set(safe["weight_map"].values())) > 1
    assert len([f for f in os.listdir(root / "bin_sharded") if f.endswith(".bin")]) == 3


def test_path_like_model_name(saved):
    root, expected = saved
    assert_same(state_dict_from_pretrained(root / "safe"), expected)


def test_pickle_is_preferred_to_safetensors_in_one_folder(saved, tmp_path):
    # FA2's order: with both files present, pytorch_model.bin is the one read
    root, expected = saved
    folder = tmp_path / "both"
    write_pickled(folder, {k: torch.zeros_like(v) for k, v in expected.items()})
    (folder / "model.safetensors").write_bytes((root / "safe" / "model.safetensors").read_bytes())
    loaded = state_dict_from_pretrained(str(folder))
    assert all(not v.any() for v in loaded.values())


def test_dtype_casts_floating_tensors_and_keeps_integer_ones(saved, tmp_path):
    _, expected = saved
    state = dict(expected, position_ids=torch.arange(16))
    write_pickled(tmp_path / "mixed", state)
    loaded = state_dict_from_pretrained(str(tmp_path / "mixed"), dtype=torch.bfloat16)
    assert loaded["position_ids"].dtype == torch.int64
    torch.testing.assert_close(loaded["position_ids"], state["position_ids"], rtol=0, atol=0)
    for k, v in expected.items():
        assert loaded[k].dtype == torch.bfloat16, k
        torch.testing.assert_close(loaded[k], v.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["safe", "bin"])
def test_device_moves_the_tensors(saved, layout):
    # "meta" stands in for an accelerator: the tensors are cast on the CPU, then moved
    root, expected = saved
    loaded = state_dict_from_pretrained(str(root / layout), device="meta", dtype=torch.float16)
    assert sorted(loaded) == sorted(expected)
    assert all(v.device.type == "meta" and v.dtype == torch.float16 for v in loaded.values())


def test_device_without_cast_loads_there(saved):
    root, expected = saved
    loaded = state_dict_from_pretrained(str(root / "safe"), device=torch.device("cpu"), dtype=torch.float32)
    assert_same(loaded, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["safe", "bin_sharded"])
@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_cuda_device_straight_or_after_the_cast(saved, layout, dtype):
    root, expected = saved
    loaded = state_dict_from_pretrained(str(root / layout), device="cuda", dtype=dtype)
    assert all(v.is_cuda for v in loaded.values())
    assert_same({k: v.cpu() for k, v in loaded.items()},
                {k: v.to(dtype) if dtype else v for k, v in expected.items()})


@pytest.mark.parametrize("layout", ["safe", "safe_sharded", "bin_sharded"])
def test_repo_id_loads_from_the_hub_cache_offline(saved, offline_cache, layout):
    root, expected = saved
    fake_hub_cache(offline_cache, f"tiny-org/{layout}", root / layout)
    assert_same(state_dict_from_pretrained(f"tiny-org/{layout}"), expected)


def test_hub_cache_from_the_environment_in_a_fresh_process(saved, tmp_path):
    """What a user sets: HF_HUB_CACHE and HF_HUB_OFFLINE=1 before anything imports huggingface_hub."""
    root, expected = saved
    cache = tmp_path / "hub"
    fake_hub_cache(cache, "tiny-org/sharded", root / "safe_sharded")
    code = ("from flash_attn.utils.pretrained import state_dict_from_pretrained as load\n"
            "sd = load('tiny-org/sharded')\n"
            "print(len(sd), sum(float(v.double().sum()) for v in sd.values()))\n")
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HF_HOME", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    count, total = proc.stdout.split()
    assert int(count) == len(expected)
    assert float(total) == pytest.approx(sum(float(v.double().sum()) for v in expected.values()), rel=1e-12)


def test_missing_repo_names_it_and_the_cache(offline_cache):
    with pytest.raises(FileNotFoundError) as err:
        state_dict_from_pretrained("tiny-org/absent")
    message = str(err.value)
    assert "tiny-org/absent" in message and str(offline_cache) in message and "HF_HUB_OFFLINE" in message
    assert isinstance(err.value, EnvironmentError)  # what FA2 raises, so callers that catch it still do


def test_folder_without_checkpoint_names_the_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="in the folder " + str(tmp_path)):
        state_dict_from_pretrained(str(tmp_path))


def test_missing_path_says_it_is_neither_a_folder_nor_a_repo_id(offline_cache, tmp_path):
    missing = str(tmp_path / "no" / "such" / "model")
    with pytest.raises(FileNotFoundError, match="not a valid hub repo id") as err:
        state_dict_from_pretrained(missing)
    assert missing in str(err.value)


def test_missing_shard_names_it(saved, tmp_path):
    root, _ = saved
    folder = tmp_path / "partial"
    folder.mkdir()
    index = json.loads((root / "safe_sharded" / "model.safetensors.index.json").read_text())
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    first = sorted(set(index["weight_map"].values()))[0]
    (folder / first).write_bytes((root / "safe_sharded" / first).read_bytes())
    with pytest.raises(FileNotFoundError, match="shard model-00002-of"):
        state_dict_from_pretrained(str(folder))


def test_index_without_weight_map_is_an_error(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="weight_map"):
        state_dict_from_pretrained(str(tmp_path))


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(model_name=3), TypeError, "model_name"),
    (dict(model_name=".", dtype="float16"), TypeError, "dtype"),
    (dict(model_name=".", device="no-such-device"), ValueError, "device"),
])
def test_bad_arguments_name_themselves(kwargs, error, name):
    with pytest.raises(error, match=name):
        state_dict_from_pretrained(**kwargs)
