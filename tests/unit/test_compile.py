"""--compile: each decoder layer compiled in place by torch.compile. It trains what eager trains (to float
rounding), keeps the parameters' names and flat layout, and evaluates Θ through the same compiled layers."""

import pytest
import torch

from p2pdiloco.config import ConfigError, InnerConfig
from p2pdiloco.training.data import BatchStream
from p2pdiloco.training.inner import InnerTrainer, evaluate, flat_params
from p2pdiloco.training.model import build_model, resolve_config

TEXT = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)


def two_layers():
    """`tiny` with 2 of its 4 layers, each compiled on its own: 33 s against 38 s for 4 with a cold inductor cache on
    2 cores (the suite's budget)."""
    config = resolve_config("tiny", vocab_size=257)
    config.num_hidden_layers = 2
    return build_model(config, seed=0)


def trainer(compiled: bool, **overrides) -> InnerTrainer:
    cfg = InnerConfig(batch_size=4, seq_len=32, warmup_steps=2, compile=compiled, **overrides)
    return InnerTrainer(two_layers(), BatchStream(TEXT, 4, 32, seed=1), cfg, torch.device("cpu"))


@pytest.mark.parametrize("overrides", [{}, pytest.param(dict(activation_checkpointing=True), marks=pytest.mark.slow)],
                         ids=["plain", "recompute"])  # recompute: slow, the default suite's budget
def test_compiled_layers_train_and_evaluate_as_eager_ones(overrides):
    compiled, eager = trainer(True, **overrides), trainer(False, **overrides)
    assert len(compiled.model.blocks()) == 2 and all(b._compiled_call_impl is not None for b in compiled.model.blocks())
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())
    for _ in range(3):
        torch.testing.assert_close(compiled.train_step(), eager.train_step(), rtol=1e-4, atol=1e-4)
    # Adam divides by the gradients' size: a rounding in a tiny gradient moves a parameter by part of a step (lr 1e-3)
    torch.testing.assert_close(flat_params(compiled.model), flat_params(eager.model), rtol=1e-3, atol=2e-4)
    theta = flat_params(eager.model).clone().mul_(0.5)  # another vector than the compiled model's own
    batches = [next(eager.batches) for _ in range(2)]
    assert evaluate(compiled.model, batches, torch.device("cpu"), params=theta) == pytest.approx(
        evaluate(eager.model, batches, torch.device("cpu"), params=theta), rel=1e-4)


def test_a_model_that_cannot_compile_its_blocks_is_refused():
    with pytest.raises(ConfigError, match="cannot compile"):
        InnerTrainer(torch.nn.Linear(2, 2), iter(()), InnerConfig(compile=True), torch.device("cpu"))
