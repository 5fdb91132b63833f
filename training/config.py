"""Training configuration: typed sections loaded from YAML, with ``section.field=value`` overrides.

Every field has a type and a default; a YAML key or override that names no field is an error that names it
(with the closest valid names), and a value of the wrong type is an error that names the field and the type.
"""
import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from typing import Optional

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


class ConfigError(ValueError):
    """A config file, field name or value is wrong; the message says which."""


@dataclass
class ModelConfig:
    """The network. ``arch`` picks GPT-2 style (LayerNorm, GELU MLP, learned positions), LLaMA style
    (RMSNorm, SwiGLU, rotary, no biases) or BTLM style (GPT-2 layers with SwiGLU, ALiBi and muP: attention scores
    / head_dim, muP's init and AdamW groups with hidden matrices at ``optim.lr * mup_width_scale``, see
    flash_attn.models.btlm); the other fields are the usual GPT2Config / LlamaConfig sizes."""

    arch: str = "gpt2"  # gpt2 | llama | btlm
    vocab_size: int = 256
    n_positions: int = 1024  # learned positions (gpt2); the longest sequence (llama)
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: Optional[int] = None  # grouped-query attention; None = n_head
    n_inner: Optional[int] = None  # MLP hidden size; None = 4 * n_embd (gpt2) / 8/3 * n_embd (llama rounded, btlm)
    rotary_emb_fraction: float = 0.0  # gpt2 only; llama always rotates the whole head
    rotary_emb_base: float = 10000.0
    parallel_block: bool = False
    tie_word_embeddings: bool = True
    dropout: float = 0.0  # embedding, attention and residual dropout
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    pad_vocab_size_multiple: int = 8
    residual_in_fp32: bool = True
    use_flash_attn: bool = True  # False: plain PyTorch softmax attention (materialises the scores)
    fused: str = "auto"  # fused bias/GELU/dropout-add-LayerNorm kernels: auto (on with CUDA) | on | off
    # muP (arch=btlm only): mup_width_scale = the tuned base model's n_embd / this n_embd; the embeddings are
    # multiplied by mup_embeddings_scale and the LM head's input by mup_output_alpha * mup_width_scale
    mup_width_scale: float = 1.0
    mup_embeddings_scale: float = 1.0
    mup_output_alpha: float = 1.0


@dataclass
class DataConfig:
    """Where tokens come from. ``train`` is ``synthetic`` (the built-in generated corpus) or a path: a text
    file (tokenized byte-level or with ``tokenizer``, a ``tokenizers`` JSON file) or a token file (``.npy``,
    or ``.bin`` raw ``token_dtype``) read through numpy.memmap."""

    train: str = "synthetic"
    val: Optional[str] = None  # None: the last val_fraction of train
    val_fraction: float = 0.05
    format: str = "auto"  # auto (by extension: .npy/.bin = tokens, else text) | text | tokens
    tokenizer: str = "byte"  # byte | path to a tokenizers JSON file
    token_dtype: str = "uint16"  # for .bin token files
    synthetic_chars: int = 2_000_000
    synthetic_seed: int = 1234


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to min_lr."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    fused: str = "auto"  # fused AdamW: auto (on with CUDA) | on | off


@dataclass
class TrainConfig:
    """The loop. The global batch per step is micro_batch_size * grad_accum * world_size sequences."""

    seq_len: int = 64
    micro_batch_size: int = 8
    grad_accum: int = 1
    max_steps: int = 50
    stop_at: int = 0  # stop this run after this step (the schedule still spans max_steps); 0 = max_steps
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # autocast dtype: auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp32
    loss: str = "auto"  # auto (fused on CUDA) | fused (flash_attn.losses) | torch
    compile: bool = False
    # Replay the step as CUDA graphs after a few eager steps: no Python or launch time per kernel (one
    # GPU, no dropout, no torch.compile; see flash_attn.training.graphs)
    cuda_graph: bool = False
    activation_checkpointing: bool = False
    eval_interval: int = 25  # 0 = only at the end
    eval_batches: int = 4
    peak_tflops: float = 0.0  # for MFU, per device; 0 = look the GPU up (unknown: no MFU)


@dataclass
class DistConfig:
    """Multi-process training under torchrun."""

    strategy: str = "auto"  # auto (ddp when WORLD_SIZE > 1) | none | ddp | fsdp
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | nccl | gloo


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps (0 = only at the end)
    keep: int = 2  # step checkpoints kept (the newest ones)
    resume: str = "auto"  # auto (latest in out_dir if any) | none | path to a checkpoint file
    save_final: bool = True


@dataclass
class LogConfig:
    interval: int = 1  # steps between logged (all-reduced) losses
    progress: str = "auto"  # auto (bar on a terminal, lines otherwise) | bar | lines | off
    csv: bool = False  # also write metrics.csv
    tensorboard: str = "auto"  # auto (if installed) | on | off
    plot: bool = True  # loss.png at the end (needs matplotlib)


@dataclass
class Config:
    name: str = "run"
    out_dir: str = "runs/run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self):
        return dataclasses.asdict(self)


_CHOICES = {
    "model.arch": ("gpt2", "llama", "btlm"),
    "model.fused": ("auto", "on", "off"),
    "data.format": ("auto", "text", "tokens"),
    "data.token_dtype": ("uint8", "uint16", "uint32", "int32", "int64"),
    "optim.fused": ("auto", "on", "off"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.dtype": ("auto", "bf16", "fp32"),
    "train.loss": ("auto", "fused", "torch"),
    "dist.strategy": ("auto", "none", "ddp", "fsdp"),
    "dist.backend": ("auto", "nccl", "gloo"),
    "log.progress": ("auto", "bar", "lines", "off"),
    "log.tensorboard": ("auto", "on", "off"),
}


def _fields(obj):
    return {f.name: f for f in dataclasses.fields(obj)}


def _unknown(name, valid, where):
    close = difflib.get_close_matches(name.rsplit(".", 1)[-1], list(valid), n=3)
    hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
    return ConfigError(f"unknown config field {name!r}{where}{hint}; valid fields: {', '.join(sorted(valid))}")


def _coerce(value, typ, name, where):
    """Check value against the field's annotation; ints are accepted for floats."""
    hints = typing.get_args(typ) if typing.get_origin(typ) is typing.Union else (typ,)
    if value is None:
        if type(None) in hints:
            return None
        raise ConfigError(f"config field {name!r}{where} may not be null")
    for t in hints:
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is str and isinstance(value, str):
            return value
    if float in hints and isinstance(value, str):
        try:
            return float(value)  # PyYAML (YAML 1.1) reads 3e-4, without a dot, as a string
        except ValueError:
            pass
    names = " or ".join("null" if t is type(None) else t.__name__ for t in hints)
    raise ConfigError(f"config field {name!r}{where} must be {names}, got {value!r}")


def _set(cfg, dotted, value, where=""):
    parts = dotted.split(".")
    obj = cfg
    for i, part in enumerate(parts):
        fields = _fields(obj)
        prefix = ".".join(parts[:i])
        if part not in fields:
            raise _unknown(f"{prefix}.{part}" if prefix else part, fields, where)
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(getattr(obj, part)):
                raise ConfigError(f"config field {dotted!r}{where} is a section; set its fields "
                                  f"({dotted}.<field>=...)")
            hints = typing.get_type_hints(type(obj))
            choices = _CHOICES.get(dotted)
            if isinstance(value, bool) and choices is not None and ("on" if value else "off") in choices:
                value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a bool
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and hints[part] is str:
                value = str(value)  # a name or path may look like a number
            value = _coerce(value, hints[part], dotted, where)
            if choices is not None and value not in choices:
                raise ConfigError(f"config field {dotted!r}{where} must be one of {choices}, got {value!r}")
            setattr(obj, part, value)
        else:
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"config field {'.'.join(parts[:i + 1])!r}{where} is not a section")


def _flatten(mapping, prefix=""):
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise ConfigError(f"config keys must be strings, got {key!r}")
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, name + ".")
        else:
            yield name, value


def resolve_config_path(name):
    """A config argument is a file path or the name of a bundled config (``tiny`` -> configs/tiny.yaml)."""
    if os.path.isfile(name):
        return name
    bundled = os.path.join(CONFIG_DIR, name if name.endswith(".yaml") else name + ".yaml")
    if os.path.isfile(bundled):
        return bundled
    available = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))
    raise ConfigError(f"config file {name!r} not found (neither a file nor a bundled config; bundled: "
                      f"{', '.join(available)})")


def _yaml():
    try:
        import yaml
    except ImportError as e:
        raise ConfigError("reading YAML configs needs PyYAML: pip install pyyaml") from e
    return yaml


def parse_value(text):
    """An override's value is read as a YAML scalar: 1e-3 -> float, true -> bool, null -> None."""
    yaml = _yaml()
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def load_config(path=None, overrides=()):
    """Config from defaults, then the YAML file at path (or bundled name), then ``a.b=value`` overrides."""
    cfg = Config()
    if path is not None:
        path = resolve_config_path(path)
        yaml = _yaml()
        with open(path) as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path!r} must hold a mapping, got {type(data).__name__}")
        for name, value in _flatten(data):
            _set(cfg, name, value, where=f" in {path}")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        name, text = item.split("=", 1)
        _set(cfg, name.strip(), parse_value(text), where=" (command-line override)")
    validate(cfg)
    return cfg


def config_from_dict(data):
    """Rebuild a Config saved with to_dict() (e.g. from a checkpoint)."""
    cfg = Config()
    for name, value in _flatten(data):
        _set(cfg, name, value, where=" (saved config)")
    return cfg


def validate(cfg):
    """Cross-field checks that a single field's type cannot express."""
    m, t, o = cfg.model, cfg.train, cfg.optim
    positive = {"model.vocab_size": m.vocab_size, "model.n_embd": m.n_embd, "model.n_layer": m.n_layer,
                "model.n_head": m.n_head, "train.seq_len": t.seq_len, "train.micro_batch_size": t.micro_batch_size,
                "train.grad_accum": t.grad_accum, "train.max_steps": t.max_steps, "log.interval": cfg.log.interval,
                "train.eval_batches": t.eval_batches}
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"config field {name!r} must be >= 1, got {value}")
    for name, value in {"train.stop_at": t.stop_at, "train.eval_interval": t.eval_interval,
                        "checkpoint.every": cfg.checkpoint.every, "checkpoint.keep": cfg.checkpoint.keep,
                        "optim.warmup_steps": o.warmup_steps, "optim.grad_clip": o.grad_clip,
                        "optim.weight_decay": o.weight_decay, "train.peak_tflops": t.peak_tflops}.items():
        if value < 0:
            raise ConfigError(f"config field {name!r} must be >= 0, got {value}")
    if m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd ({m.n_embd}) must be a multiple of model.n_head ({m.n_head})")
    if m.n_head_kv is not None and (m.n_head_kv < 1 or m.n_head % m.n_head_kv):
        raise ConfigError(f"model.n_head ({m.n_head}) must be a multiple of model.n_head_kv ({m.n_head_kv})")
    if m.arch == "gpt2" and m.rotary_emb_fraction == 0.0 and t.seq_len > m.n_positions:
        raise ConfigError(f"train.seq_len ({t.seq_len}) exceeds model.n_positions ({m.n_positions}), the "
                          "number of learned positions")
    mup = {"model.mup_width_scale": m.mup_width_scale, "model.mup_embeddings_scale": m.mup_embeddings_scale,
           "model.mup_output_alpha": m.mup_output_alpha}
    for name, value in mup.items():
        if value <= 0:
            raise ConfigError(f"config field {name!r} must be > 0, got {value}")
        if m.arch != "btlm" and value != 1.0:
            raise ConfigError(f"config field {name!r} applies to model.arch=btlm only (got {value} with "
                              f"model.arch={m.arch})")
    if m.arch == "btlm":
        for name, value, plain in (("model.n_head_kv", m.n_head_kv, None), ("model.parallel_block", m.parallel_block,
                                   False), ("model.rotary_emb_fraction", m.rotary_emb_fraction, 0.0)):
            if value != plain:
                raise ConfigError(f"model.arch=btlm (ALiBi, one KV head per head, sequential blocks) needs {name}="
                                  f"{plain}, got {value!r}")
    if not 0.0 <= m.rotary_emb_fraction <= 1.0:
        raise ConfigError(f"model.rotary_emb_fraction must be in [0, 1], got {m.rotary_emb_fraction}")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {m.dropout}")
    if not 0.0 < cfg.data.val_fraction < 1.0 and cfg.data.val is None:
        raise ConfigError(f"data.val_fraction must be in (0, 1) when data.val is not set, got "
                          f"{cfg.data.val_fraction}")
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"need 0 <= optim.min_lr <= optim.lr and optim.lr > 0, got lr={o.lr}, "
                          f"min_lr={o.min_lr}")
    if t.cuda_graph and t.compile:
        raise ConfigError("train.cuda_graph and train.compile cannot both be on (torch.compile's "
                          "mode='reduce-overhead' makes its own graphs)")
    if t.cuda_graph and m.dropout > 0:
        raise ConfigError(f"train.cuda_graph needs model.dropout=0 (got {m.dropout}): the fused dropout "
                          "kernels draw their seeds on the host, which a replayed graph would repeat")
    if t.stop_at > t.max_steps:
        raise ConfigError(f"train.stop_at ({t.stop_at}) exceeds train.max_steps ({t.max_steps})")
    return cfg
