"""Developer tools, run from the repo root as ``python -m tools.<name>``: the GPU checks
(``gpu_*``; their checks are also the tests of ``pytest -m gpu tests/``), kernel sweeps,
profiles and host costs."""
