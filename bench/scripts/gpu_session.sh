#!/usr/bin/env bash
# One GPU host session, step by step: what docs/gpu.md's runs were made with.
#
#   bash bench/scripts/gpu_session.sh STEP [STEP ...]
#
# Run in the checkout on the GPU host. The environment is either rig's own (pixi / bootstrap.py)
# or a carried one: SITE (default /tmp/site) installed from CARRY (default /tmp/c) by `install`.
# Everything worth keeping is copied under OUT (default .rig/gpu-session). Steps:
#   install    join and check the carried pieces (bench/scripts/gpu_carry.py), install into SITE; carried
#              compile caches (caches.tgz.* and caches.sha256, from `gpu_window.sh caches-out`) are
#              checked and unpacked into the state folder: the serves start warm
#   build      inv kernels.build for this GPU's arch, nothing else (what prepass needs)
#   kernels    inv kernels.build for this GPU's arch, the kernels' GPU tests, the prefill-attention bench
#   prefix     the int8 prefill kernel over a cached prefix: its GPU test (tests/test_kernel_int8_prefix.py)
#   chunkbench a later chunk over its prefix: the int8 route vs vLLM's FlashAttention (prefill_chunk_bench.py)
#   prepass    the int8 prefill pre-pass profile (bench/scripts/prefill_prepass_profile.py; after `kernels`)
#   kvarn      the KVarN kernels' GPU tests and bench/scripts/kvarn_bench.py (issue 14's table)
#   kvdecode   the packed-cache decode kernels and the blocked chunk path: kvarn_decode_sweep.py (SWEEP_ARGS; by default
#              v3 / v4 at their defaults beside v5 with 4, 2, 3 stages at 8k and 32k), their GPU tests, kvarn_chunk_bench.py
#   ncu        Nsight Compute (--set full) of one decode split launch at 8 x 32k for each sweep config in NCU_ONLY
#              (default 35, v5 at its defaults): details, the SASS source page and its warp samples by loop region
#              (bench/scripts/ncu_regions.py)
#   tier       the GPU tier of the suite (tests/test_gpu.py), RIG_GPU_SETS as set by the caller
#   kvserve    the kvarn profile served on this GPU: the backend's Triton engine compiled (tests/test_kvarn_kernels.py
#              -k engine), the GPU tier's kvarn tests (tests/test_gpu.py -k kvarn:
#              pool, greedy and prompt logprobs vs KV=auto) and the cache's perplexity in the engine
#              (bench/scripts/kvarn_engine_ppl.py --platform gpu; KVPPL_ARGS adds arguments)
#   train      train the tiny hybrid (models/recipes/tiny-hybrid-train.toml) on the GPU with the host's own
#              torch and transformers (pydantic borrowed from SITE), evaluate it; the model lands in OUT
#   fixture    build the real-shape benchmark fixture (random weights; CPU work, ~19 GB on disk)
#   fixture&   the same in the background (its log in OUT/fixture.log); a later `wait` step waits for it,
#              so GPU steps between the two overlap the fixture's CPU work
#   pack       tar OUT (less the Triton cache) into the file PACK names, for channels that return few files
#   real       serve the batch profile on the real shape under the gpu24 overlay, verify it live
#              (pool and concurrency vs the planner), one ladder cell, stop (files in OUT/real/)
#   ladder     the same for each rung of LADDER ("name:KNOB=v ...;name:..."; the reference's five by
#              default, the profile's own first; MAX_SEQS=fit: the seats the plan has room for),
#              verifying the first only; files in OUT/<name>/; a rung's OVERLAYS=a,b and PROTOCOL=file
#              replace REAL_OVERLAYS and PROTOCOL for that rung (e.g. the 16k prefill under long-steps), and
#              POOL_OF= (empty) leaves its pool to vLLM's memory profiling, whose log gives the activation peak;
#              with PACK set, OUT is packed after each rung (a caller polling from outside sees progress)
# DEADLINE (epoch seconds) stops the ladder before a rung that would not end ~RUNG_S (default 300) seconds
# before it: a window's last minutes go to fetching files and caches, not to a rung cut in the middle.
# real and ladder on any card but POOL_OF (default rtx3090; empty: off) pin KV_MEM to POOL_OF's planned
# pool, so the seats are that card's: GPU_MEM alone leaves this card's runtime overhead in the pool.
# Nothing here is specific to one GPU model: the arch comes from NVML.
set -uo pipefail
SITE=${SITE:-/tmp/site}
CARRY=${CARRY:-/tmp/c}
OUT=${OUT:-.rig/gpu-session}
FIXTURE=${FIXTURE-fixture:qwen3.5-27b-class}
REAL_SETS=${REAL_SETS-}  # the profile's own compile mode: eager decode of the real shape is step-bound (docs/gpu.md)
REAL_OVERLAYS=${REAL_OVERLAYS-gpu24}
PROFILE=${PROFILE:-batch}
PROTOCOL=${PROTOCOL:-bench/cells/ladder.toml}
POOL_OF=${POOL_OF-rtx3090}
LADDER=${LADDER:-"mlp:INT8_ACT=int8 INT8_LAYERS=mlp;fp16:INT8_ACT= MAMBA_SSM_DTYPE=float16;fp32:INT8_ACT= MAMBA_SSM_DTYPE=float32 MAX_SEQS=fit;all:INT8_ACT=int8 INT8_LAYERS=.;gate_up:INT8_ACT=int8 INT8_LAYERS=gate_up"}
mkdir -p "$OUT"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
inv() { "$PY" -u -m invoke "$@"; }
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
arch() { [ -n "${ARCH:-}" ] && { echo "$ARCH"; return; }; "$PY" -c "import pynvml as n; n.nvmlInit(); a,b=n.nvmlDeviceGetCudaComputeCapability(n.nvmlDeviceGetHandleByIndex(0)); print(f'sm{a}{b}')"; }
keep_triton_cache() { tar -C "$HOME" -czf "$OUT/triton-cache.tgz" .triton 2>/dev/null || true; }

step_install() {
  stamp install
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.csv"
  /usr/bin/time -f "install: %e s wall" sh "$CARRY/install.sh" "$SITE" 2>&1 | tail -3 | tee "$OUT/install.log"
  "$PY" -c "import torch, triton, vllm; print('torch', torch.__version__, 'triton', triton.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name())" 2>&1 | tail -1 | tee -a "$OUT/install.log"
  caches_in | tee -a "$OUT/install.log"
}

# The compile caches an earlier window brought back (gpu_window.sh caches-out), if carried: every piece is
# checked against caches.sha256 before anything is unpacked; one missing or damaged piece, none are used.
caches_in() {
  [ -f "$CARRY/caches.sha256" ] || return 0
  local st=${RIG_STATE_DIR:-.rig}
  if (cd "$CARRY" && sha256sum --quiet -c caches.sha256) && mkdir -p "$st" \
     && cat "$CARRY"/caches.tgz.* | tar -xzf - -C "$st"; then
    echo "caches: unpacked into $st/cache ($(du -sh "$st/cache" | cut -f1)): a warm start"
  else
    echo "caches: a piece is missing or damaged (above): not used, the serves start cold"
  fi
}

step_build() {
  local a; a=$(arch)
  stamp "build ($a)"
  inv kernels.build --arch "$a" 2>&1 | tee "$OUT/kernels-build.log" | tail -5
}

# The int8 prefill kernel over a cached prefix (a prompt's later chunk): its GPU test only (~a minute).
step_prefix() {
  stamp prefix
  "$PY" -m pytest -q -m gpu tests/test_kernel_int8_prefix.py -rA -p no:cacheprovider 2>&1 \
    | tee "$OUT/prefix-pytest.log" | tail -8
}

# A later chunk over its cached prefix: the int8 route beside vLLM's FlashAttention (needs vLLM's CUDA build).
step_chunkbench() {
  stamp chunkbench
  "$PY" bench/scripts/prefill_chunk_bench.py --json "$OUT/prefill_chunk.json" 2>&1 | tee "$OUT/prefill_chunk.txt"
}

step_kernels() {
  local a; a=$(arch)
  stamp "kernels ($a)"
  inv kernels.build --arch "$a" 2>&1 | tee "$OUT/kernels-build.log"
  "$PY" -m pytest -q -m gpu tests/test_kernel_int8_attn.py tests/test_kernel_int8_prefix.py tests/test_kernels_build.py -rA -p no:cacheprovider 2>&1 | tee "$OUT/kernels-pytest.log" | tail -25
  "$PY" bench/scripts/prefill_attn_bench.py --json "$OUT/prefill_attn.json" 2>&1 | tee "$OUT/prefill_attn.txt"
  keep_triton_cache
}

step_prepass() {
  stamp prepass
  "$PY" bench/scripts/prefill_prepass_profile.py --json "$OUT/prefill_prepass.json" \
    --trace "$OUT/prefill_prepass.trace.json" 2>&1 | tee "$OUT/prefill_prepass.txt" | tail -60
}

step_kvarn() {
  stamp kvarn
  "$PY" -m pytest -q -m gpu tests/test_kvarn_kernels.py -rA -p no:cacheprovider 2>&1 | tee "$OUT/kvarn-pytest.log" | tail -20
  "$PY" bench/scripts/kvarn_bench.py --json "$OUT/kvarn_bench.json" 2>&1 | tee "$OUT/kvarn_bench.txt" | tail -40
  keep_triton_cache
}

step_kvdecode() {
  stamp kvdecode
  # shellcheck disable=SC2086  # SWEEP_ARGS is a word list
  "$PY" bench/scripts/kvarn_decode_sweep.py ${SWEEP_ARGS:---only 3,29,35,36,37 --lengths 8192,32768} 2>&1 \
    | tee "$OUT/kvarn_sweep.txt" | tail -25
  "$PY" -m pytest -q -m gpu tests/test_kvarn_kernels.py -k "(decode and (v5 or v6 or match_v1)) or long_context_gpu" \
    -rA -p no:cacheprovider 2>&1 | tee "$OUT/kvdecode-pytest.log" | tail -15
  "$PY" bench/scripts/kvarn_chunk_bench.py --json "$OUT/kvarn_chunk.json" 2>&1 | tee "$OUT/kvarn_chunk.txt" | tail -12
}

step_ncu() {
  stamp "ncu (the decode sweep's configs ${NCU_ONLY:-35} at 8 x 32k, one launch each)"
  local ncu idx bad=0
  ncu=${NCU-$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)}
  [ -n "$ncu" ] && [ -x "$ncu" ] || { echo "ncu: not found on this host (NCU, PATH, /usr/local/cuda*/bin)"; return 1; }
  for idx in ${NCU_ONLY:-35}; do
    "$ncu" --clock-control none -k regex:decode_split -c 1 --set full --import-source yes -o "$OUT/ncu-$idx" \
      "$PY" bench/scripts/kvarn_decode_sweep.py --only "$idx" --lengths 32768 --profile > "$OUT/ncu-$idx.log" 2>&1
    "$ncu" -i "$OUT/ncu-$idx.ncu-rep" --page details > "$OUT/ncu-$idx-details.txt" 2>&1
    "$ncu" -i "$OUT/ncu-$idx.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-$idx-sass.csv" 2>&1
    # to the file, then its head: `tee | head` under pipefail fails the step (SIGPIPE, 141) when head exits first
    "$PY" bench/scripts/ncu_regions.py "$OUT/ncu-$idx-sass.csv" --least "${NCU_LEAST:-64}" > "$OUT/ncu-$idx-regions.txt" 2>&1 \
      || bad=1
    head -12 "$OUT/ncu-$idx-regions.txt"
  done
  return "$bad"
}

step_tier() {
  stamp "tier (RIG_GPU_SETS=${RIG_GPU_SETS:-})"
  "$PY" -m pytest -q -m gpu tests/test_gpu.py -s -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tier-pytest.log" | tail -30
  cp -f "${RIG_STATE_DIR:-.rig}/results/gpu-tier.json" "$OUT/" 2>/dev/null
  keep_triton_cache
}

step_kvserve() {
  stamp kvserve
  inv patch.apply 2>&1 | tail -2
  "$PY" -m pytest -q -m gpu tests/test_kvarn_kernels.py -k engine -rA -p no:cacheprovider 2>&1 | tee "$OUT/kvarn-engine-pytest.log" | tail -8
  "$PY" -m pytest -q -m gpu tests/test_gpu.py -k kvarn -s -rA -p no:cacheprovider 2>&1 | tee "$OUT/kvarn-tier-pytest.log" | tail -30
  # shellcheck disable=SC2086
  "$PY" bench/scripts/kvarn_engine_ppl.py --platform gpu --json "$OUT/kvarn_engine_ppl.json" ${KVPPL_ARGS:-} 2>&1 \
    | tee "$OUT/kvarn_engine_ppl.txt" | tail -20
  keep_triton_cache
}

step_train() {
  stamp "train ${TRAIN_ARGS:-}"
  mkdir -p /tmp/train-site
  for p in "$SITE"/pydantic* "$SITE"/annotated_types* "$SITE"/typing_inspection*; do ln -sfn "$p" /tmp/train-site/; done
  PYTHONPATH="/tmp/train-site:$PWD" "$PY" -u -m rig.models.train --eval --out "$OUT/tiny-hybrid" ${TRAIN_ARGS:-} 2>&1 \
    | grep -v '^\[transformers\]' | tee "$OUT/train.log" | tail -45
}

step_fixture() {
  stamp "fixture $FIXTURE"
  /usr/bin/time -f "fixture: %e s wall" "$PY" -u -m invoke model.fixture --shape "${FIXTURE#fixture:}" 2>&1 | tail -3 | tee "$OUT/fixture.log"
}

# KV_MEM of POOL_OF's plan for these plan arguments when this GPU is not POOL_OF; nothing otherwise.
# GPU_UTIL x GPU_MEM leaves this card's runtime overhead in the pool, so other seats than POOL_OF's
# (2026-12-05, H100 as 24 GiB: 179,842 tokens and 57 seats, not the 3090 plan's 223,821 and 71).
pool_pin() {
  { [ -n "$POOL_OF" ] && command -v nvidia-smi >/dev/null; } || return 0
  local here
  here=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  # the planner's own NVML-name matcher: the card key hardware/gpus.toml knows this GPU by, if any
  [ "$("$PY" -c 'import sys; from rig.capacity import cards; c = cards.match(sys.argv[1]); print(c.key if c else "")' \
       "$here")" = "$POOL_OF" ] && return 0
  plan_read 'd["budget"]["kv_mem_exact"]' --gpu "$POOL_OF" "$@"
}

# plan_read EXPR PLAN-ARGS...: EXPR of `inv plan PLAN-ARGS --json` (as d), also for a plan it refuses.
plan_read() {
  local expr=$1; shift
  inv plan "$@" --json 2>/dev/null | "$PY" -c "import json, sys; d = json.load(sys.stdin); print($expr)"
}

# MAX_SEQS=fit in a rung: the seats this plan's pool has room for, at most the profile's MAX_SEQS. The planner
# refuses MAX_SEQS=64 where the state of 64 seats does not fit (float32 state on the 3090's pool: 36 seats,
# 2026-12-05); the reference ran that rung with its engine capping the running requests (37 of 64).
fit_seats() { plan_read 'min(d["budget"]["short_seats"], d["knobs"]["MAX_SEQS"])' "$@"; }

# One configuration of the real shape: plan, serve, wait for ready, verify (VERIFY=1), bench, stop.
# Its files land in $OUT/$1/; the rest of the arguments are KNOB=value sets on top of the base ones.
serve_cell() {
  local name=$1; shift
  local d="$OUT/$name" a s sets=() ovl=() pid t0 log
  a=$(arch); mkdir -p "$d"; log="$d/serve.log"
  local dabs; dabs=$(cd "$d" && pwd); touch "$dabs/.start"  # this cell's files are the ones newer than this
  [ -n "$FIXTURE" ] && sets+=(--set MODEL="$FIXTURE" --set SERVED_NAME="${SERVED:-fixture-${FIXTURE#fixture:}}")
  local fit=0 overlays=$REAL_OVERLAYS protocol=$PROTOCOL
  for s in GPU_ARCH="$a" $REAL_SETS "$@"; do
    case $s in
      MAX_SEQS=fit) fit=1 ;;
      OVERLAYS=*) overlays=${s#OVERLAYS=}; overlays=${overlays//,/ } ;;  # this rung's overlays, comma-separated
      PROTOCOL=*) protocol=${s#PROTOCOL=} ;;                             # this rung's bench protocol
      POOL_OF=*) local POOL_OF=${s#POOL_OF=} ;;  # empty: vLLM profiles memory (its log: the activation peak)
      *) sets+=(--set "$s") ;;
    esac
  done
  for s in $overlays; do ovl+=(--overlay "$s"); done
  local kv; kv=$(pool_pin --profile "$PROFILE" "${ovl[@]}" "${sets[@]}")
  [ -n "$kv" ] && sets+=(--set KV_MEM="$kv") && echo "$name: KV_MEM=$kv, the $POOL_OF plan's pool" | tee "$d/pool-of.txt"
  if [ $fit = 1 ]; then
    local n; n=$(fit_seats --profile "$PROFILE" "${ovl[@]}" "${sets[@]}")
    [ -n "$n" ] || { stamp "cell $name: MAX_SEQS=fit: no plan to read the seats from"; return 1; }
    sets+=(--set MAX_SEQS="$n") && echo "$name: MAX_SEQS=$n, the seats the plan has room for" | tee "$d/seats-fit.txt"
  fi
  stamp "cell $name: $FIXTURE on $a, overlays: $overlays, protocol: $protocol, sets: $REAL_SETS $*"
  inv plan --profile "$PROFILE" "${ovl[@]}" "${sets[@]}" > "$d/plan.txt" 2>&1 || { stamp "cell $name: plan refused"; tail -5 "$d/plan.txt"; return 1; }
  inv plan --profile "$PROFILE" "${ovl[@]}" "${sets[@]}" --json > "$d/plan.json" 2>/dev/null
  t0=$SECONDS
  # python itself in the background, not the `inv` function: $! must be the process that stops the server
  "$PY" -u -m invoke serve --profile "$PROFILE" "${ovl[@]}" "${sets[@]}" > "$log" 2>&1 &
  pid=$!
  until grep -q -E "rig: ready|serving at|Ctrl-C" "$log" 2>/dev/null; do
    kill -0 $pid 2>/dev/null || { stamp "cell $name: serve exited"; tail -40 "$log"; return 1; }
    sleep 2
  done
  echo "$name: ready after $((SECONDS - t0)) s (serve's own timing is in serve.log)" | tee "$d/ready.txt"
  [ "${VERIFY:-1}" = 1 ] && inv verify --running --report-dir "$d" > "$d/verify.txt" 2>&1
  [ -f "$d/verify.txt" ] && tail -25 "$d/verify.txt"
  inv bench --running --protocol "$protocol" --no-progress > "$d/bench.log" 2>&1
  tail -12 "$d/bench.log"
  kill -TERM $pid; wait $pid  # SIGINT is ignored by a background job of a non-interactive shell
  stamp "cell $name: stopped ($(tail -1 "$log"))"
  # this cell's results and logs only: earlier rungs' files are already in their own folders
  (cd "${RIG_STATE_DIR:-.rig}" && find results logs -type f -newer "$dabs/.start" -print0 2>/dev/null \
     | xargs -0r cp --parents -t "$dabs")
  gpu_idle
  stamp "cell $name: done"
}

# The next server sizes its pool from free memory: wait until the last one's memory is back.
gpu_idle() {
  command -v nvidia-smi >/dev/null || return 0
  local i used
  for i in $(seq 60); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    [ "${used:-0}" -lt 2048 ] && return 0
    [ "$i" = 30 ] && pkill -TERM -f "vllm serve|vllm.entrypoints" 2>/dev/null
    sleep 2
  done
  stamp "GPU memory still in use: ${used} MiB"
}

step_real() {
  inv patch.apply 2>&1 | tail -2  # serve refuses an unpatched vLLM
  serve_cell real
  keep_triton_cache
}

# The configuration ladder: LADDER is "name:KNOB=v KNOB=v;name:..."; VERIFY runs with the first only.
step_ladder() {
  local rung first=1
  inv patch.apply 2>&1 | tail -2
  IFS=';' read -ra rungs <<< "$LADDER"
  for rung in "${rungs[@]}"; do
    if [ -n "${DEADLINE:-}" ] && [ $(( DEADLINE - $(date +%s) )) -lt "${RUNG_S:-300}" ]; then
      stamp "ladder: $(( DEADLINE - $(date +%s) )) s to DEADLINE, a rung takes ~${RUNG_S:-300} s: stopping before ${rung%%:*}"
      break
    fi
    # shellcheck disable=SC2086
    VERIFY=$first serve_cell "${rung%%:*}" ${rung#*:}
    first=0
    [ -n "${PACK:-}" ] && step_pack
  done
  stamp "ladder done"
}

BG=()
step_wait() { stamp "wait for ${#BG[@]} background step(s)"; for p in "${BG[@]}"; do wait "$p"; done; BG=(); }

# A channel that brings back a few files only: `pack` tars OUT (less the Triton cache) into PACK.
step_pack() { [ -n "${PACK:-}" ] && tar --exclude=triton-cache.tgz -czf "$PACK" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }

for step in "$@"; do
  case $step in
    *"&") "step_${step%&}" > "$OUT/${step%&}.bg.log" 2>&1 & BG+=($!) ;;
    *) "step_$step" ;;
  esac
done
