"""The Triton backend's fast relaunch (flash_attn/triton/_launch.py): its cache key must change whenever
Triton would specialise a kernel differently, so a compiled kernel is never reused for arguments it was
not compiled for. Runs on CPU: the key is computed from tensors' addresses, dtypes and int values, and the
launcher's first/second-call logic is driven with a fake kernel (no GPU launch)."""
import types

import pytest
import torch

triton = pytest.importorskip("triton")

from flash_attn.triton import _launch  # noqa: E402

# A kernel signature like the forward's: pointers, then specialised ints (strides, head counts),
# unspecialised ints (lengths, seeds) and floats.
DNS = [False, False, False, False, False, False, True, True, False]


def _args(t0=None, t1=None, stride=128, heads=16, seqlen=100, seed=7, scale=0.125):
    t0 = torch.empty(64, dtype=torch.float16) if t0 is None else t0
    t1 = torch.empty(64, dtype=torch.float32) if t1 is None else t1
    return (t0, t1, stride, 2 * stride, heads, 1, seqlen, seed, scale)


def _key(args):
    layout = _launch.learn_layout(args, DNS)
    return _launch.spec_key(layout, args)[1]


def test_layout_learnt_from_arguments():
    layout = _launch.learn_layout(_args(), DNS)
    assert layout.kinds == ("p", "p", "i", "i", "i", "i", "i", "i", "f")
    assert layout.n_ptr == 2
    assert layout.spec(_args()) == (128, 256, 16, 1)
    assert layout.plain(_args()) == (100, 7)
    # None (a constexpr for Triton), bools and pointers after scalars are left to Triton's own path
    assert _launch.learn_layout((*_args()[:-1], None), DNS) is None
    assert _launch.learn_layout((*_args()[:-1], True), DNS) is None
    a = _args()
    assert _launch.learn_layout((a[2], a[0], *a[1:2], *a[3:]), DNS) is None


def test_same_kind_of_call_same_key():
    assert _key(_args()) == _key(_args())
    # unspecialised ints (lengths, seeds) and floats do not enter the key while they stay i32
    assert _key(_args(seqlen=5, seed=123456, scale=3.0)) == _key(_args())


@pytest.mark.parametrize("change", [
    dict(stride=136),          # still divisible by 16 ... and by 8: another value, another key
    dict(stride=100),          # no longer divisible by 16
    dict(stride=1),            # == 1 (Triton turns it into a constant)
    dict(heads=1),
    dict(heads=17),
    dict(stride=1 << 31),      # i64 instead of i32
    dict(seqlen=1 << 31),      # unspecialised, but i64 instead of i32
    dict(seed=-(1 << 31) - 1),
    dict(seed=1 << 63),        # u64
])
def test_specialisation_change_changes_key(change):
    assert _key(_args(**change)) != _key(_args())


def test_pointer_alignment_and_dtype_change_key():
    flat = torch.empty(65, dtype=torch.float16)
    aligned = flat[:64] if flat.data_ptr() % 16 == 0 else flat[1:]
    misaligned = flat[1:] if aligned.data_ptr() == flat.data_ptr() else flat[:64]
    assert aligned.data_ptr() % 16 == 0 and misaligned.data_ptr() % 16 == 2
    base = _key(_args(t0=aligned))
    assert _key(_args(t0=misaligned)) != base
    assert _key(_args(t0=torch.empty(64, dtype=torch.bfloat16))) != base
    assert _key(_args(t0=aligned.clone())) == base  # another aligned buffer: same kernel
    # the key's pointer part is the addresses handed to the launcher
    ptrs, _ = _launch.spec_key(_launch.learn_layout(_args(t0=misaligned), DNS), _args(t0=misaligned))
    assert ptrs[0] == misaligned.data_ptr()


def test_key_is_a_superset_of_tritons_specialisation():
    # Whenever Triton's own binder types or specialises two calls differently, the keys differ.
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    def triton_spec(args):
        return tuple(native_specialize_impl(BaseBackend, a, False, not dns, True)
                     for a, dns in zip(args, DNS))

    flat = torch.empty(200, dtype=torch.float16)
    variants = [_args()]
    for off in (0, 1, 8):
        for stride in (1, 2, 16, 48, 100, 1 << 31, (1 << 31) + 16):
            for heads in (1, 3, 32):
                for seqlen in (0, 1, 17, 1 << 31, -(1 << 40)):
                    variants.append(_args(t0=flat[off:off + 64], stride=stride, heads=heads, seqlen=seqlen))
    keys = [_key(a) for a in variants]
    specs = [triton_spec(a) for a in variants]
    for i in range(len(variants)):
        for j in range(i + 1, len(variants)):
            if specs[i] != specs[j]:
                assert keys[i] != keys[j], (variants[i][2:], variants[j][2:])


class _FakeCompiled:
    def __init__(self, log):
        self.function = 1234
        self.packed_metadata = (4, 1, 0)
        self.run = lambda *a: log.append(("fast", a))


class _FakeKernel:
    """Stands in for a JITFunction: kernel[grid](*args, **meta) records a 'slow' launch."""

    def __init__(self, n_args, dns, constexprs=("BLOCK",)):
        P = types.SimpleNamespace
        self.params = ([P(is_constexpr=False, do_not_specialize=d, name=f"a{i}", has_default=False,
                          annotation_type="")
                        for i, d in enumerate(dns)]
                       + [P(is_constexpr=True, do_not_specialize=False, name=n, has_default=False)
                          for n in constexprs])
        self.device_caches = {}
        self.pre_run_hooks = []
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.log.append(("slow", args))
            return _FakeCompiled(self.log)
        return launch


@pytest.fixture
def fake_launcher(monkeypatch):
    monkeypatch.setattr(_launch, "_INTERPRET", False)
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_current_stream", lambda device: 99)
    kernel = _FakeKernel(len(DNS), DNS)
    launcher = _launch.Launcher(kernel)
    if not launcher.enabled:
        pytest.skip("this Triton has no knobs/driver internals: the fast path is off")
    return launcher, kernel.log


def test_launcher_relaunches_compiled_kernel_and_respecialises(fake_launcher):
    launcher, log = fake_launcher
    meta = dict(BLOCK=64, num_warps=4)
    plan = object()
    args = _args()
    launcher((3, 2), args, meta, plan)
    launcher((3, 2), args, meta, plan)
    assert [kind for kind, _ in log] == ["slow", "fast"]
    fast = log[-1][1]
    # grid, stream, function, packed metadata, no launch metadata or hooks, addresses, scalars, constexprs
    assert fast[:9] == (3, 2, 1, 99, 1234, (4, 1, 0), None, None, None)
    assert fast[9:] == (args[0].data_ptr(), args[1].data_ptr(), *args[2:], 64)
    launcher((3, 2), _args(seqlen=999), meta, plan)  # unspecialised change: still fast
    assert log[-1][0] == "fast"
    for change in (dict(stride=100), dict(heads=1), dict(seqlen=1 << 33)):
        n = len(log)
        launcher((3, 2), _args(**change), meta, plan)
        launcher((3, 2), _args(**change), meta, plan)
        assert [kind for kind, _ in log[n:]] == ["slow", "fast"], change
    launcher((3, 2), _args(), dict(BLOCK=32, num_warps=4), object())  # another plan: Triton's path first
    assert log[-1][0] == "slow"


def test_launcher_leaves_unfit_calls_and_hooks_to_triton(fake_launcher, monkeypatch):
    launcher, log = fake_launcher
    meta = dict(BLOCK=64, num_warps=4)
    plan = object()
    launcher((1,), _args(), meta, plan)
    launcher((1,), (5, *_args()[1:]), meta, plan)  # not a tensor where a pointer was
    assert log[-1][0] == "slow"
    kernel = launcher.kernel
    kernel.pre_run_hooks.append(lambda *a, **k: None)
    launcher((1,), _args(), meta, plan)
    assert log[-1][0] == "slow"
    kernel.pre_run_hooks.clear()
    rt = types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[print]), launch_exit_hook=None)
    monkeypatch.setattr(_launch, "_knobs", types.SimpleNamespace(runtime=rt))
    launcher((1,), _args(), meta, plan)
    assert log[-1][0] == "slow"
    rt.launch_enter_hook.calls.clear()
    launcher((1,), _args(), meta, plan)
    assert log[-1][0] == "fast"
    rt.launch_exit_hook = print  # an old-style (callable) hook
    launcher((1,), _args(), meta, plan)
    assert log[-1][0] == "slow"


def test_interpreter_takes_tritons_path():
    from flash_attn.triton import backend as tb

    if not tb._INTERPRET:
        pytest.skip("kernels are compiled here, not interpreted")
    tb._kernels()
    assert not tb._L_FWD.enabled and not tb._L_DKDV.enabled


# ----------------------------------------------------------------------------- None pointer arguments
def _nkey(args, nullable=None):
    layout = _launch.learn_layout(args, DNS, nullable)
    return layout.key(layout, args)


def test_layout_learnt_with_nones():
    a = _args()
    layout = _launch.learn_layout((a[0], None, *a[2:]), DNS)
    assert layout.kinds == ("p", "n", "i", "i", "i", "i", "i", "i", "f")
    assert layout.base == _launch.learn_layout(a, DNS).base
    assert layout.n_ptr == 2 and layout.nulls and layout.key is _launch.spec_key_nulls
    assert layout.spec(a) == (128, 256, 16, 1) and layout.plain(a) == (100, 7)
    assert _launch.learn_layout(a, DNS).key is _launch.spec_key  # all tensors: the lean key
    # a None may lead the pointers; None only where the parameter may take one (no type annotation)
    assert _launch.learn_layout((None, *a[1:]), DNS).kinds[:2] == ("n", "p")
    assert _launch.learn_layout((a[0], None, *a[2:]), DNS, [True, False] + [True] * 7) is None
    # None after the scalars, or a tensor after a scalar, is still left to Triton
    assert _launch.learn_layout((*a[:-1], None), DNS) is None
    assert _launch.learn_layout((a[0], a[2], a[1], *a[3:]), DNS) is None


def test_none_pattern_is_part_of_the_key():
    a = _args()
    t0, t1 = a[0], a[1]
    calls = {
        "both": (t0, t1, *a[2:]),
        "no_t1": (t0, None, *a[2:]),
        "no_t0": (None, t1, *a[2:]),
        "none": (None, None, *a[2:]),
        "no_t1_as_f16": (t0, t0, *a[2:]),  # a tensor of t0's dtype in t1's place
    }
    nulls = _launch.Layout(_launch.learn_layout(a, DNS).kinds, 2, DNS, nulls=True)
    keys = {name: nulls.key(nulls, args)[1] for name, args in calls.items()}
    assert len(set(keys.values())) == len(keys), keys
    # the addresses passed on hold None where the call has None
    ptrs, _ = nulls.key(nulls, calls["no_t0"])
    assert ptrs == (None, t1.data_ptr())
    # for an all-tensor call the None-aware key is spec_key's (entries survive a layout upgrade)
    assert nulls.key(nulls, calls["both"]) == _launch.spec_key(_launch.learn_layout(a, DNS), a)
    # a tensor where the lean layout had none raises (-> Triton's path), as does a None where it had one
    with pytest.raises((TypeError, AttributeError)):
        _launch.spec_key(_launch.learn_layout(a, DNS), calls["no_t1"])
    layout = _launch.learn_layout(calls["no_t1"], DNS)
    with pytest.raises((TypeError, AttributeError)):
        layout.key(layout, (t0, 5, *a[2:]))
    # the rest of the key still follows specialisation and alignment
    assert _nkey((t0, None, *a[2:]))[1] == _nkey((t0.clone(), None, *a[2:]))[1]
    assert _nkey((t0, None, *_args(stride=100)[2:]))[1] != keys["no_t1"]
    flat = torch.empty(65, dtype=torch.float16)
    mis = flat[1:] if flat.data_ptr() % 16 == 0 else flat[:64]
    assert _nkey((mis, None, *a[2:]))[1] != keys["no_t1"]


def test_launcher_relaunches_with_nones(fake_launcher):
    launcher, log = fake_launcher
    meta = dict(BLOCK=64, num_warps=4)
    plan = object()
    a = _args()
    no_t1 = (a[0], None, *a[2:])
    launcher((5,), no_t1, meta, plan)
    launcher((5,), no_t1, meta, plan)
    assert [kind for kind, _ in log] == ["slow", "fast"]
    fast = log[-1][1]
    assert fast[:9] == (5, 1, 1, 99, 1234, (4, 1, 0), None, None, None)
    assert fast[9:] == (a[0].data_ptr(), None, *a[2:], 64)  # None passed where Triton passes it
    # a tensor where the cached call had None: another kernel, so Triton's path first, then fast
    n = len(log)
    launcher((5,), a, meta, plan)
    launcher((5,), a, meta, plan)
    assert [kind for kind, _ in log[n:]] == ["slow", "fast"]
    assert log[-1][1][9:11] == (a[0].data_ptr(), a[1].data_ptr())
    n = len(log)
    launcher((5,), (None, a[1], *a[2:]), meta, plan)
    launcher((5,), (None, a[1], *a[2:]), meta, plan)
    launcher((5,), no_t1, meta, plan)
    assert [kind for kind, _ in log[n:]] == ["slow", "fast", "fast"]
    assert log[-2][1][9:11] == (None, a[1].data_ptr())
    assert log[-1][1][9:11] == (a[0].data_ptr(), None)


def test_launcher_learns_nones_after_tensors(fake_launcher):
    launcher, log = fake_launcher
    meta = dict(BLOCK=64, num_warps=4)
    plan = object()
    a = _args()
    no_t1 = (a[0], None, *a[2:])
    launcher((5,), a, meta, plan)
    launcher((5,), a, meta, plan)
    assert launcher.layouts[plan].key is _launch.spec_key
    launcher((5,), no_t1, meta, plan)  # None where the plan had a tensor: Triton's path ...
    assert log[-1][0] == "slow"
    assert launcher.layouts[plan].key is _launch.spec_key_nulls  # ... and the plan keys on Nones now
    launcher((5,), no_t1, meta, plan)
    launcher((5,), a, meta, plan)  # the entry of the all-tensor call is still found
    assert [kind for kind, _ in log] == ["slow", "fast", "slow", "fast", "fast"]
    assert log[-2][1][9:11] == (a[0].data_ptr(), None)
    assert log[-1][1][9:11] == (a[0].data_ptr(), a[1].data_ptr())
    # None where a scalar belongs does not fit the plan
    launcher((5,), (*a[:2], None, *a[3:]), meta, plan)
    launcher((5,), (*a[:2], None, *a[3:]), meta, plan)
    assert [kind for kind, _ in log[-2:]] == ["slow", "slow"]


def test_annotated_pointer_takes_nones_to_triton(fake_launcher):
    launcher, log = fake_launcher
    launcher.kernel.params[1].annotation_type = "*fp32"  # Triton types such a None by its annotation
    launcher = _launch.Launcher(launcher.kernel)
    meta = dict(BLOCK=64, num_warps=4)
    plan = object()
    a = _args()
    for _ in range(2):
        launcher((5,), (a[0], None, *a[2:]), meta, plan)
    assert launcher.layouts[plan] is None  # a plan whose first call had such a None is left to Triton
    plan = object()
    launcher((5,), a, meta, plan)
    launcher((5,), a, meta, plan)
    launcher((5,), (a[0], None, *a[2:]), meta, plan)
    launcher((5,), (a[0], None, *a[2:]), meta, plan)
    assert [kind for kind, _ in log] == ["slow", "slow", "slow", "fast", "slow", "slow"]
    assert launcher.layouts[plan].key is _launch.spec_key


def test_triton_makes_none_a_constexpr():
    # What the None support relies on: Triton's binder types a None argument (of a parameter without an
    # annotation) as a constexpr, specialised or not, and compiles a kernel for it.
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    for specialize in (True, False):
        assert native_specialize_impl(BaseBackend, None, False, specialize, True) == ("constexpr", None)


def test_rocm_takes_tritons_path_every_call(monkeypatch):
    # On a ROCm build of torch the fast path is off: each launch goes through Triton's own binder.
    monkeypatch.setattr(_launch, "_INTERPRET", False)
    monkeypatch.setattr(_launch, "_HIP", True)
    kernel = _FakeKernel(len(DNS), DNS)
    launcher = _launch.Launcher(kernel)
    assert not launcher.enabled
    args, plan = _args(), object()
    for _ in range(3):
        launcher((3, 2), args, dict(BLOCK=64, num_warps=4), plan)  # the same plan: relaunched fast elsewhere
    assert [kind for kind, _ in kernel.log] == ["slow"] * 3


def test_amd_backend_specialises_on_storage_size():
    # Why ROCm has no fast path: Triton's AMD backend marks a tensor whose storage fits 2 GiB for 32-bit buffer
    # offsets, a specialisation the key does not hold (a kernel compiled for a small tensor would address a
    # larger one wrongly).
    amd = pytest.importorskip("triton.backends.amd.compiler")
    from triton import knobs

    if not knobs.amd.use_buffer_ops:
        pytest.skip("AMDGCN_USE_BUFFER_OPS is off in this environment")
    small = torch.empty(64, dtype=torch.float16)
    big = types.SimpleNamespace(data_ptr=small.data_ptr, dtype=small.dtype, ptr_range=lambda: 1 << 32)
    spec = amd.HIPBackend.get_tensor_specialization
    assert "S" in spec(small, align=True) and "S" not in spec(big, align=True)
    assert _key(_args(t0=small)) == _key(_args(t0=torch.empty(1 << 20, dtype=torch.float16)[:64]))


# ----------------------------------------------------------------------------- out of shared memory
class _SmemBoundKernel(_FakeKernel):
    """A kernel whose launch needs more shared memory than the GPU has above ``fits`` pipeline stages."""

    def __init__(self, fits, **kw):
        super().__init__(len(DNS), DNS, **kw)
        self.fits = fits
        self.stages_tried = []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            stages = meta.get("num_stages", 3)  # Triton's default on NVIDIA
            self.stages_tried.append(stages)
            if stages > self.fits:
                raise _launch.OutOfResources(50000 * stages, 101376, "shared memory")
            self.log.append(("slow", args))
            return _FakeCompiled(self.log)
        return launch


@pytest.mark.parametrize("fast_path", [True, False])
def test_a_launch_out_of_shared_memory_runs_with_fewer_stages(monkeypatch, fast_path):
    monkeypatch.setattr(_launch, "_INTERPRET", not fast_path)
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_current_stream", lambda device: 99)
    kernel = _SmemBoundKernel(fits=2)
    launcher = _launch.Launcher(kernel)
    if fast_path and not launcher.enabled:
        pytest.skip("this Triton has no knobs/driver internals: the fast path is off")
    plan = object()
    with pytest.warns(RuntimeWarning, match="num_stages=2 instead of 3"):
        launcher((1,), _args(), dict(BLOCK=64, num_warps=4, num_stages=4), plan)
    assert kernel.stages_tried == [4, 3, 2]
    assert launcher.stages[plan] == 2
    # the plan remembers what fit: the next launch does not try the larger counts again
    launcher((1,), _args(stride=100), dict(BLOCK=64, num_warps=4, num_stages=4), plan)
    assert kernel.stages_tried[3:] == [2]
    if fast_path:
        launcher((1,), _args(), dict(BLOCK=64, num_warps=4, num_stages=4), plan)
        assert kernel.log[-1][0] == "fast"


def test_a_launch_that_does_not_fit_with_one_stage_raises(monkeypatch):
    monkeypatch.setattr(_launch, "_INTERPRET", True)
    kernel = _SmemBoundKernel(fits=0)
    launcher = _launch.Launcher(kernel)
    with pytest.warns(RuntimeWarning), pytest.raises(_launch.OutOfResources, match="shared memory"):
        launcher((1,), _args(), dict(BLOCK=64, num_warps=4, num_stages=2), object())
    assert kernel.stages_tried == [2, 1]
    with pytest.raises(_launch.OutOfResources):  # no stage count to lower: Triton's error as it is
        launcher((1,), _args(), dict(BLOCK=64, num_warps=4), object())
