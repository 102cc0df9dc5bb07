#!/usr/bin/env python3
"""Greedy continuation reference for tests/model/test_forward.c (test_smollm2).

A plain NumPy Llama forward pass in float64 over the GGUF's tensors dequantised with
gguf-py (gguf.quants.dequantize): RMSNorm, RoPE on adjacent pairs, GQA softmax attention,
SwiGLU, tied output. Prints the greedy token ids and each step's top-2 logit margin.
Run once, by hand:  python3 smollm2_greedy_ref.py MODEL.gguf 504,3575,282,4649,314 8
"""
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def main(path, prompt, steps):
    r = GGUFReader(path)
    tensors = {t.name: t for t in r.tensors}

    def weight(name):
        t = tensors[name]
        return dequantize(t.data, t.tensor_type).astype(np.float64)

    def meta(key):
        return r.fields[key].contents()

    layers, dim = meta("llama.block_count"), meta("llama.embedding_length")
    heads, kv_heads = meta("llama.attention.head_count"), meta("llama.attention.head_count_kv")
    hd, theta = dim // heads, meta("llama.rope.freq_base")
    eps = meta("llama.attention.layer_norm_rms_epsilon")
    embed = weight("token_embd.weight")  # [vocab][dim]
    names = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
             "ffn_up", "ffn_down"]
    blocks = [{k: weight(f"blk.{l}.{k}.weight") for k in names} for l in range(layers)]
    out_norm = weight("output_norm.weight")

    def rmsnorm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w

    def rope(x, pos):  # x [n][heads][hd]; rotates (x[2i], x[2i+1])
        ang = pos[:, None] * theta ** (-2.0 * np.arange(hd // 2) / hd)
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        y = np.empty_like(x)
        y[..., 0::2], y[..., 1::2] = x0 * c - x1 * s, x0 * s + x1 * c
        return y

    def forward(tokens):
        n = len(tokens)
        pos = np.arange(n, dtype=np.float64)
        x = embed[tokens]
        causal = np.triu(np.ones((n, n), bool), 1)
        for b in blocks:
            h = rmsnorm(x, b["attn_norm"])
            q = rope((h @ b["attn_q"].T).reshape(n, heads, hd), pos)
            k = rope((h @ b["attn_k"].T).reshape(n, kv_heads, hd), pos)
            v = (h @ b["attn_v"].T).reshape(n, kv_heads, hd)
            o = np.zeros((n, heads, hd))
            for j in range(heads):
                g = j // (heads // kv_heads)
                s = q[:, j] @ k[:, g].T / np.sqrt(hd)
                s[causal] = -np.inf
                p = np.exp(s - s.max(-1, keepdims=True))
                o[:, j] = (p / p.sum(-1, keepdims=True)) @ v[:, g]
            x = x + o.reshape(n, dim) @ b["attn_output"].T
            h = rmsnorm(x, b["ffn_norm"])
            gate, up = h @ b["ffn_gate"].T, h @ b["ffn_up"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ b["ffn_down"].T
        return rmsnorm(x, out_norm) @ embed.T

    tokens, out = list(prompt), []
    for _ in range(steps):
        logits = forward(tokens)[-1]
        top = np.sort(logits)[::-1]
        nxt = int(np.argmax(logits))
        print(f"{nxt} margin {top[0] - top[1]:.4f}", file=sys.stderr)
        out.append(nxt)
        tokens.append(nxt)
    print(",".join(map(str, out)))


if __name__ == "__main__":
    main(sys.argv[1], [int(t) for t in sys.argv[2].split(",")], int(sys.argv[3]))
