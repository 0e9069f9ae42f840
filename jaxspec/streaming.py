"""Host-side work between dispatches of the compiled round loop: streaming, stop strings and max_time.

When the host watches the output, the same compiled loop runs a few rounds per dispatch; the state stays on the
device between dispatches and the host reads only lengths and the token buffer.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np

from .output import GenerateOutput


@dataclasses.dataclass(frozen=True)
class StreamingConfig:
    """Output as it is made, and when to stop early, with transformers' names where it has them.

    `streamer` follows transformers' protocol (`put(prompt ids)`, then `put(new ids)` as rounds commit, then `end()`)
    for a batch of one row; `on_tokens(rows)` gets each row's newly committed tokens (a list of int32 arrays,
    possibly empty) for any batch. `stop_strings` end a row at the token that completes one (decoded with
    generate's `tokenizer`, default the model's); `max_time` (seconds) ends the call after the round in progress.
    `rounds_per_dispatch`: rounds per dispatch (default: as many as fill about STREAM_INTERVAL seconds).
    """

    stop_strings: str | Sequence[str] | None = None
    max_time: float | None = None
    streamer: Any = None
    on_tokens: Callable[[list[np.ndarray]], None] | None = None
    rounds_per_dispatch: int | None = None


# When the host watches the output (streaming, stop strings, max_time), each dispatch runs as many rounds as fill
# about STREAM_INTERVAL seconds, judged from the previous dispatch: every dispatch costs a host round trip (a few
# ms), which one round per dispatch would pay per token. Text still appears several times a second, and a stop
# string or max_time is noticed within that interval (tokens past a stop string are cropped, never returned).
STREAM_INTERVAL = 0.1
MAX_STREAM_ROUNDS = 64


def rounds_for_interval(rounds: int, seconds: float, interval: float = STREAM_INTERVAL) -> int:
    """Rounds for the next dispatch, from the last one's `rounds` and its wall time `seconds`."""
    if seconds <= 0:
        return min(2 * rounds, MAX_STREAM_ROUNDS)
    return int(np.clip(round(rounds * interval / seconds), 1, MAX_STREAM_ROUNDS))


@dataclasses.dataclass
class HostControl:
    """What the host does between dispatches of the round loop: hand new tokens to a streamer or callback, end rows
    whose text completed a stop string, and end the call past `max_time`.

    A stop string ends its row at the token whose text completes it (transformers' StopStringCriteria stops at the
    same token in plain decoding; in its assisted loop a whole verified block is kept, past the stop string). Text
    is each row's decoded new tokens: a stop string that starts inside the prompt is not seen.
    """

    stop_strings: tuple[str, ...] = ()
    max_time: float | None = None
    streamer: Any = None
    on_tokens: Callable[[list[np.ndarray]], None] | None = None
    rounds_per_dispatch: int | None = None  # None: about STREAM_INTERVAL seconds of rounds per dispatch
    tokenizer: Any = None

    @classmethod
    def build(cls, config: "StreamingConfig", tokenizer: Any) -> "HostControl":
        """Validated settings (errors before anything compiles)."""
        stop_strings = config.stop_strings
        if isinstance(stop_strings, str):
            stop_strings = (stop_strings,)
        stop_strings = tuple(stop_strings or ())
        if not all(isinstance(text, str) and text for text in stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {stop_strings!r}.")
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings need a tokenizer to read the text: pass tokenizer= (this model has none).")
        max_time = config.max_time
        if max_time is not None and not (isinstance(max_time, (int, float)) and max_time > 0):
            raise ValueError(f"max_time must be a number of seconds > 0, got {max_time!r}.")
        streamer = config.streamer
        if streamer is not None and not (hasattr(streamer, "put") and hasattr(streamer, "end")):
            raise TypeError("streamer must have put(ids) and end() (transformers' streamer protocol).")
        per_dispatch = config.rounds_per_dispatch
        if per_dispatch is not None and (isinstance(per_dispatch, bool) or not isinstance(per_dispatch, int) or
                                         per_dispatch < 1):
            raise ValueError(f"rounds_per_dispatch must be an integer >= 1, got {per_dispatch!r}.")
        return cls(stop_strings, max_time, streamer, config.on_tokens, per_dispatch, tokenizer)

    @property
    def active(self) -> bool:
        return bool(self.stop_strings or self.max_time or self.streamer is not None or self.on_tokens is not None)

    def check_batch(self, batch: int) -> None:
        if self.streamer is not None and batch != 1:
            raise ValueError(f"a streamer follows transformers' protocol, which streams one row; this batch has {batch}. "
                             "Pass on_tokens=callback instead: it gets every row's new tokens.")

    def begin(self, prompts, prompt_lengths, deadline_from: float) -> None:
        self._prompt_lengths = prompt_lengths
        self._emitted = prompt_lengths.copy()  # [B] tokens handed out so far, prompt included
        self._stop_at = np.full(len(prompts), -1)  # [B] new tokens kept when a stop string ended the row
        self._deadline = None if self.max_time is None else deadline_from + self.max_time
        if self.streamer is not None:
            self.streamer.put(np.asarray(prompts[0])[None])

    def out_of_time(self) -> bool:
        return self._deadline is not None and time.perf_counter() > self._deadline

    def after_dispatch(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Hand out what the rows committed since the last dispatch; -> [B] rows that a stop string ends."""
        stop = self._stop_at >= 0
        for row in np.flatnonzero(~stop):
            if self.stop_strings:
                new = tokens[row, self._prompt_lengths[row]: lengths[row]]
                kept = self._stop_point(new, already=self._emitted[row] - self._prompt_lengths[row])
                if kept is not None:
                    self._stop_at[row] = kept
                    lengths = lengths.copy()
                    lengths[row] = self._prompt_lengths[row] + kept
                    stop[row] = True
        fresh = [tokens[row, self._emitted[row]: max(lengths[row], self._emitted[row])] for row in range(len(lengths))]
        self._emitted = np.maximum(self._emitted, lengths)
        if self.streamer is not None and len(fresh[0]):
            self.streamer.put(fresh[0])
        if self.on_tokens is not None:
            self.on_tokens(fresh)
        return stop

    def _stop_point(self, new: np.ndarray, already: int) -> int | None:
        """The number of new tokens up to the one whose text completes a stop string, or None."""
        text = self.tokenizer.decode(new.tolist())
        if not any(s in text for s in self.stop_strings):
            return None
        for kept in range(max(already, 1), len(new) + 1):  # the text up to `already` had no stop string
            text = self.tokenizer.decode(new[:kept].tolist())
            if any(s in text for s in self.stop_strings):
                return kept
        return len(new)

    def finish(self) -> None:
        if self.streamer is not None:
            self.streamer.end()

    def crop(self, output: GenerateOutput, pad_id: int) -> GenerateOutput:
        """Rows a stop string ended keep their tokens up to it; the rest of the row becomes padding."""
        if not self.stop_strings or (self._stop_at < 0).all():
            return output
        width = output.sequences.shape[1] - int(output.num_new_tokens.max())
        kept = np.where(self._stop_at >= 0, np.minimum(self._stop_at, output.num_new_tokens), output.num_new_tokens)
        sequences = output.sequences[:, : width + int(kept.max())].copy()
        for row, n in enumerate(kept):
            sequences[row, width + n:] = pad_id
        return dataclasses.replace(output, sequences=sequences, num_new_tokens=kept.astype(np.int32))
