"""Chain against tree drafting at equal verify width: tokens per round, speedup over plain greedy, and what a tree
block costs against a chain block of the same width.

    python benchmarks/bench_tree.py [--model smollm2-135m] [--drafters prompt_lookup,eagle3] [--chain 8]
        [--trees 8,4:8,2:8,4,4] [--schedule constant] [--max-new-tokens 64] [--repeats 2]
        [--results benchmarks/results]

Drafters: `prompt_lookup`, `eagle3` (the model's shipped head, or `eagle3=PATH`), `mtp` (the MTP layers a catalogue
model ships), `assistant=NAME` (a catalogue name or path with the target's tokenizer), `assistant-int8=NAME` (the same
with int8 weights and activations, `jaxspec.quantize`). Each runs a chain of K = `--chain` drafts and each tree (N, D) or (N, D, F) of
`--trees` with N = K (so every block verifies up to K + 1 entries; with F, the N most probable of D F candidates), on the five prompts of benchmarks/_bench_prompts.py through
the chat template, batch 1, greedy; every output is checked equal to plain greedy's. The constant schedule (the
default here) drafts the whole chain or tree every round, so the widths compared are the widths verified;
`--schedule adaptive` compares what the library does by default.

First table, per strategy: tokens per round (new tokens over rounds, all prompts), decode throughput over plain
greedy's (prefill excluded; each prompt's calls interleaved, median of `--repeats`, then total tokens over total
time). Second table: a round of a fixed chain of K rejected drafts and of a fixed tree of N rejected nodes (a chain
of D with N/D - 1 alternatives at each depth), in milliseconds and in plain steps: the verify cost of an N-node tree
block against a chain block of the same width (the tree pays its attention mask, per-node processing and the move
of its accepted path). The tables go to a JSON record in `--results` (benchmarks/_record.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

from _bench_prompts import PROMPTS, chat_ids
from _record import Record, add_results_argument


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafters", default="prompt_lookup,eagle3")
    p.add_argument("--chain", type=int, default=8, help="K: the chain's drafts, and every tree's node budget N")
    p.add_argument("--trees", default="8,4:8,2", help="tree shapes N,D or N,D,F separated by ':' (N must equal "
                   "--chain)")
    p.add_argument("--schedule", default="constant", choices=("constant", "adaptive"))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    add_results_argument(p)
    args = p.parse_args(argv)
    record = Record("bench_tree", __file__, argv, args.results)

    import jax.numpy as jnp
    import numpy as np

    import jaxspec
    from jaxspec import catalog
    from jaxspec import settings as settings_lib
    from jaxspec.generate import generate_with_drafter
    from jaxspec.strategies.base import Draft, Drafter, DraftStep
    from jaxspec.tree import TreeShape, sibling_tree

    def describe(tree: TreeShape) -> str:
        return f"N={tree.nodes} D={tree.depth}" + (f" F={tree.branching}" if tree.selects else "")

    trees = [TreeShape.parse(shape) for shape in args.trees.split(":")]
    for tree in trees:
        if tree.nodes != args.chain:
            p.error(f"tree {describe(tree)}: its node budget must equal --chain {args.chain} (equal widths)")
    model = jaxspec.load(args.model)
    prompts = {name: [chat_ids(model.tokenizer, text)] for name, text in PROMPTS.items()}

    def strategy_arguments(drafter: str) -> tuple[str, dict]:
        name, _, path = drafter.partition("=")
        if name == "prompt_lookup":
            return name, dict(prompt_lookup_num_tokens=args.chain)
        if name == "eagle3":
            head = path or catalog.shipped_drafter(args.model, "eagle3")
            return f"eagle3 ({head})", dict(assistant_model=jaxspec.load(head), num_assistant_tokens=args.chain)
        if name == "mtp":
            return "mtp", dict(use_mtp=True, num_assistant_tokens=args.chain)
        if name in ("assistant", "assistant-int8"):
            assistant = jaxspec.load(path)
            if name == "assistant-int8":
                assistant = jaxspec.quantize(assistant, "int8")
            return f"{name} {path}", dict(assistant_model=assistant, num_assistant_tokens=args.chain,
                                          assistant_confidence_threshold=0.0)
        p.error(f"unknown drafter {drafter!r}: prompt_lookup, eagle3[=PATH], mtp or assistant[-int8]=NAME")

    calls = {"plain greedy": {}}
    for drafter in args.drafters.split(","):
        label, kwargs = strategy_arguments(drafter)
        kwargs |= dict(num_assistant_tokens_schedule=args.schedule)
        calls[f"{label}, chain K={args.chain}"] = kwargs
        for tree in trees:
            calls[f"{label}, tree {describe(tree)}"] = kwargs | dict(tree=tree)

    def run(kwargs, ids):
        return jaxspec.generate(model, ids, max_new_tokens=args.max_new_tokens, eos_token_id=[], **kwargs)

    plain_tokens = {name: run({}, ids).sequences for name, ids in prompts.items()}
    seconds = {(call, name): [] for call in calls for name in prompts}
    rounds, tokens = {call: 0 for call in calls}, {call: 0 for call in calls}
    for repeat in range(args.repeats + 1):  # the first pass compiles
        for name, ids in prompts.items():
            for call, kwargs in calls.items():
                out = run(kwargs, ids)
                if repeat == 0:
                    assert np.array_equal(out.sequences, plain_tokens[name]), f"{call} on {name} is not plain greedy"
                    rounds[call] += int(out.rounds)
                    tokens[call] += int(out.new_tokens(0).size)
                    continue
                seconds[(call, name)].append(out.decode_seconds - out.prefill_seconds)
    total = {call: sum(statistics.median(seconds[(call, name)]) for name in prompts) for call in calls}
    title = (f"chain vs tree at equal verify width: {args.model}, {len(prompts)} prompts x {args.max_new_tokens} "
             f"tokens, batch 1, greedy, {args.schedule} schedule, median of {args.repeats}")
    print(f"# {title}\n")
    print("| strategy | tokens per round | speedup over plain greedy |")
    print("|---|---:|---:|")
    rows = []
    for call in calls:
        per_round = tokens[call] / rounds[call]
        speedup = (tokens[call] / total[call]) / (tokens["plain greedy"] / total["plain greedy"])
        print(f"| {call} | {per_round:.2f} | {speedup:.2f} |")
        rows.append({"table": "strategies", "strategy": call, "tokens_per_round": per_round, "speedup": speedup})

    @dataclasses.dataclass(frozen=True)
    class FixedBlock(Drafter):
        """Proposes the same rejected tokens every round: a chain of K, or (with `tree`) a tree of N nodes (with a
        budget, the first N of the D F candidates: the block's shape is all that counts here)."""

        def draft(self, ctx, loop, state, rng):
            batch = loop.lengths.shape[0]
            count = jnp.full((batch,), self.max_draft, jnp.int32)
            if self.tree is None:
                draft = Draft(tokens=jnp.zeros((batch, self.max_draft), jnp.int32), count=count)
            else:
                tokens = jnp.zeros((batch, self.max_draft, self.tree.branching), jnp.int32)
                draft = Draft.of_tree(sibling_tree(tokens + jnp.arange(self.tree.branching), count).truncated(
                    self.tree.nodes))
            return DraftStep(draft, state, jnp.zeros((), jnp.int32), loop.cache)

    story = prompts["story"]
    settings = settings_lib.resolve(model, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=[])
    blocks = {"plain step": Drafter(0), f"chain block of {args.chain} drafts": FixedBlock(max_draft=args.chain)}
    for tree in trees:
        blocks[f"tree block of {tree.nodes} nodes, depth {tree.depth}"] = FixedBlock(max_draft=tree.depth, tree=tree)
        # (a budget tree's block has the same N + 1 entries as the full tree of its depth)
    block_seconds = {name: [] for name in blocks}
    for repeat in range(args.repeats + 1):
        for name, drafter in blocks.items():
            out = generate_with_drafter(model, story, None, drafter, settings)
            if repeat:
                block_seconds[name].append(out.seconds_per_round)
    step = statistics.median(block_seconds["plain step"])
    print("\n| round (story prompt) | ms | plain steps |")
    print("|---|---:|---:|")
    for name in blocks:
        ms = statistics.median(block_seconds[name])
        print(f"| {name} | {ms * 1e3:.2f} | {ms / step:.2f} |")
        rows.append({"table": "blocks", "block": name, "ms": ms * 1e3, "plain_steps": ms / step})
    record.write(rows, [args.model], title=title,
                 settings={k: v for k, v in vars(args).items() if k not in ("model", "results")})


if __name__ == "__main__":
    sys.exit(main())
