#!/usr/bin/env bash
# Waits (at most $1 seconds, default 420) for the llama.cpp build and the 48-layer file that
# scripts/start_builds.sh started in the background on this warm machine; fails if either
# failed or did not finish.
limit=${1:-420}
for ((t = 0; t < limit; t += 5)); do
  [ -f /tmp/llbuild.done ] && [ -f /tmp/model48.done ] && break
  sleep 5
done
for job in llbuild model48; do
  rc=$(cat /tmp/$job.done 2>/dev/null || echo "not finished")
  echo "$job: rc $rc after ${t}s of waiting"
  [ "$rc" = 0 ] || { tail -5 /tmp/$job.log 2>/dev/null; exit 1; }
done
# the build ran under /tmp: put it where gpu_session.py looks
[ -x .baseline/build/bin/llama-bench ] || { mkdir -p .baseline && cp -a /tmp/llama-build .baseline/build; }
