"""jupyter_shard.launchers.zygote: which zygote serves a rank, and its check that forking is safe."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from jupyter_shard.launchers.zygote import cuda_driver_state, cuda_libraries, driver_files, interpreter_key


def test_one_zygote_serves_every_rank_and_pool_of_an_interpreter() -> None:
    base = {
        "PATH": "/usr/bin",
        "PYTHONPATH": "/src",
        "OMP_NUM_THREADS": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }

    def rank(k: int, pool: str) -> dict[str, str]:
        return base | {
            "RANK": str(k),
            "TORCHELASTIC_RUN_ID": pool,
            "TORCHELASTIC_ERROR_FILE": f"/logs/{pool}/rank-{k}-error.json",
            "TORCHELASTIC_RESTART_COUNT": "0",
        }

    keys = {interpreter_key(rank(k, pool)) for k in range(4) for pool in ("pool-a", "pool-b")}
    assert keys == {(("PYTHONPATH", "/src"), ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))}
    assert interpreter_key(base | {"LD_PRELOAD": "x.so"}) != interpreter_key(base)


def test_which_gpus_a_rank_uses_does_not_need_another_zygote() -> None:
    base = {"PYTHONPATH": "/src", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert interpreter_key(base | {"CUDA_VISIBLE_DEVICES": "0,1"}) == interpreter_key(
        base | {"CUDA_VISIBLE_DEVICES": "2,3"}
    )
    assert interpreter_key(base | {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}) != interpreter_key(base)


# -- the no-CUDA guard ------------------------------------------------------------------------------------

# /proc/<pid>/maps of a process that initialised CUDA (the driver library and its UVM mapping).
CUDA_MAPS = """\
55d0c3a00000-55d0c3a2e000 r--p 00000000 08:01 1048602  /usr/bin/python3.11
7f1b2c000000-7f1b2c021000 rw-p 00000000 00:00 0
7f1b30000000-7f1b30200000 ---p 00000000 00:00 0
7f1b3a000000-7f1b3a400000 rw-s 00000000 00:05 4221  /dev/nvidia-uvm
7f1b41200000-7f1b41a5c000 r--p 00000000 08:01 2363031  /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
7f1b41a5c000-7f1b42d33000 r-xp 0085c000 08:01 2363031  /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
7f1b43000000-7f1b43100000 r-xp 00000000 08:01 2363044  /usr/lib/wsl/lib/libcuda.so.1.1
7f1b44000000-7f1b44100000 r-xp 00000000 08:01 2363050  /opt/venv/nvidia/cuda_runtime/lib/libcudart.so.12
7f1b45000000-7f1b45100000 r-xp 00000000 08:01 2363051  /opt/venv/torch/lib/libtorch_cuda.so
7ffd8e3f1000-7ffd8e412000 rw-p 00000000 00:00 0  [stack]
"""

# A process that only imported a CUDA build of torch: the runtime and torch's CUDA library, no driver.
IMPORTED_MAPS = "\n".join(line for line in CUDA_MAPS.splitlines() if "libcuda.so" not in line)


def test_cuda_driver_library_is_found_in_proc_maps() -> None:
    assert cuda_libraries(CUDA_MAPS) == [
        "/usr/lib/wsl/lib/libcuda.so.1.1",
        "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
    ]
    assert cuda_libraries(IMPORTED_MAPS) == []
    assert cuda_libraries("") == []


def test_gpu_device_files_open_are_found(tmp_path: Path) -> None:
    fds = tmp_path / "fd"
    fds.mkdir()
    targets = ["/dev/null", "pipe:[81234]", "/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"]
    targets += ["/dev/nvidia-caps/nvidia-cap1", "/dev/nvme0n1", "/dev/dxg", "socket:[9]", "/tmp/nvidia0"]
    for fd, target in enumerate(targets):
        (fds / str(fd)).symlink_to(target)  # as /proc/self/fd shows them: links to what is open
    assert driver_files(str(fds)) == [
        "/dev/dxg",
        "/dev/nvidia-caps/nvidia-cap1",
        "/dev/nvidia-uvm",
        "/dev/nvidia0",
        "/dev/nvidiactl",
    ]
    assert driver_files(str(tmp_path / "missing")) == []


def test_driver_state_names_what_is_held(tmp_path: Path) -> None:
    fds = tmp_path / "fd"
    fds.mkdir()
    (fds / "0").symlink_to("/dev/null")
    maps = tmp_path / "maps"
    maps.write_text(IMPORTED_MAPS)
    assert cuda_driver_state(str(fds), str(maps)) == ""
    (fds / "7").symlink_to("/dev/nvidiactl")
    maps.write_text(CUDA_MAPS)
    assert cuda_driver_state(str(fds), str(maps)) == (
        "/dev/nvidiactl is open; /usr/lib/wsl/lib/libcuda.so.1.1 is loaded; "
        "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15 is loaded"
    )


def test_this_process_holds_no_cuda_driver_state() -> None:
    assert cuda_driver_state() == ""  # no GPU here: the check must pass (torch imported, CPU build)


def test_the_zygotes_imports_leave_it_safe_to_fork_here() -> None:
    code = "from jupyter_shard.launchers.zygote import _preload; print(repr(_preload()))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "''"


def test_a_loaded_cuda_driver_library_is_detected_in_this_process(tmp_path: Path) -> None:
    import _json

    fake = tmp_path / "libcuda.so.1"  # any real shared library, under the driver's name
    shutil.copy(_json.__file__, fake)
    code = f"import ctypes; ctypes.CDLL({str(fake)!r}); {CHECK}"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == repr(f"{fake} is loaded")


CHECK = "from jupyter_shard.launchers.zygote import cuda_driver_state; print(repr(cuda_driver_state()))"
