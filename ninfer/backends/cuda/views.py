"""Device arrays that remember their views.

numba builds each slice or reshape of a device array in Python: a walk over a dummy array's extents and a CUDA
context check, ~50 us per slice on the H200 machine (cProfile of the Vision tower), longer than most of the kernels
the views feed. The model slices the same workspace buffers with the same few row counts at every layer of every
step, so an eager prefill chunk of the 27B paid for thousands of them. A `ViewMemoArray` builds each distinct view
once and hands the same view object back afterwards; element reads (which copy a value to the host) are never
remembered.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ninfer.kernels_numba.numba_setup import cuda  # the numpy shim comes before numba

DeviceNDArray = cuda.cudadrv.devicearray.DeviceNDArray

VIEWS_PER_ARRAY = 256  # a bound for callers that slice with ever new bounds (prefill chunks of any length)


def _integer(value: Any) -> int | None:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    return None


def _index_key(item: Any) -> Any:
    """A hashable stand-in for an index made of slices and integers (slices are not hashable before Python 3.12),
    or None for anything else (arrays, Ellipsis, None), whose views are then built every time."""
    if isinstance(item, slice):
        bounds = (item.start, item.stop, item.step)
        keys = tuple("-" if b is None else _integer(b) for b in bounds)
        return None if None in keys else ("slice", *keys)
    if isinstance(item, tuple):
        parts = tuple(_index_key(part) for part in item)
        return None if None in parts else ("tuple", *parts)
    return _integer(item)


class ViewMemoArray(DeviceNDArray):
    """A DeviceNDArray whose slices, reshapes and dtype views are built once (views of it are ViewMemoArrays too).
    Remembered views are also what makes `fast_launch` cheap: it works out an array's launch slots once per
    object."""

    def _views(self) -> dict:
        views = self.__dict__.get("_memo")
        if views is None or len(views) >= VIEWS_PER_ARRAY:
            views = self.__dict__["_memo"] = {}
        return views

    def __getitem__(self, item: Any) -> Any:
        key = _index_key(item)
        if key is None:
            return super().__getitem__(item)
        views = self._views()
        view = views.get(key)
        if view is None:
            view = super().__getitem__(item)
            if not isinstance(view, DeviceNDArray):  # an element read: a value, read again next time
                return view
            views[key] = view
        return view

    def reshape(self, *shape: Any, **kwargs: Any) -> Any:
        if kwargs:
            return super().reshape(*shape, **kwargs)
        key = ("reshape", *(shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape))
        views = self._views()
        view = views.get(key)
        if view is None:
            view = views[key] = super().reshape(*shape)
        return view

    def view(self, dtype: Any) -> Any:
        """The same bytes as another dtype (the kernels' unused-output stand-ins view fp32 outputs as uint16)."""
        key = ("view", np.dtype(dtype).str)
        views = self._views()
        view = views.get(key)
        if view is None:
            view = views[key] = remembering_views(super().view(dtype))  # (numba's is a plain DeviceNDArray)
        return view


def remembering_views(array: DeviceNDArray) -> ViewMemoArray:
    """The same device memory as a ViewMemoArray."""
    return ViewMemoArray(shape=array.shape, strides=array.strides, dtype=array.dtype, gpu_data=array.gpu_data,
                         stream=array.stream)
