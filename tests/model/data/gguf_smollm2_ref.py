#!/usr/bin/env python3
"""Writes gguf_smollm2_ref.h: reference data for tests/model/test_gguf.c, taken from the
SmolLM2-135M-Instruct Q4_1 GGUF with the Python gguf package (GGUFReader and
gguf.quants.dequantize), independent of kvstage's reader.

    python3 tests/model/data/gguf_smollm2_ref.py MODEL.gguf > tests/model/data/gguf_smollm2_ref.h
"""
import sys

import numpy as np
import gguf
from gguf.quants import dequantize

# (tensor, row, first column, columns): whole rows and cuts that start and end inside blocks.
SLICES = [
    ("token_embd.weight", 1, 0, 576),
    ("token_embd.weight", 49151, 0, 64),
    ("token_embd.weight", 12345, 100, 70),
    ("blk.0.attn_q.weight", 0, 0, 576),
    ("blk.0.attn_q.weight", 575, 517, 59),
    ("blk.29.ffn_down.weight", 100, 1000, 100),
    ("blk.0.attn_norm.weight", 0, 0, 576),
    ("output_norm.weight", 0, 3, 61),
]


def main():
    reader = gguf.GGUFReader(sys.argv[1])
    tensors = {t.name: t for t in reader.tensors}
    out = []
    out.append("/* Reference data for test_gguf.c from the SmolLM2-135M-Instruct Q4_1 GGUF, written by")
    out.append(" * gguf_smollm2_ref.py with Python gguf (GGUFReader, gguf.quants.dequantize). */")
    out.append("#ifndef KVSTAGE_TESTS_MODEL_GGUF_SMOLLM2_REF_H")
    out.append("#define KVSTAGE_TESTS_MODEL_GGUF_SMOLLM2_REF_H")
    out.append("")
    out.append("#include <stdint.h>")
    out.append("")
    out.append("typedef struct {")
    out.append("    const char *name;")
    out.append("    uint32_t type;")
    out.append("    uint32_t n_dims;")
    out.append("    uint64_t ne[4];")
    out.append("    uint64_t file_offset; /* of the tensor's data */")
    out.append("    uint64_t bytes;")
    out.append("} gguf_ref_tensor_t;")
    out.append("")
    out.append("/* Every tensor, in file order. */")
    out.append("static const gguf_ref_tensor_t gguf_ref_tensors[] = {")
    for t in reader.tensors:
        ne = [int(x) for x in t.shape] + [1] * (4 - len(t.shape))
        out.append('    {"%s", %d, %d, {%s}, %d, %d},' % (
            t.name, int(t.tensor_type), len(t.shape), ", ".join(str(x) for x in ne),
            int(t.data_offset), int(t.n_bytes)))
    out.append("};")
    out.append("")
    out.append("typedef struct {")
    out.append("    const char *name;")
    out.append("    uint64_t row, col0, ncols;")
    out.append("    const uint32_t *bits; /* [ncols] f32 bit patterns */")
    out.append("} gguf_ref_slice_t;")
    out.append("")
    for i, (name, row, col0, ncols) in enumerate(SLICES):
        t = tensors[name]
        ne0 = int(t.shape[0])
        full = dequantize(t.data, t.tensor_type).reshape(-1, ne0).astype(np.float32)
        vals = full[row, col0:col0 + ncols].view(np.uint32)
        out.append("static const uint32_t gguf_ref_slice%d[%d] = {" % (i, ncols))
        for k in range(0, ncols, 6):
            out.append("    " + ", ".join("0x%08x" % v for v in vals[k:k + 6]) + ",")
        out.append("};")
    out.append("")
    out.append("static const gguf_ref_slice_t gguf_ref_slices[] = {")
    for i, (name, row, col0, ncols) in enumerate(SLICES):
        out.append('    {"%s", %d, %d, %d, gguf_ref_slice%d},' % (name, row, col0, ncols, i))
    out.append("};")
    out.append("")
    out.append("#endif")
    print("\n".join(out))


if __name__ == "__main__":
    main()
