"""Where decompose's RSS peaks: a thread samples RSS every 2 ms and keeps the main
thread's stack at each new peak. ``python where.py WIDTH N BUDGET DTYPE``."""

# ruff: noqa: E402
import sys
import threading
import time
import traceback

import probe

peaks = []


def sampler(main_id, stop):
    best = 0
    while not stop.is_set():
        r = probe.rss()
        if r > best * 1.02 + 2**20:
            best = r
            f = sys._current_frames().get(main_id)
            st = [
                f"{fs.filename.split('skpathkernel/')[-1]}:{fs.lineno} {fs.name}"
                for fs in traceback.extract_stack(f)
                if "skpathkernel" in fs.filename or "torch" in fs.filename
            ][-8:]
            peaks.append((r, st))
        time.sleep(0.002)


orig = probe.hwm
stop = threading.Event()
started = []


def hwm():
    stop.set()
    return orig()


probe.hwm = hwm
real_decompose = None
import skpathkernel._network._trained as T

rd = T.TrainedNetwork.decompose


def dec(self, *a, **k):
    threading.Thread(target=sampler, args=(threading.get_ident(), stop), daemon=True).start()
    return rd(self, *a, **k)


T.TrainedNetwork.decompose = dec
probe.main(int(sys.argv[1]), int(sys.argv[2]), int(float(sys.argv[3])), sys.argv[4])
for r, st in peaks[-6:]:
    print(f"{r / 2**20:.0f} MiB")
    for s in st:
        print("   ", s)
