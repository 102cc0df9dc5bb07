#!/usr/bin/env python3
"""Plots the GPU engine benchmark: prefill model-FLOP utilisation against prompt tokens, decode
share of the HBM roofline against batch size (the limits measured in the same run), and time to
first token colocated vs disaggregated with the transfer's share.

Regenerate (needs a CUDA build of kvstage and a GPU, then matplotlib):
    kvstage bench engine --device cuda --json > bench/engine_h200.json
    python3 bench/plot_engine.py bench/engine_h200.json --out bench/engine_h200.png
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {"Llama-3-8B": "tab:blue", "SmolLM2-135M": "tab:orange"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="output of kvstage bench engine --device cuda --json")
    ap.add_argument("--out", default="engine.png", help="PNG to write")
    a = ap.parse_args()
    with open(a.json) as f:
        d = json.load(f)
    rows = d["model_rows"]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for model, colour in COLOURS.items():
        pre = [r for r in rows if r["model"] == model and r["step"] == "prefill"]
        dec = [r for r in rows if r["model"] == model and r["step"] == "decode"]
        if pre:
            ax[0].plot([r["tokens"] for r in pre], [100 * r["mfu"] for r in pre], "o-",
                       color=colour, label=model)
        if dec:
            ax[1].plot([r["batch"] for r in dec], [100 * r["of_roofline"] for r in dec], "o-",
                       color=colour, label=model)
    ax[0].axhline(50, color="0.4", ls="--", lw=1, label="target (8B, 4096)")
    ax[0].set(xscale="log", xlabel="prompt tokens (one sequence)", ylabel="MFU %",
              title="prefill vs a cuBLAS GEMM of %.0f TFLOP/s" % d["gemm_ceiling_tflops"],
              ylim=(0, 100))
    ax[1].axhline(70, color="0.4", ls="--", lw=1, label="target (8B, batch 1)")
    ax[1].set(xscale="log", xlabel="decode batch (1024 cached positions each)",
              ylabel="% of the HBM roofline",
              title="decode vs a copy of %.0f GB/s" % d["copy_ceiling_gb_s"], ylim=(0, 100))
    for x in ax[:2]:
        x.legend(fontsize=8)
        x.grid(alpha=0.3)
    deps = [r for r in d["rows"] if r["ok"]]
    labels, col, dis, share = [], [], [], []
    for r in deps:
        if r["colocated"]:
            labels.append("%s\n%d tok" % (r["model"], r["prompt_tokens"]))
            col.append(r["ttft_ms"])
        else:
            dis.append(r["ttft_ms"])
            share.append(100 * r["transfer_share"])
    xs = range(len(labels))
    ax[2].bar([x - 0.2 for x in xs], col, 0.4, label="colocated", color="0.6")
    ax[2].bar([x + 0.2 for x in xs], dis, 0.4, label="disaggregated (CUDA IPC)",
              color="tab:green")
    for x, v, s in zip(xs, dis, share):
        ax[2].annotate("%.1f%%" % s, (x + 0.2, v), ha="center", va="bottom", fontsize=8)
    ax[2].set(xticks=list(xs), ylabel="time to first token, ms", yscale="log",
              title="TTFT (label: transfer share)")
    ax[2].set_xticklabels(labels, fontsize=7)
    ax[2].legend(fontsize=8)
    fig.suptitle("kvstage bench engine --device cuda (%s)" % d.get("hardware", "GPU"))
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
