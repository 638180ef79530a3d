"""The CUDA model runner: `ninfer.engine.runner.ModelRunner` over `CudaQwen`.

Every decode-time step replays a captured CUDA graph keyed by its exact shape: a decode or verify round by (rows,
lanes) (ordinary rows are one column, speculative rows k+1; all per-row facts live in the input buffers, so any mix
with the same counts shares a graph), the MTP head over a round's produced columns by its row count, each MTP draft
step by its lane count, and a DFlash drafter call by its lane and block counts. The first call of a shape runs
eagerly (compiling the kernels) and captures the graph for the next one; ordinary decode graphs are captured at
startup. A short prefill chunk (`CudaQwen.short_prefill`: at most 64 rows, few enough keys) runs the decode path
and is captured by its row count, as is the MTP head over its columns. A full-size longer chunk replays graphs
captured at startup in pieces, its tiled prefill attention calls eager between them (`CudaQwen.capture_prefill`);
with Capacity.prefill_buckets so does a shorter one, padded to its row bucket (`CudaQwen.stage_prefill`); other
long chunks, and chunks with Vision embeddings, run eagerly. Graphs other than startup's are kept up to a
bound, least recently used freed first (`GraphCache`). The host keeps only what the engine contract needs per
lane: the page table, the sampler, the drafts, whether the last round verified and, with DFlash, how far the
drafter's context reaches; all tensors stay on the device.

DFlash rounds follow the CPU runner (`ninfer.backends.cpu.runner`): a decode call starts with one drafter call that
projects every batch lane's pending committed columns into its context (k+1 context rows a lane, those past its
pending count padding, so the shape depends on the lane count only) and proposes k tokens for each speculative lane
from its block `[anchor, MASK x k]`; the verify that follows captures the context features of its columns, and the
committed ones (the input token and the accepted drafts; fewer after a `rewind`) stay pending in the lane's pending
rows until its next call. Prefill chunks project their columns at once (eagerly, like the chunk itself), and a
checkpoint commits the pending columns before it copies the rings.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from ninfer.backends.cpu.dflash import DFlashContextError
from ninfer.backends.cuda.capacity import PAGE_TOKENS, PrefillSpan
from ninfer.backends.cuda.graph_cache import GraphCache
from ninfer.backends.cuda.inputs import SampledRows
from ninfer.backends.cuda.lane_state import CHECKPOINT_SLOTS
from ninfer.backends.cuda.model import CudaQwen
from ninfer.engine.cold_tier import ParkedArray
from ninfer.engine.runner import (DecodeBatch, DecodeResult, LaneImage, PrefillChunk, PrefillResult, RunnerInfo,
                                  SequenceStart, StateSource, VisionUnavailable)
from ninfer.engine.request import PromptMedia
from ninfer.engine.sampler import Purpose, Sampler
from ninfer.engine.speculative import verify_candidates
from ninfer.backends.cuda.vision import CudaVisionTower
from ninfer.models.qwen3_6_vision import VisionTower, encode_prompt_item


@attrs.define
class _Lane:
    pages: int = 0  # page-table entries assigned
    has_tail: bool = False
    sampler: Sampler | None = None
    drafts: np.ndarray | None = None
    verified: bool = False  # the last round was a speculative one (rewind may select another column)
    live_column: int = 0  # after a verify: the column the recurrent states hold (the verify leaves its last one)
    # DFlash: positions 0..context-1 are in the drafter's caches, the next `pending` committed columns wait in the
    # lane's pending rows; each checkpoint slot's context length (a checkpoint holds no pending columns).
    context: int = 0
    pending: int = 0
    checkpoint_context: list[int] = attrs.Factory(lambda: [0] * CHECKPOINT_SLOTS)


@attrs.frozen
class _MtpRows:
    lane: int
    first: int  # MTP KV index of the first row
    next_ids: np.ndarray
    positions: np.ndarray  # [3, n]


class CudaRunner:
    # Lane images move between device memory and the cold tier's arenas without host copies: the scheduler parks
    # `export_lane_view`s and hands `import_lane` arrays still in their arena (`engine.cold_tier.ParkedArray`).
    streams_lane_images = True

    def __init__(self, model: CudaQwen, *, draft_tokens: int = 0, lm_head_draft: bool = False,
                 cuda_graphs: bool = True, vision_tower: VisionTower | CudaVisionTower | None = None) -> None:
        """Speculative decoding (`draft_tokens` k > 0) runs the drafter the model was built for (`Capacity.spec`):
        its MTP head, or its DFlash drafter (text only: no Vision tower)."""
        cap, dims = model.capacity, model.dims
        if draft_tokens != cap.draft_tokens:
            raise ValueError(f"the model was sized for {cap.draft_tokens} draft tokens, not {draft_tokens}")
        if lm_head_draft and not cap.draft_head:
            raise ValueError("--lm-head-draft needs the model built with its shortlist head (Capacity.draft_head)")
        if cap.dflash and vision_tower is not None:
            raise ValueError("DFlash is text-only: build the runner without the Vision tower")
        self._model, self._k, self._graphs_on = model, draft_tokens, cuda_graphs
        self._mtp, self._dflash = cap.mtp, cap.dflash
        # The Vision tower: the GPU's (`CudaVisionTower`) or the host's; its output rows reach the device
        # activations as embedding overrides of the prefill chunks.
        self._vision = vision_tower
        if not model.pages:
            raise ValueError("the model's KV pool is not allocated (CudaQwen.allocate_kv)")
        self.info = RunnerInfo(lanes=cap.lanes, pages=model.pages, page_tokens=PAGE_TOKENS,
                               checkpoint_slots=CHECKPOINT_SLOTS,
                               vocab_ids=dims.vocab_ids, draft_tokens=draft_tokens,
                               kv_bytes_per_token=model.kv_bytes_per_token, vision=vision_tower is not None)
        self._lanes = [_Lane() for _ in range(cap.lanes)]
        self._graphs = GraphCache()  # step shape -> captured graph (bounded: graph_cache.py)

    # ---- state operations ----

    def assign_pages(self, lane: int, page_table: np.ndarray) -> None:
        self._model.inputs.set_page_table(lane, np.asarray(page_table, dtype=np.int32))
        self._lanes[lane].pages = len(page_table)

    def _used_pages(self, lane: int, tokens: int) -> int:
        used = -(-tokens // PAGE_TOKENS)
        if used > self._lanes[lane].pages:
            raise ValueError(f"lane {lane}: {tokens} tokens need {used} pages, it owns {self._lanes[lane].pages}")
        return used

    def export_lane(self, lane: int, tokens: int) -> LaneImage:
        used = self._used_pages(lane, tokens)
        pages = self._model.inputs.host_page_tables[lane, :used]
        return LaneImage(tokens=tokens, pages=used, has_tail=self._lanes[lane].has_tail,
                         arrays=self._model.export_lane_arrays(lane, pages) | self._context_counts(lane))

    def export_lane_view(self, lane: int, tokens: int) -> LaneImage:
        """`export_lane` without the host copy: device views, valid until the lane runs again (the scheduler parks
        them at once; see `streams_lane_images`)."""
        used = self._used_pages(lane, tokens)
        views = self._model.export_lane_views(lane, self._model.inputs.host_page_tables[lane, :used])
        return LaneImage(tokens=tokens, pages=used, has_tail=self._lanes[lane].has_tail,
                         arrays=views | self._context_counts(lane))

    def import_lane(self, lane: int, image: LaneImage) -> None:
        state = self._lanes[lane]
        if image.pages > state.pages:
            raise ValueError(f"lane {lane}: the image needs {image.pages} pages, the lane owns {state.pages}")
        self._model.import_lane_arrays(lane, self._model.inputs.host_page_tables[lane, : image.pages], image.arrays)
        imported = self._lanes[lane] = _Lane(pages=state.pages, has_tail=image.has_tail)
        if self._dflash:
            lengths, pending = (_host(image.arrays[name]) for name in ("dflash/context_lengths",
                                                                       "dflash/pending_columns"))
            imported.context, imported.pending = int(lengths[0]), int(pending[0])
            imported.checkpoint_context = [int(length) for length in lengths[1:]]

    def _context_counts(self, lane: int) -> dict[str, np.ndarray]:
        """With DFlash, the host side of the lane's drafter context for a lane image: the context length of the
        running state and of each checkpoint slot, and the pending column count."""
        if not self._dflash:
            return {}
        state = self._lanes[lane]
        return {"dflash/context_lengths": np.array([state.context, *state.checkpoint_context], np.int64),
                "dflash/pending_columns": np.array([state.pending], np.int64)}

    def begin_sequence(self, lane: int, start: SequenceStart) -> None:
        state, model = self._lanes[lane], self._model
        if start.source is StateSource.RESET:
            model.reset_lane(lane)
            state.has_tail = False
            state.context = state.pending = 0
        elif start.source is StateSource.CHECKPOINT:
            model.copy_lane_state(lane, from_slot=start.checkpoint_slot)
            state.has_tail = True
            state.context, state.pending = state.checkpoint_context[start.checkpoint_slot], 0
        state.sampler = Sampler(start.sampling, self.info.vocab_ids)
        model.device.clear(model.penalty_counts[lane])  # the device mirror of the sampler's (empty) counts
        state.drafts, state.verified = None, False

    def save_checkpoint(self, lane: int, slot: int) -> None:
        state = self._lanes[lane]
        if not state.has_tail:
            raise ValueError(f"lane {lane} has no materialized token to checkpoint")
        if state.pending:
            self._run_drafter([lane], [])
        self._model.copy_lane_state(lane, to_slot=slot)
        state.checkpoint_context[slot] = state.context

    def rewind(self, lane: int, kept: int) -> None:
        state = self._lanes[lane]
        if self._dflash and not 0 < kept <= state.pending:
            raise DFlashContextError(f"lane {lane}: the last round left {state.pending} pending columns, cannot "
                                     f"keep {kept}")
        if not state.verified:
            if kept != 1:
                raise ValueError(f"lane {lane}: an ordinary round produced one token, cannot keep {kept}")
            return
        self._select_columns([lane], [kept - 1])
        state.drafts = None
        if self._dflash:  # only the kept columns join the drafter's context
            state.pending = kept

    def release(self, lane: int) -> None:
        self._lanes[lane] = _Lane()

    # ---- model calls ----

    def encode_media(self, item: PromptMedia) -> np.ndarray:
        if self._vision is None:
            raise VisionUnavailable("this runner was built without the Vision tower (start the server with --vision)")
        return encode_prompt_item(self._vision, item, self._model.dims.hidden)

    def prefill(self, chunk: PrefillChunk) -> PrefillResult:
        model, lane = self._model, chunk.lane
        state = self._lanes[lane]
        count, start = len(chunk.token_ids), chunk.kv_length
        if count > model.capacity.prefill_rows:
            raise ValueError(f"prefill chunk of {count} tokens exceeds the runner's {model.capacity.prefill_rows}")
        if chunk.has_embeddings and self._vision is None:
            raise VisionUnavailable("a prefill chunk carries embedding overrides, but this runner has no Vision tower")
        embeddings = (chunk.embedding_columns, chunk.embedding_rows) if chunk.has_embeddings else None
        if self._dflash:
            self._start_drafter_call(lane, start)
        if count:
            # (Vision rows replace embeddings row by row: such a chunk runs unpadded)
            rows, span = model.stage_prefill(lane, start, chunk.token_ids, chunk.positions, pad=embeddings is None)
            pieces = self._graphs.get(("prefill pieces", rows)) if embeddings is None else None
            if embeddings is None and model.short_prefill(count, start):  # a graph per row count: launches cost most
                self._step(("prefill", count), lambda: model.forward(count, 1))
                final = model.workspace.final[:count]
            elif pieces is not None:
                pieces.replay(model.device.stream_handle, span)
                final = model.workspace.final[:count]
            else:
                final = model.forward(rows, 1, span, embeddings)[:count]
            # The chunk's last row becomes the tail only after the MTP bridge column has read the old tail.
            model.device.copy(self._model.last_row, final[count - 1 :])
            if self._dflash:  # the chunk's columns are committed: project their captured features now
                end = start + count
                positions = np.arange(start, end)
                model.dflash_inputs.fill(ids=[], positions=positions, row_lane=np.full(count, lane),
                                         ring_slot=self._ring_slots(positions, end), context_source=[])
                model.dflash_step(0, count, from_pending=False)
                state.context = end
        elif chunk.final and not state.has_tail:
            raise ValueError(f"lane {lane}: nothing to sample from (empty chunk without a tail)")
        token = -1
        if chunk.final:
            row = self._model.last_row if count else model.tails[lane : lane + 1]
            token = self._sample_rows(row, [lane], [start + count], Purpose.PREFILL)[0]
        drafts_ready = self._dflash and chunk.final and self._affords_a_round(chunk.remaining - 1)
        if self._mtp:
            rows = self._prefill_mtp_rows(chunk, token)
            if rows is not None:
                n = len(rows.next_ids)
                hidden_rows = [("tail", lane)] if start > 0 else []
                hidden_rows += [("final", i) for i in range(n - len(hidden_rows))]
                mtp_embeddings = chunk.mtp_embeddings() if chunk.has_embeddings else None
                self._run_mtp([rows], hidden_rows, prefill=count > 0,
                              embeddings=mtp_embeddings if mtp_embeddings and len(mtp_embeddings[0]) else None)
                if chunk.final and self._affords_a_round(chunk.remaining - 1):
                    self._prepare_drafts([(lane, n - 1, rows.first + n - 1, int(rows.positions[0, -1]))])
                    drafts_ready = True
        if count:
            model.device.copy(model.tails[lane : lane + 1], self._model.last_row)
        state.has_tail = state.has_tail or count > 0
        state.verified = False
        return PrefillResult(token=token, drafts_ready=drafts_ready)

    def decode(self, batch: DecodeBatch) -> DecodeResult:
        model, k = self._model, self._k
        size = batch.size
        lanes = [int(lane) for lane in batch.lanes]
        if self._dflash:
            for lane, kv_length in zip(lanes, batch.kv_lengths):
                self._check_context(lane, int(kv_length))
            self._run_drafter(lanes, [(lane, int(batch.input_tokens[b]), int(batch.kv_lengths[b]))
                                      for b, lane in enumerate(lanes) if batch.speculative[b]])
        columns = [1 + (k if batch.speculative[b] else 0) for b in range(size)]
        ids, row_lane, row_pos, positions, seg_row = [], [], [], [], []
        for b, lane in enumerate(lanes):
            state = self._lanes[lane]
            tokens = [int(batch.input_tokens[b])]
            if batch.speculative[b]:
                if state.drafts is None or batch.remaining[b] < k + 1:
                    raise ValueError(f"lane {lane} cannot verify: no drafts or too little output budget")
                tokens += [int(t) for t in state.drafts]
            n = len(tokens)
            seg_row.append(len(ids))
            ids += tokens
            row_lane += [lane] * n
            kv_length, position = int(batch.kv_lengths[b]), int(batch.positions[b])
            row_pos += range(kv_length, kv_length + n)
            positions += range(position, position + n)
        rows = len(ids)
        positions = np.broadcast_to(np.asarray(positions, np.int32), (3, rows))
        samplers = [self._lanes[lane].sampler for lane in lanes]
        # Ordinary sampled rows draw on the device (§4.8 whole: penalised candidates, the draw, the count), in the
        # step's graph. Speculative sampled rows get their candidates there, each column's with the round's drafts
        # before it counted (`model.candidates(segments=)`), and the host applies the accept rules over them.
        sampled = [b for b in range(size) if not samplers[b].params.is_greedy and not batch.speculative[b]]
        verified = [b for b in range(size) if not samplers[b].params.is_greedy and batch.speculative[b]]
        sampling = None
        if sampled or verified:
            sampling = SampledRows(rows)
            for b in sampled:
                sampling.draw(seg_row[b], samplers[b].params, int(batch.kv_lengths[b]), Purpose.DECODE)
            for b in verified:
                params = samplers[b].params
                for row in range(seg_row[b], seg_row[b] + columns[b]):
                    sampling.penalize(row, params.presence_penalty, params.frequency_penalty)
        model.inputs.fill(token_ids=ids, positions=positions, row_lane=row_lane,
                          row_pos=row_pos, seg_lane=lanes, seg_row=seg_row, seg_count=columns,
                          seg_record=[int(c > 1) for c in columns], sampling=sampling)
        self._step(decode_key(rows, size, bool(sampled), bool(verified)),
                   lambda: self._decode_step(rows, size, bool(sampled), bool(verified)))
        argmax = model.device.read(model.argmax[:rows])  # with the sampled rows' draws
        if verified:
            candidate_ids, candidate_values = model.read_candidates(rows)

        tokens, counts = np.zeros((size, k + 1), np.int32), np.zeros(size, np.int32)
        accepted, drafts_ready = np.zeros(size, np.int32), np.zeros(size, bool)
        mtp_rows, mtp_hidden = [], []
        counted_lanes, counted = [], []  # generated tokens the device's penalty counts must see
        verified_lanes, kept_columns = [], []
        for b, lane in enumerate(lanes):
            state, first, start = self._lanes[lane], seg_row[b], int(batch.kv_lengths[b])
            sampler = state.sampler
            if batch.speculative[b]:
                if sampler.params.is_greedy:
                    accepted[b], produced = _verify_greedy(argmax[first : first + k + 1], state.drafts)
                else:
                    accepted[b], produced = verify_candidates(candidate_ids[first : first + k + 1],
                                                              candidate_values[first : first + k + 1],
                                                              state.drafts, sampler, start)
                state.verified, state.live_column = True, k  # (its columns' rows: `keep_segment_rows`)
                verified_lanes.append(lane)
                kept_columns.append(int(accepted[b]))
            else:
                produced = [int(argmax[first])]
                if not sampler.params.is_greedy:
                    sampler.count(produced[0])  # (the device counted it too: the draw's COUNTED flag)
                state.verified = False  # (its row is its tail: `keep_segment_rows`)
            state.drafts = None
            n = len(produced)
            tokens[b, :n], counts[b] = produced, n
            if batch.speculative[b] and sampler.params.penalties_active and not sampler.params.is_greedy:
                counted_lanes += [lane] * n
                counted += produced
            state.has_tail = True
            if self._dflash:
                # the round's columns wait in the lane's pending rows (`keep_segment_rows`); the committed ones join
                # the context next call
                state.pending = n
                drafts_ready[b] = batch.speculative[b] and self._affords_a_round(batch.remaining[b] - n)
            if self._mtp:
                mtp_rows.append(_MtpRows(lane, start, np.array(produced, np.int32),
                                         np.broadcast_to(int(batch.positions[b]) + np.arange(n), (3, n))))
                mtp_hidden += [("final", first + j) for j in range(n)]
        self._select_columns(verified_lanes, kept_columns)
        model.count_generated(counted_lanes, counted)
        if mtp_rows:
            self._run_mtp(mtp_rows, mtp_hidden, prefill=False)
            wanted, row = [], 0
            for b, rows_b in enumerate(mtp_rows):
                row += counts[b]
                if batch.speculative[b] and self._affords_a_round(batch.remaining[b] - counts[b]):
                    wanted.append((rows_b.lane, row - 1, rows_b.first + counts[b] - 1, int(rows_b.positions[0, -1])))
                    drafts_ready[b] = True
            if wanted:
                self._prepare_drafts(wanted)
        return DecodeResult(tokens=tokens, counts=counts, accepted=accepted, drafts_ready=drafts_ready)

    def capture_decode_graphs(self) -> None:
        """Capture the ordinary decode graph of every batch size now (startup), so serving never pays for it. Each
        shape first runs once on placeholder rows (token 0 at position 0 of each lane, one segment per lane): lane
        state is reset before any sequence uses it."""
        for size in range(1, self.info.lanes + 1):
            lanes = np.arange(size)
            self._model.inputs.fill(token_ids=np.zeros(size), positions=np.zeros((3, size), np.int32),
                                    row_lane=lanes, row_pos=np.zeros(size), seg_lane=lanes, seg_row=lanes,
                                    seg_count=np.ones(size), seg_record=np.zeros(size))
            if decode_key(size, size) not in self._graphs:
                self._step(decode_key(size, size), lambda size=size: self._decode_step(size, size), pinned=True)
        self._model.device.clear(self._model.tails)  # the placeholder rows' (`keep_segment_rows`)

    def capture_prefill_graph(self) -> None:
        """Capture the full-size prefill chunk (Capacity.prefill_rows rows) in pieces now (startup), and each row
        bucket shorter chunks are padded to (`CudaQwen.padded_prefill_rows`), where the model can
        (`CudaQwen.piecewise_prefill`): a long prompt's chunks are all full but its last. No other size: a capture
        costs the host about what an eager chunk does, wasted on a length that never recurs. Each first runs once
        eagerly on placeholder rows (token 0 at positions 0.. of lane 0), which compiles the kernels: lane state is
        reset before any sequence uses it."""
        model = self._model
        for rows in model.captured_prefill_rows():
            key = ("prefill pieces", rows)
            if not self._graphs_on or key in self._graphs:
                continue
            positions = np.tile(np.arange(rows), (3, 1))
            _, span = model.stage_prefill(0, 0, np.zeros(rows), positions, pad=False)
            model.forward(rows, 1, span)
            self._graphs.add(key, model.capture_prefill(rows), pinned=True)

    # ---- internals ----

    def _step(self, key: tuple, body: Any, *, pinned: bool = False) -> None:
        """Run a decode-time step: replay its graph, or run it eagerly once (that call's real work, which also
        compiles its kernels) and capture it for the next call. Capturing records without executing. `pinned`
        graphs (startup's decode graphs) are never freed; others may be (`GraphCache`)."""
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay(self._model.device.stream_handle)
            return
        body()
        if self._graphs_on:
            self._graphs.add(key, self._model.device.capture(body), pinned=pinned)

    def _decode_step(self, rows: int, segments: int, sampled: bool = False, verified: bool = False) -> None:
        """A decode or verify round: decoder, what each lane keeps of its rows (its tail, or its verify columns),
        head, argmax; when a row samples, the penalised top candidates (each verify row's with its round's earlier
        drafts counted, when a sampled lane verifies) and the draw of the ordinary sampled rows."""
        model = self._model
        model.forward(rows, segments)
        model.keep_segment_rows(segments)
        logits = model.head_logits(model.workspace.final, rows)
        model.greedy(logits)
        if sampled or verified:
            model.candidates(logits, segments=segments if verified else None)
        if sampled:
            model.sample(rows)

    def _sample_rows(self, hidden: Any, lanes: list[int], positions: list[int], purpose: Purpose) -> list[int]:
        """Each row of `hidden` (lane lanes[r]) through the head and its lane's sampler, on the device: the argmax,
        or the draw over the penalised candidates (counted for the lane's penalties on both sides)."""
        model = self._model
        samplers = [self._lanes[lane].sampler for lane in lanes]
        logits = model.head_logits(hidden)
        model.greedy(logits)
        sampled = [r for r, sampler in enumerate(samplers) if not sampler.params.is_greedy]
        if sampled:
            sampling = SampledRows(len(lanes))
            for r in sampled:
                sampling.draw(r, samplers[r].params, positions[r], purpose)
            model.inputs.fill_sampling(lanes, sampling)
            model.candidates(logits)
            model.sample(len(lanes))
        tokens = [int(t) for t in model.device.read(model.argmax[: len(lanes)])]
        for r in sampled:
            samplers[r].count(tokens[r])
        return tokens

    def _select_columns(self, lanes: list[int], columns: list[int]) -> None:
        """These lanes continue from these verify columns: one launch a state kind for all of them (a graph), and
        none for the recurrent states of a lane whose states already hold its column."""
        if not lanes:
            return
        model, states = self._model, [self._lanes[lane].live_column != column for lane, column in zip(lanes, columns)]
        model.stage_selection(lanes, columns, states)
        self._step(("select", len(lanes), any(states)), lambda: model.select_staged(len(lanes), any(states)))
        for lane, column in zip(lanes, columns):
            self._lanes[lane].live_column = column

    def _affords_a_round(self, remaining: int) -> bool:
        return remaining >= self._k + 1

    def _check_context(self, lane: int, kv_length: int) -> None:
        """The lane's drafter context (committed and pending columns) covers exactly the E = `kv_length` tokens."""
        state = self._lanes[lane]
        if state.context + state.pending != kv_length:
            raise DFlashContextError(f"lane {lane}: the DFlash context covers {state.context + state.pending} "
                                     f"tokens, the call starts at E = {kv_length}")

    def _start_drafter_call(self, lane: int, kv_length: int) -> None:
        """Before a prefill chunk: commit the lane's pending columns, so the chunk's own follow them."""
        self._check_context(lane, kv_length)
        if self._lanes[lane].pending:
            self._run_drafter([lane], [])

    def _ring_slots(self, positions: np.ndarray, end: int) -> np.ndarray:
        """The sliding layers' ring slot of each committed position of one lane whose context will end at `end`;
        -1 for a position that a later one of the same call overwrites (it falls out of the window)."""
        window = self._model.dflash.dims.sliding_window
        return np.where(positions >= end - window, positions % window, -1)

    def _run_drafter(self, lanes: list[int], blocks: list[tuple[int, int, int]]) -> None:
        """One drafter call (a graph per lane and block count): the pending columns of every lane of `lanes`
        projected into its context, then for each (lane, anchor, E) of `blocks` the block [anchor, MASK x k] at
        positions E..E+k, whose mask rows' greedy proposals (§3.10: mask i proposes the token at E+1+i) become the
        lane's drafts."""
        model, width = self._model, self._k + 1
        ids, positions, row_lane = [], [], []
        for lane, anchor, start in blocks:
            ids += [anchor] + [model.dflash.dims.mask_token_id] * self._k
            positions += range(start, start + width)
            row_lane += [lane] * width
        ring_slot, source = [-1] * len(ids), []
        for lane in lanes:  # k+1 context rows a lane: its pending columns, then padding (position -1)
            state = self._lanes[lane]
            end = state.context + state.pending
            committed = np.where(np.arange(width) < state.pending, state.context + np.arange(width), -1)
            positions += committed.tolist()
            row_lane += [lane] * width
            ring_slot += np.where(committed >= 0, self._ring_slots(committed, end), -1).tolist()
            source += range(lane * width, (lane + 1) * width)
        model.dflash_inputs.fill(ids=ids, positions=positions, row_lane=row_lane, ring_slot=ring_slot,
                                 context_source=source)
        block_rows, context_rows = len(ids), len(lanes) * width
        self._step(("dflash", len(lanes), len(blocks)),
                   lambda: model.dflash_step(block_rows, context_rows, from_pending=True))
        for lane in lanes:
            state = self._lanes[lane]
            state.context, state.pending = state.context + state.pending, 0
        if blocks:
            chosen = model.device.read(model.argmax[:block_rows]).reshape(len(blocks), width)[:, 1:]
            if model.draft_head_ids is not None:
                chosen = model.draft_head_ids[chosen]
            for (lane, *_), drafts in zip(blocks, chosen):
                self._lanes[lane].drafts = drafts

    def _prefill_mtp_rows(self, chunk: PrefillChunk, token: int) -> _MtpRows | None:
        """Mirror of the CPU runner: one column behind the target, starting with the bridge column E-1."""
        start = chunk.kv_length
        next_ids = np.append(chunk.token_ids, token) if chunk.final else chunk.token_ids
        positions = chunk.positions
        if start > 0:
            positions = np.concatenate([chunk.tail_position[:, None], positions], axis=1)
        else:
            next_ids = next_ids[1:]
        n = len(next_ids)
        if n == 0:
            return None
        return _MtpRows(chunk.lane, start - 1 if start > 0 else 0, np.asarray(next_ids, np.int32),
                        positions[:, :n])

    def _run_mtp(self, items: list[_MtpRows], hidden_rows: list[tuple[str, int]], *, prefill: bool,
                 embeddings: tuple[np.ndarray, np.ndarray] | None = None) -> Any:
        """The MTP head over the items' rows; `hidden_rows` names each row's target hidden row (a lane's tail, or a
        row of the last forward's final-norm output). Returns d [rows, H] (valid until the next forward).
        `embeddings` (next-token overrides of a prefill chunk's rows) make the call eager."""
        model = self._model
        rows = len(hidden_rows)
        next_ids = np.concatenate([item.next_ids for item in items])
        positions = np.concatenate([item.positions for item in items], axis=1)
        row_lane = np.concatenate([np.full(len(item.next_ids), item.lane) for item in items])
        row_pos = np.concatenate([item.first + np.arange(len(item.next_ids)) for item in items])
        # the target hidden rows are gathered on the device by the step itself (`gather_mtp_hidden`), not copied a
        # row or a run at a time by the host (~5-10 us of host time a copy: a 1024-row chunk made 1024 of them)
        sources = [-1 - index if where == "tail" else index for where, index in hidden_rows]
        model.inputs.fill(token_ids=next_ids, next_ids=next_ids, positions=positions, row_lane=row_lane,
                          row_pos=row_pos, seg_lane=[], seg_row=[], seg_count=[], seg_record=[], hidden_rows=sources)
        # a long prefill chunk's columns: tiled attention, eager (short ones take the graph below); embeddings: eager
        tiled = prefill and len(items) == 1 and rows > 1 and (embeddings is not None
                                                              or not model.short_prefill(rows, items[0].first))
        if tiled or embeddings is not None:
            span = PrefillSpan(items[0].lane, items[0].first) if tiled else None
            return model.mtp_forward(model.gather_mtp_hidden(rows), rows, span, embeddings)
        self._step(("mtp", rows), lambda: model.mtp_forward(model.gather_mtp_hidden(rows), rows))
        return model.workspace.final[:rows]

    def _prepare_drafts(self, wanted: list[tuple[int, int, int, int]]) -> None:
        """k greedy proposals per lane from the MTP output row `row` (of workspace.final, where `_run_mtp` leaves
        it) of its last aligned column (MTP KV index `column`, rope position `position`): draft 0 from that row,
        then k-1 autoregressive MTP steps (§3.8)."""
        model, k = self._model, self._k
        n = len(wanted)
        current, hidden = model.mtp_hidden[n : 2 * n], model.mtp_hidden[:n]
        # one graph a round: the rows' gather, the k proposals and the MTP steps between them
        # (`CudaQwen.draft_chain`), its inputs in one copy before it, one read after it
        model.stage_draft_steps(k, [lane for lane, *_ in wanted], [p for *_, p in wanted],
                                [column for _, _, column, _ in wanted], sources=[row for _, row, _, _ in wanted])
        self._step(("drafts", n), lambda: model.draft_chain(current, hidden, k, gather=True))
        chosen = model.device.read(model.draft_ids)[:k, :n].T
        drafts = chosen if model.draft_head_ids is None else model.draft_head_ids[chosen]
        for (lane, *_), row in zip(wanted, drafts):
            self._lanes[lane].drafts = row


def _host(value: Any) -> np.ndarray:
    """An image array on the host (a parked one is read from its arena)."""
    return value.host() if isinstance(value, ParkedArray) else np.asarray(value)


def _verify_greedy(argmax: np.ndarray, drafts: np.ndarray) -> tuple[int, list[int]]:
    """§4.7 under greedy sampling from the verify columns' argmaxes: accept drafts while they equal the argmax."""
    produced: list[int] = []
    for i, draft in enumerate(drafts):
        if int(argmax[i]) != int(draft):
            return i, produced + [int(argmax[i])]
        produced.append(int(draft))
    return len(drafts), produced + [int(argmax[len(drafts)])]


def decode_key(rows: int, segments: int, sampled: bool = False, verified: bool = False) -> tuple:
    """The graph of a decode or verify step: its rows and segments, whether a row draws on the device and whether a
    sampled lane verifies (`CudaRunner._decode_step`)."""
    return ("decode", rows, segments, sampled, verified)

