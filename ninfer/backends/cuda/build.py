"""Build the CUDA runner for an artifact and an engine configuration, and size the KV pool from what is left.

Order matters for `--kv-capacity auto`: the weights, the per-lane state, the workspace and the inputs are allocated
first (the complete runtime layout except the pool), then the pool takes the free device memory that remains minus
the CUDA-graph allowance and 1 GiB of headroom. An explicit capacity is never reduced: if it does not fit, startup
fails and says by how much. The ledger of every arena goes into the startup report.
"""

from __future__ import annotations

from typing import Any

import attrs

from ninfer.artifact.reader import Artifact
from ninfer.backends.cuda.device import GIB, CudaDevice, Device
from ninfer.backends.cuda.graph_cache import SPARE_GRAPHS
from ninfer.backends.cuda.capacity import Capacity, DEFAULT_SPLIT_K_NORM, PAGE_TOKENS
from ninfer.backends.cuda.model import CudaQwen
from ninfer.backends.cuda.runner import CudaRunner
from ninfer.backends.cuda.vision import CudaVisionTower
from ninfer.backends.cuda.weights import ArtifactDeviceWeights
from ninfer.kernels_numba.gdn import REC_DEFAULT_GROUPS
from ninfer.engine.config import EngineConfig
from ninfer.engine.kv_pool import AUTO_HEADROOM_BYTES, plan_kv_pool
from ninfer.media.prepare import MAX_RAW_PATCHES
from ninfer.models.loader import ArtifactWeights, artifact_dflash_dims, artifact_dims
from ninfer.models.qwen3_6 import build_vision_tower
from ninfer.models.qwen3_6_vision import VisionTower
from ninfer.targets.dims import QwenDims, VisionDims

# Device memory one captured step graph may take (nodes, kernel parameters). Measured on the H200 by the free memory
# before and after capturing one decode graph (bench/cuda_model.py `graph_device_bytes`; 27B and 35B-A3B, 700-930
# kernel nodes, batch 1 and 8): no drop at all, the driver's own reserve held them. 2 MiB (its allocation granule) a
# shape keeps room should that reserve run out, for the pinned decode graphs and the cache's spare shapes both.
GRAPH_ALLOWANCE_PER_SHAPE = 2 << 20


class KvCapacityDoesNotFit(ValueError):
    """An explicit --kv-capacity needs more device memory than is free after everything else."""


@attrs.frozen
class CudaBuild:
    device: Device
    model: CudaQwen
    runner: CudaRunner
    ledger: dict[str, int]  # bytes per arena: weights, state, workspace, inputs, kv
    sizing: dict[str, int | str]  # the KV sizing report (serving.md: policy, capacity, reservation, slack...)


def build_cuda_runner(artifact: Artifact, config: EngineConfig, *, device_index: int = 0, cuda_graphs: bool = True,
                      device: Device | None = None, tensor_core_attention: bool = True,
                      decode_linear: str = "cublas", decode_quant: str = "mma", vision: bool = False,
                      vision_on_device: bool = True, branches: bool | None = None,
                      programmatic_launch: bool = True, narrow_decode: bool | None = None,
                      split_k_norm: int = DEFAULT_SPLIT_K_NORM, conv_in_projection: bool = True,
                      ab_in_recurrence: bool | None = None,
                      recurrence_groups: int = REC_DEFAULT_GROUPS, prefill_buckets: bool = False,
                      direct_quant_experts: bool = False, tensor_core_decode_int8: bool = False) -> CudaBuild:
    """The runner on GPU `device_index`, or on `device` when given (a `HostDevice` runs the same code on the
    kernels' NumPy twins). `tensor_core_attention`, `decode_linear`, `decode_quant`, `branches`,
    `programmatic_launch`, `narrow_decode`, `split_k_norm`, `conv_in_projection`, `ab_in_recurrence`,
    `recurrence_groups`, `prefill_buckets`, `direct_quant_experts`, `tensor_core_decode_int8`: see `Capacity`.
    `vision` builds the Vision tower: on the GPU (`CudaVisionTower`, its scratch arena sized for the largest item
    serving admits: `vision_max_patches`), or on the host with `vision_on_device=False`."""
    dims = artifact_dims(artifact)
    if not isinstance(dims, QwenDims):
        raise TypeError(f"the CUDA backend serves Qwen3.6 models; {artifact.model_id} is {type(dims).__name__}")
    spec = config.spec or "mtp"  # the drafter is irrelevant without drafts
    drafter = artifact_dflash_dims(artifact) if config.draft_tokens and spec == "dflash" else None
    if config.draft_tokens and spec == "dflash" and drafter is None:
        raise ValueError(f"{artifact.model_id}: the artifact has no DFlash drafter (no dflash/... weights)")
    device = device if device is not None else CudaDevice(device_index)
    capacity = Capacity(lanes=config.max_concurrency, max_context=config.max_context, kv_dtype=config.kv_dtype,
                        prefill_rows=config.prefill_chunk, draft_tokens=config.draft_tokens,
                        draft_head=config.lm_head_draft, spec=spec, tensor_core_attention=tensor_core_attention,
                        decode_linear=decode_linear, decode_quant=decode_quant, branches=branches,
                        programmatic_launch=programmatic_launch, narrow_decode=narrow_decode,
                        split_k_norm=split_k_norm, conv_in_projection=conv_in_projection,
                        ab_in_recurrence=ab_in_recurrence, recurrence_groups=recurrence_groups,
                        prefill_buckets=prefill_buckets, direct_quant_experts=direct_quant_experts,
                        tensor_core_decode_int8=tensor_core_decode_int8)
    model = CudaQwen(dims, ArtifactDeviceWeights(artifact, device), device, capacity, dflash=drafter)
    tower = build_vision_tower(dims, ArtifactWeights(artifact)) if vision else None
    if tower is not None and vision_on_device:
        tower = CudaVisionTower(tower, device, max_patches=vision_max_patches(dims.vision, config))
    return finish_build(device, model, config, cuda_graphs=cuda_graphs, vision_tower=tower)


def vision_max_patches(vision: VisionDims, config: EngineConfig) -> int:
    """Raw patches of the largest Vision item serving admits: within the media envelope, and its merged tokens
    (merge^2 patches each) within the context."""
    return min(MAX_RAW_PATCHES, vision.spatial_merge * vision.spatial_merge * config.max_context)


def finish_build(device: Device, model: CudaQwen, config: EngineConfig, *, cuda_graphs: bool,
                 vision_tower: VisionTower | CudaVisionTower | None = None) -> CudaBuild:
    """Size and allocate the KV pool on a model whose other arenas are allocated, build the runner and capture its
    decode graphs and its full-size prefill chunk's pieces. The page count is a direct calculation: free memory after
    the weights, minus the exact bytes of the rest of the runtime layout (lane state, workspace, inputs: the
    ledger), the graph allowance and 1 GiB."""
    capacity = model.capacity
    # the prefill chunks' pieces (the full size's and each bucket's): one graph before each attention layer's
    # attention and one after the last
    attention_layers = sum(layer.attention is not None for layer in model.layers)
    prefill_pieces = len(model.captured_prefill_rows()) * (attention_layers + 1)
    graph_allowance = (GRAPH_ALLOWANCE_PER_SHAPE * (capacity.lanes + prefill_pieces + SPARE_GRAPHS) if cuda_graphs
                       else 0)
    reservation = sum(size for purpose, size in device.ledger.items() if purpose not in ("weights", "kv"))
    per_token = model.kv_bytes_per_token
    plan = plan_kv_pool(kv_capacity=config.kv_capacity, max_context=config.max_context, lanes=capacity.lanes,
                        bytes_per_token=per_token, memory_budget=model.free_after_weights,
                        reserved_bytes=reservation + graph_allowance)
    pool_bytes = plan.pages * PAGE_TOKENS * per_token
    available = model.free_after_weights - reservation - graph_allowance
    if pool_bytes > available:
        raise KvCapacityDoesNotFit(
            f"a KV pool of {plan.pages * PAGE_TOKENS} tokens needs {pool_bytes / GIB:.2f} GiB, but only "
            f"{available / GIB:.2f} GiB are free on the GPU after the weights, lane state and workspace")
    model.allocate_kv(plan.pages)
    runner = CudaRunner(model, draft_tokens=config.draft_tokens, lm_head_draft=config.lm_head_draft,
                        cuda_graphs=cuda_graphs, vision_tower=vision_tower)
    device.synchronize()
    before_graphs = device.info.free_bytes
    if cuda_graphs:
        runner.capture_decode_graphs()
        runner.capture_prefill_graph()
    device.synchronize()
    free_after = device.info.free_bytes
    return CudaBuild(device=device, model=model, runner=runner, ledger=dict(device.ledger),
                     sizing={"policy": plan.policy, "pages": plan.pages, "capacity_tokens": plan.pages * PAGE_TOKENS,
                             "bytes_per_token": per_token, "pool_bytes": pool_bytes,
                             "free_after_weights_bytes": model.free_after_weights,
                             "runtime_reservation_bytes": reservation, "graph_allowance_bytes": graph_allowance,
                             "headroom_bytes": AUTO_HEADROOM_BYTES if plan.policy == "auto" else 0,
                             "planned_slack_bytes": available - pool_bytes,
                             "free_after_startup_bytes": free_after,
                             "observed_graph_bytes": max(0, before_graphs - free_after)})


def describe(build: CudaBuild) -> dict[str, Any]:
    """The sizing ledger for the startup line and the server_start record, and what the kernel cache did (how many
    of the kernels the startup launched were loaded, how many compiled)."""
    from ninfer.kernels_numba import kernel_cache

    info = build.device.info
    return {"device": {"index": info.index, "name": info.name, "total_bytes": info.total_bytes,
                       "multiprocessors": info.multiprocessors},
            "arenas_bytes": build.ledger, "kv_sizing": build.sizing, "kernel_cache": kernel_cache.report()}
