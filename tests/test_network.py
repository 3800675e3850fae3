"""TrainedNetwork: the one fitted-network object under every estimator (issue 17).

Every consumer reads a fitted network through ``network_of``: these tests check that the
object holds what fit trained (against independent references), that each producer
(estimators, RecordedNetwork, the OOD detector, FrozenEstimator) exposes the same one, and
that pickles in the format written before ``network_`` existed still load.
"""

import copy
import inspect
import pickle
import re
import types

import numpy as np
import pytest
import torch
from _reference import features_loop, forward_recursion, gauss_nodes, jacobian_loop, module_at
from sklearn.compose import TransformedTargetRegressor
from sklearn.ensemble import BaggingRegressor
from sklearn.exceptions import NotFittedError
from sklearn.frozen import FrozenEstimator
from sklearn.linear_model import Ridge
from sklearn.model_selection import GridSearchCV
from sklearn.multioutput import MultiOutputRegressor
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from skpathkernel import (
    OODRankDetector,
    PathKernel,
    PathKernelClassifier,
    PathKernelMachine,
    PathRecorder,
    RecordedNetwork,
    TangentKernel,
    TrainedNetwork,
)
from skpathkernel._network._trained import network_of
from skpathkernel.diagnostics import hessian_trace

SMALL = dict(hidden_layer_sizes=(6,), solver="adam", learning_rate_init=0.05, max_iter=6,
             tol=None, activation="tanh", dtype="float64", random_state=0)


@pytest.fixture(scope="module")
def data():
    rng = np.random.RandomState(0)
    X = rng.normal(size=(24, 3))
    return X, (X[:, 0] + X[:, 1] * X[:, 2] > 0).astype(int)


@pytest.fixture(scope="module")
def clf(data):
    return PathKernelClassifier(**SMALL).fit(*data)


def test_network_holds_what_fit_trained(clf, data):
    X, y = data
    net = clf.network_
    assert isinstance(net, TrainedNetwork)
    assert net.module is clf.module_ and net.trajectory is clf.trajectory_
    assert (net.dtype, net.device, net.n_params) == ("float64", "cpu", clf.n_params_)
    assert net.loss.name == "log_loss" and net.input_kind == "features"
    np.testing.assert_array_equal(net.X_fit, X)
    # Binary log loss: the targets are the 0/1 codes of the labels.
    np.testing.assert_array_equal(net.targets().numpy(), (y == clf.classes_[1]).astype(float))
    # The parameters at a recorded point are the trajectory's, by name.
    theta = net.params_at(0)
    first = module_at(clf, 0)
    for name, p in first.named_parameters():
        np.testing.assert_array_equal(theta[name].numpy(), p.detach().numpy())


def test_tangent_kernel_of_the_network_is_the_jacobian_gram(clf, data):
    X, _ = data
    J = jacobian_loop(module_at(clf), X[:7]).reshape(7, -1).numpy()
    for source in (clf, clf.network_, FrozenEstimator(clf)):
        np.testing.assert_allclose(TangentKernel(source)(X[:7]), J @ J.T, rtol=1e-10,
                                   atol=1e-12)
    np.testing.assert_allclose(PathKernel(clf.network_)(X[:5]), PathKernel(clf)(X[:5]),
                               rtol=1e-12)


def test_network_of_every_producer(clf, data):
    X, _ = data
    assert network_of(clf) is clf.network_
    assert network_of(clf.network_) is clf.network_
    # FrozenEstimator forwards attribute access: no class-name check is needed.
    assert network_of(FrozenEstimator(clf)) is clf.network_
    det = OODRankDetector(FrozenEstimator(clf)).fit(X)
    # The detector composes its estimator's network; it keeps no copies of it.
    assert det.network_ is clf.network_ and det.module_ is clf.module_
    assert not {"module_", "trajectory_", "device_", "n_params_"} & set(vars(det))
    rec = RecordedNetwork(clf.module_, clf.trajectory_, X_train=X)
    assert network_of(rec).trajectory is clf.trajectory_
    with pytest.raises(NotFittedError):
        network_of(PathKernelMachine())
    with pytest.raises(TypeError, match="not an estimator"):
        network_of(object())
    with pytest.raises(NotFittedError):
        network_of(Ridge())
    # Fitted, but with no network: refitting would not help, so not NotFittedError.
    ridge = Ridge().fit(X, X[:, 0])
    for obj in (ridge, FrozenEstimator(ridge)):
        with pytest.raises(TypeError, match="exposes no fitted network"):
            network_of(obj)
    with pytest.raises(TypeError, match="exposes no fitted network"):
        TangentKernel(ridge)(X)
    # A pipeline ending in a fitted network: network_of itself names the way to its
    # network; the kernels follow that way (the network sees the scaled inputs).
    pipe = make_pipeline(StandardScaler(), PathKernelMachine(
        hidden_layer_sizes=(4,), max_iter=3, dtype="float64", random_state=0)).fit(X, X[:, 0])
    with pytest.raises(TypeError, match=re.escape("pipe[-1]") + ".*" +
                       re.escape("pipe[:-1].transform(X)")):
        network_of(pipe)
    Z = pipe[:-1].transform(X)
    J = jacobian_loop(pipe[-1].module_, torch.as_tensor(Z))
    for source, inputs in ((pipe[-1], Z), (pipe, X)):
        np.testing.assert_allclose(TangentKernel(source)(inputs),
                                   (J[:, 0] @ J[:, 0].T).numpy(), rtol=1e-10)


@pytest.mark.parametrize("wrapper", ["search", "transformed_target", "multi_output"])
def test_a_wrapper_around_a_network_names_where_the_network_is(wrapper):
    # A regression user's wrappers hold the fitted network under their own names; the
    # error named none, only the pipeline's. The named way gives the network's kernel.
    rng = np.random.RandomState(0)
    X = rng.normal(size=(16, 2))
    y = X[:, 0] - X[:, 1]
    reg = PathKernelMachine(hidden_layer_sizes=(3,), max_iter=2, tol=None, dtype="float64",
                            random_state=0)
    obj, attr, inner = {
        "search": (GridSearchCV(reg, {"alpha": [1e-4]}, cv=2), "best_estimator_",
                   lambda o: o.best_estimator_),
        "transformed_target": (TransformedTargetRegressor(reg, func=np.tanh,
                                                          inverse_func=np.arctanh,
                                                          check_inverse=False),
                               "regressor_", lambda o: o.regressor_),
        "multi_output": (MultiOutputRegressor(reg), "estimators_[i]",
                         lambda o: o.estimators_[1]),
    }[wrapper]
    obj.fit(X, np.c_[y, -y] if wrapper == "multi_output" else 0.5 * np.tanh(y))
    with pytest.raises(TypeError, match=re.escape(attr)):
        network_of(obj)
    J = jacobian_loop(inner(obj).module_, torch.as_tensor(X))
    np.testing.assert_allclose(TangentKernel(inner(obj))(X), (J[:, 0] @ J[:, 0].T).numpy(),
                               rtol=1e-10)
    if wrapper == "search":
        # A refitted search's best_estimator_ saw X and y as they are: the kernel follows.
        np.testing.assert_allclose(TangentKernel(obj)(X), (J[:, 0] @ J[:, 0].T).numpy(),
                                   rtol=1e-10)
    else:
        # Another network's targets (func(y)), or one network per target: refused.
        with pytest.raises(TypeError, match=re.escape(attr)):
            TangentKernel(obj)(X)


@pytest.mark.parametrize("wrapper", ["search_of_pipeline", "pipeline_of_transformed"])
def test_a_wrapper_nesting_a_pipeline_names_the_way_and_the_inputs(wrapper):
    # The search a regression user runs is over a pipeline (the scaler inside the
    # search): the error named no way, as for any wrapper whose estimator is a pipeline.
    # The way and the inputs it names give the network's kernel.
    rng = np.random.RandomState(0)
    X = rng.normal(size=(16, 2)) * [1.0, 10.0]
    y = 0.5 * np.tanh(X[:, 0] - X[:, 1] / 10)
    reg = PathKernelMachine(hidden_layer_sizes=(3,), max_iter=2, tol=None, dtype="float64",
                            random_state=0)
    if wrapper == "search_of_pipeline":
        obj = GridSearchCV(make_pipeline(StandardScaler(), reg),
                           {"pathkernelmachine__alpha": [1e-4]}, cv=2).fit(X, y)
        way, inputs = "best_estimator_[-1]", "best_estimator_[:-1].transform(X)"
        inner, Z = obj.best_estimator_[-1], obj.best_estimator_[:-1].transform(X)
    else:
        obj = make_pipeline(StandardScaler(), TransformedTargetRegressor(
            reg, func=np.arctanh, inverse_func=np.tanh, check_inverse=False)).fit(X, y)
        way, inputs = "pipe[-1].regressor_", "pipe[:-1].transform(X)"
        inner, Z = obj[-1].regressor_, obj[:-1].transform(X)
    with pytest.raises(TypeError, match=re.escape(way) + ".*" + re.escape(inputs)):
        network_of(obj)
    J = jacobian_loop(inner.module_, torch.as_tensor(Z))
    np.testing.assert_allclose(TangentKernel(inner)(Z), (J[:, 0] @ J[:, 0].T).numpy(),
                               rtol=1e-10)
    if wrapper == "search_of_pipeline":
        # The kernel follows the search and its pipeline, on X as the search got it.
        np.testing.assert_allclose(TangentKernel(obj)(X), (J[:, 0] @ J[:, 0].T).numpy(),
                                   rtol=1e-10)
    else:
        with pytest.raises(TypeError, match=re.escape(way) + ".*" + re.escape(inputs)):
            TangentKernel(obj)(X)


def test_a_bag_of_networks_is_not_named_one_per_target():
    # BaggingRegressor's estimators_ are one per bag, each fitted on a sample of the rows
    # and on estimators_features_'s columns: the error called them one per target and
    # sent X as it is to a network that takes two of its three columns.
    rng = np.random.RandomState(0)
    X = rng.normal(size=(16, 3))
    bag = BaggingRegressor(PathKernelMachine(hidden_layer_sizes=(3,), max_iter=2, tol=None,
                                             random_state=0),
                           n_estimators=2, max_features=2, random_state=0).fit(X, X[:, 0])
    with pytest.raises(TypeError, match=r"estimators_\[0\]") as info:
        TangentKernel(bag)(X)
    assert "per target" not in str(info.value)
    assert bag.estimators_[0].n_features_in_ != X.shape[1]


def test_memory_budget_is_read_from_the_estimator_at_each_call(data):
    X, y = data
    est = PathKernelMachine(**SMALL).fit(X, y.astype(float))
    assert network_of(est).memory_budget == 2**30
    est.set_params(memory_budget=2**20)
    assert network_of(est).memory_budget == 2**20
    assert est.network_.memory_budget == 2**30  # the fitted object is not modified


def test_setting_an_attribute_on_a_copy_leaves_the_original(clf):
    view = copy.copy(clf)
    other = copy.deepcopy(clf.module_)
    view.module_ = other
    assert view.module_ is other and view.network_.module is other
    assert clf.module_ is not other and clf.network_.module is not other
    with pytest.raises(AttributeError, match="read from network_"):
        view.trajectory_ = clf.trajectory_


def test_unfitted_attributes_are_missing():
    est = PathKernelMachine()
    for name in ("module_", "trajectory_", "X_fit_", "network_", "device_"):
        assert not hasattr(est, name)
    det = OODRankDetector()
    for name in ("network_", "module_", "loss_curve_", "X_fit_"):
        assert not hasattr(det, name)


def test_trained_network_pickles(clf, data):
    X, _ = data
    net = pickle.loads(pickle.dumps(clf.network_))
    np.testing.assert_allclose(TangentKernel(net)(X[:4]), TangentKernel(clf)(X[:4]),
                               rtol=1e-12)
    assert repr(net).startswith("TrainedNetwork(Sequential, 7 recorded points")


def test_trained_network_refuses_a_trajectory_of_another_network(clf):
    other = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    with pytest.raises(ValueError, match="recorded from another network"):
        TrainedNetwork(other.double(), clf.trajectory_)
    with pytest.raises(ValueError, match="loss must be one of"):
        TrainedNetwork(clf.module_, clf.trajectory_, loss="hinge")


def _recorded(n=12, steps=5, seed=0):
    torch.manual_seed(seed)
    X, y = torch.randn(n, 2, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    module = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(),
                                 torch.nn.Linear(4, 1)).double()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    with PathRecorder(module, opt, n_samples=n) as rec:
        for _ in range(steps):
            rec.set_batch(np.arange(n))
            opt.zero_grad()
            (0.5 * (module(X)[:, 0] - y).pow(2).mean()).backward()
            opt.step()
    return module, rec.trajectory, X.numpy(), y.numpy()


def test_recorded_network_init_only_stores_and_set_params_is_honoured():
    module, traj, X, y = _recorded()
    net = RecordedNetwork(module, traj, X_train=X, y_train=y)
    # Parameters (and the private cache of the network built from them) only.
    assert set(vars(net)) == {"module", "trajectory", "X_train", "y_train", "loss",
                              "memory_budget", "_cache"}
    res = net.decompose(X[:3])
    np.testing.assert_allclose(res.reconstruction, net.predict(X[:3]), atol=1e-10)
    # Another recorded run: the network is rebuilt from the new parameters.
    module2, traj2, X2, y2 = _recorded(seed=1)
    net.set_params(module=module2, trajectory=traj2, X_train=X2, y_train=y2)
    assert net.trajectory_ is traj2 and net.module_ is module2
    J = jacobian_loop(module_at(net), X2[:4]).reshape(4, -1).numpy()
    np.testing.assert_allclose(net.tangent_kernel_(X2[:4]), J @ J.T, rtol=1e-10)
    np.testing.assert_allclose(net.decompose(X2[:3]).reconstruction, net.predict(X2[:3]),
                               atol=1e-10)
    net.set_params(memory_budget=2**20)
    assert net.network_.memory_budget == 2**20


def test_recorded_network_rebuilds_for_a_new_object_at_a_freed_address():
    # A parameter replaced by None and then by a new object that CPython may place at
    # the freed address of the old one: the network is still rebuilt from the new one.
    module, traj, X, y = _recorded()
    net = RecordedNetwork(module, traj, X_train=X, y_train=y.tolist())
    for shift in range(1, 6):
        assert net.network_.y_fit is not None
        net.set_params(y_train=None)
        net.set_params(y_train=(y + shift).tolist())
        np.testing.assert_array_equal(net.network_.y_fit, y + shift)
        np.testing.assert_allclose(net.network_.targets().numpy()[:, 0], y + shift)


# --------------------------------------------------------------------------- pickling
@pytest.mark.parametrize("cls", [PathKernelClassifier, PathKernelMachine])
def test_pickled_state_holds_no_torch_objects_and_loads_identically(cls, data):
    X, y = data
    est = cls(**SMALL).fit(X, y if cls is PathKernelClassifier else y.astype(float))
    state = est.__getstate__()
    # NumPy and plain values only: a CUDA-trained estimator loads anywhere, skops reads it.
    assert "network_" not in state
    assert not [k for k, v in state.items() if isinstance(v, (torch.Tensor, torch.nn.Module))]
    loaded = cls.__new__(cls)
    loaded.__setstate__(copy.deepcopy(state))
    assert isinstance(loaded.network_, TrainedNetwork)
    assert not {"module_", "trajectory_", "X_fit_", "device_"} & set(vars(loaded))
    np.testing.assert_array_equal(loaded.predict(X), est.predict(X))
    np.testing.assert_array_equal(loaded.transform(X[:5]), est.transform(X[:5]))
    np.testing.assert_allclose(loaded.transform(X[:5]), features_loop(module_at(est), X[:5]),
                               rtol=1e-10, atol=1e-12)
    a, b = loaded.decompose(X[:3]), est.decompose(X[:3])
    np.testing.assert_array_equal(a.contributions, b.contributions)


def test_outputs_at_a_recorded_point_are_the_module_there(clf, data):
    X, _ = data
    for step in (0, 3, -1):
        ref = module_at(clf, step)(torch.as_tensor(X[:5])).detach().numpy()
        np.testing.assert_allclose(clf.network_.outputs(X[:5], step=step), ref, rtol=1e-12)
    with pytest.raises(ValueError, match="2 features, but the network is expecting 3 features"):
        clf.network_.outputs(X[:5, :2])


def _wide_recorded(width=512, n=8, seed=0):
    """A recorded network whose float64 activations need 8 * width * 8 bytes per row."""
    torch.manual_seed(seed)
    X, y = torch.randn(n, 3, dtype=torch.float64), torch.randn(n, 1, dtype=torch.float64)
    module = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Tanh(),
                                 torch.nn.Linear(width, 1)).double()
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    with PathRecorder(module, opt, n_samples=n) as rec:
        for _ in range(3):
            rec.set_batch(np.arange(n))
            opt.zero_grad()
            (0.5 * (module(X) - y).pow(2).mean()).backward()
            opt.step()
    return module, rec.trajectory, X.numpy()


@pytest.mark.parametrize("budget, rows", [(2**20, 2**20 // (8 * 512 * 8)), (2**30, 256)])
def test_recorded_network_predicts_in_blocks_under_its_memory_budget(budget, rows):
    module, traj, X = _wide_recorded()
    Xq = np.random.RandomState(1).randn(100, 3)
    net = RecordedNetwork(module, traj, X_train=X, memory_budget=budget)
    seen = []
    hook = module.register_forward_pre_hook(lambda m, args: seen.append(len(args[0])))
    try:
        out = net.predict(Xq)
    finally:
        hook.remove()
    # Every block the same size (the last one padded), none above what the budget allows.
    assert set(seen) == {min(rows, 256)} and len(seen) == -(-100 // min(rows, 256))
    ref = module_at(types.SimpleNamespace(module_=module, trajectory_=traj), -1)
    np.testing.assert_allclose(out, ref(torch.as_tensor(Xq)).detach().numpy(), rtol=1e-12)
    # A row's output does not depend on the rows passed with it.
    np.testing.assert_array_equal(net.predict(Xq[7:8]), out[7:8])


def test_estimator_predicts_with_the_network_forward_pass(clf, data):
    X, _ = data
    # The fitted module's own parameters are the last recorded point's.
    np.testing.assert_allclose(clf.network_.outputs(X, step=None), clf.network_.outputs(X),
                               rtol=1e-12, atol=1e-14)
    ref = module_at(clf, -1)(torch.as_tensor(X)).detach().numpy()
    np.testing.assert_allclose(clf.decision_function(X), ref[:, 0], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("verb", ["decompose", "attribute", "self_influence"])
def test_read_only_verbs_share_one_docstring(verb):
    docscrape = pytest.importorskip("numpydoc.docscrape")
    owners = [TrainedNetwork, RecordedNetwork, PathKernelMachine, PathKernelClassifier]
    docs = [docscrape.FunctionDoc(getattr(cls, verb)) for cls in owners]
    # The same parameters, described in the same words, wherever the verb is.
    for doc in docs[1:]:
        # X, y and output's default are each owner's own.
        shared = {p.name: p.desc for p in doc["Parameters"]
                  if p.name not in ("X", "y", "output")}
        first = {p.name: p.desc for p in docs[0]["Parameters"] if p.name in shared}
        assert first == {k: v for k, v in shared.items() if k in first}
        assert doc["Returns"][0].type == docs[0]["Returns"][0].type
    # Their signatures agree with their documented parameters.
    for cls, doc in zip(owners, docs):
        documented = [p.name for p in doc["Parameters"]]
        params = [n for n in inspect.signature(getattr(cls, verb)).parameters if n != "self"]
        assert documented == params, cls


# --------------------------------------------------------------------------- PathRecorder
def _squared(out, y):
    return 0.5 * (out - y).pow(2).mean(dim=1)


def test_path_recorder_produces_the_network_of_its_estimator():
    module, traj, X, y = _recorded()
    ref = types.SimpleNamespace(module_=module, trajectory_=traj)  # for the references
    # The same recording as both: PathRecorder.as_network is as_estimator(...).network_.
    rec = types.SimpleNamespace(module=module, trajectory=traj)
    net = PathRecorder.as_network(rec, X, y)
    est_net = PathRecorder.as_estimator(rec, X, y).network_
    assert isinstance(net, TrainedNetwork) and network_of(net) is net
    assert net.module is est_net.module and net.trajectory is est_net.trajectory
    assert (net.dtype, net.input_shape, net.input_kind) == ("float64", (2,), "features")
    np.testing.assert_array_equal(net.X_fit, est_net.X_fit)
    # Independent references: the module at the last recorded point, its Jacobian Gram,
    # and the per-sample forward recursion of the decomposition.
    with torch.no_grad():
        out = module_at(ref)(torch.as_tensor(X[:4])).numpy()
    np.testing.assert_allclose(net.outputs(X[:4]), out, rtol=1e-12)
    J = jacobian_loop(module_at(ref), X[:4]).reshape(4, -1).numpy()
    np.testing.assert_allclose(TangentKernel(net)(X[:4]), J @ J.T, rtol=1e-10)
    res = net.decompose(X[:3], n_nodes=3)
    contrib, _ = forward_recursion(ref, X, torch.as_tensor(y).reshape(-1, 1), _squared,
                                   X[:3], nodes=gauss_nodes(3))
    scale = np.abs(contrib).max()
    np.testing.assert_allclose(res.contributions, contrib, rtol=0, atol=1e-10 * scale)
    # A tensor query is the array query.
    np.testing.assert_array_equal(net.decompose(torch.as_tensor(X[:3]), n_nodes=3)
                                  .contributions, res.contributions)


def test_network_decompose_refuses_what_it_cannot_decompose():
    module, traj, X, y = _recorded()
    with pytest.raises(ValueError, match="needs the training inputs"):
        TrainedNetwork(module, traj).decompose(X[:2])
    with pytest.raises(ValueError, match="batches index 12 samples but X_train has 6"):
        TrainedNetwork(module, traj, loss="squared_error", X_fit=X[:6], y_fit=y[:6]
                       ).decompose(X[:2])
    with pytest.raises(ValueError, match="y_train has 5 rows but X_train has 12"):
        TrainedNetwork(module, traj, loss="squared_error", X_fit=X, y_fit=y[:5]
                       ).decompose(X[:2])
    X_nan = X.copy()
    X_nan[3, 0] = np.nan
    with pytest.raises(ValueError, match="X_train contains NaN"):
        TrainedNetwork(module, traj, loss="squared_error", X_fit=X_nan, y_fit=y
                       ).decompose(X[:2])
    whole = TrainedNetwork(module, traj, loss=lambda out, t: (out - t[:, None]) ** 2,
                           X_fit=X, y_fit=y)
    with pytest.raises(ValueError, match=r"one value per sample, shape \(B,\)"):
        whole.decompose(X[:2])
    with pytest.raises(ValueError, match="method must be"):
        TrainedNetwork(module, traj, loss="squared_error", X_fit=X, y_fit=y
                       ).decompose(X[:2], method="third_order")


def _three_class_loop(codes, n_steps):
    """A recorded full-batch SGD loop of a 2-4-3 tanh network on class ``codes``:
    (recorder, X, codes)."""
    torch.manual_seed(0)
    X = torch.randn(len(codes), 2, dtype=torch.float64)
    module = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(),
                                 torch.nn.Linear(4, 3)).double()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    with PathRecorder(module, opt, n_samples=len(codes)) as rec:
        for _ in range(n_steps):
            rec.set_batch(np.arange(len(codes)))
            opt.zero_grad()
            torch.nn.functional.cross_entropy(module(X), codes).backward()
            opt.step()
    return rec, X, codes


def test_library_losses_on_targets_of_another_form_are_refused_up_front():
    """Targets the declared library loss cannot take: float class codes for log_loss on
    3 outputs failed deep inside with torch's RuntimeError ("expected target dtype to be
    Long"), and one target column for squared_error on 3 outputs was broadcast against
    all of them (another loss, silently)."""
    rec, X, codes = _three_class_loop(torch.arange(12) % 3, n_steps=3)
    floats = rec.as_network(X, codes.double(), loss="log_loss")
    for call in (lambda: floats.decompose(X[:2]),
                 lambda: floats.attribute(X[:2], output="margin", method="unrolled"),
                 lambda: floats.self_influence(output="margin")):
        with pytest.raises(ValueError, match="log_loss takes integer class codes"):
            call()
    column = rec.as_network(X, codes.double(), loss="squared_error")
    with pytest.raises(ValueError, match=r"y_train has \(1,\) values per sample and the "
                                         "network 3 outputs"):
        column.attribute(X[:2], output=0)
    # The codes as integers are taken.
    net = rec.as_network(X, codes, loss="log_loss")
    assert net.decompose(X[:2]).error < 1e-10


@pytest.mark.parametrize("method", ["exact", "unrolled"])
def test_classes_given_without_the_margin_are_refused(method):
    """A recorded binary classifier (one logit) explains output 0 by default: classes
    given with it were dropped without a word, and the scores were the logit's, of the
    opposite sign to the margin's for every query of class 0. They are refused, and the
    network stays usable: with output="margin" the scores are the logit's signed by the
    class (the margin of one logit is the logit, negated for class 0)."""
    torch.manual_seed(0)
    n = 12
    X = torch.randn(n, 2, dtype=torch.float64)
    codes = (X[:, 0] > 0).double()
    module = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(),
                                 torch.nn.Linear(4, 1)).double()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    with PathRecorder(module, opt, n_samples=n) as rec:
        for step in range(4):
            batch = np.arange(step % 2, n, 2)
            rec.set_batch(batch)
            opt.zero_grad()
            torch.nn.functional.binary_cross_entropy_with_logits(
                module(X[batch])[:, 0], codes[batch]).backward()
            opt.step()
    net = rec.as_estimator(X.numpy(), codes.numpy()[:, None], loss="log_loss")
    y = np.array([0, 1, 0])
    with pytest.raises(ValueError, match="only output='margin' reads"):
        net.attribute(X[:3].numpy(), y, method=method)
    logit = net.attribute(X[:3].numpy(), method=method)
    margin = net.attribute(X[:3].numpy(), y, method=method, output="margin")
    np.testing.assert_allclose(margin, np.where(y == 1, 1.0, -1.0)[:, None] * logit,
                               rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("method", ["bad", "unrolled", None])
@pytest.mark.parametrize("output", [None, "all"])
def test_explain_names_the_methods_it_takes(method, output):
    """A bad method named 'unrolled' among the choices (attribute's list), which explain
    then refused: its error lists the decomposition's methods, whatever the output."""
    module, traj, X, y = _recorded()
    net = RecordedNetwork(module, traj, X_train=X, y_train=y).network_
    with pytest.raises(ValueError, match=r"^method must be 'exact', 'first_order' or "
                                         r"'second_order', got"):
        net.explain(X[:2], 3, method=method, output=output)


def test_a_loss_for_unflattened_outputs_is_refused_before_any_work():
    """Every analysis hands a user's loss the outputs flattened per sample (B, C); a loss
    written for a module's (B, T, C) outputs is refused up front with that shape, not
    deep inside the decomposition (IndexError) or the unrolled sweep."""
    torch.manual_seed(0)
    n, T, C = 8, 2, 3
    X = torch.randn(n, 4, dtype=torch.float64)
    y = torch.randint(C, (n, T))
    module = torch.nn.Sequential(torch.nn.Linear(4, T * C), torch.nn.Unflatten(1, (T, C))
                                 ).double()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)

    def per_token(out, target):  # cross-entropy over the T positions, (B, T, C) outputs
        return torch.nn.functional.cross_entropy(out.transpose(1, 2), target,
                                                 reduction="none").mean(1)

    with PathRecorder(module, opt, n_samples=n) as rec:
        for _ in range(3):
            rec.set_batch(np.arange(n))
            opt.zero_grad()
            per_token(module(X), y).mean().backward()
            opt.step()
    net = rec.as_network(X.numpy(), y.numpy(), loss=per_token)
    for call in (lambda: net.decompose(X[:2].numpy()),
                 lambda: net.attribute(X[:2].numpy(), method="unrolled", output=0)):
        with pytest.raises(ValueError, match=r"flattened per sample, shape \(B, C\) "
                                             r"\(here \(2, 6\)\)"):
            call()


def test_detector_diagnostics_on_new_data_stand_for_its_estimator(clf, data):
    # New (X, y) are encoded by the estimator that trained the network (its classes_),
    # not by the detector around it.
    X, y = data
    det = OODRankDetector(FrozenEstimator(clf), method="residual").fit(X)
    Xn, yn = X[::2] + 0.1, y[::2]
    a = hessian_trace(det, Xn, yn, n_samples=64, random_state=0)
    b = hessian_trace(clf, Xn, yn, n_samples=64, random_state=0)
    np.testing.assert_array_equal(a.estimates, b.estimates)
    # Against the exact trace of the loss's Hessian on (Xn, yn): Hutchinson's estimate
    # is unbiased (64 Rademacher probes; within 5 standard errors).
    module = module_at(clf)
    names = [n for n, p in module.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    sizes = [p.numel() for p in module.parameters()]
    shapes = [p.shape for p in module.parameters()]

    def loss(theta):
        params = {n: t.reshape(s) for n, t, s in zip(names, theta.split(sizes), shapes)}
        out = torch.func.functional_call(module, params, (torch.as_tensor(Xn),))[:, 0]
        return torch.nn.functional.binary_cross_entropy_with_logits(
            out, torch.as_tensor(yn, dtype=out.dtype))

    exact = float(torch.autograd.functional.hessian(loss, flat).diagonal().sum())
    assert abs(b.trace - exact) <= 5 * b.stderr + 1e-12


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_params_at_keeps_one_point_and_never_pickles_it(storage, data, tmp_path):
    X, y = data
    est = PathKernelMachine(hidden_layer_sizes=(5,), max_iter=4, dtype="float64",
                            random_state=0, trajectory_storage=storage,
                            trajectory_dir=tmp_path / "t" if storage == "disk" else None,
                            ).fit(X, y)
    net, traj = est.network_, est.trajectory_
    reads = []
    real = type(traj).parameters
    traj.parameters = lambda k=-1: reads.append(k) or real(traj, k)

    def expected(k):
        return dict(zip(traj.names, traj._unflatten(real(traj, k))))

    # Every point, read back as recorded; a repeated point (also spelled negatively) is
    # not read again, another one is.
    for k, read in [(0, True), (0, False), (len(traj) - 1, True), (-1, False), (2, True)]:
        n_reads = len(reads)
        got = net.params_at(k)
        assert (len(reads) > n_reads) == read
        want = expected(k)
        assert list(got) == list(want)
        assert all(torch.equal(got[name], want[name]) for name in want)
    # A caller's changes to the dict it got do not reach the kept point.
    net.params_at(2).clear()
    assert list(net.params_at(2)) == list(traj.names)
    # Another trajectory (a copy of the network with it) is read, not the kept point.
    del traj.parameters
    other = PathKernelMachine(hidden_layer_sizes=(5,), max_iter=4, dtype="float64",
                              random_state=1).fit(X, y).trajectory_
    theirs = net.replace(trajectory=other).params_at(2)
    assert torch.equal(theirs[traj.names[0]], other.unflatten(other.parameters(2))[
        traj.names[0]])
    assert not torch.equal(theirs[traj.names[0]], net.params_at(2)[traj.names[0]])
    # The kept point is not part of the pickle (of a saved on-disk trajectory: a temporary
    # one would warn that pickling keeps its directory).
    if storage == "disk":
        traj.save(tmp_path / "saved")
    assert "_kept_point" in vars(net)
    assert "_kept_point" not in vars(pickle.loads(pickle.dumps(net)))


def _module_takes(net, X):
    """Whether the network's module runs on X (its floats in the network's dtype)."""
    x = torch.as_tensor(X)
    if x.is_floating_point():
        x = x.to(net.torch_dtype)
    try:
        with torch.no_grad():
            net.module(x)
    except RuntimeError:
        return False
    return True


def test_check_takes_a_clean_float_array_as_check_input_does(clf, data):
    # The shortcut for plain finite float arrays returns what check_input returns, and
    # everything else (errors included) is check_input's.
    from skpathkernel._network._inputs import check_input

    X, _ = data
    module, traj = clf.network_.module, clf.network_.trajectory
    image = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(6, 1)).double()
    nets = {
        "features": clf.network_,
        "no inputs": TrainedNetwork(module, traj),
        "images": TrainedNetwork(image, PathRecorder(image, torch.optim.SGD(
            image.parameters(), lr=0.1)).trajectory, X_fit=np.zeros((2, 2, 3))),
    }
    rng = np.random.RandomState(0)
    for label, net in nets.items():
        shape = (4, *(net.input_shape or (X.shape[1],)))
        good = rng.randn(*shape)
        candidates = [good, good.astype(np.float32), np.asfortranarray(good),
                      good.astype(np.float16), good.astype(np.int64), good.tolist(),
                      good.reshape(4, -1), good[:0], np.where(good > 1, np.nan, good),
                      np.where(good > 1, np.inf, good), rng.randn(4, 7), good[:, None],
                      np.full(shape, 3e38, dtype=np.float32), np.ma.masked_array(good)]
        for Z in candidates:
            for allow_flat in (False, True):
                try:
                    want = check_input(net.input_shape, net.input_kind, net.module, Z,
                                       allow_flat=allow_flat)
                except ValueError as exc:
                    with pytest.raises(ValueError) as got:
                        net.check(Z, allow_flat=allow_flat)
                    assert str(got.value) == str(exc), label
                    continue
                if net.input_shape is None and not _module_takes(net, want):
                    # Without training inputs the module itself says what it takes.
                    with pytest.raises(ValueError, match="could not take X of shape"):
                        net.check(Z, allow_flat=allow_flat)
                    continue
                got = net.check(Z, allow_flat=allow_flat)
                assert type(got) is type(want) and got.dtype == want.dtype, label
                np.testing.assert_array_equal(got, want)
                assert got.shape == want.shape
    # A clean array is taken as it is: no copy.
    Xc = np.ascontiguousarray(X, dtype=np.float32)
    assert clf.network_.check(Xc) is Xc


@pytest.mark.parametrize("bad", [7, -1])
def test_class_codes_beyond_the_outputs_are_refused_from_every_row(bad):
    """log_loss's targets were probed on their first two rows only: a class code beyond
    the network's outputs further down failed inside the computation with torch's
    "Target 7 is out of bounds" (an IndexError), and on a GPU as a device-side assert
    that leaves every later CUDA call of the process failing."""
    rec, X, y = _three_class_loop(torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]), n_steps=2)
    wrong = y.clone()
    wrong[5] = bad
    est = rec.as_estimator(X, wrong, loss="log_loss")
    message = rf"class codes in \[0, 3\) for the network's 3 outputs, but y_train holds {bad}"
    for verb in (lambda: est.decompose(X[:2]), lambda: est.self_influence(output=0),
                 lambda: est.attribute(X[:2], output=0)):
        with pytest.raises(ValueError, match=message):
            verb()
    # The right codes decompose the network exactly.
    assert rec.as_estimator(X, y, loss="log_loss").decompose(X[:2]).error < 1e-10


def test_image_targets_of_an_image_output_say_how_to_flatten_them():
    """A generator returning images, (n, 1, 2, 2), trained on image targets: the analyses
    read its outputs flattened per sample, and ``loss="squared_error"`` refused the image
    targets saying only that their shape differs from the 4 outputs. The error now says to
    flatten them; flattened (C order), the decomposition closes on the module's output."""
    gen = torch.Generator().manual_seed(0)
    Z = torch.randn(6, 2, generator=gen, dtype=torch.float64)
    Y = torch.rand(6, 1, 2, 2, generator=gen, dtype=torch.float64)
    torch.manual_seed(0)
    lin = torch.nn.Linear(2, 4).double()

    class Images(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, z):
            return torch.tanh(self.lin(z)).reshape(-1, 1, 2, 2)

    module = Images()
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    with PathRecorder(module, opt, n_samples=6) as rec:
        for _ in range(3):
            opt.zero_grad()
            (0.5 * (module(Z) - Y).pow(2).mean()).backward()
            rec.set_batch(np.arange(6))
            opt.step()
    with pytest.raises(ValueError, match=r"reshape\(len\(y_train\), -1\)"):
        rec.as_estimator(Z.numpy(), Y.numpy()).decompose(Z.numpy()[:2])
    res = rec.as_estimator(Z.numpy(), Y.reshape(6, -1).numpy()).decompose(Z.numpy())
    with torch.no_grad():
        truth = module(Z).reshape(6, -1).numpy()
    np.testing.assert_allclose(res.initial + res.contributions.sum(1) + res.regularization,
                               truth, rtol=0, atol=1e-12)
