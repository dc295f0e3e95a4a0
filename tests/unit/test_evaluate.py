"""Validation of Θ runs through the training model's modules on views of Θ: no second model."""

import torch
from p2pdiloco.training.inner import evaluate, flat_params, load_flat_params
from p2pdiloco.training.model import build_model


def test_evaluating_a_flat_vector_equals_evaluating_a_model_that_holds_it_and_leaves_the_model_alone():
    model = build_model("tiny", 0)
    theta = flat_params(model)
    other = theta + 0.01 * torch.randn(theta.numel(), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g))
               for _ in range(3)]
    grad_modes = []
    model.register_forward_pre_hook(lambda module, args: grad_modes.append(torch.is_grad_enabled()))
    reference = build_model("tiny", 0)
    load_flat_params(reference, other)
    assert evaluate(model, batches, torch.device("cpu"), params=other) == evaluate(reference, batches,
                                                                                  torch.device("cpu"))
    assert evaluate(model, batches, torch.device("cpu")) != evaluate(reference, batches, torch.device("cpu"))
    assert torch.equal(flat_params(model), theta) and model.training  # θ and the mode untouched
    assert grad_modes and not any(grad_modes)  # no autograd graph (its activations) was built
