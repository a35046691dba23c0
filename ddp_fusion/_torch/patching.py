"""One way to change process-wide settings of torch and put them back: :class:`Patches`.

Every process-wide change ddp_fusion makes (a torch DDP method replaced, Inductor's
post-grad pass slot filled, compiled autograd switched on) goes through a
:class:`Patches`, which keeps, per :class:`Setting`, the value from before ddp_fusion
first changed it and the value ddp_fusion put there:

* an entry is dropped only once its undo has succeeded (an undo that raises keeps it,
  and the next :meth:`Patches.restore` tries again);
* changing a setting again (a re-install) keeps the original value; only a setting
  whose value someone else replaced for good (``Setting.whose`` says ``REPLACED``)
  takes its original afresh from the value in place;
* :meth:`Patches.restore` first asks every setting whose value is in place, and
  refuses (``RuntimeError``, nothing changed) if any of ddp_fusion's values is
  ``COVERED``: something set later will put it back (torch's compiled-autograd context
  restores the compiler it found when it closes).

Whose value is in place is, by default, identity: ``OURS`` if the current value is
the one ddp_fusion set, else ``REPLACED`` (someone else set theirs after ours; it is
left alone). A setting with a richer history (compiled autograd's nested contexts)
gives its own ``whose``.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any

REQUIRED: tuple[str, ...] = ()
UNCHECKED: dict[str, str] = {}

OURS = "ours"
"""ddp_fusion's value is in effect: restoring puts the original back."""
COVERED = "covered"
"""Someone set a value on top of ddp_fusion's and will put ddp_fusion's back: restoring
now is refused."""
REPLACED = "replaced"
"""Someone replaced ddp_fusion's value for good: restoring leaves theirs."""

MISSING: Any = object()
"""The value of an attribute that is not there."""


def _same(current: Any, ours: Any) -> str:
    return OURS if current is ours else REPLACED


@dataclasses.dataclass(frozen=True, eq=False)
class Setting:
    """One process-wide setting: how to read it, write it, and tell whose value is in
    place (``whose(current, ours)``: ``OURS``, ``COVERED`` or ``REPLACED``)."""

    name: str
    get: Callable[[], Any]
    set: Callable[[Any], None]
    whose: Callable[[Any, Any], str] = _same
    refusal: str = ""
    """Why restoring a ``COVERED`` value is refused, and what to do (the error's text)."""


def attribute(owner: Any, name: str) -> Setting:
    """The attribute ``name`` of ``owner`` (a class or a module) as a :class:`Setting`,
    read from ``owner``'s own ``__dict__`` (a classmethod compares as itself; an
    attribute inherited from a base reads as :data:`MISSING` and is removed again)."""

    def set_(value: Any) -> None:
        if value is MISSING:
            if name in vars(owner):
                delattr(owner, name)
        else:
            setattr(owner, name, value)

    if isinstance(owner, types.ModuleType):
        where = owner.__name__
    else:
        where = f"{owner.__module__}.{owner.__qualname__}"
    return Setting(f"{where}.{name}", lambda: vars(owner).get(name, MISSING), set_)


@dataclasses.dataclass
class _Entry:
    setting: Setting
    original: Any
    ours: Any


_NOTHING_YET = object()  # an entry recorded before its value was set


class Patches:
    """The process-wide settings one owner (``config.enabled``, say) changed, in the
    order first changed, and how to put each back."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def whose(self, setting: Setting) -> str | None:
        """``OURS``, ``COVERED`` or ``REPLACED`` for a setting changed here; None if
        it was not (or was restored since)."""
        entry = self._entries.get(setting.name)
        if entry is None:
            return None
        if entry.ours is _NOTHING_YET:
            return REPLACED
        return entry.setting.whose(entry.setting.get(), entry.ours)

    def ours(self, setting: Setting) -> Any:
        """The value set here last (``KeyError`` if none)."""
        return self._entries[setting.name].ours

    def set(self, setting: Setting, value: Any) -> None:
        """Set ``setting`` to ``value``, keeping the value from before the first change
        (unless someone has replaced ours since: then the value in place now is the
        one to put back)."""
        if self.whose(setting) in (None, REPLACED):
            # recorded before it is changed: a set that fails half-way is still undone
            self._entries[setting.name] = _Entry(setting, setting.get(), _NOTHING_YET)
        setting.set(value)
        self._entries[setting.name].ours = value

    def wrap(self, setting: Setting, make: Callable[[Any], Any]) -> None:
        """Set ``setting`` to ``make(value in place)`` unless ours is in place already
        (a wrapper is made once, around what it replaces)."""
        if self.whose(setting) not in (OURS, COVERED):
            self.set(setting, make(setting.get()))

    def restore(self) -> None:
        """Put back every setting's original, newest first, where ours is in place;
        leave a value someone else put there. Refused with ``RuntimeError`` (nothing
        changed, nothing dropped) while any of ours is covered."""
        entries = list(self._entries.values())[::-1]
        states = [self.whose(e.setting) for e in entries]  # all read before any is changed
        covered = [e.setting.refusal or e.setting.name for e, s in zip(entries, states) if s == COVERED]
        if covered:
            raise RuntimeError("; ".join(covered))
        for entry, state in zip(entries, states):
            if state == OURS:
                entry.setting.set(entry.original)
            del self._entries[entry.setting.name]  # only once its undo has succeeded
