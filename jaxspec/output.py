"""What `generate` returns, and how the loop's final state becomes it (on the host)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class GenerateOutput:
    sequences: np.ndarray  # [B, T_in + N] int32: the prompts as given, new tokens, then padding (HF layout)
    num_new_tokens: np.ndarray  # [B]
    target_forwards: int  # prefill + verification rounds
    rounds: int
    draft_forwards: int
    drafted: np.ndarray  # [B]
    accepted: np.ndarray  # [B]
    accepted_hist: np.ndarray  # [B, K+1]: rounds in which a row accepted exactly i drafts
    # The rounds' price in plain decoding steps by the adaptive schedule's cost model (0: nothing priced them).
    priced_steps: float
    # The call's wall time in three parts that add up to it: compile_seconds (the loop's compiles, and the adaptive
    # schedule's step costs when measured, costs.py), then prefill + rounds. The round loop compiles while the prefill
    # runs; the time they overlapped counts as compile.
    compile_seconds: float
    decode_seconds: float  # prefill + rounds, compile excluded
    prefill_seconds: float = float("nan")
    first_token_seconds: float = float("nan")  # from the call's start until the prefill's tokens were ready
    strategy: str = "greedy"
    tree_rounds: int = 0  # rounds that verified a tree: alternatives beside the drafter's chain (`tree=`)
    drafter_summary: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # [B, N, V] float32 with return_logits=True: the processed target logits each new token was chosen from (what
    # plain decoding would have used at that position), -inf rows past a row's end; else None.
    logits: np.ndarray | None = None

    def new_tokens(self, row: int = 0) -> np.ndarray:
        """Row `row`'s new tokens: up to and including its EOS, without the padding after it. [N_row] int32"""
        start = self.sequences.shape[1] - int(self.num_new_tokens.max())
        return self.sequences[row, start: start + int(self.num_new_tokens[row])]

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens over the batch (nan when nothing was drafted)."""
        drafted = int(self.drafted.sum())
        return float(self.accepted.sum()) / drafted if drafted else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verification round and row (accepted drafts + the target's own token)."""
        row_rounds = int(self.accepted_hist.sum())
        first_tokens = len(self.num_new_tokens)  # produced by the prefill, not by a round
        return float(self.num_new_tokens.sum() - first_tokens) / row_rounds if row_rounds else float("nan")

    @property
    def modelled_speedup(self) -> float:
        """The speedup over plain decoding that the adaptive schedule's cost model gives for the rounds this call
        ran: plain decoding would need one step per new token after the first (the prefill picks it) for the longest
        row; the rounds cost `priced_steps` (nan where the schedule is not priced). Compared with a measured
        speedup, it says whether the cost model holds every cost that decoding pays."""
        steps = int(self.num_new_tokens.max()) - 1
        return steps / self.priced_steps if self.priced_steps > 0 else float("nan")

    @property
    def seconds_per_round(self) -> float:
        """Wall seconds a verification round took (plain decoding: a step), the prefill excluded; nan without
        rounds. Against plain decoding's, what a strategy's round costs in plain steps."""
        return (self.decode_seconds - self.prefill_seconds) / self.rounds if self.rounds else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return float(self.num_new_tokens.sum()) / self.decode_seconds if self.decode_seconds else float("nan")

    def counters(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "new_tokens": self.num_new_tokens.tolist(),
            "target_forwards": self.target_forwards,
            "rounds": self.rounds,
            "draft_forwards": self.draft_forwards,
            "drafted": self.drafted.tolist(),
            "accepted": self.accepted.tolist(),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_length_histogram": self.accepted_hist.sum(0).tolist(),
            "tree_rounds": self.tree_rounds,
            "priced_steps": self.priced_steps,
            "modelled_speedup": self.modelled_speedup,
            "compile_seconds": self.compile_seconds,
            "prefill_seconds": self.prefill_seconds,
            "first_token_seconds": self.first_token_seconds,
            "decode_seconds": self.decode_seconds,
            "tokens_per_second": self.tokens_per_second,
        }


@dataclasses.dataclass(frozen=True)
class FinalState:
    """The loop's final state, fetched to the host: what the output is made of."""

    tokens: np.ndarray  # [B, S] prompts (left-aligned) and committed tokens
    lengths: np.ndarray  # [B]
    counters: Any  # jaxspec.strategies.base.Counters, as host arrays
    drafter_summary: dict[str, np.ndarray]
    scores: np.ndarray | None  # [B, N, V] with return_logits


@dataclasses.dataclass(frozen=True)
class Timings:
    compile_seconds: float  # compiles, and measuring step costs where the schedule does
    prefill_seconds: float
    decode_seconds: float  # prefill + rounds
    first_token_seconds: float  # from the call's start until the prefill's tokens were ready


def unpack(final: FinalState, given: np.ndarray, prompt_lengths: np.ndarray, pad_id: int, timings: Timings,
           strategy: str) -> GenerateOutput:
    """The output in transformers' layout: `given` ([B, T_in], the prompts as the caller laid them out), then each
    row's new tokens, then padding."""
    new_counts = final.lengths - prompt_lengths
    width = int(new_counts.max())
    sequences = np.full((len(prompt_lengths), given.shape[1] + width), pad_id, np.int32)
    sequences[:, : given.shape[1]] = given
    for row, (p, n) in enumerate(zip(prompt_lengths, new_counts)):
        sequences[row, given.shape[1] : given.shape[1] + n] = final.tokens[row, p : p + n]
    counters = final.counters
    return GenerateOutput(
        sequences=sequences,
        num_new_tokens=new_counts.astype(np.int32),
        target_forwards=int(counters.rounds) + 1,
        rounds=int(counters.rounds),
        draft_forwards=int(counters.draft_forwards),
        drafted=np.asarray(counters.drafted),
        accepted=np.asarray(counters.accepted),
        accepted_hist=np.asarray(counters.accepted_hist),
        priced_steps=float(counters.priced_steps),
        compile_seconds=timings.compile_seconds,
        decode_seconds=timings.decode_seconds,
        prefill_seconds=timings.prefill_seconds,
        first_token_seconds=timings.first_token_seconds,
        strategy=strategy,
        tree_rounds=int(counters.tree_rounds),
        drafter_summary={k: np.asarray(v) for k, v in final.drafter_summary.items()},
        logits=None if final.scores is None else np.asarray(final.scores)[:, :width],
    )
