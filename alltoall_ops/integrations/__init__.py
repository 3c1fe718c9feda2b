"""Integrations with other libraries, one module each, imported only when asked for: importing
:mod:`alltoall_ops` imports none of them, nor the libraries they serve.

- :mod:`alltoall_ops.integrations.transformers`: expert-parallel implementations for Hugging
  Face transformers' ``DistributedConfig(ep_implementation=...)``; call its ``register()``.
"""
