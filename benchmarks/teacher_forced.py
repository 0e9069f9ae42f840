"""Does an assistant's acceptance come in runs? Its matches to the target's greedy answer, teacher-forced, replayed.

    python benchmarks/teacher_forced.py [--model qwen2.5-coder-1.5b] [--assistant qwen2.5-coder-0.5b]
        [--prompts code_completion,...] [--max-new-tokens 64] [--num-assistant-tokens 4]

For each prompt of benchmarks/_bench_prompts.py (a chat message), the target answers greedily; then the assistant
reads the prompt and that answer in one forward. Its greedy token at each answer position, given the target's own
prefix, either matches the target's token or not (a match), with some confidence (its top probability). An
autoregressive assistant's round that starts at position p has drafted from the target's prefix, so it is accepted
up to the first position from p that does not match: the matches decide every round of every schedule, and replaying
them needs no second run of either model.

The table: the answer's match rate; the chance of a match right after a match and right after a miss (equal where
matches are independent); the positions where the assistant doubts its token (top probability below the threshold);
tokens a round of a constant schedule of K drafts, replayed as the loop runs it (`replay_constant`: the prefill's
token first; a doubted draft is proposed and ends its round, as in transformers; tests/e2e/test_teacher_forced.py
checks the replay against the loop's rounds); and the same replay with the matches shuffled (the mean over many
orders), which keeps the rate and loses the order. Where the two agree, the adaptive schedule's model of a round,
independent acceptances at one rate (jaxspec/schedule.py), describes the answer; runs of matches would show as more
tokens a round in order. The table also goes to a JSON record in `--results`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import numpy as np

from _bench_prompts import PROMPTS, chat_ids
from _record import Record, add_results_argument

SHUFFLES = 200


def replay_constant(matches: Sequence[bool], confident: Sequence[bool], k: int, budget: int | None = None,
                    ends_with_eos: bool = False) -> list[int]:
    """Accepted drafts in each round of a constant schedule of `k` drafts over an answer whose position t the
    assistant predicts (`matches[t]`) with its top probability above the threshold (`confident[t]`), as the loop
    runs it. The prefill commits position 0; a round from position c drafts c, c + 1, ... up to k of them, no more
    than leave the round its own token within `budget` (max_new_tokens; the answer's length where it is None), and
    stops after a doubted draft (proposed, then drafting stops) or after drafting the EOS that ends the answer
    (`ends_with_eos`). Positions past the answer are reached only after a draft the target rejects, so they change
    no round's accepted count."""
    n = len(matches)
    budget = n if budget is None else budget
    committed, rounds = 1, []
    while committed < n:
        limit = min(k, budget - committed - 1)
        drafts = 0
        while drafts < limit and committed + drafts < n:
            drafts += 1
            position = committed + drafts - 1
            if not confident[position] or (ends_with_eos and position == n - 1 and matches[position]):
                break
        accepted = 0
        while accepted < drafts and matches[committed + accepted]:
            accepted += 1
        rounds.append(accepted)
        committed += accepted + 1
    return rounds


def transitions(matches: Sequence[bool]) -> tuple[float, float]:
    """(P(match | the position before matched), P(match | it did not)); nan where there is no such position."""
    m = np.asarray(matches, bool)
    before, after = m[:-1], m[1:]

    def rate(mask):
        return float(after[mask].mean()) if mask.any() else float("nan")

    return rate(before), rate(~before)


def tokens_per_round(rounds: Sequence[int]) -> float:
    return float(np.mean(np.asarray(rounds) + 1)) if len(rounds) else float("nan")


def shuffled_tokens_per_round(matches, confident, k: int, seed: int = 0) -> float:
    """`replay_constant`'s tokens a round, the mean over SHUFFLES random orders of the (match, confidence) pairs (an
    answer that fills its budget: the EOS that ends one would move with the shuffle)."""
    rng = np.random.default_rng(seed)
    m, c = np.asarray(matches, bool), np.asarray(confident, bool)
    means = []
    for _ in range(SHUFFLES):
        order = rng.permutation(len(m))
        means.append(tokens_per_round(replay_constant(m[order], c[order], k)))
    return float(np.mean(means))


def teacher_forced(target, assistant, ids: list[int], max_new_tokens: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """([N] bool, [N] float, ended): for each of the target's N greedy answer tokens, whether the assistant's greedy
    token there (given the prompt and the answer before it) is the same, and the assistant's top probability there;
    and whether the answer ended with an EOS before `max_new_tokens`."""
    import jax.numpy as jnp

    import jaxspec

    out = jaxspec.generate(target, [ids], max_new_tokens=max_new_tokens)
    answer = np.asarray(out.sequences)[0, len(ids): len(ids) + int(out.num_new_tokens[0])]
    tokens = np.concatenate([np.asarray(ids), answer]).astype(np.int32)[None]  # [1, T]
    module, length = assistant.module, tokens.shape[1]
    logits, _, _ = module(jnp.asarray(tokens), jnp.arange(length)[None], module.init_cache(1, length))  # eager: once
    # [N, V]: the logits that predict each answer token, from the position before it
    predicting = np.asarray(logits[0, len(ids) - 1: length - 1], np.float32)
    shifted = predicting - predicting.max(axis=-1, keepdims=True)
    top_probability = 1.0 / np.exp(shifted).sum(axis=-1)
    return predicting.argmax(axis=-1) == answer, top_probability, len(answer) < max_new_tokens


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--assistant", default="qwen2.5-coder-0.5b", help="a catalogue name or a path, same tokenizer")
    p.add_argument("--prompts", default=",".join(PROMPTS), help=", ".join(PROMPTS))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-assistant-tokens", type=int, default=4, help="K of the replayed constant schedule")
    p.add_argument("--confidence-threshold", type=float, default=0.4,
                   help="assistant_confidence_threshold (transformers' default; 0 disables it)")
    add_results_argument(p)
    args = p.parse_args(argv)
    prompts = args.prompts.split(",")
    if unknown := [name for name in prompts if name not in PROMPTS]:
        p.error(f"unknown prompts {unknown}; choose from {', '.join(PROMPTS)}")
    if args.max_new_tokens < 2 or args.num_assistant_tokens < 1 or not 0 <= args.confidence_threshold <= 1:
        p.error("--max-new-tokens must be at least 2, --num-assistant-tokens at least 1, and "
                "--confidence-threshold in [0, 1]")
    record = Record("teacher_forced", __file__, argv, args.results)

    import jaxspec

    target, assistant = jaxspec.load(args.model), jaxspec.load(args.assistant)
    if target.config.vocab_size != assistant.config.vocab_size:
        p.error(f"{args.assistant} has a vocabulary of {assistant.config.vocab_size} tokens and {args.model} of "
                f"{target.config.vocab_size}: teacher forcing needs the target's tokenizer")
    k = args.num_assistant_tokens
    title = (f"{args.assistant}'s matches to {args.model}'s greedy answers, teacher-forced: {args.max_new_tokens} new "
             f"tokens, K = {k}, confidence threshold {args.confidence_threshold}")
    print(f"# {title}\n")
    print("| prompt | answer tokens | match rate | after a match | after a miss | doubted | tokens a round, K "
          f"= {k} | shuffled |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")  # shuffled: nan for an answer that ended early
    rows = []
    for name in prompts:
        matches, top, ended = teacher_forced(target, assistant, chat_ids(target.tokenizer, PROMPTS[name]),
                                             args.max_new_tokens)
        confident = top >= args.confidence_threshold
        after_match, after_miss = transitions(matches)
        in_order = tokens_per_round(replay_constant(matches, confident, k, args.max_new_tokens, ended))
        shuffled = float("nan") if ended else shuffled_tokens_per_round(matches, confident, k)
        row = dict(table="teacher_forced", prompt=name, answer_tokens=len(matches), match_rate=float(matches.mean()),
                   after_match=after_match, after_miss=after_miss, doubted=int((~confident).sum()),
                   tokens_per_round=in_order, shuffled_tokens_per_round=shuffled,
                   matches="".join("1" if m else "0" for m in matches))
        rows.append(row)
        print(f"| {name} | {len(matches)} | {row['match_rate']:.2f} | {after_match:.2f} | {after_miss:.2f} | "
              f"{row['doubted']} | {in_order:.2f} | {shuffled:.2f} |", flush=True)
    record.write(rows, [args.model], title=title,
                 settings={k_: v for k_, v in vars(args).items() if k_ not in ("model", "results")})


if __name__ == "__main__":
    sys.exit(main())
