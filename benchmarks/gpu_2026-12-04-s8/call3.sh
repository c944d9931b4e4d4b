python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/bloomery; S="python3 scripts/gpu_session.py --out $OUT"
(taskset -c 0 $S model > $OUT/model48.log 2>&1; echo "model at ${SECONDS}s" >> $OUT/model48.log) &
python3 -c "import numba; numba.get_num_threads(); print('numba', numba.__version__, numba.threading_layer())"
bb() { m=$1 t=$2; shift 2; BLOOMERY_FFI_HOST_THREAD=$m BLOOMERY_FFI_DEBUG=1 taskset -c 1-15 timeout 120 python3 scripts/bridge_bench.py --work 64 --layers 36 --reps 10 --threads $t --json $OUT/bb-$m-t$t.json "$@" > /tmp/bb.log 2>&1; echo "$m t$t rc $? at ${SECONDS}s: $(grep 'host thread' /tmp/bb.log | sort -u | tr '\n' ' ')"; python3 -c "import json;d=json.load(open('$OUT/bb-$m-t$t.json'));print(' kernel_ms', round(d['kernel_ms'],2), {k:(round(v['step_ms'],2),round(v['overhead_per_call_us'])) for k,v in d['bridges'].items()})" 2>&1 | tail -1; }
bb own 15 --bridges callback,ffi
bb driver 15 --bridges ffi
bb driver-affinity 15 --bridges ffi
bb driver 1 --bridges ffi
bb own 8 --bridges ffi
best=$(python3 -c "
import json
r={m:json.load(open('$OUT/bb-%s-t15.json'%m))['bridges']['ffi']['step_ms'] for m in ('own','driver','driver-affinity')}
print(min(r,key=r.get))")
echo "best mode $best at ${SECONDS}s"; wait; tail -1 $OUT/model48.log
BLOOMERY_FFI_HOST_THREAD=$best $S bench --only ncmoe36 --parallel 1 --kernels pallas --bridge ffi --variant-timeout $((585 - SECONDS)) 2>&1 | grep -o '"test": "[a-z0-9]*", "parallel": 1, "depth": 0, "n_tokens": [0-9]*, "tps_median": [0-9.]*\|"compile_s": [0-9.]*\|rc": [a-z0-9"]*\|host_kernel_s": [0-9.]*'
echo "end ${SECONDS}s"
