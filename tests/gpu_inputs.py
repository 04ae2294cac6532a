"""Inputs the GPU test files share: seeded random tensors on the GPU and
varlen prefix sums (imported as ``from gpu_inputs import ...``, as
``launch_fakes`` is)."""
import torch

DEV = "cuda"


def rnd(*shape, dtype=torch.bfloat16, seed=0, magnitude=1.0):
    """A standard normal tensor of ``shape`` times ``magnitude`` in ``dtype``,
    drawn on the GPU from its own generator seeded with ``seed``."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=gen) * magnitude).to(dtype)


def cu(lengths):
    """int32 prefix sums ``[0, l0, l0 + l1, ...]`` on the GPU (``cu_seqlens``)."""
    return torch.tensor([0] + list(lengths), device=DEV).cumsum(0).to(torch.int32)
