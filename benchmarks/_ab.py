"""What the one-process A/B benchmarks share: a row's statistics and the results files."""

import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from skpathkernel._tangent import RULES, tangent_gram
from skpathkernel.rules import layer_routes


def ab_row(case, times, load, **extra):
    """Least and median of each side's times, and their ratios ref / tree."""
    row = dict(case=case, load=load,
               ref_least=min(times["ref"]), ref_median=statistics.median(times["ref"]),
               tree_least=min(times["tree"]), tree_median=statistics.median(times["tree"]),
               ref_times=times["ref"], tree_times=times["tree"], **extra)
    row["ratio_least"] = row["ref_least"] / row["tree_least"]
    row["ratio_median"] = row["ref_median"] / row["tree_median"]
    return row


def outputs_row(case, times, out):
    """:func:`ab_row` with the largest difference of the two sides' outputs relative to
    the reference's largest entry (``out``: each side's last output), printed."""
    ref, tree = np.asarray(out["ref"]), np.asarray(out["tree"])
    row = ab_row(case, times, os.getloadavg()[0],
                 max_rel_diff=float(np.abs(ref - tree).max() / np.abs(ref).max()))
    print(f"{case}: ref {row['ref_least']:.3f} s (median {row['ref_median']:.3f}), "
          f"tree {row['tree_least']:.3f} s (median {row['tree_median']:.3f}), "
          f"ratio {row['ratio_least']:.3f} least, {row['ratio_median']:.3f} median, "
          f"diff {row['max_rel_diff']:.1e}, load {row['load']:.2f}", flush=True)
    return row


def write_ab(out, title, timer, prov, rows, digits, columns=(), machine=False):
    """``out``.json (provenance and rows) and ``out``.md (the table, times to ``digits``;
    ``columns``: further ``(header, key)`` pairs of the rows, appended; ``machine``: a
    last line with the machine, ``CPU_NAME`` in the environment, and the load average
    when the run ended)."""
    out.with_suffix(".json").write_text(json.dumps(dict(provenance=prov, rows=rows),
                                                   indent=1))
    lines = [f"# {title}", "", *(f"- {k}: {v}" for k, v in prov.items()), "",
             f"Time (`{timer}`) per call, least and median of the repeats, the two "
             "sides alternating; ratio = ref / tree (above 1: the tree is faster). A loaded "
             "machine: compare ratios, not times.", "",
             "| case | ref least (s) | ref median | tree least (s) | tree median | "
             "ratio least | ratio median | max rel. diff | load |"
             + "".join(f" {header} |" for header, _ in columns),
             "|---|---|---|---|---|---|---|---|---|" + "---|" * len(columns)]
    for r in rows:
        lines.append(f"| {r['case']} | {r['ref_least']:.{digits}f} | "
                     f"{r['ref_median']:.{digits}f} | {r['tree_least']:.{digits}f} | "
                     f"{r['tree_median']:.{digits}f} | {r['ratio_least']:.3f} | "
                     f"{r['ratio_median']:.3f} | "
                     f"{r.get('max_rel_diff', float('nan')):.1e} | {r['load']:.2f} |"
                     + "".join(f" {r.get(key, '-')} |" for _, key in columns))
    if machine:
        lines += ["", f"Machine: {os.environ.get('CPU_NAME', '') or 'see above'}; load average "
                  "(1, 5, 15 min) at the end: "
                  + ", ".join(f"{x:.2f}" for x in os.getloadavg()) + "."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def ab_provenance(root, script, paths, ref, reps, **extra):
    """A run's provenance: the commit names the run's code only where none of ``paths``
    (the compared modules and the scripts) differs from it."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                            capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", *paths], cwd=root,
                                capture_output=True, text=True).stdout.strip())
    return dict(command=f"python -m benchmarks.{script} " + " ".join(sys.argv[1:]),
                commit=commit + ("+dirty" if dirty else ""), ref=ref,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                cores=sorted(os.sched_getaffinity(0)), threads=torch.get_num_threads(),
                reps=reps, **extra)


def reference_module(root, ref, module, replace=()):
    """The package module at path ``module`` (``skpathkernel/...py``) as it is at git
    ``ref``, imported beside the working tree's as ``<its name>_ref`` (in its package, so
    that its relative imports resolve; ``replace``: ``(old, new)`` pairs of its source,
    ``from ._parameters import`` to import another module's reference copy)."""
    source = subprocess.run(["git", "show", f"{ref}:{module}"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    for old, new in replace:
        assert old in source, old
        source = source.replace(old, new)
    stem = Path(module).stem + "_ref"
    path = Path(tempfile.mkdtemp()) / f"{stem}.py"
    path.write_text(source)
    name = ".".join(Path(module).with_suffix("").parts[:-1] + (stem,))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def rules_ab(cases, types, reps):
    """Rows of ``tangent_gram`` on each case's ``(net, X)``: with the RULES entries of
    ``types`` removed (ref: the generic fallback) and present (tree), alternating
    ``reps`` times, each side's routes checked first."""
    rules, names = {t: RULES[t] for t in types}, {t.__name__ for t in types}
    rows = []
    try:
        for case, (net, X) in cases.items():
            params = {k: v.detach() for k, v in net.named_parameters()}
            times, grams = {"ref": [], "tree": []}, {}
            for _ in range(reps):
                for side in ("ref", "tree"):
                    if side == "ref":
                        for t in types:
                            RULES.pop(t)
                    else:
                        RULES.update(rules)
                    routes = {r.route for r in layer_routes(net, X) if r.type in names}
                    assert routes == {"fallback" if side == "ref" else "rule"}, routes
                    start = time.thread_time()
                    grams[side] = tangent_gram(net, params, X)
                    times[side].append(time.thread_time() - start)
                RULES.update(rules)
            diff = ((grams["ref"] - grams["tree"]).abs().max()
                    / grams["ref"].abs().max()).item()
            rows.append(ab_row(case, times, os.getloadavg()[0], max_rel_diff=diff))
            print(case, f"{rows[-1]['ratio_least']:.3f}", flush=True)
    finally:
        RULES.update(rules)
    return rows
