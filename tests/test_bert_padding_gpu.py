"""flash-attn's unpad -> varlen -> pad workflow through ``hopper_flash.bert_padding``
on a Hopper GPU: a padded batch (left and right padding, an empty row), its
padding filled with NaN, unpadded, attended by ``flash_attn_varlen_func`` and
padded back. Each prompt's live part is judged against the float64 reference
of that prompt alone (``reference.check_attention``), the padding must come
back exactly 0, and the gradients reach only the live positions."""
import pytest
import torch

import hopper_flash
from hopper_flash.bert_padding import pad_input, unpad_input
from hopper_flash.reference import check_attention, check_attention_grads
from gpu_inputs import rnd

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _mask(spans, seqlen):
    """``[batch, seqlen]`` bool: row b live over ``spans[b] = (start, stop)``."""
    mask = torch.zeros(len(spans), seqlen, dtype=torch.bool, device=DEV)
    for b, (start, stop) in enumerate(spans):
        mask[b, start:stop] = True
    return mask


SPANS = [(0, 300), (211, 1000), (0, 1000), (0, 0), (999, 1000), (0, 129)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_unpad_varlen_pad_matches_each_prompt_alone(causal):
    seqlen, h, hkv, d = 1000, 8, 2, 128
    mask = _mask(SPANS, seqlen)
    q, k, v = (rnd(len(SPANS), seqlen, n, d, seed=i) for i, n in enumerate((h, hkv, hkv)))
    for t in (q, k, v):
        t[~mask] = float("nan")
    q_thd, indices, cu, max_seqlen, seqused = unpad_input(q, mask)
    k_thd, v_thd = unpad_input(k, mask)[0], unpad_input(v, mask)[0]
    assert max_seqlen == 1000 and seqused.tolist() == [b - a for a, b in SPANS]
    out = pad_input(hopper_flash.flash_attn_varlen_func(q_thd, k_thd, v_thd, cu, cu, max_seqlen, max_seqlen,
                                                        causal=causal), indices, len(SPANS), seqlen)
    assert out.shape == q.shape and (out[~mask] == 0).all()
    for b, (start, stop) in enumerate(SPANS):
        if stop > start:
            part = slice(start, stop)
            verdicts = check_attention(out[b:b + 1, part], q[b:b + 1, part], k[b:b + 1, part], v[b:b + 1, part],
                                       causal=causal, name=f"prompt {b}")
            assert all(verdicts), "\n".join(x.message for x in verdicts)


def test_gradients_through_the_padding_helpers():
    seqlen, h, d = 400, 4, 64
    spans = [(0, 400), (37, 400), (0, 1), (0, 258)]
    mask = _mask(spans, seqlen)
    q, k, v = (rnd(len(spans), seqlen, h, d, seed=10 + i) for i in range(3))
    for t in (q, k, v):
        t[~mask] = float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dout = rnd(len(spans), seqlen, h, d, seed=20)
    q_thd, indices, cu, max_seqlen, _ = unpad_input(q, mask)
    k_thd, v_thd = unpad_input(k, mask)[0], unpad_input(v, mask)[0]
    out = pad_input(hopper_flash.flash_attn_varlen_func(q_thd, k_thd, v_thd, cu, cu, max_seqlen, max_seqlen,
                                                        causal=True), indices, len(spans), seqlen)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for g in (dq, dk, dv):
        assert (g[~mask] == 0).all()
    for b, (start, stop) in enumerate(spans):
        part = slice(start, stop)
        verdicts = check_attention_grads(
            (dq[b:b + 1, part], dk[b:b + 1, part], dv[b:b + 1, part]),
            q[b:b + 1, part].detach(), k[b:b + 1, part].detach(), v[b:b + 1, part].detach(),
            dout[b:b + 1, part], causal=True)
        assert all(verdicts), "\n".join(x.message for x in verdicts)
