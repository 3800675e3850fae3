"""The estimators' optimizer against torch.optim's, step by step, bit for bit, and the
fit that no longer pays torch.optim's one-time ``torch._dynamo`` import."""

import subprocess
import sys

import pytest
import torch
from numpy.testing import assert_array_equal

from skpathkernel._path._optim import FunctionalOptimizer
from skpathkernel._path._trajectory import SolverSpec

# (spec, the torch.optim optimizer with the same rule, built independently)
CASES = {
    "sgd": (SolverSpec(name="sgd"), lambda ps, lr, fused: torch.optim.SGD(ps, lr=lr, fused=fused)),
    "sgd-momentum-l2": (
        SolverSpec(name="sgd", momentum=0.9, weight_decay=0.01),
        lambda ps, lr, fused: torch.optim.SGD(
            ps, lr=lr, momentum=0.9, weight_decay=0.01, fused=fused
        ),
    ),
    "sgd-nesterov": (
        SolverSpec(name="sgd", momentum=0.5, nesterov=True),
        lambda ps, lr, fused: torch.optim.SGD(ps, lr=lr, momentum=0.5, nesterov=True, fused=fused),
    ),
    "adam": (
        SolverSpec(name="adam"),
        lambda ps, lr, fused: torch.optim.Adam(ps, lr=lr, fused=fused),
    ),
    "adam-l2-betas": (
        SolverSpec(name="adam", beta_1=0.8, beta_2=0.99, epsilon=1e-7, weight_decay=0.01),
        lambda ps, lr, fused: torch.optim.Adam(
            ps, lr=lr, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.01, fused=fused
        ),
    ),
    "adamw": (
        SolverSpec(name="adamw", weight_decay=0.05),
        lambda ps, lr, fused: torch.optim.AdamW(ps, lr=lr, weight_decay=0.05, fused=fused),
    ),
    # No fused RMSprop in torch: the multi-tensor implementation on both sides.
    "rmsprop": (
        SolverSpec(name="rmsprop", rmsprop_alpha=0.9, weight_decay=0.01),
        lambda ps, lr, fused: torch.optim.RMSprop(
            ps, lr=lr, alpha=0.9, weight_decay=0.01, foreach=True
        ),
    ),
}


def _problem(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(24, 3, generator=g, dtype=dtype)
    y = torch.randn(24, 2, generator=g, dtype=dtype)
    net = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    return X, y, net.to(dtype)


def _train(net, opt, X, y, steps, lrs=None, first=0):
    """Steps ``first .. first + steps - 1`` over minibatches (the step size changed every
    step when lrs is given); the parameters after every step."""
    points = []
    for t in range(first, first + steps):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[t % len(lrs)]
        rows = slice(6 * (t % 4), 6 * (t % 4) + 6)
        opt.zero_grad(set_to_none=True)
        ((net(X[rows]) - y[rows]) ** 2).mean().backward()
        opt.step()
        points.append(torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()]))
    return torch.stack(points)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_step_equals_torch_optim_bit_for_bit(case, dtype):
    spec, reference = CASES[case]
    X, y, net = _problem(dtype)
    twin = _problem(dtype)[2]
    twin.load_state_dict(net.state_dict())
    lrs = [0.05, 0.02, 0.01]  # a schedule changing param_groups' lr, as the loop does
    ours = _train(net, FunctionalOptimizer(list(net.parameters()), spec, lrs[0]), X, y, 12, lrs)
    ref_opt = reference(list(twin.parameters()), lrs[0], True if case != "rmsprop" else None)
    theirs = _train(twin, ref_opt, X, y, 12, lrs)
    assert_array_equal(ours.numpy(), theirs.numpy())


@pytest.mark.parametrize("case", list(CASES))
def test_state_round_trip_continues_the_same_path(case):
    """A second optimizer loaded with the first's state_dict continues exactly where an
    uninterrupted torch.optim run goes, and holds the state torch.optim holds."""
    spec, reference = CASES[case]
    X, y, net = _problem(torch.float64, seed=1)
    twin = _problem(torch.float64)[2]
    twin.load_state_dict(net.state_dict())
    ref_opt = reference(list(twin.parameters()), 0.03, True if case != "rmsprop" else None)
    theirs = _train(twin, ref_opt, X, y, 8)

    first = FunctionalOptimizer(list(net.parameters()), spec, 0.03)
    head = _train(net, first, X, y, 5)
    saved = {
        i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
        for i, s in first.state_dict()["state"].items()
    }
    second = FunctionalOptimizer(list(net.parameters()), spec, 0.03)
    full = second.state_dict()
    full["state"] = saved
    second.load_state_dict(full)
    tail = _train(net, second, X, y, 3, first=5)
    assert_array_equal(torch.cat([head, tail]).numpy(), theirs.numpy())
    ref_state = ref_opt.state_dict()["state"]
    ours = second.state_dict()["state"]
    assert sorted(ours) == sorted(ref_state)
    for i, state in ref_state.items():
        assert sorted(ours[i]) == sorted(state)
        for key, value in state.items():
            assert ours[i][key].dtype == value.dtype, key
            assert_array_equal(ours[i][key].numpy(), value.numpy())


def test_a_parameter_without_gradient_is_left_alone():
    X, y, net = _problem(torch.float64)
    net[2].bias.requires_grad_(False)
    before = net[2].bias.detach().clone()
    opt = FunctionalOptimizer([p for p in net.parameters()], SolverSpec(name="adam"), 0.1)
    _train(net, opt, X, y, 2)
    assert_array_equal(net[2].bias.detach().numpy(), before.numpy())
    assert opt.state[net[2].bias] == {}


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_as_torch_optim(set_to_none):
    grads = {}
    for kind in ("ours", "torch"):
        net = _problem(torch.float64)[2]
        params = list(net.parameters())
        opt = (FunctionalOptimizer(params, SolverSpec(name="sgd"), 0.1) if kind == "ours"
               else torch.optim.SGD(params, lr=0.1))
        net(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
        kept = params[0].grad
        opt.zero_grad(set_to_none=set_to_none)
        grads[kind] = [p.grad for p in params]
        # Zeroed in place: the same tensor, not a new one.
        assert (params[0].grad is kept) == (not set_to_none)
    for ours, ref in zip(grads["ours"], grads["torch"], strict=True):
        assert (ours is None) == (ref is None) == set_to_none
        if ours is not None:
            assert_array_equal(ours.numpy(), ref.numpy())
            assert not ours.any()


def test_unknown_solver_and_empty_parameters_are_refused():
    with pytest.raises(ValueError, match="Unknown solver 'lbfgs'"):
        FunctionalOptimizer([torch.zeros(2, requires_grad=True)], SolverSpec(name="lbfgs"), 0.1)
    with pytest.raises(ValueError, match="empty parameter list"):
        FunctionalOptimizer([], SolverSpec(name="adam"), 0.1)


def test_a_fit_does_not_import_torch_dynamo():
    """torch.optim.Optimizer's methods import torch._dynamo on first use (seconds once per
    process); the estimators' fits, every solver, do not."""
    code = (
        "import sys, warnings, numpy as np\n"
        "warnings.simplefilter('ignore')\n"
        "from skpathkernel import PathKernelClassifier, PathKernelMachine\n"
        "X = np.random.RandomState(0).randn(30, 3); y = (X[:, 0] > 0).astype(int)\n"
        "PathKernelClassifier(max_iter=3, random_state=0).fit(X, y)\n"
        "for s in ('sgd', 'adamw', 'rmsprop'):\n"
        "    PathKernelMachine(solver=s, momentum=0.5, max_iter=3).fit(X, X[:, 1])\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("case", ["sgd-momentum-l2", "adam", "adamw"])
def test_parameters_of_two_dtypes_take_torch_optims_grouping(case):
    """Parameters of two dtypes are two groups for the fused kernel: torch.optim's own
    grouping runs, with the same result as torch.optim."""
    spec, reference = CASES[case]
    g = torch.Generator().manual_seed(3)
    a32, a64 = torch.randn(5, generator=g), torch.randn(4, generator=g, dtype=torch.float64)
    ours = [a32.clone().requires_grad_(), a64.clone().requires_grad_()]
    theirs = [a32.clone().requires_grad_(), a64.clone().requires_grad_()]
    opt = FunctionalOptimizer(ours, spec, 0.1)
    assert not opt._direct
    ref = reference(theirs, 0.1, True)
    for t in range(4):
        for params, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            ((params[0] ** 2).sum() * (t + 1) + params[1].sin().sum()).backward()
            o.step()
    for x, y in zip(ours, theirs):
        assert_array_equal(x.detach().numpy(), y.detach().numpy())
