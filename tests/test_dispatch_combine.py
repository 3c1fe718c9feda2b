"""dispatch / combine / exchange_counts on W = 1, 2, 4 real gloo ranks against the plain-PyTorch
references of ``alltoall_ops.reference``: exact layouts, fp64 values and gradients, bf16 error
bounds, distributed properties, determinism, and the local backend without a process group.

Functions run on ranks are module-level (they travel to the pool's processes by reference). Each
rank rebuilds every rank's inputs from the test's seed (one generator per rank), so it holds the
global view the references need."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import alltoall_ops
from alltoall_ops import layout
from alltoall_ops.reference import reference_combine, reference_dispatch

FP64_TOL = dict(rtol=1e-12, atol=1e-12)  # only summation order may differ from the reference


def seed_for(name: str) -> int:
    """A test-level seed: fixed per test, different across tests."""
    return zlib.crc32(name.encode())


@dataclasses.dataclass(frozen=True)
class Case:
    """One routing scenario. ``tokens[s]``: T of rank s; ``allowed``: the global experts topk_idx
    may name (None: all); ``drop``: probability of a -1 slot."""

    tokens: tuple[int, ...]
    e: int = 2
    H: int = 5
    K: int = 2
    alignment: int = 1
    drop: float = 0.2
    weights: bool = True
    allowed: Optional[tuple[int, ...]] = None

    @property
    def world_size(self) -> int:
        return len(self.tokens)

    @property
    def num_experts(self) -> int:
        return self.e * self.world_size


def make_inputs(case: Case, seed: int, dtype=torch.float64):
    """Every rank's (x (T_s, H), topk_idx (T_s, K), topk_weights (T_s, K), grad_y (T_s, H))."""
    xs, idxs, ws, gys = [], [], [], []
    allowed = torch.tensor(case.allowed if case.allowed is not None else range(case.num_experts))
    for s, T in enumerate(case.tokens):
        g = torch.Generator().manual_seed(seed * 1009 + s)
        xs.append(torch.randn(T, case.H, generator=g, dtype=torch.float64).to(dtype))
        if len(allowed):
            idx = allowed[torch.randint(len(allowed), (T, case.K), generator=g)]
        else:
            idx = torch.full((T, case.K), -1)
        drop = torch.rand(T, case.K, generator=g) < case.drop
        idxs.append(torch.where(drop, -1, idx))
        ws.append(torch.rand(T, case.K, generator=g, dtype=torch.float64).to(dtype))
        gys.append(torch.randn(T, case.H, generator=g, dtype=torch.float64).to(dtype))
    return xs, idxs, ws, gys


def run_experts(routed: torch.Tensor, tokens_per_expert: torch.Tensor, rank: int, e: int):
    """Expert g maps a row to ``row * (1 + g / 4) + (g + 1) / 8``; rows past the last group (the
    local backend's static tail) to ``row * 3 + 1``. The biases make padding and tail rows of the
    output non-zero, so rows that leaked into ``combine`` would show."""
    sizes = tokens_per_expert.tolist()
    *groups, tail = routed.split(sizes + [routed.shape[0] - sum(sizes)])
    out = [rows * (1 + (rank * e + j) / 4) + (rank * e + j + 1) / 8 for j, rows in enumerate(groups)]
    return torch.cat(out + [tail * 3 + 1])


def reference_forward_backward(case: Case, xs, idxs, ws, gys):
    """The global reference: per rank (routed, tokens_per_expert, expert_out, y) and the
    gradients of sum_s <y_s, grad_y_s> w.r.t. every x_s, w_s and expert_out_d."""
    xs = [x.clone().requires_grad_() for x in xs]
    ws = [w.clone().requires_grad_() for w in ws]
    dispatched = reference_dispatch(xs, idxs, case.num_experts, case.alignment)
    expert_outs = [run_experts(r, tpe, d, case.e) for d, (r, tpe) in enumerate(dispatched)]
    for eo in expert_outs:
        if eo.requires_grad:  # not when no rank sends a single row
            eo.retain_grad()
    ys = reference_combine(
        expert_outs, idxs, case.num_experts, ws if case.weights else None, case.alignment,
        acc_dtype=torch.float64,
    )
    loss = sum((y * gy).sum() for y, gy in zip(ys, gys))
    if loss.requires_grad:  # not when every slot is dropped: then every gradient is zero
        loss.backward()
    grads = lambda ts: [torch.zeros_like(t) if t.grad is None else t.grad for t in ts]  # noqa: E731
    return dispatched, expert_outs, ys, grads(xs), grads(ws), grads(expert_outs)


def check_case(rank: int, world_size: int, case: Case, seed: int) -> dict:
    """dispatch -> experts -> combine -> backward on this rank, compared with the reference."""
    assert world_size == case.world_size
    xs, idxs, ws, gys = make_inputs(case, seed)
    ref_dispatched, _, ref_ys, ref_gx, ref_gw, ref_geo = reference_forward_backward(
        case, xs, idxs, ws, gys
    )
    x = xs[rank].clone().requires_grad_()
    w = ws[rank].clone().requires_grad_()
    routed, tokens_per_expert, handle = alltoall_ops.dispatch(
        x, idxs[rank], num_experts=case.num_experts, expert_alignment=case.alignment
    )
    ref_routed, ref_tpe = ref_dispatched[rank]
    # Layout and values of dispatch: bitwise. One rank (local backend): C static rows, the ones
    # past R zero; on a group R rows.
    R = ref_routed.shape[0]
    C = layout.local_capacity(idxs[rank].numel(), case.num_experts, case.alignment) if world_size == 1 else R
    assert tokens_per_expert.dtype == torch.int64
    assert torch.equal(tokens_per_expert, ref_tpe), (tokens_per_expert, ref_tpe)
    assert routed.dtype == x.dtype and routed.shape == (C, case.H), (routed.shape, ref_routed.shape, C)
    assert torch.equal(routed[:R], ref_routed) and not routed[R:].any()
    assert handle.num_rows == routed.shape[0] and int(tokens_per_expert.sum()) == R

    expert_out = run_experts(routed, tokens_per_expert, rank, case.e)
    expert_out.retain_grad()
    y = alltoall_ops.combine(expert_out, handle, w if case.weights else None)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y, ref_ys[rank], **FP64_TOL)

    (y * gys[rank]).sum().backward()  # every rank takes part, even one with no tokens
    assert x.grad is not None and x.grad.shape == x.shape
    torch.testing.assert_close(x.grad, ref_gx[rank], **FP64_TOL)
    torch.testing.assert_close(expert_out.grad[:R], ref_geo[rank], **FP64_TOL)
    assert not expert_out.grad[R:].any()  # no gradient into the tail
    if case.weights:
        torch.testing.assert_close(w.grad, ref_gw[rank], **FP64_TOL)
    # Padding rows: zero in routed, no gradient into them.
    real = torch.zeros(routed.shape[0], dtype=torch.bool)
    start = 0
    for j in range(case.e):
        n = sum(int((idx == rank * case.e + j).sum()) for idx in idxs)
        real[start : start + n] = True
        start += int(tokens_per_expert[j])
    assert (routed[~real] == 0).all() and (expert_out.grad[~real] == 0).all()
    return dict(rows=R, padding=int((~real).sum()), tokens_per_expert=tokens_per_expert.tolist())


def _cases(W: int) -> dict[str, Case]:
    uneven = tuple(3 + 4 * s for s in range(W))  # 3, 7, 11, 15 tokens
    cases = {
        "uneven": Case(uneven),
        "top1_no_weights": Case(uneven, K=1, weights=False),
        "top3_wide": Case(uneven, K=3, H=9, e=1),
        "zero_token_rank": Case((0,) + uneven[1:] if W > 1 else (0,)),
        "zero_token_expert": Case(uneven, allowed=tuple(g for g in range(2 * W) if g != 1)),
        "all_slots_dropped": Case(uneven, drop=1.0),
        "alignment": Case(uneven, K=3, alignment=4, drop=0.3),
        "alignment_no_drop": Case(uneven, e=3, alignment=3, drop=0.0),
    }
    if W > 1:
        cases["rank_receives_nothing"] = Case(uneven, allowed=tuple(range(2 * (W - 1))))
    return cases


CASES = [(W, name, case) for W in (1, 2, 4) for name, case in _cases(W).items()]


@pytest.mark.parametrize(
    "pool, name, case", CASES, ids=[f"W{W}-{name}" for W, name, _ in CASES], indirect=["pool"]
)
def test_dispatch_combine_fp64_matches_reference(pool, name, case):
    results = pool.run(check_case, case, seed_for(f"fp64-{name}-{case.world_size}"))
    e = case.e
    # The scenario really happened.
    if name == "zero_token_rank":
        assert case.tokens[0] == 0
    if name == "zero_token_expert":
        assert results[1 // e]["tokens_per_expert"][1 % e] == 0
    if name == "all_slots_dropped":
        assert all(r["rows"] == 0 for r in results)
    if name == "rank_receives_nothing":
        assert results[-1]["rows"] == 0 and all(r["rows"] > 0 for r in results[:-1])
    if name.startswith("alignment"):
        assert all(all(n % case.alignment == 0 for n in r["tokens_per_expert"]) for r in results)
        assert sum(r["padding"] for r in results) > 0
    if name != "all_slots_dropped" and sum(case.tokens) > 0:
        assert sum(r["rows"] for r in results) > 0


# --------------------------------------------------------------------------------------------
# bf16


def _check_bf16_close(op: torch.Tensor, ref64: torch.Tensor, plain: torch.Tensor, what: str) -> None:
    """``op`` accumulates in fp32 and rounds once to bf16, so each element is within half a bf16
    ulp (<= 2**-8 relative) of the fp64 reference, up to fp32 summation noise; and its worst
    error is at most twice that of plain bf16 arithmetic (``plain``)."""
    assert op.dtype == torch.bfloat16, what
    err = (op.double() - ref64).abs()
    bound = 2.0**-8 * ref64.abs() + 1e-5
    assert (err <= bound).all(), f"{what}: error {float((err - bound).max())} above the rounding bound"
    if err.numel():
        plain_err = (plain.double() - ref64).abs().max()
        assert err.max() <= 2 * plain_err, f"{what}: error {float(err.max())} vs plain bf16 {float(plain_err)}"


def check_bf16(rank: int, world_size: int, case: Case, seed: int) -> dict:
    xs64, idxs, ws64, gys64 = make_inputs(case, seed)
    bf = torch.bfloat16
    xs, ws, gys = [[t.to(bf) for t in ts] for ts in (xs64, ws64, gys64)]
    E, a = case.num_experts, case.alignment
    x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    routed, tpe, handle = alltoall_ops.dispatch(x, idxs[rank], num_experts=E, expert_alignment=a)
    ref_routed, ref_tpe = reference_dispatch(xs, idxs, E, a)[rank]
    R, C = ref_routed.shape[0], routed.shape[0]  # C > R: the local backend's zero tail
    assert torch.equal(tpe, ref_tpe) and torch.equal(routed[:R], ref_routed)  # moving data is exact
    assert not routed[R:].any()

    # Expert outputs and routed-row gradients: fresh bf16 values of every rank's routed size;
    # on this rank C rows (fresh values in the tail too, which must not leak anywhere).
    sizes = [int(t.sum()) for _, t in reference_dispatch(xs, idxs, E, a)]
    g = torch.Generator().manual_seed(seed + 7)
    eos = [torch.randn(R, case.H, generator=g).to(bf) for R in sizes]
    g_routeds = [torch.randn(R, case.H, generator=g).to(bf) for R in sizes]
    tail_eo, tail_g = (torch.randn(C - R, case.H, generator=g).to(bf) for _ in range(2))
    expert_out = torch.cat([eos[rank], tail_eo]).requires_grad_()
    y = alltoall_ops.combine(expert_out, handle, w)
    ((y * gys[rank]).sum() + (routed * torch.cat([g_routeds[rank], tail_g])).sum()).backward()
    assert not expert_out.grad[R:].any()

    def reference(dtype, acc_dtype):
        leaves = [[t.detach().to(dtype).clone().requires_grad_() for t in ts] for ts in (xs, ws, eos)]
        rxs, rws, reos = leaves
        rrouted = [r for r, _ in reference_dispatch(rxs, idxs, E, a)]
        rys = reference_combine(reos, idxs, E, rws, a, acc_dtype=acc_dtype)
        loss = sum((ry * gy.to(dtype)).sum() for ry, gy in zip(rys, gys))
        loss = loss + sum((rr * gr.to(dtype)).sum() for rr, gr in zip(rrouted, g_routeds))
        loss.backward()
        return rys[rank].detach(), rxs[rank].grad, rws[rank].grad, reos[rank].grad

    exact = reference(torch.float64, torch.float64)
    plain = reference(bf, bf)  # every product and sum rounded to bf16
    for name, got, ref64, pl in zip(("y", "grad x", "grad w", "grad expert_out"),
                                    (y, x.grad, w.grad, expert_out.grad[:R]), exact, plain):
        _check_bf16_close(got, ref64, pl, name)
    return float((y.double() - exact[0]).abs().max()) if y.numel() else 0.0


@pytest.mark.parametrize("pool", [1, 2, 4], indirect=True)
def test_bf16_within_rounding_of_fp64_reference(pool):
    W = pool.world_size
    case = Case(tuple(6 + 5 * s for s in range(W)), H=16, K=3, alignment=2, drop=0.1)
    errors = pool.run(check_bf16, case, seed_for(f"bf16-{W}"))
    assert max(errors) > 0  # bf16 really rounded: the check above was not vacuous


# --------------------------------------------------------------------------------------------
# Distributed properties (hypothesis)

DIST = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


def exchange_counts_on_rank(rank: int, world_size: int, counts: list[list[int]], dtype: torch.dtype):
    out = alltoall_ops.exchange_counts(torch.tensor(counts[rank], dtype=dtype))
    assert out.dtype == torch.int64
    return out


@DIST
@pytest.mark.parametrize("pool", [1, 2, 4], indirect=True)
@given(data=st.data())
def test_exchange_counts_is_transpose(pool, data):
    W = pool.world_size
    e = data.draw(st.integers(1, 3), label="e")
    counts = data.draw(
        st.lists(st.lists(st.integers(0, 1000), min_size=W * e, max_size=W * e), min_size=W, max_size=W),
        label="counts",
    )
    dtype = data.draw(st.sampled_from([torch.int64, torch.int32]), label="dtype")
    received = pool.run(exchange_counts_on_rank, counts, dtype)
    # received[r][s, j] == what rank s sends to global expert r * e + j.
    send = torch.tensor(counts).view(W, W, e)  # [s, r, j]
    assert torch.equal(torch.stack(received), send.transpose(0, 1))


def identity_round_trip(rank: int, world_size: int, case: Case, seed: int) -> tuple[int, int]:
    xs, idxs, ws, _ = make_inputs(case, seed)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    routed, tpe, handle = alltoall_ops.dispatch(
        x, idx, num_experts=case.num_experts, expert_alignment=case.alignment
    )
    ref_routed, ref_tpe = reference_dispatch(xs, idxs, case.num_experts, case.alignment)[rank]
    R = ref_routed.shape[0]
    assert torch.equal(tpe, ref_tpe) and torch.equal(routed[:R], ref_routed) and not routed[R:].any()
    y = alltoall_ops.combine(routed, handle, w)
    valid = (idx >= 0).to(w.dtype)
    torch.testing.assert_close(y, x * (w * valid).sum(1, keepdim=True), **FP64_TOL)
    torch.testing.assert_close(alltoall_ops.combine(routed, handle), x * valid.sum(1, keepdim=True), **FP64_TOL)
    mine = range(rank * case.e, (rank + 1) * case.e)
    received = sum(int(torch.isin(i, torch.tensor(mine)).sum()) for i in idxs)  # real (non-padding) rows
    assert received <= R < received + case.e * case.alignment
    return int((idx >= 0).sum()), received


@st.composite
def cases(draw, W: int):
    return Case(
        tokens=tuple(draw(st.lists(st.integers(0, 9), min_size=W, max_size=W))),
        e=draw(st.integers(1, 3)),
        H=draw(st.integers(1, 4)),
        K=draw(st.integers(1, 3)),
        alignment=draw(st.integers(1, 4)),
        drop=draw(st.sampled_from([0.0, 0.3, 1.0])),
    )


@DIST
@pytest.mark.parametrize("pool", [1, 2, 4], indirect=True)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_identity_experts_round_trip(pool, data, seed):
    case = data.draw(cases(pool.world_size), label="case")
    sent, received = zip(*pool.run(identity_round_trip, case, seed))
    assert sum(sent) == sum(received)  # every valid slot arrives exactly once, somewhere


# --------------------------------------------------------------------------------------------
# Determinism


def twice_bitwise(rank: int, world_size: int, case: Case, seed: int) -> None:
    xs, idxs, ws, gys = make_inputs(case, seed, dtype=torch.float32)

    def once():
        x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
        routed, tpe, handle = alltoall_ops.dispatch(
            x, idxs[rank], num_experts=case.num_experts, expert_alignment=case.alignment
        )
        expert_out = run_experts(routed, tpe, rank, case.e)
        y = alltoall_ops.combine(expert_out, handle, w)
        (y * gys[rank]).sum().backward()
        return routed, tpe, y, x.grad, w.grad

    first, second = once(), once()
    for a, b in zip(first, second):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("pool", [1, 2, 4], indirect=True)
def test_deterministic(pool):
    W = pool.world_size
    case = Case(tuple(20 + 3 * s for s in range(W)), H=32, K=4, alignment=2)
    pool.run(twice_bitwise, case, seed_for(f"det-{W}"))


# --------------------------------------------------------------------------------------------
# Local backend, single process, no process group


@pytest.fixture(params=["torch", "kernels"])
def row_path(request, monkeypatch):
    """How dispatch / combine move rows: torch ops (CPU tensors), or this package's Triton
    kernels, which CUDA tensors take, here run on the CPU in Triton's interpreter."""
    if request.param == "kernels":
        from alltoall_ops.kernels import loader

        if not loader.load().interpreting():
            pytest.skip("the kernels run on CPU tensors only in Triton's interpreter")
        monkeypatch.setattr(loader, "use_kernels", lambda t: True)
    return request.param


@pytest.mark.parametrize("backend", ["local", "auto"])
@pytest.mark.parametrize("alignment", [1, 3])
def test_local_backend_without_process_group(backend, alignment, row_path):
    assert not dist.is_initialized()
    case = Case((13,), e=4, K=3, alignment=alignment)
    seed = seed_for(f"local-{backend}-{alignment}")
    xs, idxs, ws, gys = make_inputs(case, seed)
    ref_dispatched, _, ref_ys, ref_gx, ref_gw, ref_geo = reference_forward_backward(
        case, xs, idxs, ws, gys
    )
    x, w = xs[0].clone().requires_grad_(), ws[0].clone().requires_grad_()
    routed, tpe, handle = alltoall_ops.dispatch(
        x, idxs[0], num_experts=case.num_experts, backend=backend, expert_alignment=alignment
    )
    assert handle.group_name == ""
    R = ref_dispatched[0][0].shape[0]
    assert routed.shape[0] == layout.local_capacity(idxs[0].numel(), case.num_experts, alignment)
    assert torch.equal(tpe, ref_dispatched[0][1]) and torch.equal(routed[:R], ref_dispatched[0][0])
    assert not routed[R:].any()
    expert_out = run_experts(routed, tpe, 0, case.e)
    expert_out.retain_grad()
    y = alltoall_ops.combine(expert_out, handle, w)
    torch.testing.assert_close(y, ref_ys[0], **FP64_TOL)
    (y * gys[0]).sum().backward()
    torch.testing.assert_close(x.grad, ref_gx[0], **FP64_TOL)
    torch.testing.assert_close(w.grad, ref_gw[0], **FP64_TOL)
    torch.testing.assert_close(expert_out.grad[:R], ref_geo[0], **FP64_TOL)
    assert not expert_out.grad[R:].any()  # the tail's outputs (non-zero) get no gradient
    counts = torch.tensor([3, 0, 5, 1])
    assert torch.equal(alltoall_ops.exchange_counts(counts, backend=backend), counts.view(1, 4))


def test_second_order_gradients_local(row_path):
    """gradgradcheck through dispatch -> experts -> combine: double backward reaches the weights'
    gradient path (dispatch's scale and combine's returned rows) correctly."""
    E, T, H, K = 4, 5, 3, 2
    gen = torch.Generator().manual_seed(11)
    topk_idx = torch.randint(-1, E, (T, K), generator=gen)

    def layer(x, weights, expert_w):
        routed, tokens_per_expert, handle = alltoall_ops.dispatch(
            x, topk_idx, num_experts=E, expert_alignment=2
        )
        expert_of_row = layout.expert_of_rows(tokens_per_expert, routed.shape[0]).clamp(max=E - 1)  # tail: E - 1
        out = torch.tanh(torch.bmm(routed.unsqueeze(1), expert_w[expert_of_row]).squeeze(1))
        return alltoall_ops.combine(out, handle, weights)

    x = torch.randn(T, H, dtype=torch.float64, generator=gen, requires_grad=True)
    weights = torch.rand(T, K, dtype=torch.float64, generator=gen, requires_grad=True)
    expert_w = torch.randn(E, H, H, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x, weights, expert_w))
    assert torch.autograd.gradgradcheck(layer, (x, weights, expert_w))


def test_local_combine_checks_rows_against_the_handle():
    x = torch.randn(5, 3)
    routed, _, handle = alltoall_ops.dispatch(x, torch.tensor([[0, 1]] * 5), num_experts=2)
    with pytest.raises(ValueError, match="expert_out has 9 rows but its handle's dispatch returned 10"):
        alltoall_ops.combine(routed[:-1], handle)


def test_local_combine_takes_expert_outputs_of_another_dtype():
    """One rank exchanges nothing, so expert_out may differ from x in dtype (on a group it may
    not: every rank's rows must mean the same, see test_reliability)."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(6, 3, generator=g), torch.rand(6, 2, generator=g)
    topk_idx = torch.randint(-1, 4, (6, 2), generator=g)
    routed, _, handle = alltoall_ops.dispatch(x, topk_idx, num_experts=4)
    y = alltoall_ops.combine(routed.double() * 2, handle, w.double())
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, (x.double() * 2) * (w.double() * (topk_idx >= 0)).sum(1, keepdim=True))
