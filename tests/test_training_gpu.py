"""Training through the backward: a small random Llama (GQA 32/8, head dim
64) takes a few SGD steps with the hopper_flash attention backend, against
transformers' "sdpa" and "eager" backends from the same weights: the loss
and the first step's gradients must agree with "sdpa" within twice the spread
between "sdpa" and "eager" (plus a small floor); and a torch.compile'd
training step runs and agrees with the eager one."""
import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hopper_flash.integrations import transformers as hft  # noqa: E402

pytestmark = pytest.mark.gpu

NAME = "hopper_flash"


@pytest.fixture(scope="module")
def base_model():
    hft.register()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                   max_position_embeddings=1024, attention_dropout=0.0)
    return transformers.LlamaForCausalLM(cfg)


def _train(base, impl, ids, steps=3, compile_step=False):
    model = copy.deepcopy(base).to(device="cuda", dtype=torch.bfloat16)
    model.set_attn_implementation(impl)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        return model(input_ids=ids, labels=ids).loss

    run = torch.compile(step) if compile_step else step
    losses, grads = [], None
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = run()
        loss.backward()
        if i == 0:
            grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
        losses.append(loss.item())
        opt.step()
    return losses, grads


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_llama_gqa_training_matches_sdpa(base_model):
    ids = torch.randint(0, 1000, (2, 333), generator=torch.Generator().manual_seed(1)).cuda()
    hf_loss, hf_grad = _train(base_model, NAME, ids)
    sdpa_loss, sdpa_grad = _train(base_model, "sdpa", ids)
    eager_loss, eager_grad = _train(base_model, "eager", ids)
    assert all(math.isfinite(x) for x in hf_loss) and torch.isfinite(hf_grad).all()
    spread_grad = _rel(eager_grad, sdpa_grad)
    print(f"\nlosses hopper_flash {hf_loss}, sdpa {sdpa_loss}, eager {eager_loss}; first-step gradients "
          f"rel vs sdpa: hopper_flash {_rel(hf_grad, sdpa_grad):.3e}, eager {spread_grad:.3e}")
    assert _rel(hf_grad, sdpa_grad) <= 2 * spread_grad + 1e-2
    for hf, sd, ea in zip(hf_loss, sdpa_loss, eager_loss):
        assert abs(hf - sd) <= 2 * abs(ea - sd) + 2e-2


def test_llama_compiled_training_step(base_model):
    ids = torch.randint(0, 1000, (2, 200), generator=torch.Generator().manual_seed(2)).cuda()
    eager_loss, eager_grad = _train(base_model, NAME, ids, steps=2)
    comp_loss, comp_grad = _train(base_model, NAME, ids, steps=2, compile_step=True)
    assert _rel(comp_grad, eager_grad) < 2e-2
    assert all(abs(a - b) < 2e-2 for a, b in zip(comp_loss, eager_loss))
