"""torch.compile's disk caches never hand one version of the package another's compiled graphs
(issue 40), and an unchanged package keeps its warm cache.

Copies of the package (the installed one, one with a changed Python backward, one with a changed
inlined op body) each run the same dispatch -> combine step, eager and compiled, in a fresh
process on one cache directory, in turn. Before the fix, AOTAutograd's cache keyed that step on
dynamo's graph, where each op is a call by name, and the second copy's compiled step returned the
first copy's gradient. ``alltoall_ops/_cache_key.py`` puts the package's source hash in the key.

CPU tensors everywhere, CUDA tensors where there is CUDA (the inlined bodies' Triton kernels then in
the graph). On a GPU host (torch 2.11): ``python3 -m pytest -q tests/test_compile_cache.py``. Six
processes a device, about 30 s on the CPU with 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parent.parent / "alltoall_ops"

# A step every backend change would touch: local dispatch (an inlined op), experts, combine.
WORKER = textwrap.dedent("""
    import json, sys
    import torch
    import alltoall_ops as a2a
    from torch._dynamo.utils import counters

    assert a2a.__file__.startswith(sys.argv[1]), (a2a.__file__, sys.argv[1])
    if sys.argv[2] != "-":  # the control: another copy's tag (as if the key did not see the change)
        torch.compiler.config.cache_key_tag = sys.argv[2]
    device = sys.argv[3]
    T, H, E, K = 8, 4, 4, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g, dtype=torch.float64).to(device)
    w = torch.rand(T, K, generator=g, dtype=torch.float64).to(device)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
    up = torch.randn(T, H, generator=g, dtype=torch.float64).to(device)

    def step(x, w, idx):
        routed, tokens_per_expert, handle = a2a.dispatch(x, idx, num_experts=E, backend="local")
        return a2a.combine(routed * 2.0 + 1.0, handle, w)

    def run(fn):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xs, ws, idx)
        y.backward(up)
        return [t.detach().cpu().tolist() for t in (y, xs.grad, ws.grad)]

    config = {"fallback_by_default": True} if device == "cpu" and hasattr(torch._inductor.config,
                                                                           "fallback_by_default") else {}
    eager = run(step)
    with torch._inductor.config.patch(config):
        compiled = run(torch.compile(step, backend="inductor", fullgraph=True))
    print(json.dumps({"eager": eager, "compiled": compiled, "tag": torch.compiler.config.cache_key_tag,
                      "aot": dict(counters["aot_autograd"]), "torch": torch.__version__, "device": device}))
""")

# NB: appended to a module of the copy, so they apply whatever the code above them says.
CHANGES = {
    # a Python backward formula: combine's gradient for the expert outputs doubled
    "backward": ("backends/local.py", """
        _issue40_backward = _local_combine_backward

        def _local_combine_backward(ctx, grad_y_TH):
            grads = _issue40_backward(ctx, grad_y_TH)
            return (None if grads[0] is None else 2 * grads[0], *grads[1:])

        local_combine_op.register_autograd(_local_combine_backward, setup_context=_local_combine_setup_context)
    """),
    # the body local_dispatch (custom_op(inline=True)) traces into the graph: every row tripled
    "inlined_body": ("backends/local.py", """
        _issue40_gather_rows = gather_rows

        def gather_rows(*args, **kwargs):
            return 3 * _issue40_gather_rows(*args, **kwargs)
    """),
}


def _copy(root: Path, name: str, change: str | None = None) -> Path:
    """A copy of the package under ``root / name`` (its parent directory, for PYTHONPATH)."""
    parent = root / name
    shutil.copytree(PACKAGE, parent / "alltoall_ops", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if change is not None:
        module, code = CHANGES[change]
        with open(parent / "alltoall_ops" / module, "a") as f:
            f.write("\n" + textwrap.dedent(code))
    return parent


def _step(parent: Path, cache_dir: Path, device: str, tag: str = "-") -> dict:
    """The worker's step on ``device`` in a fresh process importing the copy under ``parent`` (with
    ``tag`` as ``torch.compiler.config.cache_key_tag``, unless "-")."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TORCH_COMPILE_"))}
    env.update(PYTHONPATH=str(parent), TORCHINDUCTOR_CACHE_DIR=str(cache_dir), PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run([sys.executable, "-c", WORKER, str(parent), tag, device], capture_output=True, text=True,
                         timeout=300, cwd=parent, env=env, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _close(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(u, v) for u, v in zip(a, b))
    return abs(a - b) <= 1e-9 * (1 + abs(b))


def _assert_compiled_is_eager(result: dict, what: str) -> None:
    names = ("y", "x.grad", "weights.grad")
    for name, eager, compiled in zip(names, result["eager"], result["compiled"]):
        assert _close(compiled, eager), (f"{what}: the compiled {name} is not the eager one (a stale compiled "
                                         f"graph from the cache?): {compiled} vs {eager}; {result['aot']}")


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_a_changed_package_never_loads_another_versions_graphs(tmp_path, device):
    cache = tmp_path / "cache"
    base, same = _copy(tmp_path, "base"), _copy(tmp_path, "same")

    cold = _step(base, cache, device)
    _assert_compiled_is_eager(cold, "the first process")
    assert cold["aot"].get("autograd_cache_miss", 0) >= 1 and cold["aot"].get("autograd_cache_saved", 0) >= 1, cold

    warm = _step(base, cache, device)  # the same code in a second process: a warm cache
    _assert_compiled_is_eager(warm, "the same package again")
    assert warm["aot"].get("autograd_cache_hit", 0) >= 1 and not warm["aot"].get("autograd_cache_miss"), warm

    elsewhere = _step(same, cache, device)  # the same files installed elsewhere: the same key
    assert elsewhere["tag"] == warm["tag"]
    assert elsewhere["aot"].get("autograd_cache_hit", 0) >= 1, elsewhere

    for change in CHANGES:
        changed = _step(_copy(tmp_path, change, change), cache, device)
        _assert_compiled_is_eager(changed, f"the package with a changed {change}")
        assert changed["aot"].get("autograd_cache_miss", 0) >= 1, changed
        assert changed["tag"] != warm["tag"]
        assert not _close(changed["eager"], warm["eager"]), f"{change}: the change changed nothing"

    # The control: the changed backward under the unchanged package's tag (the key as it was before
    # the fix) is served the unchanged package's graph, so this test sees a stale graph.
    stale = _step(_copy(tmp_path, "control", "backward"), cache, device, warm["tag"])
    assert stale["aot"].get("autograd_cache_hit", 0) >= 1, stale
    assert not _close(stale["compiled"][1], stale["eager"][1]), (
        "torch now keys AOTAutograd's cache on the ops' backward itself: the library's tag may be redundant", stale)


def test_a_tag_set_before_the_import_is_kept():
    """``TORCH_COMPILE_CACHE_KEY_TAG`` (or a tag assigned before the import) keeps its value, the
    library's part appended once; a reload replaces that part."""
    from alltoall_ops import _cache_key

    assert _cache_key.with_tag("") == _cache_key.TAG
    assert _cache_key.with_tag("mine") == f"mine|{_cache_key.TAG}"
    assert _cache_key.with_tag("mine|alltoall_ops=0123abcd|other") == f"mine|other|{_cache_key.TAG}"
    assert _cache_key.with_tag(_cache_key.with_tag("mine")) == f"mine|{_cache_key.TAG}"
    env = {**os.environ, "TORCH_COMPILE_CACHE_KEY_TAG": "mine"}
    code = "import torch, alltoall_ops; print(torch.compiler.config.cache_key_tag)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         cwd=PACKAGE.parent, check=True)
    assert re.fullmatch(r"mine\|alltoall_ops=[0-9a-f]{16}", out.stdout.strip()), out.stdout


if __name__ == "__main__":
    sys.exit(pytest.main(["-q", __file__]))
