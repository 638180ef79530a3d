"""A model call's inputs on the device: int32 input rows carved from one array with a host mirror, written in one
pitched copy (`InputRows`), for decode / prefill steps (`StepInputs`) and DFlash drafter steps (`DFlashInputs`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ninfer.backends.cuda.device import Device
from ninfer.engine.sampler import Purpose, SamplingParams, effective_top_k
from ninfer.kernels_numba.sampling import SAMPLE_FIELDS, sample_parameters


class InputRows:
    """Named int32 input rows carved from one device array [names, rows] (each row a contiguous view), with a host
    mirror, so that a call's inputs go down in one pitched copy (`Device.write_rows`) instead of a write each: a
    write with its event took ~10 us of host time, and an MTP round at one lane wrote 12 input rows (two fills)
    while the GPU waited for them. `fill` copies rows 0 .. the last one given, columns 0 .. the longest value given:
    rows in that range it was not given go down again as the mirror holds them, so no kernel may write a row
    before a name listed after it unless every fill gives that row (`StepInputs` puts `next_ids`, which the draft
    chain writes on the device, last)."""

    def __init__(self, device: Device, names: tuple[str, ...], rows: int) -> None:
        self._device = device
        self._rows = {name: i for i, name in enumerate(names)}
        self.block = device.zeros((len(names), rows), np.int32, "inputs")
        self._mirror = np.zeros((len(names), rows), np.int32)

    def row(self, name: str) -> Any:
        return self.block[self._rows[name]]

    def fill(self, values: dict[str, Any]) -> None:
        """Each named row's first len(value) entries (a 2D value: its rows from the named row on); names given None
        or empty values keep their contents. (Per call on the decode path: kept to plain slice assignments.)"""
        last, width, mirror, capacity = -1, 0, self._mirror, self._mirror.shape[1]
        for name, value in values.items():
            if value is None or not len(value):
                continue
            first = self._rows[name]
            value = value if isinstance(value, np.ndarray) else np.asarray(value)
            count, columns = value.shape if value.ndim == 2 else (1, value.shape[0])
            if columns > capacity:
                raise ValueError(f"{columns} values of {name} exceed the {capacity} this model was sized for")
            mirror[first:first + count, :columns] = value
            if first + count - 1 > last:
                last = first + count - 1
            if columns > width:
                width = columns
        if last >= 0:
            self._device.write_rows(self.block[:last + 1, :width], mirror[:last + 1, :width])


class StepInputs:
    """Fixed device buffers a call reads its per-row and per-segment inputs from (filled before a replay)."""

    # positions are three rows (MRoPE's sections); then the sampled rows' penalties and draw parameters (fp32 as
    # bits: `sampling.sample_parameters`), which only sampling calls write; next_ids last (see InputRows)
    ROWS = ("token_ids", "row_lane", "row_pos", "positions", "positions 1", "positions 2", "seg_lane", "seg_row",
            "seg_count", "seg_record", "hidden_rows", "presence", "frequency", *SAMPLE_FIELDS, "next_ids")

    def __init__(self, device: Device, rows: int, lanes: int, pages: int) -> None:
        self._device = device
        self._inputs = InputRows(device, self.ROWS, rows)
        row = self._inputs.row
        self.token_ids, self.row_lane, self.row_pos = row("token_ids"), row("row_lane"), row("row_pos")
        self.positions = self._inputs.block[3:6]  # [3, rows]
        self.seg_lane, self.seg_row = row("seg_lane"), row("seg_row")
        self.seg_count, self.seg_record = row("seg_count"), row("seg_record")
        self.hidden_rows = row("hidden_rows")  # MTP: each row's target hidden row (`CudaQwen.gather_mtp_hidden`)
        self.next_ids = row("next_ids")  # MTP: the token after each row's token
        # the sampled rows' penalties (`CudaQwen.candidates`) and the draw's parameters (`CudaQwen.sample`)
        self.presence, self.frequency = row("presence").view(np.float32), row("frequency").view(np.float32)
        first = self.ROWS.index(SAMPLE_FIELDS[0])
        self.sampling = self._inputs.block[first:first + len(SAMPLE_FIELDS)]  # [SAMPLE_FIELDS, rows]
        self.page_tables = device.zeros((lanes, pages), np.int32, "inputs")
        self.host_page_tables = np.zeros((lanes, pages), np.int32)

    def fill(self, *, token_ids: Any, positions: np.ndarray, row_lane: Any, row_pos: Any, seg_lane: Any,
             seg_row: Any, seg_count: Any, seg_record: Any, next_ids: Any = None, hidden_rows: Any = None,
             sampling: "SampledRows | None" = None) -> None:
        """Per-row inputs (rows = len(token_ids)) and per-segment inputs (segments = len(seg_lane)), in one copy;
        with `sampling`, the rows' penalties and draw parameters too."""
        if len(token_ids) > len(self.token_ids):
            raise ValueError(f"{len(token_ids)} rows exceed the {len(self.token_ids)} this model was sized for")
        rows = len(token_ids)
        self._inputs.fill({"token_ids": token_ids, "row_lane": row_lane, "row_pos": row_pos,
                           "positions": np.asarray(positions)[:, :rows] if rows else None, "seg_lane": seg_lane,
                           "seg_row": seg_row, "seg_count": seg_count, "seg_record": seg_record,
                           "hidden_rows": hidden_rows, "next_ids": next_ids,
                           **(sampling.rows() if sampling is not None else {})})

    def fill_sampling(self, row_lane: Any, sampling: "SampledRows") -> None:
        """The rows' lanes, penalties and draw parameters alone (a prefill's last row, sampled after its chunk)."""
        self._inputs.fill({"row_lane": row_lane, **sampling.rows()})

    def set_page_table(self, lane: int, table: np.ndarray) -> None:
        pages = self.host_page_tables.shape[1]
        if len(table) > pages:
            raise ValueError(f"lane {lane}: {len(table)} pages exceed the {pages} a lane can address")
        row = np.zeros(pages, np.int32)
        row[: len(table)] = table
        self.host_page_tables[lane] = row
        self._device.write(self.page_tables[lane], row)


class SampledRows:
    """The per-row sampling inputs of one call, rows not sampled left at zero (no penalty, not drawn): `draw` a row
    on the device with a request's parameters, `penalize` a row whose candidates the host samples."""

    def __init__(self, rows: int) -> None:
        self.presence, self.frequency = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
        self.fields = np.zeros((len(SAMPLE_FIELDS), rows), np.int32)

    def draw(self, row: int, params: SamplingParams, position: int, purpose: Purpose) -> None:
        """The row draws on the device (`sampling.sample_candidates`) at `position` for `purpose`, counted for its
        lane's penalties when they are on."""
        self.penalize(row, params.presence_penalty, params.frequency_penalty)
        fields = sample_parameters(temperature=params.temperature, top_k=effective_top_k(params.top_k),
                                   top_p=params.top_p, min_p=params.min_p, seed=params.seed, position=position,
                                   purpose=purpose, counted=params.penalties_active)
        self.fields[:, row] = [fields[name] for name in SAMPLE_FIELDS]

    def penalize(self, row: int, presence: float, frequency: float) -> None:
        """A row whose candidates the host reads (a sampled verify row): its penalties, no draw."""
        self.presence[row], self.frequency[row] = presence, frequency

    def rows(self) -> dict[str, np.ndarray]:
        return {"presence": self.presence.view(np.int32), "frequency": self.frequency.view(np.int32),
                **dict(zip(SAMPLE_FIELDS, self.fields))}


class DFlashInputs:
    """Fixed device buffers of a drafter call's rows: block rows first (proposal blocks of k+1 rows), then context
    rows (committed positions to project into the caches)."""

    def __init__(self, device: Device, rows: int) -> None:
        self._inputs = InputRows(device, ("ids", "positions", "row_lane", "ring_slot", "context_source"), rows)
        row = self._inputs.row
        self.ids = row("ids")  # block rows: anchor, then the mask id
        self.positions = row("positions")  # RoPE and window position; -1: a padding row
        self.row_lane = row("row_lane")
        self.ring_slot = row("ring_slot")  # context rows: ring slot, -1 when superseded
        self.context_source = row("context_source")  # context row r: its pending row (lane-major)

    def fill(self, *, ids: Any, positions: Any, row_lane: Any, ring_slot: Any, context_source: Any) -> None:
        if len(positions) > len(self.positions):
            raise ValueError(f"{len(positions)} drafter rows exceed the {len(self.positions)} this model was sized for")
        self._inputs.fill({"ids": ids, "positions": positions, "row_lane": row_lane, "ring_slot": ring_slot,
                           "context_source": context_source})
