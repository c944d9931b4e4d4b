#!/usr/bin/env bash
# Starts, in sessions of their own so that they outlive the call on a warm machine, the llama.cpp
# build (cores 0-11) and the 48-layer file (core 12); scripts/await_builds.sh waits for their
# /tmp/llbuild.done and /tmp/model48.done. A job already running or done is left alone.
# The file is flushed to disk (sync) before it counts as done: written in ~25 s, its 18.5 GB of
# dirty pages may go on being written back under the next benches (the likely cause of the
# nineteenth session's disturbed quarter runs, benchmarks/gpu_2026-12-05-s19/COMMANDS.md).
# The build runs in a copy of .baseline under /tmp: a later call that carries .baseline replaces
# the folder, and with it a build still running there (seventeenth session).
# A build that failed is tried again with this call's .baseline (twenty-sixth session: a source
# tarball written twice at once here failed the first build and blocked the next call's).
[ -f /tmp/llbuild.done ] && [ "$(cat /tmp/llbuild.done)" != 0 ] && rm -rf /tmp/llbuild.done /tmp/llama-build
if [ ! -f /tmp/llbuild.done ] && ! pgrep -f llbase/llamacpp_gpu.sh > /dev/null; then
  gzip -t .baseline/llama.cpp-src.tgz 2> /dev/null ||
    echo "start_builds: .baseline/llama.cpp-src.tgz is damaged: run 'bash ../shared/tools/llamacpp_gpu.sh prepare' again" >&2
  rm -rf /tmp/llbase && cp -a .baseline /tmp/llbase
  setsid bash -c "taskset -c 0-11 nice -n 10 bash /tmp/llbase/llamacpp_gpu.sh build > /tmp/llbuild.log 2>&1; rc=\$?; cp -a /tmp/llbase/build /tmp/llama-build; echo \$rc > /tmp/llbuild.done" < /dev/null > /dev/null 2>&1 &
fi
if [ ! -f /tmp/model48.done ] && ! pgrep -f "model48-out model" > /dev/null; then
  setsid bash -c "taskset -c 12 nice -n 19 python3 scripts/gpu_session.py --out /tmp/model48-out model > /tmp/model48.log 2>&1; rc=\$?; sync; echo \$rc > /tmp/model48.done" < /dev/null > /dev/null 2>&1 &
fi
