#!/usr/bin/env bash
# The H200 run for issue 2 (Pallas kernels): the pallas tests compiled on the GPU, then bench_pallas_kda.py
# (lineattn-pallas variants beside jax-linear-attention's Mosaic GPU kernels and FLA, same inputs). Run through
# the device tool with `.whl` carried (see ../shared/BENCHMARKING.md); writes into $OUT.
#   SKIP_TESTS=1 / SKIP_BENCH=1   one part only        TESTS_K="expr"   a subset of the tests (pytest -k)
#   IDS_FILE=path   the test ids in that file (one a line, e.g. shards a time limit cut) in place of all
#   AB=1 AB_ARGS="..."   ab_pallas_kda.py (wall clocks of settings in turn) in place of the bench
#   BENCH_ARGS="..."   replaces the bench flags below; TEST_TIMEOUT / BENCH_TIMEOUT in seconds. The one long
#   sequence alone (run6's call ran out of time before it): BENCH_ARGS="--shapes= --decode= --fla= --long 262144"
#   The default bench (the whole table, T = 262144 included) fit one call in run8c (563 s) but not in run9c (cut
#   at 570 s after jla's GDN forward at 1 x 32768; FLA autotunes each shape): better in two calls:
#     SKIP_TESTS=1 BENCH_TIMEOUT=560 BENCH_ARGS="--iters 10 --shapes 8x4096 --gdn --fla fwd,fwdbwd
#       --fla-shapes 8x4096 --skip lineattn-chunk lineattn-pallas-kernels-mml2" bash benchmarks/h200_issue2.sh
#     SKIP_TESTS=1 BENCH_TIMEOUT=560 BENCH_ARGS="--iters 10 --shapes 1x32768 --gdn --fla fwd,fwdbwd
#       --fla-shapes 1x32768 --decode= --skip lineattn-chunk lineattn-pallas-kernels-mml2 --long 262144"
#       bash benchmarks/h200_issue2.sh
#   (run15d: that second call without --long was cut at 385 s, in GDN after KDA's rows: give it 560 s.)
#   All the GPU tests in 5 processes side by side (run16d: 82 tests, all passed, 220-333 s a shard; run15c with 4
#   shards: 259-296 s for the shards of 20, the two of 21 cut at 300 s):
#     SHARDS=5 TEST_TIMEOUT=370 SKIP_BENCH=1 bash benchmarks/h200_issue2.sh
#   Run15 (session 13): the 10 Mosaic GPU tests passed (K = V = 128 through both Mosaic passes among them); the
#   suite with the Mosaic passes as default: 78 of 82 passed, none failed, 4 cut by the time limit (run15c); the
#   Mosaic passes on V tiles of 16 at 1 x 32768 are slower than Triton's (0.914 against 0.783 ms: "auto" keeps
#   Triton there); a Gram kernel and Gram gradients with one program per chunk were 2-3x slower (removed). Open
#   leads, per kernel against jla's (8 x 4096, run13b/run15c): the solve (0.42 ms, jla 0.25; it stages G in fp32
#   SMEM, 80 KB a CTA: two CTAs an SM), the Gram kernel (0.79, jla's intra 0.60; latency-bound: more programs
#   won every time), the Gram gradients (1.72), the state passes at 1 x 32768 (1.5 us a chunk step either way),
#   GDN's path (2.2-2.4x jla: jla fuses solve, state pass and output in one kernel). Run16a: Kin from the Gram
#   kernel (solve -0.04 ms, Gram +0.05), the Gram kernel over column windows and the Gram gradients over K halves
#   were no faster (removed). Run16c/f: a Mosaic GPU decode kernel (CTAs streaming tiles through a TMA pipeline)
#   reached 3.59 TB/s at best against Triton's 3.77 (removed; history 0f60cc7): one warpgroup's compute per tile
#   (reductions over K across its 4 warps) is not hidden behind the copies.
#   Run17 (session 15): Nsight Compute reads the counters here: NCU=1 [NCU_KERNELS=regex] [NCU_SECTIONS="--section
#   ..."] PROFILE_ARGS="--impls lineattn,jla --configs default;chunk_bwd.WY_BT=64 --decode 256" wraps
#   profile_pallas_kda.py --ncu (registers, occupancy, spills, DRAM throughput per kernel into ncu.log). It showed the
#   backward's Triton kernels spilling at 255 registers; the fixes took fwd+bwd to 0.84x jla at 8 x 4096 (run17d).
#   Run18 (session 16): the Gram and solve fused in one Mosaic GPU kernel (GRAM_IMPL=mosaic, removed in session 30):
#   exact, 2.66 ms against 0.79 + 0.41 (its warps wait on instruction fetches, run18d). Run19 (session 17): the exps as
#   PTX ex2.approx (common.FAST_EXP in the Triton kernels, solve_mgpu.APPROX_MATH in the Mosaic ones; defaults since):
#   fwd+bwd 4.836 -> 4.448 ms kernel time; the fused kernel 1.19 ms (still no faster than 0.725 + 0.404). The wall
#   clocks of the bench spread widely after a batch of tests (run19c-d): time the bench in a call of its own:
#     SKIP_TESTS=1 BENCH_TIMEOUT=190 BENCH_ARGS="--iters 30 --shapes 8x4096,1x32768 --fla= --decode= --skip
#       lineattn-chunk lineattn-pallas-kernels-mml2" bash benchmarks/h200_issue2.sh     (run19e: 114 s)
#   Run20 (session 18): three Triton kernels launched last axis first (common.LAST_AXIS_FASTEST), the gate's cumsum
#   saved for the backward: fwd+bwd 4.34 ms kernel time at 8 x 4096; bench alone 0.741x jla (8 x 4096), 0.878x (1 x
#   32768); XLA's command buffers off changed neither (XLA_FLAGS=--xla_gpu_enable_command_buffer= before `bash`);
#   LOOP=tiles 1.177 ms (no faster). Sweeps at 1 x 32768 (the passes are what is left there) take --shape:
#     PROFILE=1 PROFILE_ARGS="--impls lineattn,jla --shape 1x32768 --configs default;segments.SEGMENT_MIN_PROGRAMS=512"
#   Run21 (session 19): the forward's state pass in segments where it saves, its maps reused by the backward, and
#   the Mosaic passes in segments: fwd+bwd 5.09 ms kernel time at 1 x 32768; bench alone 0.751x jla (8 x 4096),
#   0.793x (1 x 32768, run21f; 0.811x in run21e). Where a call's time beyond its kernels goes (dispatch and sync,
#   jla's too): PROFILE_ARGS="--impls noop,lineattn,jla --sync --iters 10" (the stream idle before each first kernel);
#   add --host for each call's host events and the last call's timeline, host and device (run32b).
#   Run22 (session 20): the Mosaic zero-start pass as default (0.184 ms against 0.339 at 1 x 32768); the whole GPU suite
#   with SHARDS=6 TEST_TIMEOUT=430 took 383 s (98 tests); bench alone 0.769x jla (8 x 4096), 0.756x (1 x 32768).
#   Run23 (session 21): a persistent Triton decode kernel (programs looping over tiles, the next state prefetched)
#   took 2.64-3.35 TB/s against 3.72 (reverted; history b2bbd38); fewer warps a program were slower (run23b).
#   Run25 (session 23): the Gram kernel's first-half blocks against half the keys (history 067828e) no faster:
#   its time goes to what each 16-row block loads and writes, not to the key side. Bool constants take
#   True/False in --configs (before 4287780 "False" stayed a truthy string). GDN's gate cumsum no longer
#   broadcast over K (ac5d0a2): GDN 8 x 4096 kernels 0.865 / 3.434 ms (run25e), still 2.1-2.2x jla (run25f).
#   Run26 (session 24): the whole GPU suite passed (99 tests, 284 s with SHARDS=6); two Gram-kernel forms, row
#   blocks sharing their loads (a77d315) and keys scaled once with 16 x 16 products (3331c0f): no faster, reverted.
#   Run27 (session 25): the Gram kernel forming the gate's cumsum itself by Triton scans, no cumsum kernel (12059fe):
#   Gram 2.17 ms against 0.70 + 0.16, reverted; the Mosaic solve's G in a TMA batch after A's (251a3b4): 0.422 ms
#   against 0.403, reverted.
#   Run28 (session 26): in a forward alone the 16 x 16 diagonal blocks of I + A inverted before the solve, inside
#   the Gram kernel (00afc93: Gram 2.48 ms, removed) and then as their own kernel (f8a58eb, the default: 0.04 ms,
#   solve 0.26 against 0.40, forward kernels 1.38 against 1.49); bench fwd 1.66 / 2.25 ms; the whole GPU suite
#   passed (102 tests).
#   Run29 (session 27): the same inversion in GDN's forward alone (forward kernels 0.76 against 0.87 ms); the scalar
#   Gram gradients as bf16x2 products on K tiles of 16 (0.82 against 1.22 ms); KDA's in bf16x3 (2.20 against 1.29:
#   KDA keeps TF32); two profiles in one call, each with its own --out, then the grep:
#     SKIP_BENCH=1 SHARDS=3 TESTS_K="gdn or deltanet" bash benchmarks/h200_issue2.sh; export PYTHONPATH=$PWD/.site:$PWD
#     python3 benchmarks/profile_pallas_kda.py --out $OUT/gdn --rule gdn --impls lineattn --check --configs "..."
#   Run30 (session 28): the forward alone writes fewer intermediates (chunk_fwd.INVERSE_IN_PASS: R alone from the
#   solve, E formed in the Mosaic pass; ROW_GATE: a scalar gate's raw q, k with row factors; DIAG_INVERSE_BLOCK 32):
#   forward kernels GDN 0.760 -> 0.599 ms, KDA 1.378 -> 1.324 (run30b); bench wall KDA 1.68 ms, GDN 0.93 (run30c).
#   Run31 (session 29): the forward alone's Mosaic state pass as two compute warpgroups a CTA plus one issuing the
#   loads (state_mgpu.PASS_WARPGROUPS): pass 0.28 -> 0.18 ms (GDN), 0.27 -> 0.20 (KDA); bench wall KDA 1.61 / 4.85 ms
#   (0.736x jla's fwd+bwd), GDN 0.74; the whole GPU suite passed (113 tests, SHARDS=6 TEST_TIMEOUT=440, 305 s).
#   The long GPU tests take ~30 s each (19 of them): a subset fits a call beside a bench part, e.g.
#     TEST_TIMEOUT=200 TESTS_K="long_bf16 and default" SKIP_BENCH=1 bash benchmarks/h200_issue2.sh
#   A/B wall clock of settings, interleaved (not through this script): PYTHONPATH=$PWD python3
#     benchmarks/ab_pallas_kda.py --out $OUT --configs "default;solve.SOLVE_IMPL=triton"
#   Run33 (session 31): the whole GPU suite passed (109 tests); the Gram kernel's K tiles in a fori_loop pipelined two
#   deep (gram.GRAM_TILE_LOOP, GRAM_STAGES): 0.70 ms against 0.73, the default since; GDN's M formed inside the
#   state pass: slower (reverted).
#   Run34 (session 32): the same loop in the WY backward, pipelined three deep (chunk_bwd.WY_TILE_LOOP, WY_STAGES):
#   0.480 ms against 0.529, the default since; in the Gram gradients (K tiles of 64) slower, 1.65-1.69 against 1.31
#   (removed); R = (I + A)^-1 by one Triton kernel a chunk (block forward substitution) no faster than the inversion
#   and Mosaic inverse it replaced, 0.146 ms with bf16x3 products against 0.145 (reverted: 2c7d932, 1fee734); the chunk
#   gradients' K tiles looped, 0.497 ms against 0.505 (noise; reverted), the Gram kernel three deep 1.115 (run34d). The
#   sweep was one call with two profiles, each with its own --out (one --configs argument: no spaces inside):
#     export PYTHONPATH=$PWD/.site:$PWD; python3 benchmarks/profile_pallas_kda.py --out $OUT/kda --impls lineattn
#       --check --configs "default;chunk_bwd.WY_TILE_LOOP=True+chunk_bwd.WY_STAGES=3"
#   Run34e-f: GDN's forward alone at 1 x 32768 runs the unsegmented Triton pass (0.785 of 1.308 ms of kernels); in
#   segments (chunk_fwd.PASS_SEGMENTS=always) 0.964 ms. Run35a: its GPU tests passed and the A/B gave GDN 1.233 ms a
#   call against 1.539, KDA 1.910 against 2.173 (the default since); the one call was
#     SKIP_BENCH=1 SHARDS=2 TEST_TIMEOUT=200 TESTS_K="in_segments" bash benchmarks/h200_issue2.sh; export
#       PYTHONPATH=$PWD/.site:$PWD; for r in gdn kda; do python3 benchmarks/ab_pallas_kda.py --out $OUT --rule $r
#       --shapes 1x32768,8x4096 --configs "default;chunk_fwd.PASS_SEGMENTS=always"; done
#   Run35f: chunk_fwd.FORMS_IN_SEGMENTS (the forward alone's inverse and raw-q/k forms in segments) passed its GPU
#   tests; its A/B was inconclusive. Run36a: its kernel time beside the default's, GDN 0.808 ms against 1.001, KDA
#   1.657 against 1.624 ("scalar", GDN only, the default since); the one call was
#     SKIP_BENCH=1 SHARDS=3 TEST_TIMEOUT=250 TESTS_K="in_segments or mosaic" bash benchmarks/h200_issue2.sh; export
#       PYTHONPATH=$PWD/.site:$PWD; for r in gdn kda; do python3 benchmarks/profile_pallas_kda.py --out $OUT/$r
#       --rule $r --shape 1x32768 --impls lineattn --check --configs "default;chunk_fwd.FORMS_IN_SEGMENTS=True"; done
#   Run36b-d: the forward that saves for the backward inverts the diagonal blocks too (solve.DIAG_INVERSE_SAVE):
#   fwd+bwd kernels KDA 4.272 ms against 4.329, GDN 2.946 against 3.030 (run36c, with the whole GPU suite: 121
#   passed); bench (run36d) KDA 0.750x / 0.771x jla's forward+backward.
#   Run40 (session 38): a forward alone's Gram kernel forms the gate's cumsum itself (gram.GRAM_FORMS_G) and the
#   Gram products take bf16x2 (GRAM_PREC): forward kernels 0.917 ms against 1.226 (run40d); the whole GPU suite 137 of
#   138 (run40e; the one failure, an interpreted test, mended and passed in run40g); bench KDA (8, 4096) forward 1.152
#   ms against jla's 1.499 (run40g), 1.389 against 1.827 on a slower host (run40f).
#   Run41 (session 39): the whole GPU suite at e7af322's kernels, 138 passed (run41e); that Gram kernel in every
#   per-channel forward (G kept where the solve or the backward reads it): fwd+bwd kernels 4.028 ms against 4.165
#   (8, 4096), 4.544 against 4.746 (1, 32768) (run41f). One Mosaic GPU CTA per decode tile, the tile in SMEM: 147.7+ us
#   a step against the Triton kernel's 142.8 (run41a-d; removed).
#   Run42 (session 43, fc99b1c): the whole GPU suite passed (138; SHARDS=8 TEST_TIMEOUT=330 cut two shards at 15 of
#   17-18 tests, so give 8 shards 380 s); bench KDA (8, 4096) forward 1.289 / 1.384 ms in two calls against jla's
#   1.533 / 1.584, fwd+bwd 0.709x-0.792x jla's; decode 3.77 TB/s of kernel time (run42a-b).
#   The sequence of 262144 alone (BENCH_ARGS="--iters 10 --shapes= --decode= --fla= --long 262144", 122 s):
#   forward 11.59 ms, forward+backward 38.38 ms, peaks 13.55 / 21.59 GiB (run42d).
#   Run43 (session 44): the Gram kernel's keys toward each block's middle row with fewer exps (gram.GRAM_FACTORS
#   "next-middle" for a forward alone, GRAM_FACTORS_KEEP_G "middle-keys" for the forwards that keep G): the kernel
#   0.500 -> 0.483 ms and 0.601 -> 0.502, forward kernels 0.852 ms, fwd+bwd 3.932 (run43c-d); the order of the
#   kernel's stores matters as much (0.618 ms with the rows' stores moved after the middle rows, run43b). The whole
#   GPU suite passed (150, SHARDS=8 TEST_TIMEOUT=420: 283-348 s a shard, run43e); bench in two calls (run43f-g):
#   KDA (8, 4096) fwd 1.500 / 1.304 ms against jla's 1.405 / 1.830, fwd+bwd 0.742x / 0.815x jla's.
#   Note: without SKIP_TESTS=1 a PROFILE=1 call runs the tests first (run43a lost 200 s to that).
#   Session 45 (no GPU): the gate floor moved into the kernels (chunk.GATE_FLOOR "kernels"): every bench call since
#   run42 ran an XLA pass over the fp32 g before them (and its select over dg in the backward), which the profiles,
#   calling chunk_pallas directly, never showed. Changed kernels: the Gram, gate-cumsum and scalar Gram kernels (a
#   `where` on each g tile) and the dg kernel (an int8 mask read). Session 46 (an H100, run44): the suite passed
#   (run44a-b, e; 40 tests of run44a did not run: an id with spaces, mended), the floor in the kernels is faster
#   (forward 1.293 against 1.482 ms), and the mask written by the Gram kernel slower than XLA's pass (5.466 against
#   5.329 ms: the kernel took 0.21 ms more). Run45 (session 47, an H200): the whole GPU suite passed (158: SHARDS=8
#   TEST_TIMEOUT=420 cut 3 shards, whose 60 tests passed in a second call from a file of their ids, IDS_FILE); the A/B
#   of the three gate forms (run45b): forward 1.124 / 1.124 / 1.228 ms, forward+backward 4.606 / 4.659 / 4.730 (the
#   Gram kernel's mask removed since); the bench (--rounds, lineattn and jla timed in turn) KDA (8, 4096) forward
#   1.227 and 1.230 ms in two calls against jla's 1.546 / 1.594, fwd+bwd 0.722x / 0.725x jla's, (1, 32768) 0.743x.
#   Give the whole suite 8 shards and 500 s (this host compiled more slowly: 346-407 s for the shards that finished):
#     SHARDS=8 TEST_TIMEOUT=500 SKIP_BENCH=1 bash benchmarks/h200_issue2.sh
#   The bench (run45c: 8x4096 and 1x32768 in 150 s, then the profile in the same call with its own OUT):
#     SKIP_TESTS=1 BENCH_TIMEOUT=330 BENCH_ARGS="--iters 30 --rounds 5 --shapes 8x4096,1x32768 --fla= --decode=
#       --skip lineattn-chunk lineattn-pallas-kernels-mml2" bash benchmarks/h200_issue2.sh; mkdir -p $OUT/prof &&
#       OUT=$OUT/prof SKIP_TESTS=1 PROFILE=1 PROFILE_ARGS="--impls lineattn,jla" bash benchmarks/h200_issue2.sh
#   The bench's wall clock of a forward is its kernels (0.850 ms, run45c) plus 0.2-0.4 ms of dispatch and sync that
#   moves from call to call (rounds of 10 calls: 1.138-1.451 ms in run45e); jla's moves alike (kernels 1.195 ms).
#   Run46 (session 48, an H200 after nine refused starts; 316 s, the results README has it): the call below. The Gram
#   kernel on halves 0.466 ms against 0.486, forward 1.068 against 1.094 interleaved (kept opt-in: o 3.7e-3 against
#   3.6e-3); its 6 GPU tests passed; the bench: forward 1.080 ms (jit) / 1.053 (AOT) against jla's 1.431. Still to
#   run: FLA's chunk rows beside ours (BENCH_ARGS with --fla fwd,fwdbwd, one shape a call: FLA autotunes for
#   minutes). The call, each part with its own OUT:
#   the Gram kernel on 32-row halves (gram.GRAM_FACTORS "halves", opt-in) against the default, kernel time with the
#   errors (profile --check) and wall clock (A/B); its GPU tests (TESTS_K=extreme_gates: both forms, gates at -5,
#   cuts and uniform); and the bench with --aot (each JAX program also through jax.jit(f).lower(*args).compile(), as
#   ab_pallas_kda.py times it: run45's A/B read the same forward 0.1 ms faster than the bench):
#     F='grep -v ^WARNING:.Target'; mkdir -p $OUT/prof $OUT/ab $OUT/t $OUT/bench; OUT=$OUT/prof SKIP_TESTS=1 PROFILE=1
#       BENCH_TIMEOUT=200 PROFILE_ARGS="--impls lineattn --check --configs default;gram.GRAM_FACTORS=halves;
#       gram.GRAM_FACTORS=halves+gram.GRAM_CHUNK_WARPS=4;gram.GRAM_FACTORS=halves+gram.GRAM_CHUNK_BK=32" bash
#       benchmarks/h200_issue2.sh 2>&1 | $F | tail -60; OUT=$OUT/ab SKIP_TESTS=1 AB=1 BENCH_TIMEOUT=140
#       AB_ARGS="--shapes 8x4096 --configs default;gram.GRAM_FACTORS=halves --rounds 5 --iters 10" bash
#       benchmarks/h200_issue2.sh 2>&1 | $F | tail -6; OUT=$OUT/t SKIP_BENCH=1 SHARDS=2 TEST_TIMEOUT=130
#       TESTS_K=extreme_gates bash benchmarks/h200_issue2.sh 2>&1 | $F | tail -12; OUT=$OUT/bench SKIP_TESTS=1
#       BENCH_TIMEOUT=150 BENCH_ARGS="--iters 60 --rounds 10 --aot --shapes 8x4096 --fla= --decode= --skip
#       lineattn-chunk lineattn-pallas-kernels-mml2" bash benchmarks/h200_issue2.sh 2>&1 | $F | tail -14
#   (The --configs value holds no spaces: join those lines without them.)
#   Run47 (session 49, an H100 though an H200 was asked for): the whole table with FLA's chunk rows, two calls back
#   to back (399 s and 271 s): SKIP_TESTS=1 BENCH_TIMEOUT=570 BENCH_ARGS="--iters 60 --rounds 10 --shapes 8x4096 --gdn
#   --fla fwd,fwdbwd --fla-shapes 8x4096 --skip lineattn-chunk lineattn-pallas-kernels-mml2", then the same with
#   "--shapes 1x32768 --fla-shapes 1x32768 --decode= --long 262144". Still to run: those two calls on an H200 (FLA's
#   chunk rows there are run37b-c's); a guard first, so that another card costs only its start:
#     nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || exit 3; ...
#   Run48 (session 50: six starts refused, ten H100s, no H200): on an H100 the decode step's two reductions joined
#   (c6c9c81, removed) were slower, 2.81 against 2.89 TB/s. The two FLA calls above are still to run on an H200.
#   Session 51 (no run: seven H100s stopped by the guard, four refused starts, then no device lent): to time next,
#   decode_step(state_layout="vk") (t: the state transposed, reductions over K inside a warp) and readout="stored"
#   (s: o after the state's stores) beside the default and the copies on both grids: TESTS_K=decode_step_head_dim_128
#   BENCH_ARGS="--shapes= --fla= --decode=64x4f,64x4fs,64x4ft,64x4fts,64x8fts,128x8fts,32x4fts,64x4fc,64x4ftc,
#   64x8ftc,64x8fts,64x4f" bash benchmarks/h200_issue2.sh   (the --decode list is one string)
#   Run49 (session 52, an H100 though an H200 was asked for): that decode list ran; on the H100 "vk" + "stored" on 8
#   warps was 1 % faster than the default, on 4 warps 4 % slower. Still to run on an H200: it (add 128x16fts and
#   64x8ft), then the two FLA calls above.
#   Run50 (session 54, an H200 after four refused starts; six calls on one machine): that decode list (58 s), the two
#   FLA calls (315 s and 220 s), three more decode lists (25-29 s each) and every test of test_pallas_gpu.py (49
#   passed; SHARDS=8 TEST_TIMEOUT=280 TESTS_K="head_dim_128 or fp64", 211 s). "vk" + "stored" on 8-16 warps: 3.87-3.89
#   TB/s against the default's 3.76 and FLA's 3.84, but a copy on the "vk" grid reaches only 3.93-3.97 (4.11 on "kv"),
#   so "vk" became that layout's opt-in defaults, not the step's. KDA fwd+bwd 0.739x / 0.756x jla's, 0.507x / 0.430x
#   FLA's; forward 1.320 ms on this host (jla 1.683 there, 1.431 in run46d). Next: decode_step(v_tiles="strided")
#   (letter i: "vk" with each program's V rows strided, one state's tiles interleaved as "kv"'s are), its copies
#   and a "kv" copy of whole rows: TESTS_K=decode_step_head_dim_128 BENCH_ARGS="--shapes= --fla= --decode=64x8fts,
#   64x8ftsi,64x16ftsi,32x8ftsi,64x4ftsi,64x8ftc,64x8ftic,32x8ftic,128x8fc,64x4fc,64x4f" bash benchmarks/h200_issue2.sh
#   Run51 (session 56, H100s only): that list's strided forms passed their GPU tests and ran at 99.5 % of their copy,
#   but every copy on the H100 runs at 2.97-2.98 TB/s whatever the tiling. Still to run on an H200: TESTS_K=
#   decode_step_head_dim_128 BENCH_ARGS="--shapes= --fla= --decode=64x8fts,64x8ftsi,64x16ftsi,32x8ftsi,128x8ftsi,
#   32x16ftsi,64x8ftc,64x8ftic,32x8ftic,128x8ftic,64x16ftic,128x8fc,64x4fc,64x4f" bash benchmarks/h200_issue2.sh
#   PROFILE=1 [PROFILE_ARGS="..."]   profile_pallas_kda.py instead (per-kernel device time of one call, lineattn
#   and jla; --configs sets module constants such as chunk_bwd.WY_WARPS=4 or chunk_fwd.PASS_STAGES=1 for sweeps;
#   --rule gdn for Gated DeltaNet, e.g. PROFILE_ARGS='--rule gdn --check --configs default;api.SCALAR_GATE=1')
# Tests take 1-3 minutes (5 for the 57 short ones in one process: SHARDS=4 runs 4 side by side), the bench 6-9
# (FLA autotunes on first use): one device call for each part. Environment
# variables go before `bash` (`SKIP_BENCH=1 bash ...`; an argument after the script name is ignored).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then  # SHARDS=n: n pytest processes side by side on the GPU (compiling is CPU-bound)
  tests="tests/test_pallas.py tests/test_pallas_gpu.py"
  if [ -n "${IDS_FILE:-}" ]; then cp "$IDS_FILE" $OUT/ids  # IDS_FILE: test ids, one a line (e.g. shards cut by time)
  else python3 -m pytest -q --collect-only -p no:cacheprovider $tests ${TESTS_K:+-k "$TESTS_K"} | grep "::" > $OUT/ids
  fi
  echo "$(wc -l < $OUT/ids) tests in ${SHARDS:-1} shard(s)"
  for i in $(seq 0 $(( ${SHARDS:-1} - 1 ))); do
    mapfile -t ids < <(awk -v n=${SHARDS:-1} -v i=$i '(NR - 1) % n == i' $OUT/ids)  # (one argument an id)
    timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -s -p no:cacheprovider "${ids[@]}" > $OUT/gpu_tests_$i.log 2>&1 &
  done
  wait
  cat $OUT/gpu_tests_*.log > $OUT/gpu_tests.log && rm $OUT/gpu_tests_*.log $OUT/ids
  grep -E "(^|\.)(kda|gdn|deltanet|gla) |passed|failed|^FAILED|^E  " $OUT/gpu_tests.log | cut -c1-300 | tail -40
fi
[ -n "${SKIP_BENCH:-}" ] && exit 0
if [ -n "${NCU:-}" ]; then  # Nsight Compute's counters for each kernel (NCU_KERNELS: a name regex; PROFILE_ARGS)
  timeout ${BENCH_TIMEOUT:-400} ncu --clock-control none -k "regex:${NCU_KERNELS:-lineattn|vg_|fused_recurrent}" \
    --launch-count ${NCU_COUNT:-60} ${NCU_SECTIONS:---section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis} \
    python3 benchmarks/profile_pallas_kda.py --out $OUT --ncu ${PROFILE_ARGS:-} > $OUT/ncu.log 2>&1
  echo "ncu rc=$?"
  keys="^  [a-z_]+.*\(|Duration|Registers Per|Occupancy  |Block Limit|Memory Throughput|Shared Memory Per|Spilling|ncu:"
  grep -E "$keys" $OUT/ncu.log | cut -c1-160 | head -400
  exit 0
fi
if [ -n "${AB:-}" ]; then  # wall clocks of settings timed in turn (AB_ARGS: ab_pallas_kda.py's flags)
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/ab_pallas_kda.py --out $OUT ${AB_ARGS:-} 2>&1 \
    | grep --line-buffered -v "slow_operation_alarm\|Constant folding\|^$" | tee $OUT/ab.log
  exit 0
fi
if [ -n "${PROFILE:-}" ]; then  # per-kernel device times from a profiler trace (PROFILE_ARGS: its flags)
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/profile_pallas_kda.py --out $OUT ${PROFILE_ARGS:-} 2>&1 \
    | grep --line-buffered -v "slow_operation_alarm\|Constant folding\|^$" | tee $OUT/profile.log
  exit 0
fi
# Default: the table with the default kernels only: KDA at (8, 4096) and (1, 32768) beside jla and FLA
# (forward and forward+backward), the decode sweep, GDN beside jla (and FLA's forward), one sequence of 262144.
timeout ${BENCH_TIMEOUT:-540} python3 benchmarks/bench_pallas_kda.py --out $OUT ${BENCH_ARGS:---iters 10 --gdn \
  --fla fwd,fwdbwd --fla-shapes 8x4096,1x32768 --skip lineattn-chunk lineattn-pallas-kernels-mml2 \
  --long 262144} 2>&1 | grep --line-buffered -v "slow_operation_alarm\|Constant folding\|^$" | tee $OUT/bench.log
