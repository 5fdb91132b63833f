import subprocess
import sys

from flash_attn import cli
from flash_attn.training.cli import COMMANDS


def test_training_commands_match_the_training_cli():
    assert cli.TRAINING_COMMANDS == COMMANDS


def test_info_runs_as_a_command():
    r = subprocess.run([sys.executable, "-m", "flash_attn.cli", "info"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "backends (priority order):" in r.stdout and "torch   available" in r.stdout


def test_train_is_forwarded_to_the_training_cli(capsys):
    assert cli.main(["train", "--config", "tiny", "--print-config", "optim.lr=0.00123"]) == 0
    assert "0.00123" in capsys.readouterr().out


def test_train_config_typo_is_a_clear_error(capsys):
    assert cli.main(["train", "--config", "tiny", "optim.lrr=1"]) == 2
    assert "lrr" in capsys.readouterr().err


def test_info_names_backends_found_in_the_source_tree(monkeypatch):
    """A source checkout has no installed flash-attn-4 / flash-attn-triton distribution, yet their packages import:
    `flash-attn info` says where it found them rather than "not installed"."""
    import importlib.metadata

    def version(dist):
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert cli._version("flash-attn-4").startswith("from the source tree (")
    assert cli._version("flash-attn-4").rstrip(")").replace("\\\\", "/").endswith("flash_attn/cute")
    assert cli._version("no-such-dist") == "not installed"
