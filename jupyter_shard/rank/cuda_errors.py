"""Telling a CUDA error that lasts for the life of the process from one that does not, from the
exception a cell raised alone.

After a device-side assert, an illegal memory access, an uncorrectable ECC error and a few more, the
CUDA context of the process is lost: every later CUDA call raises the same error, and only a new
process helps (NVIDIA's runtime API documents each of them as leaving "the process in an
inconsistent state": it "must be terminated and relaunched"). A rank reads this from the exception
its cell raised, following ``__cause__`` and ``__context__``: its ``error_code`` where torch gives
one (``torch.AcceleratorError``), else torch's, NCCL's or Triton's words for the CUDA error in its
message. It never asks the device: a ``torch.cuda.synchronize()`` probe could block behind a kernel
that never ends. Out of memory is not such an error (freeing memory helps), nor is a Python error
whose own text merely mentions CUDA.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Iterator

__all__ = ["STICKY_CODES", "exception_chain", "lost_context"]

# cudaError_t values whose documentation says the process must be relaunched, by their message
STICKY_CODES: dict[int, str] = {
    214: "uncorrectable ECC error encountered",  # cudaErrorECCUncorrectable
    220: "uncorrectable NVLink error",  # cudaErrorNvlinkUncorrectable
    700: "an illegal memory access was encountered",  # cudaErrorIllegalAddress
    702: "the launch timed out and was terminated",  # cudaErrorLaunchTimeout
    710: "device-side assert triggered",  # cudaErrorAssert
    714: "hardware stack error",  # cudaErrorHardwareStackError
    715: "an illegal instruction was encountered",  # cudaErrorIllegalInstruction
    716: "misaligned address",  # cudaErrorMisalignedAddress
    717: "operation not supported on global/shared address space",  # cudaErrorInvalidAddressSpace
    718: "invalid program counter",  # cudaErrorInvalidPc
    719: "unspecified launch failure",  # cudaErrorLaunchFailure
    999: "unknown error",  # cudaErrorUnknown
}

# The words torch ("CUDA error: …", "CUDA driver error: …"), NCCL ("Cuda failure 700 '…'") and
# Triton ("Triton Error [CUDA]: …") put before the CUDA runtime's or driver's message, on one line.
_STICKY = re.compile(
    r"\b(?:cuda(?: driver)? error\b|cuda failure\b|triton error \[cuda\])[^\n]*?(?:"
    + "|".join(re.escape(text) for text in STICKY_CODES.values())
    + ")",
    re.IGNORECASE,
)
_EXCEPTION_GROUP: type[BaseException] | None = getattr(builtins, "BaseExceptionGroup", None)
_CHAIN_LIMIT = 64  # exceptions looked at in one chain (a cycle is followed once)


def lost_context(error: BaseException | None) -> str:
    """The line that says this process's CUDA context is lost (``"CUDA error: device-side assert
    triggered"``), or "" when ``error`` (or an exception it came from) is no such error."""
    for exc in exception_chain(error):
        if not isinstance(exc, RuntimeError) or type(exc).__name__ == "OutOfMemoryError":
            continue
        text = str(exc)
        found = _STICKY.search(text)
        if found is not None:
            start = text.rfind("\n", 0, found.start()) + 1
            end = text.find("\n", found.end())
            return _short(text[start : end if end >= 0 else len(text)])
        if getattr(exc, "error_code", None) in STICKY_CODES:
            code = int(getattr(exc, "error_code", 0))
            return _short(text.split("\n", 1)[0] or f"CUDA error: {STICKY_CODES[code]}")
    return ""


def exception_chain(error: BaseException | None) -> Iterator[BaseException]:
    """``error`` and every exception it came from (``__cause__``, ``__context__``, an exception
    group's members), each once, breadth first."""
    todo = [error] if error is not None else []
    seen: set[int] = set()
    while todo and len(seen) < _CHAIN_LIMIT:
        exc = todo.pop(0)
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        if _EXCEPTION_GROUP is not None and isinstance(exc, _EXCEPTION_GROUP):
            todo.extend(getattr(exc, "exceptions", ()))
        todo.extend(e for e in (exc.__cause__, exc.__context__) if e is not None)


def _short(line: str, limit: int = 200) -> str:
    line = line.strip()
    return line if len(line) <= limit else line[: limit - 1] + "…"
