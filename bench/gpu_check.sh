#!/usr/bin/env bash
# One call on a CUDA machine: the GPU tests of every op, then `python -m fusedops.bench`, with every log kept
# under $OUT (default ./gpu-logs) as it is written, so a run cut by a time limit still leaves its
# numbers. Baseline wheels in .whl/ (liger-kernel, fla-core, einops) are installed to /tmp/site first.
#   STEPS="host tune tests bench" OPS="attn_res embedding" TEST_S=200 BENCH_S=330 bash bench/gpu_check.sh
# STEPS (default "tests bench"): host = fusedops.bench.host (host overhead vs GPU time),
# tune = fusedops.bench.tune_attn_res (attn_res plan sweep), depthtune / depthfwd = the attn_res depth-tile backward /
# forward sweeps, fwdsplit = the split depth-tile forward on few tokens, bwddim = the attn_res backward's warps x grid x constant-D sweep, bwdwide = the two-phase backward
# of wide rows (split sources, tiles), bwdablate = where the
# one-pass backward's time goes, stashtune =
# the attn_res backward with its partial sums stashed in grad_values or in their own buffer,
# embtune = embedding backward-kernel variants, natune = fusedops.bench.tune_neighborhood_attention,
# breakdown = fusedops.bench.breakdown (device time per kernel of a fwd+bwd step),
# block = fusedops.bench.block_attn_res (PARTS, default all four), blocktune = fusedops.bench.tune_block_attn_res
# (BLOCKTUNE, default "multi merge"), experiment = python -m bench.experiments.$EXP,
# grid = fusedops.bench.attn_res_grid (issue 31's attn_res shape grid, GRID_S, GRID_ARGS e.g. "--providers fusedops";
# JSON and heatmaps into $OUT),
# gridpar = the same grid over every GPU of the host: GRID_WARM processes a GPU (default 6) first run its part's
# shapes once untimed (compiles), beside the GPU tests on GPU 0 when STEPS also names tests (run them there, not
# after), then one timed part a GPU (GRID_S each; GRID_PARTS, GRID_FIRST: which parts), merged by --summarize;
# the parts' JSON and logs come back as one tgz,
# nagrid = fusedops.bench.na_grid (issue 32's neighborhood-attention grid against Flex; PART, default 1/2),
# tests = the GPU tests (TEST_K: a pytest -k expression), aoti = the AOTInductor package test (3.5-5 min of compiling), lm = the example model,
# bench = python -m fusedops.bench.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
for step in ${STEPS:-tests bench}; do
  [[ $step == tests && " ${STEPS:-} " == *" gridpar "* ]] && continue  # gridpar runs the tests beside its warm-up
  case $step in
    host)
      timeout "${HOST_S:-150}" python3 -m fusedops.bench.host > "$OUT/host.txt" 2>&1
      echo "host (exit $?):"; head -n 24 "$OUT/host.txt" ;;
    tune)
      timeout "${TUNE_S:-150}" python3 -m fusedops.bench.tune_attn_res > "$OUT/tune.txt" 2>&1
      echo "tune (exit $?):"; cat "$OUT/tune.txt" ;;
    depthtune)
      timeout "${TUNE_S:-150}" python3 -m fusedops.bench.tune_attn_res depth > "$OUT/depthtune.txt" 2>&1
      echo "depthtune (exit $?):"; sed -n '/^case |/,$p' "$OUT/depthtune.txt" ;;
    stashtune)
      timeout "${TUNE_S:-150}" python3 -m fusedops.bench.tune_attn_res stash > "$OUT/stashtune.txt" 2>&1
      echo "stashtune (exit $?):"; sed -n '/^case |/,$p' "$OUT/stashtune.txt" ;;
    depthfwd)
      timeout "${TUNE_S:-150}" python3 -m fusedops.bench.tune_attn_res depth-fwd > "$OUT/depthfwd.txt" 2>&1
      echo "depthfwd (exit $?):"; sed -n '/^case |/,$p' "$OUT/depthfwd.txt" ;;
    bwddim)
      timeout "${TUNE_S:-150}" python3 -m fusedops.bench.tune_attn_res bwd-dim > "$OUT/bwddim.txt" 2>&1
      echo "bwddim (exit $?):"; sed -n '/^case |/,$p' "$OUT/bwddim.txt" ;;
    fwdsplit)
      timeout "${TUNE_S:-150}" python3 -m fusedops.bench.tune_attn_res fwd-split > "$OUT/fwdsplit.txt" 2>&1
      echo "fwdsplit (exit $?):"; sed -n '/^case |/,$p' "$OUT/fwdsplit.txt" ;;
    bwdwide)
      timeout "${TUNE_S:-150}" python3 -m fusedops.bench.tune_attn_res bwd-wide > "$OUT/bwdwide.txt" 2>&1
      echo "bwdwide (exit $?):"; sed -n '/^case |/,$p' "$OUT/bwdwide.txt" ;;
    bwdablate)
      timeout "${TUNE_S:-150}" python3 -m fusedops.bench.tune_attn_res bwd-ablation > "$OUT/bwdablate.txt" 2>&1
      echo "bwdablate (exit $?):"; grep " | " "$OUT/bwdablate.txt" ;;
    block)
      timeout "${BLOCK_S:-300}" python3 -m fusedops.bench.block_attn_res --parts ${PARTS:-block decode merge multi} \
        > "$OUT/block.txt" 2> "$OUT/block_progress.txt"
      echo "block (exit $?):"; cat "$OUT/block.txt" ;;
    blocktune)
      TUNE_S=$(( ${BLOCKTUNE_S:-300} - 20 )) timeout "${BLOCKTUNE_S:-300}" python3 -m fusedops.bench.tune_block_attn_res \
        ${BLOCKTUNE:-multi merge} > "$OUT/blocktune.txt" 2>&1
      echo "blocktune (exit $?):"; grep -A4 "^case" "$OUT/blocktune.txt" ;;
    experiment)
      timeout "${EXP_S:-300}" python3 -m "bench.experiments.$EXP" > "$OUT/$EXP.txt" 2>&1
      echo "$EXP (exit $?):"; tail -n "${EXP_TAIL:-30}" "$OUT/$EXP.txt" ;;
    embtune)
      timeout "${EMBTUNE_S:-150}" python3 -c "from fusedops.bench.embedding import sweep_bwd; sweep_bwd()" > "$OUT/embtune.txt" 2>&1
      echo "embtune (exit $?):"; cat "$OUT/embtune.txt" ;;
    breakdown)
      timeout "${BREAKDOWN_S:-150}" python3 -m fusedops.bench.breakdown ${OPS:-} > "$OUT/breakdown.txt" 2>&1
      echo "breakdown (exit $?):"; cat "$OUT/breakdown.txt" ;;
    natune)
      timeout "${NATUNE_S:-150}" python3 -m fusedops.bench.tune_neighborhood_attention > "$OUT/natune.txt" 2>&1
      echo "natune (exit $?):"; cat "$OUT/natune.txt" ;;
    grid)
      # --max-seconds a minute short of the timeout: the summary and the heatmaps of what was measured still come
      timeout "${GRID_S:-420}" python3 -m fusedops.bench.attn_res_grid --device cuda --out "$OUT" ${GRID_ARGS:-} \
        --max-seconds $(( ${GRID_S:-420} - 60 )) > "$OUT/grid.txt" 2>&1
      echo "grid (exit $?):"
      if grep -q "^attn_res grid summary" "$OUT/grid.txt"; then sed -n '/^attn_res grid summary/,$p' "$OUT/grid.txt"
      else grep -E " ms" "$OUT/grid.txt" | tail -n 40; fi ;;
    gridpar)
      # GRID_PARTS (default: the GPU count) parts of the grid, this call timing parts GRID_FIRST.. (one a GPU), so
      # that two calls of a 4-GPU host cover 8 parts; warm-up: GRID_WARM processes a GPU over its part's shapes
      gpus=$(python3 -c "import torch; print(torch.cuda.device_count())"); per=${GRID_WARM:-6}
      nparts=${GRID_PARTS:-$gpus}; first=${GRID_FIRST:-1}; last=$(( first + gpus - 1 < nparts ? first + gpus - 1 : nparts ))
      parts=/tmp/gridpar; rm -rf $parts; mkdir -p $parts; started=$SECONDS
      for p in $(seq $first $last); do
        for j in $(seq 1 $per); do
          # FLA_CACHE_RESULTS=0: fla's autotuner picks its configs in the timed run, alone on its GPU (compiles stay cached)
          FLA_CACHE_RESULTS=0 CUDA_VISIBLE_DEVICES=$(( p - first )) timeout "${WARM_S:-300}" python3 -m fusedops.bench.attn_res_grid \
            --device cuda --warm --part "$p/$nparts" --sub "$j/$per" ${GRID_ARGS:-} > "$parts/warm-$p-$j.txt" 2>&1 &
        done
      done
      if [[ " ${STEPS} " == *" tests "* ]]; then
        CUDA_VISIBLE_DEVICES=0 STEPS=tests bash bench/gpu_check.sh
      fi
      wait; echo "gridpar: warm-up of parts $first-$last of $nparts ($per processes a GPU) took $(( SECONDS - started )) s;" \
        "$(cat $parts/warm-*.txt | grep -c ': ok$') shape-warm-ups ok, not ok: $(grep -h 'warm ' $parts/warm-*.txt | grep -v ': ok$' | tr '\n' ' ')"
      for p in $(seq $first $last); do
        CUDA_VISIBLE_DEVICES=$(( p - first )) timeout "${GRID_S:-420}" python3 -m fusedops.bench.attn_res_grid --device cuda \
          --part "$p/$nparts" --out $parts --no-plots ${GRID_ARGS:-} --max-seconds $(( ${GRID_S:-420} - 40 )) > "$parts/grid-$p.txt" 2>&1 &
      done
      wait; echo "gridpar: timed parts done at $(( SECONDS - started )) s"
      python3 -m fusedops.bench.attn_res_grid --summarize $parts/attn_res_grid-cuda-*-part*.json --out "$OUT" \
        > "$OUT/grid.txt" 2>&1
      for p in $(seq $first $last); do sed -n '/^attn_res grid summary/,$p' "$parts/grid-$p.txt" >> "$OUT/grid.txt"; done
      tar -czf "$OUT/grid-parts.tgz" -C $parts . ; cat "$OUT/grid.txt" | head -n 40 ;;
    nagrid)
      timeout "${NAGRID_S:-560}" python3 -m fusedops.bench.na_grid --part "${PART:-1/2}" --out "$OUT/na_grid.json" \
        > "$OUT/na_grid.txt" 2>&1
      echo "na grid (exit $?):"; grep -v -i -e warn -e create_block_mask "$OUT/na_grid.txt" | tail -n 25 ;;
    tests)
      tests=()
      for op in ${OPS:-attn_res block_attn_res embedding neighborhood_attention hardening}; do tests+=("fusedops_tests/test_$op.py"); done
      tests+=("fusedops_tests/test_dispatch.py")
      timeout "${TEST_S:-200}" python3 -m pytest "${tests[@]}" -m gpu ${TEST_K:+-k "$TEST_K"} -q -p no:cacheprovider \
        > "$OUT/gpu_tests.txt" 2>&1
      echo "gpu tests (exit $?):"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.txt" | tail -8 ;;
    aoti)
      timeout "${AOTI_S:-420}" python3 -m pytest fusedops_tests/test_example_lm.py -m gpu -q -rs -p no:cacheprovider \
        > "$OUT/aoti.txt" 2>&1
      echo "aoti (exit $?):"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|skipped" "$OUT/aoti.txt" | tail -4 ;;
    lm)
      timeout "${LM_S:-200}" python3 -m fusedops.examples.lm --out "$OUT/lm" > "$OUT/lm.txt" 2>&1
      echo "lm (exit $?):"; tail -n 25 "$OUT/lm.txt" ;;
    bench)
      timeout "${BENCH_S:-330}" python3 -m fusedops.bench ${OPS:-} --device cuda --no-plots --out "$OUT" \
        > "$OUT/bench.txt" 2> "$OUT/bench_progress.txt"
      echo "bench (exit $?):"
      if [ -s "$OUT/bench.txt" ]; then tail -n 70 "$OUT/bench.txt"; else grep -E "ms" "$OUT/bench_progress.txt" | tail -n 60; fi ;;
  esac
done
