"""decompose / attribute with n_jobs: query blocks on joblib workers equal the serial call.

The reference is the serial call itself; the quadrature nodes are chosen per chunk of
queries and the blocks are cut at chunk boundaries, so the blocks take the serial call's
nodes and agree with it to round-off (1e-12 relative, float32 paths included), and the
warnings judge the joined result in the calling process.
"""

import joblib
import numpy as np
import pytest
from numpy.testing import assert_allclose

from skpathkernel import PathKernelMachine


@pytest.fixture(scope="module")
def fitted():
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(30, 2))
    y = np.sin(2 * X[:, 0]) + X[:, 1]
    est = PathKernelMachine(hidden_layer_sizes=(8,), solver="adam", max_iter=10,
                            dtype="float64", random_state=0).fit(X, y)
    return est, rng.uniform(-1, 1, size=(7, 2))


def _same(par, serial):
    size = np.abs(serial.prediction).max()
    # The forward passes of a block of rows round like those of all rows, to an ulp.
    assert_allclose(par.initial, serial.initial, rtol=1e-15)
    assert_allclose(par.prediction, serial.prediction, rtol=1e-15)
    assert_allclose(par.contributions, serial.contributions, rtol=0, atol=1e-12 * size)
    assert_allclose(par.regularization, serial.regularization, rtol=0, atol=1e-12 * size)
    # At the serial call's error (float64: round-off; float32: its quadrature's).
    assert abs(par.error - serial.error) <= 1e-12 * size
    if par.contributions.dtype == np.float64 and serial.error <= 1e-12 * size:
        # A float64 path: the blocks' split itself exact, summed here from its parts
        # against the network's own prediction (not only equal to the serial call's).
        rebuilt = par.initial + par.contributions.sum(axis=1) + par.regularization
        assert np.abs(rebuilt - par.prediction).max() <= 1e-12 * size


@pytest.mark.parametrize("backend", ["loky", "threading"])
def test_n_jobs_matches_serial(fitted, backend):
    est, Xq = fitted
    serial = est.decompose(Xq)
    attribution = est.attribute(Xq)
    with joblib.parallel_config(backend=backend):
        _same(est.decompose(Xq, n_jobs=2), serial)
        got = est.attribute(Xq, n_jobs=2)
    assert_allclose(got, attribution, rtol=0, atol=1e-12 * np.abs(serial.prediction).max())


@pytest.mark.parametrize("backend", ["loky", "threading"])
@pytest.mark.parametrize("output", [None, "all"])
def test_explain_n_jobs_matches_serial(fitted, backend, output):
    """The serial explain, and the serial decomposition ranked by hand: the same points
    and contributions (agreeing to tol, as the blocks' nodes are their own)."""
    est, Xq = fitted
    idx, contrib = est.explain(Xq, n_neighbors=5, output=output)
    full = est.decompose(Xq).contributions[:, :, 0]
    by_hand = np.argsort(-np.abs(full), axis=1, kind="stable")[:, :5]
    assert np.array_equal(idx, by_hand)
    with joblib.parallel_config(backend=backend):
        got_idx, got = est.explain(Xq, n_neighbors=5, output=output, n_jobs=2)
    assert np.array_equal(got_idx, idx)
    size = np.abs(est.predict(Xq)).max()
    assert_allclose(got, contrib, rtol=0, atol=1e-12 * size)
    assert_allclose(got[:, :, 0], np.take_along_axis(full, idx, axis=1), rtol=0,
                    atol=1e-12 * size)


def test_workers_results_are_judged_here(fitted):
    est, Xq = fitted
    lrs = est.trajectory_.learning_rates
    recorded = lrs.copy()
    lrs *= 1.5  # a record that is not the training's
    try:
        with joblib.parallel_config(backend="loky"), \
                pytest.warns(UserWarning, match="misses the prediction") as caught:
            est.decompose(Xq, n_jobs=2)
        assert caught[0].filename == __file__
    finally:
        lrs[:] = recorded


def _plain_sgd(seed, n, freq, batch_size, lr, max_iter, dtype, n_queries):
    rng = np.random.RandomState(seed)
    X = rng.uniform(-1, 1, size=(n, 3))
    y = np.sin(freq * X[:, 0]) + X[:, 1] * X[:, 2]
    est = PathKernelMachine(hidden_layer_sizes=(16, 16), solver="sgd", batch_size=batch_size,
                            learning_rate_init=lr, max_iter=max_iter, tol=None, dtype=dtype,
                            random_state=0).fit(X, y)
    return est, rng.uniform(-1, 1, size=(n_queries, 3))


@pytest.fixture(scope="module")
def sgd_fitted():
    return _plain_sgd(1, 40, 2, 10, 0.2, 3, "float64", 9)


@pytest.mark.parametrize("backend", ["loky", "threading"])
def test_plain_sgd_paths_split_their_steps(sgd_fitted, backend, monkeypatch):
    """Plain SGD's steps are independent: each worker takes a range of steps for every
    query, and the ranges' sums equal the serial decomposition, the contracted route
    (attribute) and explain included."""
    from skpathkernel._network import _trained

    est, Xq = sgd_fitted
    serial, attribution = est.decompose(Xq), est.attribute(Xq)
    idx, contrib = est.explain(Xq, n_neighbors=4)
    ranges = []
    run = _trained._decompose_steps

    def spy(start, stop, *args):
        ranges.append((start, stop))
        return run(start, stop, *args)

    if backend == "threading":  # in this process: the spy sees the split
        monkeypatch.setattr(_trained, "_decompose_steps", spy)
    with joblib.parallel_config(backend=backend):
        _same(est.decompose(Xq, n_jobs=2), serial)
        got = est.attribute(Xq, n_jobs=2)
        got_idx, got_contrib = est.explain(Xq, n_neighbors=4, n_jobs=2)
    n = len(est.trajectory_) - 1
    if backend == "threading":
        assert sorted(set(ranges)) == [(0, n // 2), (n // 2, n)]
    size = np.abs(serial.prediction).max()
    assert_allclose(got, attribution, rtol=0, atol=1e-12 * size)
    assert np.array_equal(got_idx, idx)
    assert_allclose(got_contrib, contrib, rtol=0, atol=1e-12 * size)


def test_many_queries_on_plain_sgd_split_the_queries(sgd_fitted, monkeypatch):
    """The cost model: 12 steps of 10 rows against 60 queries, whose reference f at every
    point would cost each step range more than the batches it saves."""
    from skpathkernel._network import _trained

    est, _ = sgd_fitted
    Xq = np.random.RandomState(5).uniform(-1, 1, size=(60, 3))
    serial = est.decompose(Xq)
    called = []
    for name in ("_decompose_steps", "_decompose_rows"):
        run = getattr(_trained, name)
        monkeypatch.setattr(_trained, name, lambda *a, run=run, name=name: (
            called.append(name), run(*a))[1])
    with joblib.parallel_config(backend="threading"):
        _same(est.decompose(Xq, n_jobs=2), serial)
    assert called == ["_decompose_rows"] * 2


def test_step_ranges_count_the_query_blocks_the_chunks_allow(sgd_fitted):
    """Four workers on 100 queries of plain SGD: the adaptive call's query blocks are
    its two node chunks (64 and 36 queries), so a query split's slowest worker would
    capture 64 queries' side of every step, not 25: ranges of steps are cheaper there,
    while a fixed node count's balanced blocks of 25 are cheaper than ranges."""
    from skpathkernel._analysis._decomposition import node_chunk, step_ranges

    est, _ = sgd_fitted
    traj = est.trajectory_
    assert node_chunk(traj, "exact", 100) == 64
    ranges = step_ranges(traj, "exact", "realized", 100, 4)
    assert ranges is not None and len(ranges) > 1
    # A fixed node count chooses no nodes: its query blocks are balanced, 25 each.
    assert step_ranges(traj, "exact", "realized", 100, 4, n_nodes=2) is None


def test_step_ranges_refused_where_the_adjoint_crosses_steps(fitted):
    from skpathkernel._analysis._decomposition import decompose

    est, Xq = fitted  # Adam
    net = est.network_
    X_fit, Y_fit = net._training_data()
    with pytest.raises(ValueError, match="plain SGD"):
        decompose(net.module, net.trajectory, X_fit, Y_fit, net.loss, net.tensor(Xq),
                  intervals=(0, 2))


@pytest.fixture(scope="module")
def sgd32_fitted():
    """A float32 plain SGD path whose steps' node counts vary, with batches large next
    to the queries (the regime where the steps are split)."""
    return _plain_sgd(2, 300, 3, 100, 0.5, 4, "float32", 2)


def _ranges_by_hand(net, Xq, ranges, **kw):
    from skpathkernel._analysis._decomposition import decompose, merge_steps

    X_fit, Y_fit = net._training_data()
    return merge_steps([decompose(net.module, net.trajectory, X_fit, Y_fit, net.loss,
                                  net.tensor(Xq), warn=False, intervals=r, **kw)
                        for r in ranges])[0]


def test_float32_step_ranges_give_the_serial_numbers(sgd32_fitted, monkeypatch):
    """A range replays the node choice of the steps the serial call walks before it, so
    float32 ranges take the serial call's nodes: equal to 1e-12 relative, where ranges
    that restart the choice differ by far more (their nodes are not the serial's). The
    ranges of one step too (cuts 1 and n - 1), whose batch capture is a pass of one
    step: torch's batched GEMM of one matrix is its plain GEMM, which rounded the
    contributions 1.6e-9 and 6.5e-9 relative off the serial call's (AVX2 host) before
    such a pass ran as one of two (_StackedCapture.batched)."""
    from skpathkernel._analysis import _decomposition
    from skpathkernel._analysis._decomposition import decompose
    from skpathkernel._network import _trained

    est, Xq = sgd32_fitted
    net = est.network_
    n = len(net.trajectory) - 1
    serial = est.decompose(Xq)
    assert len(set(serial.n_nodes)) > 1  # the state the ranges must carry over matters
    ranges = []
    run = _trained._decompose_steps

    def spy(start, stop, *args):
        ranges.append((start, stop))
        return run(start, stop, *args)

    monkeypatch.setattr(_trained, "_decompose_steps", spy)
    with joblib.parallel_config(backend="threading"):
        par = est.decompose(Xq, n_jobs=2)
    ranges.sort()  # the threads may start their ranges in either order
    assert len(ranges) == 2 and ranges[0][0] == 0 and ranges[1][1] == n
    assert ranges[0][1] == ranges[1][0]
    _same(par, serial)
    assert np.array_equal(par.n_nodes, serial.n_nodes)
    # The contrast: ranges restarted at their first step take other nodes than the
    # serial call's, at a cut where the ranges that replay take the serial call's. Whether
    # a restart's nodes differ at one given cut depends on the CPU's float32 round-off
    # (at the cut the workers get, equal on an AVX2 host, different on AVX-512 ones):
    # the cut is searched for, the workers' first, then every cut. By hand, in the
    # network's units (est.decompose's are the targets'), against the serial call made
    # the same way.
    X_fit, Y_fit = net._training_data()
    by_hand = decompose(net.module, net.trajectory, X_fit, Y_fit, net.loss, net.tensor(Xq),
                        warn=False)[0]
    assert np.array_equal(by_hand.n_nodes, serial.n_nodes)
    size = np.abs(by_hand.prediction).max()
    replaying = _decomposition.replays
    monkeypatch.setattr(_decomposition, "replays", lambda *a: False)
    for cut in [ranges[0][1], *range(1, n)]:
        restarted = _ranges_by_hand(net, Xq, [(0, cut), (cut, n)])
        if not np.array_equal(restarted.n_nodes, serial.n_nodes):
            break
    else:
        pytest.fail("no cut where restarted ranges take other nodes than the serial call")
    # Restarted, the nodes, and so the sums, move ...
    assert np.abs(restarted.contributions - by_hand.contributions).max() > 1e-10 * size
    # ... where the ranges that replay keep the serial call's, at that cut too, and at
    # the cuts that leave a range one step.
    monkeypatch.setattr(_decomposition, "replays", replaying)
    for at in sorted({cut, 1, n - 1}):
        replayed = _ranges_by_hand(net, Xq, [(0, at), (at, n)])
        assert np.array_equal(replayed.n_nodes, serial.n_nodes)
        assert_allclose(replayed.contributions, by_hand.contributions, rtol=0,
                        atol=1e-12 * size, err_msg=f"cut {at}")


def test_replay_across_query_blocks(sgd32_fitted, monkeypatch):
    """The node choice also carries over from one query block to the next: with a
    memory budget that cuts the queries into blocks, each range replays the steps of
    the blocks before its own and still gives the serial call's numbers."""
    from skpathkernel._analysis import _decomposition
    from skpathkernel._analysis._decomposition import decompose

    est, _ = sgd32_fitted
    Xq = np.random.RandomState(7).uniform(-1, 1, size=(5, 3))
    net = est.network_
    X_fit, Y_fit = net._training_data()
    blocks = []
    run = _decomposition._factored_block
    monkeypatch.setattr(_decomposition, "_factored_block",
                        lambda ctx, Xb, *a, **k: (blocks.append(len(Xb)), run(ctx, Xb, *a, **k))[1])
    # Blocks of two queries (2, 2, 1) on this network: the node choice crosses two block
    # boundaries, and each block's rows are cut into a few chunks. 60,000 (one query a
    # block) checked the same carry-over at four boundaries, but its tiny row chunks
    # took 14x the CPU (163 s for the serial call alone, 11.8 s here).
    budget = 120_000
    serial = decompose(net.module, net.trajectory, X_fit, Y_fit, net.loss, net.tensor(Xq),
                       memory_budget=budget)
    assert len(blocks) > 1
    n = len(net.trajectory) - 1
    for cut in (3, n // 2, n - 2):
        par = _ranges_by_hand(net, Xq, [(0, cut), (cut, n)], memory_budget=budget)
        _same(par, serial)
        assert np.array_equal(par.n_nodes, serial.n_nodes)


def _model_cost(traj, n_queries, bounds, replay):
    """The worst worker's cost of ``bounds`` under step_ranges' model, written out."""
    from skpathkernel._analysis._decomposition import NODES_GUESS, REPLAY_ROWS

    n = len(traj) - 1
    q = (REPLAY_ROWS if replay else NODES_GUESS) * n_queries
    batch = [len(traj.batch(t)) for t in range(traj.n_steps)]
    ref = (n + 1) * n_queries / 2
    costs = []
    for start, stop in bounds:
        cost = ref + sum(batch[start:stop]) + q * (stop - start)
        if stop < n:
            cost += q * (n - stop) if replay else 2 * n_queries
        costs.append(cost)
    return max(costs)


@pytest.mark.parametrize("case", ["sgd32_fitted", "sgd_fitted"])
def test_step_cuts_are_the_cheapest_under_the_model(case, request):
    """Brute force over every cut into two ranges: the one chosen costs the least under
    the cost model; a float32 range replays (the later steps take the larger range), a
    float64 one restarts (an even cut of equal batches)."""
    from skpathkernel._analysis._decomposition import step_ranges

    est, Xq = request.getfixturevalue(case)
    traj = est.network_.trajectory
    n = len(traj) - 1
    replay = case == "sgd32_fitted"
    got = step_ranges(traj, "exact", "realized", len(Xq), 2)
    best = min(_model_cost(traj, len(Xq), [(0, c), (c, n)], replay) for c in range(1, n))
    assert got is not None and got[0][0] == 0 and got[-1][1] == n
    assert _model_cost(traj, len(Xq), got, replay) == best
    if replay:
        assert got[0][1] < n - got[0][1]
    else:
        assert got == [(0, n // 2), (n // 2, n)]
    # Three workers: contiguous ranges that cover the path.
    three = step_ranges(traj, "exact", "realized", len(Xq), 3)
    assert [r[0] for r in three[1:]] == [r[1] for r in three[:-1]] and len(three) == 3
    # Many queries: their captures at every node dominate, the queries are split.
    assert step_ranges(traj, "exact", "realized", 200, 2) is None


@pytest.fixture(scope="module")
def adam32_fitted():
    """A float32 Adam path (query blocks: the adjoint runs through every step) whose
    queries need different node counts at some steps."""
    rng = np.random.RandomState(3)
    X = rng.uniform(-1, 1, size=(80, 3))
    y = np.sin(3 * X[:, 0]) + X[:, 1] * X[:, 2]
    est = PathKernelMachine(hidden_layer_sizes=(16, 16), solver="adam", batch_size=20,
                            learning_rate_init=0.05, max_iter=3, tol=None, dtype="float32",
                            random_state=0).fit(X, y)
    return est, rng.uniform(-2, 2, size=(40, 3))


@pytest.mark.parametrize("backend", ["loky", "threading"])
def test_float32_query_blocks_give_the_serial_numbers(adam32_fitted, backend):
    """Each chunk of queries chooses its nodes from its own residuals, and the blocks
    are cut at chunk boundaries: a float32 path's blocks give the serial call's nodes
    and numbers to 1e-12 relative (a block that chose from its own queries moved them
    by its quadrature's error, about 1e-8 here), with the serial call's checks."""
    from skpathkernel._analysis._decomposition import node_chunk

    est, Xq = adam32_fitted
    serial = est.decompose(Xq)
    # Chunks that chose differently: a choice from all the queries would differ too.
    assert node_chunk(est.trajectory_, "exact", len(Xq)) < len(Xq) // 2
    with joblib.parallel_config(backend=backend):
        par = est.decompose(Xq, n_jobs=2)
    _same(par, serial)
    assert np.array_equal(par.n_nodes, serial.n_nodes)
    assert_allclose(par.step_errors, serial.step_errors, rtol=1e-12, atol=0)
    # Against the independent reference of the decomposition: the prediction.
    size = np.abs(serial.prediction).max()
    assert np.abs(par.reconstruction - par.prediction).max() <= 1e-5 * size


def test_float32_query_blocks_under_a_memory_cap(adam32_fitted):
    """A memory budget whose blocks hold fewer queries than a node chunk caps the chunk
    to a smaller power of two, which still divides the chunk the workers' blocks are cut
    at: the blocks give the serial call's nodes and numbers. (A cap to the block's 7
    queries, not a power of two, cuts the serial chunks where no block starts.)"""
    from skpathkernel._analysis import _decomposition

    est, Xq = adam32_fitted
    budget = est.get_params()["memory_budget"]
    # Blocks of 4 to 7 queries (in the query side's half, with the adjoint's copies, the
    # per-contribution check's rows, and beside a step's parameter points and what the
    # call holds: the float32 data and queries, their outputs): chunks of 8 capped to 4.
    est.set_params(memory_budget=220_000)
    quads = []
    init = _decomposition._Quadrature.__init__

    def counted(self, *args, **kwargs):
        quads.append(self)
        init(self, *args, **kwargs)

    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(_decomposition._Quadrature, "__init__", counted)
            serial = est.decompose(Xq)
        with joblib.parallel_config(backend="threading"):
            par = est.decompose(Xq, n_jobs=2)
    finally:
        est.set_params(memory_budget=budget)
    # The cap binds: ten chunks of 4 queries, not five of the rule's 8.
    assert _decomposition.node_chunk(est.trajectory_, "exact", len(Xq)) == 8
    assert len(quads) == len(Xq) // 4
    _same(par, serial)
    assert np.array_equal(par.n_nodes, serial.n_nodes)


@pytest.mark.parametrize("kwargs", [dict(method="first_order"), dict(n_nodes=2),
                                    dict(method="exact")])
def test_query_blocks_follow_the_chunks_only_where_nodes_are_chosen(kwargs, monkeypatch):
    """An adaptive node choice cuts the workers' query blocks at its chunks (100
    queries of plain SGD: 64 and 36); a method that chooses no nodes balances them by
    rows (50 and 50). Both give the serial call's numbers."""
    import skpathkernel._network._trained as trained

    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(30, 2))
    y = np.sin(2 * X[:, 0]) + X[:, 1]
    est = PathKernelMachine(hidden_layer_sizes=(8,), solver="sgd", momentum=0.0,
                            batch_size=10, max_iter=2, tol=None, dtype="float64",
                            random_state=0).fit(X, y)
    Xq = rng.uniform(-1, 1, size=(100, 2))
    # Query blocks, not ranges of steps: the path has too few steps to split.
    monkeypatch.setattr(trained, "step_ranges", lambda *args, **kw: None)
    blocks = []
    run = trained._decompose_rows

    def spy(rows, *args):
        blocks.append(len(rows))
        return run(rows, *args)

    monkeypatch.setattr(trained, "_decompose_rows", spy)
    serial = est.decompose(Xq, **kwargs)
    with joblib.parallel_config(backend="threading"):
        par = est.decompose(Xq, n_jobs=2, **kwargs)
    adaptive = kwargs.get("method") == "exact"
    assert sorted(blocks) == ([36, 64] if adaptive else [50, 50])
    assert_allclose(par.contributions, serial.contributions, rtol=1e-12,
                    atol=1e-12 * np.abs(serial.contributions).max())


def test_second_order_on_threads_gives_the_serial_numbers():
    """The second-order term's Hessian-vector rows use forward-mode AD, whose dual
    levels belong to the process: query blocks on threads entered and left each
    other's level (a RuntimeError, or the process aborted)."""
    rng = np.random.RandomState(3)
    X = rng.uniform(-1, 1, size=(40, 3))
    y = np.sin(3 * X[:, 0]) + X[:, 1] * X[:, 2]
    est = PathKernelMachine(hidden_layer_sizes=(8,), solver="adam", batch_size=10,
                            learning_rate_init=0.05, max_iter=2, tol=None,
                            dtype="float64", random_state=0).fit(X, y)
    Xq = rng.uniform(-2, 2, size=(20, 3))
    serial = est.decompose(Xq, method="second_order")
    for _ in range(2):
        with joblib.parallel_config(backend="threading"):
            par = est.decompose(Xq, method="second_order", n_jobs=2)
        assert_allclose(par.contributions, serial.contributions, rtol=1e-12,
                        atol=1e-12 * np.abs(serial.contributions).max())


def test_float32_sgd_chunks_keep_their_own_captures(monkeypatch):
    """Plain SGD's float32 pair products read each chunk's own capture, not rows of the
    group's joined one: a view at a row offset is memory laid out unlike a serial call's,
    and a BLAS whose kernels depend on alignment may round it differently."""
    from skpathkernel._analysis import _decomposition

    rng = np.random.RandomState(0)
    X = rng.uniform(-2, 2, size=(60, 3))
    y = np.sin(X[:, 0]) + X[:, 1] * X[:, 2]
    est = PathKernelMachine(hidden_layer_sizes=(16,), solver="sgd", momentum=0.0,
                            batch_size=20, max_iter=3, tol=None, dtype="float32",
                            random_state=0).fit(X, y)
    Xq = rng.uniform(-2, 2, size=(40, 3))
    captured, read = set(), []
    real_capture = _decomposition._Context.capture_nodes
    real_shares = _decomposition.factor_shares

    def capture(self, points, X, W, **kw):
        nodes = real_capture(self, points, X, W, **kw)
        captured.update(t.delta.data_ptr() for node in nodes for t in node)
        return nodes

    def shares(nodes, weights, batch, dhat):
        read.extend(t.delta.data_ptr() for node in nodes for t in node)
        return real_shares(nodes, weights, batch, dhat)

    monkeypatch.setattr(_decomposition._Context, "capture_nodes", capture)
    monkeypatch.setattr(_decomposition, "factor_shares", shares)
    result = est.decompose(Xq)
    # Several chunks of queries, taken together at the steps where they agree.
    assert _decomposition.node_chunk(est.trajectory_, "exact", len(Xq)) < len(Xq) and read
    assert set(read) <= captured
    size = np.abs(result.prediction).max()
    assert np.abs(result.reconstruction - result.prediction).max() <= 1e-5 * size
