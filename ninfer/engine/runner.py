"""The model-runner interface: everything the engine asks of a backend, and nothing more.

The engine decides *what* runs (admission, page allocation, prefix reuse, chunking, batching, output acceptance);
a runner decides *how* (device memory, kernels, graphs). The CPU runner (`ninfer.backends.cpu.runner`) is the
reference; the CUDA runner implements the same calls with device buffers and one CUDA graph per exact batch size.

Shape of the contract
---------------------
* Lanes. A runner is built for `lanes` (1..8) sequence slots. A lane holds one sequence's device state: the
  recurrent (Gated DeltaNet conv + SSM) running state, `checkpoint_slots` checkpoint copies of it (each with the
  final-norm hidden row of the token before it), the hidden row of the last materialized token ("tail"), the
  sampler's per-request state (penalty counts), the draft window, the per-column state of its last verify, and
  with DFlash the drafter's context (its cyclic caches, and the committed columns not yet projected into them).
  All of it is addressed by lane index: the engine never sees a tensor.
* Pages. Attention KV (every full-attention layer, and the MTP layer or the DFlash drafter's full-attention
  layers when speculative decoding is on) lives in one
  shared pool of `pages` pages of `page_tokens` tokens. A lane's page table is an int32 array of page ids, set by
  `assign_pages`; token i of the sequence is at page `table[i // page_tokens]`, offset `i % page_tokens`. The engine
  owns the allocator and guarantees no page is in two live tables; a runner only reads and writes through tables.
* Frontier bookkeeping. `E` (execution frontier) is the number of tokens whose KV and recurrent state are
  materialized. The engine passes E (`kv_length`) and rope positions with every call, so the runner keeps no
  ledger. After every call that produced tokens, the MTP KV of an MTP runner covers the same E tokens (column j
  fuses hidden h_j with token j+1), so a later request can bridge from the tail or a checkpoint; the DFlash context
  of a DFlash runner covers them too (committed, or pending until the lane's next call).
* Calls are coarse: one per prefill chunk of one lane, one per decode round for the whole decode batch (ordinary
  and speculative rows together; a CUDA runner may replay one exact-size graph per row kind), plus cheap state
  operations between rounds. Per-round inputs are small int32 arrays (CUDA: copied into fixed device buffers before
  a graph replay); nothing is a Python object per token.
* Media (Vision). A runner built with the Vision tower (`info.vision`) encodes one prompt image or video at a time:
  `encode_media(item)` takes a `PromptMedia` (bf16 patch rows and grid) and returns its merged vision tokens, float32
  `[len(item.columns), hidden]`, row i for prompt column `item.columns[i]`. A prefill chunk carries the rows of the
  media columns it covers as `embedding_columns` (chunk-relative) and `embedding_rows`: they replace the token
  embeddings there, in the target model and (for the MTP head, which embeds the NEXT token of each column) in the
  MTP input, so a placeholder token is never embedded as itself. The engine decides when to encode (once per item
  per request, only for items the reused prefix does not already cover) and keeps the rows until the item's last
  column is prefilled. A runner without the tower raises `VisionUnavailable` and the engine rejects media prompts.
* Sampling runs inside the runner (§4.8 pipeline, counter-based RNG keyed by seed, position and purpose), and so do
  the §4.7 speculative accept rules, so a round returns token ids, never logits.

Determinism: for a given runner configuration, a row's logits must not depend on which other rows share its call
(batch, verify block or prefill chunk). Greedy output is then identical alone or batched, with or without speculative
decoding or prefix reuse. (The CUDA runner's cuBLAS decode keeps one GEMM shape per configuration for that: see
`backends.cuda.linear.Linear`.)
"""

from __future__ import annotations

import enum
from typing import Protocol

import attrs
import numpy as np

from ninfer.engine.request import PromptMedia
from ninfer.engine.sampler import SamplingParams


class VisionUnavailable(RuntimeError):
    """`encode_media` on a runner built without the Vision tower (the server was started without --vision)."""


class StateSource(enum.Enum):
    """Where a new sequence's running state comes from (`begin_sequence`)."""

    RESET = "reset"  # zero state: the sequence starts at token 0
    RESIDENT = "resident"  # keep the lane's running state and tail: continue at its frontier (append)
    CHECKPOINT = "checkpoint"  # copy checkpoint `slot` (state + hidden row) back into the running state


@attrs.frozen(kw_only=True)
class RunnerInfo:
    lanes: int
    pages: int
    page_tokens: int
    checkpoint_slots: int
    vocab_ids: int
    draft_tokens: int  # k of speculative decoding (MTP or DFlash); 0 when off
    kv_bytes_per_token: int  # shared-pool bytes one token takes (all attention layers, MTP / DFlash included)
    vision: bool = False  # the Vision tower is built: `encode_media` works and prompts may carry media


@attrs.frozen(kw_only=True, eq=False)
class LaneImage:
    """A lane's sequence state copied out to host arrays: what the cold tier parks on a secondary device and restores
    into another lane (serving.md "Cross-GPU cold tier").

    tokens: the KV tokens it covers (the execution frontier E). pages: the page-table entries those tokens fill.
    has_tail: the lane had materialized a token (its tail row is part of the image). arrays: named host arrays in the
    exporting runner's stored formats: every attention layer's KV pages (and the MTP layer's), the recurrent running
    state, every rewrite-checkpoint slot and the tail and checkpoint hidden rows. Only a runner of the same build and
    configuration reads the names; the engine moves the bytes.
    """

    tokens: int
    pages: int
    has_tail: bool
    arrays: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(int(array.nbytes) for array in self.arrays.values())


@attrs.frozen(kw_only=True)
class SequenceStart:
    source: StateSource
    sampling: SamplingParams  # the request's resolved sampler; its penalty counts start empty
    checkpoint_slot: int = -1  # with StateSource.CHECKPOINT


def _int32(value) -> np.ndarray:
    return np.ascontiguousarray(value, dtype=np.int32)


def _rows(value) -> np.ndarray:
    rows = np.ascontiguousarray(value, dtype=np.float32)
    return rows.reshape(0, 0) if rows.size == 0 and rows.ndim != 2 else rows


@attrs.frozen(kw_only=True)
class PrefillChunk:
    """Prompt tokens kv_length..kv_length+T-1 of one lane.

    A `final` chunk samples the first output token (RNG position = prompt length, purpose Prefill) from its last
    column, or from the lane's tail when T == 0 (the whole prompt was reused). An MTP runner also runs the MTP
    head over the chunk, starting one column early (the bridge column kv_length-1 fuses the tail hidden with the
    chunk's first token), and after a final chunk prepares k drafts when `remaining - 1 >= k + 1`; a DFlash runner
    extends the drafter's context by the chunk's columns, and reports drafts ready under the same condition (it
    proposes at the start of the round).

    `embedding_columns` (int32 [n], ascending chunk-relative indices) and `embedding_rows` (float32 [n, hidden]):
    input embeddings that replace the token embeddings of those columns (media placeholders: the Vision output rows).
    The MTP head sees them too, at the column whose next token is a replaced one. Empty for text.
    """

    lane: int
    token_ids: np.ndarray = attrs.field(converter=_int32, eq=False)  # [T]
    positions: np.ndarray = attrs.field(converter=_int32, eq=False)  # [3, T] rope positions
    kv_length: int  # E before the chunk
    tail_position: np.ndarray = attrs.field(converter=_int32, eq=False)  # [3]: position of token E-1
    final: bool
    remaining: int  # output tokens the request may still produce, before this chunk's token
    embedding_columns: np.ndarray = attrs.field(factory=lambda: np.zeros(0, np.int32), converter=_int32, eq=False)
    embedding_rows: np.ndarray = attrs.field(factory=lambda: np.zeros((0, 0), np.float32), converter=_rows, eq=False)

    def __attrs_post_init__(self) -> None:
        columns, rows, count = self.embedding_columns, self.embedding_rows, len(self.token_ids)
        if columns.ndim != 1 or rows.ndim != 2 or rows.shape[0] != columns.shape[0]:
            raise ValueError(f"embedding overrides need columns [n] and rows [n, hidden], got {columns.shape} "
                             f"and {rows.shape}")
        if columns.size and (columns[0] < 0 or columns[-1] >= count or np.any(np.diff(columns) <= 0)):
            raise ValueError(f"embedding columns must be ascending indices inside the chunk's {count} tokens")

    @property
    def has_embeddings(self) -> bool:
        return bool(self.embedding_columns.size)

    def mtp_embeddings(self) -> tuple[np.ndarray, np.ndarray]:
        """The overrides as rows of the chunk's MTP pass: MTP row r embeds the next token of its column, which is
        chunk column r with a bridge row (kv_length > 0) and r + 1 without one (column 0 then has no MTP row)."""
        columns = self.embedding_columns - (0 if self.kv_length > 0 else 1)
        keep = columns >= 0
        return columns[keep], self.embedding_rows[keep]


@attrs.frozen
class PrefillResult:
    token: int  # the sampled first output token, -1 for a non-final chunk
    drafts_ready: bool


@attrs.frozen(kw_only=True)
class DecodeBatch:
    """One decode round over B lanes.

    Row b feeds `input_tokens[b]` at KV index `kv_lengths[b]` and rope position `positions[b]` (all three axes).
    An ordinary row samples one token (RNG position = kv_length, purpose Decode). A `speculative` row verifies the
    lane's k drafts in the same traversal (T = k+1 columns; requires `remaining >= k + 1`), keeps the state after
    the accepted prefix and returns A+1 tokens. An MTP runner keeps every row's MTP KV aligned, and prepares the next
    drafts for speculative rows that can afford another round (`remaining - produced >= k + 1`). A DFlash runner
    proposes a speculative row's drafts at the start of its round (after committing the lane's pending context),
    and leaves every row's committed columns pending for the next call.
    """

    lanes: np.ndarray = attrs.field(converter=_int32, eq=False)
    input_tokens: np.ndarray = attrs.field(converter=_int32, eq=False)
    kv_lengths: np.ndarray = attrs.field(converter=_int32, eq=False)
    positions: np.ndarray = attrs.field(converter=_int32, eq=False)
    speculative: np.ndarray = attrs.field(converter=lambda v: np.ascontiguousarray(v, dtype=bool), eq=False)
    remaining: np.ndarray = attrs.field(converter=_int32, eq=False)

    @property
    def size(self) -> int:
        return len(self.lanes)


@attrs.frozen(kw_only=True)
class DecodeResult:
    tokens: np.ndarray = attrs.field(eq=False)  # int32 [B, k+1]; row b's tokens are tokens[b, :counts[b]]
    counts: np.ndarray = attrs.field(eq=False)  # int32 [B]: 1 for an ordinary row, A+1 for a speculative one
    accepted: np.ndarray = attrs.field(eq=False)  # int32 [B]: drafts accepted (A), 0 for ordinary rows
    drafts_ready: np.ndarray = attrs.field(eq=False)  # bool [B]: drafts prepared for the next round


class ModelRunner(Protocol):
    info: RunnerInfo

    def assign_pages(self, lane: int, page_table: np.ndarray) -> None:
        """Set the lane's page table (int32 page ids, in token order). Pages keep their contents: a table that keeps
        a prefix of the old one keeps that prefix's KV."""

    def begin_sequence(self, lane: int, start: SequenceStart) -> None:
        """Start a request on the lane: choose its running state (reset, resident, or a checkpoint), install its
        sampler with empty penalty counts, and forget drafts and verify columns."""

    def save_checkpoint(self, lane: int, slot: int) -> None:
        """Copy the running recurrent state and the tail hidden row into checkpoint `slot` (the lane's state at E)."""

    def prefill(self, chunk: PrefillChunk) -> PrefillResult: ...

    def encode_media(self, item: PromptMedia) -> np.ndarray:
        """The Vision tower over one item: float32 `[len(item.columns), hidden]` merged tokens, row i for the
        prompt column `item.columns[i]`. Raises VisionUnavailable when the runner was built without the tower."""

    def decode(self, batch: DecodeBatch) -> DecodeResult: ...

    def export_lane(self, lane: int, tokens: int) -> LaneImage:
        """The lane's state for its first `tokens` KV tokens (its frontier), copied out; the lane is unchanged."""

    def import_lane(self, lane: int, image: LaneImage) -> None:
        """Write an exported state into `lane`, whose page table (assigned first) has at least `image.pages` pages:
        the lane then holds that sequence at `image.tokens` (its KV, recurrent state, checkpoints and tail), ready
        for begin_sequence with RESIDENT or CHECKPOINT as if it had computed those tokens itself."""

    def rewind(self, lane: int, kept: int) -> None:
        """Commit only the first `kept` tokens of the lane's last decode round (a stop inside a speculative round):
        the running state, tail and DFlash context become those after verify column kept-1, so E = round E + kept
        is exact."""

    def release(self, lane: int) -> None:
        """Forget the lane's sequence (cancelled or evicted): its state, checkpoints, sampler and page table."""
