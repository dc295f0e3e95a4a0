import pytest
import torch

from p2pdiloco.core.outer import OuterOptimizer, merge_weights, pseudo_gradient, weighted_merge


def test_pseudo_gradient_points_from_local_back_to_global():
    global_params = torch.tensor([1.0, 2.0])
    local = torch.tensor([0.5, 3.0])  # the local model moved by (-0.5, +1.0)
    assert torch.equal(pseudo_gradient(global_params, local), torch.tensor([0.5, -1.0]))


def test_outer_step_with_lr_1_and_no_momentum_lands_on_the_local_model():
    global_params, local = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 3.0])
    opt = OuterOptimizer(global_params.clone(), lr=1.0, momentum=0.0)
    opt.step(pseudo_gradient(global_params, local))
    assert torch.allclose(opt.params, local)


def test_nesterov_matches_hand_computation_over_two_steps():
    opt = OuterOptimizer(torch.tensor([1.0, -2.0]), lr=0.7, momentum=0.9)
    d1, d2 = torch.tensor([0.1, -0.2]), torch.tensor([0.3, 0.0])
    opt.step(d1)
    # buf = d1; update = d1 + 0.9*buf = 1.9*d1; theta = theta - 0.7*1.9*d1
    assert torch.allclose(opt.params, torch.tensor([1.0 - 0.133, -2.0 + 0.266]))
    opt.step(d2)
    buf = 0.9 * torch.tensor([0.1, -0.2]) + d2  # (0.39, -0.18)
    expected = torch.tensor([1.0 - 0.133, -2.0 + 0.266]) - 0.7 * (d2 + 0.9 * buf)
    assert torch.allclose(opt.momentum_buffer, buf)
    assert torch.allclose(opt.params, expected)


def test_nesterov_matches_torch_sgd_nesterov():
    torch.manual_seed(0)
    theta = torch.randn(100)
    ours = OuterOptimizer(theta.clone(), lr=0.7, momentum=0.9)
    param = torch.nn.Parameter(theta.clone())
    reference = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(5):
        delta = torch.randn(100) * 0.01
        ours.step(delta)
        param.grad = delta.clone()
        reference.step()
    assert torch.allclose(ours.params, param.detach(), atol=1e-6)


def test_weighted_merge_weights_by_tokens():
    deltas = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])]
    assert merge_weights([100, 300]) == [0.25, 0.75]
    assert torch.allclose(weighted_merge(deltas, [0.25, 0.75]), torch.tensor([0.25, 0.75]))


def test_rda_directions_are_unit_per_segment_and_leave_zero_segments_and_the_rest_alone():
    from p2pdiloco.core.outer import rda_combine, rda_directions

    delta = torch.tensor([3.0, 4.0, 0.0, 0.0, 0.5, 7.0])
    units, norms = rda_directions(delta, [(0, 2), (2, 4), (4, 5)])
    assert norms == [5.0, 0.0, 0.5] and units.tolist() == pytest.approx([0.6, 0.8, 0.0, 0.0, 1.0, 7.0], abs=1e-7)
    small = torch.tensor([0.3, 0.4])  # a norm below 1 divides too
    assert rda_directions(small, [(0, 2)])[0].tolist() == pytest.approx([0.6, 0.8])
    # Σ w·unit → mean norm × unit of the sum; a segment whose summed direction is 0 stays 0; the rest untouched
    summed = torch.tensor([0.6, 0.8, 0.0, 0.0, 2.0])
    out = rda_combine(summed, [[5.0, 1.0], [15.0, 3.0]], [0.5, 0.5], [(0, 2), (2, 4)])
    assert out.tolist() == pytest.approx([6.0, 8.0, 0.0, 0.0, 2.0]) and out.dtype == torch.float32
    half = rda_combine(torch.tensor([0.3, 0.4]), [[1.0]], [1.0], [(0, 2)])  # a direction norm below 1
    assert half.tolist() == pytest.approx([0.6, 0.8])


def test_a_weighted_merge_sums_in_float64_whatever_the_first_deltas_type():
    from p2pdiloco.core.outer import weighted_merge

    big, small = torch.tensor([1e8, 1.0], dtype=torch.float32), torch.tensor([1.0, 1.0], dtype=torch.float32)
    merged = weighted_merge([big, small, -big], [1.0, 1.0, 1.0])  # in fp32, 1e8 + 1 − 1e8 would be 0
    assert merged.tolist() == [1.0, 1.0]
