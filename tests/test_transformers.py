"""``alltoall_ops.integrations.transformers`` inside Hugging Face transformers' own models: tiny
random-init Mixtral and Qwen3-MoE (built here, saved and loaded with ``from_pretrained``; no
downloads), expert-parallel on 2 and 4 gloo ranks, fp64, against the unsharded model and against
transformers' built-in ``ep_implementation="all_to_all"``: logits, the gradients of every
parameter and the losses of a short SGD loop, with fresh tokens (a new routing) every step.

Two layouts transformers builds: data + expert parallel (``fsdp_size=W, ep_size=W``: each rank
its own batch, FSDP2 on the dense parameters) and tensor + expert parallel (``tp_size=W,
ep_size=W``: one batch shared by the TP group, which the implementation slices). Compiled: the
whole model with ``fullgraph=True`` under TP + EP; under FSDP2 its hooks are dynamo-disabled
(a graph break at each FSDP module), so there the experts' forward (dispatch, experts, combine)
is compiled with ``fullgraph=True``. One compilation across the routings either way."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (make install adds it: the [transformers] extra)")

from alltoall_ops.integrations import transformers as a2a_hf  # noqa: E402
from alltoall_ops.testing import nan_unwritten_rows  # noqa: E402
from examples.train_hf_moe import build_config  # noqa: E402

VOCAB, BATCH, SEQ, STEPS, LR = 64, 2, 6, 3, 0.5
TOL = {"rtol": 1e-10, "atol": 1e-12}


def build(kind: str, layers: int = 2):
    """(config, model class) of a tiny random-init model: ``layers`` layers, 8 experts, top-2
    (the example's models, smaller)."""
    config, cls = build_config(kind, vocab=VOCAB, hidden=16, ffn=8, head_dim=4)
    config.num_hidden_layers = layers
    return config, cls


def load(path: str, cls, config=None):
    # batched_mm: the experts implementation that runs in fp64 on CPUs (grouped_mm wants fp32 / bf16)
    return cls.from_pretrained(path, dtype=torch.float64, experts_implementation="batched_mm",
                               distributed_config=config)


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole (DTensor shards gathered)."""
    return {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()}


def lm_loss(logits_BSV: torch.Tensor, ids_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in the logits' dtype (fp64; transformers' own loss is fp32)."""
    return torch.nn.functional.cross_entropy(logits_BSV[:, :-1].reshape(-1, VOCAB), ids_BS[:, 1:].reshape(-1))


def undo_expert_grad_division(model, world_size: int) -> None:
    """transformers 5.24's data + expert parallel layout leaves each expert gradient divided by W
    once too often (1 / W of the unsharded model's, here on gloo; the built-in "all_to_all"
    alike: FSDP2 on the size-1 expert-FSDP mesh with ``set_gradient_divide_factor(dp_size)``).
    Multiply it back, so that the gradients and the training loop can be compared."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts." in name:
                p.grad.mul_(world_size)


def assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=lambda m, n=n: f"{what}: {n}: {m}")


def run_models(rank: int, world_size: int, path: str, kind: str, layout: str, impl: str, compiled: bool,
               max_tokens_per_rank: int | None = None, layers: int = 2) -> tuple[int, list[float]]:
    """STEPS SGD steps of the sharded model (``impl``), the built-in "all_to_all" one and the
    unsharded one on the same tokens; checks logits and every gradient at each step and returns
    (frames compiled, this implementation's global losses)."""
    from transformers.distributed import DistributedConfig

    a2a_hf.register(max_tokens_per_rank=max_tokens_per_rank)
    config, cls = build(kind, layers)
    if rank == 0:
        torch.manual_seed(0)
        cls(config).to(torch.float64).save_pretrained(path)
    dist.barrier()
    W = world_size
    sizes = dict(fsdp_size=W, ep_size=W) if layout == "dp_ep" else dict(tp_size=W, ep_size=W)
    ours = load(path, cls, DistributedConfig(**sizes, ep_implementation=impl))
    builtin = load(path, cls, DistributedConfig(**sizes, ep_implementation="all_to_all"))
    dense = load(path, cls)
    models = (ours, builtin, dense)
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    step = ours
    if compiled and layout == "tp_ep":
        # transformers' TP forwards hook the parameters on their first call (a dict they fill: a
        # guard that recompiles once, whatever the routing), so one eager forward first
        ours(input_ids=torch.zeros(1, SEQ, dtype=torch.long))  # with grad: the hooks are for gradients
        step = torch.compile(ours, backend=counter, fullgraph=True)
    losses = []
    # symm_mem: the rows its copy-outs leave unwritten (routed's and the gradient's past the
    # groups, whatever the buffers held) are NaN here: none may reach a logit or a gradient
    with nan_unwritten_rows() as unwritten:
        for s in range(STEPS):
            # FSDP2's hooks are dynamo-disabled: compile inside them, the experts' forward; symm_mem
            # after one eager step, which makes the buffers
            if compiled and layout == "dp_ep" and s == (1 if impl.endswith("symm_mem") else 0):
                for layer in ours.model.layers:
                    experts = layer.mlp.experts
                    experts.forward = torch.compile(experts.forward, backend=counter, fullgraph=True)
            g = torch.Generator().manual_seed(1000 * s + 17)  # fresh tokens: a new routing every step
            ids_all = torch.randint(0, VOCAB, (W * BATCH, SEQ), generator=g)
            # dp_ep: rank r holds rows [r*B, (r+1)*B); tp_ep: every rank the whole batch
            mine = slice(rank * BATCH, (rank + 1) * BATCH) if layout == "dp_ep" else slice(None)
            ids = ids_all[mine]
            out, out_builtin, out_dense = step(input_ids=ids), builtin(input_ids=ids), dense(input_ids=ids_all)
            torch.testing.assert_close(out.logits, out_dense.logits[mine], **TOL)
            torch.testing.assert_close(out.logits, out_builtin.logits, **TOL)
            loss, loss_builtin, loss_dense = (lm_loss(o.logits, i) for o, i in
                                              ((out, ids), (out_builtin, ids), (out_dense, ids_all)))
            for each in (loss, loss_builtin, loss_dense):
                each.backward()
            if layout == "dp_ep":
                for m in (ours, builtin):
                    undo_expert_grad_division(m, W)
            loss = loss.detach()
            if layout == "dp_ep":  # each rank's loss is the mean of its batch: the global one is their mean
                dist.all_reduce(loss)
                loss /= W
            torch.testing.assert_close(loss, loss_dense.detach(), **TOL)
            grads = full_grads(ours)
            assert all(torch.isfinite(g).all() for g in grads.values())
            assert_same(grads, full_grads(dense), f"step {s}, vs the unsharded model")
            assert_same(grads, full_grads(builtin), f"step {s}, vs ep_implementation='all_to_all'")
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
    if impl.endswith("symm_mem"):
        assert min(unwritten) > 0  # the rows were there
    assert len(set(losses)) == STEPS, losses  # the parameters (and tokens) changed between steps
    return counter.frame_count, losses


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_data_and_expert_parallel(request, tmp_path, kind, world_size, compiled):
    pool = request.getfixturevalue(f"pool{world_size}")
    results = pool.run(run_models, str(tmp_path / "model"), kind, "dp_ep", "alltoall_ops", compiled, timeout=240)
    frames, losses = zip(*results)
    assert all(ls == losses[0] for ls in losses)
    assert frames == ((1,) if compiled else (0,)) * world_size  # one compilation across the routings


@pytest.mark.parametrize("kind,world_size", [("mixtral", 2), ("qwen3_moe", 2), ("mixtral", 4)])
def test_tensor_and_expert_parallel_compiled_whole_model(request, tmp_path, kind, world_size):
    """The TP group shares one batch: each rank dispatches its slice and the outputs are gathered
    over TP, as in the built-in. The whole model compiles with fullgraph=True (the built-in does
    not: it branches on its data-dependent row count)."""
    pool = request.getfixturevalue(f"pool{world_size}")
    results = pool.run(run_models, str(tmp_path / "model"), kind, "tp_ep", "alltoall_ops", True, timeout=300)
    assert [frames for frames, _ in results] == [1] * world_size


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_symm_mem(pool2, tmp_path, compiled):
    """``"alltoall_ops_symm_mem"``, buffers for BATCH * SEQ tokens a rank, made by the first (eager)
    forward; compiled steps after it, each layer's experts' forward compiled with fullgraph=True.
    Its 12 layers share one set of buffers, a constant of the graph: one compilation in all, none
    per layer (past dynamo's recompile limit of 8: FailOnRecompileLimitHit) or per routing."""
    results = pool2.run(run_models, str(tmp_path / "model"), "mixtral", "dp_ep", "alltoall_ops_symm_mem", compiled,
                        max_tokens_per_rank=BATCH * SEQ, layers=12 if compiled else 2, timeout=300)
    assert [frames for frames, _ in results] == ([1, 1] if compiled else [0, 0])


@pytest.mark.parametrize("experts_implementation", ["batched_mm", "grouped_mm"])
def test_one_rank_local_backend_on_static_rows(pool1, experts_implementation):
    """On one rank ("local": C static rows, zero past tokens_per_expert.sum(), local expert id e
    there) the implementation equals the experts module run on its tokens directly, eager and
    compiled, for two routings. grouped_mm (fp32): the rows go straight to the grouped GEMMs,
    without the experts forward's sort and scatter."""
    pool1.run(run_one_rank, experts_implementation)


def run_one_rank(rank: int, world_size: int, experts_implementation: str):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config, _ = build("mixtral")
    config._experts_implementation = experts_implementation
    grouped = experts_implementation == "grouped_mm"
    dtype, tol = (torch.float32, dict(rtol=1e-5, atol=1e-5)) if grouped else (torch.float64, TOL)
    torch.manual_seed(0)
    experts = MixtralExperts(config).to(dtype)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.3)
    experts._is_expert_parallel = True  # as transformers marks sharded experts: id e means "not here"
    assert a2a_hf._grouped_mm_experts(experts) == grouped
    mesh = init_device_mesh("cpu", (1,))
    impl = a2a_hf.AllToAllOpsEP(experts, mesh, mesh)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(impl.__call__, backend=counter, fullgraph=True)
    for _ in range(2):  # two routings
        x = torch.randn(10, 16, dtype=dtype, requires_grad=True)
        scores = torch.randn(10, 8, dtype=dtype).softmax(-1)
        weights, idx = scores.topk(2, dim=-1)
        weights.requires_grad_()
        want = experts(x, idx, weights)
        grads_want = torch.autograd.grad(want.square().sum(), [x, weights, *experts.parameters()])
        for fn in (impl, compiled):
            got = fn(x, idx, weights)
            torch.testing.assert_close(got, want, **tol)
            grads = torch.autograd.grad(got.square().sum(), [x, weights, *experts.parameters()])
            for a, b in zip(grads, grads_want):
                torch.testing.assert_close(a, b, **tol)
    assert counter.frame_count == 1


def test_symm_mem_errors_name_what_the_user_sets(pool1):
    """``"alltoall_ops_symm_mem"`` compiled before any eager forward: the library's RuntimeError
    (run one forward first) is the error's first line, not dynamo's "Observed exception"; more
    tokens than the buffers hold: a CapacityError naming ``register(max_tokens_per_rank=)``."""
    pool1.run(run_symm_mem_errors)


def run_symm_mem_errors(rank: int, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from alltoall_ops.errors import CapacityError

    config, _ = build("mixtral")
    config._experts_implementation = "batched_mm"
    experts = MixtralExperts(config).to(torch.float64)
    experts._is_expert_parallel = True
    mesh = init_device_mesh("cpu", (1,))
    a2a_hf.register(max_tokens_per_rank=4)
    impl = a2a_hf.AllToAllOpsSymmMemEP(experts, mesh, mesh)
    idx = torch.randint(0, 8, (5, 2))
    x, weights = torch.randn(5, 16, dtype=torch.float64), torch.rand(5, 2, dtype=torch.float64)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError) as raised:
        torch.compile(impl.__call__, backend="aot_eager", fullgraph=True)(x[:4], idx[:4], weights[:4])
    assert str(raised.value).startswith("RuntimeError: ep_implementation='alltoall_ops_symm_mem': the buffers are "
                                        "made by the first forward, which must run eagerly"), raised.value
    with pytest.raises(CapacityError, match=r"raise it with alltoall_ops\.integrations\.transformers\.register\("
                                            r"max_tokens_per_rank=\.\.\.\) .*now 4\)"):
        impl(x, idx, weights)  # 5 tokens, buffers for 4


def test_register_and_no_import_side_effects():
    """Importing alltoall_ops (and the integration module) imports no transformers;
    register() adds both names to transformers' registry."""
    code = ("import sys, alltoall_ops, alltoall_ops.integrations.transformers as m; "
            "assert 'transformers' not in sys.modules, 'imported transformers'; "
            "names = m.register(); "
            "from transformers.distributed.expert_parallel import EPImplementationInterface as I; "
            "assert all(I()[n] is m.IMPLEMENTATIONS[n] for n in names), names; print(names)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "alltoall_ops_symm_mem" in out.stdout


def test_the_training_example_matches_one_rank():
    """``python -m examples.train_hf_moe`` (2 spawned ranks, a few steps): every step's loss equals
    the whole model's on one rank, so it exits 0."""
    from examples import train_hf_moe

    assert train_hf_moe.main(["--steps", "3", "--batch", "2", "--seq", "16"]) == 0


def test_the_training_example_runs_one_rank_in_this_process(monkeypatch):
    """``--world-size 1``: one rank in this process, in a process group of one (NCCL with ``--device
    cuda``: before, it refused to run without torchrun), no rank spawned."""
    from examples import train_hf_moe

    backends, init = [], torch.distributed.init_process_group
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, **kwargs: (backends.append(backend), init(backend, **kwargs))[1])
    assert train_hf_moe.main(["--world-size", "1", "--steps", "2", "--batch", "2", "--seq", "16"]) == 0
    assert backends == ["gloo"] and not torch.distributed.is_initialized()
