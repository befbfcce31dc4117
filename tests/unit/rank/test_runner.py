"""jupyter_shard.rank.runner: the rank's main-thread loop and its handlers, driven in-process.

The socket, the I/O channel, the shell and the process group are stand-ins recording what the
runner asks of them; the messages it sends are checked against the registry.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jupyter_shard.rank import runner as runner_module
from jupyter_shard.rank import shard as shard_module
from jupyter_shard.rank import transfer
from jupyter_shard.rank.runner import CellState, Runner
from jupyter_shard.transfer import pickling
from jupyter_shard.wire.messages import check_body
from jupyter_shard.wire.protocol import Message

pytestmark = pytest.mark.timeout(30)

Error = tuple[str, str, list[str]]


class _Stop(BaseException):
    """Ends the runner's endless loop once the test's messages are used up."""


class FakeSock:
    def __init__(self, *incoming: Message) -> None:
        self.incoming = list(incoming)
        self.sent: list[tuple[str, dict[str, Any], list[Any]]] = []

    def recv(self) -> Message:
        if not self.incoming:
            raise _Stop
        return self.incoming.pop(0)

    def send(self, msg_type: str, body: Any, buffers: list[Any] | None = None) -> None:
        assert check_body(msg_type, body) == [], body
        self.sent.append((msg_type, dict(body), list(buffers or [])))

    def only(self, msg_type: str) -> dict[str, Any]:
        (sent,) = self.sent
        assert sent[0] == msg_type
        return sent[1]


class FakeChannel:
    def __init__(self) -> None:
        self.flushed = 0
        self.closed = False

    def flush(self) -> int:
        self.flushed += 1
        return 7

    def close(self) -> None:
        self.closed = True


class FakeShell:
    def __init__(self, state: CellState) -> None:
        self.state = state
        self.user_ns: dict[str, Any] = {}
        self.last_value: tuple[Any] | None = None
        self.kept_error: BaseException | None = None
        self.ran: list[tuple[Any, ...]] = []
        self.result: Error | None = None
        self.raises: BaseException | None = None
        self.seen_state: tuple[bool, str] | None = None

    def run(self, code: str, cell_id: str, exec_count: int, *filename: str) -> Error | None:
        self.ran.append((code, cell_id, exec_count, *filename))
        self.seen_state = (self.state.executing, self.state.cell_id)
        if self.raises is not None:
            raise self.raises
        return self.result

    def post_mortem(self, cell_id: str) -> Error | None:
        self.ran.append(("post_mortem", cell_id))
        return None


class FakeGroup:
    backend = "gloo"

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.unusable_because = ""
        self.steps: tuple[str, ...] = ()
        self.fail: Exception | None = None

    def free_retired(self) -> None:
        self.calls.append("free_retired")

    def unusable(self, failure: BaseException | None = None) -> str:
        self.calls.append(("unusable", failure))
        return self.unusable_because

    def release_steps(self, backend: str, role: str) -> tuple[str, ...]:
        self.calls.append(("release_steps", backend, role))
        return self.steps

    def abort(self) -> None:
        self.calls.append("abort")
        if self.fail is not None:
            raise self.fail

    def build_on_prefix(self, prefix: str) -> None:
        self.calls.append(("prefix", prefix))
        if self.fail is not None:
            raise self.fail

    def build_on_file(self, store: str) -> None:
        self.calls.append(("file", store))
        if self.fail is not None:
            raise self.fail


class Rig:
    def __init__(self) -> None:
        self.state = CellState()
        self.sock = FakeSock()
        self.channel = FakeChannel()
        self.shell = FakeShell(self.state)
        self.group = FakeGroup()
        self.runner = Runner(0, self.channel, self.sock, self.state, self.shell, self.group)  # type: ignore[arg-type]

    def execute(self, code: str = "x = 1", **body: Any) -> dict[str, Any]:
        self.sock.sent.clear()
        self.runner.execute(Message("execute", {"cell_id": "c1", "code": code, "exec_count": 3, **body}))
        return self.sock.only("done")


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    previous = signal.getsignal(signal.SIGINT)
    monkeypatch.chdir(os.getcwd())  # a cell's cwd is undone after the test
    monkeypatch.setattr(shard_module, "_current", None)
    transfer.release()
    try:
        yield Rig()
    finally:
        signal.signal(signal.SIGINT, previous)
        transfer.release()


# execute


def test_a_cell_runs_in_the_shell_and_its_done_counts_the_output_before_it(rig: Rig) -> None:
    done = rig.execute("print(1)")
    assert rig.shell.ran == [("print(1)", "c1", 3)]
    assert rig.shell.seen_state == (True, "c1"), "the I/O thread sees the cell running"
    assert not rig.state.executing and rig.state.cell_head == ""
    assert rig.group.calls[0] == "free_retired"
    assert ("unusable", None) in rig.group.calls
    assert done["io_count"] == 7 and rig.channel.flushed == 1
    assert done["cell_id"] == "c1" and done["status"] == "ok"
    assert (done["ename"], done["evalue"], done["traceback"]) == ("", "", [])
    assert done["grouped"] is True and done["ungrouped"] == "" and done["lost_context"] == ""
    assert done["duration"] >= 0


def test_a_failing_cell_reports_its_error_and_what_it_did_to_the_group(rig: Rig) -> None:
    kept = RuntimeError("Connection closed by peer")
    rig.shell.result = ("RuntimeError", "Connection closed by peer", ["tb line"])
    rig.shell.kept_error = kept
    rig.group.unusable_because = "the default group is destroyed"
    done = rig.execute()
    assert done["status"] == "error"
    assert (done["ename"], done["evalue"], done["traceback"]) == (
        "RuntimeError",
        "Connection closed by peer",
        ["tb line"],
    )
    assert ("unusable", kept) in rig.group.calls
    assert done["grouped"] is False and done["ungrouped"] == "the default group is destroyed"


def test_a_lost_cuda_context_is_reported_and_remembered(rig: Rig) -> None:
    rig.shell.result = ("AcceleratorError", "CUDA error: device-side assert triggered", [])
    rig.shell.kept_error = RuntimeError("CUDA error: device-side assert triggered\nmore text")
    first = rig.execute()
    assert first["lost_context"] == "CUDA error: device-side assert triggered"
    rig.shell.result, rig.shell.kept_error = None, None
    assert rig.execute()["lost_context"] == first["lost_context"], "for the life of the process"


def test_an_interrupted_cell_reports_keyboard_interrupt(rig: Rig) -> None:
    rig.shell.raises = KeyboardInterrupt()
    done = rig.execute()
    assert (done["status"], done["ename"], done["traceback"]) == (
        "error",
        "KeyboardInterrupt",
        ["KeyboardInterrupt"],
    )
    assert ("unusable", rig.shell.raises) in rig.group.calls
    assert not rig.state.executing


def test_sigint_interrupts_a_running_cell_and_nothing_between_cells(rig: Rig) -> None:
    os.kill(os.getpid(), signal.SIGINT)  # between cells: a no-op
    reached: list[str] = []

    def run(code: str, cell_id: str, exec_count: int) -> Error | None:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs between bytecodes
            reached.append("after")
        return None

    rig.shell.run = run  # type: ignore[method-assign]
    done = rig.execute()
    assert done["ename"] == "KeyboardInterrupt" and len(reached) < 1000
    os.kill(os.getpid(), signal.SIGINT)  # the cell is over: still a no-op


def test_a_cell_left_at_a_pdb_prompt_by_an_interrupt_says_so_and_takes_sigint_back(rig: Rig) -> None:
    def run(code: str, cell_id: str, exec_count: int) -> Error | None:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as pdb's does
        rig.state.stopped_at_prompt = True
        return None

    rig.shell.run = run  # type: ignore[method-assign]
    done = rig.execute()
    assert done["status"] == "error" and done["ename"] == "KeyboardInterrupt"
    assert done["traceback"] == ["KeyboardInterrupt: stopped at a pdb prompt"]
    assert rig.state.stopped_at_prompt is False
    assert signal.getsignal(signal.SIGINT) == rig.runner._sigint
    os.kill(os.getpid(), signal.SIGINT)  # the runner's no-op again, not default_int_handler


def test_a_post_mortem_cell_runs_the_debugger_not_the_code(rig: Rig) -> None:
    rig.execute("ignored", post_mortem=True)
    assert rig.shell.ran == [("post_mortem", "c1")]


def test_a_cell_follows_the_kernels_directory_when_this_host_has_it(rig: Rig, tmp_path: Path) -> None:
    rig.execute(cwd=str(tmp_path))
    assert Path(os.getcwd()) == tmp_path
    rig.execute(cwd=str(tmp_path / "not-on-this-host"))
    assert Path(os.getcwd()) == tmp_path


# the loop


def test_the_loop_logs_unknown_and_failing_messages_and_goes_on(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = io.StringIO()
    monkeypatch.setattr(sys, "__stderr__", log)
    rig.sock.incoming = [
        Message("bogus", {}),
        Message("execute", {"code": "1"}),  # no cell_id: the handler raises KeyError
        Message("debug_request", {"seq": 4}),
    ]
    with pytest.raises(_Stop):
        rig.runner.loop()
    text = log.getvalue()
    assert "jupyter_shard: rank 0 ignored a 'bogus' message" in text
    assert "jupyter_shard: rank 0 failed to handle a 'execute' message:" in text
    assert "KeyError: 'cell_id'" in text
    assert [m for m, _, _ in rig.sock.sent] == ["debug_response"]


def test_the_loop_takes_deferred_messages_before_new_ones(rig: Rig) -> None:
    rig.sock.incoming = [Message("debug_request", {"seq": 2})]
    rig.runner.deferred.append(Message("debug_request", {"seq": 1}))
    with pytest.raises(_Stop):
        rig.runner.loop()
    assert [body["seq"] for _, body, _ in rig.sock.sent] == [1, 2]


def test_a_message_while_waiting_at_a_prompt_waits_unless_it_is_a_shutdown(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    stopped: list[Message] = []
    monkeypatch.setattr(rig.runner, "shutdown", stopped.append)
    pull, stop = Message("pull", {"req_id": "x"}), Message("shutdown", {})
    rig.runner.while_waiting(pull)
    assert rig.runner.deferred == [pull] and stopped == []
    rig.runner.while_waiting(stop)
    assert stopped == [stop]


def test_a_late_debug_request_is_answered_not_stopped(rig: Rig) -> None:
    rig.runner.debug_request(Message("debug_request", {"seq": 9}))
    assert rig.sock.only("debug_response") == {
        "seq": 9,
        "success": False,
        "message": "the rank is not stopped",
        "body": {},
    }


def test_a_stale_answer_is_dropped(rig: Rig) -> None:
    rig.runner.stale_answer(Message("answer", {"value": "y"}))
    assert rig.sock.sent == []


# push and pull


def test_a_push_puts_its_values_in_the_namespace(rig: Rig) -> None:
    packed = pickling.dumps(np.arange(3))
    body = {"req_id": "p1", "names": ["arr"], "counts": [1]}
    rig.runner.push(Message("push", body, buffers=[packed.inband, bytes(packed.buffers[0])]))
    assert rig.sock.only("push_reply") == {"req_id": "p1", "ok": True, "error": ""}
    assert np.array_equal(rig.shell.user_ns["arr"], np.arange(3))


def test_a_malformed_push_is_refused_and_changes_nothing(rig: Rig) -> None:
    rig.shell.user_ns["arr"] = "before"
    body = {"req_id": "p1", "names": ["arr", "b"], "counts": [0]}
    rig.runner.push(Message("push", body, buffers=[pickling.dumps(1).inband]))
    reply = rig.sock.only("push_reply")
    assert reply["ok"] is False and reply["error"].startswith("ValueError: malformed push")
    assert rig.shell.user_ns == {"arr": "before"}


def test_a_push_asking_for_a_landing_is_answered_with_memory(rig: Rig) -> None:
    rig.runner.push(
        Message("push", {"req_id": "p1", "land": True, "names": ["a"], "counts": [1], "sizes": [64]})
    )
    reply = rig.sock.only("push_reply")
    assert reply["ok"] and reply["req_id"] == "p1"
    assert rig.shell.user_ns == {}


def _pull(rig: Rig, **body: Any) -> tuple[dict[str, Any], list[Any]]:
    rig.sock.sent.clear()
    rig.runner.pull(Message("pull", {"req_id": "q", **body}))
    (sent,) = rig.sock.sent
    assert sent[0] == "pull_reply"
    return sent[1], sent[2]


def test_a_pull_sends_a_copy_of_the_variable(rig: Rig) -> None:
    rig.shell.user_ns["w"] = {"a": np.ones(4)}
    reply, buffers = _pull(rig, name="w")
    assert reply["ok"] and reply["seconds"] >= 0
    value = pickling.loads(bytes(buffers[0]), [bytearray(b) for b in buffers[1:]])
    assert np.array_equal(value["a"], np.ones(4))


def test_a_pull_of_an_unknown_name_or_a_missing_last_value_says_so(rig: Rig) -> None:
    reply, buffers = _pull(rig, name="nope")
    assert reply == {"req_id": "q", "ok": False, "error": "name 'nope' is not defined on rank 0"}
    assert buffers == []
    reply, _ = _pull(rig, last=True)
    assert reply["ok"] is False and "rank 0's last cell ended without a value" in reply["error"]


def test_a_pull_of_the_last_value(rig: Rig) -> None:
    rig.shell.last_value = ([1, 2, 3],)
    reply, buffers = _pull(rig, last=True)
    assert reply["ok"] and pickling.loads(bytes(buffers[0]), []) == [1, 2, 3]


def test_a_pull_whose_tensors_pass_the_limit_is_refused_before_pickling(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    def never(*args: Any) -> Any:
        raise AssertionError("pickled")

    monkeypatch.setattr(transfer, "pulled_reply", never)
    rig.shell.user_ns["t"] = torch.zeros(3 * 2**20, dtype=torch.uint8)
    reply, buffers = _pull(rig, name="t", limit=2**20)
    assert reply == {
        "req_id": "q",
        "ok": False,
        "error": "'t' holds 3 MiB of tensors, over the 1 MiB limit of this copy",
    }
    assert buffers == []


def test_a_gather_of_anything_but_the_prepared_model_is_refused(rig: Rig) -> None:
    rig.shell.user_ns["m"] = object()
    reply, _ = _pull(rig, name="m", gather=True)
    assert reply["ok"] is False
    assert reply["error"] == "rank 0: --gather applies to the model returned by shard.prepare; 'm' is not it"


def test_a_failed_cuda_copy_after_a_lost_context_says_only_cpu_values_can_be_copied(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cuda_failure(msg: Message, rank: int, what: str, value: Any, limit: int) -> tuple[Any, list[Any]]:
        error = (
            f"{what} could not be pickled: AcceleratorError: CUDA error: an illegal memory access\nlong help"
        )
        return {"req_id": "q", "ok": False, "error": error}, []

    monkeypatch.setattr(transfer, "pulled_reply", cuda_failure)
    rig.shell.user_ns["t"] = 1
    reply, _ = _pull(rig, name="t")
    assert reply["error"].endswith("long help"), "a live context: torch's words as they are"
    rig.runner.lost_context = "CUDA error: an illegal memory access was encountered"
    reply, _ = _pull(rig, name="t")
    assert reply["error"] == (
        "'t' could not be pickled: AcceleratorError: CUDA error: an illegal memory access; "
        "rank 0's CUDA context is lost: only CPU values can be copied"
    )


def test_a_release_pull_lets_the_loan_go_without_a_reply(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "CHUNK", 8)
    rig.shell.user_ns["a"] = np.arange(32)
    reply, _ = _pull(rig, name="a", stream=True)
    assert reply["streamed"]
    part, pieces = _pull(rig, chunk=[0, 8])
    assert part["ok"] and b"".join(bytes(p) for p in pieces) == np.arange(32).tobytes()[:8]
    rig.sock.sent.clear()
    rig.runner.pull(Message("pull", {"req_id": "q", "release": True}))
    assert rig.sock.sent == []
    part, _ = _pull(rig, chunk=[0, 8])
    assert part["ok"] is False


def test_a_resend_pull_is_answered_by_the_resend(rig: Rig) -> None:
    reply, buffers = _pull(rig, resend=True, segments={})
    assert reply["ok"] is False and "rank 0 has nothing lent to resend" in reply["error"]
    assert buffers == []


# release, regroup, shutdown


def test_release_aborts_when_the_backend_says_so_and_reports_a_failure(rig: Rig) -> None:
    rig.group.steps = ("abort",)
    rig.runner.release(Message("release", {"req_id": "r"}))
    assert rig.sock.only("release_reply") == {"req_id": "r", "ok": True, "error": "", "closed": 0}
    assert ("release_steps", "gloo", "idle") in rig.group.calls and "abort" in rig.group.calls
    rig.sock.sent.clear()
    rig.group.fail = RuntimeError("communicator gone")
    rig.runner.release(Message("release", {"req_id": "r"}))
    assert rig.sock.only("release_reply") == {
        "req_id": "r",
        "ok": False,
        "error": "RuntimeError: communicator gone",
        "closed": 0,
    }


def test_release_closes_connections_only_to_peers_on_this_host(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[list[int]] = []

    def shut(pids: list[int]) -> int:
        asked.append(pids)
        return 5

    monkeypatch.setattr(runner_module, "_shut_down_connections_to", shut)
    rig.group.steps = ("close",)
    here = socket.gethostname()
    body = {"req_id": "r", "peers": [11, 12, 13], "peer_hosts": ["", here, "elsewhere"]}
    rig.runner.release(Message("release", body))
    assert asked == [[11, 12]]
    assert rig.sock.only("release_reply")["closed"] == 5
    assert "abort" not in rig.group.calls
    rig.sock.sent.clear()
    rig.runner.release(Message("release", {"req_id": "r", "peers": [21, 22]}))  # no hosts: all local
    assert asked[-1] == [21, 22]


def test_regroup_builds_on_the_store_it_names_and_says_whether_the_model_followed(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Helper:
        def group_rebuilt(self) -> bool:
            return True

    rig.runner.regroup(Message("regroup", {"req_id": "g", "prefix": "round-2"}))
    reply = rig.sock.only("regroup_reply")
    assert ("prefix", "round-2") in rig.group.calls
    assert reply["ok"] and reply["prepared"] is False and reply["seconds"] >= 0
    rig.sock.sent.clear()
    monkeypatch.setattr(shard_module, "_current", Helper())
    rig.runner.regroup(Message("regroup", {"req_id": "g", "store": "/tmp/store"}))
    assert ("file", "/tmp/store") in rig.group.calls
    assert rig.sock.only("regroup_reply")["prepared"] is True


def test_a_failed_regroup_says_why(rig: Rig) -> None:
    rig.group.fail = TimeoutError("store timed out")
    rig.runner.regroup(Message("regroup", {"req_id": "g", "store": "/x"}))
    reply = rig.sock.only("regroup_reply")
    assert (reply["ok"], reply["error"], reply["prepared"]) == (False, "TimeoutError: store timed out", False)


def test_shutdown_closes_the_channel_then_exits(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    exits: list[int] = []

    def fake_exit(code: int) -> None:
        assert rig.channel.closed, "output is sent before the process ends"
        exits.append(code)

    monkeypatch.setattr(runner_module.os, "_exit", fake_exit)
    rig.runner.shutdown(Message("shutdown", {}))
    assert exits == [0]
