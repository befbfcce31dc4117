"""The dry run's training step for real, on each rank of a live pool: measured, then forgotten.

Why it exists: ``%dist_picker ... --find-batch --confirm`` checks the batch the dry run found. The
kernel sends every rank a one-line cell calling :func:`confirm`, which runs in the rank: it builds
the model and batch from the same ``MODEL`` (or cell code) and ``--batch`` expressions, read over the
rank's namespace without defining anything in it; prepares the model with a fresh object of the
pool's strategy (``shard.trial_strategy()``, as ``shard.prepare`` would wrap it, leaving the user's
prepared model alone); runs the dry run's steps (:data:`~jupyter_shard.planner.tracing.STEPS`: the
last holds the optimizer's state through forward and backward, the peak a training loop reaches)
and measures the peak. Then everything it made is freed, and its cell is taken out of the rank's
input history, so the namespace holds no new name. The report goes back as the rank's last value,
which the kernel copies. :func:`check` runs first, to refuse names the ranks lack before any dry run.
It lives with the dry run it confirms; the rank's own code is reached through its ``shard``.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypedDict

import torch
from torch import nn

from jupyter_shard.errors import SpecError, one_line
from jupyter_shard.planner import tracing
from jupyter_shard.planner.cell_model import compile_model_code, run_model_code
from jupyter_shard.strategies.base import StrategyBase

__all__ = ["TrialError", "TrialOutOfMemory", "TrialReport", "TrialRequest", "check", "confirm"]

#: how each device's peak is measured, as the report says it
CUDA_PEAK = "torch.cuda.max_memory_allocated after reset_peak_memory_stats, less what the rank held before"
CPU_PEAK = "torch's MemTracker over the step's tensors, as the dry run's accuracy test measures"


class TrialRequest(TypedDict):
    """What the kernel asks for: ``model`` (an expression) or ``code`` (a cell's), the ``--batch``
    expression and its batch size, the size to run, and the ``--step`` expression (or None)."""

    model: str | None
    code: str | None
    batch: str
    batch_size: int
    size: int
    step: str | None


class TrialReport(TypedDict):
    """What one rank measured, in bytes: the step's peak over what the rank held before, and the
    device's free memory before it (None on CPU ranks, which share the host's)."""

    rank: int
    peak: int
    free: int | None
    how: str


class Helper(Protocol):
    """What the trial uses of the rank's ``shard`` (:class:`jupyter_shard.rank.shard.Shard`)."""

    rank: int
    device: torch.device

    @property
    def prepared_model(self) -> nn.Module | None: ...

    def trial_strategy(self) -> StrategyBase: ...


class TrialError(RuntimeError):
    """The model, batch or step could not be built or run here; says what to do."""


class TrialOutOfMemory(RuntimeError):
    """The step did not fit in the device's memory at this batch size."""


def confirm(request: TrialRequest) -> None:
    """Run and measure the step; the report is this rank's last value (``pool.last_value``)."""
    from IPython import get_ipython

    shell = get_ipython()
    helper: Helper | None = shell.user_ns.get("shard") if shell is not None else None
    if helper is None or not hasattr(helper, "trial_strategy"):
        raise RuntimeError("a trial step runs inside a rank of a pool, whose namespace has its shard")
    history = _History(shell)
    try:
        shell.last_value = (_measured(request, helper, shell.user_ns),)
    finally:
        history.forget()


def check(request: TrialRequest) -> None:
    """Raise a :class:`TrialError` now when an expression of ``request`` names what the rank's
    namespace lacks, before the kernel spends its dry runs on a batch the ranks cannot build."""
    import builtins

    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("a trial step runs inside a rank of a pool")
    history = _History(shell)
    try:
        known = {"torch", "nn", *shell.user_ns, *vars(builtins)}
        texts = (("the model expression", request["model"]), ("--batch", request["batch"]))
        for what, text in (*texts, ("--step", request["step"])):
            missing = [n for n in _free_names(text) if n not in known] if text is not None else []
            if missing:
                error = NameError(f"name {missing[0]!r} is not defined", name=missing[0])
                raise TrialError(_unbuilt(what, str(text), error))
    finally:
        history.forget()


def _free_names(text: str) -> list[str]:
    """The names an expression reads from its namespace (not those its lambdas or comprehensions
    bind); a syntax error is left for the evaluation to report."""
    import ast

    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return []
    bound = {a.arg for node in ast.walk(tree) if isinstance(node, ast.Lambda) for a in node.args.args}
    bound |= {
        n.id
        for node in ast.walk(tree)
        if isinstance(node, ast.comprehension)
        for n in ast.walk(node.target)
        if isinstance(n, ast.Name)
    }
    loaded = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    return [n for n in dict.fromkeys(loaded) if n not in bound]


def _measured(request: TrialRequest, helper: Helper, user_ns: Mapping[str, Any]) -> TrialReport:
    """The step's report; every object it made is freed before it returns or raises. A failure is
    raised again as a new :class:`TrialError` or :class:`TrialOutOfMemory` without its traceback,
    whose frames would keep the model alive in the rank's post-mortem."""
    cuda = helper.device.type == "cuda"
    made: dict[str, Any] = {}  # everything the step holds, in one place to free
    failure: tuple[type[RuntimeError], str] | None = None
    try:
        return _build_and_run(request, helper, user_ns, made)
    except TrialError as exc:
        failure = (TrialError, str(exc))
    except torch.OutOfMemoryError as exc:
        failure = (TrialOutOfMemory, f"rank {helper.rank}: {one_line(exc)}")
    except Exception as exc:
        failure = (TrialError, f"the real step raised {one_line(exc)} on rank {helper.rank}")
    finally:
        made.clear()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    raise failure[0](failure[1])


def _build_and_run(
    request: TrialRequest, helper: Helper, user_ns: Mapping[str, Any], made: dict[str, Any]
) -> TrialReport:
    device = helper.device
    cuda = device.type == "cuda"
    base, free = _before(device) if cuda else (0, None)
    # the expressions read the rank's names (and torch, as in the kernel) and define none there
    made["scratch"] = {"torch": torch, "nn": nn, **user_ns}
    made["model"] = _model(request, made["scratch"], helper)
    made["batch"] = _batch(request, made["scratch"], device)
    step = _step(request, made["scratch"])
    made["optimizer"] = torch.optim.AdamW(made["model"].parameters()) if step is None else None
    made["impl"] = helper.trial_strategy()
    made["wrapped"], made["optimizer"] = made["impl"].prepare(made.pop("model"), made["optimizer"])
    peak = _run_cuda(made, step, device, base) if cuda else _run_cpu(made, step)
    return {"rank": helper.rank, "peak": peak, "free": free, "how": CUDA_PEAK if cuda else CPU_PEAK}


def _before(device: torch.device) -> tuple[int, int]:
    """Bytes allocated before the step (the user's tensors), and free on the device."""
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device), int(torch.cuda.mem_get_info(device)[0])


def _run_cuda(made: dict[str, Any], step: tracing.Step | None, device: torch.device, base: int) -> int:
    torch.cuda.reset_peak_memory_stats(device)  # the peak starts at what is allocated now: model, batch
    for _ in range(tracing.STEPS):
        _one_step(made, step)
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device)) - base


def _run_cpu(made: dict[str, Any], step: tracing.Step | None) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = made["tracker"] = MemTracker()
    optimizers = [made["optimizer"]] if made["optimizer"] is not None else []
    tracker.track_external(made["wrapped"], *optimizers, *tracing.batch_tensors(made["batch"]))
    with tracker:
        for _ in range(tracing.STEPS):
            _one_step(made, step)
            tracker.reset_mod_stats()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def _one_step(made: dict[str, Any], step: tracing.Step | None) -> None:
    """The dry run's default step as the strategy runs it (forward, mean loss, its backward and its
    optimizer step, gradients set to None), or the user's ``--step``."""
    model, batch, impl = made["wrapped"], made["batch"], made["impl"]
    if step is not None:
        step(model, batch)
        return
    loss = tracing.scalar_loss(tracing.forward(model, batch))
    impl.backward(loss, model)
    del loss
    impl.step(made["optimizer"], model)


# -- building on the rank -------------------------------------------------------------------------


def _evaluate(text: str, scratch: dict[str, Any], what: str) -> Any:
    try:
        return eval(text, scratch)
    except Exception as exc:
        raise TrialError(_unbuilt(what, text, exc)) from None


def _unbuilt(what: str, text: str, exc: BaseException) -> str:
    """One line: what did not evaluate on the ranks, and what to do about it."""
    name = getattr(exc, "name", None) if isinstance(exc, NameError) else None
    hint = (
        f"define {name} in a %%distributed cell first"
        if name
        else "make it build in the ranks' namespace (it runs there, not in the notebook)"
    )
    return (
        f"{what} {text!r} does not evaluate on the ranks ({one_line(exc)}); --confirm builds the "
        f"model and batch on the ranks: {hint}"
    )


def _model(request: TrialRequest, scratch: dict[str, Any], helper: Helper) -> nn.Module:
    code = request["code"]
    if code is not None:
        try:
            return run_model_code(compile_model_code(code), scratch)  # type: ignore[no-any-return]
        except SpecError as exc:
            cause = exc.__cause__
            if isinstance(cause, NameError) and cause.name:
                raise TrialError(_unbuilt("the cell's model code, at", cause.name, cause)) from None
            raise TrialError(f"on rank {helper.rank}, {exc}") from None
    text = request["model"]
    assert text is not None
    value = _evaluate(text, scratch, "the model expression")
    if value is helper.prepared_model and value is not None:
        raise TrialError(
            f"the model expression {text!r} is the model shard.prepare wrapped on the ranks; pass the "
            "function that builds it, so that --confirm builds its own"
        )
    if isinstance(value, nn.Module):
        try:
            return copy.deepcopy(value)  # the user's own module is left as it is
        except Exception as exc:
            raise TrialError(
                f"the model {text!r} cannot be copied on the ranks ({one_line(exc)}); pass the "
                "function that builds it"
            ) from None
    if callable(value):
        try:
            built = value()
        except Exception as exc:
            raise TrialError(_unbuilt("the model builder", f"{text}()", exc)) from None
        if isinstance(built, nn.Module):
            return built
    raise TrialError(f"the model expression {text!r} gives no nn.Module on the ranks; pass a builder")


def _batch(request: TrialRequest, scratch: dict[str, Any], device: torch.device) -> object:
    """The ``--batch`` expression evaluated here, cut or repeated along its first dimension to the
    size asked (its values kept, such as token ids in range), on the rank's device."""
    value = _evaluate(request["batch"], scratch, "--batch")
    old, new = request["batch_size"], request["size"]

    def resized(item: object) -> object:
        if isinstance(item, torch.Tensor):
            if item.dim() and item.shape[0] == old and new != old:
                times = -(-new // old)
                item = (item.repeat(times, *([1] * (item.dim() - 1))) if times > 1 else item)[:new].clone()
            return item.to(device)
        if isinstance(item, tuple | list):
            return type(item)(resized(i) for i in item)
        if isinstance(item, dict):
            return {k: resized(v) for k, v in item.items()}
        raise TrialError(
            f"--batch {request['batch']!r} holds a {type(item).__name__} on the ranks, not tensors"
        )

    return resized(value)


def _step(request: TrialRequest, scratch: dict[str, Any]) -> Callable[[nn.Module, Any], object] | None:
    text = request["step"]
    if text is None:
        return None
    value = _evaluate(text, scratch, "--step")
    if not callable(value):
        raise TrialError(f"--step {text!r} is a {type(value).__name__} on the ranks; pass a function")
    step: Callable[[nn.Module, Any], object] = value
    return step


class _History:
    """The rank shell's input history as it was before the cell that runs :func:`confirm`, which
    IPython has stored already (``In``, ``_i``, ``_i<n>``): :meth:`forget` takes that cell out."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.count = int(shell.execution_count) - 1  # the plain-cell path counts before running
        manager = shell.history_manager
        raw = manager.input_hist_raw if manager is not None else []
        self.source = raw[-1] if raw else None

    def forget(self) -> None:
        shell, manager = self.shell, self.shell.history_manager
        key = f"_i{self.count}"
        if manager is None or self.source is None or shell.user_ns.get(key) != self.source:
            return
        raw, parsed = manager.input_hist_raw, manager.input_hist_parsed
        if raw and raw[-1] == self.source:
            raw.pop()
            if parsed:
                parsed.pop()

        def back(k: int) -> str:
            return str(raw[-k]) if len(raw) >= k else ""

        manager._i00, manager._i, manager._ii, manager._iii = back(1), back(2), back(3), back(4)
        shell.user_ns.pop(key, None)
        shell.user_ns_hidden.pop(key, None)
        shell.user_ns.update({"_i": manager._i, "_ii": manager._ii, "_iii": manager._iii})
        shell.execution_count = self.count
