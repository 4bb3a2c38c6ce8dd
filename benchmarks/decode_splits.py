"""The decode step's attention split, at every batch: why the model cuts each cache in
equal chunks of at most 512 keys.

    python -m benchmarks.decode_splits

A sequence's attention numbers follow its split and the block width, so the decode step
splits the same way at every batch size: if the split changed with the batch, a sequence's
tokens would depend on what it is batched with. Two ways qualify: a fixed number of equal
chunks of the sequence's own length (``splits``, merged by a kernel of their own), and
as many equal chunks as chunks of at most a fixed number of keys need (``split_keys``: one
chunk written by its block, more merged by the last block to finish). This times
``decode_attention`` for GPT-2's 12 heads of 64 in float16 in a cache of 1,024 positions,
at batch 1, 8, 64 and 256 and cached lengths 40 to 1,000, for each split and block width,
in a CUDA graph (benchmarks/common.py time_in_graph: back-to-back launches, as in the
step). Writes benchmarks/results/decode_splits-<device>.json.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

import cupy_kernels as K
from benchmarks.common import banner, time_in_graph, write_results

H, D, S_MAX = 12, 64, 1024
CONFIGS = ([{"threads": 128, "splits": s} for s in (1, 2, 3, 4, 8, 16)]
           + [{"threads": 512, "splits": s} for s in (1, 2, 4)]
           + [{"threads": 128, "split_keys": k} for k in (256, 384, 512)])


def main():
    print(banner(), flush=True)
    rows = []
    for B in (1, 8, 64, 256):
        rng = np.random.default_rng(0)
        q = cp.asarray(rng.standard_normal((B, H, D)), dtype=cp.float16)
        k = cp.asarray(rng.standard_normal((B, H, S_MAX, D)), dtype=cp.float16)
        v = cp.asarray(rng.standard_normal((B, H, S_MAX, D)), dtype=cp.float16)
        out = cp.empty((B, H, D), cp.float16)
        for L in (40, 264, 520, 1000):
            lens = cp.full(B, L, dtype=cp.int32)
            line = []
            for cfg in CONFIGS:
                if "splits" in cfg:
                    kw = dict(num_splits=cfg["splits"], merge="kernel")
                else:
                    kw = dict(split_keys=cfg["split_keys"])
                us = time_in_graph(lambda: K.decode_attention(q, k, v, lens, threads=cfg["threads"], out=out, **kw),
                                   n=20)
                rows.append({"bench": "decode_splits", "dtype": "float16", "heads": H, "head_dim": D, "batch": B,
                             "cached": L, **cfg, "us": round(us, 2)})
                line.append(f"{cfg['threads']}/{cfg.get('splits', str(cfg.get('split_keys')) + 'k')} {us:.1f}")
            print(f"B={B:3d} cached {L:4d}: " + ", ".join(line), flush=True)
    print(f"wrote {write_results('decode_splits', rows, {})}")


if __name__ == "__main__":
    main()
