"""Recording in parts (``_buffers.Segments``) against bad1034's doubling buffers.

Three measurements, the old code loaded beside this tree as a second package (a copy of
bad1034's ``skpathkernel`` renamed, ``--base``):

``bits``: recorded paths of both sides, every trajectory array compared bit for bit
(SGD, momentum, Adam, AdamW, RMSprop, ``record_every`` 1 and 3, storage memory / disk /
auto, small budgets that force many parts and moves to disk, float16 / bfloat16
compression, paths read while recording goes on, ``resume_from``, the estimators'
``warm_start`` and ``partial_fit``).

``memory``: one fresh process per run and side, alternating sides: the recorder's
buffers by their own count (the largest held after a step, and during a doubling's copy
the old and the new buffers together) and the process's ``VmHWM`` above its high-water
mark after a warm-up of the same training without a recorder (so what the recording
added, resident).

``time``: the recorded loop's CPU time and one analysis on its path, and an estimator's
fit, the two sides alternating in one process, pinned by the caller (``taskset``),
medians. ``step``: the recorder's own calls per step alone, alike.

    taskset -c 0 python -m benchmarks.bench_recording_segments bits --base /tmp/sb/basepkg
"""

import argparse
import copy
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.01),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
}


def _net(n_params, seed=0, dtype=torch.float32):
    """A d-w-1 tanh MLP of about ``n_params`` parameters (d = 3 w)."""
    w = max(2, int(round((n_params / 3) ** 0.5)))
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3 * w, w), torch.nn.Tanh(),
                               torch.nn.Linear(w, 1)).to(dtype)


def _data(net, n=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    d = net[0].in_features
    dtype = net[0].weight.dtype
    return (torch.randn(n, d, generator=g, dtype=dtype),
            torch.randn(n, 1, generator=g, dtype=dtype))


def _step(net, opt, X, y, rec, step, batch=8):
    idx = np.arange(batch) + (step % 2) * (len(X) - batch)
    opt.zero_grad()
    (0.5 * (net(X[idx]) - y[idx]) ** 2).mean().backward()
    if rec is not None:
        rec.set_batch(idx)
    opt.step()


def _arrays(traj, prefix=""):
    """Every array a trajectory holds, by name."""
    out = {f"{prefix}param{k}": traj.parameters(k).numpy() for k in range(len(traj))}
    for k in range(len(traj) - 1):
        for key, v in traj.optimizer_state(k).items():
            out[f"{prefix}state-{key}{k}"] = v.numpy()
    for name in ("steps", "learning_rates", "_batch_indices", "_batch_offsets",
                 "_state_steps", "_step_lrs", "_pools", "_pool_weights"):
        v = getattr(traj, name)
        if v is not None:
            out[prefix + name] = np.asarray(v)
    for key, v in traj._extras().items():
        if v is not None:
            out[f"{prefix}extra-{key}"] = np.asarray(v)
    out[prefix + "storage"] = np.array(traj.storage)
    out[prefix + "compression"] = np.array(str(traj.compression))
    return out


def _record(pkg, *, opt_name, n_params, steps, every, storage, budget, compression,
            reads, dtype=torch.float32, resume_at=None, directory=None):
    """A recorded loop of ``pkg`` (a module); the paths read at ``reads`` and at the end
    (with ``resume_at``: interrupted there, saved, loaded and resumed)."""
    net = _net(n_params, dtype=dtype)
    X, y = _data(net)
    opt = OPTIMIZERS[opt_name](net.parameters())
    kw = dict(record_every=every, n_samples=len(X), storage=storage, memory_budget=budget,
              compression=compression, directory=directory)
    rec = pkg.PathRecorder(net, opt, **kw)
    out = {}
    for step in range(steps):
        if resume_at is not None and step == resume_at:
            path = os.path.join(directory, f"ckpt{id(rec)}")
            rec.trajectory.save(path)
            state = (copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict()))
            rec.close()
            del rec
            net.load_state_dict(state[0])
            opt.load_state_dict(state[1])
            rec = pkg.PathRecorder(net, opt, resume_from=pkg.Trajectory.load(path), **kw)
        _step(net, opt, X, y, rec, step)
        if step in reads:
            out.update(_arrays(rec.trajectory, f"read{step}-"))
    out.update(_arrays(rec.trajectory, "end-"))
    rec.close()
    return out


def _estimator(pkg, *, solver, storage, budget, calls, compression=None, directory=None):
    """An estimator's path after ``calls`` (``fit``, ``warm`` or ``partial``) on digits-like
    data."""
    rng = np.random.RandomState(0)
    X, y = rng.randn(120, 10), rng.randn(120)
    est = pkg.PathKernelMachine(hidden_layer_sizes=(32,), solver=solver, max_iter=6,
                                batch_size=40, tol=None, random_state=0, device="cpu",
                                trajectory_storage=storage, memory_budget=budget,
                                trajectory_compression=compression,
                                trajectory_dir=directory)
    out = {}
    for i, call in enumerate(calls):
        part = slice(40 * (i % 3), 40 * (i % 3) + 40)
        if call == "fit":
            est.fit(X, y)
        elif call == "warm":
            est.set_params(warm_start=True).fit(X, y)
        else:
            est.partial_fit(X[part], y[part])
        out.update(_arrays(est.trajectory_, f"call{i}-"))
    return out


def bit_cases():
    mb = 2**20
    cases = []
    for opt in OPTIMIZERS:
        for every in (1, 3):
            for storage, budget, comp in (("memory", 2**30, None), ("memory", mb, None),
                                          ("disk", mb, None), ("auto", mb, None),
                                          ("auto", 8 * mb, None), ("auto", mb, "float16"),
                                          ("auto", mb, "bfloat16")):
                cases.append(dict(kind="loop", opt_name=opt, n_params=5000, steps=150,
                                  every=every, storage=storage, budget=budget,
                                  compression=comp, reads=(4, 70, 71, 149)))
    for opt in ("sgd", "adam", "momentum"):
        for storage, budget in (("memory", mb), ("auto", 8 * mb), ("auto", mb),
                                ("disk", mb)):
            for every in (1, 3):
                cases.append(dict(kind="loop", opt_name=opt, n_params=5000, steps=120,
                                  every=every, storage=storage, budget=budget,
                                  compression=None, reads=(30, 100), resume_at=50))
    cases.append(dict(kind="loop", opt_name="adam", n_params=5000, steps=100, every=1,
                      storage="auto", budget=mb, compression=None, reads=(10,),
                      dtype=torch.float64))
    for solver in ("sgd", "adam"):
        for storage, budget in (("memory", 2**30), ("auto", 2**30), ("auto", 2**20),
                                ("disk", 2**30)):
            for calls in (("fit", "warm", "warm"), ("partial", "partial", "partial")):
                cases.append(dict(kind="estimator", solver=solver, storage=storage,
                                  budget=budget, calls=calls))
    return cases


def _load(base):
    sys.path.insert(0, base)
    return importlib.import_module("skpk_base"), importlib.import_module("skpathkernel")


def cmd_bits(args):
    old, new = _load(args.base)
    rows, n_arrays, bad = [], 0, 0
    for case in bit_cases():
        kind = case.pop("kind")
        res = {}
        for side, pkg in (("base", old), ("tree", new)):
            with tempfile.TemporaryDirectory() as d:
                if kind == "loop":
                    res[side] = _record(pkg, directory=d, **case)
                else:
                    res[side] = _estimator(pkg, directory=d, **case)
        # Where each side kept each path read is no array: "auto" keeps in memory paths
        # that bad1034 moved to disk. A compressed path is lossy on disk only, so a path
        # read in memory on one side and on disk on the other is compared only without
        # compression (exact on disk, so equal bits).
        where = {side: {k[: -len("storage")]: str(v) for k, v in r.items()
                        if k.endswith("storage")} for side, r in res.items()}
        a, b = res["base"], res["tree"]
        lossy = case.get("compression") is not None
        skipped = [p for p in where["base"] if lossy and where["base"][p] != where["tree"][p]]
        keys = [k for k in a if not k.endswith("storage")
                and not any(k.startswith(p) for p in skipped)]
        same = a.keys() == b.keys() and all(
            a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
            and a[k].tobytes() == b[k].tobytes() for k in keys)
        n_arrays += len(keys)
        bad += not same
        rows.append(dict(kind=kind, **{k: str(v) for k, v in case.items()},
                         arrays=len(keys), bit_equal=same,
                         storage_base=list(where["base"].values()),
                         storage_tree=list(where["tree"].values()),
                         reads_not_compared=skipped))
        print(kind, case, len(keys), "arrays", "EQUAL" if same else "DIFFER",
              "base", list(where["base"].values()), "tree", list(where["tree"].values()),
              "not compared", skipped, flush=True)
    print(f"{len(rows)} cases, {n_arrays} arrays, {bad} cases differ")
    json.dump(rows, open(args.out, "w"), indent=1)


# ---------------------------------------------------------------------------- memory
def _vm(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _held(rec):
    """The recorder's in-memory buffers' bytes (0 on disk) and the buffer object."""
    r = rec._recorder
    if type(r._buf).__name__ == "Series":
        return 0, None
    bufs = [r._buf, *r._states.values()]
    return sum(b.nbytes for b in bufs), r._buf


def cmd_peak(args):
    """One run (a fresh process): prints a JSON line."""
    torch.set_num_threads(1)
    pkg = importlib.import_module(args.pkg)
    net = _net(args.n_params)
    X, y = _data(net)
    # The same training without a recorder first: its gradients, optimizer state and
    # temporaries set the high-water mark that the recording's is read above.
    warm = copy.deepcopy(net)
    warm_opt = OPTIMIZERS[args.opt](warm.parameters())
    for step in range(3):
        _step(warm, warm_opt, X, y, None, step)
    del warm, warm_opt
    base = _vm("VmHWM")
    opt = OPTIMIZERS[args.opt](net.parameters())
    d = tempfile.mkdtemp(dir=args.dir)
    rec = pkg.PathRecorder(net, opt, n_samples=len(X), storage=args.storage,
                           memory_budget=args.budget, directory=d,
                           record_every=args.every)
    held_max, transient_max, first_disk = 0, 0, None
    held, buf = _held(rec)
    held_max = transient_max = held
    for step in range(args.steps):
        _step(net, opt, X, y, rec, step)
        now, now_buf = _held(rec)
        if now_buf is None and first_disk is None:
            first_disk = step
        # A doubling allocated new tensors while the old ones were held: both at once.
        copied = (buf is not None and now_buf is not None and now_buf is not buf
                  and isinstance(buf, torch.Tensor))
        transient_max = max(transient_max, now + (held if copied else 0))
        held_max = max(held_max, now)
        held, buf = now, now_buf
    hwm_rec = _vm("VmHWM")
    traj = rec.trajectory
    hwm_read = _vm("VmHWM")
    row_bytes = traj.n_params * 4
    n_state = len(traj.state_keys)
    path = (len(traj) + (len(traj) - 1) * n_state) * row_bytes
    print(json.dumps(dict(
        pkg=args.pkg, n_params=traj.n_params, opt=args.opt, budget=args.budget,
        storage_arg=args.storage, every=args.every, steps=args.steps, points=len(traj),
        path_bytes=path, storage=traj.storage, first_disk_step=first_disk,
        held_max=held_max, transient_max=transient_max,
        rss_recording=hwm_rec - base, rss_after_read=hwm_read - base)))


def memory_cases(which="main"):
    """``main``: 0.5M-3M parameters; ``long``: paths of more than 65 points (where the
    doubling starts) under 64 MiB-1 GiB."""
    mib, gib = 2**20, 2**30
    row = lambda p: p * 4  # noqa: E731  (float32 rows)
    cases = []

    def steps_for(p, n_state, budget, frac, every=1):
        points = int(frac * budget / row(p) + n_state) // (1 + n_state)
        return (points - 1) * every

    long = ((100_000, "sgd", 64 * mib, 0.9), (100_000, "adam", 64 * mib, 0.9),
            (500_000, "sgd", 256 * mib, 0.9), (250_000, "adam", 256 * mib, 0.9),
            (500_000, "sgd", 256 * mib, 0.6), (1_000_000, "sgd", gib, 0.9),
            (1_000_000, "adam", gib, 0.9))
    for p, opt, budget, frac in long if which == "long" else (
            (500_000, "sgd", 64 * mib, 0.9), (500_000, "adam", 64 * mib, 0.9),
            (1_000_000, "sgd", 256 * mib, 0.9), (1_000_000, "adam", 256 * mib, 0.9),
            (1_000_000, "sgd", 256 * mib, 0.7), (1_000_000, "sgd", 2 * gib, 0.2),
            (3_000_000, "sgd", 2 * gib, 0.9), (3_000_000, "adam", 2 * gib, 0.9),
            (3_000_000, "sgd", 2 * gib, 0.7), (3_000_000, "sgd", 2 * gib, 0.55),
            (1_000_000, "sgd", 64 * mib, 1.5), (3_000_000, "adam", 256 * mib, 1.3)):
        n_state = 1 if opt == "adam" else 0
        cases.append(dict(n_params=p, opt=opt, budget=budget, storage="auto", every=1,
                          steps=steps_for(p, n_state, budget, frac), frac=frac))
    if which == "main":
        cases.append(dict(n_params=3_000_000, opt="sgd", budget=gib, storage="memory",
                          every=1, steps=140, frac=None))
    return cases


def cmd_memory(args):
    rows = []
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.getcwd(), args.base]))
    for i, case in enumerate(memory_cases(args.set)):
        sides = ("skpk_base", "skpathkernel") if i % 2 == 0 else ("skpathkernel", "skpk_base")
        for pkg in (s for s in sides if args.sides in ("both", s)):
            cmd = [sys.executable, "-m", "benchmarks.bench_recording_segments", "peak",
                   "--pkg", pkg, "--n-params", str(case["n_params"]), "--opt", case["opt"],
                   "--budget", str(case["budget"]), "--storage", case["storage"],
                   "--every", str(case["every"]), "--steps", str(case["steps"]),
                   "--dir", args.dir]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["frac"] = case["frac"]
            row["load"] = os.getloadavg()[0]
            rows.append(row)
            print(row, flush=True)
    json.dump(rows, open(args.out, "w"), indent=1)


# ------------------------------------------------------------------------------ time
def cmd_time(args):
    torch.set_num_threads(1)
    old, new = _load(args.base)
    sides = {"base": old, "tree": new}
    rows = []
    for opt_name, n_params, steps, every in (("sgd", 300_000, 150, 1),
                                             ("adam", 300_000, 150, 1),
                                             ("sgd", 20_000, 600, 1),
                                             ("adam", 300_000, 150, 3)):
        times = {s: [] for s in sides}
        plain = []
        ana = {s: [] for s in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for side in order:
                pkg = sides[side]
                net = _net(n_params)
                X, y = _data(net)
                opt = OPTIMIZERS[opt_name](net.parameters())
                t0 = time.process_time()
                rec = pkg.PathRecorder(net, opt, n_samples=len(X), record_every=every)
                for step in range(steps):
                    _step(net, opt, X, y, rec, step)
                traj = rec.trajectory
                times[side].append(time.process_time() - t0)
                if n_params <= 20_000 or args.analysis_all:
                    est = rec.as_estimator(X.numpy(), y.numpy())
                    t0 = time.process_time()
                    est.decompose(X[:4].numpy())
                    ana[side].append(time.process_time() - t0)
                rec.close()
                del rec, traj
            net = _net(n_params)
            opt = OPTIMIZERS[opt_name](net.parameters())
            t0 = time.process_time()
            for step in range(steps):
                _step(net, opt, X, y, None, step)
            plain.append(time.process_time() - t0)
        row = dict(case=f"{opt_name} P={n_params} steps={steps} every={every}",
                   base=statistics.median(times["base"]),
                   tree=statistics.median(times["tree"]),
                   base_all=times["base"], tree_all=times["tree"],
                   plain=statistics.median(plain), load=os.getloadavg()[0])
        if ana["base"]:
            row.update(ana_base=statistics.median(ana["base"]),
                       ana_tree=statistics.median(ana["tree"]),
                       ana_base_all=ana["base"], ana_tree_all=ana["tree"])
        rows.append(row)
        print(row, flush=True)
    # An estimator's fit: buffers preallocated (one part), the recording per step.
    rng = np.random.RandomState(0)
    X, y = rng.randn(2000, 20), rng.randn(2000)
    for solver in ("sgd", "adam"):
        times = {s: [] for s in sides}
        for r in range(args.rounds):
            for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                est = sides[side].PathKernelMachine(
                    hidden_layer_sizes=(64,), solver=solver, max_iter=30, batch_size=50,
                    tol=None, random_state=0, device="cpu")
                t0 = time.process_time()
                est.fit(X, y)
                times[side].append(time.process_time() - t0)
        row = dict(case=f"PathKernelMachine.fit {solver} 2000x20, (64,), 1200 steps",
                   base=statistics.median(times["base"]),
                   tree=statistics.median(times["tree"]),
                   base_all=times["base"], tree_all=times["tree"], load=os.getloadavg()[0])
        rows.append(row)
        print(row, flush=True)
    json.dump(rows, open(args.out, "w"), indent=1)


def _recorder_loop(mod, n_params, n_steps, solver, known):
    """CPU time of a ``TrajectoryRecorder``'s calls alone over ``n_steps`` steps (the
    optimizer's state taken as it is after one step), its ``finish`` included."""
    p = torch.nn.Parameter(torch.randn(n_params))
    opt = OPTIMIZERS[solver]([p])
    p.grad = torch.randn(n_params)
    opt.step()
    rec = mod.TrajectoryRecorder([p], ["p"], n_steps=n_steps if known else None,
                                 record_every=1, solver=mod.SolverSpec(solver),
                                 n_samples=4, batch_size=2, dtype=torch.float32)
    idx = np.array([0, 1])
    t0 = time.process_time()
    rec.record_point(0)
    for s in range(n_steps):
        rec.record_batch(idx)
        rec.record_step(s, 0.1, opt)
        rec.record_point(s + 1)
    rec.finish()
    return time.process_time() - t0


def cmd_step(args):
    """The recording's own calls per step, the two sides alternating."""
    torch.set_num_threads(1)
    _load(args.base)
    mods = {"base": importlib.import_module("skpk_base._path._trajectory"),
            "tree": importlib.import_module("skpathkernel._path._trajectory")}
    rows = []
    for n_params, n_steps, solver, known in ((2000, 3000, "adam", True),
                                             (2000, 3000, "sgd", True),
                                             (300_000, 150, "adam", True),
                                             (2000, 3000, "adam", False),
                                             (300_000, 150, "sgd", False),
                                             (300_000, 150, "adam", False)):
        times = {"base": [], "tree": []}
        for r in range(args.rounds):
            for side in (("base", "tree") if r % 2 == 0 else ("tree", "base")):
                times[side].append(_recorder_loop(mods[side], n_params, n_steps, solver,
                                                  known))
        row = dict(case=f"TrajectoryRecorder {solver} P={n_params} steps={n_steps} "
                        f"n_steps {'known' if known else 'unknown'}",
                   base=statistics.median(times["base"]),
                   tree=statistics.median(times["tree"]),
                   base_all=times["base"], tree_all=times["tree"], load=os.getloadavg()[0])
        rows.append(row)
        print(row["case"], f"{row['base'] / n_steps * 1e6:.1f} us/step against "
              f"{row['tree'] / n_steps * 1e6:.1f}", flush=True)
    json.dump(rows, open(args.out, "w"), indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("bits", "memory", "time", "step"):
        p = sub.add_parser(name)
        p.add_argument("--base", required=True, help="directory holding skpk_base")
        p.add_argument("--out", required=True)
        p.add_argument("--dir", default=None, help="parent of on-disk paths")
        p.add_argument("--rounds", type=int, default=7)
        p.add_argument("--analysis-all", action="store_true")
        p.add_argument("--set", default="main", help="memory: main or long")
        p.add_argument("--sides", default="both", help="memory: both or one package")
    p = sub.add_parser("peak")
    p.add_argument("--pkg", required=True)
    p.add_argument("--n-params", type=int, required=True)
    p.add_argument("--opt", required=True)
    p.add_argument("--budget", type=int, required=True)
    p.add_argument("--storage", required=True)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--dir", default=None)
    args = ap.parse_args()
    commands = {"bits": cmd_bits, "memory": cmd_memory, "time": cmd_time, "step": cmd_step,
                "peak": cmd_peak}
    commands[args.cmd](args)


if __name__ == "__main__":
    main()
