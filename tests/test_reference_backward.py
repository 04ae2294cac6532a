"""The backward tests' autograd reference (reference_backward.attention_grads)
agrees with the package's textbook float64 backward
(reference.attention_reference_grads) on CPU: two derivations, one answer."""
import pytest
import torch

from hopper_flash.reference import attention_reference_grads
from hopper_flash.reference_backward import attention_grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,h,hkv", [(17, 17, 2, 2), (33, 9, 4, 2), (5, 40, 4, 1), (1, 1, 2, 2)])
def test_autograd_reference_matches_textbook_backward(sq, sk, h, hkv, causal):
    gen = torch.Generator().manual_seed(sq * 100 + sk)
    q = torch.randn(2, sq, h, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, sk, hkv, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(2, sk, hkv, 16, generator=gen, dtype=torch.float64)
    do = torch.randn(2, sq, h, 16, generator=gen, dtype=torch.float64)
    ours = attention_grads(q, k, v, do, 0.3, causal)
    theirs = attention_reference_grads(q, k, v, do, causal=causal, softmax_scale=0.3)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    if causal and sq > sk:  # rows that see no key
        assert (ours[0][:, :sq - sk] == 0).all()
