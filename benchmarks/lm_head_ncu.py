"""GPT-2 small's LM head at batch 1, float16, random weights and a folded LayerNorm: the exact
argmax product (linear_mma_kernel) and the screened one (linear_q8_max_kernel's 8-bit pass,
then the exact tiles), twice each, for Nsight Compute:

    ncu --clock-control none -k regex:"linear_q8_max_kernel|linear_mma_kernel" -c 2 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section Occupancy \\
        --section LaunchStats --section SchedulerStats --metrics dram__bytes_read.sum,\\
    lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum,\\
    dram__sectors_read.sum python3 -m benchmarks.lm_head_ncu

(results/head_screen_q8_ncu-h100.log). Prints both tokens, which must agree.
"""

import cupy as cp
import numpy as np

import cupy_kernels as K

rng = np.random.default_rng(0)
N, C, B = 50257, 768, 1
w = (cp.asarray(rng.standard_normal((N, C)), dtype=cp.float32) / np.sqrt(C)).astype(cp.float16)
x = cp.asarray(rng.standard_normal((B, C))).astype(cp.float16)
xs = x.astype(cp.float32).reshape(B, -1, 16)
mu = xs.mean(axis=2)
stats = cp.ascontiguousarray(cp.stack([mu, ((xs - mu[..., None]) ** 2).sum(axis=2)], axis=-1).astype(cp.float32))
u = w.astype(cp.float32).sum(axis=1)
c = cp.zeros(N, cp.float32)
fold = (stats, u, c, 1e-5)
scr = K.quantize_rows(w)
for _ in range(2):
    a = K.linear_argmax(x, w, ln_fold=fold)
    b = K.linear_argmax(x, w, ln_fold=fold, screen=scr)
cp.cuda.runtime.deviceSynchronize()
print("tokens", a, b)
