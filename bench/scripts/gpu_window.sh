#!/usr/bin/env bash
# A GPU window reached through a channel of bounded size, one device call at a time (docs/gpu.md,
# "The real shape served"). Each call runs in the checkout; /tmp survives between calls.
#
#   bash bench/scripts/gpu_window.sh piece              carried .rig/carry/* moved to CARRY (one call per
#                                                       piece of bench/scripts/gpu_carry.py's output)
#   bash bench/scripts/gpu_window.sh daemon STEP ...    bench/scripts/gpu_session.sh STEPs in a daemon that
#                                                       outlives the call (setsid), OUT packed after each rung
#   bash bench/scripts/gpu_window.sh poll SECONDS       wait until the daemon is done or SECONDS passed, then
#                                                       copy its log and a pack of its files to $OUT
#   bash bench/scripts/gpu_window.sh caches-out N       after the daemon: the serves' compile caches (vLLM's
#                                                       torch.compile, inductor, Triton and its autotuning) as
#                                                       16 MiB pieces, the Nth 7 of them (from 0) and their
#                                                       caches.sha256 to $OUT; put them in .rig/carry and the
#                                                       next window's `install` unpacks them: a warm start
#
# The fixture goes to /dev/shm when it has room (RIG_MODELS_DIR), which the daemon and later calls share.
set -u
CARRY=${CARRY:-/tmp/c}
GS=${GS:-/tmp/gs}              # gpu_session.sh's OUT: survives between calls
LOG=${LOG:-/tmp/gs-daemon.log}
OUT=${OUT:-.rig/gpu-window}    # the device call's own folder: what comes back
mkdir -p "$CARRY" "$GS" "$OUT"
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
models_env() {
  local free
  [ -f /tmp/models.env ] || {
    free=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
    if [ "${free:-0}" -ge 40 ]; then echo "export RIG_MODELS_DIR=/dev/shm/models" > /tmp/models.env; else : > /tmp/models.env; fi
  }
  . /tmp/models.env
}

case ${1:-} in
piece)
  compgen -G ".rig/carry/*" >/dev/null && mv -f .rig/carry/* "$CARRY"/
  echo "pieces in $CARRY: $(find "$CARRY" -name 'wheels.tar.*' | wc -l)" ;;
daemon)
  shift
  [ $# -gt 0 ] || { echo "gpu_window.sh daemon: name gpu_session.sh steps (e.g. install fixture ladder)" >&2; exit 2; }
  models_env
  stamp "daemon: gpu_session.sh $* (models: ${RIG_MODELS_DIR:-.rig/models}, files: $GS)"
  CARRY=$CARRY OUT=$GS PACK=${PACK:-/tmp/gs.tgz} setsid nohup bash bench/scripts/gpu_session.sh "$@" > "$LOG" 2>&1 < /dev/null &
  echo "daemon pid $!" ;;
poll)
  t=${2:-540}
  while [ "$SECONDS" -lt "$t" ] && pgrep -f "bench/scripts/gpu_session.sh" >/dev/null; do sleep 5; done
  pgrep -f "bench/scripts/gpu_session.sh" >/dev/null && stamp "daemon still running" || stamp "daemon done"
  tail -40 "$LOG"
  cp "$LOG" "$OUT/"
  tar --exclude=triton-cache.tgz -czf "$OUT/gs-now.tgz" -C "$(dirname "$GS")" "$(basename "$GS")" ;;
caches-out)
  i=${2:-0}; d=${CACHES_OUT:-/tmp/caches-out}; st=${RIG_STATE_DIR:-.rig}
  if pgrep -f "bench/scripts/gpu_session.sh" >/dev/null; then echo "gpu_window.sh caches-out: the daemon still runs: poll first" >&2; exit 2; fi
  if [ ! -f "$d/caches.sha256" ]; then
    dirs=$(cd "$st" && ls -d cache/vllm cache/inductor cache/triton 2>/dev/null)
    [ -n "$dirs" ] || { echo "gpu_window.sh caches-out: no compile caches under $st/cache" >&2; exit 2; }
    rm -rf "$d" && mkdir -p "$d"
    # shellcheck disable=SC2086
    tar -czf - -C "$st" $dirs | split -b 16M -d -a 3 - "$d/caches.tgz."
    (cd "$d" && sha256sum caches.tgz.* > caches.sha256)
  fi
  n=$(find "$d" -name 'caches.tgz.*' | wc -l)
  stamp "caches: $n pieces of at most 16 MiB ($(du -sh "$d" | cut -f1)); call caches-out 0 .. $(( (n - 1) / 7 ))"
  find "$d" -name 'caches.tgz.*' | sort | sed -n "$((i * 7 + 1)),$((i * 7 + 7))p" | xargs -r cp -t "$OUT"
  cp "$d/caches.sha256" "$OUT/" ;;
*)
  echo "usage: gpu_window.sh piece | daemon STEP ... | poll SECONDS | caches-out N" >&2; exit 2 ;;
esac
