"""The pure-PyTorch reference under ``torch.compile`` (Inductor): the same loss and gradient as eager.

The reference is what ``backend="reference"`` runs, so a model compiled with it must train exactly as in eager mode.
Dual focal's ``p_j`` once was an ``amax`` over ``softmax(z)``, whose backward mask ``p == amax(p)`` Inductor evaluated
on a ``p`` recomputed through another exp than the forward's: no class matched, 0/0, NaN gradients
(pytorch/pytorch#186799).
"""

import pytest
import torch

from calibkernels import reference as R


def _argmax_rows_with_ties(n, c):
    """Fresh random fp32 logits whose target is the row's arg-max, with ties below the target and at the top."""
    z = torch.randn(n, c) * 3.0
    target = z.argmax(dim=1)
    # row 0: two classes tie for the largest probability strictly below p_y (p_j's gradient splits between them)
    order = z[0].argsort(descending=True)
    z[0, order[2]] = z[0, order[1]]
    # row 1: three-way tie below the target
    order = z[1].argsort(descending=True)
    z[1, order[2]] = z[1, order[1]]
    z[1, order[3]] = z[1, order[1]]
    # row 2: a class ties with the target itself (not strictly below, so it is not p_j)
    order = z[2].argsort(descending=True)
    z[2, order[1]] = z[2, order[0]]
    target[2] = order[0]
    # row 3: every class ties (nothing strictly below p_y: p_j = 0)
    z[3] = 0.5
    target[3] = 1
    return z, target


# Few classes and many rows: Inductor's CPU code then evaluates exp through both its vector and its scalar path,
# which round differently in the last bit for some inputs; 256 rows make such an input all but certain.
@pytest.mark.parametrize("num_classes, reduction", [(5, "mean"), (7, "none")])
def test_compiled_dual_focal_loss_gradient_equals_eager(num_classes, reduction):
    torch._dynamo.reset()
    z, target = _argmax_rows_with_ties(256, num_classes)

    def loss_fn(logits):
        loss = R.uncertainty_weighted_ce(logits, target, uncertainty="dual_focal", mode="loss", gamma=5.0,
                                         reduction=reduction, backend="reference")
        return loss.sum()

    eager = z.clone().requires_grad_()
    eager_loss = loss_fn(eager)
    eager_loss.backward()
    compiled = z.clone().requires_grad_()
    compiled_loss = torch.compile(loss_fn, backend="inductor", fullgraph=True)(compiled)
    compiled_loss.backward()

    assert torch.isfinite(compiled.grad).all(), f"compiled gradient has non-finite entries:\n{compiled.grad}"
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled.grad, eager.grad, rtol=1e-5, atol=1e-6)
    # and both are the float64 gradient, which splits p_j's share evenly between tied classes
    exact = z.double().requires_grad_()
    loss_fn(exact).backward()
    torch.testing.assert_close(compiled.grad, exact.grad.float(), rtol=1e-4, atol=1e-6)


def test_compiled_weights_on_saturated_rows_equal_eager():
    """Every weight with exponents < 1 (the powers' log-domain gradients), on rows with p_y = 1 in float32."""
    torch._dynamo.reset()
    z, target = _argmax_rows_with_ties(64, 5)
    z[4:8] = torch.tensor([200.0, 0.0, 0.0, -1.0, 0.0])  # saturated: 1 - p_y and every p_k (k ≠ y) underflow
    target[4:8] = 0
    z[8, :] = torch.tensor([30.0, 0.0, -5.0, 0.0, 1.0])  # 1 - p_y below float32 resolution of p_y
    target[8] = 0
    settings = [("focal", 0.5, 2.0), ("flsd", 0.25, 2.0), ("dual_focal", 0.5, 2.0), ("brier", 0.5, 0.7)]

    def loss_fn(logits):
        return sum(R.uncertainty_weighted_ce(logits, target, uncertainty=w, mode="loss", gamma=g, norm=q,
                                             backend="reference") for w, g, q in settings)

    eager = z.clone().requires_grad_()
    loss_fn(eager).backward()
    compiled = z.clone().requires_grad_()
    torch.compile(loss_fn, backend="inductor", fullgraph=True)(compiled).backward()
    assert torch.isfinite(eager.grad).all() and torch.isfinite(compiled.grad).all()
    torch.testing.assert_close(compiled.grad, eager.grad, rtol=1e-5, atol=1e-6)
