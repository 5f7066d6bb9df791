"""Multi-device: train steps on 8 simulated CPU devices (data parallel; data x FSDP) equal those on 1 device.

The device count must be fixed before JAX starts, and the suite runs under pytest-xdist, so the check runs in a
subprocess (`python -m lineattn.train.testing sharded`), once, in a single test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lineattn.train.testing import CACHE_DIR


def test_eight_devices_equal_one():
    # (XLA's backend optimisation and LLVM's expensive passes off, as in tests/conftest.py: compiled faster)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
           "--xla_llvm_disable_expensive_passes=true", "JAX_PLATFORMS": "cpu",
           "LINEATTN_TEST_CACHE": CACHE_DIR}
    res = subprocess.run([sys.executable, "-m", "lineattn.train.testing", "sharded"], capture_output=True,
                         text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["devices"] == 8
    for mesh in ("data", "fsdp"):   # data=8; data=2 x fsdp=4
        r = report[mesh]
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5), (mesh, r)
        assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-4), (mesh, r)
        assert r["max_rel_param_diff"] < 1e-5, (mesh, r)
    assert report["data"]["param_specs"] == ["P()"]                        # data parallel: parameters replicated
    assert any("fsdp" in s for s in report["fsdp"]["param_specs"])        # FSDP: parameters split
