"""Asynchronous global -> shared copies (`cp.async`, sm_80+) and shared-memory access by 32-bit shared address: the
PTX numba's front end does not expose.

Why: a streaming kernel that loads into registers can keep only as many bytes in flight as it has registers for; a
warp that copies into shared memory with `cp.async` keeps several steps in flight at no register cost and reads each
step back when its group has landed (`wait_group`). A lane that reads back only the bytes it copied itself needs no
barrier: `cp.async.wait_group` orders the lane's own copies before its later shared loads.

The asm statements that touch shared memory are side effects with a memory clobber, so LLVM keeps them in program
order with each other (a read after the wait that covers its copy, a copy into a slot after the reads of that slot).
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


def _make_small_copy(count: int):
    @intrinsic
    def copy_async(typingctx, shared, address):
        """Copy 4 * count bytes (aligned to them) from a global to a shared address (`cp.async.ca`)."""
        def codegen(context, builder, sig, args):
            i32, i64 = ir.IntType(32), ir.IntType(64)
            _void_asm(builder, f"cp.async.ca.shared.global [$0], [$1], {4 * count};", "r,l", list(args), [i32, i64])
            return context.get_dummy_value()

        return types.void(uint32, int64), codegen

    return copy_async


copy_async_4 = _make_small_copy(1)
copy_async_8 = _make_small_copy(2)


@intrinsic
def copy_async_commit(typingctx):
    """Close the lane's open group of copies (`cp.async.commit_group`; an empty group counts too)."""
    def codegen(context, builder, sig, args):
        _void_asm(builder, "cp.async.commit_group;", "", [], [])
        return context.get_dummy_value()

    return types.void(), codegen


def copy_async_wait(pending: int):
    """An intrinsic that waits until at most `pending` of the lane's committed groups are still in flight."""
    @intrinsic
    def wait(typingctx):
        def codegen(context, builder, sig, args):
            _void_asm(builder, f"cp.async.wait_group {int(pending)};", "", [], [])
            return context.get_dummy_value()

        return types.void(), codegen

    return wait


def _make_shared_load(count: int):
    @intrinsic
    def load_shared(typingctx, shared):
        """`count` uint32 words at a shared address (aligned to 4 * count bytes), as one load."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            if count == 1:
                return builder.asm(ir.FunctionType(i32, [i32]), "ld.shared.u32 $0, [$1];", "=r,r,~{memory}",
                                   list(args), side_effect=True)
            outputs = ", ".join(f"${i}" for i in range(count))
            result = builder.asm(ir.FunctionType(ir.LiteralStructType([i32] * count), [i32]),
                                 f"ld.shared.v{count}.u32 {{{outputs}}}, [${count}];",
                                 ",".join(["=r"] * count) + ",r,~{memory}", list(args), side_effect=True)
            values = [builder.extract_value(result, i) for i in range(count)]
            return context.make_tuple(builder, sig.return_type, values)

        return (uint32 if count == 1 else types.UniTuple(uint32, count))(uint32), codegen

    return load_shared


load_shared_word = _make_shared_load(1)
load_shared_words2 = _make_shared_load(2)
load_shared_words4 = _make_shared_load(4)
