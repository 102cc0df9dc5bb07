#!/usr/bin/env python3
"""Plots `kvstage bench serve --json`: time to first token (p50 and p99) and output tokens/s
(per user and in total) against the number of concurrent users, one line per deployment
(colocated, disaggregated through kvstage).

Regenerate:
    kvstage bench serve --json > bench/serve_cpu.json
    python3 bench/plot_serve.py bench/serve_cpu.json --out bench/serve_cpu.png
Needs matplotlib (only to redraw the plot; nothing in the build or tests uses it).
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="output of kvstage bench serve --json")
    ap.add_argument("--out", required=True, help="PNG to write")
    a = ap.parse_args()
    with open(a.json) as f:
        data = json.load(f)
    rows = data["rows"]
    deployments = []
    for r in rows:
        if r["deployment"] not in deployments:
            deployments.append(r["deployment"])
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(14, 6))
    for i, d in enumerate(deployments):
        rs = sorted((r for r in rows if r["deployment"] == d), key=lambda r: r["users"])
        users = [r["users"] for r in rs]
        c = colors[i % len(colors)]
        ax_t.plot(users, [r["ttft_p50_ms"] for r in rs], "o-", color=c, label=f"{d}, p50")
        ax_t.plot(users, [r["ttft_p99_ms"] for r in rs], "s--", color=c, label=f"{d}, p99")
        ax_r.plot(users, [r["tok_s_total"] for r in rs], "o-", color=c, label=f"{d}, total")
        ax_r.plot(users, [r["tok_s_per_user"] for r in rs], "s--", color=c, label=f"{d}, per user")
    for ax in (ax_t, ax_r):
        ax.set_xlabel("concurrent users (streaming clients)")
        ax.set_xticks(sorted({r["users"] for r in rows}))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=9)
        ax.set_ylim(bottom=0)
    ax_t.set_ylabel("time to first token at the client (ms)")
    ax_t.set_title("time to first token")
    ax_r.set_ylabel("output tokens/s")
    ax_r.set_title("throughput")
    model = os.path.basename(data.get("model", "?"))
    fig.suptitle(f"kvstage bench serve: {model} on CPU, colocated vs disaggregated over HTTP")
    fig.text(0.01, 0.01, "$ kvstage bench serve --json   (requests of ~80 prompt tokens, up to "
             "24 new tokens, greedy; each user sends its requests one after another)",
             fontsize=8, family="monospace")
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(a.out, dpi=100)


if __name__ == "__main__":
    main()
