"""The CUDA backend's per-call inputs (`InputRows`, `StepInputs`): a call's input rows go down in one pitched copy,
rows not given keep what the device holds, and a decode round writes each fill once."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from ninfer.backends.cuda.host import HostDevice
from ninfer.backends.cuda.inputs import InputRows, StepInputs


class CountingDevice(HostDevice):
    """A HostDevice that counts its host-to-device writes by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()
        self.pitched: list[tuple[int, int]] = []

    def write(self, destination, host, *, stream_handle=None) -> None:
        self.calls["write"] += 1
        super().write(destination, host, stream_handle=stream_handle)

    def write_rows(self, destination, host) -> None:
        self.calls["write_rows"] += 1
        self.pitched.append(tuple(destination.shape))
        super().write_rows(destination, host)


def test_a_fill_is_one_pitched_copy_of_the_rows_up_to_the_last_given():
    device = CountingDevice()
    rows = InputRows(device, ("a", "b", "c"), 8)
    rows.fill({"a": [1, 2, 3], "b": [4]})
    assert device.calls == {"write_rows": 1} and device.pitched == [(2, 3)]
    assert rows.block.tolist() == [[1, 2, 3, 0, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0, 0, 0], [0] * 8]
    rows.block[2, :2] = [9, 9]  # a kernel's write to the last row, which this fill does not name
    rows.block[1, 5] = 7  # ... and past the columns it copies
    rows.fill({"a": [5, 6], "b": None, "c": []})
    assert device.pitched[-1] == (1, 2)
    assert rows.block.tolist() == [[5, 6, 3, 0, 0, 0, 0, 0], [4, 0, 0, 0, 0, 7, 0, 0], [9, 9, 0, 0, 0, 0, 0, 0]]
    rows.fill({})
    assert device.calls["write_rows"] == 2  # nothing given, nothing copied
    with pytest.raises(ValueError, match="9 values of b exceed the 8"):
        rows.fill({"b": np.arange(9)})


def test_step_inputs_keep_the_device_written_next_ids_when_a_fill_gives_none():
    """The MTP draft chain writes next_ids on the device; a decode fill (no next_ids) must not put the host's old
    ones back, and positions are three rows of [3, rows]."""
    device = CountingDevice()
    inputs = StepInputs(device, rows=6, lanes=2, pages=4)
    inputs.fill(token_ids=[7, 8], positions=np.array([[0, 1], [2, 3], [4, 5]]), row_lane=[0, 0], row_pos=[0, 1],
                seg_lane=[0], seg_row=[0], seg_count=[2], seg_record=[0], next_ids=[8, 9])
    inputs.next_ids[:2] = [11, 12]
    inputs.fill(token_ids=[3], positions=np.array([[5], [6], [7]]), row_lane=[1], row_pos=[4], seg_lane=[1],
                seg_row=[0], seg_count=[1], seg_record=[0])
    # every row to next_ids (the last), then the rows to seg_record (the last a decode fill gives)
    assert device.calls == {"write_rows": 2} and device.pitched == [(len(StepInputs.ROWS), 2), (10, 1)]
    assert inputs.next_ids[:2].tolist() == [11, 12] and inputs.token_ids[:2].tolist() == [3, 8]
    assert inputs.positions[:, :2].tolist() == [[5, 1], [6, 3], [7, 5]]
    assert inputs.positions.shape == (3, 6) and inputs.positions.flags.c_contiguous
    assert inputs.sampling.shape == (8, 6) and inputs.sampling.flags.c_contiguous
    with pytest.raises(ValueError, match="7 rows exceed the 6"):
        inputs.fill(token_ids=np.zeros(7), positions=np.zeros((3, 7)), row_lane=np.zeros(7), row_pos=np.zeros(7),
                    seg_lane=[0], seg_row=[0], seg_count=[7], seg_record=[0])


def test_an_mtp_round_at_one_lane_writes_each_fill_once(tmp_path):
    """A greedy k = 3 round at one lane: the verify's inputs, the MTP rows' inputs and the draft chain's inputs
    one pitched copy each, and the selection's write: 4 host copies where there were 18 and an eager gather launch
    (each ~10 us of host time on the GPU machine, while the GPU waited)."""
    from tests.support.cuda_models import write_tiny_qwen_artifact
    from tests.test_cuda_runner import GREEDY, Lane, cuda_build, decode_round, prompt

    path = write_tiny_qwen_artifact(tmp_path / "dense.ninfer", moe=False, recipe="bf16")
    build = cuda_build("host", path, lanes=1, draft_tokens=3)
    device = build.model.device
    calls = collections.Counter()
    for name in ("write", "write_rows"):
        original = getattr(device, name)
        setattr(device, name, lambda *a, _name=name, _original=original, **k: (calls.update([_name]),
                                                                             _original(*a, **k)))
    lane = Lane(build.runner, 0, prompt(3, 30), sampling=GREEDY, budget=40)
    lane.prefill(1000)
    decode_round(build.runner, [lane])
    calls.clear()
    decode_round(build.runner, [lane])
    assert calls == {"write_rows": 3, "write": 1}, calls


def test_the_mtp_rows_of_a_prefill_chunk_are_gathered_on_the_device(tmp_path):
    """With MTP on, a prefill chunk's MTP rows read the lane's tail and then the chunk's own output rows: one gather
    launch on the device names them (`inputs.hidden_rows`: -1 - lane for a tail), where the host made a device copy
    a row (1024 a chunk at the server's default). The only host copies into the MTP head's input rows left are the
    draft chain's (its MTP steps' outputs, inside its graph)."""
    from ninfer.backends.cuda import host_kernels
    from tests.support.cuda_models import write_tiny_qwen_artifact
    from tests.test_cuda_runner import GREEDY, Lane, cuda_build, prompt

    path = write_tiny_qwen_artifact(tmp_path / "dense.ninfer", moe=False, recipe="bf16")
    build = cuda_build("host", path, lanes=1, draft_tokens=3, prefill_chunk=128)
    model, copies, gathers = build.model, [], []
    original_copy, original_gather = model.device.copy, host_kernels.gather_two_sources

    def copy(destination, source) -> None:
        if np.shares_memory(destination, model.mtp_hidden) and any(
                np.shares_memory(source, rows) for rows in (model.tails, model.workspace.final)):
            copies.append(destination.shape[0])
        original_copy(destination, source)

    def gather(first, second, index, out, *, stream) -> None:
        gathers.append(list(index))
        original_gather(first, second, index, out, stream=stream)

    model.device.copy = copy
    host_kernels.gather_two_sources = gather
    try:
        Lane(build.runner, 0, prompt(3, 200), sampling=GREEDY, budget=8).prefill(128)  # chunks of 128 and 72 rows
    finally:
        host_kernels.gather_two_sources = original_gather
    # the first chunk: its rows 0..126 (its last row has no next token yet); the second: lane 0's tail, then 72 rows
    assert gathers == [list(range(127)), [-1] + list(range(72))], gathers
    assert copies == [1, 1], copies  # the draft chain's two MTP steps


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_decode_step_keeps_its_lanes_rows_inside_its_graph(tmp_path, sampled):
    """A plain decode step at eight lanes: one pitched copy of its inputs, the graph, one read of the tokens; each
    lane's tail (and, in MTP rounds, its verify columns) is kept by the step's own graph (`keep_segment_rows`), where
    the host made a device copy a lane after the read. Sampled lanes (penalties on) cost no more: their penalties
    and draw parameters go down with the inputs, the draw and the count run in the graph, where the host wrote the
    penalties twice, read the candidates twice and wrote the counts three times."""
    from ninfer.backends.cuda import host as host_module
    from tests.support.cuda_models import write_tiny_qwen_artifact
    from tests.test_cuda_runner import GREEDY, SAMPLED, Lane, cuda_build, decode_round, prompt

    path = write_tiny_qwen_artifact(tmp_path / "dense.ninfer", moe=False, recipe="bf16")
    build = cuda_build("host", path, lanes=8)
    device, calls, replaying = build.model.device, collections.Counter(), []
    for name in ("write", "write_rows", "copy", "read"):
        original = getattr(device, name)
        setattr(device, name, lambda *a, _name=name, _original=original, **k: (
            calls.update([] if replaying else [_name]), _original(*a, **k))[1])
    lanes = [Lane(build.runner, i, prompt(3 + i, 20), sampling=SAMPLED if sampled else GREEDY, budget=8)
             for i in range(8)]
    for lane in lanes:
        lane.prefill(1000)
    decode_round(build.runner, lanes)
    replay = host_module.HostGraph.replay

    def counted_replay(graph, *args):
        replaying.append(graph)
        try:
            return replay(graph, *args)
        finally:
            replaying.pop()

    host_module.HostGraph.replay = counted_replay
    try:
        calls.clear()
        decode_round(build.runner, lanes)
    finally:
        host_module.HostGraph.replay = replay
    assert calls == {"write_rows": 1, "read": 1}, calls
