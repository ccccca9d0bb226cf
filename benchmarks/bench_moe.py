"""Mixture of experts: update time and per-rank actor memory at EP=2 vs EP=1, and the MoE weight-sync export.

Run with two processes; every layout lives in the same launch:

    torchrun --nproc_per_node 2 benchmarks/bench_moe.py [--hidden 256 --layers 4 --experts 8 --topk 2
        --moe-ffn 256 --batch 8 --seq 256 --rounds 7 --sync-rounds 15]

A Qwen3-MoE float32 model (`--hidden`, `--layers`, `--experts` routed `--topk` per token, expert FFN
`--moe-ffn`, 4 heads / 2 KV heads, untied vocabulary `--vocab`, every layer sparse) is saved as an HF
checkpoint (transformers' `Qwen3MoeConfig`) and loaded by both layouts, both data-parallel over the
two ranks (DP=2):

* EP=1: every rank holds all experts; the expert gradients are reduced over the two replicas;
* EP=2: each rank holds `experts / 2` of them; tokens travel to their experts' rank and back through
  the token dispatcher (`--dispatcher`, all-to-all by default) in every MoE layer, forward and backward.

Both actors (and their process groups) are built once and kept; Megatron's parallel state, a set of
module globals, is switched to the layout about to run (`ParallelStates`), so the two sides alternate
within one launch.

Measured:

(a) the wall time of one actor update (`MegatronActor.update`: forward, backward, gradient reduction,
    distributed optimizer step) on the global batch of `--batch` sequences of `--seq` tokens (`--prompt`
    of them prompt), half of it on each rank, one micro-batch per rank: one warm-up each, then
    `--rounds` rounds EP1, EP2, EP1, EP2, ... (the slower rank's time of each run); median, min-max;
(b) the bytes each rank holds for the actor's state after an update, exact: parameters (tensor
    nbytes), the DDP gradient buffers (`grad_data`, padding included) and the optimizer's own tensors
    (Adam's moments, main parameters that are not views of the model's), each split into dense and
    routed-expert parameters (by parameter name; a gradient or optimizer tensor by the parameter it
    belongs to; the router is dense), with the distributed optimizer (the config's default; it shards the
    dense state over DP and the expert state over the expert-data-parallel group) and without it;
(c) the weight-sync export that feeds the rollout engine (`rollout.sync.gather.iter_weight_buckets`
    with its default bucket, consumed to the end on both ranks; at EP=2 each rank's experts of a layer
    are packed into one buffer and broadcast to the other rank, `model.expert_groups`) of the MoE
    model at EP=1 and at EP=2, and of a dense Qwen3 model whose FFN (`experts x moe-ffn`) gives about
    the same bytes, alternating, median of `--sync-rounds` with min-max, bytes of full HF tensors per
    second; and, as a control (the floor of the EP=2 exchange), the bytes the EP=2 export broadcasts
    (the experts) moved as one broadcast per EP rank, with no export work around them.

The EP2/EP1 update ratio is given of the medians and, per round, of the adjacent runs (the machine's
load changes less between two neighbouring runs than over the whole benchmark).
"""

from __future__ import annotations

import argparse
import bisect
import os
import platform
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_actor import make_batch  # noqa: E402

from megatron_dapo.config import Config  # noqa: E402
from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown  # noqa: E402

KINDS = ("params", "grads", "optimizer")


def save_models(root: Path, args) -> tuple[Path, Path]:
    """The MoE checkpoint and a dense Qwen3 one of about the same bytes (FFN width = experts x expert FFN)."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    common = dict(hidden_size=args.hidden, num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
                  num_hidden_layers=args.layers, vocab_size=args.vocab, max_position_embeddings=max(2 * args.seq, 512),
                  rope_theta=1000000.0, tie_word_embeddings=False)  # fmt: skip
    moe = Qwen3MoeConfig(**common, num_experts=args.experts, num_experts_per_tok=args.topk, moe_intermediate_size=args.moe_ffn,
                         intermediate_size=args.experts * args.moe_ffn, decoder_sparse_step=1, norm_topk_prob=True)  # fmt: skip
    moe.architectures = ["Qwen3MoeForCausalLM"]
    dense = Qwen3Config(**common, intermediate_size=args.experts * args.moe_ffn)
    dense.architectures = ["Qwen3ForCausalLM"]
    paths = root / "moe", root / "dense"
    for cfg, path in zip((moe, dense), paths):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return paths


class ParallelStates:
    """Megatron's parallel state (module globals of `parallel_state`) per layout, switched by name.

    `initialize_model_parallel` refuses to run twice and `destroy_model_parallel` forgets the groups;
    the groups themselves stay alive as long as something refers to them. So each layout is set up
    from the pristine globals and its globals are kept; `activate` puts a layout's back.
    """

    def __init__(self) -> None:
        from megatron.core import parallel_state

        self.module = parallel_state
        self.names = [k for k, v in vars(parallel_state).items() if k.startswith("_") and not k.startswith("__")
                      and not callable(v) and not isinstance(v, types.ModuleType)]  # fmt: skip
        self.pristine = self._snapshot()
        self.saved: dict[str, dict] = {}

    def _snapshot(self) -> dict:
        return {name: getattr(self.module, name) for name in self.names}

    def _restore(self, values: dict) -> None:
        for name, value in values.items():
            setattr(self.module, name, value)

    def set_up(self, name: str, ep: int):
        """`init_distributed` for DP=2 x EP=`ep` from pristine globals; the layout becomes the active one."""
        self._restore({k: (type(v)() if isinstance(v, (dict, list)) else v) for k, v in self.pristine.items()})
        parallel = ParallelLayout(ep=ep)
        ctx = init_distributed(parallel, timeout_s=600, seed=0)
        self.saved[name] = self._snapshot()
        return ctx

    def activate(self, name: str) -> None:
        self._restore(self.saved[name])


def build_models(model_dir: Path, layout, args):
    from megatron_dapo.model.builder import build_gpt_models
    from megatron_dapo.model.hf_config import read_hf_config
    from megatron_dapo.model.load import load_hf_into_megatron

    hf_cfg = read_hf_config(model_dir)
    models = build_gpt_models(hf_cfg, layout, torch.float32, transformer_engine="off", init_weights=False,
                              moe_token_dispatcher=args.dispatcher)  # fmt: skip
    load_hf_into_megatron(models, model_dir, hf_cfg)
    return models, hf_cfg


def build_moe_actor(model_dir: Path, layout, ep: int, distributed_optimizer: bool, args):
    from megatron_dapo.actor import build_actor

    models, hf_cfg = build_models(model_dir, layout, args)
    cfg = Config()
    cfg.optimizer.lr, cfg.optimizer.warmup_steps = 1e-6, 0
    cfg.trainer.micro_batch_size = args.batch // 2  # this rank's half of the batch: one micro-batch
    cfg.trainer.max_tokens_per_micro_batch = 0
    cfg.parallel.ep = ep
    cfg.parallel.use_distributed_optimizer = distributed_optimizer
    cfg.moe.token_dispatcher = args.dispatcher
    return build_actor(cfg, models, vocab_size=hf_cfg.vocab_size), hf_cfg


# ---------------------------------------------------------------------------------------------
# (b) memory of the actor's state
# ---------------------------------------------------------------------------------------------


def is_expert_name(name: str) -> bool:
    """A routed expert's parameter (Megatron's `mlp.experts.` modules); the router is dense (replicated)."""
    return ".mlp.experts." in name


class ExpertRanges:
    """Which bytes of memory hold expert parameters: each model parameter's address range, by name.

    The distributed optimizer's main parameters of an fp32 model are views of the parameters'
    storage; its Adam state is keyed by them. An address says which parameter a view belongs to.
    """

    def __init__(self, models) -> None:
        spans = sorted((p.data_ptr(), p.data_ptr() + p.nbytes, is_expert_name(n)) for m in models for n, p in m.named_parameters())
        self.starts = [s for s, _, _ in spans]
        self.spans = spans

    def __call__(self, tensor: torch.Tensor) -> bool:
        index = bisect.bisect_right(self.starts, tensor.data_ptr()) - 1
        start, end, expert = self.spans[index]
        if not start <= tensor.data_ptr() < end:
            raise ValueError("tensor is not a view of a model parameter")
        return expert


def actor_state_bytes(actor) -> dict[tuple[str, str], int]:
    """{(kind, "dense" | "expert"): bytes this rank holds} for params, grads, optimizer (module doc, (b))."""
    out = {(kind, side): 0 for kind in KINDS for side in ("dense", "expert")}
    part = {False: "dense", True: "expert"}
    expert_param = ExpertRanges(actor.models)
    seen: set[int] = set()  # storages counted already (the optimizer's views of params and grads)
    for model in actor.models:
        names = {p: n for n, p in model.named_parameters()}
        for p, name in names.items():
            out["params", part[is_expert_name(name)]] += p.nbytes
            seen.add(p.untyped_storage().data_ptr())
        # Megatron DDP: `buffers` (dense; every parameter at EP=1) and `expert_parallel_buffers` (EP>1)
        for buffer in list(model.buffers) + list(getattr(model, "expert_parallel_buffers", None) or []):
            if buffer.param_data is not None:
                seen.add(buffer.param_data.untyped_storage().data_ptr())
            seen.add(buffer.grad_data.untyped_storage().data_ptr())
            held = {kind: sum(p.main_grad.nbytes for p in buffer.params if is_expert_name(names[p]) == kind) for kind in part}
            only_experts = held[True] > 0 and held[False] == 0
            held[only_experts] += buffer.grad_data.nbytes - sum(held.values())  # alignment padding: the buffer's kind
            for kind, n in held.items():
                out["grads", part[kind]] += n
    for opt in getattr(actor.optimizer, "chained_optimizers", None) or [actor.optimizer]:
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                for t in [p] + [v for v in inner.state.get(p, {}).values() if isinstance(v, torch.Tensor)]:
                    key = t.untyped_storage().data_ptr()
                    if key not in seen:
                        seen.add(key)
                        out["optimizer", part[expert_param(p)]] += t.untyped_storage().nbytes()
    return out


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def alternate(sides: dict[str, tuple[str, Callable[[], object]]], states: ParallelStates, rounds: int) -> dict[str, list[float]]:
    """{side: seconds per run}: one warm-up of each side, then `rounds` rounds in order; a run's time
    is the slower rank's (every side is a collective)."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for timed in [False] + [True] * rounds:
        for name, (layout, fn) in sides.items():
            states.activate(layout)
            dist.barrier()
            start = time.perf_counter()
            fn()
            if timed:
                times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        times[name] = tensor.tolist()
    return times


def drain_sync(models, hf_cfg) -> int:
    """Consume the gather export to the end; the bytes of full HF tensors it produced."""
    from megatron_dapo.rollout.sync.gather import iter_weight_buckets

    return sum(t.nbytes for bucket in iter_weight_buckets(models, hf_cfg) for _, t in bucket)


def broadcast_experts_flat(expert_bytes_per_rank: int) -> Callable[[], None]:
    """The control of the EP=2 export: the same expert bytes, each EP rank's as ONE broadcast over the EP group."""
    from megatron.core import parallel_state

    flat = torch.zeros(expert_bytes_per_rank // 4, dtype=torch.float32)

    def run() -> None:
        group = parallel_state.get_expert_model_parallel_group()
        for source in dist.get_process_group_ranks(group):
            dist.broadcast(flat, src=source, group=group)

    return run


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} s ({min(values):.3f}-{max(values):.3f})"


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--moe-ffn", type=int, default=256, help="each expert's FFN width (moe_intermediate_size)")
    parser.add_argument("--dispatcher", choices=("alltoall", "allgather"), default="alltoall")
    parser.add_argument("--batch", type=int, default=8, help="sequences in the global batch (half per rank)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence (prompt + response)")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds of the update step")
    parser.add_argument("--sync-rounds", type=int, default=15, help="timed rounds of the weight-sync export")
    args = parser.parse_args()
    args.variable = False
    if int(os.environ.get("WORLD_SIZE", "1")) != 2:
        parser.error("run with two processes: torchrun --nproc_per_node 2 benchmarks/bench_moe.py")
    if args.batch % 2 or args.experts % 2:
        parser.error("--batch and --experts must be even (two data-parallel ranks; EP=2)")
    torch.set_num_threads(1)  # two ranks on this machine's cores: one thread each, no oversubscription

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batch = make_batch(args).select(list(range(rank * args.batch // 2, (rank + 1) * args.batch // 2)))
    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp]
        dist.broadcast_object_list(shared, src=0)  # rank 0's directory: both ranks load the same models
        if rank == 0:
            save_models(Path(shared[0]), args)
        dist.barrier()
        moe_dir, dense_dir = Path(shared[0]) / "moe", Path(shared[0]) / "dense"

        states = ParallelStates()
        actors, memory = {}, {}
        for ep in (1, 2):
            name = f"EP{ep}"
            ctx = states.set_up(name, ep)
            for distributed_optimizer in (False, True):  # the plain optimizer for (b) only
                actor, hf_cfg = build_moe_actor(moe_dir, ctx.layout, ep, distributed_optimizer, args)
                actor.update([batch])  # the optimizer's state exists after its first step
                memory[name, distributed_optimizer] = actor_state_bytes(actor)
            actors[name] = actor
            if ep == 1:
                dense_models, dense_cfg = build_models(dense_dir, ctx.layout, args)

        update_times = alternate({name: (name, lambda a=actor: a.update([batch])) for name, actor in actors.items()},
                                 states, args.rounds)  # fmt: skip
        sync_bytes: dict[str, int] = {}
        expert_bytes = memory["EP2", True]["params", "expert"]  # each EP rank's experts
        sync_bytes["control"] = 2 * expert_bytes

        def sync(name: str, models) -> Callable[[], None]:
            def run() -> None:
                sync_bytes[name] = drain_sync(models, dense_cfg if name == "dense" else hf_cfg)

            return run

        sync_times = alternate({"MoE EP1": ("EP1", sync("MoE EP1", actors["EP1"].models)),
                                "MoE EP2": ("EP2", sync("MoE EP2", actors["EP2"].models)),
                                "dense": ("EP1", sync("dense", dense_models)),
                                "control": ("EP2", broadcast_experts_flat(expert_bytes))}, states, args.sync_rounds)  # fmt: skip
        dist.barrier()

    if rank == 0:
        tokens = args.batch * args.seq
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
              f"(1 thread per rank), 2 ranks, gloo")  # fmt: skip
        print(f"model: Qwen3-MoE float32, hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-{args.topk}, "
              f"expert FFN {args.moe_ffn}, vocab {args.vocab}; {args.dispatcher} dispatcher; DP=2; global batch "
              f"{args.batch} x {args.seq} tokens ({tokens}), {args.batch // 2} sequences per rank in one micro-batch; "
              f"{args.rounds} rounds ({args.sync_rounds} for the sync) after a warm-up, alternating; median (min-max)")  # fmt: skip
        print("\n(a) update step")
        for name, values in update_times.items():
            print(f"  DP2 x {name}: {spread(values)}, {tokens / statistics.median(values):.0f} tok/s")
        ratio = statistics.median(update_times["EP2"]) / statistics.median(update_times["EP1"])
        paired = [two / one for one, two in zip(update_times["EP1"], update_times["EP2"])]
        print(f"  EP2 / EP1: x{ratio:.3f} (medians); per round x{statistics.median(paired):.3f} "
              f"(x{min(paired):.3f}-x{max(paired):.3f})")  # fmt: skip
        print("\n(b) actor state per rank, MiB (dense + expert)")
        print(f"  {'optimizer':<14}{'layout':<7}" + "".join(f"{kind:>22}" for kind in KINDS) + f"{'total':>10}")
        for distributed_optimizer in (True, False):
            for name in actors:
                m = memory[name, distributed_optimizer]
                cells = "".join(f"{mib(m[kind, 'dense']) + ' + ' + mib(m[kind, 'expert']):>22}" for kind in KINDS)
                label = "distributed" if distributed_optimizer else "plain"
                print(f"  {label:<14}{name:<7}{cells}{mib(sum(m.values())):>10}")
        print("\n(c) weight-sync export (gather, consumed to the end on both ranks)")
        base = statistics.median(sync_times["dense"])
        for name, values in sync_times.items():
            if name == "control":
                print("  control: the EP2 export's expert bytes, each rank's in one broadcast (no export)")
            print(f"  {name:<8} {sync_bytes[name] / 2**20:7.2f} MiB  {spread(values)}  "
                  f"{sync_bytes[name] / statistics.median(values) / 2**20:7.1f} MiB/s  x{statistics.median(values) / base:.2f} of dense")  # fmt: skip
    teardown()


if __name__ == "__main__":
    main()
