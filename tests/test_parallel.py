"""n_jobs: Grams and detector scores in joblib row blocks equal the serial ones, and torch
threads per task stay within the cores (the Dask cluster runs are in test_dask.py)."""

import os
import pickle
import threading
import time
import warnings

import joblib
import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose
from sklearn.base import clone
from sklearn.frozen import FrozenEstimator
from sklearn.gaussian_process import GaussianProcessRegressor

from skpathkernel import OODRankDetector, PathKernelClassifier, PathKernelMachine
from skpathkernel._device import torch_threads
from skpathkernel._parallel import limit_torch_threads, map_row_blocks
from skpathkernel.kernels import PathKernel, TangentKernel

# The old defaults, pinned (tanh, a fixed number of epochs; OLD: plain SGD): the round-off
# bounds below were measured on them.
SMALL = dict(hidden_layer_sizes=(6, 5), max_iter=6, dtype="float64", device="cpu",
             activation="tanh", tol=None, random_state=0)
OLD = dict(solver="sgd", learning_rate_init=0.01)


def _data(n=23, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.uniform(-1, 1, size=(n, 3))
    return X, np.sin(2 * X[:, 0]) + X[:, 1] ** 2


@pytest.fixture(scope="module")
def fitted():
    X, y = _data()
    reg = PathKernelMachine(solver="adam", learning_rate_init=0.01, **SMALL).fit(X, y)
    labels = np.digitize(y, np.quantile(y, [0.33, 0.66]))
    clf = PathKernelClassifier(solver="sgd", learning_rate_init=0.05, batch_size=8,
                               **SMALL).fit(X, labels)
    return reg, clf


def _assert_same(K_parallel, K_serial):
    # float64 round-off only: the blocks reorder some sums.
    assert K_parallel.shape == K_serial.shape
    assert_allclose(K_parallel, K_serial, rtol=1e-12, atol=1e-12 * np.abs(K_serial).max())


@pytest.mark.parametrize("kind", ["tangent", "path"])
@pytest.mark.parametrize("normalized", [False, True])
@pytest.mark.parametrize("which", [0, 1])
def test_kernel_row_blocks_equal_serial(fitted, kind, normalized, which):
    est = fitted[which]
    X, _ = _data()
    Y, _ = _data(n=9, seed=1)
    kernel = (TangentKernel(est, step=2, normalized=normalized) if kind == "tangent"
              else PathKernel(est, start=1, normalized=normalized))
    parallel = clone(kernel).set_params(n_jobs=3)
    with joblib.parallel_config(backend="threading"):
        _assert_same(parallel(X), kernel(X))
        _assert_same(parallel(X, Y), kernel(X, Y))
        _assert_same(parallel.diag(X), kernel.diag(X))
        # More workers than rows: one row per block.
        _assert_same(clone(kernel).set_params(n_jobs=4)(X[:2], Y), kernel(X[:2], Y))


def test_kernel_n_jobs_on_loky_processes(fitted):
    X, _ = _data()
    kernel = PathKernel(fitted[0])
    _assert_same(PathKernel(fitted[0], n_jobs=2)(X), kernel(X))


def test_n_jobs_is_not_a_hyperparameter(fitted):
    kernel = TangentKernel(fitted[0], n_jobs=2)
    assert kernel.get_params()["n_jobs"] == 2
    assert kernel.hyperparameters == [] and kernel.theta.shape == (0,)
    assert kernel.n_dims == 0 and kernel.bounds.size == 0
    cloned = clone(kernel)
    assert cloned.estimator is fitted[0] and cloned.n_jobs == 2 and cloned == kernel
    assert kernel.clone_with_theta(kernel.theta).n_jobs == 2
    X, y = _data()
    # The optimizer sees no hyperparameter; the kernel stays the one given.
    gp = GaussianProcessRegressor(kernel=PathKernel(fitted[0], n_jobs=2), alpha=1e-2)
    gp.fit(X, y)
    assert gp.kernel_.n_jobs == 2
    ref = GaussianProcessRegressor(kernel=PathKernel(fitted[0]), alpha=1e-2).fit(X, y)
    assert_allclose(gp.predict(X), ref.predict(X), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", ["residual", "alignment", "local"])
def test_detector_scores_in_row_blocks_equal_serial(method):
    X, _ = _data(n=30)
    Q, _ = _data(n=11, seed=2)
    det = OODRankDetector(PathKernelMachine(normalize_y=False, **OLD, **SMALL),
                          method=method).fit(X)
    parallel = clone(det).set_params(n_jobs=2).fit(X)
    with joblib.parallel_config(backend="threading"):
        # Scores in [-1, 1]; the residual's 1 - explained / diag cancels (explained /
        # diag = 1 - 1e-4 here) and its span solve runs on a training Gram of condition
        # ~1e10, so changing the order of the sums by row blocks moves a score by ~1e-12
        # (measured, numpy 2.4); a wrong block would be off by the score itself (>= 4e-5).
        assert_allclose(parallel.score_samples(Q), det.score_samples(Q), rtol=0, atol=1e-10)
        np.testing.assert_array_equal(parallel.predict(Q), det.predict(Q))


def test_tasks_share_the_cores():
    # torch's thread count recorded inside each task: n_jobs x threads <= cores.
    def threads(X_rows):
        return np.array([[torch.get_num_threads(), os.getpid()]] * len(X_rows))

    cores = joblib.cpu_count()
    X = np.zeros((8, 1))
    before = torch.get_num_threads()
    for backend, n_jobs in [("threading", 2), ("threading", 4), ("loky", 2)]:
        with joblib.parallel_config(backend=backend):
            out = np.vstack(map_row_blocks(threads, X, n_jobs))
        n_tasks = min(n_jobs, len(X))
        assert np.all(out[:, 0] <= max(1, cores // n_tasks)), (backend, n_jobs)
        assert n_tasks * out[:, 0].max() <= max(cores, n_tasks)
    assert torch.get_num_threads() == before
    # Serial: nothing changes.
    assert np.all(map_row_blocks(threads, X, None)[0][:, 0] == before)


def test_limit_torch_threads_restores_and_never_raises():
    before = torch.get_num_threads()
    with limit_torch_threads(before + 4):
        assert torch.get_num_threads() == before
    torch.set_num_threads(2)
    try:
        with limit_torch_threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _in_new_thread(func):
    """``func()`` on a thread started now: what a thread's first use of torch sees."""
    out = []
    thread = threading.Thread(target=lambda: out.append(func()))
    thread.start()
    thread.join()
    return out[0]


def test_torch_keeps_a_count_per_thread_and_new_threads_take_the_last_set():
    # What the limits below rely on (torch 2.13, OpenMP build): a thread's set_num_threads
    # leaves another thread's count alone, and a thread takes the value set last, by any
    # thread, when it first uses torch (not when it starts).
    torch.set_num_threads(3)
    started, lowered = threading.Event(), threading.Event()

    def late():
        started.set()
        lowered.wait()
        return torch.get_num_threads()

    out = []
    thread = threading.Thread(target=lambda: out.append(late()))
    thread.start()
    started.wait()
    assert _in_new_thread(lambda: (torch.set_num_threads(2), torch.get_num_threads())[1]) == 2
    lowered.set()
    thread.join()
    assert torch.get_num_threads() == 3
    assert out == [2]
    assert _in_new_thread(torch.get_num_threads) == 2


@pytest.mark.parametrize("limit", [limit_torch_threads, torch_threads])
def test_thread_limits_on_threads_restore_every_count(limit):
    """Two limits on threads, in the order that left torch's count for new threads
    lowered: A limits itself to 2; B, whose first use of torch comes then (it starts
    from 2), limits itself to 1; A ends, then B. Each ran with its own limit; after,
    the caller, A, B, a thread started before that first uses torch now, and a new
    thread have the count they had, or would have had, without the limits."""
    torch.set_num_threads(4)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def run_a():
        seen["A before"] = torch.get_num_threads()
        with limit(2):
            a_in.set()
            b_in.wait()
            seen["A in"] = torch.get_num_threads()
        seen["A after"] = torch.get_num_threads()
        a_out.set()

    def run_b():
        a_in.wait()
        seen["B before"] = torch.get_num_threads()
        with limit(1):
            seen["B in"] = torch.get_num_threads()
            b_in.set()
            a_out.wait()
            seen["B in, A out"] = torch.get_num_threads()
        seen["B after"] = torch.get_num_threads()

    done = threading.Event()

    def run_late():
        done.wait()
        seen["late"] = torch.get_num_threads()

    threads = [threading.Thread(target=f) for f in (run_a, run_b, run_late)]
    for thread in threads:
        thread.start()
    for thread in threads[:2]:
        thread.join()
    done.set()
    threads[2].join()
    assert seen == {"A before": 4, "A in": 2, "A after": 4, "B before": 2, "B in": 1,
                    "B in, A out": 1, "B after": 2, "late": 4}
    assert torch.get_num_threads() == 4
    assert _in_new_thread(torch.get_num_threads) == 4


@pytest.mark.parametrize("limit", [limit_torch_threads, torch_threads])
def test_thread_limit_keeps_the_count_new_threads_take(limit):
    # Another thread set 3 last: new threads take 3, the caller keeps its 4. A limit
    # here restores both, not the caller's count for everyone.
    torch.set_num_threads(4)
    _in_new_thread(lambda: torch.set_num_threads(3))
    with limit(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 4
    assert _in_new_thread(torch.get_num_threads) == 3


@pytest.mark.parametrize("prefitted", [False, True])
def test_detector_pickles_with_its_network(prefitted):
    # Workers receive the detector pickled: its mirrored network travels inside estimator_.
    X, y = _data(n=20)
    if prefitted:
        net = PathKernelMachine(**SMALL).fit(X, y)
        det = OODRankDetector(FrozenEstimator(net)).fit(X)
    else:
        det = OODRankDetector(PathKernelMachine(**SMALL)).fit(X)
    back = pickle.loads(pickle.dumps(det))
    assert back.module_ is back.estimator_.module_
    assert next(back.module_.parameters()).dtype == torch.float64
    np.testing.assert_array_equal(back.score_samples(X[:5]), det.score_samples(X[:5]))


def test_loky_tasks_get_an_in_memory_path_by_reference(monkeypatch):
    """Tasks for loky processes carry an in-memory path as the name of its shared files,
    not the path (their pickles are smaller than the same tasks' with the path by value
    by most of the path's own pickle); unpickled (run here) they give the numbers of the
    tasks with the path by value (threads: nothing is shared); a call of a single block
    shares nothing."""
    import skpathkernel._parallel as parallel

    X, y = _data()
    # Batches of 4: a path of 37 points, much larger than the module.
    est = PathKernelMachine(solver="adam", learning_rate_init=0.01, batch_size=4,
                            **SMALL).fit(X, y)
    traj = est.network_.trajectory
    by_value = len(pickle.dumps(traj))
    sent = []

    def round_trip(func, n_jobs, calls):
        if len(calls) == 1:
            return [func(*calls[0])]
        blobs = [pickle.dumps(call) for call in calls]
        sent.append([len(blob) for blob in blobs])
        return [func(*pickle.loads(blob)) for blob in blobs]

    monkeypatch.setattr(parallel, "map_calls", round_trip)
    cases = {
        "rows": lambda n: PathKernel(est, n_jobs=n)(X[:6], X),
        "diag": lambda n: PathKernel(est, n_jobs=n).diag(X),
        "steps": lambda n: PathKernel(est, n_jobs=n, split="steps")(X[:6], X),
        "unrolled": lambda n: est.attribute(X[:4], method="unrolled", n_jobs=n),
        "detector": lambda n: OODRankDetector(FrozenEstimator(est), n_jobs=n)
        .fit(X).score_samples(X[:6]),
    }
    with joblib.parallel_config(backend="loky"):
        for case in cases.values():
            case(None)
    assert not sent and "_shared_copy" not in traj.__dict__
    for name, case in cases.items():
        with joblib.parallel_config(backend="threading"):
            plain = case(2)
        with joblib.parallel_config(backend="loky"):
            shared = case(2)
        assert [len(sizes) for sizes in sent] == [2, 2], name
        assert max(sent[1]) < min(sent[0]) - 0.9 * by_value, (name, sent, by_value)
        sent.clear()
        np.testing.assert_array_equal(shared, plain, err_msg=name)


@pytest.mark.parametrize("n_jobs", ["two", 1.5])
@pytest.mark.parametrize("call", ["decompose", "attribute", "unrolled", "self_influence",
                                  "explain", "PathKernel", "split_steps", "diag",
                                  "TangentKernel"])
def test_a_bad_n_jobs_is_named(fitted, call, n_jobs):
    # A string or float n_jobs surfaced as joblib's "'<' not supported between instances
    # of 'str' and 'int'" or "'float' object cannot be interpreted as an integer", naming
    # no parameter (API.md, "Errors and bad input").
    est = fitted[0]
    X, _ = _data(n=5)
    calls = {
        "decompose": lambda: est.decompose(X, n_jobs=n_jobs),
        "attribute": lambda: est.attribute(X, n_jobs=n_jobs),
        "unrolled": lambda: est.attribute(X, method="unrolled", n_jobs=n_jobs),
        "self_influence": lambda: est.self_influence(n_jobs=n_jobs),
        "explain": lambda: est.explain(X, 2, n_jobs=n_jobs),
        "PathKernel": lambda: PathKernel(est, n_jobs=n_jobs)(X),
        "split_steps": lambda: PathKernel(est, n_jobs=n_jobs, split="steps")(X),
        "diag": lambda: PathKernel(est, n_jobs=n_jobs).diag(X),
        "TangentKernel": lambda: TangentKernel(est, n_jobs=n_jobs)(X),
    }
    with pytest.raises(TypeError, match=r"n_jobs must be an int or None, got " + repr(n_jobs)):
        calls[call]()


def _in_threads(calls, n_threads=4, rounds=5, timeout=120):
    """Every call of ``calls`` (name -> function) from ``n_threads`` threads released
    together, ``rounds`` times each; the largest difference from the call's serial result
    per name, and the exceptions raised. Fails, rather than hangs, on a deadlock."""
    import threading

    refs = {name: np.asarray(call(), dtype=np.float64) for name, call in calls.items()}
    worst = dict.fromkeys(calls, 0.0)
    errors = []
    barrier = threading.Barrier(n_threads)

    def work(i):
        barrier.wait()
        names = list(calls)
        try:
            for r in range(rounds):
                name = names[(i + r) % len(names)]
                got = np.asarray(calls[name](), dtype=np.float64)
                worst[name] = max(worst[name], float(np.abs(got - refs[name]).max()))
        except Exception as exc:  # reported below, with the others
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "the threads did not finish (deadlock?)"
    return worst, errors


def test_verbs_from_several_threads_on_one_estimator_match_serial():
    # functional_call swaps the module's parameters and the engine hooks the module:
    # concurrent verbs on one network read each other's (transform was off by 70% of its
    # scale, predict by 0.9 beside a decompose, attribute raised). They take turns.
    X, y = _data(60)
    est = PathKernelMachine(hidden_layer_sizes=(16,), max_iter=10, dtype="float64",
                            random_state=0).fit(X, y)
    det = OODRankDetector(clone(est), method="residual").fit(X, y)
    calls = {"predict": lambda: est.predict(X), "transform": lambda: est.transform(X[:20]),
             "decompose": lambda: est.decompose(X[:8]).contributions,
             "attribute": lambda: est.attribute(X[:6]),
             "ood": lambda: det.score_samples(X[:10])}
    worst, errors = _in_threads(calls)
    assert errors == []
    assert max(worst.values()) <= 1e-12, worst


def test_verbs_with_threaded_n_jobs_do_not_wait_on_their_own_lock():
    # A verb holds its module's lock while its n_jobs tasks run in threads on copies of
    # the module: none of them may wait for the lock of the module it copied.
    X, y = _data(60)
    est = PathKernelMachine(hidden_layer_sizes=(16,), max_iter=10, dtype="float64",
                            random_state=0).fit(X, y)
    det = OODRankDetector(clone(est), method="residual").fit(X, y)
    serial = {"attribute": est.attribute(X[:6]), "influence": est.self_influence(),
              "path": PathKernel(est)(X[:10]), "ood": det.score_samples(X[:10])}

    def parallel():
        with joblib.parallel_backend("threading", n_jobs=2):
            return {"attribute": est.attribute(X[:6], n_jobs=2),
                    "influence": est.self_influence(n_jobs=2),
                    "path": PathKernel(est, n_jobs=2)(X[:10]),
                    "ood": det.score_samples(X[:10])}

    worst, errors = _in_threads({"all": lambda: np.concatenate(
        [np.ravel(v) for v in parallel().values()])}, n_threads=1, rounds=1)
    assert errors == [] and worst["all"] <= 1e-12
    got = parallel()
    for name, value in serial.items():
        # Other row blocks sum in another order: float64 round-off (the residual scores,
        # 1 - cos^2 near 0, to 1e-9 of their unit scale).
        assert_allclose(got[name], value, rtol=1e-10, atol=1e-9)


def test_fits_on_threads_are_their_serial_fits():
    # A fit seeds torch's global generator for the module's initial weights: fits on
    # threads (joblib's threading backend, a multi-threaded Dask worker) took each
    # other's draws, and a fork's restore rewound another fit's generator, so the same
    # random_state trained another network (decision values off by 1.3 in a threaded
    # GridSearchCV). Each fit is compared with the same fit run alone.
    X, y = _data(40)
    labels = (y > np.median(y)).astype(int)
    calls = {
        f"seed{seed}": (lambda seed=seed: PathKernelClassifier(
            hidden_layer_sizes=(64, 64), max_iter=2, tol=None, dtype="float64",
            device="cpu", random_state=seed).fit(X, labels).decision_function(X))
        for seed in range(4)}
    worst, errors = _in_threads(calls, n_threads=8, rounds=6)
    assert errors == []
    assert max(worst.values()) == 0.0, worst


def test_fits_on_threads_train_at_once():
    # The seeded sections of fits are exclusive for the construction only: one fit's
    # training (seeded, for a layer that draws) must not hold the others back.
    import threading

    training, released = threading.Event(), threading.Event()
    timed_out = []

    def wait(grad):
        training.set()
        if not released.wait(10):
            timed_out.append(grad)
        return grad

    class Waiting(torch.nn.Module):
        """A linear model whose backward passes (training steps, not the probes) wait
        until the other fit has finished."""

        def __init__(self, n_features_in, n_outputs):
            super().__init__()
            self.linear = torch.nn.Linear(n_features_in, n_outputs)

        def forward(self, x):
            out = self.linear(x)
            if out.requires_grad:
                out.register_hook(wait)
            return out

    X, y = _data(20)
    first = PathKernelMachine(module=Waiting, max_iter=2, tol=None, random_state=0,
                              device="cpu")
    thread = threading.Thread(target=first.fit, args=(X, y), daemon=True)
    thread.start()
    try:
        assert training.wait(10)
        PathKernelMachine(hidden_layer_sizes=(4,), max_iter=2, tol=None, random_state=0,
                          device="cpu").fit(X, y)
        # Done while the first fit's step still waits for it (no wait timed out).
        waited = bool(timed_out)
    finally:
        released.set()
        thread.join(30)
    assert not waited, "the second fit waited for the first one's training"
    assert hasattr(first, "network_")


def test_a_fit_on_a_thread_keeps_its_draws_from_a_training_that_draws():
    # A training that draws (a dropout layer in training mode) ran outside the generators'
    # lock: its draws, from torch's global generator, interleaved with the seeded
    # construction of a fit on another thread, which then started from another network
    # than its random_state's (predictions 0.3 off the serial fit's).
    import threading

    spinning, constructed = threading.Event(), threading.Event()

    class Drawing(torch.nn.Module):
        """Dropout in training mode whose first training forward keeps drawing from the
        global generator until the other fit is done (3 s at most)."""

        def __init__(self, n_features_in, n_outputs):
            super().__init__()
            self.linear = torch.nn.Linear(n_features_in, n_outputs)
            self.drop = torch.nn.Dropout(0.1)
            self.spun = False

        def forward(self, x):
            if torch.is_grad_enabled() and self.training and not self.spun:
                self.spun = True
                spinning.set()
                start = time.monotonic()
                while not constructed.is_set() and time.monotonic() - start < 3:
                    torch.rand(1)
            return self.linear(self.drop(x))

    def slow(n_features_in, n_outputs):
        # A construction that lets other threads run between its draws.
        first = torch.nn.Linear(n_features_in, 8)
        time.sleep(0.05)
        return torch.nn.Sequential(first, torch.nn.Tanh(), torch.nn.Linear(8, n_outputs))

    X, y = _data(20)
    other = dict(module=slow, max_iter=1, tol=None, random_state=1, device="cpu",
                 dtype="float64")
    serial = PathKernelMachine(**other).fit(X, y).predict(X)
    first = PathKernelMachine(module=Drawing, max_iter=2, tol=None, random_state=0,
                              device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dropout layer's, on the thread
        thread = threading.Thread(target=first.fit, args=(X, y), daemon=True)
        thread.start()
        try:
            assert spinning.wait(30)
            got = PathKernelMachine(**other).fit(X, y).predict(X)
        finally:
            constructed.set()
            thread.join(30)
    assert_allclose(got, serial, rtol=0, atol=0)


def test_overlapping_trainings_on_threads_restore_the_callers_generator():
    # Each training's seeded section saved the generator state it found and restored it
    # when done: a second one entered while the first ran saved the first's seeded state,
    # and, ending last, left torch's global generator there for good (at the other
    # fit's random_state + 1, not the caller's).
    import threading

    from skpathkernel._device import seeded_torch

    first_in, second_in, first_out = (threading.Event() for _ in range(3))

    def first():
        with seeded_torch(1, torch.device("cpu"), exclusive=False):
            first_in.set()
            assert second_in.wait(10)
        first_out.set()

    def second():
        assert first_in.wait(10)
        with seeded_torch(2, torch.device("cpu"), exclusive=False):
            second_in.set()
            assert first_out.wait(10)

    torch.manual_seed(12345)
    before = torch.get_rng_state()
    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_non_exclusive_seeding_that_fails_closes_its_block():
    """A seed torch refuses (out of its range) raised inside the block's count: the count
    of open blocks stayed 1, so the last block of every later overlap never restored the
    caller's generator."""
    from skpathkernel import _device

    cpu = torch.device("cpu")
    torch.manual_seed(123)
    state = torch.get_rng_state()
    with pytest.raises((RuntimeError, ValueError), match="(?i)overflow"):
        with _device.seeded_torch(2**70, cpu, exclusive=False):
            pass
    assert _device._OPEN["blocks"] == 0
    assert torch.equal(torch.get_rng_state(), state)
    with _device.seeded_torch(5, cpu, exclusive=False):
        torch.rand(3)
    assert torch.equal(torch.get_rng_state(), state)
