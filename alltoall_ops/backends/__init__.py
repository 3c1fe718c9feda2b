"""The backends, one module each, and their registration (the order of ``backend=`` choices).

    base.py        the interface (:class:`Backend`, :class:`DispatchHandle`) and the registry
    local.py       one rank, no communication
    collective.py  all-to-alls over a process group, and the custom ops local shares
    symm_mem/      peer-addressable buffers and Triton kernels, no host sync

A new backend: a module with a :class:`Backend` subclass and its :class:`DispatchHandle`, and one
line below.
"""

from .base import Backend, DispatchHandle, auto, choose, names, register
from .collective import CollectiveBackend
from .local import LocalBackend
from .symm_mem import SymmMemBackend

for _backend in (LocalBackend(), CollectiveBackend(), SymmMemBackend()):
    register(_backend)

__all__ = ["Backend", "DispatchHandle", "auto", "choose", "names", "register"]
