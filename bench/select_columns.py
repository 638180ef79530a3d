"""Restoring lanes from their verify columns after an MTP verify, at the real 27B and 35B-A3B state shapes: a
device copy a layer a state kind a lane plus the tail row (what the runner did before d92c875) against
the runner's graph of `CudaQwen.select_staged` (one launch a state kind for all the lanes) after its one write of
the picks. Wall-clock of one round's selection, host calls included, for 1 and 8 lanes.

Run on the GPU machine: `python bench/select_columns.py`; JSON goes to `$OUT/select_columns.json`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ninfer.kernels_numba.numba_setup  # noqa: E402,F401  (the numpy shim before numba)

from ninfer.backends.cuda.device import CudaDevice  # noqa: E402
from ninfer.backends.cuda.lane_state import CHECKPOINT_SLOTS, make_gdn_states  # noqa: E402
from ninfer.backends.cuda.model import CudaQwen  # noqa: E402
from ninfer.backends.cuda.timing import wall_seconds  # noqa: E402
from ninfer.targets.registry import QWEN36_27B_DIMS, QWEN36_35B_A3B_DIMS  # noqa: E402

LANES = 8
COLUMNS = 4  # MTP k = 3


def per_layer_copies(device, states: dict, tails, hidden, picks: list[tuple[int, int]]) -> None:
    for lane, column in picks:
        for state in states.values():
            device.copy(state.conv[lane], state.conv_columns[lane, column])
            device.copy(state.ssm[lane], state.ssm_columns[lane, column])
        device.copy(tails[lane], hidden[lane, column])


def measure(name: str, dims, device) -> list[dict]:
    recurrent = [i for i, kind in enumerate(dims.layer_types) if kind != "full_attention"]
    capacity = SimpleNamespace(lanes=LANES, verify_columns=COLUMNS)
    states, bank = make_gdn_states(device, dims, capacity, CHECKPOINT_SLOTS, recurrent)
    model = SimpleNamespace(  # what CudaQwen.stage_selection and select_staged read
        device=device, k=device.kernels, gdn_bank=bank,
        tails=device.zeros((LANES, dims.hidden), np.float32, "state"),
        verify_hidden=device.zeros((LANES, COLUMNS, dims.hidden), np.float32, "state"),
        selection=device.zeros((3, LANES), np.int32, "inputs"))
    out = []
    for lanes in (1, LANES):
        picks = [(lane, COLUMNS - 2) for lane in range(lanes)]  # each rejected its last draft: states copied
        before = wall_seconds(lambda: per_layer_copies(device, states, model.tails, model.verify_hidden, picks),
                              device.synchronize, repeats=20, warmup=3)
        timed = {}
        for states_too in (True, False):  # the runner's graph of the selection (False: every draft accepted)
            columns = [p[1] if states_too else COLUMNS - 1 for p in picks]
            CudaQwen.stage_selection(model, [p[0] for p in picks], columns, [states_too] * lanes)
            graph = device.capture(lambda: CudaQwen.select_staged(model, lanes, states_too))

            def select():
                CudaQwen.stage_selection(model, [p[0] for p in picks], columns, [states_too] * lanes)
                graph.replay(device.stream_handle)

            timed[states_too] = wall_seconds(select, device.synchronize, repeats=20, warmup=3)
            graph.close()
        after, kept = timed[True], timed[False]
        moved = 2 * lanes * len(recurrent) * 4 * (dims.gdn_v_heads * dims.gdn_k_dim * dims.gdn_v_dim
                                                  + (dims.conv_kernel - 1) * dims.gdn_conv_channels)
        row = {"model": name, "lanes": lanes, "layers": len(recurrent), "per_layer_copies_ms": before * 1e3,
               "select_columns_ms": after * 1e3, "tail_only_ms": kept * 1e3, "bytes_moved": moved,
               "select_columns_tb_s": moved / after / 1e12}
        print(f"{name} {lanes} lanes: per-layer copies {before * 1e3:.3f} ms, select_columns {after * 1e3:.3f} ms "
              f"({row['select_columns_tb_s']:.2f} TB/s of {moved / 1e9:.2f} GB), tail only {kept * 1e3:.3f} ms",
              flush=True)
        out.append(row)
    return out


def main() -> None:
    device = CudaDevice(0)
    rows = []
    for name, dims in (("27b", QWEN36_27B_DIMS), ("35b", QWEN36_35B_A3B_DIMS)):
        rows += measure(name, dims, device)
    path = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "select_columns.json"
    path.write_text(json.dumps({"device": device.info.name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
