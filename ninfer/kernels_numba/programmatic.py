"""Programmatic dependent launch (PDL, sm_90): a kernel may start while the kernel before it on the stream finishes.

Why: a decode step is hundreds of short kernels (a 35B-A3B step ~750, most under 10 us), and each one pays its launch
and the DRAM latency of its first loads after the one before has drained. Launched programmatically, a kernel's
blocks become resident as soon as every block of the kernel before has called `allow_dependents`; they can compute
addresses and start loading what no earlier kernel writes (the weights), and `wait_for_prior_grids` holds them until
the kernels before have completed and their memory is visible. Without a programmatic launch both instructions
return at once, so kernels carry them whatever the launch.

The rule that keeps this exact: a programmatically launched kernel reads or writes nothing an earlier kernel of the
step touches (activations, ids, outputs) before `wait_for_prior_grids`. Stream capture turns the launch attribute
into a programmatic graph edge, so captured decode graphs keep it.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic


def _barrier_asm(builder, text: str) -> None:
    """An asm statement with a memory clobber: LLVM moves no load or store across it."""
    builder.asm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", [], side_effect=True)


@intrinsic
def wait_for_prior_grids(typingctx):
    """`griddepcontrol.wait`: block until the grids this one depends on have completed and their writes are
    visible (returns at once for a normal launch)."""
    def codegen(context, builder, sig, args):
        _barrier_asm(builder, "griddepcontrol.wait;")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def allow_dependents(typingctx):
    """`griddepcontrol.launch_dependents`: once every block of this grid has run it (or exited), a programmatically
    launched next kernel may start; it still waits for this grid's completion before reading what it wrote."""
    def codegen(context, builder, sig, args):
        _barrier_asm(builder, "griddepcontrol.launch_dependents;")
        return context.get_dummy_value()

    return types.void(), codegen


def launch(dispatcher: Any, grid: Any, block: Any, stream: Any, shared: int, *args: Any,
           programmatic: bool) -> None:
    """dispatcher[grid, block, stream, shared](*args), launched programmatically when asked: for kernels that call
    `wait_for_prior_grids` before touching anything an earlier kernel wrote or reads."""
    if not programmatic:
        dispatcher[grid, block, stream, shared](*args)
        return
    from cuda.core import LaunchConfig
    from cuda.core import launch as core_launch

    argument_types = tuple(dispatcher.typeof_pyval(value) for value in args)
    kernel = dispatcher.overloads.get(argument_types) or dispatcher.compile(argument_types)
    function = kernel._codelibrary.get_cufunc()  # numba's own launch path (Kernel.launch), plus the attribute
    packed: list = []
    for argument_type, value in zip(kernel.argument_types, args):
        kernel._prepare_args(argument_type, value, stream, [], packed)
    config = LaunchConfig(grid=grid, block=block, shmem_size=shared, programmatic_stream_serialization=True)
    core_launch(stream, config, function.kernel, *packed)


def check_available() -> None:
    """Raise a clear error where this cuda.core cannot make programmatic launches."""
    from cuda.core import LaunchConfig

    try:
        LaunchConfig(grid=1, block=1, programmatic_stream_serialization=True)
    except TypeError as exc:
        raise RuntimeError("programmatic dependent launch needs a cuda.core whose LaunchConfig takes "
                           "programmatic_stream_serialization") from exc
