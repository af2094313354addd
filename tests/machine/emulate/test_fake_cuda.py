"""labkit.machine.emulate.fake_cuda: CI's fake CUDA machine, in a fresh interpreter (it patches torch.cuda for
the rest of the process), pinned against what CUDA's caching allocator does."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = r"""
import json, torch, labkit
from labkit.cluster import Cluster
from labkit.machine.machine import Machine
MiB = 2**20
out = {"available": torch.cuda.is_available(), "count": torch.cuda.device_count()}
c = Cluster.resolve("auto", 2)
out["kind"], out["label"], out["gpu_sized"] = c.kind, c.label, c.gpu_sized
out["machine_caps"] = Machine(c, 2).caps_reserved
small = torch.ones(1024)                     # 4 KiB: a 2 MiB segment of the small pool
mid = torch.ones(3 * MiB // 4)               # 3 MiB: a 20 MiB segment (kLargeBuffer)
out["allocated"], out["reserved"] = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
del mid
out["reserved_after_free"] = torch.cuda.memory_reserved()  # cached, not given back
torch.cuda.empty_cache()
out["reserved_after_empty"] = torch.cuda.memory_reserved()
torch.cuda.set_per_process_memory_fraction(10 * MiB / torch.cuda.get_device_properties(0).total_memory)
try:
    torch.ones(3 * MiB // 4)                 # needs a new 20 MiB segment: over the 10 MiB cap
    out["oom"] = None
except torch.OutOfMemoryError as err:
    out["oom"] = str(err)
stats = torch.cuda.memory_stats()
out["stats"] = [stats["allocated_bytes.all.current"], stats["reserved_bytes.all.current"]]
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
a.record(); b.record()
out["elapsed_ms"] = a.elapsed_time(b)
print(json.dumps(out))
"""


def _probe(env_value: str | None, labkit_env: dict[str, str]) -> dict:
    env = dict(labkit_env)
    env.pop("LABKIT_FAKE_CUDA", None)
    if env_value is not None:
        env["LABKIT_FAKE_CUDA"] = env_value
    cmd = [sys.executable, "-c", _PROBE]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_fake_cuda_machine_serves_torch_cuda_from_the_caching_allocator_model(labkit_env):
    out = _probe("2", labkit_env)
    assert out["available"] and out["count"] == 2
    assert out["kind"] == "gpu" and out["label"] == "emulated, fake CUDA" and not out["gpu_sized"]
    assert out["machine_caps"]
    # CUDA's rounding: 4 KiB in a 2 MiB small segment, 3 MiB in a fresh 20 MiB segment
    assert out["allocated"] == 4096 + 3 * 2**20 and out["reserved"] == 22 * 2**20
    assert out["reserved_after_free"] == 22 * 2**20 and out["reserved_after_empty"] == 2 * 2**20
    # a cap on reserved memory: the next 20 MiB segment does not fit, in CUDA's words (as the H200 said)
    assert out["oom"] is not None and "CUDA out of memory. Tried to allocate 20.00 MiB" in out["oom"]
    assert out["stats"][1] == 2 * 2**20 and out["elapsed_ms"] >= 0


def test_without_the_variable_torch_cuda_is_the_cpu_builds(labkit_env):
    code = "import torch, labkit; print(torch.cuda.is_available())"
    env = {k: v for k, v in labkit_env.items() if k != "LABKIT_FAKE_CUDA"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.stdout.strip() == "False"
