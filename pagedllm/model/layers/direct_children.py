"""A module base whose children are plain attributes, for modules read at every step of a forward pass."""

from torch import nn


class DirectChildren(nn.Module):
    """Keeps each child module in the instance ``__dict__`` too, so ``self.child`` in a forward is a
    plain attribute read: otherwise every such read misses and runs ``nn.Module.__getattr__``
    (~0.5-0.9 us; about a dozen a layer per step). The child still lives in ``_modules`` (state
    dicts, ``.to()``, hooks and ``__call__`` are unchanged); assigning, adding or deleting a child
    refreshes the copy, so it never goes stale."""

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        self._refresh_child(name)

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        self._refresh_child(name)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        super().add_module(name, module)
        self._refresh_child(name)

    register_module = add_module

    def _refresh_child(self, name: str) -> None:
        modules = self.__dict__.get("_modules")
        if modules is not None and name in modules:
            self.__dict__[name] = modules[name]
        elif modules is not None:
            child = self.__dict__.get(name)
            if isinstance(child, nn.Module):  # a stale copy of a removed child
                del self.__dict__[name]
