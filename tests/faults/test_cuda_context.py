"""F20: a CUDA error that lasts for the process (device-side assert, illegal address, ECC) breaks its
rank until a restart: shown broken, the cell says why and what to do, the next cell is refused at
once, CPU values can still be pulled.

On CPU ranks the last rank raises what torch raises for such an error (``torch.AcceleratorError``,
a ``RuntimeError`` before torch 2.8, with torch's words) while the others enter a collective, as in
a real DDP step; the rank's classification reads only the exception, so this is the path a GPU
takes up to the CUDA call itself."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.timeout(120)

STICKY = "CUDA error: device-side assert triggered"
MESSAGE = (
    f"{STICKY}\nSearch for `cudaErrorAssert' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
    "group__CUDART__TYPES.html for more information.\nCUDA kernel errors might be asynchronously "
    "reported at some other API call, so the stacktrace below might be incorrect.\nFor debugging "
    "consider passing CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side "
    "assertions.\n"
)
ENAME = getattr(torch, "AcceleratorError", RuntimeError).__name__
RAISE = f"""\
try:
    from torch import AcceleratorError as Sticky
except ImportError:
    Sticky = RuntimeError
raise Sticky({MESSAGE!r})
"""


def _indented(code: str) -> str:
    return "".join(f"    {line}\n" for line in code.splitlines())


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_a_lost_cuda_context_breaks_the_rank_until_a_restart(kernel: Any, nproc: int) -> None:
    last = nproc - 1
    assert kernel.execute("%load_ext jupyter_shard").ok
    start = kernel.execute(
        f"%%distributed --nproc {nproc} --device cpu --timeout 20\nimport torch, torch.distributed as dist\n"
        "weights = torch.arange(3.0) + shard.rank\n"
        # stands for a tensor on the GPU: copying it to the CPU raises what the lost context raises
        f"class OnGpu:\n    def __reduce__(self):\n{_indented(_indented(RAISE))}on_gpu = OnGpu()"
    )
    assert start.ok, start.outputs
    run = kernel.execute(
        f"%%distributed\nif shard.rank == {last}:\n{_indented(RAISE)}dist.all_reduce(torch.ones(1))\n"
    )
    failed_at = time.monotonic()
    assert not run.ok
    text = run.error_text()
    assert text.startswith(f"rank {last} failed first: {ENAME}: {STICKY}\n"), text[:300]
    lines = text.splitlines()
    said = [k for k, ln in enumerate(lines) if ln.startswith(f"rank {last} lost its CUDA context")]
    assert said, text[:3000]
    note, tip = lines[said[0] : said[0] + 2]  # the notes, after the headline's full torch message
    assert note.startswith(f"rank {last} lost its CUDA context ({STICKY}): every later CUDA call in")
    assert "only a new process helps, so cells on it are refused from now on" in note
    assert "run %dist_restart for fresh ranks (rank state is lost; values on the CPU can be copied " in note
    assert f"with %dist_pull NAME --rank {last})" in note
    assert "CUDA_LAUNCH_BLOCKING=1" in tip and "%dist_restart" in tip
    assert "rebuilds the group" not in text  # no promise the broken rank would break

    status = kernel.execute("%dist_status").data("execute_result")[0]["text/plain"]
    rows = {int(ln.split()[0]): ln for ln in status.splitlines() if re.match(r"\d+ +\d+ ", ln)}
    assert "broken" in rows[last], status
    assert all("broken" not in rows[k] for k in range(last)), status
    panel = kernel.execute(
        "from jupyter_shard.pool.pool import latest_pool\nfrom jupyter_shard.notebook.panel import "
        "status_reply\nreply = status_reply(latest_pool())\nprint(reply['state'])\n"
        f"print(reply['ranks'][{last}]['state'], reply['ranks'][{last}]['problem'])"
    )
    assert panel.stream().splitlines() == [
        f"broken (rank {last}: CUDA context lost; restart)",
        f"broken broken: CUDA context lost ({STICKY}); %dist_restart for fresh ranks",
    ], panel.outputs

    refused = kernel.execute("%%distributed\nprint('ran')")
    assert not refused.ok and "ran" not in refused.stream()
    assert refused.error_text() == (
        f"PoolError: rank {last} lost its CUDA context ({STICKY}) and can run no cell: run %dist_restart "
        "for fresh ranks (rank state is lost; values on the CPU can be copied out first with "
        f"%dist_pull NAME --rank {last})"
    )
    assert refused.elapsed < 1.0, f"refused after {refused.elapsed:.2f} s"

    pulled = kernel.execute(f"%dist_pull weights --rank {last}\nprint(weights.tolist())")
    assert pulled.ok, pulled.outputs
    assert pulled.stream().strip() == str([float(last), last + 1.0, last + 2.0])

    copy = kernel.execute(f"%dist_pull on_gpu --rank {last}")
    assert not copy.ok and f"rank {last}'s CUDA context is lost: only CPU values can be copied" in (
        copy.error_text()
    )

    restart = kernel.execute("%dist_restart")
    assert "rank state is lost" in restart.stream()
    again = kernel.execute(
        "%%distributed\nimport torch, torch.distributed as dist\nt = torch.ones(1)\n"
        "dist.all_reduce(t); t.item()"
    )
    assert again.data("execute_result") == [{"text/plain": f"{float(nproc)}"}]
    status = kernel.execute("%dist_status").data("execute_result")[0]["text/plain"]
    assert "broken" not in status, status
    back = time.monotonic() - failed_at
    assert back < 20.0, f"back to a working cell {back:.1f} s after the failing cell ended"
