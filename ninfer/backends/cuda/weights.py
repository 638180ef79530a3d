"""Model weights on the device, read by ninfer name: from an artifact (uploaded once), or random at a model's real
shapes (generated on the GPU, for benchmarks).

Matrices stay in their artifact format: bf16 as uint16 bit arrays, the ninfer-v2 formats as `QuantWeight`s that the
quantized kernels read, or, with `quant_layout = "mma"`, in the tensor-core layout of `kernels_numba.quant_mma`
(stacked MoE expert matrices too, when their rows are whole 16-row tiles). Several tensors that one projection reads
together (the 27B's `query_key` + `gate_value`) are concatenated by rows without decoding (`codec.concat_rows`). Norm
vectors and small parameters are fp32.
"""

from __future__ import annotations

from typing import Any, Protocol, Union

import attrs
import numpy as np

from ninfer.artifact import codec
from ninfer.artifact.formats import BF16, QUANT_FORMATS
from ninfer.artifact.reader import Artifact
from ninfer.backends.cuda.device import Device


@attrs.frozen
class Bf16Matrix:
    data: Any  # device uint16 [N, K]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@attrs.frozen
class SplitMatrix:
    """Row blocks of one projection stored in different formats (the 27B ninfer-v2 recipe stores `query_key` in Q4
    and `gate_value` in Q5): each block is its own matrix; their outputs are joined side by side."""

    parts: tuple[Any, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(part.shape[0] for part in self.parts), self.parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


Matrix = Union[Bf16Matrix, SplitMatrix, Any]  # or a quantized weight of the device's kernel set (it carries `fmt`)


class DeviceWeights(Protocol):
    quant_layout: str  # quantized matrices for "simt" (quant_linear) or "mma" (quant_mma) decode kernels

    def has(self, name: str) -> bool: ...

    def matrix(self, *names: str, gathered: bool = False, swiglu_rows: int = 0) -> Matrix:
        """The row-wise concatenation of the named [N_i, K] tensors, in their stored format (`gathered`: the
        stacked experts the gathered MoE kernels read, see `tensor_core_layout`). `swiglu_rows`: the rows are SwiGLU
        gate|up blocks of that many rows, which a tensor-core matrix stores in `quant_mma.swiglu_order` for the fused
        epilogue when `swiglu_layout` allows (the matrix's `swiglu_rows` then says so; 0 otherwise)."""

    def table(self, name: str) -> Any:
        """An embedding table [V, H]: bf16 bits when stored as BF16, else its exact fp32 decoding (a quantized
        value has more significant bits than bf16 holds). Gathers read single rows, so the width costs memory only."""

    def vector(self, name: str) -> Any:
        """A small tensor as fp32 on the device (any shape)."""

    def host(self, name: str) -> np.ndarray:
        """A small tensor decoded on the host (fp32, or int32 for I32 tensors)."""


def tensor_core_layout(quant_layout: str, shape: tuple[int, int], gathered: bool) -> bool:
    """Whether a quantized matrix goes to the device in the tensor-core layout: K in whole 64-column blocks, and for
    stacked experts whole 16-row tiles (the gathered kernel reads an expert as tiles of the stacked layout; the rows
    per expert, unknown here, are checked by its launcher)."""
    from ninfer.kernels_numba.quant_mma import BLOCK, TILE_ROWS

    return quant_layout == "mma" and shape[1] % BLOCK == 0 and (not gathered or shape[0] % TILE_ROWS == 0)


def swiglu_layout(swiglu_rows: int, shape: tuple[int, int]) -> int:
    """The gate|up block rows a tensor-core matrix of `shape` is stored interleaved by (`quant_mma.swiglu_order`),
    or 0: whole blocks of whole tile pairs, and half a block (the units) in whole 64-column x-fragment blocks."""
    from ninfer.kernels_numba.quant_mma import BLOCK, TILE_ROWS

    fits = swiglu_rows > 0 and shape[0] % swiglu_rows == 0 and swiglu_rows % (2 * TILE_ROWS) == 0 and (
        swiglu_rows // 2) % BLOCK == 0
    return swiglu_rows if fits else 0


class ArtifactDeviceWeights:
    def __init__(self, artifact: Artifact, device: Device) -> None:
        self._artifact, self._device = artifact, device
        self.quant_layout = "simt"

    def has(self, name: str) -> bool:
        return name in self._artifact

    def matrix(self, *names: str, gathered: bool = False, swiglu_rows: int = 0) -> Matrix:
        views = [self._artifact.tensor(name) for name in names]
        if len({view.format for view in views}) != 1:
            return SplitMatrix(tuple(self.matrix(name, gathered=gathered) for name in names))
        fmt = views[0].format
        parts = [(view.shape, np.frombuffer(view.raw, dtype=np.uint8)) for view in views]
        shape, payload = parts[0] if len(parts) == 1 else codec.concat_rows(fmt, parts)
        if fmt == BF16:
            return Bf16Matrix(self._device.upload(payload.view(np.uint16).reshape(shape), "weights"))
        if fmt in QUANT_FORMATS:
            kernels = self._device.kernels
            if tensor_core_layout(self.quant_layout, tuple(shape), gathered):
                weight = kernels.upload_quant_mma(fmt, tuple(shape), payload,
                                                  swiglu_rows=swiglu_layout(swiglu_rows, tuple(shape)))
            else:
                weight = kernels.upload_quant_weight(fmt, tuple(shape), payload)
            self._device.ledger["weights"] += weight.nbytes
            return weight
        # Any other float format (FP32 matrices are rare): round to bf16 once.
        decoded = np.concatenate([view.to_numpy() for view in views])
        return Bf16Matrix(self._device.upload(codec.f32_to_bf16_bits(decoded), "weights"))

    def table(self, name: str) -> Any:
        view = self._artifact.tensor(name)
        if view.format == BF16:
            return self._device.upload(np.frombuffer(view.raw, dtype=np.uint16).reshape(view.shape), "weights")
        rows = view.shape[0]
        out = self._device.empty(view.shape, np.float32, "weights")
        step = max(1, (64 << 20) // (4 * view.shape[1]))
        for start in range(0, rows, step):  # bounded host memory: decode a block of rows at a time
            count = min(step, rows - start)
            self._device.write(out[start : start + count], view.rows(start, count))
        return out

    def vector(self, name: str) -> Any:
        return self._device.upload(self.host(name).astype(np.float32), "weights")

    def host(self, name: str) -> np.ndarray:
        return self._artifact.tensor(name).to_numpy()


class RandomDeviceWeights:
    """Every tensor of a Qwen inventory, uniform random, generated on the GPU in its recipe's format.

    bf16 matrices are filled on the device. Quantized matrices get random code planes and small positive scales:
    one host payload per distinct (format, shape), repacked once and uploaded per tensor (distinct device copies,
    so timing reads real HBM traffic, not cache). Values keep activations bounded (norm weights near 0 for offset
    norms)."""

    def __init__(self, specs: list[Any], recipe: str, device: Device, *, seed: int = 0) -> None:
        from ninfer.convert.plan import recipe_format

        self._specs = {spec.name: spec for spec in specs}
        self._format = {spec.name: recipe_format(recipe, spec) for spec in specs}
        self._device, self._seed = device, seed
        self.quant_layout = "simt"
        self._planes: dict[tuple[str, tuple[int, ...], bool], dict[str, np.ndarray]] = {}

    def has(self, name: str) -> bool:
        return name in self._specs

    def _next_seed(self) -> int:
        self._seed += 1
        return self._seed

    def matrix(self, *names: str, gathered: bool = False, swiglu_rows: int = 0) -> Matrix:
        if len({self._format[name] for name in names}) != 1:
            return SplitMatrix(tuple(self.matrix(name, gathered=gathered) for name in names))
        shapes = [self._specs[name].shape for name in names]
        fmt = self._format[names[0]]
        shape = (sum(s[0] for s in shapes), shapes[0][1])
        if fmt in QUANT_FORMATS:
            kernels, mma = self._device.kernels, tensor_core_layout(self.quant_layout, shape, gathered)
            from ninfer.kernels_numba.quant_mma import TILE_ROWS

            swiglu = swiglu_layout(swiglu_rows, shape)  # random codes: the stored row order is immaterial
            if mma and shape[0] % TILE_ROWS == 0:  # generated on the device
                weight = kernels.random_quant_mma_weight(fmt, shape, seed=self._next_seed(),
                                                         stream=self._device.stream, swiglu_rows=swiglu)
            else:
                planes = self._random_planes(fmt, shape, mma)
                weight = (kernels.upload_quant_mma_planes(fmt, shape, planes, swiglu_rows=swiglu) if mma
                          else kernels.upload_quant_planes(fmt, shape, planes))
            self._device.ledger["weights"] += weight.nbytes
            return weight
        data = self._device.empty(shape, np.uint16, "weights")
        self._device.kernels.fill_uniform(data, seed=self._next_seed(), scale=0.02, stream=self._device.stream)
        return Bf16Matrix(data)

    def table(self, name: str) -> Any:
        spec = self._specs[name]
        data = self._device.empty(spec.shape, np.uint16 if self._format[name] == BF16 else np.float32, "weights")
        self._device.kernels.fill_uniform(data, seed=self._next_seed(), scale=0.02, stream=self._device.stream)
        return data

    def vector(self, name: str) -> Any:
        return self._device.upload(self.host(name), "weights")

    def host(self, name: str) -> np.ndarray:
        spec = self._specs[name]
        rng = np.random.default_rng(self._next_seed())
        if name.endswith("token_ids"):
            return np.arange(spec.shape[0], dtype=np.int32)
        if name.endswith("a_log"):
            return rng.uniform(-1.0, 0.5, spec.shape).astype(np.float32)
        if name.endswith("dt_bias"):
            return rng.uniform(-1.0, 1.0, spec.shape).astype(np.float32)
        if name.endswith("convolution"):
            return rng.uniform(-0.3, 0.3, spec.shape).astype(np.float32)
        return rng.uniform(-0.1, 0.1, spec.shape).astype(np.float32)

    def _random_planes(self, fmt: str, shape: tuple[int, int], mma: bool) -> dict[str, np.ndarray]:
        """A random payload per distinct (format, shape, layout), repacked once into the kernels' planes (the
        layouts the device does not fill itself)."""
        from ninfer.kernels_numba.fill import random_quant_payload

        key = (fmt, shape, mma)
        if key not in self._planes:
            payload = random_quant_payload(fmt, shape, seed=len(self._planes) + 1)
            kernels = self._device.kernels
            self._planes[key] = (kernels.repack_quant_mma if mma else kernels.repack_quant)(fmt, shape, payload)
        return self._planes[key]


def is_quantized(matrix: Any) -> bool:
    """A ninfer-v2 matrix: the kernel set's quantized weight, which carries its storage format."""
    return getattr(matrix, "fmt", None) in QUANT_FORMATS


def row_blocks(matrix: Matrix) -> tuple:
    """The matrices a projection is stored as: a split projection's row blocks, or the matrix itself."""
    return tuple(matrix.parts) if isinstance(matrix, SplitMatrix) else (matrix,)


def tensor_core(matrix: Any) -> bool:
    """A quantized matrix stored in the tensor-core layout (`quant_mma`)."""
    return bool(getattr(matrix, "tensor_core", False))


def is_matrix(value: Any) -> bool:
    return isinstance(value, (Bf16Matrix, SplitMatrix)) or is_quantized(value)
