"""Interleaved timing across processes: a case is set up once in its own process (a
server), then the harness asks each server of a group for one timed call in turn.

Why servers: the ratio to a peer must be measured in the same run, under the same
background load, so the repeats of the two methods alternate. Each method still gets a
fresh process (allocator caches and thread pools do not mix, and the JAX peer runs under
another interpreter), and its setup (imports, JIT compilation) is paid once, outside the
timings. Pure Python on purpose: the JAX worker imports this module too.

Protocol, one JSON line per reply on stdout: after setup the server prints its ``info``
(``{"ready": true, ...}``); then for each command line on stdin -- ``mem``: one call
under the peak-memory probe, ``{"peak_bytes": int}``; ``time``: one timed call,
``{"t": seconds, "cpu": the process's CPU seconds}``, with ``"probe": [[t, cpu], [t, cpu]]``
where the case has a GEMM probe (a roofline's rate), timed just before and just after the
call; ``run``: one call both timed and
under the probe (for calls too slow to repeat), ``{"t": seconds, "peak_bytes": int}``;
``done``: ``{...final results}`` and exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """Peak resident set size above the level at entry, sampled every millisecond."""

    def __enter__(self):
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        return False

    @property
    def delta(self) -> int:
        return self.peak - self.base


def _timed(fn, sync):
    """``(result, wall seconds, process CPU seconds)`` of one call of ``fn``."""
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    result = fn()
    sync()
    return result, time.perf_counter() - t0, time.process_time() - c0


def serve(call, info, finish, peak=PeakRSS, sync=lambda: None, probe=None):
    """Run the protocol above; ``call()`` must return only once its work is finished.

    ``probe``: a GEMM timed on both sides of every timed call, in this process: a rate
    measured apart (another process, another moment, its best repeat) compares the
    call's time on a contended core with a GEMM on a quiet one.
    """
    # Anything the case prints (JAX / TensorFlow banners, a peer's progress during its
    # setup) must not corrupt the replies: they go to the process's own stdout, whatever
    # sys.stdout was redirected to.
    out = sys.__stdout__
    sys.stdout = sys.stderr
    last = None

    def reply(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()

    reply({"ready": True, **info})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "mem":
            # The sampler thread competes for the GIL with Python-heavy code, so timed
            # calls run without it; this call doubles as the warm-up.
            with peak() as mem:
                last = call()
                sync()
            reply({"peak_bytes": mem.delta})
        elif cmd == "time":
            probes = [] if probe is None else [_timed(probe, sync)[1:]]
            # The process's CPU time besides the wall time: on cores that other processes
            # share, a pinned case waits for the core, which the wall time counts.
            last, t, cpu = _timed(call, sync)
            out_reply = {"t": t, "cpu": cpu}
            if probe is not None:
                probes.append(_timed(probe, sync)[1:])
                out_reply["probe"] = probes
            reply(out_reply)
        elif cmd == "run":
            with peak() as mem:
                sync()
                t0 = time.perf_counter()
                last = call()
                sync()
                t = time.perf_counter() - t0
            reply({"t": t, "peak_bytes": mem.delta})
        elif cmd == "done":
            reply(finish(last))
            return
        else:
            reply({"error": f"unknown command {cmd!r}"})


class Server:
    """Client side: one case process, asked one command at a time."""

    def __init__(self, cmd, *, cwd, env=None, cores=None):
        """``cores``: CPU indices the process (and every thread it starts) is pinned to."""
        self.cmd = cmd
        # Pinned before exec, so that no thread pool sized at import sees other cores.
        pin = None if cores is None else (lambda: os.sched_setaffinity(0, cores))
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1, preexec_fn=pin)
        # stderr is drained by a thread: a chatty peer (TensorFlow's logging) would
        # otherwise fill the pipe and block.
        self._err: list[str] = []
        self._drain = threading.Thread(target=lambda: self._err.extend(self.proc.stderr),
                                       daemon=True)
        self._drain.start()
        self.info = self._read()

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self._drain.join(timeout=5)
            # The exit status goes last: a message cut to its tail keeps it (-9 is
            # a SIGKILL, on these machines the kernel's out-of-memory killer).
            raise RuntimeError(f"benchmark case {self.cmd[-1]} failed:\n"
                               + "".join(self._err)[-3000:]
                               + f"\nexit status {self.proc.returncode}")
        return json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> dict:
        final = self.ask("done")
        self.proc.wait()
        return final

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
