import numpy as np
import pytest
import torch

from skpathkernel._path._losses import LOSSES, LogLoss, Loss, SquaredError


def _per_sample_hessians(loss, f, y):
    """The reference: torch.autograd.functional.hessian of each sample's loss alone."""
    return torch.stack([torch.autograd.functional.hessian(
        lambda fi, i=i: loss.per_sample(fi[None], y[i : i + 1])[0], f[i]) for i in range(len(f))])


@pytest.mark.parametrize("loss, C, target", [
    (SquaredError(), 1, "real"),
    (SquaredError(), 3, "real"),
    (LogLoss(), 1, "codes"),
    (LogLoss(), 1, "column"),
    (LogLoss(), 4, "codes"),
    (LogLoss(), 3, "indicator"),
])
def test_output_hessian_closed_forms_equal_autograd(loss, C, target):
    """The closed-form output Hessians (the unrolled scores' MLP products read them)
    against autograd's per sample, and the base class's generic loop against both."""
    rng = np.random.RandomState(0)
    f = torch.as_tensor(rng.normal(size=(7, C)) * 3)
    y = {"real": torch.as_tensor(rng.normal(size=(7, C))),
         "codes": torch.as_tensor(rng.randint(0, max(C, 2), size=7)),
         "column": torch.as_tensor(rng.randint(0, 2, size=(7, 1))).double(),
         "indicator": torch.as_tensor(rng.randint(0, 2, size=(7, C))).double()}[target]
    want = _per_sample_hessians(loss, f, y)
    assert want.abs().max() > 0
    torch.testing.assert_close(loss.output_hessian(f, y), want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(Loss.output_hessian(loss, f, y), want, rtol=1e-12, atol=1e-14)


def test_output_hessian_refuses_a_once_differentiable_loss():
    """A custom loss through a @once_differentiable backward: autograd differentiates
    around it and the generic output Hessian read as zeros (the unrolled scores' MLP
    route then returned wrong scores without a word). Refused, as the other routes do."""
    from torch.autograd.function import once_differentiable

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x**2

        @staticmethod
        @once_differentiable
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    class Custom(Loss):
        def per_sample(self, output, target):
            return Square.apply(output - target).sum(1)

    f, y = torch.randn(4, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="once_differentiable"):
        Custom().output_hessian(f, y)


def test_target_hessian_by_autograd_against_closed_forms():
    """``d^2 l / df dy``: the base class's autograd against the squared error's closed
    form, and against a quartic loss's, ``-12 diag((f - y)^2)``."""
    torch.manual_seed(0)
    f, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    squared = LOSSES["squared_error"]()
    torch.testing.assert_close(Loss.target_hessian(squared, f, y),
                               squared.target_hessian(f, y), rtol=0, atol=1e-15)

    class Quartic(Loss):
        def per_sample(self, output, target):
            return (output - target).pow(4).sum(1)

    expected = torch.diag_embed(-12 * (f - y) ** 2)
    torch.testing.assert_close(Quartic().target_hessian(f, y), expected)
