"""Changes to a model that Ctrl-C cannot leave half-done: hooks, activation caching, weight swaps.

TransformerLens removes context hooks in a ``finally`` block, but a KeyboardInterrupt can land
while that removal runs (it loops over every hook point), before the ``try`` is entered, or at
the first instruction of a context manager's ``__exit__``: hooks stay attached, or the hook
context level ends off by one. A weight swap put back in a loop has the same windows.

Here every such change is an :class:`InterruptSafeChange`. While one is active, a SIGINT handler
of ours is installed (main thread only; the previous one is restored when the last change ends).
A Ctrl-C during the change's ``__enter__`` or ``__exit__`` (found on the interrupted frame's
stack) is held and delivered, through the previous handler, as soon as the model is whole again:
an interrupted ``__enter__`` first undoes what it applied. Anywhere else, for example during the
forward passes inside the ``with`` block, Ctrl-C is delivered at once, as usual.

Every place in cpsuper that attaches hooks goes through :class:`hooked` (or
:func:`run_with_cache`); weight edits go through :class:`swapped_parameters`.
"""

from __future__ import annotations

import difflib
import signal
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor
from transformer_lens import ActivationCache

if TYPE_CHECKING:  # the type only: backend runs its forward passes under these hooks
    from .backend import Model

__all__ = [
    "InterruptSafeChange",
    "check_hook_names",
    "hooked",
    "run_with_cache",
    "skipped_blocks",
    "swapped_parameters",
]

HookList = Iterable[tuple[str | Callable, Callable]]


class _Guard:
    """The process's SIGINT state while changes are active (signals reach the main thread only)."""

    depth = 0  # active changes that installed the handler
    previous: Any = None  # the handler to restore and to deliver through
    pending: tuple | None = None  # a held (signum, frame)


def _handle_sigint(signum: int, frame: Any) -> None:
    code = frame
    while code is not None:
        if code.f_code in _GUARDED:
            _Guard.pending = (signum, frame)
            return
        code = code.f_back
    _Guard.previous(signum, frame)


def _guard_on() -> bool:
    """Install our handler (if this is the first active change); whether this call counts."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if _Guard.depth == 0:
        current = signal.getsignal(signal.SIGINT)
        if not callable(current):  # SIG_DFL / SIG_IGN / not set from Python: no KeyboardInterrupt
            return False
        if current is not _handle_sigint:
            _Guard.previous = current
        signal.signal(signal.SIGINT, _handle_sigint)
    _Guard.depth += 1
    return True


def _guard_off(counted: bool) -> None:
    if counted:
        _Guard.depth -= 1
        if _Guard.depth == 0:
            signal.signal(signal.SIGINT, _Guard.previous)


def _deliver() -> None:
    if _Guard.pending is not None:
        pending, _Guard.pending = _Guard.pending, None
        _Guard.previous(*pending)  # Python's default handler raises KeyboardInterrupt here


class InterruptSafeChange:
    """A context manager that changes a model on entry and undoes it on exit, whole, whenever
    Ctrl-C is pressed (see the module's docstring).

    Subclasses define :meth:`apply` and :meth:`undo`, both short (no forward pass). ``undo``
    must be idempotent and undo a partial ``apply``: it runs on exit, and on entry when
    ``apply`` fails or an interrupt arrived during it.
    """

    model: Model

    def apply(self) -> None:
        raise NotImplementedError

    def undo(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Model:
        self._counted = _guard_on()
        try:
            self.apply()
        except BaseException:
            self.undo()
            _guard_off(self._counted)
            raise
        if _Guard.pending is not None:  # Ctrl-C while applying: leave the model as it was, stop
            self.undo()
            _guard_off(self._counted)
            _deliver()
        return self.model

    def __exit__(self, *exc: object) -> bool:
        try:
            self.undo()
        finally:
            _guard_off(self._counted)
            _deliver()
        return False


def check_hook_names(model: Model, names: Iterable[str | Callable]) -> None:
    """Raise a ValueError naming a hook the model lacks, with the closest hook names it has
    (TransformerLens raises a bare KeyError, or on the bridge silently attaches nothing). A
    callable is a name filter and is left to TransformerLens."""
    names = [n for n in names if not callable(n)]
    if not names:
        return
    known = model.hook_dict  # built afresh on every access on the bridge: read it once
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"A hook is named by a string or a filter function, got {name!r} ({type(name).__name__}).")
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(map(repr, close))}?" if close else "model.hook_dict lists its hook names."
            raise ValueError(f"The model has no hook {name!r}; {hint}")


class hooked(InterruptSafeChange):  # noqa: N801 - used like model.hooks(...)
    """``model.hooks(fwd_hooks=..., bwd_hooks=...)`` whose adding and removing of hooks a
    Ctrl-C cannot cut short. Nests like ``model.hooks`` (each level removes only its hooks).

    >>> with hooked(model, [("blocks.0.hook_resid_post", hook)]):
    ...     logits = model(tokens)
    """

    def __init__(self, model: Model, fwd_hooks: HookList = (), bwd_hooks: HookList = ()):
        self.model, self.fwd_hooks, self.bwd_hooks = model, list(fwd_hooks), list(bwd_hooks)
        self.context = None
        check_hook_names(model, [name for name, _ in self.fwd_hooks + self.bwd_hooks])

    def apply(self) -> None:
        context = self.model.hooks(fwd_hooks=self.fwd_hooks, bwd_hooks=self.bwd_hooks)
        context.__enter__()
        self.context = context

    def undo(self) -> None:
        context, self.context = self.context, None
        if context is not None:
            context.__exit__(None, None, None)


class _Caching(hooked):
    """:class:`hooked` with TransformerLens's caching hooks, made on entry (which marks the
    model as caching) and cleared on exit."""

    def __init__(self, model: Model, **options: Any):
        super().__init__(model)
        self.options, self.cache = options, {}

    def apply(self) -> None:
        _, self.fwd_hooks, self.bwd_hooks = self.model.get_caching_hooks(cache=self.cache, **self.options)
        super().apply()

    def undo(self) -> None:
        super().undo()
        self.model.is_caching = False


def run_with_cache(
    model: Model,
    *model_args: Any,
    names_filter: Any = None,
    device: Any = None,
    remove_batch_dim: bool = False,
    incl_bwd: bool = False,
    pos_slice: Any = None,
    **model_kwargs: Any,
) -> tuple[Any, ActivationCache]:
    """``model.run_with_cache(...)`` with the caching hooks attached by :class:`hooked`."""
    caching = _Caching(
        model,
        names_filter=names_filter,
        incl_bwd=incl_bwd,
        device=device,
        remove_batch_dim=remove_batch_dim,
        pos_slice=pos_slice,
    )
    with caching:
        out = model(*model_args, **model_kwargs)
        if incl_bwd:
            out.backward()
    return out, ActivationCache(caching.cache, model, has_batch_dim=not remove_batch_dim)


def _pass_through(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    return hidden_states


def _pass_through_as_tuple(hidden_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor]:
    return (hidden_states,)


def _blocks_return_tuples(model: Model) -> bool:
    """Whether the model's layer loop unpacks a one-element tuple from each block: TransformerLens
    4.3's native models do (``(hidden,) = block(...)``); Hugging Face's decoder layers return the
    tensor itself."""
    try:
        from transformer_lens.model_bridge.sources.native.model import NativeModel
    except ImportError:
        return False
    return isinstance(getattr(model, "original_model", None), NativeModel)


class skipped_blocks(InterruptSafeChange):  # noqa: N801 - used like a function
    """A TransformerBridge's blocks ``0 .. n-1`` hand their input on without computing anything.

    TransformerLens 4.3's ``start_at_layer`` runs every block before the start and then discards
    what they produced (the start block takes the given residual instead), so a resumed run costs
    a whole forward pass. With those blocks passing their input through, it costs only the blocks
    it needs; the result is the same, because the start block replaces its input anyway. (Hugging
    Face decoder layers return the hidden states as one tensor from transformers 5 on, which
    TransformerLens 4.3 requires; its native models, which the toys use, unpack a one-element tuple.)

    On exit it also disarms the bridge's own ``start_at_layer`` state, which the bridge sets on
    every block before the ``try`` whose ``finally`` clears it: a Ctrl-C in between would leave
    the next, unrelated forward pass taking a stale residual."""

    def __init__(self, model: Model, n: int):
        self.model, self.blocks = model, list(model.blocks)[:n]

    def apply(self) -> None:
        forward = _pass_through_as_tuple if _blocks_return_tuples(self.model) else _pass_through
        for block in self.blocks:
            # on the block itself: a bridge component's own __setattr__ would pass the attribute
            # on to the Hugging Face layer it wraps
            object.__setattr__(block, "forward", forward)

    def undo(self) -> None:
        for block in self.blocks:
            block.__dict__.pop("forward", None)
        disarm = getattr(self.model, "_teardown_start_at_layer", None)  # TransformerLens >= 4.3
        if disarm is not None:
            disarm()


class swapped_parameters(InterruptSafeChange):  # noqa: N801 - used like a function
    """Put ``replacements`` (parameter name -> tensor) in place of the model's parameters for the
    block; the original tensors themselves come back on exit, so the model is bit-for-bit as
    before, also after an exception or Ctrl-C."""

    def __init__(self, model: Model, replacements: Mapping[str, Tensor]):
        self.model, self.replacements = model, dict(replacements)
        self.saved: dict[str, Tensor] = {}

    def apply(self) -> None:
        for name, new in self.replacements.items():
            param = self.model.get_parameter(name)
            self.saved.setdefault(name, param.data)
            param.data = new.to(device=param.device, dtype=param.dtype)

    def undo(self) -> None:
        while self.saved:
            name, original = next(iter(self.saved.items()))
            self.model.get_parameter(name).data = original
            del self.saved[name]


_GUARDED = {InterruptSafeChange.__enter__.__code__, InterruptSafeChange.__exit__.__code__}
