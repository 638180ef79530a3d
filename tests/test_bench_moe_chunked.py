"""bench/moe_chunked.py's measurement runs end to end on a HostDevice (the kernels' NumPy twins) at a small shape,
so the GPU run spends its device minutes on measuring."""

from __future__ import annotations

import numpy as np


def test_the_chunked_expert_measurement_runs_on_the_host_device():
    from bench.moe_chunked import measure
    from ninfer.backends.cuda.host import HostDevice

    rows = measure(HostDevice(), np.random.default_rng(0), cases=[(24, 32, True), (48, 64, False)], experts=6,
                   slots=2, hidden=128, inter=64)
    assert [(row["rows"], row["chunk"], row["sync_free"]) for row in rows] == [(24, 32, True), (48, 64, False)]
    for row in rows:
        assert set(row["ms"]) == {"direct", "dequantizing", "dequantize_only", "gemms_only"}
        assert row["real_chunks"] <= row["chunks"]
        # the direct path rounds the activation once from fp32, the dequantizing one from bf16 gate and up
        assert 0 < row["relative_difference"] < 2e-2
