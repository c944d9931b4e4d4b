"""scripts/hlo_launches.py counts the entry computation's thunks of an optimized HLO dump."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "hlo_launches", Path(__file__).resolve().parent.parent / "scripts" / "hlo_launches.py")
hlo_launches = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hlo_launches)

GPU_LIKE = '''HloModule jit__decode, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%command_buffer (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %fusion.1 = f32[4]{0} fusion(f32[4]{0} %p), kind=kLoop, calls=%fused_computation
}

ENTRY %main.9 (Arg_0.1: f32[4]) -> f32[4] {
  %Arg_0.1 = f32[4]{0} parameter(0)
  %constant.2 = s32[] constant(0)
  %call.3 = f32[4]{0} call(f32[4]{0} %Arg_0.1), to_apply=%command_buffer
  %custom-call.4 = f32[4]{0} custom-call(f32[4]{0} %call.3), custom_call_target="__gpu$xla.gpu.triton", api_version=API_VERSION_TYPED_FFI
  %bitcast.5 = f32[2,2]{1,0} bitcast(f32[4]{0} %custom-call.4)
  %fusion.6 = f32[2,2]{1,0} fusion(f32[2,2]{1,0} %bitcast.5), kind=kInput, calls=%fused_reduce
  %copy.7 = f32[2,2]{0,1} copy(f32[2,2]{1,0} %fusion.6)
  %tuple.8 = (f32[2,2]{0,1}) tuple(f32[2,2]{0,1} %copy.7)
  ROOT %get-tuple-element.9 = f32[4]{0} get-tuple-element((f32[2,2]{0,1}) %tuple.8), index=0
}
'''


def test_counts_entry_thunks_only():
    got = hlo_launches.count_launches(GPU_LIKE)
    # the fusion inside the command buffer is not an entry launch; no-ops are not counted
    assert got["by_opcode"] == {"call (command buffer)": 1, "custom-call": 1, "fusion": 1, "copy": 1}
    assert got["launches"] == 4
    assert got["custom_calls"] == {"__gpu$xla.gpu.triton": 1}
