import json
import os
import statistics
import warnings

import torch
from torch import nn

from benchmarks.bench_recurrent_ab import three_sides
from benchmarks.bench_recurrent_packed_ab import _ids, _loop, _Packed

torch.set_num_threads(1)
warnings.filterwarnings("ignore")
gen = torch.Generator().manual_seed(0)
res = []
for cell in (nn.LSTM, nn.GRU):
    torch.manual_seed(0)
    net = _Packed(cell).eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    _ids(2, gen)
    _ids(2, gen)
    X = _ids(128, gen)
    times, out = three_sides(net, params, X, cell, "trace", _loop, 3)
    med = {k: statistics.median(v) for k, v in times.items()}
    ref = out["torch.func"]
    diff = {k: float((out[k].reshape(ref.shape) - ref).abs().max() / ref.abs().max()) for k in out}
    r = dict(
        case=f"{cell.__name__} N=128 trace",
        median=med,
        times=times,
        fallback_over_rule=med["fallback"] / med["rule"],
        loop_over_rule=med["torch.func"] / med["rule"],
        diff=diff,
        load=os.getloadavg()[0],
    )
    print(json.dumps(r), flush=True)
    res.append(r)
