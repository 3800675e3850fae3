"""What the one-process A/B benchmarks share: a row's statistics and the results files."""

import json
import statistics


def ab_row(case, times, load, **extra):
    """Least and median of each side's times, and their ratios ref / tree."""
    row = dict(case=case, load=load,
               ref_least=min(times["ref"]), ref_median=statistics.median(times["ref"]),
               tree_least=min(times["tree"]), tree_median=statistics.median(times["tree"]),
               ref_times=times["ref"], tree_times=times["tree"], **extra)
    row["ratio_least"] = row["ref_least"] / row["tree_least"]
    row["ratio_median"] = row["ref_median"] / row["tree_median"]
    return row


def write_ab(out, title, timer, prov, rows, digits):
    """``out``.json (provenance and rows) and ``out``.md (the table, times to ``digits``)."""
    out.with_suffix(".json").write_text(json.dumps(dict(provenance=prov, rows=rows),
                                                   indent=1))
    lines = [f"# {title}", "", *(f"- {k}: {v}" for k, v in prov.items()), "",
             f"CPU time (`{timer}`) per call, least and median of the repeats, the two "
             "sides alternating; ratio = ref / tree (above 1: the tree is faster). A loaded "
             "machine: compare ratios, not times.", "",
             "| case | ref least (s) | ref median | tree least (s) | tree median | "
             "ratio least | ratio median | max rel. diff | load |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['ref_least']:.{digits}f} | "
                     f"{r['ref_median']:.{digits}f} | {r['tree_least']:.{digits}f} | "
                     f"{r['tree_median']:.{digits}f} | {r['ratio_least']:.3f} | "
                     f"{r['ratio_median']:.3f} | "
                     f"{r.get('max_rel_diff', float('nan')):.1e} | {r['load']:.2f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
