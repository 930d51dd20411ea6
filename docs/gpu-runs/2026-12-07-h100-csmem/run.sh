#!/usr/bin/env bash
# One GPU call (issue 14): v5 / v6 / csmem sweeps (in parts: a killed sweep prints nothing), rcp vs 5e279cc on
# config 35, decode checks, ncu of 97 and 91. BUDGET: seconds this call may use.
set -uo pipefail
O=$OUT/s; mkdir -p $O
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s); left() { echo $(( ${BUDGET:-540} - ($(date +%s) - T0) )); }
CARRY=.rig/carry-host OUT=$O bash bench/scripts/gpu_session.sh install 2>&1 | tail -3
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $O/gpu.csv
sweep() { echo "== sweep $1 $(date -u +%T), $(left) s left"; [ "$(left)" -gt 30 ] || return 0
  timeout $(left) python3 -u bench/scripts/kvarn_decode_sweep.py --graph --only $1 --lengths 8192,32768 > $O/sweep-$2.txt 2>&1; grep "^|\|best\|tokens:" $O/sweep-$2.txt | tail -14; }
sweep 35,97,91 a
echo "== rcp: old (5e279cc) config 35 $(date -u +%T)"
(cd .rig/call/old5e && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 bench/scripts/kvarn_decode_sweep.py --graph --only 35 --lengths 8192,32768 > $O/old5e-35.txt 2>&1); grep "^|" $O/old5e-35.txt | tail -3
sweep 98,99,100,101,102,35 b
sweep 92,93,94,95,96,79,83 c
echo "== pytest $(date -u +%T), $(left) s left"
[ "$(left)" -gt 40 ] && timeout $(left) python3 -m pytest -q -m gpu tests/test_kvarn_kernels.py -k "(decode and (v5 or v6 or match_v1)) or long_context_gpu or resident or default_decode" -rA -p no:cacheprovider > $O/pytest.txt 2>&1; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $O/pytest.txt | tail -40
echo "== ncu $(date -u +%T), $(left) s left"
[ "$(left)" -gt 70 ] && NCU_ONLY="97 91" OUT=$O timeout $(left) bash bench/scripts/gpu_session.sh ncu 2>&1 | tail -30
echo "== done $(date -u +%T)"
