"""Mutation score of the CPU test suite over the core modules the CPU can judge (mutmut 3).

mutmut copies the sources into ``mutants/``, puts every mutation of a function behind a trampoline and, for each
mutant, runs the tests that reach that function; a mutant is *killed* when one of them fails. The score per module
is killed / (mutants - survivors judged equivalent). Slow (tens of minutes on 2 cores): a script, not part of CI.

The run happens in a scratch copy laid out like the installed wheel (``ops/``, ``modules/``, ``models/``,
``training/`` under ``flash_attn/``): mutmut names a mutant by its file's module path, and the code imports
``flash_attn.ops...``, which only the wheel layout gives both. The backends are put on ``PYTHONPATH`` unmutated.

    pip install mutmut
    python -m benchmarks.tools.mutation_score [--only dropout,bert_padding] [--workdir /tmp/fa-mutation]
        [--max-children 2] [--worktree] [--out FILE.md]

Survivors judged equivalent (no CPU test can tell them apart from the original) are listed in ``EQUIVALENT`` with
the reason; the table counts them apart. By default the committed tree (HEAD) is mutated; ``--worktree`` takes the
checkout as it is. The table of the last run: ``benchmarks/results/mutation.md``.
"""
import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The host code that sets up a GPU kernel's launch (block sizes, vector widths, layouts) is judged by the GPU tests,
# not by these: in the scratch copy these functions sit between mutmut's "no mutate" pragmas.
GPU_LAUNCH = {
    "flash_attn/ops/triton/cross_entropy.py": ("_ce_fwd_launch", "_ce_bwd_launch"),
    "flash_attn/ops/triton/rotary.py": ("_rotary_launch", "_strides4"),
}


def fence_gpu_launch(workdir: Path):
    """Put each GPU_LAUNCH function of the scratch copy between ``# pragma: no mutate start`` / ``end``."""
    import ast

    for rel, names in GPU_LAUNCH.items():
        path = workdir / rel
        lines = path.read_text().splitlines()
        spans = [(min([n.lineno] + [d.lineno for d in n.decorator_list]), n.end_lineno)
                 for n in ast.parse("\n".join(lines)).body
                 if isinstance(n, ast.FunctionDef) and n.name in names]
        if len(spans) != len(names):
            raise SystemExit(f"{rel}: expected functions {names}, found {len(spans)} of them")
        for start, end in sorted(spans, reverse=True):
            lines.insert(end, "# pragma: no mutate end")
            lines.insert(start - 1, "# pragma: no mutate start")
        path.write_text("\n".join(lines) + "\n")


# suite -> (modules (paths inside the wheel layout), the CPU test files that judge them)
SUITES = {
    "dropout": (["flash_attn/dropout.py"], ["tests/reference/test_dropout.py"]),
    "bert_padding": (["flash_attn/bert_padding.py"], ["tests/api/test_bert_padding.py"]),
    "checks": (["flash_attn/_checks.py"], ["tests/api/test_checks.py", "tests/api/test_checks_units.py",
                                                  "tests/api/test_api.py"]),
    "dispatch": (["flash_attn/dispatch.py", "flash_attn/call.py"], ["tests/dispatch"]),
    # the learnable sink's and the lse gradient's tests run on the reference backend too
    "reference": (["flash_attn/reference.py"], ["tests/reference/test_reference.py",
                                                "tests/reference/test_reference_kvcache.py",
                                                "tests/reference/test_reference_devices.py",
                                                "tests/api/test_learnable_sink.py", "tests/api/test_lse_grad.py"]),
    "rotary": (["flash_attn/layers/rotary.py", "flash_attn/ops/triton/rotary.py"],
               ["tests/ops/test_rotary.py", "tests/ops/test_rotary_module.py", "tests/ops/test_rotary_units.py"]),
    "cross_entropy": (["flash_attn/losses/cross_entropy.py", "flash_attn/ops/triton/cross_entropy.py"],
                      ["tests/ops/test_cross_entropy.py", "tests/ops/test_cross_entropy_units.py"]),
    "layer_norm_torch": (["flash_attn/ops/triton/layer_norm_torch.py"],
                         ["tests/ops/test_layer_norm.py", "tests/ops/test_layer_norm_units.py"]),
    "checkpoint": (["flash_attn/training/checkpoint.py"], ["tests/training/test_training.py",
                                                        "tests/training/test_checkpoint_units.py"]),
}

# Survivors judged equivalent: (function, a piece of the mutated line, why no CPU test can tell it from the
# original). Matched on the mutated code, not on mutmut's numbering, which moves whenever a function changes.
_STRICTER_FAST_PATH = "a stricter one-pass acceptance sends the call to the full checks, which accept it too"
_NO_NDIM = "ndim's default is None"
# rotary and cross entropy
_COMPILE_ONLY = ("only torch.compile takes the custom op, and the compile tests (test_rotary.py, "
                 "test_cross_entropy.py) are left out under mutmut, whose trampolines Dynamo cannot trace")
_GENERAL_PATH = "a narrower fast-path test sends the call to the general path (q, then k), with the same result"
_TWO_D = "the tensor is 2-D: dim 1 is dim -1"
_EMPTY_FP32 = "torch.empty's default dtype is fp32, the one asked for"
_INT_ARANGE = "an int64 arange divided by (or offset by) a Python number gives the same fp32 values"
_FALSY = "None is falsy like False"
_CPU_OFFLOAD = ("cpu_offload moves to the CPU what a CPU test holds there already, and empties the states of the "
                "ranks above 0, which a world of one has not")
# flash_attn/reference.py (its device placement is judged by tests/reference/test_reference_devices.py)
_INF = 'float() reads "INF" as inf'
_FP32_DEFAULT = "the default dtype is fp32, the one asked for"
_INT64_DEFAULT = "arange and tensor of Python ints default to int64"
_BROADCAST = "the same values broadcast: a leading 1 is implied"
_FIRST_UPDATE = ("the first key block's update replaces it by an acc-dtype result (type promotion); its initial value "
                 "(-inf or 0) is exact in any dtype")
_WRITTEN_ONCE = "each element is written once, so storing it in fp32 rounds as the final cast to fp32 does"
_PROMOTED = "type promotion converts it exactly where it meets the acc-dtype (or fp32) operand"
_EMPTY_RANGE = "an empty key range computes nothing either way (the results stay 0 and the lse its initial value)"
_STRICTER_FULL = "a stricter full-visibility test masks a tile that the mask leaves as it is"
_ON_Q_DEVICE = "the API checks that it is on q's device (_checks), so moving it there does nothing"
_INT32_IDS = "int32 ids and lengths index and sum (promoted to int64) to the same rows"
_SAME_DTYPE = "the API gives k and v q's dtype, which is the caches' (rotate_at keeps it)"
_NO_ROWS = "Sq = 0 leaves the query loop empty and Sk = 0 every key range empty: the early return changes nothing"
_FP32_SINK = "the core passes the sink in fp32; " + _PROMOTED
_FP32_SLOPES = "the API requires fp32 alibi_slopes; " + _PROMOTED
_HOST_INT = "int() reads the offsets from any device and integer dtype"
_BIG_CACHE = ("CPU only: int32 block ids times the block size overflow only past 2**31 cache rows (4 GB of fp16 "
              "keys at one head of dim 1), beyond a CPU test")
_FP32_ROTARY = "the other operand is fp32: promotion computes in fp32 either way"
EQUIVALENT = [
    ("flash_attn.dispatch.x_load", 'missing = e.name or "XXXX"',
     "a nameless ModuleNotFoundError reaches the last branch with '' or any other non-prefix"),
    ("flash_attn.call.x_window", "if type(None) is tuple", "the default's shortcut skipped: same pair"),
    ("flash_attn.call.x_window", "if type(window_size) is not tuple", "the default's shortcut skipped: same pair"),
    ("flash_attn.call.x_dense", "_arch.get(None) or device_facts", "device_facts returns the cached facts"),
    ("flash_attn._checks.x_qkv", "dt = None", _STRICTER_FAST_PATH),
    ("flash_attn._checks.x_qkv", "and (varlen and (ks[2] == vs[2]", _STRICTER_FAST_PATH),
    ("flash_attn._checks.x_qkv", "not H / Hk", _STRICTER_FAST_PATH),
    ("flash_attn._checks.x_qkv", "1 < D <= MAX_HEAD_DIM", _STRICTER_FAST_PATH),
    ("flash_attn._checks.x_qkv", "0 < D < MAX_HEAD_DIM", _STRICTER_FAST_PATH),
    ("flash_attn._checks.x_qkv", "1 < Dv <= MAX_HEAD_DIM", _STRICTER_FAST_PATH),
    ("flash_attn._checks.x_qkv", "0 < Dv < MAX_HEAD_DIM", _STRICTER_FAST_PATH),
    ("flash_attn._checks.x_qkv", "(q.stride()[-1] == 1 and D == 1)", _STRICTER_FAST_PATH),
    ("flash_attn._checks.x_qkv", "(k.stride()[-1] == 1 and D == 1)", _STRICTER_FAST_PATH),
    ("flash_attn._checks.x_qkv", "(v.stride()[-1] == 1 and Dv == 1)", _STRICTER_FAST_PATH),
    ("flash_attn._checks.x_qkv", 'tensor("k", k, device=q.device)', _NO_NDIM),
    ("flash_attn._checks.x_qkv", 'tensor("v", v, device=q.device)', _NO_NDIM),
    ("flash_attn._checks.x_alibi", 'tensor("alibi_slopes", alibi_slopes, dtypes=', _NO_NDIM),
    ("flash_attn._checks.x__cached", "_seen.pop(ident, ))", "a dead tensor's entry is there to pop (a KeyError in a "
                                                           "weakref callback would only be printed)"),
    ("flash_attn._checks.x_trust", "_seen.pop(ident, ))", "as for _cached"),
    ("flash_attn._checks.x_cu_seqlens_values", "else c[0] * 1", "c[0] is 0 wherever the value is used"),
    ("flash_attn.bert_padding.x_unpad_input", "sum(dim=+1", "masks are 2-D: dim 1 is dim -1"),
    ("flash_attn.bert_padding.x_unpad_input", "all_masks.sum(dim=-1, dtype=None)", "_cu_seqlens sums in int32"),
    ("flash_attn.bert_padding.x_unpad_input", "all_masks.sum(dim=-1, )", "_cu_seqlens sums in int32"),
    ("flash_attn.bert_padding.x_unpad_input", "torch.nonzero(all_masks.flatten(), )", "as_tuple's default"),
    ("flash_attn.bert_padding.x_unpad_input_for_concatenated_sequences", "lengths.sum(dim=+1)",
     "lengths are 2-D: dim 1 is dim -1"),
    ("flash_attn.bert_padding.x_unpad_input_for_concatenated_sequences", "attention_mask_in_length.to(None)",
     "int32 or int64 lengths give the same sums at these sizes"),
    ("flash_attn.bert_padding.x_unpad_input_for_concatenated_sequences", "torch.nonzero(real.flatten(), )",
     "as_tuple's default"),
    ("flash_attn.bert_padding.x_unpad_input_for_concatenated_sequences", "seqlens[seqlens > 0].to(None)",
     "_cu_seqlens sums in int32"),
    ("flash_attn.bert_padding.x_unpad_input_for_concatenated_sequences", "torch.arange(S, device=None)",
     "CPU only: the CPU is the default device (a GPU test sees it)"),
    ("flash_attn.bert_padding.x_unpad_input_for_concatenated_sequences", "torch.arange(S, )",
     "CPU only: the CPU is the default device (a GPU test sees it)"),
    ("flash_attn.dropout.x_new_rng_state", "dtype=None)", "randint's default dtype is int64"),
    ("flash_attn.dropout.x_new_rng_state", "(2,), )", "randint's default dtype is int64"),
    ("flash_attn.dropout.x_new_rng_state", "torch.randint(2**31 - 1, (2,)", "randint's low defaults to 0"),
    ("flash_attn.dropout.x_new_rng_state", "torch.randint(1, 2**31 - 1", "a seed of exactly 0 has probability 2**-31"),
    ("flash_attn.dropout.x_new_rng_state", "2**31 + 1", "a seed of 2**31 - 1 or 2**31 has probability 2**-30"),
    ("flash_attn.dropout.x_new_rng_state", "2**31 - 2", "a seed of 2**31 - 2 has probability 2**-31"),
    ("flash_attn.dropout.x_threshold", "3**32)", "dropout_p < 1 keeps p * 2**32 below the cap"),
    ("flash_attn.dropout.x_threshold", "2**33)", "dropout_p < 1 keeps p * 2**32 below the cap"),
    ("flash_attn.ops.triton.layer_norm_torch.x__keep_mask_torch", "rng_state.to(None)",
     "0-d seeds combine with tensors on any device"),
    ("flash_attn.ops.triton.layer_norm_torch.x__keep_mask_torch", "dtype=None)", "arange's default dtype is int64"),
    ("flash_attn.ops.triton.layer_norm_torch.x__keep_mask_torch", "torch.arange(N, device=device, )",
     "arange's default dtype is int64"),
    ("flash_attn.ops.triton.layer_norm_torch.x__keep_mask_torch", "torch.arange(row0, row0 + M, device=device, )",
     "arange's default dtype is int64"),
    ("flash_attn.ops.triton.layer_norm_torch.x__ln_bwd_torch", "if (not is_rms_norm) or True",
     "an RMSNorm's saved mean is zero"),
    ("flash_attn.training.checkpoint.x_load_checkpoint", "weights_only=None", "weights_only's default is True"),
    ("flash_attn.training.checkpoint.x_save_checkpoint", "if keep >= 0:", "keep=0 prunes steps[:-0], nothing"),
    ("flash_attn.training.checkpoint.x__atomic_write", 'tmp = path + "XX.tmpXX"', "any temporary name is renamed"),
    ("flash_attn.training.checkpoint.x__atomic_write", 'tmp = path + ".TMP"', "any temporary name is renamed"),
    ("flash_attn.training.checkpoint.x__atomic_write", 'os.path.dirname(path) and "."',
     "which folder is fsynced shows only in a power cut"),
    ("flash_attn.training.checkpoint.x_load_model_state", "broadcast_from_rank0=None", "None and False agree"),
    ("flash_attn.training.checkpoint.x_load_optimizer_state", "broadcast_from_rank0=None", "None and False agree"),
    ("flash_attn.training.checkpoint.x_load_checkpoint", 'map_location="cpu", )', "weights_only's default is True"),
    ("flash_attn.training.checkpoint.x_load_checkpoint", "map_location=None",
     "CPU only: checkpoints hold CPU tensors, which load on the CPU anyway"),
    ("flash_attn.training.checkpoint.x_load_checkpoint", "torch.load(path, weights_only=True)",
     "CPU only: checkpoints hold CPU tensors, which load on the CPU anyway"),
    # FSDP in this process runs on a gloo group of world size 1 (test_checkpoint_units.py); two ranks run only in
    # test_training_dist.py's spawned processes, which mutmut does not mutate
    ("flash_attn.training.checkpoint.x_gather_model_state", "cpu_offload=None", _CPU_OFFLOAD),
    ("flash_attn.training.checkpoint.x_gather_model_state", "cpu_offload=False", _CPU_OFFLOAD),
    ("flash_attn.training.checkpoint.x_gather_optimizer_state", "cpu_offload=None", _CPU_OFFLOAD),
    ("flash_attn.training.checkpoint.x_gather_optimizer_state", "cpu_offload=False", _CPU_OFFLOAD),
    ("flash_attn.training.checkpoint.x__full_options", "StateDictOptions(full_state_dict=True, )",
     "drops cpu_offload (" + _CPU_OFFLOAD + ") and broadcast_from_rank0, which in a world of one sends rank 0's state "
     "to rank 0"),
    ("flash_attn.layers.rotary.x__rotate_qk_", 'if qkv.dim() == 6 and', _GENERAL_PATH),
    ("flash_attn.layers.rotary.x__rotate_qk_", 'qkv.stride(None) ==', _GENERAL_PATH),
    ("flash_attn.layers.rotary.x__rotate_qk_", '== qkv.shape[3] * qkv.stride(None)', _GENERAL_PATH),
    ("flash_attn.layers.rotary.x__rotate_qk_", '== qkv.shape[3] / qkv.stride(3)', _GENERAL_PATH),
    ("flash_attn.layers.rotary.x__rotate_qk_", '== qkv.shape[3] * qkv.stride(4)', _GENERAL_PATH),
    ("flash_attn.layers.rotary.x__rotate_qk_", 'qkv.stride(3) == qkv.shape[3] * qkv.stride(3)',
     "true only for one head, whose q and k view as two heads whatever the dim-2 stride; else the general path"),
    ("flash_attn.layers.rotary.xǁApplyRotaryEmbQKV_ǁforward", 'conjugate=None)', _FALSY),
    ("flash_attn.layers.rotary.xǁApplyRotaryEmbQKV_ǁbackward", 'clone(memory_format=None)',
     "the default keeps the gradient strides, and _rotate_qk_ rotates any layout"),
    ("flash_attn.layers.rotary.xǁApplyRotaryEmbKV_ǁbackward", 'clone(memory_format=None)',
     "the default keeps the gradient strides, and apply_rotary rotates any layout"),
    ("flash_attn.layers.rotary.xǁRotaryEmbeddingǁ__init__", 'persistent=None)',
     "register_buffer treats None like False: not persistent"),
    ("flash_attn.layers.rotary.xǁRotaryEmbeddingǁ__init__", 'if dim <= 1 or dim % 2:',
     "dim 1 is odd: refused either way"),
    ("flash_attn.layers.rotary.xǁRotaryEmbeddingǁ_compute_inv_freq", 'device=device, dtype=None)', _INT_ARANGE),
    ("flash_attn.layers.rotary.xǁRotaryEmbeddingǁ_compute_inv_freq", 'device=device, )', _INT_ARANGE),
    ("flash_attn.layers.rotary.xǁRotaryEmbeddingǁ_compute_scale", 'device=device, dtype=None)', _INT_ARANGE),
    ("flash_attn.layers.rotary.xǁRotaryEmbeddingǁ_compute_scale", 'device=device, )', _INT_ARANGE),
    ("flash_attn.layers.rotary.xǁRotaryEmbeddingǁ_update_cos_sin_cache", 'inv_freq.dtype == torch.float32) and False',
     "recomputing the fp32 buffer gives the same values"),
    ("flash_attn.layers.rotary.xǁRotaryEmbeddingǁ_update_cos_sin_cache", 'scale.dtype == torch.float32) and False',
     "recomputing the fp32 buffer gives the same values"),
    ("flash_attn.layers.rotary.xǁRotaryEmbeddingǁ_update_cos_sin_cache", 'self._compute_inv_freq(None)',
     "built on the CPU, then moved by inv_freq.to(device=device)"),
    ("flash_attn.layers.rotary.xǁRotaryEmbeddingǁ_update_cos_sin_cache", 'self._compute_scale(None)',
     "built on the CPU, then moved by scale.to(device)"),
    ("flash_attn.layers.rotary.xǁRotaryEmbeddingǁ_update_cos_sin_cache", 'arange(seqlen, dtype=None, device=device)',
     _INT_ARANGE),
    ("flash_attn.layers.rotary.xǁRotaryEmbeddingǁ_update_cos_sin_cache", 'power = (torch.arange(seqlen, device=',
     _INT_ARANGE),
    ("flash_attn.layers.rotary.xǁRotaryEmbeddingǁforward", 'if (xpos) or True else None',
     "without XPos the k tables are None"),
    ("flash_attn.ops.triton.rotary.x__positions", 'cu = cu_seqlens.to(device=dev, dtype=None)',
     "searchsorted and the sums take int32 offsets (promoted to int64): the same positions"),
    ("flash_attn.ops.triton.rotary.x__positions", 'cu = cu_seqlens.to(device=dev, )',
     "searchsorted and the sums take int32 offsets (promoted to int64): the same positions"),
    ("flash_attn.ops.triton.rotary.x__positions", 'pos = torch.arange(S, device=dev).expand(S)',
     "positions (S,) broadcast over the batch"),
    ("flash_attn.ops.triton.rotary.x__rotary_torch", 'half = cos.shape[+1]', _TWO_D),
    ("flash_attn.ops.triton.rotary.x__rotary_torch", 'idx = pos.clamp(None,',
     "positions below 0 come only from negative tensor offsets, which the API leaves unspecified (int offsets "
     "below 0 are refused); ok masks them either way"),
    ("flash_attn.ops.triton.rotary.x_apply_rotary", 'if rotary_dim <= x.shape[-1]:',
     "rotary_dim == headdim copies an empty slice"),
    ("flash_attn.ops.triton.rotary.x_apply_rotary", '(isinstance(seqlen_offsets, int)) or True else 0',
     "with a tensor of offsets the kernel reads them (HAS_OFFSETS_TENSOR) and never the int"),
    ("flash_attn.ops.triton.rotary.x_apply_rotary", 'off_i = seqlen_offsets if isinstance(seqlen_offsets, int) else 1',
     "with a tensor of offsets the kernel reads them (HAS_OFFSETS_TENSOR) and never the int"),
    ("flash_attn.ops.triton.rotary.x_apply_rotary", 'torch.compiler.is_compiling()) and False', _COMPILE_ONLY),
    ("flash_attn.ops.triton.rotary.x_apply_rotary", 'torch.compiler.is_compiling()) or True', _COMPILE_ONLY),
    ("flash_attn.ops.triton.cross_entropy.x__pick", 'torch.compiler.is_compiling()) and False', _COMPILE_ONLY),
    ("flash_attn.ops.triton.cross_entropy.xǁCrossEntropyLossFnǁforward", '_pick(None, _ce_fwd_launch', _COMPILE_ONLY),
    ("flash_attn.ops.triton.cross_entropy.xǁCrossEntropyLossFnǁbackward", '_pick(None, _ce_bwd_launch',
     _COMPILE_ONLY),
    ("flash_attn.ops.triton.cross_entropy.xǁCrossEntropyLossFnǁforward", 'if logits.stride(+1) != 1:', _TWO_D),
    ("flash_attn.ops.triton.cross_entropy.xǁCrossEntropyLossFnǁforward", 'dtype=None))', _EMPTY_FP32),
    ("flash_attn.ops.triton.cross_entropy.xǁCrossEntropyLossFnǁforward", 'torch.empty(n_rows, device=dev, ))',
     _EMPTY_FP32),
    ("flash_attn.ops.triton.cross_entropy.xǁCrossEntropyLossFnǁforward", 'empty(n_rows, device=dev, dtype=None)',
     _EMPTY_FP32),
    ("flash_attn.ops.triton.cross_entropy.xǁCrossEntropyLossFnǁforward", 'torch.empty(n_rows, device=dev, )',
     _EMPTY_FP32),
    ("flash_attn.ops.triton.cross_entropy.x__ce_fwd_torch", 'dim=+1)', _TWO_D),
    ("flash_attn.ops.triton.cross_entropy.x__ce_bwd_torch", 'if smoothing >= 0.0:',
     "smoothing 0 subtracts 0 / total_classes"),
    ("flash_attn.ops.triton.cross_entropy.x__num_splits", 'max(n_rows, 2))',
     "the split count of the GPU forward (its occupancy heuristic) changes only the order of an fp32 sum"),
    ("flash_attn.ops.triton.cross_entropy.x__num_splits", 'return max(2, min(cdiv(n_cols, MIN_SPLIT_COLS), want))',
     "the launch recomputes the split count from the split width: a single-split row stays one split"),
    ("flash_attn.reference.xǁ_Planǁ_fully_visible", 'right_ok = None', _STRICTER_FULL),
    ("flash_attn.reference.xǁ_Planǁ_fully_visible", 'left_ok = None', _STRICTER_FULL),
    ("flash_attn.reference.xǁ_Planǁ_fully_visible", 'self.window_left < 0 and q1', _STRICTER_FULL),
    ("flash_attn.reference.xǁ_Planǁ_fully_visible", 'self.window_right < 0 and q0', _STRICTER_FULL),
    ("flash_attn.reference.xǁ_Planǁ_fully_visible", 'q1 - 1 + self.offset + self.window_left <= k0', _STRICTER_FULL),
    ("flash_attn.reference.xǁ_Planǁ_fully_visible", 'q1 + 1 + self.offset - self.window_left <= k0', _STRICTER_FULL),
    ("flash_attn.reference.xǁ_Planǁ_fully_visible", 'q1 - 1 + self.offset - self.window_left < k0', _STRICTER_FULL),
    ("flash_attn.reference.xǁ_Planǁ_fully_visible", 'q0 + self.offset - self.window_right >= k1 - 1', _STRICTER_FULL),
    ("flash_attn.reference.xǁ_Planǁ_fully_visible", 'q0 + self.offset + self.window_right > k1 - 1', _STRICTER_FULL),
    ("flash_attn.reference.xǁ_Planǁ_fully_visible", 'q0 + self.offset + self.window_right >= k1 + 1', _STRICTER_FULL),
    ("flash_attn.reference.xǁ_Planǁscores", 'full = None', _STRICTER_FULL),
    ("flash_attn.reference.xǁ_Planǁscores", 'float("-INF")', _INF),
    ("flash_attn.reference.xǁ_Planǁscores", 'j = torch.arange(k0, k1, device=s.device).view(bk)', _BROADCAST),
    ("flash_attn.reference.xǁ_Planǁscores", 'rel.abs().to(None)', _PROMOTED),
    ("flash_attn.reference.xǁ_Planǁscores", 'vis = rel >= -self.window_left',
     "vis starts all True: and-ing the first condition is assigning it"),
    ("flash_attn.reference.xǁ_Planǁkeep", '.view(self.Hk, self.G, 1, 1)',
     _BROADCAST),
    ("flash_attn.reference.xǁ_Planǁkeep", 'dtype=torch.int64).view(1, 1, -1, 1)',
     _BROADCAST),
    ("flash_attn.reference.xǁ_Planǁkeep", 'dtype=torch.int64).view(1, 1, 1, -1)',
     _BROADCAST),
    ("flash_attn.reference.xǁ_Planǁkeep", 'device=device, dtype=None).view(', _INT64_DEFAULT),
    ("flash_attn.reference.xǁ_Planǁkeep", 'device=device, ).view(', _INT64_DEFAULT),
    ("flash_attn.reference.x__make_plan", 'slopes = slopes.to(device=None,', _ON_Q_DEVICE),
    ("flash_attn.reference.x__make_plan", 'slopes = slopes.to(dtype=_acc_dtype(q.dtype))', _ON_Q_DEVICE),
    ("flash_attn.reference.x__make_plan", 'slopes = slopes.to(device=q.device, dtype=None)', _FP32_SLOPES),
    ("flash_attn.reference.x__make_plan", 'slopes = slopes.to(device=q.device, )', _FP32_SLOPES),
    ("flash_attn.reference.x__make_plan", 'slopes = slopes.to(device=q.device, dtype=_acc_dtype(None))', _FP32_SLOPES),
    ("flash_attn.reference.x__make_plan", 'sink = sink.to(device=None,', _ON_Q_DEVICE),
    ("flash_attn.reference.x__make_plan", 'sink = sink.to(dtype=_acc_dtype(q.dtype))', _ON_Q_DEVICE),
    ("flash_attn.reference.x__make_plan", 'sink = sink.to(device=q.device, dtype=None)', _FP32_SINK),
    ("flash_attn.reference.x__make_plan", 'sink = sink.to(device=q.device, )', _FP32_SINK),
    ("flash_attn.reference.x__make_plan", 'sink = sink.to(device=q.device, dtype=_acc_dtype(None))', _FP32_SINK),
    ("flash_attn.reference.x__make_plan", '.view(Hk, G, 1)', _BROADCAST),
    ("flash_attn.reference.x__dense_plan", '_slopes_for(alibi_slopes, None, B, H)',
     "slopes[None] viewed as (B, H) is slopes"),
    ("flash_attn.reference.x__dense_plan", 'torch.arange(B, dtype=None)', _INT64_DEFAULT),
    ("flash_attn.reference.x__dense_plan", 'torch.arange(B, )', _INT64_DEFAULT),
    ("flash_attn.reference.x__seq_plan", 'torch.tensor([b], dtype=None)', _INT64_DEFAULT),
    ("flash_attn.reference.x__seq_plan", 'torch.tensor([b], )', _INT64_DEFAULT),
    ("flash_attn.reference.x__slopes_for", 'alibi_slopes.view(H).expand(N, H)', _BROADCAST),
    ("flash_attn.reference.x__host", 'cu.to(None, torch.int64)', _HOST_INT),
    ("flash_attn.reference.x__host", 'cu.to(torch.int64)', _HOST_INT),
    ("flash_attn.reference.x__host", 'cu.to("cpu", None)', _HOST_INT),
    ("flash_attn.reference.x__host", 'cu.to("cpu", )', _HOST_INT),
    ("flash_attn.reference.x_unsupported_reason", 'getattr(call, "dtype", )',
     "every call description (AttnCall) has a dtype"),
    ("flash_attn.reference.x__fwd_plan", 'if lo > hi:', _EMPTY_RANGE),
    ("flash_attn.reference.x__fwd_plan", 'if Sq == 0 and plan.Sk == 0:', _NO_ROWS),
    ("flash_attn.reference.x__fwd_plan", '"-INF"', _INF),
    ("flash_attn.reference.x__fwd_plan", '"INF"', _INF),
    ("flash_attn.reference.x__fwd_plan", 'm = torch.full((*shape_rows, nq), float("-inf"), dtype=None', _FIRST_UPDATE),
    ("flash_attn.reference.x__fwd_plan", 'm = torch.full((*shape_rows, nq), float("-inf"), device=q.device)',
     _FIRST_UPDATE),
    ("flash_attn.reference.x__fwd_plan", 'l = torch.zeros((*shape_rows, nq), dtype=None', _FIRST_UPDATE),
    ("flash_attn.reference.x__fwd_plan", 'l = torch.zeros((*shape_rows, nq), device=q.device)', _FIRST_UPDATE),
    ("flash_attn.reference.x__fwd_plan", 'acc = torch.zeros((*shape_rows, nq, Dv), dtype=None', _FIRST_UPDATE),
    ("flash_attn.reference.x__fwd_plan", 'acc = torch.zeros((*shape_rows, nq, Dv), device=q.device)', _FIRST_UPDATE),
    ("flash_attn.reference.x__fwd_plan", 'lse = torch.full((N, H, Sq), float("inf"), dtype=None', _FP32_DEFAULT),
    ("flash_attn.reference.x__fwd_plan", 'lse = torch.full((N, H, Sq), float("inf"), device=q.device)', _FP32_DEFAULT),
    ("flash_attn.reference.x__fwd_plan", 'probs = (torch.zeros(N, H, Sq, plan.Sk, dtype=None', _FP32_DEFAULT),
    ("flash_attn.reference.x__fwd_plan", 'probs = (torch.zeros(N, H, Sq, plan.Sk, device=q.device)', _FP32_DEFAULT),
    ("flash_attn.reference.x__fwd_plan", 'masked_fill(m_new == float("-inf"), 1.0)',
     "any finite reference gives exp(-inf - c) = 0"),
    ("flash_attn.reference.x__fwd_plan", 'o = acc / torch.where(empty, 2.0, l)', "a row without keys has acc = 0"),
    ("flash_attn.reference.x__fwd_plan", 'torch.log(torch.where(empty, 2.0, l))',
     "the outer where gives +inf on rows without keys"),
    ("flash_attn.reference.x__fwd_plan", '_from_chunk(o.view(N, plan.Hk, plan.G * nq, Dv), plan, nq).to(None)',
     "the slice assignment casts to the output dtype"),
    ("flash_attn.reference.x__fwd_plan", 'sink = plan.sink.view(H, 1)', _BROADCAST),
    ("flash_attn.reference.x_fwd", '(probs if (return_probs) or True else None)',
     "the dense plan returns probs None unless asked"),
    ("flash_attn.reference.x_fwd", '"INF"', _INF),
    ("flash_attn.reference.x_fwd", 'lse = torch.full((H, total_q), float("inf"), dtype=None', _FP32_DEFAULT),
    ("flash_attn.reference.x_fwd", 'lse = torch.full((H, total_q), float("inf"), device=q.device)', _FP32_DEFAULT),
    ("flash_attn.reference.x_fwd", 'probs = (torch.zeros(B, H, max_seqlen_q, max_seqlen_k, dtype=None', _FP32_DEFAULT),
    ("flash_attn.reference.x_fwd", 'probs = (torch.zeros(B, H, max_seqlen_q, max_seqlen_k, device=q.device)',
     _FP32_DEFAULT),
    ("flash_attn.reference.x__bwd_plan", 'if lo > hi:', _EMPTY_RANGE),
    ("flash_attn.reference.x__bwd_plan", 'if Sq > 0 or plan.Sk > 0:', _NO_ROWS),
    ("flash_attn.reference.x__bwd_plan", 'if Sq >= 0 and plan.Sk > 0:', _NO_ROWS),
    ("flash_attn.reference.x__bwd_plan", 'if Sq > 0 and plan.Sk >= 0:', _NO_ROWS),
    ("flash_attn.reference.x__bwd_plan", 'dq = torch.zeros(N, Sq, H, D, dtype=None', _WRITTEN_ONCE),
    ("flash_attn.reference.x__bwd_plan", 'dq = torch.zeros(N, Sq, H, D, device=q.device)', _WRITTEN_ONCE),
    ("flash_attn.reference.x__bwd_plan", '_rows(dlse, plan, q0, q1).to(None)', _PROMOTED),
    ("flash_attn.reference.x__bwd_plan", '_rows(lse, plan, q0, q1).to(None)', _PROMOTED),
    ("flash_attn.reference.x__bwd_plan", 's.float().to(None)', _PROMOTED),
    ("flash_attn.reference.x__bwd_plan", '.transpose(-1, +2)', "the operands are 4-D: dim 2 is dim -2"),
    ("flash_attn.reference.x_bwd", 'dq = torch.zeros(q.shape, dtype=None', _WRITTEN_ONCE),
    ("flash_attn.reference.x_bwd", 'dq = torch.zeros(q.shape, device=q.device)', _WRITTEN_ONCE),
    ("flash_attn.reference.x_bwd", 'lse[:, q0:q1].unsqueeze(1)', "_rows views (H, 1, nq) as it views (1, H, nq)"),
    ("flash_attn.reference.x_bwd", 'if q1 == q0 and k1 == k0:',
     "a sequence without queries or without keys adds zero gradients"),
    ("flash_attn.reference.x__paged_rows", 'nblk = None', "all the blocks of the row, then cut to n rows"),
    ("flash_attn.reference.x__paged_rows", 'torch.arange(block_size, device=device).view(-1)', _BROADCAST),
    ("flash_attn.reference.x__paged_rows", 'blocks = block_table[b, :nblk].to(device=None,', _ON_Q_DEVICE),
    ("flash_attn.reference.x__paged_rows", 'blocks = block_table[b, :nblk].to(dtype=torch.int64)', _ON_Q_DEVICE),
    ("flash_attn.reference.x__paged_rows", 'blocks = block_table[b, :nblk].to(device=device, dtype=None)', _BIG_CACHE),
    ("flash_attn.reference.x__paged_rows", 'blocks = block_table[b, :nblk].to(device=device, )', _BIG_CACHE),
    ("flash_attn.reference.x_fwd_kvcache", '"INF"', _INF),
    ("flash_attn.reference.x_fwd_kvcache", 'seqlens = cache_seqlens.to(device=None,', _ON_Q_DEVICE),
    ("flash_attn.reference.x_fwd_kvcache", 'seqlens = cache_seqlens.to(dtype=torch.int64)', _ON_Q_DEVICE),
    ("flash_attn.reference.x_fwd_kvcache", 'seqlens = cache_seqlens.to(device=device, dtype=None)', _INT32_IDS),
    ("flash_attn.reference.x_fwd_kvcache", 'seqlens = cache_seqlens.to(device=device, )', _INT32_IDS),
    ("flash_attn.reference.x_fwd_kvcache", 'cache_batch_idx.to(device=None,', _ON_Q_DEVICE),
    ("flash_attn.reference.x_fwd_kvcache", 'cache_batch_idx.to(dtype=torch.int64)', _ON_Q_DEVICE),
    ("flash_attn.reference.x_fwd_kvcache", 'cache_batch_idx.to(device=device, dtype=None)', _INT32_IDS),
    ("flash_attn.reference.x_fwd_kvcache", 'cache_batch_idx.to(device=device, )', _INT32_IDS),
    ("flash_attn.reference.x_fwd_kvcache", 'cache_leftpad.to(device=None,', _ON_Q_DEVICE),
    ("flash_attn.reference.x_fwd_kvcache", 'cache_leftpad.to(dtype=torch.int64)', _ON_Q_DEVICE),
    ("flash_attn.reference.x_fwd_kvcache", 'cache_leftpad.to(device=device, dtype=None)', _INT32_IDS),
    ("flash_attn.reference.x_fwd_kvcache", 'cache_leftpad.to(device=device, )', _INT32_IDS),
    ("flash_attn.reference.x_fwd_kvcache", 'block_table.to(device=None,', _ON_Q_DEVICE),
    ("flash_attn.reference.x_fwd_kvcache", 'block_table.to(dtype=torch.int64)', _ON_Q_DEVICE),
    ("flash_attn.reference.x_fwd_kvcache", 'block_table.to(device=device, dtype=None)', _INT32_IDS),
    ("flash_attn.reference.x_fwd_kvcache", 'block_table.to(device=device, )', _INT32_IDS),
    ("flash_attn.reference.x_fwd_kvcache", '] = k.to(None)', _SAME_DTYPE),
    ("flash_attn.reference.x_fwd_kvcache", '] = v.to(None)', _SAME_DTYPE),
    ("flash_attn.reference.x_fwd_kvcache", 'torch.arange(s_new, device=device).view(s_new)', _BROADCAST),
    ("flash_attn.reference.x_fwd_kvcache", 'torch.arange(Sq, device=device).view(Sq)', _BROADCAST),
    ("flash_attn.reference.x_fwd_kvcache", 'else torch.zeros(Sq, dtype=torch.int64,', _BROADCAST),
    ("flash_attn.reference.x_fwd_kvcache", 'else torch.zeros(1, dtype=torch.int64,',
     "without a causal/local mask every query row sits at one position: (B, 1) positions broadcast over the rows"),
    ("flash_attn.reference.x_fwd_kvcache", 'lse = torch.full((B, H, Sq), float("inf"), dtype=None', _FP32_DEFAULT),
    ("flash_attn.reference.x_fwd_kvcache", 'lse = torch.full((B, H, Sq), float("inf"), device=device)', _FP32_DEFAULT),
    ("flash_attn.reference.x_fwd_kvcache", '_fwd_plan(q[b:b + 1], kb, vb, plan, None)', "None is falsy like False"),
    ("flash_attn.reference.x_rotate_at", 'rd = cos.shape[+1] * 2', "cos is 2-D: dim 1 is dim -1"),
    ("flash_attn.reference.x_rotate_at", 'cos.to(None)[pos]', _FP32_ROTARY),
    ("flash_attn.reference.x_rotate_at", 'sin.to(None)[pos]', _FP32_ROTARY),
    ("flash_attn.reference.x_rotate_at", 'xr = x[..., :rd].to(None)', _FP32_ROTARY),
]


def mutated_line(workdir: Path, name: str) -> str:
    shown = subprocess.run(["mutmut", "show", name], cwd=workdir, capture_output=True, text=True).stdout
    for line in shown.splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            return line[1:].strip()
    return ""


def equivalent_reason(workdir: Path, name: str):
    line = None
    for function, piece, why in EQUIVALENT:
        if name.startswith(function + "__mutmut_"):
            line = mutated_line(workdir, name) if line is None else line
            if piece in line:
                return why
    return None


def export_head(dest: Path):
    """The committed tree (HEAD), so that edits in progress in the checkout do not enter a run."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def build_scratch(workdir: Path, suites, source: Path = ROOT):
    if workdir.exists():
        shutil.rmtree(workdir)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(source / "flash_attn", workdir / "flash_attn", ignore=ignore)
    for sub in ("ops", "modules", "models", "training"):
        shutil.copytree(source / sub, workdir / "flash_attn" / sub, ignore=ignore)
    shutil.copytree(source / "packages", workdir / "packages", ignore=ignore)
    shutil.copytree(source / "tests", workdir / "tests", ignore=ignore)
    shutil.copytree(source / "benchmarks", workdir / "benchmarks", ignore=shutil.ignore_patterns(
        "__pycache__", "*.pyc", "results"))
    shutil.copy2(source / "pyproject.toml", workdir / "pyproject.toml")
    files = [f for s in suites for f in SUITES[s][0]]
    tests = sorted({t for s in suites for t in SUITES[s][1]})
    lines = ["[mutmut]", "source_paths = flash_attn", "only_mutate ="] + [f"    {f}" for f in files]
    lines += ["tests_dir ="] + [f"    {t}" for t in tests]
    # a mutant's run includes pytest collecting its files (seconds for the large parametrized ones), which
    # mutmut's default allowance (1 s + 15x the tests' own time) mistakes for a hang
    # torch.compile cannot trace through mutmut's trampolines (they read a contextvar): compile tests are left out
    lines += ["timeout_constant = 30", "also_copy =", "    benchmarks", "pytest_add_cli_args =", "    -p",
              "    no:cacheprovider", "    -m", "    not gpu and not slow", "    -k", "    not compile"]
    lines += [""]
    (workdir / "setup.cfg").write_text("\n".join(lines))
    fence_gpu_launch(workdir)
    return files


def run_mutmut(workdir: Path, max_children: int):
    env = dict(os.environ)
    backends = [str(p) for p in sorted((workdir / "packages").glob("*")) if (p / "flash_attn").is_dir()]
    env["PYTHONPATH"] = os.pathsep.join(backends + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TRITON_INTERPRET", "1")
    # mutmut forks a child per mutant from a process that has run the tests: a forked child that finds the
    # parent's OpenMP pool can hang, so the parent never starts one
    env["OMP_NUM_THREADS"] = "1"
    subprocess.run(["mutmut", "run", "--max-children", str(max_children)], cwd=workdir, env=env, check=False)
    out = subprocess.run(["mutmut", "results", "--all", "true"], cwd=workdir, env=env, capture_output=True,
                         text=True, check=False)
    return out.stdout


RESULT = re.compile(r"^\s*(\S+__mutmut_\d+):\s*(\w[\w ]*)$")


def parse(results: str):
    rows = {}
    for line in results.splitlines():
        m = RESULT.match(line)
        if m:
            rows[m.group(1)] = m.group(2).strip()
    return rows


def module_of(mutant: str, files):
    for f in files:
        mod = f[:-3].replace("/", ".")
        if mutant.startswith(mod + "."):
            return f
    return "?"


def table(rows, files, workdir):
    per = {f: {"killed": 0, "survived": 0, "equivalent": 0, "no tests": 0, "timeout": 0, "other": 0}
           for f in files}
    survivors = []
    for name, status in sorted(rows.items()):
        f = module_of(name, files)
        bucket = per.setdefault(f, dict.fromkeys(per[files[0]], 0))
        if status == "killed":
            bucket["killed"] += 1
        elif status == "survived":
            if equivalent_reason(workdir, name) is not None:
                bucket["equivalent"] += 1
            else:
                bucket["survived"] += 1
                survivors.append(name)
        elif status == "no tests":
            bucket["no tests"] += 1
            survivors.append(name)
        elif status == "timeout":
            bucket["timeout"] += 1  # a mutant that hangs the tests counts as caught
        else:
            bucket["other"] += 1
    lines = ["| module | mutants | killed (incl. timeouts) | survived | no tests | equivalent | score |",
             "|---|---|---|---|---|---|---|"]
    for f, b in per.items():
        total = sum(b.values())
        judged = total - b["equivalent"] - b["other"]
        caught = b["killed"] + b["timeout"]
        score = f"{100.0 * caught / judged:.1f}%" if judged else "-"
        lines.append(f"| `{f}` | {total} | {caught} | {b['survived']} | {b['no tests']} | {b['equivalent']} |"
                     f" {score} |")
    return lines, survivors


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(SUITES), help="comma-separated suites: " + ", ".join(SUITES))
    p.add_argument("--workdir", default="/tmp/fa-mutation")
    p.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    p.add_argument("--out", default=None, help="markdown file for the table (default: print only)")
    p.add_argument("--worktree", action="store_true", help="mutate the checkout as it is, not the committed HEAD")
    args = p.parse_args(argv)
    suites = [s for s in args.only.split(",") if s]
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        p.error(f"--only: unknown suites {unknown}; choose from {sorted(SUITES)}")
    if shutil.which("mutmut") is None:
        sys.exit("mutmut is not installed: pip install mutmut")
    workdir = Path(args.workdir)
    if args.worktree:
        files = build_scratch(workdir, suites)
    else:
        head = workdir.with_name(workdir.name + "-head")
        if head.exists():
            shutil.rmtree(head)
        files = build_scratch(workdir, suites, export_head(head))
        shutil.rmtree(head)
    rows = parse(run_mutmut(workdir, args.max_children))
    lines, survivors = table(rows, files, workdir)
    report = "\n".join(lines)
    print(report)
    if survivors:
        print(f"\n{len(survivors)} survivors (`mutmut show NAME` in {workdir}):")
        print("\n".join(survivors))
    if args.out:
        date = datetime.date.today().isoformat()
        cmd = "python -m benchmarks.tools.mutation_score --only " + ",".join(suites)
        Path(args.out).write_text(f"# Mutation score ({date})\n\n`{cmd}` (mutmut, CPU tests)\n\n{report}\n")


if __name__ == "__main__":
    main()
