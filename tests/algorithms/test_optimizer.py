"""The trainers' optimizer (:func:`marft.algorithms.steps.adamw`): AdamW without weight decay, torch's default
implementation on CPU (the same steps as before it existed), its fused kernel only where every parameter is on a GPU."""

import pytest
import torch

from marft.algorithms.steps import adamw


def test_on_cpu_the_optimizer_steps_as_plain_adamw_without_weight_decay():
    torch.manual_seed(0)
    ours, plain = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    plain.load_state_dict(ours.state_dict())
    ours_opt, plain_opt = adamw(ours.parameters(), 1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
    assert not ours_opt.defaults["fused"] and ours_opt.defaults["weight_decay"] == 0.0
    for _ in range(3):
        x = torch.randn(5, 8)
        for model, opt in ((ours, ours_opt), (plain, plain_opt)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    for a, b in zip(ours.parameters(), plain.parameters()):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the fused kernel is chosen on GPUs only")
def test_on_a_gpu_the_optimizer_is_fused():
    assert adamw(torch.nn.Linear(8, 4, device="cuda").parameters(), 1e-2).defaults["fused"]
