"""``hopper_flash.bert_padding`` (flash-attn's padding helpers) on the CPU.
Expectations are written out by hand or built row by row from the mask,
never from the functions under test."""
import pytest
import torch

from hopper_flash.bert_padding import (
    index_first_axis,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)


def _hidden(batch, seqlen, *rest, seed=0):
    return torch.randn(batch, seqlen, *rest, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.int64])
def test_unpad_right_and_left_padding(dtype):
    mask = torch.tensor([[1, 1, 0, 0],    # right padding
                         [0, 0, 1, 1],    # left padding
                         [1, 1, 1, 1],
                         [0, 0, 0, 0]]).to(dtype)  # an empty row
    x = _hidden(4, 4, 3, 5)
    got, indices, cu, max_seqlen, seqused = unpad_input(x, mask)
    assert indices.tolist() == [0, 1, 6, 7, 8, 9, 10, 11]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 4, 8, 8]
    assert max_seqlen == 4 and isinstance(max_seqlen, int)
    assert seqused.dtype == torch.int32 and seqused.tolist() == [2, 2, 4, 0]
    want = torch.stack([x[0, 0], x[0, 1], x[1, 2], x[1, 3], x[2, 0], x[2, 1], x[2, 2], x[2, 3]])
    assert torch.equal(got, want)


def test_unpad_with_unused_slots():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    x = _hidden(2, 4, 6)
    got, indices, cu, max_seqlen, seqused = unpad_input(x, mask, unused)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6, 7]
    assert cu.tolist() == [0, 3, 7] and max_seqlen == 4 and seqused.tolist() == [2, 1]
    assert torch.equal(got, x.reshape(8, 6)[[0, 1, 2, 4, 5, 6, 7]])


def test_pad_input_inverts_unpad_with_zeros_at_the_padding():
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(5, 37, generator=g) < 0.6
    x = _hidden(5, 37, 4, 8, seed=1)
    got, indices, *_ = unpad_input(x, mask)
    back = pad_input(got, indices, 5, 37)
    assert back.shape == x.shape
    assert torch.equal(back, torch.where(mask[:, :, None, None], x, torch.zeros(())))


def test_pad_input_of_a_vector_per_token():
    indices = torch.tensor([3, 0])
    assert pad_input(torch.tensor([7.0, 9.0]), indices, 2, 2).tolist() == [[9.0, 0.0], [0.0, 7.0]]


def test_gradients_scatter_back_to_the_selected_positions():
    x = _hidden(3, 5, 2).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 1, 0, 1]], dtype=torch.bool)
    got, indices, *_ = unpad_input(x, mask)
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(5))
    (got * w).sum().backward()
    want = torch.zeros_like(x)
    row = 0
    for b in range(3):
        for s in range(5):
            if mask[b, s]:
                want[b, s] = w[row]
                row += 1
    assert torch.equal(x.grad, want)

    # pad_input's gradient reads the selected positions back.
    vals = got.detach().clone().requires_grad_()
    up = torch.randn(3, 5, 2, generator=torch.Generator().manual_seed(6))
    (pad_input(vals, indices, 3, 5) * up).sum().backward()
    assert torch.equal(vals.grad, up[mask])


def test_index_helpers_by_hand():
    x = torch.arange(12.0).reshape(4, 3)
    assert index_first_axis(x, torch.tensor([2, 0], dtype=torch.int32)).tolist() == [[6, 7, 8], [0, 1, 2]]
    put = index_put_first_axis(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([3, 1]), 4)
    assert put.tolist() == [[0, 0], [3, 4], [0, 0], [1, 2]]


def test_unpad_concatenated_sequences_flash_attn_example():
    # flash-attn's docstring example: rows of 6 holding sequences 2+3, 3+2 and 6.
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    x = _hidden(3, 6, 4)
    got, indices, cu, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 8, 10, 16] and max_seqlen == 6
    assert torch.equal(got, x.reshape(18, 4)[indices])


def test_compiled_pad_and_index():
    x = _hidden(6, 4)
    indices = torch.tensor([5, 1, 2])

    def f(t):
        return pad_input(index_first_axis(t, indices), indices, 2, 3)

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    want = torch.zeros(6, 4)
    want[[5, 1, 2]] = x[[5, 1, 2]]
    assert torch.equal(got, want.reshape(2, 3, 4))


@pytest.mark.parametrize("call,match", [
    (lambda: unpad_input(torch.zeros(2, 3, 4), torch.ones(2, 4)), "attention_mask must be \\[batch, seqlen\\]"),
    (lambda: unpad_input(torch.zeros(2, 3, 4), torch.ones(2, 3)), "attention_mask must be bool or an integer"),
    (lambda: unpad_input(torch.zeros(3), torch.ones(1, 3, dtype=torch.bool)), "hidden_states must have at least 2"),
    (lambda: unpad_input(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.ones(3, 2, dtype=torch.bool)),
     "unused_mask must be"),
    (lambda: unpad_input("x", torch.ones(2, 3)), "hidden_states must be a torch.Tensor"),
    (lambda: pad_input(torch.zeros(2, 4), torch.tensor([0.0, 1.0]), 1, 2), "indices must have dtype int64 or int32"),
    (lambda: pad_input(torch.zeros(2, 4), torch.tensor([0, 1, 2]), 1, 3), "indices must have one entry per row"),
    (lambda: pad_input(torch.zeros(2, 4), torch.tensor([0, 1]), -1, 2), "batch must be a non-negative int"),
    (lambda: pad_input(torch.zeros(2, 4), torch.tensor([0, 1]), 1, 2.0), "seqlen must be a non-negative int"),
    (lambda: index_first_axis(torch.zeros(4, 2), torch.tensor([[0]])), "indices must be 1-D"),
    (lambda: unpad_input_for_concatenated_sequences(torch.zeros(1, 2, 3), torch.ones(1, 2, dtype=torch.bool)),
     "attention_mask_in_length must hold lengths"),
])
def test_errors_name_the_argument(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()
