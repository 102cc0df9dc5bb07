#!/usr/bin/env python3
"""Plots the GPU transfer benchmark: GB/s against prompt tokens at one page size (16 by default),
one column per model, for each prefill->decode TP pair: the bulk peer copy (the limit, dashed),
the staged protocol, direct writes and the per-page copies that staging replaces (in a lower
panel of its own, since it runs one to two orders of magnitude slower).

Regenerate (needs a 2-GPU CUDA build of kvstage, then matplotlib):
    kvstage bench transfer --device cuda --json > bench/transfer_h200.json
    python3 bench/plot_transfer.py bench/transfer_h200.json --out bench/transfer_h200.png
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FixedLocator, NullLocator  # noqa: E402

COMMAND = "kvstage bench transfer --device cuda --json"

# Colour says the method; marker says the TP pair, so the method comparison reads at a glance.
METHODS = [  # (json key, label, colour, line style)
    ("bulk_gbs", "bulk peer copy (limit)", "0.35", "--"),
    ("staged_gbs", "staged (protocol)", "tab:blue", "-"),
    ("direct_gbs", "direct-write (protocol)", "tab:orange", "-"),
]
PER_PAGE = ("per_page_gbs", "per-page copies", "tab:red", "-")
TP_MARKERS = ["o", "s", "^", "D", "v", "P"]
TP_SHADES = [0.0, -0.45, 0.45]  # base, darker, lighter: a second cue besides the marker


def shade(colour, amount):
    """Mixes the colour toward black (amount < 0) or white (amount > 0)."""
    target = 0.0 if amount < 0 else 1.0
    return tuple(c + (target - c) * abs(amount) for c in to_rgb(colour))


def end_labels(ends, span):
    """Joins the names of lines that end within 6% of the axis span of each other, so their
    labels do not print on top of one another; returns [(y, text)]."""
    out = []
    for y, name in sorted(ends):
        if out and y - out[-1][0] < 0.06 * span:
            out[-1] = (out[-1][0], out[-1][1] + ", " + name)
        else:
            out.append((y, name))
    return out


def load(path):
    with open(path) as f:
        return json.load(f)


def tp_pairs(rows):
    seen = []
    for r in rows:
        p = (r["prefill_tp"], r["decode_tp"])
        if p not in seen:
            seen.append(p)
    return seen


def series(rows, model, pair, page, key):
    """(tokens, GB/s) sorted by tokens; a zero means the mode was unavailable, so it is left out."""
    pts = sorted(
        (r["tokens"], r[key])
        for r in rows
        if r["model"] == model
        and (r["prefill_tp"], r["decode_tp"]) == pair
        and r["page_size"] == page
        and r.get(key, 0) > 0
    )
    return [t for t, _ in pts], [v for _, v in pts]


def failed_checks(rows, model, page):
    return [r for r in rows if r["model"] == model and r["page_size"] == page and not r["check_ok"]]


def token_label(t):
    return f"{t // 1024}K" if t >= 1024 and t % 1024 == 0 else str(t)


def style_x(ax, tokens, labels):
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(tokens))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([token_label(t) for t in tokens] if labels else [])
    ax.set_xlim(tokens[0] / 1.3, tokens[-1] * 1.3)
    ax.grid(True, which="major", alpha=0.3)


def main():
    ap = argparse.ArgumentParser(description="Plot `kvstage bench transfer --json` output.")
    ap.add_argument("json", help="output of " + COMMAND)
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--page", type=int, default=16, help="page size to plot (16)")
    args = ap.parse_args()

    d = load(args.json)
    rows = d["rows"]
    rows_page = [r for r in rows if r["page_size"] == args.page]
    if not rows_page:
        sys.exit(f"no rows with page size {args.page} in {args.json}")
    models = []
    for r in rows_page:
        if r["model"] not in models:
            models.append(r["model"])
    pairs = tp_pairs(rows_page)
    tokens = sorted({r["tokens"] for r in rows_page})
    ymax = max(max(r[k] for k, *_ in METHODS) for r in rows_page)
    pp_max = max(r[PER_PAGE[0]] for r in rows_page)

    fig, axes = plt.subplots(
        2,
        len(models),
        figsize=(16, 9),
        dpi=100,
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 1], "hspace": 0.08, "wspace": 0.12},
    )
    for c, model in enumerate(models):
        top, low = axes[0][c], axes[1][c]
        ends = []
        for i, pair in enumerate(pairs):
            mk = TP_MARKERS[i % len(TP_MARKERS)]
            sh = TP_SHADES[i % len(TP_SHADES)]
            for key, _, colour, ls in METHODS:
                x, y = series(rows, model, pair, args.page, key)
                top.plot(x, y, ls=ls, color=shade(colour, sh), marker=mk, ms=6, lw=1.8)
            x, y = series(rows, model, pair, args.page, PER_PAGE[0])
            low.plot(x, y, ls=PER_PAGE[3], color=shade(PER_PAGE[2], sh), marker=mk, ms=6, lw=1.8)
            if x:
                ends.append((y[-1], f"{pair[0]}\u2192{pair[1]}"))
        # Name the per-page lines at their right ends: unlike the top panel, they sit apart.
        for y, text in end_labels(ends, pp_max * 1.35):
            low.annotate(
                text,
                (tokens[-1], y),
                xytext=(8, 0),
                textcoords="offset points",
                va="center",
                fontsize=9,
                color=PER_PAGE[2],
                annotation_clip=False,
            )
        for r in failed_checks(rows, model, args.page):
            top.plot(r["tokens"], r["staged_gbs"], "kx", ms=12, mew=2)

        top.set_title(f"{model}, page size {args.page}", fontsize=13)
        top.set_ylim(0, ymax * 1.08)
        low.set_ylim(0, pp_max * 1.35)
        style_x(top, tokens, labels=False)
        style_x(low, tokens, labels=True)
        low.set_xlabel("prompt tokens (log\u2082 scale)", fontsize=11)
        if c == 0:
            top.set_ylabel("throughput (GB/s)", fontsize=11)
            low.set_ylabel("per-page (GB/s)", fontsize=11)
        # The ratio staging buys over per-page copies, at the longest prompt, TP 1->1 if present.
        pair0 = (1, 1) if (1, 1) in pairs else pairs[0]
        xs, ys = series(rows, model, pair0, args.page, "staged_gbs")
        xp, yp = series(rows, model, pair0, args.page, PER_PAGE[0])
        if xs and xp and xs[-1] == xp[-1]:
            low.text(
                0.02,
                0.88,
                f"staged / per-page at {token_label(xs[-1])} tokens, "
                f"TP {pair0[0]}\u2192{pair0[1]}: {ys[-1] / yp[-1]:.0f}\u00d7",
                transform=low.transAxes,
                va="top",
                fontsize=9.5,
                color="0.25",
            )

    method_handles = [
        Line2D([], [], color=colour, ls=ls, lw=2, label=label)
        for _, label, colour, ls in METHODS + [PER_PAGE]
    ]
    pair_handles = [
        Line2D([], [], color=shade("0.4", TP_SHADES[i % len(TP_SHADES)]), ls="none",
               marker=TP_MARKERS[i % len(TP_MARKERS)], ms=7, label=f"TP {p}\u2192{d_}")
        for i, (p, d_) in enumerate(pairs)
    ]
    fig.legend(
        handles=method_handles + pair_handles,
        loc="upper center",
        ncol=len(method_handles) + len(pair_handles),
        bbox_to_anchor=(0.5, 0.925),
        frameon=False,
        fontsize=10.5,
        handlelength=2.6,
    )
    fig.suptitle(
        "KV-cache transfer, prefill GPU \u2192 decode GPU: one request, bf16\n" + d["hardware"],
        fontsize=14,
        y=0.99,
    )
    fig.text(
        0.01,
        0.01,
        f"$ {COMMAND}   (layout {d['layout']}, chunk {d['chunk_tokens']} tokens, "
        f"median of {d['reps']} reps; TP a\u2192b = a prefill ranks \u2192 b decode ranks; "
        "staged and direct timed from add_room to Success on every rank)",
        fontsize=8.5,
        color="0.35",
        family="monospace",
    )
    fig.subplots_adjust(left=0.055, right=0.95, top=0.86, bottom=0.1)
    fig.savefig(args.out)


if __name__ == "__main__":
    main()
