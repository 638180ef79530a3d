"""bench/moe_gathered.py's measurement runs end to end on a HostDevice (the kernels' NumPy twins) at a tiny shape,
so the GPU run spends its device minutes on measuring."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.artifact.formats import Q4G64, W8G32


@pytest.mark.parametrize("fmt", [Q4G64, W8G32])
@pytest.mark.parametrize("x_per_slot", [False, True])
def test_the_gathered_measurement_runs_on_the_host_device(fmt, x_per_slot):
    from bench.moe_gathered import measure
    from ninfer.backends.cuda.host import HostDevice

    rows = measure(HostDevice(), 1e12, fmt, "tiny", 16, 128, x_per_slot, np.random.default_rng(0), experts=6,
                   slots=3, batches=(1, 4))
    assert [row["rows"] for row in rows] == [1, 4]
    for row in rows:
        assert 1 <= row["distinct_experts"] <= 3 * row["rows"]
        assert row["simt_us"] > 0 and row["mma_us"] > 0 and row["x_fragments_us"] > 0
        assert row["simt_rel_to_twin"] < 1e-6 and row["mma_rel_to_twin"] < 1e-6
