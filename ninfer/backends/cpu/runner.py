"""The CPU model runner: the reference implementation of `ninfer.engine.runner.ModelRunner` over the NumPy models.

Attention KV lives in shared paged pools (`paged_kv`), recurrent state in per-lane objects. Every call runs the
model once over a ragged batch (`forward_batch`), whose rows are computed independently of each other, so a lane's
tokens do not depend on what else shares the call.

Media: a model with a Vision tower (`vision_tower` set, e.g. `Qwen36Model(..., vision=True)`) makes a vision runner;
`encode_media` converts an item's bf16 patch rows to float32 and runs the tower, and a prefill chunk's embedding
overrides reach both the target model and the MTP head (shifted to the column whose next token they replace).

Speculative decoding (`draft_tokens` k > 0) runs one of two drafters through the same verify round (§4.6, §4.7):
* MTP: drafts are prepared at the end of a call (prefill or round) from the MTP head, whose paged KV follows E;
* DFlash (a model built with its drafter, `Qwen36Model(..., dflash=...)`): the target's calls capture the context
  features of their columns; a speculative row's round starts by committing the lane's pending context, then
  proposes k tokens with one masked-block forward of the drafter and verifies them (`ninfer.backends.cpu.dflash`).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import attrs
import numpy as np

from ninfer.backends.cpu.dflash import (DFlashCaches, DFlashContextError, DFlashLaneState, dflash_kv_bytes_per_token,
                                       dflash_lane_bytes)
from ninfer.backends.cpu.ops import ATTENTION, Segment
from ninfer.backends.cpu.paged_kv import PagedKVView, PagedLayerKV, kv_bytes_per_token
from ninfer.engine.config import EngineConfig
from ninfer.engine.kv_pool import PAGE_TOKENS, plan_kv_pool
from ninfer.engine.request import PromptMedia
from ninfer.engine.runner import (DecodeBatch, DecodeResult, LaneImage, PrefillChunk, PrefillResult, RunnerInfo,
                                  SequenceStart, StateSource, VisionUnavailable)
from ninfer.engine.sampler import Purpose, Sampler
from ninfer.engine.speculative import verify_drafts
from ninfer.models.dflash import DraftBlock
from ninfer.models.qwen3_6_vision import encode_prompt_item

CHECKPOINT_SLOTS = 2  # the turn checkpoint and the response checkpoint
SPEC_BACKENDS = ("mtp", "dflash")


class RunnerModel(Protocol):
    """What the runner needs from a CPU model (Qwen36Model, LlamaModel)."""

    dims: Any
    mixer_kinds: tuple[str, ...]  # per layer: "attention" (paged KV) or "recurrent" (a state object)
    has_mtp: bool
    dflash: Any  # the DFlash drafter (a Qwen model built with one), or None

    def new_recurrent_state(self, layer: int) -> Any: ...

    def forward_batch(self, token_ids: np.ndarray, positions: np.ndarray,
                      segments: Sequence[Segment]) -> np.ndarray:
        """A vision model (`vision_tower` set) also takes `embedding_columns=` / `embedding_rows=` overrides, and
        its `mtp_forward_batch` too."""

    def forward_batch_features(self, token_ids: np.ndarray, positions: np.ndarray, segments: Sequence[Segment],
                               feature_layers: Sequence[int]) -> tuple[np.ndarray, np.ndarray]: ...

    def embed(self, token_ids: np.ndarray) -> np.ndarray: ...

    def logits(self, hidden: np.ndarray) -> np.ndarray: ...

    def mtp_forward_batch(self, hidden: np.ndarray, next_ids: np.ndarray, positions: np.ndarray,
                          segments: Sequence[Segment]) -> np.ndarray: ...

    def draft_ids(self, d: np.ndarray, *, shortlist: bool) -> np.ndarray: ...


def runner_kv_bytes_per_token(model: RunnerModel, kv_dtype: str, draft_tokens: int, spec: str = "mtp") -> int:
    """Shared-pool bytes per token: every attention layer, plus the MTP layer or the DFlash drafter's full layers
    (always BF16) when speculative decoding with `spec` is on."""
    mtp = bool(draft_tokens) and spec == "mtp"
    total = kv_bytes_per_token(model.mixer_kinds.count(ATTENTION) + mtp, model.dims.kv_heads, model.dims.head_dim,
                               kv_dtype)
    if draft_tokens and spec == "dflash":
        total += dflash_kv_bytes_per_token(_drafter(model).dims)
    return total


def _drafter(model: RunnerModel) -> Any:
    drafter = getattr(model, "dflash", None)
    if drafter is None:
        raise ValueError("DFlash speculative decoding needs a model built with its DFlash drafter")
    return drafter


@attrs.frozen
class _Checkpoint:
    recurrent: dict[int, Any]
    tail: np.ndarray
    dflash: DFlashLaneState | None = None


@attrs.frozen
class _Verify:
    """The last speculative round of a lane: recurrent state and hidden row after each verify column."""

    columns: dict[int, Any]
    hidden: np.ndarray


@attrs.define
class _Lane:
    recurrent: dict[int, Any]
    checkpoints: list[_Checkpoint | None]
    page_table: np.ndarray = attrs.Factory(lambda: np.zeros(0, np.int32))
    tail: np.ndarray | None = None  # final-norm hidden row of token E-1
    sampler: Sampler | None = None
    drafts: np.ndarray | None = None  # k proposals: MTP ones ready for the next round, DFlash ones of this round
    verify: _Verify | None = None
    dflash: DFlashLaneState | None = None  # the DFlash drafter's context


@attrs.frozen
class _MtpRows:
    """MTP columns first..first+n-1 of one lane: target hidden rows fused with the token after each."""

    lane: _Lane
    first: int
    hidden: np.ndarray  # [n, hidden]
    next_ids: np.ndarray  # [n]
    positions: np.ndarray  # [3, n]
    embedding_columns: np.ndarray | None = None  # rows (of these n) whose next-token embedding is replaced
    embedding_rows: np.ndarray | None = None


class CpuRunner:
    def __init__(self, model: RunnerModel, *, lanes: int, pages: int, kv_dtype: str = "bf16", draft_tokens: int = 0,
                 lm_head_draft: bool = False, spec: str = "mtp") -> None:
        """`spec` names the drafter `draft_tokens` > 0 runs: "mtp" (the model's MTP head) or "dflash" (its DFlash
        drafter, at most block_size - 1 drafts)."""
        if spec not in SPEC_BACKENDS:
            raise ValueError(f"unknown speculative backend {spec!r}; choose one of {', '.join(SPEC_BACKENDS)}")
        self._dflash = None
        if draft_tokens and spec == "mtp" and not model.has_mtp:
            raise ValueError("MTP speculative decoding needs a model with an MTP head")
        if draft_tokens and spec == "dflash":
            drafter = _drafter(model)
            if getattr(model, "vision_tower", None) is not None:
                raise ValueError("DFlash is text-only: build the model without its Vision tower")
            if draft_tokens > drafter.dims.max_draft_tokens:
                raise ValueError(f"the DFlash drafter proposes at most {drafter.dims.max_draft_tokens} tokens "
                                 f"(block size {drafter.dims.block_size}), not {draft_tokens}")
            self._dflash = DFlashCaches(drafter, pages, PAGE_TOKENS)
        dims = model.dims
        self._model = model
        self._kv = {i: PagedLayerKV(pages, PAGE_TOKENS, dims.kv_heads, dims.head_dim, kv_dtype)
                    for i, kind in enumerate(model.mixer_kinds) if kind == ATTENTION}
        self._mtp_kv = PagedLayerKV(pages, PAGE_TOKENS, dims.kv_heads, dims.head_dim, kv_dtype) \
            if draft_tokens and spec == "mtp" else None
        self._shortlist = lm_head_draft
        self.info = RunnerInfo(lanes=lanes, pages=pages, page_tokens=PAGE_TOKENS, checkpoint_slots=CHECKPOINT_SLOTS,
                               vocab_ids=dims.vocab_ids, draft_tokens=draft_tokens,
                               kv_bytes_per_token=runner_kv_bytes_per_token(model, kv_dtype, draft_tokens, spec),
                               vision=getattr(model, "vision_tower", None) is not None)
        self._lanes = [self._new_lane() for _ in range(lanes)]

    # ---- state operations ----

    def assign_pages(self, lane: int, page_table: np.ndarray) -> None:
        self._lanes[lane].page_table = np.array(page_table, dtype=np.int32)

    def begin_sequence(self, lane: int, start: SequenceStart) -> None:
        state = self._lanes[lane]
        if start.source is StateSource.RESET:
            table = state.page_table
            state = self._lanes[lane] = self._new_lane()
            state.page_table = table
        elif start.source is StateSource.CHECKPOINT:
            checkpoint = state.checkpoints[start.checkpoint_slot]
            if checkpoint is None:
                raise ValueError(f"lane {lane} has no checkpoint in slot {start.checkpoint_slot}")
            state.recurrent = {i: s.copy() for i, s in checkpoint.recurrent.items()}
            state.tail = checkpoint.tail.copy()
            if checkpoint.dflash is not None:
                state.dflash = checkpoint.dflash.copy()
        state.sampler = Sampler(start.sampling, self.info.vocab_ids)
        state.drafts = state.verify = None

    def save_checkpoint(self, lane: int, slot: int) -> None:
        state = self._lanes[lane]
        if state.tail is None:
            raise ValueError(f"lane {lane} has no materialized token to checkpoint")
        if state.dflash is not None:
            self._dflash.commit_pending(state.dflash, state.page_table)
        state.checkpoints[slot] = _Checkpoint({i: s.copy() for i, s in state.recurrent.items()}, state.tail.copy(),
                                              None if state.dflash is None else state.dflash.copy())

    def rewind(self, lane: int, kept: int) -> None:
        state = self._lanes[lane]
        if state.verify is None:
            if kept != 1:
                raise ValueError(f"lane {lane}: an ordinary round produced one token, cannot keep {kept}")
            return
        self._select_column(state, kept - 1)
        state.drafts = None
        if state.dflash is not None:
            state.dflash.keep_pending(kept)

    def release(self, lane: int) -> None:
        self._lanes[lane] = self._new_lane()

    def export_lane(self, lane: int, tokens: int) -> LaneImage:
        state = self._lanes[lane]
        used = -(-tokens // PAGE_TOKENS)
        if used > len(state.page_table):
            raise ValueError(f"lane {lane}: {tokens} tokens need {used} pages, it owns {len(state.page_table)}")
        pages = state.page_table[:used]
        arrays: dict[str, np.ndarray] = {}
        for name, pool in self._pools().items():
            arrays.update({f"{name}/{part}": value for part, value in pool.export_pages(pages).items()})
        arrays.update(_recurrent_arrays("state", state.recurrent))
        if state.tail is not None:
            arrays["tail"] = state.tail.copy()
        if state.dflash is not None:
            arrays.update(state.dflash.arrays("dflash"))
        for slot, checkpoint in enumerate(state.checkpoints):
            if checkpoint is not None:
                arrays.update(_recurrent_arrays(f"checkpoint/{slot}", checkpoint.recurrent))
                arrays[f"checkpoint/{slot}/tail"] = checkpoint.tail.copy()
                if checkpoint.dflash is not None:
                    arrays.update(checkpoint.dflash.arrays(f"checkpoint/{slot}/dflash"))
        return LaneImage(tokens=tokens, pages=used, has_tail=state.tail is not None, arrays=arrays)

    def import_lane(self, lane: int, image: LaneImage) -> None:
        table = self._lanes[lane].page_table
        if image.pages > len(table):
            raise ValueError(f"lane {lane}: the image needs {image.pages} pages, the lane owns {len(table)}")
        pages = table[: image.pages]
        for name, pool in self._pools().items():
            prefix = f"{name}/"
            pool.import_pages(pages, {key[len(prefix):]: value for key, value in image.arrays.items()
                                      if key.startswith(prefix)})
        state = self._new_lane()
        state.page_table = table
        state.recurrent = _recurrent_states("state", image.arrays, state.recurrent)
        state.tail = image.arrays["tail"].copy() if image.has_tail else None
        if state.dflash is not None:
            state.dflash = DFlashLaneState.from_arrays("dflash", image.arrays, state.dflash)
        for slot in range(CHECKPOINT_SLOTS):
            if f"checkpoint/{slot}/tail" in image.arrays:
                state.checkpoints[slot] = _Checkpoint(
                    _recurrent_states(f"checkpoint/{slot}", image.arrays, state.recurrent),
                    image.arrays[f"checkpoint/{slot}/tail"].copy(),
                    None if state.dflash is None else
                    DFlashLaneState.from_arrays(f"checkpoint/{slot}/dflash", image.arrays, state.dflash))
        self._lanes[lane] = state

    def _pools(self) -> dict[str, PagedLayerKV]:
        pools = {f"kv/{layer}": pool for layer, pool in self._kv.items()}
        if self._mtp_kv is not None:
            pools["mtp"] = self._mtp_kv
        if self._dflash is not None:
            pools.update({f"dflash/kv/{layer}": pool for layer, pool in self._dflash.pools.items()})
        return pools

    # ---- model calls ----

    def encode_media(self, item: PromptMedia) -> np.ndarray:
        if not self.info.vision:
            raise VisionUnavailable("this runner was built without the Vision tower (start the server with --vision)")
        return encode_prompt_item(self._model.vision_tower, item, self._model.dims.hidden)

    def prefill(self, chunk: PrefillChunk) -> PrefillResult:
        lane, model = self._lanes[chunk.lane], self._model
        count, start = len(chunk.token_ids), chunk.kv_length
        hidden = np.zeros((0, model.dims.hidden), np.float32)
        if chunk.has_embeddings and not self.info.vision:
            raise VisionUnavailable("a prefill chunk carries embedding overrides, but this runner has no Vision tower")
        if self._dflash is not None:
            self._start_dflash_call(lane, start)
        if count:
            segment = Segment(slice(0, count), self._stores(lane, start))
            if self._dflash is not None:  # text only: DFlash runs without the Vision tower
                hidden, features = model.forward_batch_features(chunk.token_ids, chunk.positions, [segment],
                                                                self._dflash.dims.target_layer_ids)
                self._dflash.extend(lane.dflash, lane.page_table, features)
            else:
                overrides = dict(embedding_columns=chunk.embedding_columns,
                                 embedding_rows=chunk.embedding_rows) if chunk.has_embeddings else {}
                hidden = model.forward_batch(chunk.token_ids, chunk.positions, [segment], **overrides)
        token = -1
        if chunk.final:
            last = hidden[-1] if count else lane.tail
            if last is None:
                raise ValueError(f"lane {chunk.lane}: nothing to sample from (empty chunk without a tail)")
            token = lane.sampler.sample(model.logits(last[None])[0], start + count, Purpose.PREFILL)
        drafts_ready = False
        if self._mtp_kv is not None:
            rows = self._prefill_mtp_rows(lane, chunk, hidden, token)
            if rows is not None:
                d = self._run_mtp([rows])[0]
                if chunk.final and self._affords_a_round(chunk.remaining - 1):
                    last_column = rows.first + len(rows.next_ids) - 1
                    self._prepare_drafts([(lane, d[-1], last_column, int(rows.positions[0, -1]))])
                    drafts_ready = True
        if self._dflash is not None:
            drafts_ready = chunk.final and self._affords_a_round(chunk.remaining - 1)
        if count:
            lane.tail = hidden[-1].copy()
        lane.verify = None
        return PrefillResult(token=token, drafts_ready=drafts_ready)

    def decode(self, batch: DecodeBatch) -> DecodeResult:
        model, k = self._model, self.info.draft_tokens
        lanes = [self._lanes[i] for i in batch.lanes]
        if self._dflash is not None:
            for lane, kv_length in zip(lanes, batch.kv_lengths):
                self._start_dflash_call(lane, int(kv_length))
            self._propose_dflash([(lane, int(batch.input_tokens[b]), int(batch.kv_lengths[b]))
                                  for b, lane in enumerate(lanes) if batch.speculative[b]])
        segments, ids, positions, row = [], [], [], 0
        for b, lane in enumerate(lanes):
            columns = [int(batch.input_tokens[b])]
            if batch.speculative[b]:
                if lane.drafts is None or batch.remaining[b] < k + 1:
                    raise ValueError(f"lane {batch.lanes[b]} cannot verify: no drafts or too little output budget")
                columns += [int(t) for t in lane.drafts]
            n = len(columns)
            segments.append(Segment(slice(row, row + n), self._stores(lane, int(batch.kv_lengths[b])),
                                    record_columns=bool(batch.speculative[b])))
            ids += columns
            positions.append(batch.positions[b] + np.arange(n))
            row += n
        positions = np.broadcast_to(np.concatenate(positions), (3, row))
        if self._dflash is not None:
            hidden, features = model.forward_batch_features(np.array(ids, np.int32), positions, segments,
                                                            self._dflash.dims.target_layer_ids)
        else:
            hidden = model.forward_batch(np.array(ids, np.int32), positions, segments)
        logits = model.logits(hidden)

        size = batch.size
        tokens, counts = np.zeros((size, k + 1), np.int32), np.zeros(size, np.int32)
        accepted, drafts_ready = np.zeros(size, np.int32), np.zeros(size, bool)
        mtp_rows = []
        for b, (lane, segment) in enumerate(zip(lanes, segments)):
            r, start = segment.rows, int(batch.kv_lengths[b])
            if batch.speculative[b]:
                accepted[b], produced = verify_drafts(logits[r], lane.drafts, lane.sampler, start)
                lane.verify = _Verify(segment.columns, hidden[r].copy())
                self._select_column(lane, int(accepted[b]))
            else:
                produced = [lane.sampler.sample(logits[r.start], start, Purpose.DECODE)]
                lane.verify, lane.tail = None, hidden[r.start].copy()
            lane.drafts = None
            n = len(produced)
            tokens[b, :n], counts[b] = produced, n
            if self._dflash is not None:
                # The committed columns (the input token and the accepted drafts) extend the context next call.
                lane.dflash.pending = features[r][:n].copy()
                drafts_ready[b] = batch.speculative[b] and self._affords_a_round(batch.remaining[b] - n)
            if self._mtp_kv is not None:
                mtp_rows.append(_MtpRows(lane, start, hidden[r][:n], np.array(produced, np.int32),
                                         np.broadcast_to(batch.positions[b] + np.arange(n), (3, n))))
        if mtp_rows:
            outputs = self._run_mtp(mtp_rows)
            wanted = []
            for b, (rows, d) in enumerate(zip(mtp_rows, outputs)):
                if batch.speculative[b] and self._affords_a_round(batch.remaining[b] - counts[b]):
                    last_column = rows.first + counts[b] - 1
                    wanted.append((rows.lane, d[-1], last_column, int(rows.positions[0, -1])))
                    drafts_ready[b] = True
            if wanted:
                self._prepare_drafts(wanted)
        return DecodeResult(tokens=tokens, counts=counts, accepted=accepted, drafts_ready=drafts_ready)

    # ---- internals ----

    def _affords_a_round(self, remaining: int) -> bool:
        """Drafts are worth preparing only when the output budget left can take a whole verify round (k + 1)."""
        return remaining >= self.info.draft_tokens + 1

    def _new_lane(self) -> _Lane:
        kinds = self._model.mixer_kinds
        recurrent = {i: self._model.new_recurrent_state(i) for i, kind in enumerate(kinds) if kind != ATTENTION}
        return _Lane(recurrent=recurrent, checkpoints=[None] * CHECKPOINT_SLOTS,
                     dflash=None if self._dflash is None else self._dflash.new_lane())

    def _stores(self, lane: _Lane, kv_length: int) -> list[Any]:
        return [PagedKVView(self._kv[i], lane.page_table, kv_length) if i in self._kv else lane.recurrent[i]
                for i in range(len(self._model.mixer_kinds))]

    def _select_column(self, lane: _Lane, column: int) -> None:
        """Keep the state after verify column `column`: the accepted prefix of the last speculative round."""
        lane.recurrent = {i: lane.verify.columns[i].state_after(column) for i in lane.recurrent}
        lane.tail = lane.verify.hidden[column].copy()

    def _start_dflash_call(self, lane: _Lane, kv_length: int) -> None:
        """Commit the lane's pending context: it then covers exactly the E = `kv_length` materialized tokens."""
        self._dflash.commit_pending(lane.dflash, lane.page_table)
        if lane.dflash.length != kv_length:
            raise DFlashContextError(f"the DFlash context covers {lane.dflash.length} tokens, the call starts at "
                                     f"E = {kv_length}")

    def _propose_dflash(self, rows: list[tuple[_Lane, int, int]]) -> None:
        """k greedy proposals per lane, from one drafter forward over each lane's block `[anchor, MASK x k]` at
        positions E..E+k (the anchor is the round's input token): mask i proposes the token at E+1+i (§3.10)."""
        if not rows:
            return
        model, k, drafter = self._model, self.info.draft_tokens, self._dflash.drafter
        width = k + 1
        block_ids = np.full((len(rows), width), drafter.dims.mask_token_id, np.int32)
        block_ids[:, 0] = [anchor for _, anchor, _ in rows]
        positions = np.concatenate([start + np.arange(width) for *_, start in rows])
        blocks = [DraftBlock(slice(j * width, (j + 1) * width), self._dflash.context(lane.dflash, lane.page_table))
                  for j, (lane, *_) in enumerate(rows)]
        d = drafter.forward(model.embed(block_ids.reshape(-1)), positions, blocks)
        mask_rows = d.reshape(len(rows), width, -1)[:, 1:].reshape(len(rows) * k, -1)
        drafts = model.draft_ids(mask_rows, shortlist=self._shortlist).reshape(len(rows), k)
        for (lane, *_), row in zip(rows, drafts):
            lane.drafts = row

    def _prefill_mtp_rows(self, lane: _Lane, chunk: PrefillChunk, hidden: np.ndarray, token: int) -> _MtpRows | None:
        """MTP columns of a prefill chunk: one behind the target (column j needs token j+1), starting with the bridge
        column E-1 from the tail; a final chunk also covers its last column with the sampled token."""
        start = chunk.kv_length
        next_ids = np.append(chunk.token_ids, token) if chunk.final else chunk.token_ids
        rows_hidden, positions = hidden, chunk.positions
        if start > 0:
            rows_hidden = np.concatenate([lane.tail[None], hidden])
            positions = np.concatenate([chunk.tail_position[:, None], positions], axis=1)
        else:
            next_ids = next_ids[1:]
        n = len(next_ids)
        if n == 0:
            return None
        columns = rows = None
        if chunk.has_embeddings:
            columns, rows = chunk.mtp_embeddings()
        return _MtpRows(lane, start - 1 if start > 0 else 0, rows_hidden[:n], next_ids, positions[:, :n],
                        columns, rows)

    def _run_mtp(self, items: list[_MtpRows]) -> list[np.ndarray]:
        segments, row, columns, rows = [], 0, [], []
        for item in items:
            n = len(item.next_ids)
            segments.append(Segment(slice(row, row + n), [PagedKVView(self._mtp_kv, item.lane.page_table, item.first)]))
            if item.embedding_columns is not None and len(item.embedding_columns):
                columns.append(item.embedding_columns + row)
                rows.append(item.embedding_rows)
            row += n
        overrides = dict(embedding_columns=np.concatenate(columns),
                         embedding_rows=np.concatenate(rows)) if columns else {}
        d = self._model.mtp_forward_batch(np.concatenate([i.hidden for i in items]),
                                          np.concatenate([i.next_ids for i in items]),
                                          np.concatenate([i.positions for i in items], axis=1), segments, **overrides)
        return [d[s.rows] for s in segments]

    def _prepare_drafts(self, wanted: list[tuple[_Lane, np.ndarray, int, int]]) -> None:
        """k greedy proposals per lane from the MTP output of its last aligned column (`last_column`, at rope
        position `position`): draft 0 from that output, then k-1 autoregressive MTP steps (§3.8)."""
        model, k = self._model, self.info.draft_tokens
        d = np.stack([w[1] for w in wanted])
        drafts = np.zeros((len(wanted), k), np.int32)
        drafts[:, 0] = model.draft_ids(d, shortlist=self._shortlist)
        for step in range(1, k):
            segments = [Segment(slice(j, j + 1), [PagedKVView(self._mtp_kv, lane.page_table, column + step)])
                        for j, (lane, _, column, _) in enumerate(wanted)]
            positions = np.broadcast_to(np.array([p + step for *_, p in wanted]), (3, len(wanted)))
            d = model.mtp_forward_batch(d, drafts[:, step - 1], positions, segments)
            drafts[:, step] = model.draft_ids(d, shortlist=self._shortlist)
        for (lane, *_), row in zip(wanted, drafts):
            lane.drafts = row


def runner_state_bytes(model: RunnerModel, lanes: int, draft_tokens: int, spec: str = "mtp") -> int:
    """Fixed per-lane state: the recurrent state's running copy, checkpoint slots and one copy per verify column,
    and with DFlash the cyclic context caches (running and per checkpoint)."""
    one = sum(array.nbytes for i, kind in enumerate(model.mixer_kinds) if kind != ATTENTION
              for array in attrs.astuple(model.new_recurrent_state(i)))
    total = lanes * one * (1 + CHECKPOINT_SLOTS + (draft_tokens + 1 if draft_tokens else 0))
    if draft_tokens and spec == "dflash":
        total += lanes * dflash_lane_bytes(_drafter(model).dims) * (1 + CHECKPOINT_SLOTS)
    return total


def build_cpu_runner(model: RunnerModel, config: EngineConfig, *, memory_budget: int | None = None) -> CpuRunner:
    """The CPU runner for an engine configuration, its pool sized by `plan_kv_pool`. `memory_budget` (bytes left
    after the weights) is what `--kv-capacity auto` sizes from, after the runner's fixed lane state."""
    spec = config.spec or "mtp"  # the backend is irrelevant without drafts
    plan = plan_kv_pool(kv_capacity=config.kv_capacity, max_context=config.max_context,
                        lanes=config.max_concurrency, memory_budget=memory_budget,
                        reserved_bytes=runner_state_bytes(model, config.max_concurrency, config.draft_tokens, spec),
                        bytes_per_token=runner_kv_bytes_per_token(model, config.kv_dtype, config.draft_tokens, spec))
    return CpuRunner(model, lanes=config.max_concurrency, pages=plan.pages, kv_dtype=config.kv_dtype,
                     draft_tokens=config.draft_tokens, lm_head_draft=config.lm_head_draft, spec=spec)


def _recurrent_arrays(prefix: str, recurrent: dict[int, Any]) -> dict[str, np.ndarray]:
    """A lane's Gated DeltaNet states as named copies (conv history and recurrent matrix per layer)."""
    out = {}
    for layer, state in recurrent.items():
        out[f"{prefix}/{layer}/conv"] = state.conv.copy()
        out[f"{prefix}/{layer}/recurrent"] = state.recurrent.copy()
    return out


def _recurrent_states(prefix: str, arrays: dict[str, np.ndarray], like: dict[int, Any]) -> dict[int, Any]:
    """The inverse of `_recurrent_arrays`, building states of the same type as `like`'s."""
    return {layer: type(state)(conv=arrays[f"{prefix}/{layer}/conv"].copy(),
                               recurrent=arrays[f"{prefix}/{layer}/recurrent"].copy())
            for layer, state in like.items()}
