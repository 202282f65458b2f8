"""The step-hook interface every instrument implements, and the list the trainer loop calls.

An instrument looks at training steps without taking part in them: the collective recorder
(``comm.record_step``), the matmul census (``profiling.matmul_census_step``), the torch
profiler and memory snapshots (``[profiling]``) and the fake-backend meter (``comm.mode =
"fake_backend"``). Each is a :class:`StepHook`; :func:`trainer.instruments.build_instruments`
builds the ones the config asks for, in one place, and the loop calls them through
:class:`Instruments`: ``on_step_start`` in list order before a step, ``on_step_end`` in reverse
order after it (so an instrument started earlier wraps the ones started after it, like nested
``with`` blocks), ``close`` in reverse order when the loop ends.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["HookBase", "Instruments", "StepHook"]


@runtime_checkable
class StepHook(Protocol):
    """One instrument. ``messages``: lines for the start-up log (set when it is built)."""

    messages: list[str]

    def on_step_start(self, step: int) -> None:
        """Step ``step`` (1-based, global) is about to run."""

    def on_grads_ready(self, params: Sequence[Any]) -> None:
        """The running step's gradients are final (reduced, not yet clipped)."""

    def on_step_end(self, step: int, result: Any) -> Mapping[str, Any] | None:
        """Step ``step`` has run (``result``: its ``StepResult``); returns the fields it adds to
        the step's metrics record, if any."""

    def close(self, exc: BaseException | None = None) -> None:
        """The loop ended (``exc``: the exception that ended it, if any)."""


class HookBase:
    """No-op defaults for every :class:`StepHook` method."""

    messages: list[str]

    def __init__(self) -> None:
        self.messages = []

    def on_step_start(self, step: int) -> None:
        pass

    def on_grads_ready(self, params: Sequence[Any]) -> None:
        pass

    def on_step_end(self, step: int, result: Any) -> Mapping[str, Any] | None:
        return None

    def close(self, exc: BaseException | None = None) -> None:
        pass


class Instruments:
    """The hooks of one run, called in order; a context manager that closes them."""

    def __init__(self, hooks: Sequence[StepHook] = ()) -> None:
        self.hooks = list(hooks)
        self._closed = False

    @property
    def messages(self) -> list[str]:
        return [m for hook in self.hooks for m in hook.messages]

    def run_step(self, step: int, run: Callable[..., Any], *args: Any) -> tuple[Any, dict[str, Any]]:
        """``run(*args)`` (the training step ``step``) between the hooks' ``on_step_start`` (in
        order) and ``on_step_end`` (innermost first): its result and the metrics fields the
        hooks add. A step that raises closes the hooks at once (with the exception)."""
        for hook in self.hooks:
            hook.on_step_start(step)
        try:
            result = run(*args)
        except BaseException as exc:
            self.close(exc)
            raise
        extra: dict[str, Any] = {}
        for hook in reversed(self.hooks):
            extra.update(hook.on_step_end(step, result) or {})
        return result, extra

    def grads_ready(self, params: Sequence[Any]) -> None:
        for hook in self.hooks:
            hook.on_grads_ready(params)

    def close(self, exc: BaseException | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        for hook in reversed(self.hooks):
            hook.close(exc)

    def __enter__(self) -> Instruments:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)
