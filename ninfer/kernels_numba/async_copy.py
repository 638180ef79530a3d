"""Asynchronous global -> shared copies (`cp.async`, sm_80+): the PTX numba's front end does not expose.

Why: a kernel that stages its next inputs through registers holds them there until it can store them (the chunked
gated delta rule's scan spilled doing that); `cp.async` keeps the copies in flight at no register cost, and the block
reads them after `copy_async_wait_all` and a barrier.

The asm statements are side effects with a memory clobber, so LLVM keeps them in program order with the shared-memory
accesses around them.
"""

from __future__ import annotations

from llvmlite import ir
from numba import int64, types, uint32
from numba.cuda.extending import intrinsic


def _void_asm(builder, text: str, constraints: str, operands: list, operand_types: list) -> None:
    function = ir.FunctionType(ir.VoidType(), operand_types)
    builder.asm(function, text, constraints + ("," if constraints else "") + "~{memory}", operands, side_effect=True)


@intrinsic
def shared_address(typingctx, generic):
    """The 32-bit shared-window address of a generic (int64) address inside a shared array (`address_of` of it)."""
    def codegen(context, builder, sig, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        return builder.asm(ir.FunctionType(i32, [i64]),
                           "{.reg .u64 s; cvta.to.shared.u64 s, $1; cvt.u32.u64 $0, s;}", "=r,l", list(args),
                           side_effect=False)

    return uint32(int64), codegen


@intrinsic
def copy_async_16(typingctx, shared, address, source_bytes):
    """Copy 16 bytes from a global address (16-byte aligned) to a shared address, the last 16 - source_bytes of them
    zeros (`cp.async.cg`: bypasses L1; source_bytes 0 reads nothing)."""
    def codegen(context, builder, sig, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        _void_asm(builder, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", list(args), [i32, i64, i32])
        return context.get_dummy_value()

    return types.void(uint32, int64, uint32), codegen


@intrinsic
def copy_async_8(typingctx, shared, address, source_bytes):
    """Copy 8 bytes from a global address (8-byte aligned) to a shared address, the last 8 - source_bytes of them
    zeros (`cp.async.ca`: the 8-byte size exists only through L1)."""
    def codegen(context, builder, sig, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        _void_asm(builder, "cp.async.ca.shared.global [$0], [$1], 8, $2;", "r,l,r", list(args), [i32, i64, i32])
        return context.get_dummy_value()

    return types.void(uint32, int64, uint32), codegen


@intrinsic
def copy_async_commit(typingctx):
    """Close the lane's open group of copies (`cp.async.commit_group`)."""
    def codegen(context, builder, sig, args):
        _void_asm(builder, "cp.async.commit_group;", "", [], [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def copy_async_wait_prior(typingctx):
    """Wait until every copy the lane committed but its newest group has landed (`cp.async.wait_group 1`): the
    newest stays in flight."""
    def codegen(context, builder, sig, args):
        _void_asm(builder, "cp.async.wait_group 1;", "", [], [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def copy_async_wait_all(typingctx):
    """Wait until every copy the lane committed has landed (`cp.async.wait_group 0`)."""
    def codegen(context, builder, sig, args):
        _void_asm(builder, "cp.async.wait_group 0;", "", [], [])
        return context.get_dummy_value()

    return types.void(), codegen
