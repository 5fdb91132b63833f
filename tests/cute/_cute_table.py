"""Shared helpers of the flash_attn.cute tests. swap_kernels: replace the contents of flash_attn.cute's one in-memory kernel
table for a test; cute_settings: the cute_env fixture as a context manager (for module-scoped fixtures).

kernels._kernels is one dict, imported by launch.py and interface.py (their per-call paths read it under their own
names), so a test cannot rebind the name: it replaces the dict's contents, and the test's end restores them exactly
(entries a call added during the test included, e.g. fwd_kernel's "short" entry that names the usual kernel)."""
import contextlib

import pytest

from flash_attn.cute import kernels, settings


class _Restore:
    """Restores ``table``'s contents when monkeypatch undoes its ``state`` (set to None again)."""

    def __init__(self, table):
        self._table, self._saved = table, dict(table)

    @property
    def state(self):
        return None

    @state.setter
    def state(self, value):
        if value is None:  # monkeypatch.undo()
            self._table.clear()
            self._table.update(self._saved)


def swap_kernels(monkeypatch, table, target=None):
    """kernels._kernels (or ``target``) holds exactly ``table`` until the test ends."""
    target = kernels._kernels if target is None else target
    monkeypatch.setattr(_Restore(target), "state", "swapped")
    target.clear()
    target.update(table)


@contextlib.contextmanager
def cute_settings(**names):
    """The cute_env fixture (tests/conftest.py) for module-scoped fixtures: FLASH_ATTN_CUTE_<name> set (None or "":
    unset; OVERRIDES and DISABLE unset unless given) and read again for the block, restored and read again after."""
    names = {"OVERRIDES": None, "DISABLE": None, **names}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in names.items():
            if value is None or value == "":
                mp.delenv("FLASH_ATTN_CUTE_" + name, raising=False)
            else:
                mp.setenv("FLASH_ATTN_CUTE_" + name, str(value))
        settings.reload()
        try:
            yield
        finally:
            mp.undo()
            settings.reload()
