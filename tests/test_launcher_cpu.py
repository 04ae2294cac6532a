"""``launcher.KernelLaunch``'s direct call on the CPU, against the installed
triton's own launch path.

Triton's ``CudaLauncher`` is built by hand around the installed version's
real descriptor wrapper (``wrap_handle_tensordesc``), with a recording
stand-in for the compiled C launch function and for the driver's TMA
descriptor encoder. The direct call must hand the C function exactly what
Triton's path hands it (tensors as their addresses, which both C launchers
read the same way), and must encode a descriptor only when its address,
shape or strides are new. The GPU half, the two launches agreeing bit for
bit, is tests/test_launch_gpu.py.
"""
from types import SimpleNamespace

import pytest
import torch
from triton.backends.nvidia import driver as nvidia_driver
from triton.runtime import driver as runtime_driver

from hopper_flash import _triton_support, launcher

MINOR = _triton_support.parse_minor(_triton_support.installed_version())
pytestmark = pytest.mark.skipif(MINOR not in _triton_support.DIRECT_LAUNCH_MINORS,
                                reason=f"no direct launch on triton {MINOR}")

# A forward-like kernel: two descriptors, two pointers, an int, a float, a constexpr.
SIGNATURE = {"q_desc": "tensordesc<bf16[1, 64, 1, 128]>", "k_desc": "tensordesc<bf16[1, 128, 1, 128]>",
             "lse_ptr": "*fp32", "o_ptr": "*bf16", "n": "i32", "scale": "fp32", "BLOCK": "constexpr"}
META = [{"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [1, 64, 1, 128], "fp4_padded": False},
        {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [1, 128, 1, 128], "fp4_padded": False}]


def _plain(x):
    """Sequences as tuples, tensors as their addresses: how the C side reads them."""
    if isinstance(x, torch.Tensor):
        return x.data_ptr()
    if isinstance(x, (list, tuple, torch.Size)):
        return tuple(_plain(a) for a in x)
    return x


class FakeUtils:
    """The driver's TMA encoders: a "map" that records what it was built from."""

    def __init__(self):
        self.fills = 0

    def fill_tma_descriptor(self, *args):
        self.fills += 1
        return ("map", _plain(args))

    fill_tma_descriptor_tiled = fill_tma_descriptor


class CLaunch:
    """The compiled C launch function (a builtin, not a Python closure): records its arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(_plain(args))


@pytest.fixture
def fake(monkeypatch):
    utils = FakeUtils()
    monkeypatch.setattr(runtime_driver, "_active", SimpleNamespace(utils=utils))
    c_launch = CLaunch()
    calls = c_launch.calls
    run = nvidia_driver.CudaLauncher.__new__(nvidia_driver.CudaLauncher)
    run.launch = nvidia_driver.wrap_handle_tensordesc(c_launch, dict(SIGNATURE), META)
    run.num_ctas = 1
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = 1
    run.launch_cooperative_grid = run.launch_pdl = False
    if MINOR >= (3, 7):
        run.arg_annotations, run.kernel_signature = "annotations", "signature"
        run.gsan_enabled = False
    compiled = SimpleNamespace(run=run, function=1234, packed_metadata=(4, 1, 1000),
                               metadata=SimpleNamespace(tensordesc_meta=META))
    return SimpleNamespace(compiled=compiled, calls=calls, utils=utils, run=run)


def _tensors(seqlen=300):
    q = torch.randn(2, seqlen, 4, 128).to(torch.bfloat16)
    k = torch.randn(2, seqlen + 7, 1, 128).to(torch.bfloat16)  # an extent-1 axis: tma_strides rewrites it
    return q, k, torch.empty(2, 4, seqlen), torch.empty_like(q)


def _triton_launch(fake, q, k, lse, out, n=300):
    fake.run(132, 1, 1, 7, fake.compiled.function, fake.compiled.packed_metadata, None, None, None,
             launcher.TmaArg(q), launcher.TmaArg(k), lse, out, n, 0.125, 64)


def test_direct_call_hands_the_c_launcher_what_triton_does(fake):
    kl = launcher.KernelLaunch(fake.compiled)
    assert kl.direct is not None
    q, k, lse, out = _tensors()
    _triton_launch(fake, q, k, lse, out)
    kl((132, 1, 1), 7, (q, k), (lse, out, 300, 0.125, 64))
    assert len(fake.calls) == 2
    assert fake.calls[1] == fake.calls[0]
    assert fake.utils.fills == 4  # one per descriptor per path


def test_descriptors_are_encoded_once_per_address_shape_and_strides(fake):
    kl = launcher.KernelLaunch(fake.compiled)
    q, k, lse, out = _tensors()
    for _ in range(3):
        kl((132, 1, 1), 7, (q, k), (lse, out, 300, 0.125, 64))
    assert fake.utils.fills == 2
    # A view at another address, and another shape at the same address, are new.
    kl((132, 1, 1), 7, (q[:, 1:], k), (lse, out, 299, 0.125, 64))
    kl((132, 1, 1), 7, (q[:, :100], k), (lse, out, 100, 0.125, 64))
    assert fake.utils.fills == 4
    # Each of those matches Triton's own encoding.
    _triton_launch(fake, q[:, :100], k, lse, out, 100)
    assert fake.calls[-1] == fake.calls[-2]


def test_the_cache_starts_over_at_its_limit(fake, monkeypatch):
    monkeypatch.setattr(launcher, "DESCRIPTOR_CACHE_LIMIT", 3)
    kl = launcher.KernelLaunch(fake.compiled)
    q, k, lse, out = _tensors()
    for start in range(4):
        kl((132, 1, 1), 7, (q[:, start:], k), (lse, out, 300, 0.125, 64))
    assert len(kl._descriptors) <= 3


def test_no_direct_call_where_the_convention_is_not_known(fake):
    fake.run.global_scratch_size = 128  # Triton would allocate scratch
    assert launcher.KernelLaunch(fake.compiled).direct is None
    fake.run.global_scratch_size = 0
    fake.compiled.metadata.tensordesc_meta = [None, None]  # descriptors not described
    assert launcher.KernelLaunch(fake.compiled).direct is None
    # A stand-in kernel without Triton's launcher (the other CPU tests' fakes).
    logged = []
    stand_in = SimpleNamespace(run=lambda *a: logged.append(a), function=1, packed_metadata=2)
    kl = launcher.KernelLaunch(stand_in)
    assert kl.direct is None
    q, k, lse, out = _tensors()
    kl((5, 1, 1), 7, (q, k), (lse, out, 300, 0.125, 64))
    (args,) = logged
    assert args[:9] == (5, 1, 1, 7, 1, 2, None, None, None)
    assert isinstance(args[9], launcher.TmaArg) and args[9].base is q and args[11] is lse
