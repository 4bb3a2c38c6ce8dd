"""GPT-2 on CuPy arrays and gpt2-cupy's kernels: prefill, a KV-cached decode step, logits.

Shapes: B sequences, T tokens, C = n_embd, H heads of D = C / H, V vocabulary.
Linear weights are stored (out, in), the transpose of GPT-2's Conv1D layout, so that the
decode step's products stream each weight row once and the LM head reads ``wte`` as is.

Prefill packs prompts along time, without padding, and runs one forward over all of them:
float16 / bfloat16 products on the project's tensor-core gemm (a row's bits never depend on
the rows beside it), attention by flash_attention with each prompt's offsets, keys and values
scattered into each prompt's cache row. float32 prefills each prompt alone, its products on
cuBLAS through CuPy. Either way a prompt's numbers never depend on what it is batched
with. The decode step runs every sequence at once on preallocated buffers with the
project's kernels only: it is recorded once as a launch plan and replayed for each token,
optionally as a CUDA graph.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import cupy
import numpy

import cupy_kernels as K
from cupy_kernels import _build
from cupy_kernels.decode_attention import AHEAD_DEEP, launch_config
from cupy_kernels.fixed_attention import HEAD_DIM as FIXED_HEAD_DIM
from cupy_kernels.fixed_attention import MAX_KEYS as FIXED_MAX_KEYS
from cupy_kernels.linear import SCREEN_MAX_ROWS

from .config import SIZES, GPT2Config

# tokens of one packed prefill forward: enough rows to fill the GPU with every product (GPT-2
# small's 768-wide ones are 384 tiles of 128 x 128 at 8,192 rows), while its activations stay
# at about 16 C float32 values a token (GPT-2 XL: 0.8 GiB)
PREFILL_TOKENS = 8192
# 16-bit prompts of at most SHORT_PROMPT tokens are prefilled with the decode step's products
# (cupy_kernels.linear: a weight read once for up to 64 rows, requested before the kernel ahead
# ends), packed only with consecutive short prompts (up to SHORT_PACK tokens, below; packs of
# at most 64 tokens put 256 prompts of 8 tokens in 32 forwards, each recorded and
# captured again in every call past the PLANS kept, and GPT-2 small's 512-token call at batch 256
# took 1.356 against 1.032 s, benchmarks/results/e2e_short_packs-h100.json); longer prompts with
# the tiled gemm. Each gives a row the same bits alone or packed, and a prompt's length alone
# picks which, so a prompt gets the same numbers whatever it is prefilled with. (The gemm at 8 rows:
# GPT-2 XL's q|k|v 6.6 TFLOP/s, 18.6 us against 5.2 for its bytes: benchmarks/results/
# gemm_short-h100.json.) H100, float16, a warm prefill as generate runs it (its CUDA graph),
# ms, short prompts on linear / all on the gemm (benchmarks/results/short_prefill-h100.json):
# GPT-2 small one prompt of 8 tokens 0.391 / 0.578, of 16 0.424 / 0.585, four of 8 0.481 /
# 0.599, a one-token call of 8 0.511 / 0.702; XL 2.408 / 3.325, 2.723 / 3.319, 3.167 / 3.516,
# 2.475 / 3.593. Packs past 256 tokens then ran launch by launch and cost more on linear: GPT-2
# small 64 prompts of 8 6.654 / 5.475, 256 of 8 7.557 / 6.549 (short_prefill_packs-h100.json).
SHORT_PROMPT = 16
# ... and, like the decode step, with each LayerNorm folded into the product after it (the
# products that add to the residual stream, and the embedding, leave its row statistics), so
# that a layer runs no LayerNorm launch: the same function, other bits than the unfolded
# products give (a prompt's bits still depend on its length alone). H100, float16, a warm
# prefill as generate runs it, ms, folded / unfolded, packs of up to 8,192 tokens in both
# (benchmarks/results/fold_prefill_pack-h100.json, "bigpack" / "before"): GPT-2 small one
# prompt of 8 tokens 0.243 / 0.358, of 16 0.299 / 0.393, four of 8 0.329 / 0.444, a one-token
# call 0.355 / 0.448; XL 1.888 / 2.190, 2.199 / 2.555, 2.757 / 3.015, 2.010 / 2.337; 256 prompts
# of 8, one eager forward: small 7.100 / 7.092, XL 85.886 / 77.315.
PREFILL_FOLD = True
# Prefills into a cache (16-bit models; generate's) are recorded once per bucket of their shape
# and replayed (_forward): the packed tokens and the longest prompt rounded up to one of eight
# sizes an octave (record_size, at least 8 tokens), the prompt count the same way; the rows past
# the prompts are padding, which no sequence attends to and whose keys and values are not
# written, and each call copies in its token ids, positions, cache rows and offsets. (Every
# product, LayerNorm and attention gives a row the same bits whatever rows it runs with: a
# prompt gets the numbers it gets launch by launch.) A record holds at most RECORD_TOKENS
# tokens; a cache keeps at most PLANS records and RECORD_TOKENS tokens of them, the least
# recently used dropped first. Launch by launch, a forward costs the host tens of microseconds
# a kernel in the wrappers' checks. H100, float16, a warm prefill as generate runs it, ms, the
# records / the code before them (launch by launch past 256 tokens; one run,
# benchmarks/results/prefill_records_final*-h100.json): GPT-2 small one prompt of 512 tokens
# 0.999 / 4.884 (GPU time alone 0.876 / 1.056), four of 300 1.567 / 4.684, XL 8.041 / 17.484
# (7.969 / 8.855) and 15.972 / 18.142.
RECORD_TOKENS = 2048
PLANS = 8
# ... and, on a stream of the caller's own (the engine's sessions), a record runs as a CUDA graph
# from its second use on (captured then; the first runs launch by launch, so that a shape seen
# once costs what the forward costs without a record), with programmatic dependent launch where
# available: the host then pays one launch instead of one per kernel (GPT-2 XL: about 390).
PREFILL_GRAPH = True
# Tokens a pack of short prompts takes at most (in runs of few packs, SHORT_RECORDS below), so
# that each pack replays a record (packs of equal prompts share one). H100, float16, folded, ms, packs of
# 256 / 8,192 tokens, each pack then recorded or run launch by launch
# (fold_prefill_pack-h100.json): GPT-2 small 64 prompts of 8 2.034 / 6.065, 256 of 8 7.993 /
# 7.100; XL 24.445 / 24.054, 97.413 / 85.886. Packs of 512 / 1,024 (fold_prefill_packs-h100.json,
# against 256): small 256 of 8 6.590 / 6.195 against 8.085, XL 90.120 / 86.594 against 98.601.
SHORT_PACK = 256
# A run of consecutive short prompts of more than SHORT_RECORDS such packs' tokens is prefilled
# in packs of up to PREFILL_TOKENS instead, launch by launch: many packs of other shapes would
# each be recorded (as a launch-by-launch forward) and some dropped again before their next
# use. H100, float16, ms, with / without the rule (benchmarks/results/short_records-h100.json,
# the records then kept per prompt lengths and cache rows, 8 a cache): GPT-2 small 512 prompts
# of 8 13.5 / 148.8, 256 of 8 7.16 / 8.17, XL 172.0 / 613.1 and 87.7 / 98.7; 128 of 8 in
# recorded packs / one launch-by-launch forward small 4.12 / 6.19, XL 49.7 / 45.0.
SHORT_RECORDS = PLANS // 2

# Most keys a chunk of each sequence's cache takes in the decode step's attention, whatever the
# batch: a sequence of len keys takes ceil(len / DECODE_SPLIT_KEYS) equal chunks, a block a head
# each, merged by the last to finish, so its numbers follow its own length alone (not what it
# is batched with, nor the cache bucket), and one of at most DECODE_SPLIT_KEYS keys is one block
# with nothing to merge.
# (Before, every cache was cut in 3 equal chunks merged by a kernel of their own.) H100, GPT-2
# small float16, us a layer in a CUDA graph (benchmarks/results/decode_splits-h100.json, 1 /
# 3 equal splits with the merge kernel): batch 1 with 264 cached keys 3.75 / 4.40, 520 5.20 /
# 4.83, 1,000 7.70 / 5.85; batch 64 20.8 / 24.7, 36.9 / 39.9, 67.5 / 70.1; batch 256 71.1 /
# 87.1: one block a head wins wherever the batch fills the GPU, and short caches at any batch;
# the split pays for one sequence of long caches. Chunks of 512 keys: one block up to half of
# GPT-2's 1,024 positions, two past it. The whole step (H100, float16, CUDA graph with PDL,
# 264 cached keys, against 3 equal splits in the same run): GPT-2 small at batch 1 249 / 251
# us, 64 654 / 702, 256 2048 / 2192; GPT-2 XL at batch 1 1923 / 1916. Equal chunks of at most
# 384 / 448 / 512 keys (the step with PDL, us, two runs): batch 1 with 264 keys 246-256 / 247-248
# / 248-248, 900 keys 292-293 / 294-296 / 306-306; batch 64 with 264 keys 670-676 / 673-674 /
# 655-656, 520 903-907 / 905-907 / 897-899, 900 1185-1188 / 1184-1193 / 1190-1191; 512 new
# tokens at batch 64 90.8k-91.4k / 89.4k-91.7k / 94.5k-94.6k tok/s; the 1,000-prompt workload
# (benchmarks/e2e.py) with 64 slots 59.9k, 55.6k / 56.4k, 52.0k / 60.9k, 56.6k (the two runs of
# each in the order 384, 512, 448, 384, 512, 448: the spread is the runs').
# Chunks of one or two loop trips (64 or 128 keys at 128 threads; branch attention-fixed-chunks),
# every split requesting its rows before the wait, lost wherever a sequence fits in one 512-key
# chunk: the step with PDL at 64 / 264 / 520 / 900 cached keys, us, 512 against 128 (two rounds
# of one run, benchmarks/results/attention_fixed_chunks-h100.log): GPT-2 small float16 B = 1
# 225.7 / 236.7 / 262.3 / 291.7 against 234.3 / 255.1 / 254.9 / 263.0, XL 1585.5 / 1604.6 /
# 1717.5 / 1837.0 against 1615.8 / 1685.7 / 1697.9 / 1718.5; with the rows requested only once
# the length is known, 250.3 at 264 keys for small. The merge of the chunks costs more than the
# trips it saves up to about 264 keys (the e2e benchmark's 512 tokens average 264).
# One chunk up to 512 keys and chunks of 256 / 128 keys past it (a rule in chunk_length; the
# grid then holds 4 / 8 blocks a head, the unused ones returning after the wait) won on long
# caches and cost GPT-2 XL at batch 1 on short ones, where only those unused blocks differ (two rounds of one run, benchmarks/results/
# attention_single_chunk-h100.log, 256 keys): GPT-2 small B = 1 220.4 / 231.1 / 250.5 / 271.8
# against 221.6 / 232.7 / 255.5 / 289.2, B = 8 261.2 against 268.5 at 264; XL B = 1 1594.9 /
# 1614.5 / 1696.5 / 1777.2 against 1568.5 / 1574.9 / 1685.6 / 1811.2. With the attention also
# letting the next kernel start at its own start (benchmarks/results/
# attention_trigger_start_chunks-h100.log), chunks of 256 keys for every length: GPT-2 small
# B = 1 211.9 / 241.1 / 246.3 / 261.9 against 220.7 / 232.0 / 257.3 / 287.6, XL 1543.8 / 1670.8
# / 1703.3 / 1750.4 against 1557.7 / 1576.1 / 1687.2 / 1812.2.
DECODE_SPLIT_KEYS = 512
DECODE_WIDE_THREADS = 512  # decode_attention's block for a float32 cache (_decode_attention_shape; DECODE_FIXED_FLOAT32 None)
# The decode step's attention keeps AHEAD_DEEP sets of loop trips in flight ahead instead of
# one (decode_attention.cuh, attend's AHEAD; the same numbers) at batches of up to
# DECODE_AHEAD_BATCH for models at least this wide. H100, float16, the step with PDL at 64 /
# 264 / 520 / 900 cached keys, us, 4 ahead against 1 at batch 1 (benchmarks/results/
# attention_ahead-h100.log, attention_depth_sizes-h100.log, two rounds of one run each):
# GPT-2 medium (1,024 wide) 509.6 / 548.7 / 594.5 / 622.0 against 513.4 / 565.5 / 615.7 /
# 654.3, large 982.6 / 1027.6 / 1092.8 / 1149.7 against 986.5 / 1059.5 / 1150.5 / 1231.9, XL
# 1552.8 / 1554.8 / 1605.9 / 1686.3 against 1564.3 / 1576.4 / 1688.1 / 1813.7; but GPT-2 small
# (768) 226.0 / 241.3 / 264.3 / 282.4 against 220.6 / 231.5 / 257.0 / 288.9, small at batch 8
# 286.9 against 266.0 at 264 keys and XL at batch 8 1916.2 against 1794.1 at 64 (XL at batch 8
# tied past 64 keys).
DECODE_AHEAD_WIDTH = 1024
# Batches of 2 to 4 win too (benchmarks/results/attention_ahead_batch-h100.log, the same
# measure, one run, the first round's figures, us): B = 2 medium 522.9 / 559.2 / 610.3 / 648.0
# against 525.4 / 576.9 / 631.1 / 674.7, large 980.7 / 1004.9 / 1062.4 / 1139.1 against 986.4 /
# 1062.4 / 1144.2 / 1246.5, XL 1596.7 / 1608.4 / 1693.3 / 1809.6 against 1609.9 / 1655.6 /
# 1779.9 / 1923.8; B = 4 medium 529.5 / 567.9 / 646.3 / 703.3 against 529.9 / 573.2 / 646.9 /
# 720.6, XL 1674.8 / 1714.6 / 1898.2 / 2068.9 against 1682.9 / 1752.0 / 1926.7 / 2137.0 (and at
# B = 1 in bfloat16: large 987.3 / 1020.9 / 1088.4 / 1152.2 against 1003.9 / 1082.6 / 1166.8 /
# 1258.7, XL 1601.5 / 1597.3 / 1674.9 / 1771.6 against 1611.6 / 1692.3 / 1792.5 / 1892.7).
# Batches of 8 too, measured on one session's buffers (benchmarks/step_variants.py; ahead_batch-
# h100.json, us a sweep of 512 replays from 8 cached keys, 1 / 4 trips ahead): medium 608.6 /
# 595.2, large 1151.3 / 1129.8, XL 1975.1 / 1974.3 (GPT-2 small at batch 2 and 4, which stays
# at one: 219.6 / 220.5 and 232.1 / 235.0, ahead_small-h100.json).
DECODE_AHEAD_BATCH = 8
# L2 warm-up in the decode step (decode_attention's warm=): at batch 1 (and up to
# DECODE_WARM_BATCH), for 16-bit models of these widths, extra blocks of each attention read the
# first DECODE_WARM_BYTES of the block's MLP down weight into L2. The attention leaves the
# memory idle, and the MLP down requests its weights last (its blocks take an SM's registers:
# they start once the MLP up's leave).
# On an H100 (float16, the step with PDL, a sweep of 512 replays from 8 cached keys as a 512-token call
# runs them, us a step, two rounds of one run; benchmarks/results/l2_warm_final_1-h100.log and
# _2): GPT-2 medium 516.7 / 516.7 against 538.2 / 538.0, large 958.1 / 958.2 against 1018.8 /
# 1021.9, small 209.5 / 209.5 and XL 1608.8 / 1608.7 (which warm nothing) against 208.8 / 209.7
# and 1605.0 / 1604.7. Choosing it (an earlier form of the kernel, rows and columns of W: the
# same bytes for whole rows; branch l2-warm; l2_warm_mlp_down-h100.log): medium 519.2 / 519.3
# warming 2.6 MB against 535.1 / 535.0 (525.3 / 525.5 warming 1.3 MB, 519.1 / 519.0 4 MB), large
# 964.8 / 964.5 against 1016.1 / 1015.9 (its MLP up past the first batch instead, 2.6 MB: 956.0 /
# 955.5), XL 1595.6 against 1596.6 (one round); GPT-2 small lost, 223.1 / 222.8 against 216.3 /
# 216.5 (its whole MLP down, 4.7 MB: 233.5 / 232.8), and so did medium's whole MLP down (8.4
# MB), 561.3 / 561.4 against 540.3 / 540.1 (l2_warm_mlp_down_small-h100.log); XL's MLP up past
# its first batch (7.4 MB) took 1695.2 against 1597.2 (l2_warm_blocks-h100.log). The bytes
# measured again on one session's buffers (benchmarks/step_variants.py, which measures to about
# 0.3%; warm_bytes-h100.json, us a sweep warming 2.6 / 3.3 / 4 / 5 / 6 MB): medium 521.1 / 516.6
# / 515.0 / 513.7 / 515.9, large 974.2 / 962.5 / 955.5 / 953.1 / 956.1.
DECODE_WARM_WIDTHS = (1024, 1280)
DECODE_WARM_BYTES = 5_000_000
# Batches (session rows) of up to DECODE_WARM_BATCH warm too. The same measure at 2 / 4 rows,
# us a sweep without / with the warm-up (warm_batch-h100.json): medium 546.7 / 528.3 and 558.6
# / 557.5, large 1010.8 / 983.3 and 1012.1 / 1091.8.
DECODE_WARM_BATCH = 2
# KV rows into L2 ahead of the decode step's attention (decode_attention's prefetch=): for 16-bit
# models of a width in DECODE_PREFETCH_BATCHES, at batches from 2 to the width's entry, each
# attention block requests its chunk's older rows into L2 before it waits for the q|k|v product.
# On an H100 (float16, us a sweep of 512 replays from 8 cached keys on one session's buffers,
# without / with; benchmarks/results/kv_prefetch-h100.json, kv_prefetch_batches-h100.json,
# kv_prefetch_sizes-h100.json): GPT-2 small B = 2 220.2 / 217.5, B = 4 232.4 / 227.8, B = 8
# 254.3 / 247.4, B = 16 329.6 / 324.0; medium B = 2 529.3 / 524.6, B = 4 553.1 / 544.0 (as taken,
# kv_prefetch_medium-h100.json: 535.7 / 528.3, 545.7 / 536.9, bfloat16 B = 4 555.4 / 546.8). It lost or
# did nothing elsewhere: small B = 1 213.5 / 213.5, B = 32 427.6 / 434.0, B = 64 615.0 / 643.6;
# medium B = 8 587.5 / 591.0; large B = 2 983.1 / 978.6 (0.5%), B = 4 1030.7 / 1032.7; XL B = 1
# 1608.9 / 1613.8, B = 8 1983.7 / 2026.3. The same numbers either way.
DECODE_PREFETCH_BATCHES = {768: 16, 1024: 4}
# Paced weight requests in the decode step (linear's pace=): for 16-bit models of a width in
# DECODE_PACE_WIDTHS, at batches of up to DECODE_PACE_BATCH, the blocks of the q|k|v and MLP up
# products request their weights tile after tile at DECODE_PACE_GBPS instead of all at their
# (early) start. Those products start during the attention and the projection before
# them, and their requests queued ahead of the loads those kernels wait for: a load that hits in
# L2 waits 244 ns while 4.3 MB stream, 1.66 us with 8.7 MB requested at once (H100,
# benchmarks/results/memory_queue-h100.json). The rule as taken, on an H100 (float16, us a
# sweep of 512 replays from 8 cached keys on one session's buffers, paced / unpaced, and the
# wall time a token of a 512-token call; benchmarks/results/pace_rule-h100.json): GPT-2 small
# at batch 1 201.22 / 213.00 (calls 204.3 / 215.9), at batch 8 253.55 / 255.27, medium at batch
# 1 467.73 / 506.08 (470.7 / 509.0); GPT-2 large paced as well lost, 1116.86 against 964.55.
# Batches 2 and 4, and bfloat16 (pace_batches-h100.json): small float16 at batch 2 207.42 /
# 215.44, at 4 221.14 / 226.06, bfloat16 at 1 201.48 / 213.64, at 8 257.05 / 259.65; medium
# float16 at 2 478.35 / 523.49, at 4 517.54 / 547.11, bfloat16 at 1 479.83 / 525.89.
# Choosing it (the same measure, through a module constant of the launches by epilogue, branch
# pacing-knob: pacing_small-h100.json, pacing_roles-h100.json): GPT-2 small at batch 1
# 212.90 unpaced, 202.66 / 200.74 / 201.99 paced at 3000 / 2000 / 1500 GB/s (calls 214.8 /
# 204.5 / 202.6 / 203.8), at batch 8 255.15 against 250.69 / 253.26 / 255.10; medium at batch 1
# 507.26 against 471.76 / 466.54 / 493.80. Pacing only the q|k|v product at 3000: small 207.93,
# medium 496.89; only the MLP up: small 207.54. Pacing the products with a residual add as well
# (the attention projection and the MLP down, which the next kernel waits for soon after they
# start) lost it: small 210.75 with all four at 3000. GPT-2 XL lost with any pacing (its layers
# keep the memory busy): 1612.56 unpaced, 1662.97 / 1735.48 with the MLP up alone at 6000 /
# 3000, 1881.85 with q|k|v and MLP up at 3000.
# With fixed_attention (benchmarks/results/pace_fixed-h100.json, pace_fixed_batches-h100.json,
# us a sweep, 2000 / 2500 / 3000 / 4000 GB/s, unpaced): GPT-2 small float16 at batch 1 192.81 /
# 192.96 / 194.29 / - / 202.83, 2 194.89 / 195.41 / 196.12 / 198.05, 4 216.75 / 216.59 / 216.54 /
# 217.24, 8 239.80 / - / 236.91 / - / 238.19 and 245.73 / 244.30 / 242.83 / 242.67 (another run),
# bfloat16 at 8 241.36 / 239.72 / 238.52 / 237.99; medium at 1 451.96 / 463.78 / 469.46 / 480.50,
# at 8 561.09 / 567.96 / 569.00 / 570.42. GPT-2 small's sessions of 8 rows (5 to 8 sequences)
# take 3000 (DECODE_PACE_FAST; as taken, pace_fast-h100.json: 242.86 against 245.98 us at batch
# 8, bfloat16 242.46 against 244.78, batch 1 193.58 against 193.47, the same launches).
DECODE_PACE_GBPS = 2000
DECODE_PACE_WIDTHS = (768, 1024)
DECODE_PACE_BATCH = 8
DECODE_PACE_FAST = {768: (5, 3000)}  # width: (from this many rows on, GB/s)
# GPT-2 small's pace below DECODE_PACE_FAST's rows follows the device's peak DRAM bandwidth
# (_build.peak_memory_GBps): a share of it instead of DECODE_PACE_GBPS, where the device gives
# it. 2000 GB/s measured best on the H100 (above: 0.60 of its 3,352), 2950-3500 on the H200
# (0.61-0.73 of its 4,814; us a sweep as above, 2000 / paced faster, float16 at batch 1:
# 168.72 / 167.35 at 2950 and 166.99 at 3500, benchmarks/results/h200_pace_b1-h200.json;
# 169.31 / 167.86 at 3000, h200_knobs-h200.json; 165.54 / 163.18 at 3000,
# h200_knobs2_small-h200.json). As taken (pace_share-h200.json: a share of 0.6, 2,889 GB/s, /
# 2000 / a share of 0.7, 3,370): float16 at batch 1 161.21 / 163.28 / 161.53, at 2 168.16 /
# 171.60 / 167.59, at 4 186.99 / 191.04 / 186.30, bfloat16 at 1 163.31 / 166.09 / 164.02.
# GPT-2 medium's does not follow it: 2000 measured best on both chips (379.78 against 383.96 at
# 2950 on the H200, h200_pace_b1-h200.json).
DECODE_PACE_PEAK_SHARE = {768: 0.6}


def decode_pace(C: int, B: int, peak_GBps: float | None) -> float | None:
    """GB/s at which the decode step's q|k|v and MLP up products of a 16-bit model of width
    ``C`` request their weights at batch ``B`` on a device of ``peak_GBps`` peak DRAM
    bandwidth (None: unknown), or None: unpaced (DECODE_PACE_* above)."""
    if B > DECODE_PACE_BATCH or C not in DECODE_PACE_WIDTHS or not DECODE_PACE_GBPS:
        return None
    fast = DECODE_PACE_FAST.get(C)  # (from this many rows on, GB/s)
    if fast is not None and B >= fast[0]:
        return fast[1]
    share = DECODE_PACE_PEAK_SHARE.get(C)
    return round(share * peak_GBps) if share and peak_GBps else DECODE_PACE_GBPS


# The decode step's embedding also leaves its rows' statistics (embedding's stats_out), so that
# the first q|k|v product folds its LayerNorm as every other product does, instead of each of
# its blocks normalizing x in its prologue (16-bit models; the same function, other bits). In
# the profile (benchmarks/results/decode_step-h100.json) that first product added 9.84 us to
# GPT-2 small's step against 2.43 for the later ones, 18.35 against 6.78 for XL's. H100, us a
# sweep of 512 replays from 8 cached keys on one session's buffers, with / without
# (benchmarks/results/embed_stats-h100.json): GPT-2 small float16 198.83 / 201.10 at batch 1,
# 250.24 / 252.82 at batch 8, medium 465.21 / 467.87, XL 1589.18 / 1597.32.
DECODE_EMBED_STATS = True
# In the graph of several steps (engine.STEPS_PER_GRAPH), greedy 16-bit steps with those
# statistics: each step's argmax also writes the next step's embedding (linear_argmax's
# embed=, the same bits), so that a chained step starts with its first q|k|v product: a
# launch fewer a step. H100, us a step over 512 steps from 8 cached keys on one session's
# buffers, with / without (benchmarks/results/embed_in_argmax-h100.json): GPT-2 small float16
# at batch 1 186.12 / 186.49 (calls 188.0 / 188.3 us a token), XL 1516.00 / 1516.01.
DECODE_EMBED_IN_ARGMAX = True
# The decode step's attention in models with caches of their dtype (16-bit; float32 with
# DECODE_FIXED_FLOAT32; head_dim 64, at most 1,024 positions): fixed_attention, whose bits do
# not depend on its block width, so that the width follows the batch (DECODE_FIXED_THREADS:
# (most sequences, threads), the first that holds B).
# decode_attention's bits depend on its width and chunks, so one of them had to serve every
# batch: 128 threads, where 512 won at batch 1 and lost at 8 (_decode_attention_shape). H100,
# float16, us a sweep of 512 replays from 8 cached keys on one session's buffers, against
# decode_attention (benchmarks/results/fixed_attention_onepass*-h100.json): GPT-2 small at batch
# 1 192.24 (512 threads) / 199.71 (256) against 199.85 (512-token calls 193.9 against 202.0 us a
# token), batch 2 194.48 / 202.61 against 206.17, batch 8 247.34 (512) / 247.28 (256) / 256.71
# (128) against 248.02, batch 64 675.48 / 614.01 / 607.06 against 617.84; GPT-2 XL at batch 1
# 1597.23 / 1597.50 against 1590.56 (its decode_attention requests 4 trips ahead), batch 8
# 1998.80 / 1915.01 / 1962.87 against 1978.58. The rule as taken (fixed_threads_*-h100.json):
# GPT-2 small at batch 4 219.04 (512) / 223.73 (256) against 216.03, batch 16 311.95 (256) /
# 327.66 (128) against 321.32, batch 32 413.95 (128) / 424.91 (256) against 427.59; GPT-2 medium
# at batch 1 451.00 against 461.76. Batches 3 / 4 lose at every width
# (fixed_threads_b3_b4-h100.json): 224.55 / 218.96 (512), 227.03 / 223.63 (256), 233.52 / 228.99
# (128) against 219.56 / 216.16. With model.fused_step on, every batch keeps decode_attention:
# the persistent kernel computes its bits.
DECODE_FIXED_ATTENTION = True
DECODE_FIXED_THREADS = ((4, 512), (16, 256), (None, 128))
# float32 models with float32 caches too (tiles of 8 keys, the fixed point following the sums:
# src_cu/fixed_attention.cu), instead of decode_attention in blocks of DECODE_WIDE_THREADS, with
# these widths ((most sequences, threads) as DECODE_FIXED_THREADS; None: decode_attention); the
# products' triggers at their start (DECODE_PRODUCT_TRIGGERS) are for 16-bit models. H200,
# GPT-2 small float32, us a sweep of 512 replays from 8 cached keys on one session's buffers
# (benchmarks/results/fixed_float32_2-h200.json): batch 1 264.59 (512 threads) against 271.94
# with decode_attention (calls 273.5 / 280.9 us a token); batch 8 1074.08 (512) / 1095.47 (256)
# / 1124.59 (128) against 1086.27. (The first build, whose p v and p sums shared one point:
# 256 threads at batch 1 279.26 against 264.27 at 512, fixed_float32-h200.json.)
DECODE_FIXED_FLOAT32 = ((8, 512), (16, 256), (None, 128))
# In sessions of up to this many rows, fixed_attention lets the next kernel (the attention
# projection, which requests its weights as it starts) start once its blocks have requested
# their cache rows, before its wait for the q|k|v product, instead of after that wait
# (trigger_early; the same numbers). H100, float16, us a sweep of 512 replays from 8 cached
# keys on one session's buffers, before the wait / after it (benchmarks/results/
# fixed_trigger_early-h100.json, fixed_trigger_xl-h100.json, fixed_trigger_sizes-h100.json):
# batch 1 GPT-2 small 193.01 / 193.99 (192.61 / 193.06 in another run, bfloat16 194.49 / 194.41:
# trigger_early_small-h100.json), medium 438.20 / 454.74, large 939.59 / 965.78, XL
# 1534.72 / 1587.23 (1546.11 / 1583.37 in another run); but GPT-2 small at batch 2 195.38 /
# 195.11 and 8 241.98 / 239.93, XL at 4 1704.62 / 1707.25 and 8 1922.10 / 1902.26. At the very
# start of the kernel instead: small 194.07, XL 1550.13 at batch 1. Later than the wait lost
# everywhere (fixed_trigger-h100.json, batch 1, small / XL): once q and the appended rows are
# requested 195.49 / 1599.59 against 193.73 / 1583.08, after the first tile 201.84 / 1636.97,
# after the block's maximum 214.92 / 1679.88.
DECODE_TRIGGER_EARLY_ROWS = 1
# In sessions of one row, where each product of the decode step lets the next kernel start
# (linear's trigger=; the same numbers), by width and role ("qkv", "proj", "up", "down"): "start"
# (as its blocks start) where not named, "requested" (once each block has requested its first
# batch of W), "waited" (once each block has passed its wait for the kernel ahead). 16-bit models
# with 16-bit caches (the fixed_attention step). H100, float16, us a sweep of 512 replays from 8
# cached keys on one session's buffers (benchmarks/results/; the product_trigger* files ran
# branch product-trigger, whose DECODE_PRODUCT_TRIGGER sets a role's point at every width):
# - GPT-2 XL (product_trigger-h100.json): the MLP up "waited" 1508.66 against 1529.35 with every
#   product at "start" (its MLP down takes 16-warp blocks, a whole SM each); the projection
#   "waited" 1585.83; every product "requested" 1528.86. With the MLP up "waited" (1511.33 and
#   1507.89 in two runs, product_trigger2-h100.json, product_trigger3-h100.json) and besides it:
#   the q|k|v "requested" 1503.08 and 1502.17, "waited" 1506.79; the projection "requested"
#   1507.09, but 1510.17 with the q|k|v "requested" too; the MLP down "requested" 1521.74,
#   "waited" 1520.46; the attention in 256-thread blocks with the q|k|v "requested" 1546.61.
# - GPT-2 small (product_trigger_small-h100.json): the q|k|v "requested" 189.98, the projection
#   "requested" 190.18 against 191.73, the MLP up "requested" 191.98 or "waited" 205.35, the MLP
#   down "requested" 195.97; on this code (product_triggers_small-h100.json) the q|k|v and the
#   projection "requested" 188.48 against 190.56 with the q|k|v alone and 192.52 with neither,
#   bfloat16 191.82 / 196.18 / 199.26.
# - GPT-2 large: the MLP up "waited" 924.91 against 929.17 (late_sizes-h100.json), the q|k|v
#   "requested" with it 938.87 against 937.90 (another run, product_trigger_large-h100.json);
#   medium, the MLP up "waited" 452.66 against 437.64 (late_sizes-h100.json). Neither is taken
#   (large's 0.5% comes from one run).
# Greedy 16-bit decode steps of sessions of up to DECODE_SCREEN_ROWS rows screen the LM head
# (linear_argmax's screen=: the LM head's weight at 8 bits bounds every row's value, and only the
# tiles of 16 rows that may hold the largest are computed exactly; the same tokens, the same
# bits). In a diagnostic run's 512-token calls of random weights, 1 to 3 of GPT-2's 3,142 tiles
# remained. H100, float16, us a sweep of 512 replays from 8 cached keys on one session's
# buffers, screened / exact (benchmarks/results/head_screen-h100.json): GPT-2 small at batch 1
# 179.55 / 185.10, XL 1481.62 / 1499.45, but GPT-2 small at batch 8 244.31 / 234.60 (the exact
# product reads the weight once for every row). Sessions of 2 / 4 rows, screened / not
# (head_screen_rows-h100.json): 192.03 / 194.97 and 220.88 / 218.93.
DECODE_HEAD_SCREEN = True
DECODE_SCREEN_ROWS = 2
# Greedy float32 decode steps of one row screen the LM head too (linear_argmax's screen= for
# float32 rows: the weight at 8 bits bounds the row's values, and only the blocks of 32 rows
# that may hold the largest are computed exactly, with their bits; the same tokens).
DECODE_HEAD_SCREEN_FLOAT32 = True
DECODE_PRODUCT_TRIGGERS = {768: {"qkv": "requested", "proj": "requested"}, 1600: {"qkv": "requested", "up": "waited"}}
# The same for float32 models with float32 caches (their fixed_attention step; CUDA-core products):
# none gained. H200, GPT-2 small float32 at batch 1, us a sweep as above, against 264.81 / 264.96
# with every product at "start" (benchmarks/results/float32_triggers-h200.json): the q|k|v
# "requested" 264.70, "waited" 265.52; the q|k|v and projection "requested" 266.60; the MLP up
# "waited" 265.71; the MLP down "requested" 265.17; all four "requested" 267.19.
DECODE_PRODUCT_TRIGGERS_FLOAT32 = {}
# The products with a folded LayerNorm ("qkv", "up") that take one warp more a block, which
# combines the rows' statistics while the others multiply (linear's stats_warp=; the same
# numbers), by width: {role: (fewest, most rows of the session)}. H100, float16, us a sweep of
# 512 replays from 8 cached keys on one session's buffers, none / the q|k|v / the q|k|v and
# MLP up (benchmarks/results/stats_warp_rows-h100.json, stats_warp_sizes-h100.json): GPT-2
# small B = 1 180.55 / 175.24 / 183.02, 2 190.34 / 185.52 / 191.83, 4 219.17 / 207.72 /
# 204.22, 8 237.89 / 231.00 / 233.33 (bfloat16 B = 1 182.81 / 178.53 / 186.01); medium B = 1
# 433.47 / 412.23 / 411.09; XL B = 1 1511.60 / 1477.69 / 1591.78. The MLP up's block of one
# warp more leaves no room beside it for a block of the MLP down, which then starts late. Across
# processes, GPT-2 small at B = 1 with this table 173.61 / 173.60 against 175.91 / 175.95 for
# the code before it (stats_warp_main_*-h100.json); the in-session gains above are larger than
# that by about 1.4% (NOTES, "The statistics warp"), so XL's 2.2% was not taken then. On the
# H200 XL's q|k|v with it gained in every run: 1287.83 against 1295.46 (h200_xl_knobs-h200.json),
# 1280.14 against 1284.45 (h200_knobs2_xl-h200.json), 1271.83 against 1297.61 (the 512-token
# calls 1273.7 against 1299.5 us a token; pace_share-h200.json), so XL takes it at batch 1.
DECODE_STATS_WARP = {768: {"qkv": (1, 8)}, 1024: {"qkv": (1, 1)}, 1600: {"qkv": (1, 1)}}

# dtype names -> (numpy dtype, torch dtype name)
DTYPES = {
    "float32": (numpy.dtype(numpy.float32), "float32"),
    "float16": (numpy.dtype(numpy.float16), "float16"),
}
if _build.BFLOAT16 is not None:
    DTYPES["bfloat16"] = (_build.BFLOAT16, "bfloat16")
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


def short_prompt(dtype, longest: int) -> bool:
    """Whether prompts of at most ``longest`` tokens take the short prompts' products
    (SHORT_PROMPT)."""
    return dtype != numpy.float32 and longest <= SHORT_PROMPT


def record_size(n: int, least: int = 1) -> int:
    """n rounded up to a multiple of max(least, 2^(bit_length(n - 1) - 4)): one of eight sizes
    an octave, at most an eighth over n past 8 least (a recorded prefill's bucket)."""
    step = max(least, 1 << max(0, (n - 1).bit_length() - 4))
    return -(-n // step) * step


def _prefill_meta(rows, sizes, slots, T: int, n: int) -> numpy.ndarray:
    """What a prefill of prompts ``rows`` (of ``sizes`` tokens) copies to the GPU, int32: the
    token ids, their positions and cache rows (``slots`` per prompt, None without a cache) for
    T rows, the n + 1 offsets of the prompts, and the row of each prompt's last token (T >=
    their tokens, n >= their count: the rows past them are padding, token 0 at position 0 in
    cache row -1, and the offsets past them repeat the last). Each part starts on a 32-byte
    boundary (_meta_views)."""
    stride = -(-T // 8) * 8
    count, tokens = len(sizes), sum(sizes)
    meta = numpy.zeros(3 * stride + 2 * n + 1, dtype=numpy.int32)
    offsets, last = meta[3 * stride:3 * stride + n + 1], meta[3 * stride + n + 1:]
    if count == 1:  # (one prompt: fewer numpy calls, the host's time of a one-token call)
        meta[:tokens] = rows[0]
        meta[stride:stride + tokens] = numpy.arange(tokens, dtype=numpy.int32)
        offsets[1:] = tokens
        last[0] = tokens - 1
    else:
        lengths = numpy.asarray(sizes, dtype=numpy.int32)
        numpy.cumsum(lengths, out=offsets[1:count + 1])
        offsets[count + 1:] = tokens
        last[:count] = offsets[1:count + 1] - 1
        meta[:tokens] = numpy.concatenate(rows)
        meta[stride:stride + tokens] = numpy.arange(tokens, dtype=numpy.int32) - numpy.repeat(offsets[:count], lengths)
    if slots is not None:
        meta[2 * stride:2 * stride + tokens] = slots[0] if count == 1 else numpy.repeat(
            numpy.asarray(slots, dtype=numpy.int32), sizes)
        meta[2 * stride + tokens:3 * stride] = -1
    return meta


def _meta_views(meta: cupy.ndarray, T: int, n: int) -> tuple:
    """(ids, positions, cache rows, offsets, last rows) in a device copy of _prefill_meta's
    array (the last rows of all n prompts, padding ones included)."""
    stride = -(-T // 8) * 8
    return (meta[:T], meta[stride:stride + T], meta[2 * stride:2 * stride + T], meta[3 * stride:3 * stride + n + 1],
            meta[3 * stride + n + 1:3 * stride + 2 * n + 1])


@dataclass
class _Record:
    """A prefill recorded into a cache (GPT2._forward): its launches, the device copy of its
    per-call data (_prefill_meta), its outputs (x, y of _blocks), its rows, and its CUDA graph
    once captured."""
    plan: object
    meta: cupy.ndarray
    x: cupy.ndarray
    y: cupy.ndarray | None
    tokens: int
    graph: object = None
    uses: int = 0


def dtype_name(dtype) -> str:
    """Canonical dtype name ('float32', 'float16', 'bfloat16') or ValueError."""
    name = str(dtype).replace("torch.", "")
    name = _ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return name


@dataclass
class _Block:
    ln_1_w: cupy.ndarray
    ln_1_b: cupy.ndarray
    attn_w: cupy.ndarray  # [3C, C]
    attn_b: cupy.ndarray  # [3C]
    attn_proj_w: cupy.ndarray  # [C, C]
    attn_proj_b: cupy.ndarray
    ln_2_w: cupy.ndarray
    ln_2_b: cupy.ndarray
    fc_w: cupy.ndarray  # [4C, C]
    fc_b: cupy.ndarray  # [4C]
    mlp_proj_w: cupy.ndarray  # [C, 4C]
    mlp_proj_b: cupy.ndarray
    # 16-bit models: ln_1 / ln_2 folded into attn_w / fc_w (GPT2._fold_layernorms), and for the
    # decode step's epilogue their row sums u and folded biases c, float32 [N]
    attn_u: cupy.ndarray | None = None
    attn_c: cupy.ndarray | None = None
    fc_u: cupy.ndarray | None = None
    fc_c: cupy.ndarray | None = None


class KVCache:
    """Keys and values of every layer: [n_layer, B, H, S_max, D] each, plus the device
    arrays the decode step reads: ``positions`` (where the next token goes, int32 [B]) and
    ``lengths`` (valid rows after it is appended, int32 [B]).

    kv_dtype None stores the model's dtype; 'int8' or 'fp8' (e4m3, held as uint8) store
    each row of D values quantized with a float32 scale of its own in ``k_scale`` /
    ``v_scale`` [n_layer, B, H, S_max] (see src_cu/kv.cuh)."""

    def __init__(self, config: GPT2Config, batch: int, max_len: int, dtype, kv_dtype=None):
        shape = (config.n_layer, batch, config.n_head, max_len, config.head_dim)
        storage = K.kv_storage_dtype(kv_dtype, dtype)
        self.k = cupy.empty(shape, dtype=storage)
        self.v = cupy.empty(shape, dtype=storage)
        self.k_scale = self.v_scale = None
        if storage != numpy.dtype(dtype):
            self.k_scale = cupy.empty(shape[:-1], dtype=numpy.float32)
            self.v_scale = cupy.empty(shape[:-1], dtype=numpy.float32)
        self.positions = cupy.zeros(batch, dtype=numpy.int32)
        self.lengths = cupy.zeros(batch, dtype=numpy.int32)
        self.max_len = max_len
        self.plans: dict = {}  # recorded prefills into this cache (GPT2._forward)

    def layer(self, i: int) -> dict:
        """Layer i's cache arrays as keyword arguments of kv_append and decode_attention."""
        scales = {} if self.k_scale is None else {"k_scale": self.k_scale[i], "v_scale": self.v_scale[i]}
        return {"k_cache": self.k[i], "v_cache": self.v[i], **scales}


class GPT2:
    """A GPT-2 model whose weights are CuPy arrays.

    Build it with :meth:`from_pretrained` (Hub name or local directory), :meth:`from_hf`
    (an in-memory ``transformers.GPT2LMHeadModel``) or :meth:`random`.
    """

    def __init__(self, config: GPT2Config, weights: dict, dtype="float32"):
        self.config = config
        self.dtype_name = dtype_name(dtype)
        self.dtype = DTYPES[self.dtype_name][0]
        C = config.n_embd
        for key, a in weights.items():
            if not isinstance(a, cupy.ndarray) or a.dtype != self.dtype or not a.flags.c_contiguous:
                raise TypeError(f"weight {key!r} must be a contiguous cupy array of {self.dtype}")
        self.wte = weights["wte"]  # [V, C]
        self.wpe = weights["wpe"]  # [P, C]
        self.lm_head = weights.get("lm_head", self.wte)  # [V, C], tied to wte in GPT-2
        self.ln_f_w, self.ln_f_b = weights["ln_f.w"], weights["ln_f.b"]
        fields = {
            "ln_1_w": "ln_1.w", "ln_1_b": "ln_1.b", "attn_w": "attn.w", "attn_b": "attn.b",
            "attn_proj_w": "attn_proj.w", "attn_proj_b": "attn_proj.b", "ln_2_w": "ln_2.w",
            "ln_2_b": "ln_2.b", "fc_w": "fc.w", "fc_b": "fc.b", "mlp_proj_w": "mlp_proj.w",
            "mlp_proj_b": "mlp_proj.b",
        }
        self.blocks = [
            _Block(**{f: weights[f"h.{i}.{k}"] for f, k in fields.items()}) for i in range(config.n_layer)
        ]
        self._engine = None
        # True: greedy decoding of one sequence in a 16-bit model runs as one persistent kernel
        # (record_step, cupy_kernels.decode_step), with the same numbers as the kernel-by-kernel
        # step. Off by default: it is slower so far (H100, float16, CUDA graph: GPT-2 small 472
        # against 217 us a step at 264 cached keys; benchmarks/results/fused_step-h100.json)
        self.fused_step = False
        if self.wte.shape != (config.vocab_size, C):
            raise ValueError(f"wte has shape {self.wte.shape}, expected {(config.vocab_size, C)}")
        self.lm_head_b = self.head_u = self.head_c = None  # [V] when ln_f is folded into the LM head
        self.head_screen = None  # the LM head at 8 bits (K.quantize_rows): ln_f folded, or float32
        self.folded = self.dtype.itemsize == 2
        if self.folded:
            self._fold_layernorms()
        elif K.screens_float(*self.lm_head.shape):  # (DECODE_HEAD_SCREEN_FLOAT32)
            self.head_screen = K.quantize_rows(self.lm_head)

    def _fold_layernorms(self) -> None:
        """Every LayerNorm of a 16-bit model folded into the product after it: its weight and
        bias into the product's (K.fold_layernorm), the LayerNorm left without parameters
        (ones, zeros), so that every forward computes the same function. The decode step
        then normalizes in the products' epilogues from row statistics (record_step). The
        LM head tied to wte becomes a copy when ln_f has parameters to fold."""
        C = self.config.n_embd
        ones, zeros = cupy.ones(C, dtype=self.dtype), cupy.zeros(C, dtype=self.dtype)
        for blk in self.blocks:
            blk.attn_w, blk.attn_b, blk.attn_u, blk.attn_c = K.fold_layernorm(blk.attn_w, blk.attn_b, blk.ln_1_w,
                                                                              blk.ln_1_b)
            blk.fc_w, blk.fc_b, blk.fc_u, blk.fc_c = K.fold_layernorm(blk.fc_w, blk.fc_b, blk.ln_2_w, blk.ln_2_b)
            blk.ln_1_w, blk.ln_1_b, blk.ln_2_w, blk.ln_2_b = ones, zeros, ones, zeros
        if bool((self.ln_f_w == 1).all()) and bool((self.ln_f_b == 0).all()):  # nothing to fold: keep the tie
            self.head_u = self.lm_head.astype(numpy.float64).sum(axis=1).astype(numpy.float32)
            self.head_c = cupy.zeros(self.config.vocab_size, dtype=numpy.float32)
        else:
            self.lm_head, self.lm_head_b, self.head_u, self.head_c = K.fold_layernorm(self.lm_head, None, self.ln_f_w,
                                                                                      self.ln_f_b)
        self.ln_f_w, self.ln_f_b = ones, zeros
        self.head_screen = K.quantize_rows(self.lm_head)  # (DECODE_HEAD_SCREEN)

    # ---------------------------------------------------------------------------------
    # construction
    # ---------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf_model, dtype="float32") -> "GPT2":
        """From an in-memory ``transformers.GPT2LMHeadModel`` (CPU or GPU)."""
        import torch

        from .weights import hf_to_cupy

        name = dtype_name(dtype)
        config = GPT2Config.from_hf(hf_model.config)
        weights = hf_to_cupy(hf_model, config, getattr(torch, DTYPES[name][1]))
        return cls(config, weights, name)

    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype="float32") -> "GPT2":
        """From a Hub name (gpt2, gpt2-medium, gpt2-large, gpt2-xl, distilgpt2) or a local
        directory in transformers' format."""
        from transformers import GPT2LMHeadModel

        name = dtype_name(dtype)
        try:
            hf = GPT2LMHeadModel.from_pretrained(name_or_path)
        except OSError as err:
            raise OSError(
                f"could not load GPT-2 weights from {name_or_path!r}: {err}. Without Hub access, "
                "pass a local directory, or use GPT2.random(...) / --random-weights"
            ) from err
        return cls.from_hf(hf, name)

    @classmethod
    def random(cls, size: str = "gpt2", dtype="float32", seed: int = 0) -> "GPT2":
        """A randomly initialized model of one of the GPT-2 sizes (transformers' init),
        for machines without the real weights: same shapes, same speed."""
        import torch
        from transformers import GPT2LMHeadModel

        if size not in SIZES:
            raise ValueError(f"unknown GPT-2 size {size!r}; choose one of {', '.join(SIZES)}")
        torch.manual_seed(seed)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.device(device):
            hf = GPT2LMHeadModel(SIZES[size].to_hf())
        model = cls.from_hf(hf, dtype)
        del hf
        return model

    # ---------------------------------------------------------------------------------
    # forward passes
    # ---------------------------------------------------------------------------------
    def _matmul(self, x: cupy.ndarray, w: cupy.ndarray, bias: cupy.ndarray | None = None,
                gelu: bool = False, out: cupy.ndarray | None = None, short: bool = False) -> cupy.ndarray:
        """x [T, K] @ w.T (+ bias, then GELU) for w [N, K] (out, in): the prefill's products.
        float16 / bfloat16 on the project's tensor-core products, whose bits for a row do not
        depend on the other rows, so prompts packed together get the numbers they get alone:
        ``linear`` for the tokens of short prompts (``short``, SHORT_PROMPT), ``gemm`` for the
        rest; float32 through cuBLAS (CuPy), whose bits do depend on them, one prompt at a time
        (prefill_groups)."""
        if self.dtype != numpy.float32:
            if short:
                return K.linear(x, w, bias, gelu=gelu, out=out)
            return K.gemm(x, w, bias, gelu=gelu, out=out)
        y = cupy.matmul(x, w.T, out=out)
        if gelu:
            K.bias_gelu(y, bias, out=y)
        elif bias is not None:
            K.bias_add(y, bias, out=y)
        return y

    def prefill_groups(self, lengths) -> list[tuple[int, int]]:
        """How prompts of these lengths are prefilled: runs [lo, hi) of consecutive prompts,
        each run one forward over its tokens packed together, of at most PREFILL_TOKENS
        tokens (or one longer prompt): short prompts (at most SHORT_PROMPT tokens, 16-bit
        models) only with short ones, at most SHORT_PACK tokens together where their run of
        consecutive short prompts holds at most SHORT_RECORDS such packs' tokens. float32
        prefills each prompt alone."""
        short = [short_prompt(self.dtype, n) for n in lengths]
        budget, i = [], 0  # each prompt's pack budget, from its run of short or other prompts
        while i < len(lengths):
            j = i + 1
            while j < len(lengths) and short[j] == short[i]:
                j += 1
            few = sum(lengths[i:j]) <= SHORT_PACK * SHORT_RECORDS
            budget += [SHORT_PACK if short[i] and few else PREFILL_TOKENS] * (j - i)
            i = j
        groups, lo, tokens = [], 0, 0
        for i, n in enumerate(lengths):
            if i > lo and (self.dtype == numpy.float32 or short[i] != short[lo] or tokens + n > budget[lo]):
                groups.append((lo, i))
                lo, tokens = i, 0
            tokens += n
        if lo < len(lengths):
            groups.append((lo, len(lengths)))
        return groups

    def prefill_tokens(self, lengths, at_once: int) -> int:
        """The most tokens one forward packs when up to ``at_once`` prompts of these lengths
        are prefilled together (a bound for the memory check)."""
        longest = max(lengths)
        if self.dtype == numpy.float32:
            return longest
        return max(longest, min(PREFILL_TOKENS, sum(sorted(lengths)[-at_once:])))

    def _prefill(self, rows, cache: KVCache | None, slots, out_last: cupy.ndarray) -> None:
        """Forward over prompts ``rows`` (host int arrays), packed (prefill_groups).

        Appends prompt i's keys and values to cache row ``slots[i]`` when a cache is given,
        and writes its last token's residual stream after the last block (before the final
        LayerNorm, which the LM head applies itself) into ``out_last[i]`` ([n, C]).
        """
        for lo, hi in self.prefill_groups([r.size for r in rows]):
            self._forward(rows[lo:hi], cache, None if slots is None else slots[lo:hi], out_last[lo:hi])

    def _forward(self, rows, cache: KVCache | None, slots, out_last: cupy.ndarray | None):
        """One forward over the tokens of prompts ``rows`` concatenated along time: every
        product over all of them at once, attention by ``flash_attention``'s ``cu_seqlens`` so
        that no prompt sees another's keys, each token's key and value into its prompt's cache
        row. With ``out_last`` ([n, C]) writes each prompt's last residual there (see _prefill)
        and returns None; without, returns the final-LayerNorm output of every token [T, C].

        A prefill into a cache (16-bit models) replays the launches recorded for its bucket of
        shapes (RECORD_TOKENS, record_size), kept with the cache: only its token ids,
        positions, cache rows and offsets are copied in. Its host cost is then a launch per
        kernel, without the wrappers' checks, or, on a stream other than the legacy one, a
        single launch of the record's CUDA graph (PREFILL_GRAPH), captured at its second use.
        """
        cfg = self.config
        eps = cfg.layer_norm_epsilon
        sizes = [int(r.size) for r in rows]
        n, T, longest = len(sizes), sum(sizes), max(sizes)
        short = short_prompt(self.dtype, longest)
        recorded = out_last is not None and cache is not None and self.dtype != numpy.float32
        if recorded:  # padded to the record's bucket
            rows_t = record_size(T, 8)
            seqs, most = record_size(n), min(record_size(longest, 8), rows_t)
            recorded = rows_t <= RECORD_TOKENS
        if not recorded:
            rows_t, seqs, most = T, n, longest
        meta = _prefill_meta(rows, sizes, slots, rows_t, seqs)
        if recorded:
            key = (short, PREFILL_FOLD, rows_t, seqs, most)
            entry = cache.plans.pop(key, None)
            if entry is None:
                meta_dev = cupy.empty(meta.size, dtype=numpy.int32)
                with _build.recording() as plan:
                    x, y = self._blocks(meta_dev, rows_t, seqs, most, short, cache, padded=True)
                entry = _Record(plan, meta_dev, x, y, rows_t)
                while cache.plans and (len(cache.plans) >= PLANS
                                       or sum(e.tokens for e in cache.plans.values()) + rows_t > RECORD_TOKENS):
                    del cache.plans[next(iter(cache.plans))]  # the least recently used
            cache.plans[key] = entry
            entry.meta.set(meta)
            stream = cupy.cuda.get_current_stream()
            if entry.graph is None and entry.uses and PREFILL_GRAPH and stream.ptr != 0:  # (not the legacy stream)
                entry.graph = _build.capture(stream, entry.plan, pdl=_build.pdl_supported())
            entry.uses += 1
            if entry.graph is not None:
                entry.graph.launch(stream)
            else:
                entry.plan.replay()
            x, y, meta_dev = entry.x, entry.y, entry.meta
        else:
            meta_dev = cupy.asarray(meta)
            x, y = self._blocks(meta_dev, T, n, longest, short, cache)
        at = meta.size - seqs  # (_meta_views: each prompt's last row)
        last = meta_dev[at:at + n]
        blk = self.blocks[-1]
        if y is None:  # the folded products: x is the residual stream after the last block
            if out_last is not None:
                cupy.take(x, last, axis=0, out=out_last)
                return None
            return K.layernorm(x, self.ln_f_w, self.ln_f_b, eps=eps)
        if out_last is not None:  # only the last tokens' residuals are needed
            K.layernorm_residual(x[last], y[last], self.ln_f_w, self.ln_f_b, proj_bias=blk.mlp_proj_b, eps=eps,
                                 sum_out=out_last)
            return None
        _, h = K.layernorm_residual(x, y, self.ln_f_w, self.ln_f_b, proj_bias=blk.mlp_proj_b, eps=eps, sum_out=x)
        return h

    def _blocks(self, meta: cupy.ndarray, T: int, n: int, longest: int, short: bool, cache: KVCache | None,
                padded: bool = False):
        """Embedding and every block over T packed tokens, up to the last block's MLP output:
        (x the residual stream before it, y that output); with the folded products of short
        prompts (PREFILL_FOLD), y is None and x is the residual stream after the last block.
        ``meta``: int32 on the device, _prefill_meta's token ids, positions, cache rows and the
        n + 1 prompt offsets; ``longest``: at least the longest prompt. ``padded``: rows past
        the last offset may be padding (a record), whose attention output stays zero. One set
        of buffers serves every layer."""
        cfg = self.config
        C, H, D, eps = cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.layer_norm_epsilon
        ids, positions, token_slots, cu_seqlens, _ = _meta_views(meta, T, n)
        fold = short and self.folded and PREFILL_FOLD
        stats = cupy.empty((T, -(-C // 16), 2), dtype=numpy.float32) if fold else None  # linear's stats_out
        x = K.embedding(ids, self.wte, self.wpe, positions, stats_out=stats)  # [T, C] residual stream
        h = None if fold else K.layernorm(x, self.blocks[0].ln_1_w, self.blocks[0].ln_1_b, eps=eps)  # normalized
        qkv = cupy.empty((T, 3 * C), dtype=self.dtype)
        a = (cupy.zeros if padded else cupy.empty)((1, T, H, D), dtype=self.dtype)
        y = None if fold else cupy.empty((T, C), dtype=self.dtype)
        f = cupy.empty((T, 4 * C), dtype=self.dtype)
        q, k, v = (qkv.reshape(1, T, 3, H, D)[:, :, j] for j in range(3))  # [1, T, H, D] views
        kv = qkv.reshape(T, 1, 3, H, D)  # every token a sequence of one: [T, 1, H, D] views
        k_new, v_new = kv[:, :, 1], kv[:, :, 2]
        for i, blk in enumerate(self.blocks):
            if fold:  # each LayerNorm in the epilogue of the product after it, from x's row statistics
                K.linear(x, blk.attn_w, ln_fold=(stats, blk.attn_u, blk.attn_c, eps), out=qkv)
            else:
                if i > 0:  # the previous block's residual add, and this block's LayerNorm
                    prev = self.blocks[i - 1]
                    K.layernorm_residual(x, y, blk.ln_1_w, blk.ln_1_b, proj_bias=prev.mlp_proj_b, eps=eps, out=h,
                                         sum_out=x)
                self._matmul(h, blk.attn_w, blk.attn_b, out=qkv, short=short)  # [T, 3C]
            if cache is not None:
                K.kv_append(k=k_new, v=v_new, start=positions, slots=token_slots, **cache.layer(i))
            K.flash_attention(q, k, v, causal=True, cu_seqlens=cu_seqlens, max_seqlen=longest, out=a)
            if fold:  # the residual adds in the epilogues, which leave the statistics of x
                K.linear(a.reshape(T, C), blk.attn_proj_w, blk.attn_proj_b, residual=x, out=x, stats_out=stats)
                K.linear(x, blk.fc_w, gelu=True, out=f, ln_fold=(stats, blk.fc_u, blk.fc_c, eps))
                K.linear(f, blk.mlp_proj_w, blk.mlp_proj_b, residual=x, out=x, stats_out=stats)
            else:
                self._matmul(a.reshape(T, C), blk.attn_proj_w, out=y, short=short)
                K.layernorm_residual(x, y, blk.ln_2_w, blk.ln_2_b, proj_bias=blk.attn_proj_b, eps=eps, out=h,
                                     sum_out=x)
                self._matmul(h, blk.fc_w, blk.fc_b, gelu=True, out=f, short=short)  # [T, 4C]
                self._matmul(f, blk.mlp_proj_w, out=y, short=short)  # [T, C]
        return x, y

    def logits(self, input_ids) -> cupy.ndarray:
        """Full forward without cache: logits [B, T, V] in the model's dtype for input_ids
        [B, T] or [T] (then [T, V])."""
        rows, single = check_input_ids(input_ids, self.config, allow_ragged=False)
        outs = [self._matmul(self._forward(rows[lo:hi], None, None, None), self.lm_head,
                             self.lm_head_b)  # [tokens, V]
                for lo, hi in self.prefill_groups([r.size for r in rows])]
        out = cupy.concatenate(outs).reshape(len(rows), rows[0].size, -1)
        return out[0] if single else out

    # ---------------------------------------------------------------------------------
    # generation
    # ---------------------------------------------------------------------------------
    def head(self, buf, sampling, stats=None, positions=None, embed: bool = False) -> None:
        """The LM head on the residual stream ``buf.x`` [B, C]: the final LayerNorm fused
        into the product (in the epilogue, from x's row statistics ``stats``, when given),
        then the next tokens into ``buf.tokens``. Greedy (sampling None) reduces the logits
        inside the product (no logits written); sampling is a dict of
        :func:`cupy_kernels.sample`'s settings and writes ``buf.logits`` first.
        ``positions`` (a decode step's cache positions): moved on by one after the tokens.
        ``embed`` (greedy, with ``stats`` and ``positions``): the argmax's launch also writes
        the next step's embedding of the tokens into ``buf.x`` and ``stats`` (embeds_in_argmax)."""
        eps = self.config.layer_norm_epsilon
        ln = dict(ln_fold=(stats, self.head_u, self.head_c, eps)) if stats is not None else dict(
            bias=self.lm_head_b, ln=(self.ln_f_w, self.ln_f_b, eps))
        if embed and (sampling is not None or stats is None or positions is None):
            raise ValueError("the argmax embeds the next step's tokens in greedy steps with the rows' statistics "
                             "and positions only")
        if sampling is None:  # (the argmax's last launch moves the positions on)
            B = buf.x.shape[0]
            if self.folded:
                screen = self.head_screen if (DECODE_HEAD_SCREEN and stats is not None
                                              and B <= min(DECODE_SCREEN_ROWS, SCREEN_MAX_ROWS)) else None
            else:
                screen = self.head_screen if DECODE_HEAD_SCREEN_FLOAT32 and B == 1 else None
            K.linear_argmax(buf.x, self.lm_head, out=buf.tokens, advance=positions,
                            embed=(self.wte, self.wpe, buf.x, stats) if embed else None, screen=screen, **ln)
        else:
            K.linear(buf.x, self.lm_head, out_dtype=numpy.float32, out=buf.logits, **ln)
            K.sample(buf.logits, offset=buf.offsets, out=buf.tokens, **sampling)
            if positions is not None:
                K.kv_advance(positions)

    def uses_fixed_attention(self, cache: KVCache) -> bool:
        """Whether the decode step's attention on ``cache`` is fixed_attention (DECODE_FIXED_ATTENTION):
        a function of the model and the cache dtype alone, never of the batch or the cache bucket."""
        cfg = self.config
        return bool(DECODE_FIXED_ATTENTION and (self.dtype.itemsize == 2 or DECODE_FIXED_FLOAT32)
                    and cache.k.dtype == self.dtype and cfg.head_dim == FIXED_HEAD_DIM
                    and cfg.n_positions <= FIXED_MAX_KEYS and not self.fused_step)

    def embeds_in_argmax(self, sampling) -> bool:
        """Whether a chained decode step's embedding runs in the argmax of the step before
        (DECODE_EMBED_IN_ARGMAX): greedy steps of a 16-bit model that fold their LayerNorms."""
        return bool(DECODE_EMBED_IN_ARGMAX and DECODE_EMBED_STATS and sampling is None and self.folded)

    def record_step(self, cache: KVCache, buf, sampling, fused: bool | None = None,
                    chained: bool = False, embed_next: bool = False) -> _build.Plan:
        """The decode step as a launch plan over preallocated buffers (``buf``: tokens
        [B] int32, x [B, C] the residual stream, qkv [B, 3C], att [B, H, D], f [B, 4C],
        logits [B, V] float32, offsets [B] uint64): embed the tokens, run every block on
        the cached keys / values, LM head, next tokens, advance the positions. ``fused``
        (default: ``self.fused_step``): the persistent kernel where it applies. ``chained``:
        the step follows another one in the same CUDA graph (engine.STEPS_PER_GRAPH); its
        first q|k|v product then lets the next kernel start only once it has passed its wait,
        since the attentions read the cache positions before their own wait, and the step
        before moves them on in its last kernel (with programmatic launch, the embedding and
        that product start during the step before). Where ``embeds_in_argmax``, a chained
        step has no embedding launch: the argmax of the step before wrote its x, as its own
        argmax writes the next step's. ``embed_next``: so does this step's (the first step of
        such a graph).

        Five launches a block (six with a quantized cache): q|k|v, attention (fixed_attention
        in 16-bit models with 16-bit caches, its block width by batch, at batch 1 letting the
        next kernel start before its own wait (DECODE_TRIGGER_EARLY_ROWS); else decode_attention,
        the chunks of a long cache merged by the last block of a head), and three products
        (with fixed_attention at batch 1, some of them letting the next kernel start later than
        as they start: DECODE_PRODUCT_TRIGGERS).
        Bias, GELU, the residual add and the KV-cache append run in the products' epilogues, and so does
        LayerNorm in 16-bit models (folded into the weights; the products that update the
        residual stream, and the embedding, leave its row statistics, from which the next
        product's epilogue normalizes; DECODE_STATS_WARP: products whose blocks take one warp more
        to combine those statistics), but in float32 models: there each block of the product
        normalizes the rows itself up to 16 sequences, a launch of its own does it past that
        (the same bits)."""
        cfg = self.config
        B, C, H, D, eps = buf.x.shape[0], cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.layer_norm_epsilon
        qkv = buf.qkv.reshape(B, 1, 3, H, D)  # view: [B, T=1, 3, H, D]
        # decode_attention: one chunk rule and block width for every batch and cache bucket, so
        # that a sequence's numbers (and tokens) depend neither on what it is batched with nor on the
        # bucket: the block width decode_attention picks for one sequence in the model's full
        # length (512 threads on a float32 cache: _decode_attention_shape), equal chunks of
        # at most DECODE_SPLIT_KEYS keys merged by the last block of a head (three equal
        # splits merged by a second kernel, before: GPT-2 small at B = 1 2.8 + 1.7 us a layer
        # in a CUDA graph, 5.0 us with the last-block merge; decode_step.py, H100; merged
        # instead by every block of the attention projection in its prologue, a thread per
        # column in turn: 362 / 788 us a step at B = 1 / 8, against 255 / 296; run inside
        # the q|k|v product by the last block of a head to finish, with this kernel's bits
        # (branch qkv-attend: 154-181 registers, one 8-warp block an SM), 241.0 / 1862.7 us a
        # step for GPT-2 small / XL at B = 1 with 64 cached keys against 225.7 / 1607.2,
        # benchmarks/results/qkv_attend-h100.log)
        split_keys, threads = self._decode_attention_shape(cache)
        # trips the attention requests ahead: the same numbers, so chosen per model and batch
        deep = (B <= DECODE_AHEAD_BATCH and cfg.n_embd >= DECODE_AHEAD_WIDTH and threads == 128
                and self.dtype != numpy.float32 and cache.k.dtype == self.dtype)
        ahead = AHEAD_DEEP if deep else 1
        stats = buf.stats if self.folded else None  # [B, C / 16, 2]: of the residual stream buf.x
        prefetch = cache.positions if (2 <= B <= DECODE_PREFETCH_BATCHES.get(C, 0)
                                       and self.dtype != numpy.float32) else None
        pace = None if self.dtype == numpy.float32 else \
            decode_pace(C, B, _build.peak_memory_GBps(cupy.cuda.Device().id))

        def normalized(b, ln, u, c, folded: bool):  # the arguments of a product after a LayerNorm
            return dict(ln_fold=(stats, u, c, eps)) if folded else dict(bias=b, ln=ln)

        widths = DECODE_FIXED_THREADS if self.dtype.itemsize == 2 else DECODE_FIXED_FLOAT32
        fixed = next(t for most, t in widths if most is None or B <= most) \
            if self.uses_fixed_attention(cache) else 0  # its threads a block
        if ((self.fused_step if fused is None else fused) and B == 1 and sampling is None and cache.k_scale is None
                and self.folded and DECODE_EMBED_STATS):  # (the fused step's layer 0 folds, as record_step's with it)
            why = K.decode_step_unsupported(self.dtype, C, H, threads)
            if why is None:
                return self._record_fused_step(cache, buf)
        triggers = DECODE_PRODUCT_TRIGGERS if self.dtype.itemsize == 2 else DECODE_PRODUCT_TRIGGERS_FLOAT32
        trig = triggers.get(C, {}) if fixed and B == 1 else {}
        sw = {role: rows[0] <= B <= rows[1] for role, rows in DECODE_STATS_WARP.get(C, {}).items()}
        in_argmax = self.embeds_in_argmax(sampling)
        with _build.recording() as plan:
            embed_stats = stats if DECODE_EMBED_STATS else None
            if not (chained and in_argmax):
                K.embedding(buf.tokens, self.wte, self.wpe, cache.positions, out=buf.x, stats_out=embed_stats)
            for i, blk in enumerate(self.blocks):
                qkv_in = normalized(blk.attn_b, (blk.ln_1_w, blk.ln_1_b, eps), blk.attn_u, blk.attn_c,
                                    stats is not None and (i > 0 or embed_stats is not None))
                qkv_trigger = "waited" if chained and i == 0 else trig.get("qkv", "start")
                if cache.k_scale is None:  # keys and values go into the cache from the product's epilogue
                    K.linear(buf.x, blk.attn_w, out=buf.qkv, pace=pace, trigger=qkv_trigger,
                             stats_warp=sw.get("qkv", False), **qkv_in,
                             kv_cache={"k_cache": cache.k[i], "v_cache": cache.v[i], "positions": cache.positions,
                                       "seq_lens": cache.lengths})
                    appended = (qkv[:, 0, 1], qkv[:, 0, 2])  # the cache's new rows, as the product wrote them
                else:  # quantized: a row's scale needs all of its D values, which kv_append holds
                    K.linear(buf.x, blk.attn_w, out=buf.qkv, pace=pace, trigger=qkv_trigger,
                             stats_warp=sw.get("qkv", False), **qkv_in)
                    K.kv_append(k=qkv[:, :, 1], v=qkv[:, :, 2], start=cache.positions, seq_lens=cache.lengths,
                                **cache.layer(i))
                    appended = None
                if fixed:
                    K.fixed_attention(qkv[:, 0, 0], cache.k[i], cache.v[i], cache.lengths, threads=fixed,
                                      positions=cache.positions, trigger_early=B <= DECODE_TRIGGER_EARLY_ROWS,
                                      out=buf.att)
                else:
                    K.decode_attention(qkv[:, 0, 0], seq_lens=cache.lengths, split_keys=split_keys,
                                       threads=threads, appended=appended, ahead=ahead, out=buf.att,
                                       warm=self._decode_warm(blk, B), prefetch=prefetch, **cache.layer(i))
                K.linear(buf.att.reshape(B, C), blk.attn_proj_w, blk.attn_proj_b, residual=buf.x, out=buf.x,
                         stats_out=stats, trigger=trig.get("proj", "start"))
                K.linear(buf.x, blk.fc_w, gelu=True, out=buf.f, pace=pace, trigger=trig.get("up", "start"),
                         stats_warp=sw.get("up", False),
                         **normalized(blk.fc_b, (blk.ln_2_w, blk.ln_2_b, eps), blk.fc_u, blk.fc_c, stats is not None))
                K.linear(buf.f, blk.mlp_proj_w, blk.mlp_proj_b, residual=buf.x, out=buf.x, stats_out=stats,
                         trigger=trig.get("down", "start"))
            plan.head_at = len(plan)  # where the LM head's launches begin (engine: the read-back's join)
            self.head(buf, sampling, stats, positions=cache.positions, embed=in_argmax and (chained or embed_next))
        return plan

    def _decode_warm(self, blk, B: int):
        """What the decode step's attention of block ``blk`` reads into L2 for the kernels after
        it at batch B (DECODE_WARM_WIDTHS, DECODE_WARM_BATCH), or None."""
        if B > DECODE_WARM_BATCH or self.dtype == numpy.float32 or self.config.n_embd not in DECODE_WARM_WIDTHS:
            return None
        w = blk.mlp_proj_w.reshape(-1)
        return w[:min(w.size, DECODE_WARM_BYTES // w.itemsize // 8 * 8)]

    def _decode_attention_shape(self, cache: KVCache) -> tuple[int, int]:
        """(keys a chunk, threads a block) of the decode step's attention (record_step says why).
        A float32 cache takes blocks of DECODE_WIDE_THREADS: a chunk of its keys is twice the
        trips of a 16-bit one in blocks of 128 (H100, GPT-2 small float32, the step at B = 1 /
        8 with PDL 358.4 / 1201.1 us with 512 threads against 380.5 / 1235.8 with 128, XL at B =
        1 3559.7 against 3647.5); a 16-bit cache keeps 128 (251.4 against 327.6 at B = 1).
        Measured again with the appended rows read beside q (us a step at 64 / 264 / 520 / 900
        cached keys, 128 / 512 threads, benchmarks/results/attention_appended-h100.log): GPT-2
        small B = 1 225.3 / 234.8 / 260.8 / 294.6 against 235.3 / 236.4 / 257.7 / 266.9, B = 8
        243.2 / 268.7 / 317.7 / 364.3 against 283.5 / 285.2 / 351.4 / 379.5; GPT-2 XL B = 1
        1606.5 / 1624.7 / 1738.6 / 1859.5 against 1584.2 / 1586.1 / 1626.9 / 1677.0. 512 wins
        on long caches at B = 1 but loses at B = 8 and on short caches, and one width serves
        every batch size (a sequence's bits must not depend on its batch): 128 stays.
        Measured for every size in one run (benchmarks/results/attention_threads-h100.log, us a
        step at 264 cached keys, 128 / 512): B = 1 small 235.6 / 237.2, medium 548.1 / 522.2,
        large 1053.5 / 964.4, XL 1646.6 / 1613.9; B = 8 small 269.5 / 273.6, medium 629.4 /
        653.0, large 1141.6 / 1251.7, XL 1957.9 / 2211.3: every size loses at batch 8 about
        what 512 gains it at batch 1, or more."""
        cfg = self.config
        if self.dtype == numpy.float32 and cache.k.dtype == numpy.float32:
            return DECODE_SPLIT_KEYS, DECODE_WIDE_THREADS
        alone = launch_config(self.dtype, cache.k.dtype, 1, cfg.n_head, cfg.n_head, cfg.head_dim, cfg.n_positions)
        return DECODE_SPLIT_KEYS, alone.threads

    def _record_fused_step(self, cache: KVCache, buf) -> _build.Plan:
        """The decode step of one greedy sequence as one persistent kernel (cupy_kernels.decode_step):
        the same numbers as the launches of record_step, with barriers for kernel boundaries."""
        with _build.recording() as plan:
            self.fused_step_launch(cache, buf)
        return plan

    def fused_step_launch(self, cache: KVCache, buf, trace=None) -> None:
        """Launch (or record) the fused decode step on ``cache`` and ``buf`` (one sequence);
        ``trace``: its timeline buffer (cupy_kernels.decode_step)."""
        split_keys, threads = self._decode_attention_shape(cache)
        layers = [{"attn_w": b.attn_w, "attn_b": b.attn_b, "attn_u": b.attn_u, "attn_c": b.attn_c,
                   "proj_w": b.attn_proj_w, "proj_b": b.attn_proj_b, "fc_w": b.fc_w, "fc_u": b.fc_u, "fc_c": b.fc_c,
                   "mlp_w": b.mlp_proj_w, "mlp_b": b.mlp_proj_b}
                  for b in self.blocks]
        K.decode_step(buf.tokens, cache.positions, cache.lengths, buf.x, buf.qkv, buf.f, buf.stats, cache.k, cache.v,
                      layers, self.wte, self.wpe, self.lm_head, self.head_u, self.head_c,
                      eps=self.config.layer_norm_epsilon, split_keys=split_keys, attention_threads=threads, trace=trace)

    @property
    def engine(self):
        """The generation engine of this model (gpt2_cupy/engine.py): decode buffers,
        KV caches and CUDA graphs kept for later calls."""
        if self._engine is None:
            from .engine import Engine

            self._engine = Engine(self)
        return self._engine

    def stream(self, input_ids, max_new_tokens: int = 32, *, do_sample: bool = False, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               eos_token_id: int | None = None, use_cache: bool = True, cuda_graph: bool = True,
               kv_cache_dtype: str | None = None):
        """An iterator over decoding steps: each item is a list with one new token id per
        sequence (None for a sequence that has finished). Arguments as :meth:`generate`;
        they are checked here, before the iterator is returned and before any launch."""
        return self._stream(input_ids, max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=seed, eos_token_id=eos_token_id, use_cache=use_cache,
                            cuda_graph=cuda_graph, kv_cache_dtype=kv_cache_dtype, fixed_length=False)

    def _stream(self, input_ids, max_new_tokens, *, do_sample, temperature, top_k, top_p, seed, eos_token_id,
                use_cache, cuda_graph, kv_cache_dtype, fixed_length: bool):
        """:meth:`stream`; ``fixed_length``: the caller reads every step (Engine.steps)."""
        rows, _ = check_input_ids(input_ids, self.config)
        seed = check_generate_args(rows, self.config, max_new_tokens, do_sample, temperature, top_k, top_p, seed,
                                   eos_token_id)
        K.kv_storage_dtype(kv_cache_dtype, self.dtype)  # ValueError for an unknown name
        if max_new_tokens == 0:
            return iter(())
        sampling = None
        if do_sample:
            sampling = {"seed": seed, "temperature": float(temperature), "top_k": top_k,
                        "top_p": None if top_p is None else float(top_p)}
        if not use_cache:
            return self.engine.steps_without_cache(rows, max_new_tokens, sampling, eos_token_id)
        return self.engine.steps(rows, max_new_tokens, sampling, eos_token_id, cuda_graph, kv_cache_dtype,
                                 fixed_length=fixed_length)

    def generate(self, input_ids, max_new_tokens: int | list[int] = 32, *, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, eos_token_id: int | None = None, use_cache: bool = True,
                 cuda_graph: bool = True, kv_cache_dtype: str | None = None, max_batch: int | None = None,
                 progress: bool | None = None):
        """Generate token ids.

        input_ids: [T] or [B, T] ints, or a list of prompts of different lengths. Returns the
        prompt followed by its new tokens: a list of ints for one sequence, a list of lists
        for several. Greedy unless ``do_sample``; sampling applies temperature, then top_k,
        then top_p, with Philox random numbers from ``seed`` (same seed, same tokens).
        A sequence stops after ``eos_token_id``. ``use_cache=False`` recomputes the whole
        sequence for every new token. ``cuda_graph`` (default) replays the decode step as one
        CUDA graph; False launches its recorded kernels one by one. ``kv_cache_dtype``: None
        keeps keys and values in the model's dtype; 'int8' or 'fp8' (e4m3) quantizes each
        cached row with a scale of its own (about half the cache bytes of fp16).
        Prompts are prefilled together, packed, and every kernel treats each row on its own,
        so a batch gives each sequence the same tokens as running it alone (greedy; sampling draws a
        different random stream per row).

        ``max_batch``: continuous batching. At most that many sequences decode at once; a
        sequence that ends frees its slot for the next prompt, and the results come back in
        the input order. ``max_new_tokens`` may then be a list, one per prompt (a list alone
        runs every prompt at once this way). Sampling draws each prompt's own random stream. ``progress``: a progress bar over the prompts
        (default: when there are more prompts than slots). The KV cache is sized for the
        slots and the longest prompt + new tokens; MemoryError before anything runs when the
        GPU lacks the memory.
        """
        rows, single = check_input_ids(input_ids, self.config)
        if max_batch is not None or isinstance(max_new_tokens, (list, tuple)):
            out = self._generate_continuous(rows, max_new_tokens, do_sample=do_sample, temperature=temperature,
                                            top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id,
                                            use_cache=use_cache, cuda_graph=cuda_graph,
                                            kv_cache_dtype=kv_cache_dtype, max_batch=max_batch, progress=progress)
            return out[0] if single else out
        seqs = [list(map(int, r)) for r in rows]
        for step in self._stream(rows, max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                                 top_p=top_p, seed=seed, eos_token_id=eos_token_id, use_cache=use_cache,
                                 cuda_graph=cuda_graph, kv_cache_dtype=kv_cache_dtype, fixed_length=True):
            for b, t in enumerate(step):
                if t is not None:
                    seqs[b].append(t)
        return seqs[0] if single else seqs


    def _generate_continuous(self, rows, max_new_tokens, *, do_sample, temperature, top_k, top_p, seed,
                             eos_token_id, use_cache, cuda_graph, kv_cache_dtype, max_batch, progress, stop=None):
        """generate() with continuous batching: prompt + new tokens per row, in input order.
        ``stop(p, token)`` True ends prompt p after that token."""
        rows, _ = check_input_ids(rows, self.config)  # (lists of ids from the text layer too)
        budgets = check_budgets(rows, max_new_tokens)
        if max_batch is None:
            max_batch = len(rows)
        if not _is_int(max_batch) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not use_cache:
            raise ValueError("continuous batching (max_batch, or one max_new_tokens per prompt) needs use_cache=True")
        for b, (r, m) in enumerate(zip(rows, budgets)):
            if len(r) + m > self.config.n_positions:
                raise ValueError(f"sequence {b}: {len(r)} prompt tokens + {m} new tokens exceed the model's "
                                 f"{self.config.n_positions} positions")
        seed = check_generate_args(rows, self.config, 0, do_sample, temperature, top_k, top_p, seed, eos_token_id)
        K.kv_storage_dtype(kv_cache_dtype, self.dtype)
        slots = min(max_batch, len(rows))
        seqs = [list(map(int, r)) for r in rows]
        if not any(budgets):
            return seqs
        sampling = None
        if do_sample:
            sampling = {"seed": seed, "temperature": float(temperature), "top_k": top_k,
                        "top_p": None if top_p is None else float(top_p)}
        self.engine.fits(slots, max(len(r) + m for r, m in zip(rows, budgets)), 
                         self.prefill_tokens([len(r) for r in rows], slots),
                         kv_cache_dtype, sampling, cuda_graph)
        show = len(rows) > slots if progress is None else bool(progress)
        for p, t in self.engine.continuous(rows, budgets, sampling, eos_token_id, slots, cuda_graph, kv_cache_dtype,
                                           stop=stop, progress=show):
            seqs[p].append(t)
        return seqs


# -------------------------------------------------------------------------------------
# input checks: on the host, before anything is launched
# -------------------------------------------------------------------------------------
def check_budgets(rows, max_new_tokens) -> list[int]:
    """New tokens per prompt: ``max_new_tokens`` (an int for all, or one int per prompt)."""
    if isinstance(max_new_tokens, (list, tuple)):
        if len(max_new_tokens) != len(rows):
            raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {len(rows)} prompts")
        budgets = list(max_new_tokens)
    else:
        budgets = [max_new_tokens] * len(rows)
    for b, m in enumerate(budgets):
        if not _is_int(m) or m < 0:
            raise ValueError(f"max_new_tokens of sequence {b} must be an integer >= 0, got {m!r}")
    return [int(m) for m in budgets]


def check_input_ids(input_ids, config: GPT2Config, allow_ragged: bool = True) -> tuple[list[numpy.ndarray], bool]:
    """input_ids ([T], [B, T], a list of prompts, or a CuPy / numpy array or tensor) as a
    list of int64 numpy rows, and whether it was a single sequence. Raises TypeError /
    ValueError for non-integer ids, an empty prompt, ids outside the vocabulary, or a
    prompt longer than the model's positions."""
    if isinstance(input_ids, cupy.ndarray):
        input_ids = cupy.asnumpy(input_ids)
    elif hasattr(input_ids, "__dlpack__") and not isinstance(input_ids, numpy.ndarray):
        if hasattr(input_ids, "detach"):  # a torch tensor, wherever it lives
            input_ids = input_ids.detach().cpu().numpy()
        else:
            input_ids = cupy.asnumpy(cupy.from_dlpack(input_ids))
    if isinstance(input_ids, numpy.ndarray):
        if input_ids.dtype.kind not in "iu":
            raise TypeError(f"input_ids must hold integers, got dtype {input_ids.dtype}")
        if input_ids.ndim not in (1, 2):
            raise ValueError(f"input_ids must be [T] or [B, T], got shape {input_ids.shape}")
        single = input_ids.ndim == 1
        rows = [input_ids] if single else list(input_ids)
    elif isinstance(input_ids, (list, tuple)):
        if len(input_ids) == 0:
            raise ValueError("input_ids is empty")
        single = not isinstance(input_ids[0], (list, tuple, numpy.ndarray))
        rows = [input_ids] if single else list(input_ids)
    else:
        raise TypeError(f"input_ids must be a list, numpy/CuPy array or tensor, got {type(input_ids).__name__}")
    checked = []
    for b, row in enumerate(rows):
        if isinstance(row, (list, tuple)) and not all(
            isinstance(t, (int, numpy.integer)) and not isinstance(t, bool) for t in row
        ):
            raise TypeError(f"sequence {b}: token ids must be integers")
        arr = numpy.asarray(row)
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"sequence {b}: token ids must be integers, got dtype {arr.dtype}")
        if arr.ndim != 1:
            raise ValueError(f"sequence {b}: expected a flat list of token ids, got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError(f"sequence {b} is empty: a prompt needs at least one token")
        bad = (arr < 0) | (arr >= config.vocab_size)
        if bad.any():
            raise ValueError(f"sequence {b}: token id {int(arr[bad][0])} is outside the vocabulary [0, {config.vocab_size})")
        if arr.size > config.n_positions:
            raise ValueError(f"sequence {b} has {arr.size} tokens; the model has {config.n_positions} positions")
        checked.append(arr.astype(numpy.int64))
    if not checked:
        raise ValueError("input_ids holds no sequence")
    if not allow_ragged and len({r.size for r in checked}) > 1:
        raise ValueError("sequences of different lengths: pass them one at a time")
    return checked, single


def _is_int(x) -> bool:
    return isinstance(x, (int, numpy.integer)) and not isinstance(x, bool)


def check_generate_args(rows, config: GPT2Config, max_new_tokens, do_sample, temperature, top_k, top_p, seed,
                        eos_token_id) -> int | None:
    """Checks generation settings; returns the seed to use (a fresh random one when
    sampling without a seed)."""
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    for b, r in enumerate(rows):
        if len(r) + max_new_tokens > config.n_positions:
            raise ValueError(
                f"sequence {b}: {len(r)} prompt tokens + {max_new_tokens} new tokens exceed the model's "
                f"{config.n_positions} positions"
            )
    if eos_token_id is not None and (not _is_int(eos_token_id) or not 0 <= eos_token_id < config.vocab_size):
        raise ValueError(f"eos_token_id must be None or a token id in [0, {config.vocab_size}), got {eos_token_id!r}")
    if not do_sample:
        return seed
    if not (isinstance(temperature, (int, float)) and numpy.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    if seed is None:
        return int.from_bytes(os.urandom(8), "little")
    if not _is_int(seed) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    return int(seed)
