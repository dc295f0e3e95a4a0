"""The GPU path of the inner steps: bf16 autocast over fp32 parameters, the loss left on the device, pinned
staging of θ for the round's CPU buffers. Skipped with a reason where torch sees no CUDA device; on a GPU
machine, scripts/bench/gpu_checks.sh runs these with the rest of the GPU checks."""

from types import SimpleNamespace

import pytest
import torch

from p2pdiloco.config import ConfigError, InnerConfig
from p2pdiloco.training.data import BatchStream
from p2pdiloco.training.inner import InnerTrainer, flat_params, load_flat_params, make_optimizer
from p2pdiloco.training.model import build_model

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (scripts/bench/gpu_checks.sh runs it)")
# learnable in a few steps (random bytes are not: on an H100 their loss went up and down around ln 256)
TEXT = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 500), dtype=torch.uint8)


def trainer_on(device: str, optimizer: str = "adamw", **options) -> InnerTrainer:
    model = build_model("tiny", seed=0).to(device)
    cfg = InnerConfig(steps=3, batch_size=4, seq_len=32, warmup_steps=0, optimizer=optimizer, **options)
    return InnerTrainer(model, BatchStream(TEXT, 4, 32, seed=1), cfg, torch.device(device))


def test_asking_for_cuda_without_it_is_a_clear_error(monkeypatch):
    from p2pdiloco.peer import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="torch sees no CUDA device.*--device cpu"):
        pick_device("cuda")
    assert pick_device("auto") == torch.device("cpu")


@CUDA
@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_gpu_inner_steps_run_in_bf16_over_fp32_parameters_and_leave_the_loss_on_the_device(optimizer):
    trainer = trainer_on("cuda", optimizer)
    before = flat_params(trainer.model)
    losses = [trainer.train_step() for _ in range(5)]
    assert all(loss.device.type == "cuda" for loss in losses)  # no host read per step
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # autocast, not a bf16 model
    assert torch.isfinite(torch.stack(losses)).all() and float(losses[-1]) < float(losses[0])
    assert not torch.equal(flat_params(trainer.model), before)


@CUDA
def test_gpu_steps_with_recomputed_activations_match_those_that_keep_them():
    """Under bf16 autocast too. Close, not equal: some CUDA backward kernels (the embedding's) add in no fixed
    order, with or without recomputing; the CPU test checks the bits. (Written when no GPU was lent: not run yet.)"""
    recomputed, kept = trainer_on("cuda", activation_checkpointing=True), trainer_on("cuda")
    for _ in range(3):
        torch.testing.assert_close(recomputed.train_step(), kept.train_step(), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(flat_params(recomputed.model), flat_params(kept.model), rtol=1e-3, atol=1e-4)


def test_adamw_takes_the_fused_kernel_where_every_parameter_is_on_a_gpu(monkeypatch):
    """The choice, checked anywhere (the test below runs the kernel on a GPU): fused where every parameter is on a
    GPU, torch's default (fused=None) on the CPU and for a model split between the two."""
    asked = []
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, **options: asked.append(options["fused"]))
    on_gpu, on_cpu = SimpleNamespace(device=torch.device("cuda")), torch.zeros(1)
    for params in ([on_gpu, on_gpu], [on_cpu], [on_gpu, on_cpu]):
        make_optimizer(params, InnerConfig())
    assert asked == [True, None, None]


@CUDA
def test_gpu_adamw_is_the_fused_kernel_also_when_stepping_in_the_backward_pass():
    """One kernel for the whole step (CUDA then loads fewer kernels: ~0.1 GB less host memory); stepping each
    parameter as its gradient completes goes through it too, and steps as stepping after the backward pass does
    (close, not equal: the embedding's backward adds in no fixed order on a GPU)."""
    in_backward, after = trainer_on("cuda", grad_clip=0, step_in_backward=True), trainer_on("cuda", grad_clip=0)
    assert all(group["fused"] for group in after.optimizer.param_groups)
    assert not trainer_on("cpu").optimizer.param_groups[0]["fused"]  # the CPU keeps torch's default
    for _ in range(3):
        torch.testing.assert_close(in_backward.train_step(), after.train_step(), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(flat_params(in_backward.model), flat_params(after.model), rtol=1e-3, atol=1e-4)


@CUDA
def test_theta_goes_between_the_gpu_and_the_cpu_buffers_bit_for_bit_through_pinned_memory():
    trainer = trainer_on("cuda")
    trainer.train_step()
    staged = flat_params(trainer.model)
    assert staged.is_pinned() and staged.device.type == "cpu" and staged.dtype == torch.float32
    cpu = torch.cat([p.detach().cpu().reshape(-1) for p in trainer.model.parameters()])
    assert torch.equal(staged, cpu)
    load_flat_params(trainer.model, staged * 2)
    assert torch.equal(flat_params(trainer.model), staged * 2)


@CUDA
def test_the_global_model_is_evaluated_on_the_gpu_from_host_memory_a_chunk_at_a_time():
    """Θ lives on the host; its evaluation copies it to the device a chunk at a time, telling each chunk done
    (a parked Θ lets its pages go), and gives the loss of a model holding Θ (to rounding: views of one flat
    vector may be aligned differently from the parameters, and cuBLAS picks its kernels by alignment)."""
    from p2pdiloco.training.inner import evaluate

    trainer = trainer_on("cuda")
    theta = flat_params(trainer.model).clone() * 0.9  # not θ
    batches = [next(trainer.batches) for _ in range(2)]
    parts = []
    loss = evaluate(trainer.model, batches, torch.device("cuda"), params=theta, let_go=parts.append)
    assert sum(p.stop - p.start for p in parts) == theta.numel()  # every chunk told
    load_flat_params(trainer.model, theta)
    assert loss == pytest.approx(evaluate(trainer.model, batches, torch.device("cuda")), rel=1e-5)
