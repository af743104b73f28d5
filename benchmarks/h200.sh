#!/usr/bin/env bash
# The H200 runs behind benchmarks/results/, in stages that each fit a 10-minute device command:
#   SPECLA_COMMIT=<hash> bash benchmarks/h200.sh tests runtime kernels e2e
# (write the hash out where the command is composed: on a copied tree, $(git rev-parse HEAD)
# can read stale git metadata and record the wrong commit)
# Stages: tests (pytest -m gpu), kernel-tests (tests/test_kernels.py on the GPU), runtime, kernels, e2e, e2e-quick,
# whole-step (the persistent AR step's GPU tests, launch counts and speed, the barrier's cost),
# chain-verify (the persistent chain verification's GPU tests, launch counts and speed, engine exactness),
# draft-step (the same for the persistent block draft), chain-accept (the same for acceptance in the verification's launch),
# tree-preset (the same for trees in the verification's launch and the block drafter's measured preset),
# ngram-chain (the n-gram chain kernel's GPU tests, the page's GPU defaults, e2e rows in PAIR_ROWS, bench_programs.py),
# swap-1p3b (the swapped projection's remaining GPU tests, the 1.3B oracle rows with fused and fla ops),
# step-ops (the AR step's kernels' and the persistent verification's GPU tests, the 1.3B step per op set in
# STEP_OPS; needs data/corpus/heldout_prompts.jsonl),
# app (benchmarks/app_vs_bench.py: the real app over HTTP against the bench's rows; options in APP_ARGS,
# cases named without spaces, e.g. --cases block_chain,lilicorr_best-first_16), launch-counts (kernels per step body),
# projection-sweep (benchmarks/bench_kernels.py --only projection), gemv (--only gemv), parallel (--only parallel,pdl),
# parallel-orders (the parallel verification's gram_first and tf32x3 forms: sweep, GPU tests, 1.3B step),
# preload (the 1.3B step with the swapped projections' inputs preloaded or not, their GPU tests),
# narrow-in (the embedded verification's input projection in narrow units or whole heads: GPU tests, phases, speed),
# fold-carve (the embedded pair with the verification's fold in phase A or B, one L1 / shared split or the driver's: speed, GPU tests),
# ops-compare (fla against the fused projections, embedded and 1.3B, with the embedded pair's speed on held-out prompts); issue #16's per-kernel profile at the 1.3B shape:
#   LAUNCH_ARGS="--model gdn-1.3b-random --budget 8" bash benchmarks/h200.sh launch-counts,
# speedup (run_acceptance.py --speedup on the GPU, SPEEDUP_ROWS), head (the LiLiCorr head's share of a GDN-1.3B-shape step; options in HEAD_ARGS), head-kernels (benchmarks/bench_lilicorr.py,
# its options in HEAD_KERNELS_ARGS), acceptance,
# drafter (a drafter kind trained alone: DRAFTER_KINDS, DRAFTER_MINUTES, DRAFTER_ARGS such as --init-from
# assets/drafters/block; carry data/corpus/train.txt.gz and manifest.json),
# drafter-speed (the block drafter in assets/ against OTHER_BLOCK on 20 held-out prompts),
# phase-floor (benchmarks/phase_floor.cu: a dependent phase joined by a grid barrier or a cluster's),
# l2-sides (benchmarks/l2_sides.cu: whether the SM that reads a tile keeps it in L2; options in L2_SIDES_ARGS),
# kernels-ab (the embedded pair with this tree's kernels against BASE_TREE's, an earlier commit's; T_KERNELS_AB),
# tree-ab (the block drafter's measured preset against its best-first tree grown in the draft's launch; with
# TREE_AB_LILICORR=1 LiLiCorr's tree of the same size too, grown by torch ops and by its own launch),
# target (a second training stage of the embedded target from assets/target; needs data/corpus). Needs the
# pure-Python wheels in .whl/ (see benchmarks/README.md). Results land in $OUT/results
# (default /tmp/specla-out/results); a stage's time limit is its T_<STAGE> variable.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 GRADIO_ANALYTICS_ENABLED=False
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
# compiled kernels kept in the tree: a warm machine keeps ignored paths between device commands.
# A fresh one spends 1-3 minutes compiling; SAVE_TRITON_CACHE=1 sends the cache back as
# $OUT/triton-cache.tgz, and a carried .triton-cache.tgz (that file, moved to the checkout's
# root) seeds an empty cache. Triton keys each kernel by its source and the GPU's arch, so a
# stale entry is never used, only recompiled.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
if [ -f .triton-cache.tgz ] && [ -z "$(ls -A "$TRITON_CACHE_DIR" 2>/dev/null)" ]; then
  mkdir -p "$TRITON_CACHE_DIR" && tar -xzf .triton-cache.tgz -C "$TRITON_CACHE_DIR" \
    && echo "triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries from .triton-cache.tgz"
fi
OUT=${OUT:-/tmp/specla-out}
R=$OUT/results
mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$R/device.txt"

bench() {  # bench SUITE LIMIT [extra args]
  local suite=$1 limit=$2; shift 2
  timeout "$limit" python3 -m specla bench --device cuda --suite "$suite" --out "$R" \
    --deadline $((limit - 40)) "$@" 2>&1 | tee "$R/log_$suite.txt"
}

build_cu() {  # build_cu NAME: benchmarks/NAME.cu -> /tmp/NAME for sm_90 (its log in $R); fails unless built
  rm -f "/tmp/$1"
  nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o "/tmp/$1" "benchmarks/$1.cu" 2>&1 \
    | tee "$R/log_$1_build.txt"
  [ -x "/tmp/$1" ]
}

pair_speed() {  # pair_speed NAME LIMIT [launch_counts options]: the embedded pair, measured preset, 20 held-out prompts
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 benchmarks/launch_counts.py --out "$R/$name" --preset measured \
    --speed-prompts data/corpus/heldout_prompts.jsonl --speed-limit 20 --tokens 128 "$@" > "$R/log_$name.txt" 2>&1
}

for stage in "$@"; do
  start=$SECONDS
  echo "=== stage $stage"
  case $stage in
    tests) timeout "${T_TESTS:-420}" python3 -m pytest -v -m gpu -p no:cacheprovider --durations=20 \
             -k "${TESTS_K:-}" ${TESTS_FILES:-tests/test_gpu_runtime.py tests/test_device_drafter.py tests/test_backends.py tests/test_gpu_app.py} > "$R/gpu_tests.txt" 2>&1; tail -30 "$R/gpu_tests.txt" ;;
    kernel-tests) timeout "${T_KERNEL_TESTS:-400}" python3 -m pytest -v -p no:cacheprovider \
             tests/test_kernels.py -k "${KERNEL_TESTS:-not interpreter}" > "$R/gpu_kernel_tests.txt" 2>&1
           tail -5 "$R/gpu_kernel_tests.txt" ;;
    runtime) bench runtime "${T_RUNTIME:-260}" ;;
    kernels) bench kernels "${T_KERNELS:-240}" ;;
    projection-sweep) # the fused projections' tilings against fla + cuBLAS (issue #15); QUICK=--quick halves it
      timeout "${T_PROJECTION:-420}" python3 benchmarks/bench_kernels.py --out "$R/projection" --only projection \
        ${QUICK:-} 2>&1 | tee "$R/log_projection_sweep.txt" ;;
    gemv) # the GEMV form's tilings at one row (an AR step), weight GB/s
      timeout "${T_GEMV:-240}" python3 benchmarks/bench_kernels.py --out "$R/gemv" --only gemv \
        ${QUICK:---quick} 2>&1 | tee "$R/log_gemv.txt" ;;
    parallel) # the one-launch parallel verify against the walk and gram + solve, and PDL on the projections
      timeout "${T_PARALLEL:-240}" python3 benchmarks/bench_kernels.py --out "$R/parallel" --only parallel,pdl \
        ${QUICK:---quick} 2>&1 | tee "$R/log_parallel.txt" ;;
    parallel-orders) # issue #16: the parallel verification's orders and product precisions at the 1.3B
      # shape (each config checked against the float64 reference, then timed), the GPU tests of both,
      # and the 1.3B step with each (needs data/corpus/heldout_prompts.jsonl); ~480 s on a cold machine
      timeout "${T_PARALLEL_ORDERS:-150}" python3 benchmarks/bench_kernels.py --out "$R/parallel_orders" \
        --only parallel --quick --parallel-models gdn-1.3b --parallel-sizes 9,16 --parallel-configs \
        '[{}, {"gram_first": true}, {"dot_precision": "tf32x3"}, {"gram_first": true, "dot_precision": "tf32x3"}]' \
        2>&1 | tee "$R/log_parallel_orders.txt"
      timeout "${T_PARALLEL_TESTS:-120}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
        -k "parallel_form_folds_pending or parallel_form_on_repeated" > "$R/gpu_tests_parallel.txt" 2>&1
      tail -2 "$R/gpu_tests_parallel.txt"
      timeout "${T_PARALLEL_COUNTS:-200}" python3 benchmarks/launch_counts.py --out "$R/lc_parallel" \
        --model gdn-1.3b-random --budget 8 --ops fused,fused+gramfirst,fused+tf32x3 \
        --speed-prompts data/corpus/heldout_prompts.jsonl --speed-limit 4 --tokens 128 \
        2>&1 | tee "$R/log_lc_parallel.txt" ;;
    narrow-in) # issue #15: the persistent verification's input projection in 16-column units (q and k normed in
      # phase B) against whole heads: the embedded pair on held-out prompts, the phase split at 16 nodes, GPU tests
      timeout "${T_NARROW_SPEED:-210}" python3 benchmarks/launch_counts.py --out "$R/lc_narrow" --ops fused,fused+in64 \
        --preset measured --speed-prompts data/corpus/heldout_prompts.jsonl --speed-limit 3 --tokens 128 \
        2>&1 | tee "$R/log_lc_narrow.txt"
      timeout "${T_NARROW_BENCH:-90}" python3 benchmarks/bench_verify_step.py --out "$R/vs_narrow" --accept --nodes 16 \
        --variants 4/256/1,4/256/1:BN_IN=32,4/256/1:BN_IN=64 2>&1 | tail -8
      timeout "${T_NARROW_TESTS:-250}" python3 -m pytest -v -p no:cacheprovider tests/test_verify_step.py \
        tests/test_chain_accept.py tests/test_gpu_runtime.py -k "not interpreter and not wide and (verify or accept or \
        graphed_spec_with_fused or (graphed_spec_equals_ar_fp32 and cuda))" > "$R/gpu_tests_narrow_in.txt" 2>&1
      tail -3 "$R/gpu_tests_narrow_in.txt" ;;
    fold-carve) # issue #15: the verification's deferred commit folded in phase B or by phase A's idle programs
      # (FOLD_IN_A), and the persistent kernels with one preferred L1 / shared split or the driver's own
      # (kernels/carveout.py): the step loop and the embedded pair's speed on held-out prompts; GPU tests
      timeout "${T_CARVE_COUNTS:-380}" python3 benchmarks/launch_counts.py --out "$R/lc_carve" \
        --ops "${CARVE_OPS:-fused+foldb,fused+folda,fused+folda+carve100,fused+folda+carvedef}" \
        --preset measured --speed-prompts data/corpus/heldout_prompts.jsonl --speed-limit 3 --tokens 128 \
        2>&1 | tee "$R/log_lc_carve.txt"
      timeout "${T_CARVE_TESTS:-170}" python3 -m pytest -v -p no:cacheprovider tests/test_carveout.py \
        tests/test_verify_step.py tests/test_gpu_runtime.py -k "not interpreter and not wide and (split or \
        matches_reference or (graphed_spec_equals_ar_fp32 and cuda))" > "$R/gpu_tests_carve.txt" 2>&1
      tail -3 "$R/gpu_tests_carve.txt" ;;
    preload) # issue #16: the swapped projections' inputs loaded a block ahead or not (session 30's default,
      # never timed in a whole step), then the GPU tests of the projections, the L2 prefetch and per-op exactness
      timeout "${T_PRELOAD_COUNTS:-200}" python3 benchmarks/launch_counts.py --out "$R/lc_preload" \
        --model gdn-1.3b-random --budget 8 --ops fused,fused+nopreload \
        --speed-prompts data/corpus/heldout_prompts.jsonl --speed-limit 4 --tokens 128 \
        2>&1 | tee "$R/log_lc_preload.txt"
      timeout "${T_PRELOAD_TESTS:-200}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
        -k "projection_matches_reference and gated_norm" > "$R/gpu_tests_preload.txt" 2>&1
      timeout "${T_PRELOAD_TESTS:-200}" python3 -m pytest -q -p no:cacheprovider tests/test_l2_prefetch.py \
        tests/test_gpu_runtime.py -k "prefetch or per_op_verification_equals_ar" >> "$R/gpu_tests_preload.txt" 2>&1
      grep -E "passed|failed" "$R/gpu_tests_preload.txt" ;;
    phase-floor) # issue #15: what one dependent phase costs, joined by a grid barrier through L2 (the Triton
      # persistent kernels' way) or by a thread-block cluster's barrier, through L2 or distributed shared memory
      if build_cu phase_floor; then
        for rows in 0 1024; do
          timeout "${T_PHASE_FLOOR:-60}" /tmp/phase_floor --rows $rows | tee "$R/phase_floor_rows$rows.json"
        done
      fi ;;
    l2-sides) # issues #15, #16: a pool read by every SM in steps joined by a grid barrier, each chunk by the
      # same SM or by another one each step: whether where a tile is read decides if it stays in L2
      if build_cu l2_sides; then
        timeout "${T_L2_SIDES:-120}" /tmp/l2_sides ${L2_SIDES_ARGS:-} | tee "$R/l2_sides.json"
      fi ;;
    head) bench head "${T_HEAD:-300}" ${HEAD_ARGS:-} ;;
    head-kernels) timeout "${T_HEAD_KERNELS:-300}" python3 benchmarks/bench_lilicorr.py --out "$R" ${HEAD_KERNELS_ARGS:-} \
             2>&1 | tee "$R/log_bench_lilicorr.txt" ;;
    e2e) bench e2e "${T_E2E:-520}" ${E2E_ARGS:-} ;;
    e2e-quick) bench e2e "${T_E2E:-200}" --quick ;;
    acceptance) bench acceptance "${T_ACCEPTANCE:-200}" ;;
    launch-counts) timeout "${T_LAUNCH_COUNTS:-150}" python3 benchmarks/launch_counts.py --out "$R" ${LAUNCH_ARGS:-} \
             2>&1 | tee "$R/log_launch_counts.txt" ;;
    ops-compare) # fla's kernels against the fused projections, one run each shape: launches and kernel time
      # per body, and (embedded) AR and speculation end to end on held-out prompts (issues #15, #16)
      timeout "${T_OPS_COMPARE:-200}" python3 benchmarks/launch_counts.py --out "$R/lc_embedded" --ops fla,fused \
        --speed-prompts data/corpus/heldout_prompts.jsonl --speed-limit 6 --tokens 128 2>&1 | tee "$R/log_lc_embedded.txt"
      timeout "${T_OPS_COMPARE_1P3B:-110}" python3 benchmarks/launch_counts.py --out "$R/lc_1p3b" --model gdn-1.3b-random \
        --budget 8 --ops fla,fused 2>&1 | tee "$R/log_lc_1p3b.txt" ;;
    whole-step) # the persistent AR step (issue #15): its GPU tests, its launches and speed against the
      # per-op path on held-out prompts, and what a grid barrier costs against a launch
      timeout "${T_WHOLE_TESTS:-130}" python3 -m pytest -v -p no:cacheprovider tests/test_decode_step.py \
        tests/test_conv_recurrent_step.py -k "not interpreter" > "$R/gpu_tests_decode.txt" 2>&1
      tail -2 "$R/gpu_tests_decode.txt"
      timeout "${T_WHOLE_SPEED:-230}" python3 benchmarks/launch_counts.py --out "$R/lc_whole" \
        --ops fused+nowhole,fused,fused+p64 --speed-prompts data/corpus/heldout_prompts.jsonl --speed-limit 3 \
        --tokens 128 2>&1 | tee "$R/log_lc_whole.txt"
      timeout "${T_BARRIER:-120}" python3 benchmarks/bench_kernels.py --out "$R/barrier" --only barrier \
        2>&1 | tee "$R/log_barrier.txt" ;;
    chain-verify) # the persistent chain verification (issue #15): its GPU tests against the reference, launches
      # and speed against the per-op verification on held-out prompts, and the engine's exactness with it
      timeout "${T_VERIFY_TESTS:-200}" python3 -m pytest -v -p no:cacheprovider tests/test_verify_step.py \
        -k "not interpreter" > "$R/gpu_tests_verify.txt" 2>&1
      tail -2 "$R/gpu_tests_verify.txt"
      timeout "${T_VERIFY_SPEED:-230}" python3 benchmarks/launch_counts.py --out "$R/lc_verify" \
        --ops fused+noverify,fused --speed-prompts data/corpus/heldout_prompts.jsonl --speed-limit 3 \
        --tokens 128 2>&1 | tee "$R/log_lc_verify.txt"
      timeout "${T_VERIFY_ENGINE:-150}" python3 -m pytest -v -p no:cacheprovider tests/test_gpu_runtime.py -k \
        "graphed_ar_equals_eager or graphed_spec_with_fused or (graphed_spec_equals_ar_fp32 and cuda) or bf16_diverges" \
        > "$R/gpu_tests_runtime.txt" 2>&1
      tail -2 "$R/gpu_tests_runtime.txt" ;;
    draft-step) # the persistent block draft (issue #15): its GPU tests against the torch path, its time per
      # call, launches and speed against the torch-ops draft on held-out prompts, and the engine's exactness with it
      timeout "${T_DRAFT_TESTS:-150}" python3 -m pytest -v -p no:cacheprovider tests/test_draft_step.py \
        -k "not interpreter" > "$R/gpu_tests_draft.txt" 2>&1
      tail -2 "$R/gpu_tests_draft.txt"
      timeout "${T_DRAFT_BENCH:-120}" python3 benchmarks/bench_draft_step.py --out "$R/ds" 2>&1 | tail -6
      timeout "${T_DRAFT_SPEED:-260}" python3 benchmarks/launch_counts.py --out "$R/lc_draft" \
        --ops fused+nodraft,fused --speed-prompts data/corpus/heldout_prompts.jsonl --speed-limit 3 \
        --tokens 128 2>&1 | tee "$R/log_lc_draft.txt"
      timeout "${T_DRAFT_ENGINE:-240}" python3 -m pytest -v -p no:cacheprovider tests/test_device_drafter.py \
        tests/test_gpu_runtime.py -m gpu -k "persistent_draft or trained_pair or fp32_equals_graphed_ar_and_eager \
        or (graphed_spec_equals_ar_fp32 and cuda)" > "$R/gpu_tests_engine.txt" 2>&1
      tail -2 "$R/gpu_tests_engine.txt" ;;
    chain-accept) # greedy acceptance inside the chain verification's launch (issue #15): its GPU tests against the
      # torch acceptance, launches and speed against acceptance as torch ops, and the engine's exactness with it
      timeout "${T_ACCEPT_TESTS:-200}" python3 -m pytest -v -p no:cacheprovider tests/test_chain_accept.py \
        tests/test_verify_step.py -k "not interpreter" > "$R/gpu_tests_accept.txt" 2>&1
      tail -2 "$R/gpu_tests_accept.txt"
      timeout "${T_ACCEPT_BENCH:-150}" python3 benchmarks/bench_verify_step.py --out "$R/vs" --accept 2>&1 | tail -5
      timeout "${T_ACCEPT_SPEED:-260}" python3 benchmarks/launch_counts.py --out "$R/lc_accept" \
        --ops fused+noaccept,fused --speed-prompts data/corpus/heldout_prompts.jsonl --speed-limit 3 \
        --tokens 128 2>&1 | tee "$R/log_lc_accept.txt"
      timeout "${T_ACCEPT_ENGINE:-300}" python3 -m pytest -v -p no:cacheprovider tests/test_device_drafter.py \
        tests/test_gpu_runtime.py -m gpu -k "persistent_draft or trained_pair or fp32_equals_graphed_ar_and_eager \
        or (graphed_spec_equals_ar_fp32 and cuda) or (oracle_realignment and cuda) or bf16_diverges" \
        > "$R/gpu_tests_engine.txt" 2>&1
      tail -2 "$R/gpu_tests_engine.txt" ;;
    tree-preset) # trees verified and accepted in the verification's launch, and the block drafter's measured preset
      # drafted in the draft's (issue #15): the kernels' GPU tests, launches and speed on held-out prompts, exactness
      timeout "${T_PRESET_TESTS:-260}" python3 -m pytest -v -p no:cacheprovider tests/test_verify_step.py \
        tests/test_chain_accept.py tests/test_draft_step.py -k "not interpreter and (tree or accept or block_draft)" \
        > "$R/gpu_tests_tree.txt" 2>&1
      tail -2 "$R/gpu_tests_tree.txt"
      timeout "${T_PRESET_SPEED:-230}" python3 benchmarks/launch_counts.py --out "$R/lc_preset" --ops fused \
        --preset measured --speed-prompts data/corpus/heldout_prompts.jsonl --speed-limit 3 --tokens 128 \
        2>&1 | tee "$R/log_lc_preset.txt"
      timeout "${T_PRESET_ENGINE:-200}" python3 -m pytest -v -p no:cacheprovider tests/test_device_drafter.py \
        tests/test_gpu_runtime.py -m gpu -k "preset or (graphed_spec_with_fused and tree)" \
        > "$R/gpu_tests_preset_engine.txt" 2>&1
      tail -2 "$R/gpu_tests_preset_engine.txt" ;;
    ngram-chain) # the n-gram chain in one launch and the page's GPU defaults (issue #15): GPU tests, then the
      # preset, the n-gram chain and the block chain against AR on held-out prompts, then grids and AR phases
      timeout "${T_NGRAM_TESTS:-200}" python3 -m pytest -v -p no:cacheprovider tests/test_ngram_chain.py \
        tests/test_device_drafter.py -m gpu -k "not interpreter and (ngram_chain or page_defaults)" \
        > "$R/gpu_tests_ngram.txt" 2>&1
      tail -2 "$R/gpu_tests_ngram.txt"
      bench e2e "${T_NGRAM_E2E:-330}" --pair-only --pair-budget $((${T_NGRAM_E2E:-330} - 50)) \
        --pair-rows "${PAIR_ROWS:-block/preset-*,ngram/chain-*,block/chain}"
      timeout "${T_PROGRAMS:-150}" python3 benchmarks/bench_programs.py --out "$R" 2>&1 | tee "$R/log_programs.txt" ;;
    swap-1p3b) # the swapped projection form (issue #16): the projection GPU tests the first H100 call did not
      # reach (gated norm, SwiGLU), then the 1.3B oracle chain and tree at alpha 0.8 with the fused op set
      # and with fla's in one run (whether "auto" may take the fused set at hidden 2048); ~570 s on a cold machine
      timeout "${T_SWAP_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
        -k "projection_matches_reference and (gated_norm or swiglu)" > "$R/gpu_tests_projection.txt" 2>&1
      tail -2 "$R/gpu_tests_projection.txt"
      for ops in fused fla; do
        timeout "${T_SWAP_E2E:-210}" python3 -m specla bench --device cuda --suite e2e --quick --ops $ops \
          --pair-budget 1 --oracle-alphas 0.8 --tokens 128 --deadline $((${T_SWAP_E2E:-210} - 15)) \
          --out "$R/e2e_oracle_$ops" 2>&1 | tee "$R/log_e2e_oracle_$ops.txt" | grep "\[e2e\]"
      done ;;
    step-ops) # issues #15, #16: the GPU tests of the AR step's kernels (conv + recurrence, the conv in
      # the in-projection, the PDL recurrence, the greedy token) and the persistent verification, then the 1.3B step per op set in STEP_OPS (launches, kernel time,
      # AR and the oracle chain of 8 at alpha 0.8 on held-out prompts; launch_counts.py --help lists the
      # +flags); ~450 s on a cold machine
      timeout "${T_STEP_TESTS:-120}" python3 -m pytest -q -p no:cacheprovider tests/test_conv_recurrent_step.py \
        tests/test_conv_projection.py tests/test_recurrent_step.py tests/test_greedy.py tests/test_verify_step.py \
        > "$R/gpu_tests_step.txt" 2>&1; tail -2 "$R/gpu_tests_step.txt"
      timeout "${T_STEP_COUNTS:-290}" python3 benchmarks/launch_counts.py --out "$R" --model gdn-1.3b-random \
        --budget 8 --ops ${STEP_OPS:-fused,fused+norecstep,fused+noconvproj+norecstep,fla} --speed-prompts data/corpus/heldout_prompts.jsonl \
        --speed-limit 4 --tokens 128 2>&1 | tee "$R/log_launch_counts.txt" | grep "^\[" ;;
    speedup) # the model-free drafter beside the trained ones, on both prompt sets (needs data/corpus/*_prompts.jsonl)
      timeout "${T_SPEEDUP:-240}" python3 benchmarks/run_acceptance.py --speedup --device cuda --limit 8 \
        --max-new-tokens 128 --out "$R" --name speedup_h200 --rows ${SPEEDUP_ROWS:-ngram:chain:1:8:depth=8 \
        ngram:best-first:4:16:depth=8 block:chain:1:7 lilicorr:chain:4:7 lilicorr:best-first:8:16} \
        2>&1 | tee "$R/log_speedup.txt" ;;
    app) timeout "${T_APP:-540}" python3 benchmarks/app_vs_bench.py --out "$R" --app-args "--device cuda" ${APP_ARGS:-} \
           2>&1 | tee "$R/log_app_vs_bench.txt" ;;
    drafter) # issue #15: a drafter kind trained alone for a whole command's budget (DRAFTER_KINDS, DRAFTER_MINUTES),
      # from the corpus text (data/corpus/train.txt.gz and manifest.json, carried; tokenized there with the
      # target's tokenizer); the weights go to $OUT/drafters, beside the results archive
      timeout "${T_DRAFTER:-585}" python3 -m specla.train drafter --target assets/target --data data/corpus \
        --state runs/drafter-state --out "$OUT/drafters" --kinds "${DRAFTER_KINDS:-block}" \
        --minutes "${DRAFTER_MINUTES:-9.0}" --gen-tokens 12000000 ${DRAFTER_ARGS:-} 2>&1 | tee "$R/log_drafter.txt"
      cp "$OUT/drafters/summary.json" "$R/drafter_summary.json" 2>/dev/null ;;
    drafter-speed) # issue #15: the block drafter in assets/ and, on the same machine, another one (OTHER_BLOCK, a
      # carried folder, e.g. runs/old_block from `git show cb75a55:assets/drafters/block/<file>`), each with its
      # own measured preset, on 20 held-out prompts of 128 tokens. The first run compiles the kernels:
      # on a fresh H100 it ran past 240 s, so it has its own limit, T_DRAFTER_SPEED_FIRST
      lc_speed() { pair_speed "$1" "$2" --ops fused; tail -2 "$R/log_$1.txt"; }
      lc_speed lc_drafter_assets "${T_DRAFTER_SPEED_FIRST:-360}"
      other=${OTHER_BLOCK:-runs/old_block}
      if [ -d "$other" ]; then
        mkdir -p /tmp/assets_block && cp assets/drafters/block/* /tmp/assets_block/ && cp "$other"/* assets/drafters/block/
        lc_speed lc_drafter_other "${T_DRAFTER_SPEED:-150}"
        cp /tmp/assets_block/* assets/drafters/block/
      fi ;;
    tree-ab) # issue #15: the block drafter's measured preset against its best-first tree of 16 nodes over top-8
      # candidates, grown in the draft's launch (TREE_AB_ARGS to change it), on 20 held-out prompts
      pair_speed lc_tree_preset "${T_TREE_AB_FIRST:-360}" --ops fused; tail -2 "$R/log_lc_tree_preset.txt"
      pair_speed lc_tree_best_first "${T_TREE_AB:-200}" --ops fused --preset '' \
        ${TREE_AB_ARGS:---tree best-first --top-k 8 --budget 15}; tail -2 "$R/log_lc_tree_best_first.txt"
      if [ -n "${TREE_AB_LILICORR:-}" ]; then   # LiLiCorr's tree of the same size: grown by torch ops, then by a kernel
        pair_speed lc_tree_lilicorr "${T_TREE_AB:-300}" --ops fused,fused+latticetree --preset '' --drafter lilicorr \
          --tree best-first --top-k 8 --budget 15; tail -3 "$R/log_lc_tree_lilicorr.txt"
      fi ;;
    kernels-ab) # issue #15: the embedded pair's measured preset with this tree's kernels and with BASE_TREE's
      # (a carried `git archive <commit> kernels benchmarks tests specla conftest.py pytest.ini` unpacked under
      # runs/, its assets and prompts linked from here), one after the other on this machine, AB_ROUNDS times
      base=${BASE_TREE:-runs/base}
      ln -sfn "$PWD/assets" "$base/assets" && mkdir -p "$base/data" && ln -sfn "$PWD/data/corpus" "$base/data/corpus"
      for round in $(seq "${AB_ROUNDS:-1}"); do
        pair_speed "lc_ab_new$round" "${T_KERNELS_AB:-300}" --ops fused; tail -2 "$R/log_lc_ab_new$round.txt"
        (cd "$base" && R=$R PYTHONPATH=/tmp/site:$PWD pair_speed "lc_ab_base$round" "${T_KERNELS_AB:-300}" --ops fused)
        tail -2 "$R/log_lc_ab_base$round.txt"
      done ;;
    target) # the exported weights are too big for the results archive: they go to $OUT/target
      timeout "${T_TARGET:-560}" python3 -m specla.train target --data data/corpus --out /tmp/target2 \
        --backend torch --tokenizer '' --init assets/target \
        --init-summary benchmarks/results/target_training_summary.json ${TARGET_ARGS:-} 2>&1 | tee "$R/log_target.txt"
      mkdir -p "$OUT/target" && cp /tmp/target2/export/* /tmp/target2/log.jsonl /tmp/target2/summary.json "$OUT/target/" ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "=== stage $stage: $((SECONDS - start)) s"
  # the reply carries at most 8 files: one archive of the results, rewritten after each stage
  tar -czf "$OUT/results.tgz" -C "$OUT" results
done
if [ "${SAVE_TRITON_CACHE:-0}" = 1 ] && [ -d "$TRITON_CACHE_DIR" ]; then
  tar -czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" .
  # the reply takes files of at most 16 MiB
  if [ "$(stat -c %s "$OUT/triton-cache.tgz")" -gt 16000000 ]; then
    echo "triton cache: $(du -h "$OUT/triton-cache.tgz" | cut -f1), over the 16 MiB a file may take back; not sent"
    rm "$OUT/triton-cache.tgz"
  fi
fi
ls -la "$OUT"
