"""Table 1: overheads. Scheduler time per action (measured wall time of the real scheduler
passes at paper scale) and the ACT breakdown (queue / restore / exec) for AI coding and MOPD.

Usage: python bench/paper/table1.py [--batch 1024]
Paper: system overhead < 3% of execution time (AI coding); restore ≈ 25% of execution (MOPD).
The simulator has no container/docker/NVML costs: the CPU-side overhead it can measure is the
scheduling decision itself; measured docker costs are listed in docs/results.md.
"""

from __future__ import annotations

import argparse
import time

from common import paper_cluster, run, save, tag_act

from tangram.sched import schedule

_spent = [0.0, 0]
_real = schedule


def _timed(*args, **kwargs):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    try:
        return _real(*args, **kwargs)
    finally:
        _spent[0] += time.perf_counter() - t0
        _spent[1] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1024)
    args = ap.parse_args()
    started = time.perf_counter()
    doc: dict[str, object] = {}
    print(
        "| workload | policy | actions | sched passes | sched time / action (ms) | avg exec (s) | "
        "sched / exec | queue (s) | restore (s) | restore / exec | paper |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for wl, tags, paper in (
        ("ai-coding", ("tool", "reward"), "overhead < 3% of exec"),
        ("mopd", ("teacher",), "restore ≈ 25% of exec"),
    ):
        doc[wl] = {}
        for policy in ("tangram", "tangram-wait", "tangram-paper"):
            _spent[0], _spent[1] = 0.0, 0
            res = run(paper_cluster(), wl, args.batch, (policy,), schedule_fn=_timed)[policy]
            s = res.summary
            n = s["actions"]
            per = _spent[0] / n
            ex = tag_act(res, tags, "avg_exec_s")
            q = tag_act(res, tags, "avg_queue_s")
            rs = tag_act(res, tags, "avg_restore_s")
            doc[wl][policy] = {"summary": s, "sched_s": _spent[0], "passes": _spent[1]}  # type: ignore[index]
            print(
                f"| {wl} | {policy} | {n} | {_spent[1]} | {per * 1e3:.3f} | {ex:.3f} | "
                f"{per / ex:.3%} | {q:.3f} | {rs:.3f} | {rs / ex:.1%} | {paper} |"
            )
    save("table1", doc, started)


if __name__ == "__main__":
    main()
