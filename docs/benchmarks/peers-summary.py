#!/usr/bin/env python3
"""Medians of docs/benchmarks/peers.sh's runs (OUT/ROW-SERVER-ROUND.json) and hubcast's ratios
to the best peer: delivered/s (goal >= 1.2x at max rate, p99 no worse) and p99 (goal <= 0.5x at
5,000 msgs/s in).

    python3 docs/benchmarks/peers-summary.py OUT
"""
import glob
import json
import os
import statistics
import sys

ROWS = {
    "max16": "C=1000 S=10, max rate, P=16",
    "max4": "C=1000 S=10, max rate, P=4",
    "wide": "C=100 S=100, max rate, P=16",
    "r20k": "C=1000 S=10, 20 k msgs/s in, P=16",
    "r5k16": "C=1000 S=10, 5 k msgs/s in (50 k out), P=16",
    "r5k4": "C=1000 S=10, 5 k msgs/s in (50 k out), P=4",
}
SERVERS = ["hubcast", "nats", "mosquitto"]


def main(out):
    runs = {}
    for path in glob.glob(os.path.join(out, "*.json")):
        row, server, _round = os.path.basename(path)[:-5].rsplit("-", 2)
        with open(path) as f:
            r = json.load(f)["results"][0]["rows"][0]
        cpu = r.get("server_cpu", r.get("hubcast_cpu"))
        runq = r.get("server_runq_ms_s", r.get("hubcast_runq_ms_s"))
        runs.setdefault((row, server), []).append(
            (r["delivered_msg_s"], r["p99_ms"], r["p50_ms"], cpu, r.get("delivered_pct", 100.0 * r["delivered_msg_s"] / max(r["expected_msg_s"], 1e-9)), runq)
        )

    def med(row, server, i):
        xs = [x[i] for x in runs.get((row, server), []) if x[i] is not None]
        return statistics.median(xs) if xs else float("nan")

    print("| workload | " + " | ".join(SERVERS) + " | hubcast ÷ best peer (delivered/s) | p99 ÷ best peer's | rounds |")
    print("|---|---|---|---|---|---|---|")
    for row, title in ROWS.items():
        if not any((row, s) in runs for s in SERVERS):
            continue
        cells = []
        for s in SERVERS:
            d, p99, p50, cpu, pct, runq = (med(row, s, i) for i in range(6))
            cell = f"{d / 1000:,.0f} k/s, p50 {p50:.1f} ms, p99 {p99:.1f} ms, CPU {cpu:.2f}, {d / max(cpu, 1e-9) / 1000:,.0f} k per CPU-s, waited {runq:.0f} ms/s"
            if pct < 99.0:
                cell += f", {pct:.0f} % delivered"
            cells.append(cell)
        peers = [s for s in SERVERS[1:] if (row, s) in runs]
        best = max(peers, key=lambda s: med(row, s, 0))
        ratio = med(row, "hubcast", 0) / med(row, best, 0)
        # At a fixed rate every server delivers the same: the best peer is the one with the lowest p99.
        if row.startswith("r"):
            best_p99 = min(peers, key=lambda s: med(row, s, 1))
        else:
            best_p99 = best
        p99_ratio = med(row, "hubcast", 1) / med(row, best_p99, 1)
        n = min(len(runs.get((row, s), [])) for s in SERVERS)
        print(f"| {title} | " + " | ".join(cells) + f" | {ratio:.2f}× ({best}) | {p99_ratio:.2f}× ({best_p99}) | {n} |")


if __name__ == "__main__":
    main(sys.argv[1])
