"""jupyter_shard.rank.cuda_errors: which exceptions say that a rank's CUDA context is lost for good,
read from the exception alone (type, error code, message, and the exceptions it came from)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from jupyter_shard.rank.cuda_errors import STICKY_CODES, exception_chain, lost_context

# What torch puts after the CUDA runtime's message (c10/cuda/CUDAMiscFunctions.cpp and the DSA hint).
TORCH_TAIL = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
    "below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)
STICKY = [
    "device-side assert triggered",
    "an illegal memory access was encountered",
    "unspecified launch failure",
    "uncorrectable ECC error encountered",
    "misaligned address",
    "an illegal instruction was encountered",
    "unknown error",
    "invalid program counter",
    "hardware stack error",
    "the launch timed out and was terminated",
]
ACCELERATOR_ERROR: type[RuntimeError] = getattr(torch, "AcceleratorError", RuntimeError)


def _torch_error(text: str, kind: type[RuntimeError] = ACCELERATOR_ERROR) -> RuntimeError:
    return kind(f"CUDA error: {text}{TORCH_TAIL}")


@pytest.mark.parametrize("text", STICKY)
def test_each_sticky_cuda_error_is_recognised_by_its_message(text: str) -> None:
    assert lost_context(_torch_error(text)) == f"CUDA error: {text}"
    # a torch older than AcceleratorError raises a RuntimeError with the same words
    assert lost_context(_torch_error(text, RuntimeError)) == f"CUDA error: {text}"


@pytest.mark.parametrize(
    ("message", "line"),
    [
        (  # NCCL's report, raised as a DistBackendError
            "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO "
            "for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function failed.\n"
            "Last error:\nCuda failure 700 'an illegal memory access was encountered'",
            "Cuda failure 700 'an illegal memory access was encountered'",
        ),
        ("Triton Error [CUDA]: device-side assert triggered", ""),
        ("CUDA driver error: unspecified launch failure", ""),
    ],
    ids=["nccl", "triton", "driver"],
)
def test_the_words_of_nccl_triton_and_the_driver_api_count_too(message: str, line: str) -> None:
    kind = dist.DistBackendError if message.startswith("NCCL") else RuntimeError
    assert lost_context(kind(message)) == (line or message)


def test_an_error_code_alone_is_enough() -> None:
    error = ACCELERATOR_ERROR("an error whose message torch shortened")
    error.error_code = 710  # type: ignore[attr-defined]  # set by torch on its AcceleratorError
    assert lost_context(error) == "an error whose message torch shortened"
    assert STICKY_CODES[710] == "device-side assert triggered"
    error.error_code = 2  # type: ignore[attr-defined]  # cudaErrorMemoryAllocation: not sticky
    assert lost_context(error) == ""


def test_the_chain_is_followed_through_cause_and_context() -> None:
    def raised_from() -> BaseException:
        try:
            try:
                raise _torch_error("device-side assert triggered")
            except RuntimeError as exc:
                raise ValueError("batch 17 failed") from exc
        except ValueError as wrapped:
            return wrapped

    def raised_while_handling() -> BaseException:
        try:
            try:
                raise _torch_error("misaligned address")
            except RuntimeError:
                raise KeyError("cleanup failed") from None
        except KeyError as exc:
            return exc

    assert lost_context(raised_from()) == "CUDA error: device-side assert triggered"
    # ``from None`` hides the context from the traceback; it still happened in this process
    assert lost_context(raised_while_handling()) == "CUDA error: misaligned address"


def test_a_chain_with_a_cycle_ends() -> None:
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert list(exception_chain(a)) == [a, b]
    assert lost_context(a) == "" and lost_context(None) == ""


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of "
            "which 1.06 GiB is free."
        ),
        _torch_error("out of memory"),  # cudaErrorMemoryAllocation: freeing memory helps
        _torch_error("invalid argument"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"),
        RuntimeError("Expected all tensors to be on the same device, but found at least two devices"),
        ValueError("CUDA error: device-side assert triggered"),  # user text in a Python error
        RuntimeError("my CUDA kernel found an illegal memory access was encountered in the log"),
        AssertionError("CUDA is not available"),
        KeyboardInterrupt(),
    ],
    ids=[
        *("oom", "oom-code", "invalid-argument", "shapes", "devices"),
        *("value-error", "user-text", "assert", "interrupt"),
    ],
)
def test_errors_a_process_recovers_from_are_not_sticky(error: BaseException) -> None:
    assert lost_context(error) == ""


def test_the_line_is_kept_short() -> None:
    error = RuntimeError("CUDA error: device-side assert triggered " + "x" * 500)
    assert len(lost_context(error)) == 200
