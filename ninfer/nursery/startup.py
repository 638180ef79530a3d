"""What startup builds before the first request is served: the checks of what this build can do, the model stack
(artifact -> model -> CPU runner -> Engine, and the prompt builder; with --vision also the Vision tower and the media
preparer; with --spec dflash the DFlash drafter), and the warm-up generation."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from ninfer.artifact.reader import Artifact
from ninfer.engine.cold_tier import ColdTier
from ninfer.engine.engine import Engine
from ninfer.engine.request import PreparedPrompt, RequestOptions, StopTokenPolicy
from ninfer.frontend.generation_config import model_stop_ids
from ninfer.frontend.prompt import PromptBuilder, PromptOptions
from ninfer.nursery.engine_bridge import submit
from ninfer.nursery.options import ServeOptions
from ninfer.targets.registry import Target, lookup_target

if TYPE_CHECKING:
    from ninfer.media.prepare import MediaPreparer

log = logging.getLogger(__name__)

WARM_UP_MESSAGE = "hi"
WARM_UP_TOKENS = 4
FP32_BYTES = 4  # the CPU models dequantize every weight to fp32


class StartupError(RuntimeError):
    """The server cannot start; the message says why (an artifact it cannot serve, a KV pool that cannot work...)."""


def unsupported_options(options: ServeOptions) -> list[str]:
    """Options the parser accepts but this machine or build cannot honour, each with what is missing.
    --no-cuda-graph needs nothing on the CPU backend (it has no graphs), and the default cold tier is simply
    inactive without secondary GPUs (serving.md: the tier is best-effort)."""
    from ninfer.backends.cuda_probe import cuda_device_count

    problems = []
    devices = cuda_device_count()
    if options.device != 0 and options.device >= devices:
        problems.append(f"--device {options.device} needs the CUDA backend on a machine with at least "
                        f"{options.device + 1} NVIDIA GPUs; this one has {devices} usable (the CPU backend stands in "
                        f"for device 0 only)")
    pinned = options.cold_tier_device
    if pinned >= 0 and not options.no_cold_tier and (pinned >= devices or pinned == options.device):
        problems.append(f"--cold-tier-device {pinned} needs a secondary CUDA device; this machine has {devices} "
                        f"usable GPU(s) and GPU {options.device} is the primary (use the default -1 or "
                        f"--no-cold-tier)")
    return problems


def weights_bytes(artifact: Artifact, *, vision: bool = True, dflash: bool = True) -> int:
    """Resident weight bytes once the CPU model has dequantized every tensor (the Vision tower's only with
    `vision`, the DFlash drafter's only with `dflash`: otherwise they are never read)."""
    from ninfer.models.loader import DFLASH_PREFIX, VISION_PREFIX

    skipped = tuple(prefix for prefix, wanted in ((VISION_PREFIX, vision), (DFLASH_PREFIX, dflash)) if not wanted)
    return sum(math.prod(entry.shape) * FP32_BYTES for entry in artifact.objects
               if entry.kind == "tensor" and not entry.name.startswith(skipped))


def dflash_problem(options: ServeOptions, artifact: Artifact, dims: Any) -> str | None:
    """Why --spec dflash cannot serve this artifact (of dimensions `dims`) with these options, None when it can:
    DFlash is the text-only drafter of the 35B-A3B target and the artifact must carry it (both backends run it)."""
    from ninfer.models.loader import artifact_dflash_dims
    from ninfer.targets.dims import QwenDims

    if options.vision:
        return "--spec dflash cannot be combined with --vision (DFlash is text-only)"
    if not isinstance(dims, QwenDims) or not dims.is_moe:
        return (f"--spec dflash needs the 35B-A3B (MoE) target, whose drafter it is; {artifact.model_id} is a dense "
                f"model (use --spec mtp)")
    if artifact_dflash_dims(artifact) is None:
        return (f"--spec dflash needs the DFlash drafter, and the artifact ({artifact.model_id}) has none (no "
                f"dflash/... objects): convert the checkpoint with `ninfer convert ... --dflash-model DIR`, or use "
                f"--spec mtp")
    return None


IMAGE_PREPROCESSOR_RESOURCE = "frontend/preprocessor_config.json"
VIDEO_PREPROCESSOR_RESOURCE = "frontend/video_preprocessor_config.json"


def _preprocessor_json(artifact: Artifact, name: str) -> dict[str, Any]:
    if name not in artifact:
        return {}
    data = json.loads(artifact.resource(name))
    if not isinstance(data, dict):
        raise ValueError(f"{name} is not a JSON object")
    return data


def build_media_preparer(artifact: Artifact, options: ServeOptions, vision: Any) -> Any:
    """The media preparer --vision serves with: the artifact's image and video preprocessor configs (their patch
    geometry taken from the model's Vision dimensions, which the tower's input must match), the prepared-media
    cache sized by --media-cache-mib / --media-live-mib, --media-preprocess-threads workers, and the Vision token
    budget min(--max-context, 32768)."""
    from ninfer.media.cache import PreparedMediaCache
    from ninfer.media.image import ImagePreprocessConfig
    from ninfer.media.prepare import MediaBudgets, MediaPreparer
    from ninfer.media.video import VideoPreprocessConfig

    geometry = dict(patch_size=vision.patch, temporal_patch_size=vision.temporal_patch,
                    merge_size=vision.spatial_merge)
    image = ImagePreprocessConfig.from_dict(_preprocessor_json(artifact, IMAGE_PREPROCESSOR_RESOURCE))
    video = VideoPreprocessConfig.from_dict(_preprocessor_json(artifact, VIDEO_PREPROCESSOR_RESOURCE))
    for name, config in (("image", image), ("video", video)):
        found = {key: getattr(config, key) for key in geometry}
        if found != geometry:
            log.warning("the %s preprocessor config's patch geometry %s differs from the Vision tower's %s; "
                        "using the tower's", name, found, geometry)
    cache = PreparedMediaCache.from_mib(options.media_cache_mib, options.media_live_mib)
    return MediaPreparer(cache, threads=options.media_preprocess_threads,
                         image_config=dataclasses.replace(image, **geometry),
                         video_config=dataclasses.replace(video, **geometry),
                         budgets=MediaBudgets.for_context(options.max_context))


def build_cold_tier(options: ServeOptions, on_gpu: bool) -> ColdTier:
    """The cross-GPU cold tier: arenas on the secondary GPUs (none with one GPU, on the CPU backend or with
    --no-cold-tier: then inactive). Best effort, like the tier itself: an arena that cannot be built is logged and
    the tier goes without it."""
    from ninfer.backends.cuda_probe import cuda_device_count

    if options.no_cold_tier or not on_gpu or cuda_device_count() < 2:
        return ColdTier([])
    from ninfer.backends.cuda.cold_arena import build_cold_arenas

    try:
        arenas, staging = build_cold_arenas(primary=options.device, devices=cuda_device_count(),
                                            pinned=options.cold_tier_device, capacity_mib=options.cold_tier_capacity_mib,
                                            staging_mib=options.cold_tier_staging_mib)
    except (RuntimeError, ValueError, OSError) as exc:
        log.warning("cold tier disabled: %s", exc)
        return ColdTier([])
    tier = ColdTier(arenas)
    if arenas:
        log.info("cold tier: %d arena(s) on GPU %s, %.2f GiB in all, %d MiB pinned staging", len(arenas),
                 ",".join(str(arena.device) for arena in arenas), tier.capacity_bytes / 2**30,
                 staging.nbytes >> 20)
    return tier


def available_memory_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@attrs.frozen(kw_only=True)
class ModelStack:
    artifact_path: Path
    artifact: Artifact
    target: Target
    model: Any
    runner: Any  # the runner the engine drives (CPU or CUDA)
    engine: Engine  # not started
    prompt_builder: PromptBuilder
    stop_ids: frozenset[int]
    public_model_id: str
    weights_bytes: int
    memory_budget: int | None  # what --kv-capacity auto sized the KV pool from (None otherwise)
    load_seconds: float
    cuda: dict[str, Any] | None = None  # the CUDA build's device, arenas and KV sizing report (None on the CPU)
    media_preparer: MediaPreparer | None = None  # --vision: prepares a request's images and videos (None without)


def load_model_stack(options: ServeOptions, artifact_path: Path) -> ModelStack:
    """Open the artifact and build everything that serves it (blocking; run it off the trio thread). Qwen artifacts
    run on the CUDA backend when an NVIDIA GPU is usable; everything else (and a machine without one) on the CPU."""
    from ninfer.backends.cuda_probe import cuda_device_count
    from ninfer.models.loader import artifact_dims, has_vision_weights
    from ninfer.targets.dims import QwenDims

    began = time.perf_counter()
    media_preparer = None
    try:
        artifact = Artifact.open(artifact_path)
        dims = artifact_dims(artifact)
        on_gpu = isinstance(dims, QwenDims) and cuda_device_count() > options.device
        dflash = options.spec == "dflash"
        problem = dflash_problem(options, artifact, dims) if dflash else None
        if problem is not None:
            raise StartupError(f"cannot serve {artifact_path}: {problem}")
        if options.vision and not has_vision_weights(artifact):
            raise StartupError(f"cannot serve {artifact_path} with --vision: the artifact ({artifact.model_id}) has "
                               f"no Vision tower weights (vision/...); convert a checkpoint with its vision tower, "
                               f"or start without --vision")
        target = lookup_target(artifact.model_id)
        builder = PromptBuilder.from_artifact(artifact)
        config = options.engine_config()
        if on_gpu:
            from ninfer.backends.cuda.build import build_cuda_runner, describe
            from ninfer.kernels_numba import kernel_cache

            build = build_cuda_runner(artifact, config, device_index=options.device,
                                      cuda_graphs=not options.no_cuda_graph, vision=options.vision)
            model, runner, cuda = build.model, build.runner, describe(build)
            weights, budget = build.ledger["weights"], int(build.sizing["free_after_weights_bytes"])
            log.info("CUDA %s: weights %.2f GiB, KV pool %s tokens (%s), free after startup %.2f GiB; kernel cache "
                     "%s: %s", cuda["device"]["name"], weights / 2**30, build.sizing["capacity_tokens"],
                     build.sizing["policy"], int(build.sizing["free_after_startup_bytes"]) / 2**30,
                     cuda["kernel_cache"]["directory"] or "off", kernel_cache.COUNTS.summary())
        else:
            from ninfer.backends.cpu.runner import build_cpu_runner
            from ninfer.models.loader import build_model

            model, cuda = build_model(artifact, vision=options.vision, dflash=dflash), None
            weights = weights_bytes(artifact, vision=options.vision, dflash=dflash)
            budget = available_memory_bytes() - weights if options.kv_capacity == "auto" else None
            runner = build_cpu_runner(model, config, memory_budget=budget)
        engine = Engine(runner, config, target.sampling, cold_tier=build_cold_tier(options, cuda is not None))
        if options.vision:
            media_preparer = build_media_preparer(artifact, options, dims.vision)
    except StartupError:
        raise
    except (OSError, ValueError, LookupError, TypeError, RuntimeError) as exc:  # artifact, target, sizing, device
        raise StartupError(f"cannot serve {artifact_path}: {exc}") from exc
    return ModelStack(artifact_path=artifact_path, artifact=artifact, target=target, model=model, runner=runner,
                      engine=engine, prompt_builder=builder, stop_ids=model_stop_ids(artifact),
                      public_model_id=options.model_id or artifact.model_id, weights_bytes=weights,
                      memory_budget=budget, load_seconds=time.perf_counter() - began, cuda=cuda,
                      media_preparer=media_preparer)


async def warm_up(stack: ModelStack, options: ServeOptions) -> float | None:
    """One tiny generation through the whole path (the first one pays for dequantizing every weight). Its seconds,
    or None when it failed: a failed warm-up is logged and ignored, as the real requests will show the problem."""
    began = time.perf_counter()
    try:
        text = stack.prompt_builder.build([{"role": "user", "content": WARM_UP_MESSAGE}],
                                          PromptOptions(thinking=options.default_thinking))
        prompt = PreparedPrompt(token_ids=text.ids, thinking=text.thinking)
        request = submit(stack.engine, prompt, RequestOptions(max_tokens=WARM_UP_TOKENS),
                         StopTokenPolicy(stack.stop_ids))
        try:
            async for event in request.events():
                if event.error is not None:
                    raise RuntimeError(event.error)
        finally:
            request.close()
    except Exception as exc:
        log.warning("warm-up generation failed (ignored): %s", exc)
        return None
    return time.perf_counter() - began


def _kv_policy(options: ServeOptions) -> str:
    if options.kv_capacity is None:
        return "max_context"
    return "auto" if options.kv_capacity == "auto" else "explicit"


def server_start_record(options: ServeOptions, stack: ModelStack, warm_up_seconds: float | None) -> dict[str, Any]:
    """The request log's server_start event: what is served, how, and on what."""
    from ninfer.observability.request_log import redact_argv

    config = stack.engine.config
    info = stack.runner.info
    kv_pool_bytes = info.pages * info.page_tokens * info.kv_bytes_per_token
    presets = stack.target.sampling
    kv_sizing = {"policy": _kv_policy(options), "pages": info.pages, "page_tokens": info.page_tokens,
                 "capacity_tokens": info.pages * info.page_tokens, "bytes_per_token": info.kv_bytes_per_token,
                 "pool_bytes": kv_pool_bytes, "memory_budget_bytes": stack.memory_budget}
    if stack.cuda is None:
        from ninfer.backends.cpu.runner import runner_state_bytes

        backend = "cpu"
        arenas = {"weights": stack.weights_bytes,
                  "sequence_state": runner_state_bytes(stack.model, config.max_concurrency, config.draft_tokens,
                                                       config.spec or "mtp"),
                  "kv_pool": kv_pool_bytes, "workspace": 0, "request_transient": 0}
        graphs = {"enabled": False, "observed_bytes": 0, "allowance_bytes": 0}  # the CPU backend has none
        environment = {"backend": "cpu", "cuda": None, "gpus": []}
        cold_reason = "no secondary GPU (CPU backend)"
    else:
        backend, ledger = "cuda", stack.cuda["arenas_bytes"]
        arenas = {"weights": ledger.get("weights", 0), "sequence_state": ledger.get("state", 0),
                  "kv_pool": ledger.get("kv", 0), "workspace": ledger.get("workspace", 0) + ledger.get("inputs", 0),
                  "request_transient": 0}
        kv_sizing.update(stack.cuda["kv_sizing"])
        graphs = {"enabled": not options.no_cuda_graph, "observed_bytes": kv_sizing.get("observed_graph_bytes", 0),
                  "allowance_bytes": kv_sizing.get("graph_allowance_bytes", 0)}
        environment = {"backend": "cuda", "cuda": stack.cuda["device"], "gpus": [stack.cuda["device"]["name"]]}
        cold_reason = "the cold tier is not implemented yet"
    return {
        "target": {"model_id": stack.target.model_id, "family": stack.target.family,
                   "description": stack.target.description},
        "weights": {"artifact": str(stack.artifact_path), "artifact_bytes": stack.artifact.file_size,
                    "model_id": stack.artifact.model_id, "public_model_id": stack.public_model_id},
        "engine": {"backend": backend, **attrs.asdict(config, recurse=True)},
        "sampling": {"thinking": attrs.asdict(presets.thinking), "non_thinking": attrs.asdict(presets.non_thinking),
                     "process_overrides": attrs.asdict(config.sampling), "greedy": config.greedy},
        "thinking_defaults": {"thinking": options.default_thinking, "preserve_thinking": options.preserve_thinking},
        "arenas_bytes": arenas,
        "kv_sizing": kv_sizing,
        "cuda_graph": graphs,
        "cold_tier": {"active": False, "reason": cold_reason if not options.no_cold_tier else "--no-cold-tier"},
        "environment": {**environment, "python": platform.python_version(), "numpy": np.__version__,
                        "platform": platform.platform(), "cpu_count": os.cpu_count()},
        "admission": {"max_concurrency": options.max_concurrency,
                      "max_pending_requests": options.max_pending_requests,
                      "pending_timeout_ms": options.pending_timeout_ms, "max_request_mib": options.max_request_mib},
        "load_seconds": stack.load_seconds,
        "warm_up_seconds": warm_up_seconds,
        "argv": redact_argv(options.argv),
    }
