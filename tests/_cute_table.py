"""swap_kernels: replace the contents of flash_attn.cute's one in-memory kernel table for a test.

kernels._kernels is one dict, imported by launch.py and interface.py (their per-call paths read it under their own
names), so a test cannot rebind the name: it replaces the dict's contents, and the test's end restores them exactly
(entries a call added during the test included, e.g. fwd_kernel's "short" entry that names the usual kernel)."""
from flash_attn.cute import kernels


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
