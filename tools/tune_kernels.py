"""Sweep the launch blocks of the row-moving kernels on one GPU and print, per kernel, every
configuration's time against the byte floor (the measured copy bandwidth), best first.

    python tools/tune_kernels.py [--tokens 4096 8192] [--top 6]
    python tools/tune_kernels.py --layout-only --layout-tokens 4096 --layout-sms 8 16 32
    python tools/tune_kernels.py --ulysses [4096 32768] [--worlds 2 4] [--rounds 3]
    python tools/tune_kernels.py --pull [--tokens 4096] [--worlds 2 4] [--pull-sms 16 32]

Kernels (bf16, H = 7168, K = 8, E = 256, fresh random top-k routing):
- ``put_rows`` (dispatch, every backend): x (T, H) -> (T*K, H) rows in send order, each token
  read once; bytes (T + T*K) * H * 2.
- ``topk_reduce``: (T*K, H) rows -> (T, H) weighted top-k sums; same bytes.
- ``pull_rows`` from the senders' tags (its tile: ``GPU_BLOCKS["pull_tokens"]``, tokens a
  program), bf16, W = 2, as ``--pull`` below. (The one-rank pull by a row map, ``"pull_rows"``:
  not swept.)
- ``--pull``: only the dispatch's pull, as the dispatch runs it: rank 0 of W pulls from W
  senders of T tokens each (their own fresh routing; a slot lands here when its expert is one of
  the first E / W), each token with a slot here read once and stored into each of its rows here
  (expert-major), in three payloads: bf16 rows (tile ``pull_tokens``), fp8 wire rows split into
  values and scale bytes (``pull_tokens_fp8``), fp8 wire rows dequantized to bf16
  (``pull_tokens_dequantize``);
  every tile's result checked against torch, each timed from a CUDA graph (at T = 128 an eager
  launch takes longer than the kernel) and run as labelled (not spread); where
  ``pull_rows`` spreads the tile in use at this T (``row_blocks(spread=True)``), that launch is
  timed too; ``--pull-sms``: their budget tiles instead, beside
  a plain gather of the rows here on as many programs (``benchmarks/scatter_kernel.py``).
- ``weight_grad``: reads grad_y (T, H) and (T*K, H) rows; bytes (T + T*K) * H * 2.
- ``quantize`` (fp8): x (T, H) bf16 into the dispatch's wire rows, by tokens a program and warps
  (``kernels/quantize.py``'s ``GPU_BLOCK_R`` / ``GPU_NUM_WARPS``); bytes T * H * 2 read plus the
  (T, H + 4 H / 128) rows written.
- ``plan_slots`` (the layout: routing -> order, positions, counts), checked against its torch
  implementation, timed eagerly and replayed from a CUDA graph (device time), against torch's
  path (a stable sort and some 20 small ops): the one-program plan by warps, the three kernels
  by slots per program and warps (``--layout-tokens``; ``ONE_PROGRAM_SLOTS`` is chosen from it),
  and with ``--layout-sms`` under SM budgets (``BUDGET_BLOCK_S``, ``BUDGET_BLOCK_NUM_WARPS``).
- ``seq_pieces`` (``--ulysses``): the Ulysses exchange's post and gather (``kernels/seq_exchange.py``),
  seq_to_head and head_to_seq of q, k, v (1, S, 32, 128) bf16 on simulated ranks, from CUDA graphs.
Baselines: ``torch.index_select`` of the same rows, and the plain copy behind the floor. The
winners go into ``alltoall_ops/kernels/_config.py:GPU_BLOCKS`` by hand.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Optional
from unittest import mock

import torch

from alltoall_ops import layout, testing
from alltoall_ops.kernels import _config
from alltoall_ops.kernels import routing_plan as routing
from alltoall_ops.kernels import loader
from alltoall_ops.kernels.region import TAG_COLUMNS, Region
from alltoall_ops.kernels.row_put import pull_tile
from alltoall_ops.testing import timer

H, K, E = 7168, 8, 256
DEVICE = torch.device("cuda")


median_us = timer(DEVICE)
PULL_PAYLOADS = ("bf16", "fp8 wire", "fp8 dequantized")
"""The pull's payloads (``--pull``): bf16 rows, fp8 wire rows split into values and scale bytes,
fp8 wire rows dequantized to bf16."""


def _use_blocks(name: str, cfg: tuple) -> None:
    _config.GPU_BLOCKS[name] = cfg


def sweep(name: str, fn, nbytes: int, bandwidth: float, configs, top: int, use=_use_blocks,
          legend: str = "(BLOCK_R, BLOCK_H at 2 bytes, num_warps)", time_us=median_us) -> list[tuple[float, tuple]]:
    """Time ``fn`` (``time_us(fn)``) with each of ``configs`` in use (``use(name, cfg)``; by
    default the kernel's ``_config.GPU_BLOCKS`` entry), print the fastest against the copy floor
    of ``nbytes``, keep the best in use, and return every (us, cfg), fastest first."""
    floor = nbytes / bandwidth * 1e6
    results = []
    for cfg in configs:
        use(name, cfg)
        try:
            results.append((time_us(fn), cfg))
        except Exception as exc:  # noqa: BLE001 - an illegal config (registers, shared memory)
            print(f"  {name} {cfg}: {type(exc).__name__}")
    results.sort()
    best = results[0][1]
    use(name, best)
    print(f"{name}: floor {floor:.1f} us; {legend} best first")
    for us, cfg in results[:top]:
        print(f"  {str(cfg):>18} {us:8.1f} us  x{us / floor:.2f}")
    return results


def graph_us(fn) -> float:
    """Median microseconds of fn() replayed from a CUDA graph: its device time, no launch costs."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_us(graph.replay)


def _routing_case(T: int) -> tuple[torch.Tensor, tuple]:
    """topk_idx (T, K) of fresh random routing on the GPU, every fifth token's first slot dropped
    (-1), and torch's plan of it (order, position, send_meta): what the plan sweeps check against."""
    _, topk_idx = torch.randn(T, E, device=torch.device("cuda")).topk(K, dim=-1)
    topk_idx[::5, 0] = -1
    return topk_idx, layout._plan_routing_torch(topk_idx, E, 1)


def sweep_layout(T: int) -> None:
    """plan_slots at T tokens: the one-program plan (a sort in registers; by warps) and the
    three kernels (by slots per program, warps and buckets a scan program), each checked against
    torch's path."""
    topk_idx, want = _routing_case(T)
    torch_path = lambda: layout._plan_routing_torch(topk_idx, E, 1)  # noqa: E731
    print(f"layout T = {T} (N = {T * K}): torch path eager {median_us(torch_path):.1f} us, "
          f"graph {graph_us(torch_path):.1f} us")
    knobs = ("ONE_PROGRAM_SLOTS", "GPU_NUM_WARPS", "GPU_BLOCK_S", "GPU_BLOCK_S_LARGE", "GPU_BLOCK_NUM_WARPS",
             "SCAN_BUCKETS")
    chosen = {k: getattr(routing, k) for k in knobs}
    block_chosen = chosen["GPU_BLOCK_S"] if T * K < routing.LARGE_PLAN_SLOTS else chosen["GPU_BLOCK_S_LARGE"]
    results = []  # NB: block sizes of 512 and more take minutes of ptxas
    # one program sorts all N slots in registers: past a few thousand, minutes of ptxas for nothing
    sort_fits = T * K <= 4 * routing.ONE_PROGRAM_SLOTS
    configs = [(1 << 30, 0, w, chosen["SCAN_BUCKETS"]) for w in (4, 8)] if sort_fits else []
    configs += [(0, *c) for c in itertools.product([32, 64, 128, 256], [2, 4, 8], [chosen["SCAN_BUCKETS"]])]
    configs += [(0, block_chosen, chosen["GPU_BLOCK_NUM_WARPS"], b) for b in (32, 64)]
    for one_program, block_s, warps, buckets in configs:
        block_s = block_s or block_chosen  # one program: the blocks unused, left as chosen
        name = (f"one program, {warps:2} warps" if one_program
                else f"three kernels, {block_s:3} slots, {warps} warps, {buckets:2} buckets a scan program")
        with mock.patch.multiple(routing, **dict(zip(knobs, (one_program, warps, block_s, block_s, warps, buckets)))):
            fn = lambda: routing.plan_slots(topk_idx, E, 1)  # noqa: E731
            assert all(torch.equal(g, w) for g, w in zip(fn(), want)), f"plan_slots != torch: {name}"
            results.append((graph_us(fn), median_us(fn), name))
    for g, eager, name in sorted(results):
        print(f"  plan_slots {name}: graph {g:6.1f} us, eager {eager:6.1f} us")


def sweep_budget_layout(T: int, max_programs: int) -> None:
    """plan_slots at T tokens on at most ``max_programs`` programs a launch: the three kernels'
    ``BUDGET_BLOCK_S`` by ``BUDGET_BLOCK_NUM_WARPS``, each checked against torch's path."""
    if T * K <= routing.ONE_PROGRAM_SLOTS:
        print(f"layout T = {T}: one program plans N = {T * K} slots, whatever the budget")
        return
    topk_idx, want = _routing_case(T)
    chosen = routing.BUDGET_BLOCK_S, routing.BUDGET_BLOCK_NUM_WARPS
    results = []
    for block_s, warps in itertools.product([64, 128, 256], [4, 8, 16]):
        with mock.patch.multiple(routing, BUDGET_BLOCK_S=block_s, BUDGET_BLOCK_NUM_WARPS=warps):
            fn = lambda: routing.plan_slots(topk_idx, E, 1, max_programs)  # noqa: E731
            assert all(torch.equal(g, w) for g, w in zip(fn(), want)), f"plan_slots != torch: {block_s}, {warps}"
            results.append((graph_us(fn), block_s, warps))
    print(f"layout T = {T} (N = {T * K}) on {max_programs} programs, {chosen} in use; best first:")
    for us, block_s, warps in sorted(results):
        print(f"  plan_slots three kernels, {block_s:3} slots, {warps:2} warps: graph {us:6.1f} us")


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes per second of a 1 GiB device copy (read + write)."""
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    return 2 * big.numel() / (median_us(lambda: big.clone()) * 1e-6)


def sweep_rows(T: int, bandwidth: float, top: int) -> None:
    """Sweep the row kernels' launch blocks at T tokens (H, K, E of this module)."""
    dev, k = DEVICE, loader.load()
    rows, widths, warps = [1, 2, 4, 8], [1024, 2048, 4096], [4, 8]
    N = T * K
    print(f"\n===== T = {T}, H = {H}, K = {K}, E = {E}")
    x = torch.randn(T, H, device=dev).bfloat16()
    weights, topk_idx = torch.randn(T, E, device=dev).softmax(-1).topk(K, dim=-1)
    plan = layout.plan_routing(topk_idx, E, 1)
    position = plan.position.reshape(-1)
    send = x.new_empty(N, H)
    nbytes = (T + N) * H * 2
    ref = x.index_select(0, plan.order // K)
    floor = nbytes / bandwidth * 1e6
    us = median_us(lambda: x.index_select(0, plan.order // K))
    print(f"torch index_select (send order): {us:.1f} us  x{us / floor:.2f}")

    def put_rows():
        k.put_rows(x, position, N, out=send, top_k=K)

    put_rows()
    assert torch.equal(send, ref), "put_rows != index_select"
    sweep("put_rows", put_rows, nbytes, bandwidth, itertools.product(rows, widths, warps), top)

    y = x.new_empty(T, H)
    ret = torch.randn(N, H, device=dev).bfloat16()
    sweep("topk_reduce", lambda: k.topk_reduce(ret, plan.position, None, weights, y, None, torch.float32),
          nbytes, bandwidth, itertools.product([1, 2, 4], widths, warps), top)

    sweep_pull(T, 2, bandwidth, top, payloads=["bf16"])  # pull_tokens: the dispatch's pull, as --pull (bf16)
    sweep_quantize(x, bandwidth, top)
    grad_w = torch.empty(T, K, device=dev)
    sweep("weight_grad", lambda: k.weight_grad(x, ret, plan.position, grad_w, torch.float32),
          nbytes, bandwidth, itertools.product([1, 2, 4], [2048, 4096], warps), top)


def _pull_case(T: int, W: int) -> tuple[torch.Tensor, int]:
    """Destination codes (W, T * K) of W senders' slots as rank 0 of W receives them: each sender
    its own fresh routing (E experts, K a token); a slot whose expert is one of the first E / W
    lands here, in expert-major order (senders, then slots, within an expert), its code its row in
    [0, C); every other slot's code is C (another rank's row). Returns (codes, C)."""
    experts = torch.stack([testing.routing(T, K, E, seed=s, device=DEVICE)[0].reshape(-1) for s in range(W)])
    here = experts < E // W
    C = int(here.sum())
    order = torch.sort(torch.where(here, experts, E).reshape(-1), stable=True).indices[:C]  # row d <- slot order[d]
    codes = torch.full((W * T * K,), C, dtype=torch.int64, device=DEVICE)
    codes[order] = torch.arange(C, device=DEVICE)
    return codes.view(W, T * K), C


def sweep_pull(T: int, W: int, bandwidth: float, top: int, budget: Optional[int] = None,
               payloads: Optional[list[str]] = None) -> None:
    """The dispatch's pull into rank 0 of W from W senders of T tokens (:func:`_pull_case`), in
    each of its payloads (:data:`PULL_PAYLOADS`, or those in ``payloads``), on its tile
    (``row_put.pull_tile``'s), or with ``budget`` on at most that
    many programs and its budget tile; each result checked against torch, the tile in use restored
    after each sweep. Bytes: every sender's token with a slot here read once, every row here
    written once."""
    from alltoall_ops import fp8
    from tools.sm_budget_diag import senders_tags

    k, N, P = loader.load(), T * K, fp8.packed_width(H)
    codes, C = _pull_case(T, W)
    tags, table = senders_tags(codes, K)  # the tags: alive while the table is used
    region = Region(table, 0, (1 + N, TAG_COLUMNS), torch.int64)
    order = torch.argsort(codes.reshape(-1))[:C]  # row d <- slot order[d] of sender order // N
    stage_row = order // N * T + order % N // K  # row d's row of the W stages (W * T rows)
    tokens_read = int((codes < C).view(W, T, K).any(-1).sum())
    num_routed = torch.full((1,), C, dtype=torch.int64, device=DEVICE)  # not read with tags
    row_src = torch.empty(C, dtype=torch.int64, device=DEVICE)
    x = torch.randn(W * T, H, device=DEVICE).bfloat16()
    values, scales = fp8.quantize(x)
    wire = torch.cat([values.view(torch.uint8), scales.view(torch.uint8)], 1)  # (W * T, P)
    cases = {  # payload: (stages, out, tail, want: the rows here, the tail's, bytes of a row in and out)
        "bf16": (x, x.new_empty(C, H), None, (x[stage_row],), H * 2, H * 2),
        "fp8 wire": (wire, wire.new_empty(C, H), wire.new_empty(C, P - H), (wire[stage_row, :H], wire[stage_row, H:]),
                     P, P),
        "fp8 dequantized": (wire, x.new_empty(C, H), wire.new_empty(C, P - H),
                            (fp8.dequantize(values, scales)[stage_row], wire[stage_row, H:]), P, H * 2 + P - H),
    }
    table_of_tiles = _config.GPU_BLOCKS if budget is None else _config.BUDGET_BLOCKS
    configs = list(itertools.product([1, 2, 4], [2048, 4096, 8192], [4, 8, 16]) if budget is None else
                   itertools.product([8, 16, 32], [2048, 4096], [16, 32]))
    print(f"\n===== pull into rank 0 of W = {W}{'' if budget is None else f' on {budget} programs'}: T = {T} a "
          f"sender, C = {C} rows here, {tokens_read} tokens read")
    for name in payloads or PULL_PAYLOADS:
        stages, out, tail, want, row_in, row_out = cases[name]
        stage_table = torch.tensor([stages[s * T].data_ptr() for s in range(W)], device=DEVICE)
        dequantize = name == "fp8 dequantized"
        key = pull_tile(name != "bf16", dequantize)
        chosen = table_of_tiles[key]
        tiles = configs + [chosen] * (chosen not in configs)  # the tile in use, always among them

        def pull(out=out, tail=tail, stage_table=stage_table, dequantize=dequantize):
            k.pull_rows(region, num_routed, out, row_src, stage_table=stage_table, dst_stride=C, top_k=K, tokens=T,
                        tail=tail, dequantize=dequantize, max_programs=budget)

        def use(_name: str, cfg: tuple, key=key) -> None:
            table_of_tiles[key] = cfg

        # NB: the sweep's tiles run as labelled (no spread); the tile in use is then timed as launched
        with mock.patch.dict(table_of_tiles), mock.patch.object(_config, "SPREAD_PROGRAMS", 0):
            for cfg in tiles:
                use(key, cfg)
                out.zero_()
                pull()
                got = (out,) if tail is None else (out, tail)
                assert all(torch.equal(g, w) for g, w in zip(got, want)), f"pull_rows {name} != torch at {cfg}"
            nbytes = tokens_read * row_in + C * row_out
            ranked = sweep(key, pull, nbytes, bandwidth, tiles, top, use, time_us=graph_us,
                           legend=f"{name}: (tokens a program, BLOCK_H at 2 bytes, num_warps)")
        print(f"  best {nbytes / ranked[0][0] / 1e3:.0f} GB/s; in use {chosen}: "
              + ", ".join(f"{us:.1f} us, {nbytes / us / 1e3:.0f} GB/s" for us, cfg in ranked if cfg == chosen))
        spread_r = _config.row_blocks(key, W * T, H, max_programs=budget, spread=True).BLOCK_R
        if spread_r != chosen[0]:  # pull_rows spreads a small pull over more programs
            us = graph_us(pull)
            print(f"  in use as launched at T = {T} (spread to {spread_r} tokens a program): {us:.1f} us, "
                  f"{nbytes / us / 1e3:.0f} GB/s")
    if budget is not None:  # the reference of bandwidth per SM: a plain gather of the rows here, bf16
        from benchmarks.scatter_kernel import gather_rows

        gathered = x.new_empty(C, H)
        us = graph_us(lambda: gather_rows(x, stage_row, gathered, budget))  # timed as the pull
        assert torch.equal(gathered, x[stage_row])
        print(f"  plain gather of the C rows (bf16) on {budget} programs: {us:.1f} us, "
              f"{2 * C * H * 2 / us / 1e3:.0f} GB/s")
    del tags


def sweep_quantize(x: torch.Tensor, bandwidth: float, top: int) -> None:
    """The fp8 quantize (``kernels/quantize.py``) of x (T, H) into wire rows, as the dispatch
    runs it, by tokens a program and warps (its ``GPU_BLOCK_R``, ``GPU_NUM_WARPS``), each result
    checked bit for bit against ``fp8.quantize``; bytes: x read, the wire rows written."""
    from alltoall_ops import fp8
    from alltoall_ops.kernels import quantize

    T, H = x.shape
    values, scales = fp8.quantize(x)
    wire = torch.empty(T, fp8.packed_width(H), dtype=torch.uint8, device=x.device)

    def use(_name: str, cfg: tuple) -> None:
        quantize.GPU_BLOCK_R, quantize.GPU_NUM_WARPS = cfg

    chosen = quantize.GPU_BLOCK_R, quantize.GPU_NUM_WARPS
    configs = list(itertools.product([1, 2, 4, 8, 16, 32], [1, 2, 4, 8]))
    for cfg in configs:
        use("quantize", cfg)
        got_values, got_scales = quantize.quantize_rows(x, out_TP=wire)
        assert torch.equal(got_values, values.view(torch.uint8)) and torch.equal(got_scales, scales), cfg
    use("quantize", chosen)
    sweep("quantize", lambda: quantize.quantize_rows(x, out_TP=wire), x.numel() * 2 + wire.numel(), bandwidth,
          configs, top, use, "(tokens a program, num_warps)")
    print(f"  in use: {chosen}")


def _seq_pieces_steps(S: int, W: int, configs: list) -> dict:
    """Row -> step: the copy of q, k, v's bytes, and seq_to_head / head_to_seq of q, k, v
    (1, S, 32, 128) bf16 over W simulated ranks at each ``seq_pieces`` tile, captured in a CUDA
    graph (a tile is fixed at capture) and checked against the shards."""
    import alltoall_ops as a2a
    from alltoall_ops.backends.symm_mem import run_simulated
    from alltoall_ops.ulysses import symm_head_to_seq_op, symm_seq_to_head_op
    from benchmarks.bench import Captured

    dev, (B, H, D) = torch.device("cuda"), (1, 32, 128)
    qkv = [torch.randn(B, S, H, D, device=dev).bfloat16() for _ in range(3)]
    flat = torch.cat([t.flatten() for t in qkv])
    copy = torch.empty_like(flat)
    bufs = a2a.UlyssesBuffers.simulated(W, a2a.UlyssesBuffers.bytes_for([(B, S // W, H, D)] * 3, torch.bfloat16, W),
                                        device=dev)
    seqs = [[t.narrow(1, r * S // W, S // W).contiguous() for t in qkv] for r in range(W)]
    heads = [[t.narrow(2, r * H // W, H // W).contiguous() for t in qkv] for r in range(W)]
    exchanges = (("seq_to_head", lambda r, b: symm_seq_to_head_op(seqs[r], b, 1, 2, [], False), heads),
                 ("head_to_seq", lambda r, b: symm_head_to_seq_op(heads[r], b, 1, 2, [H] * 3, [], False), seqs))
    steps = {"copy": lambda: copy.copy_(flat)}
    for cfg, (name, fn, want) in itertools.product(configs, exchanges):
        with mock.patch.dict(_config.GPU_BLOCKS, seq_pieces=cfg):  # NB: the graph keeps the kernels it captured
            graph = Captured(lambda stream, f=fn: run_simulated(f, bufs, stream=stream), True, relaxed=True)
            got = graph.run()
        assert all(torch.equal(g, w) for r in range(W) for g, w in zip(got[r], want[r])), (name, W, cfg)
        steps[f"{name} {cfg}"] = graph.replay
    return steps


def sweep_seq_pieces(seq_lens: list[int], worlds: list[int], rounds: int, top: int) -> None:
    """The Ulysses exchange's tiles (``seq_pieces``: its post and gather): every tile's
    seq_to_head and head_to_seq (:func:`_seq_pieces_steps`) in interleaved rounds, medians over
    the copy's."""
    import statistics

    from benchmarks.ulysses import timed_rounds

    chosen = _config.GPU_BLOCKS["seq_pieces"]
    configs = list(itertools.product([1, 2, 4], [1024, 2048, 4096], [4, 8]))
    for S, W in itertools.product(seq_lens, worlds):
        steps = _seq_pieces_steps(S, W, configs)
        samples = timed_rounds(steps, rounds, median_us, f"S = {S}, W = {W} ")
        floor = statistics.median(samples.pop("copy"))
        print(f"\n===== Ulysses (1, {S}, 32, 128), W = {W}: the copy of the bytes {floor:.1f} us; "
              f"(BLOCK_R, BLOCK_Q at 2 bytes, num_warps) best first, / the copy; {chosen} in use")
        for name in ("seq_to_head", "head_to_seq"):
            ranked = sorted((statistics.median(v), row[len(name) + 1:]) for row, v in samples.items()
                            if row.startswith(name))
            used = statistics.median(samples[f"{name} {chosen}"])
            print(f"  {name}: " + ", ".join(f"{cfg} x{us / floor:.3f}" for us, cfg in ranked[:top])
                  + f"; {chosen} x{used / floor:.3f}")
        del steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--layout-tokens", type=int, nargs="+", default=[32, 128, 256, 512, 8192])
    parser.add_argument("--layout-only", action="store_true", help="only the plan_slots sweep")
    parser.add_argument("--layout-sms", type=int, nargs="+", default=[], metavar="P",
                        help="also sweep the plan's budget blocks on P programs (an SM budget)")
    parser.add_argument("--ulysses", type=int, nargs="*", default=None, metavar="S",
                        help="only the Ulysses exchange's tiles, at these sequence lengths (default 4096 32768)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="simulated ranks (--ulysses, --pull)")
    parser.add_argument("--pull", action="store_true",
                        help="only the dispatch's pull (pull_tokens, pull_tokens_dequantize), at --tokens")
    parser.add_argument("--pull-sms", type=int, nargs="+", default=[], metavar="P",
                        help="instead, sweep the pull's budget tiles on P programs (an SM budget; --pull)")
    parser.add_argument("--pull-payloads", nargs="+", default=None, choices=PULL_PAYLOADS,
                        help="only these payloads (--pull; default all)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (--ulysses)")
    args = parser.parse_args()
    if args.ulysses is not None:
        sweep_seq_pieces(args.ulysses or [4096, 32768], args.worlds, args.rounds, args.top)
        return
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write)")
    if args.pull:
        for T, W, budget in itertools.product(args.tokens, args.worlds, args.pull_sms or [None]):
            sweep_pull(T, W, bandwidth, args.top, budget, args.pull_payloads)
        return
    for T in args.layout_tokens:
        sweep_layout(T)
        for max_programs in args.layout_sms:
            sweep_budget_layout(T, max_programs)
    if args.layout_only:
        return
    for T in args.tokens:
        sweep_rows(T, bandwidth, args.top)
    print("\nbest:", {n: _config.GPU_BLOCKS[n] for n in _config.GPU_BLOCKS})


if __name__ == "__main__":
    main()
