"""The EAGLE-3 objective, the training-time test (TTT), and the greedy drafts it implies, over teacher-forced rows.

A decoding round of a row with committed length L drafts as models/eagle3.py describes: the entry at L-2 (the
projected target features g there and the embedding of the newest token, at L-1) drafts the token at L, and draft k
(0-based) comes from an entry at L-2+k that reads the previous entry's output in place of g and the previous draft's
embedding. Draft k only matters when drafts 0..k-1 were accepted, that is, when they were the row's own tokens (on
the target's greedy rows, `dflash_data.generated_block_corpus`). So the chain teacher-forced on the row's tokens is
exactly the chain a round runs whenever its draft k is verified.

TTT (EAGLE-3's training-time test, as SpecForge's `OnlineEagle3Model.forward` runs it) computes those chains for
every round at once, in `steps` passes over all T indices of a row:

    step 0, index t:  x = (g_t, emb(token[t+1])) at rope position t; causal over step 0's entries at <= t
    step i, index t:  x = (step i-1's output at t, emb(token[t+1+i])) at rope position t+i; its query sees step 0's
                      keys at indices <= t and steps 1..i's keys at index t only (`ttt_attention`)

which is the round at committed length t+2: step 0's entries at <= t are its committed entries and steps 1..i at t
its draft entries at positions t+1..t+i. Step i at index t drafts the token at t+2+i.

Loss (SpecForge `_compute_target_p` and `LogSoftmaxLoss`): the target's distribution of that token, its head over
its final-normed state at t+1+i restricted to the draft vocabulary and renormalised, against the head's
draft-vocabulary distribution. KL here rather than SpecForge's cross-entropy: the same gradient, with a floor at 0 that
makes the curves readable. An entry counts when
- its round is one decoding runs: t+2 >= starts+1 (the first round after a prompt of length s commits s+1 tokens:
  the prompt and the token the prefill produced), and the token it drafts is in the row: t+2+i < length;
- that token is in the draft vocabulary. SpecForge masks positions whose target argmax is outside it (the restricted,
  renormalised p says nothing there, and no draft can be accepted); on the target's greedy rows that argmax is the
  row's token, which is what is checked, with no full-vocabulary head product.
Steps are weighted decay**i (SpecForge's `ploss_decay`, 0.8 by default, as in EAGLE's own trainer): draft i counts
only when every earlier one was accepted. The loss is the weighted mean of KL over the entries that count (as
`dflash_losses.block_loss` pools its entries), so its scale does not depend on the rows' lengths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import int8 as I

DEFAULT_TTT_STEPS = 7  # SpecForge's default ttt_length
DEFAULT_STEP_DECAY = 0.8  # SpecForge's default ploss_decay


def step_weights(steps: int, decay: float) -> jax.Array:
    """[steps] the loss weight decay**i of TTT step i."""
    return jnp.asarray(decay, jnp.float32) ** jnp.arange(steps, dtype=jnp.float32)


def embedding_table(head, target):
    """The [V, D] table the head embeds tokens with: its own where the checkpoint has one, else the target's raw
    table (unscaled, as SpecForge copies it in and as jaxspec/strategies/eagle3.py reads it)."""
    return I.weight(head, "embed") if head.cfg.own_embedding else I.weight(target, "embed")


def ttt_attention(q: jax.Array, keys: list[jax.Array], values: list[jax.Array], scale: float) -> jax.Array:
    """Attention of TTT step i = len(keys) - 1 (SpecForge's `LlamaAttention.forward` with `cache_hidden`).

    q: [B, T, H, Dh]; keys, values: steps 0..i's [B, T, K, Dh]. The query at index t sees step 0's keys at indices
    <= t and steps 1..i's keys at index t, all in one softmax. Returns [B, T, H, Dh]."""
    b, t, h, dh = q.shape
    kv_heads = keys[0].shape[2]
    qg = q.reshape(b, t, kv_heads, h // kv_heads, dh)  # head h reads kv head h // G, as HF's repeat_kv
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]  # [T, T]: query index >= key index
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys[0]) * scale  # [B, K, G, T, T]
    scores = jnp.where(causal, scores.astype(jnp.float32), -jnp.inf)
    if len(keys) > 1:
        diagonal = jnp.stack(keys[1:])  # [i, B, T, K, Dh]
        own = jnp.einsum("btkgd,jbtkd->bkgtj", qg, diagonal) * scale  # [B, K, G, T, i]
        scores = jnp.concatenate([scores, own.astype(jnp.float32)], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs[..., :t], values[0])
    if len(keys) > 1:
        out = out + jnp.einsum("bkgtj,jbtkd->btkgd", probs[..., t:], jnp.stack(values[1:]))
    return out.reshape(b, t, h, dh)


def ttt_outputs(head, table, g: jax.Array, tokens: jax.Array, steps: int) -> list[jax.Array]:
    """The entries' outputs a of TTT steps 0..steps-1 (module docstring): one [B, T, D] array per step.

    table: the [V, D] embedding (`embedding_table`); g: [B, T, D] projected features (`head.project_features`);
    tokens: [B, T + steps], step i at index t reading the token at t+1+i (pad a row's tokens past its end)."""
    b, t = g.shape[:2]
    p = head.params()
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    scale = head.cfg.head_dim ** -0.5
    hidden, keys, values, outputs = g, [], [], []
    for i in range(steps):
        embeds = I.lookup(table, tokens[:, 1 + i: 1 + i + t], head.dtype)  # [B, T, D]
        q, k, v = head.attention_inputs(p, embeds, hidden, positions + i)
        keys.append(k)
        values.append(v)
        hidden = head.attention_outputs(p, hidden, ttt_attention(q, keys, values, scale))
        outputs.append(hidden)
    return outputs


def ttt_logits(head, table, features: jax.Array, tokens: jax.Array, steps: int) -> list[jax.Array]:
    """Draft-vocabulary logits [B, T, V'] of each TTT step, from the tapped features [B, T, 3 D_t] (in the head's
    layer order) and tokens [B, T + steps]: the computation tests/fixtures/eagle3.py `chained_logits` runs."""
    g = head.project_features(features)
    return [head.logits(a) for a in ttt_outputs(head, table, g, tokens, steps)]


def target_log_probs(head, target, hidden: jax.Array) -> jax.Array:
    """The target's next-token log-probabilities restricted to the head's draft vocabulary and renormalised:
    hidden [B, T, D] (its final-normed states) -> [B, T, V']; only the head's V' columns are computed."""
    columns = target.head_matrix()[:, head.vocab_ids[...]]  # [D, V']
    return jax.nn.log_softmax(target.logits(hidden.astype(jnp.float32), columns), axis=-1)


def _padded_tokens(tokens: jax.Array, steps: int) -> jax.Array:
    """[B, T] -> [B, T + steps + 1]: zeros after the row, so that every step's inputs and drafted tokens exist."""
    return jnp.pad(tokens, ((0, 0), (0, steps + 1)))


def ttt_loss(head, target, tokens: jax.Array, lengths: jax.Array, starts: jax.Array, features: jax.Array,
             hidden: jax.Array, steps: int, decay: float):
    """The decay-weighted mean KL over every (step, index) that counts (module docstring) -> (loss, metrics).

    tokens: [B, T]; lengths, starts: [B]; features: [B, T, 3 D_t] the target's taps at the head's layers, in its
    order; hidden: [B, T, D] the target's final-normed states. metrics: loss, the sum of the weights (`weight`, to
    pool batches), and per step the mean KL (`step_loss`, [steps]) and how often the head's argmax is the target's
    (`step_top1`, [steps]), each over the entries that count."""
    t = tokens.shape[1]
    padded = _padded_tokens(tokens, steps)  # [B, T + steps + 1]
    outputs = ttt_outputs(head, embedding_table(head, target), head.project_features(features), padded, steps)
    log_p_all = jnp.pad(target_log_probs(head, target, hidden), ((0, 0), (0, steps + 1), (0, 0)))
    in_vocab = jnp.zeros(head.cfg.vocab_size, bool).at[head.vocab_ids[...]].set(True)  # SpecForge's t2d
    index = jnp.arange(t)[None, :]  # [1, T]
    decoded = index + 1 >= starts[:, None]  # [B, T]: index t is the newest entry of the round at length t+2
    weights = step_weights(steps, decay)
    kl_sums, counts, agree_sums = [], [], []
    for i in range(steps):
        log_q = jax.nn.log_softmax(head.logits(outputs[i]), axis=-1)  # [B, T, V']
        log_p = log_p_all[:, 1 + i: 1 + i + t]  # p of the token at t+2+i, from the target's state at t+1+i
        drafted = padded[:, 2 + i: 2 + i + t]  # [B, T] the row's token at t+2+i
        mask = (decoded & (index + 2 + i < lengths[:, None]) & in_vocab[drafted]).astype(jnp.float32)
        kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)  # [B, T]
        agree = (jnp.argmax(log_q, axis=-1) == jnp.argmax(log_p, axis=-1)).astype(jnp.float32)
        kl_sums.append(jnp.sum(mask * kl))
        counts.append(jnp.sum(mask))
        agree_sums.append(jnp.sum(mask * agree))
    kl_sums, counts, agree_sums = jnp.stack(kl_sums), jnp.stack(counts), jnp.stack(agree_sums)  # [steps] each
    weight = jnp.sum(weights * counts)
    loss = jnp.sum(weights * kl_sums) / jnp.maximum(weight, 1e-9)
    seen = jnp.maximum(counts, 1.0)
    return loss, {"loss": loss, "weight": weight, "step_loss": kl_sums / seen, "step_top1": agree_sums / seen}


def ttt_drafts(head, target, tokens: jax.Array, features: jax.Array, steps: int) -> jax.Array:
    """The greedy drafts of every round, by TTT step and index: [B, steps, T] target token ids, step i at index t
    drafting the token at t+2+i (the draft-vocabulary argmax mapped to its target id, as greedy decoding takes it;
    the draft ids are sorted, so a tie goes to the smaller token id there as here)."""
    g = head.project_features(features)
    outputs = ttt_outputs(head, embedding_table(head, target), g, _padded_tokens(tokens, steps), steps)
    ids = head.vocab_ids[...]
    return jnp.stack([ids[jnp.argmax(head.logits(a), axis=-1)] for a in outputs], axis=1).astype(jnp.int32)


def replay_layout(drafts: np.ndarray) -> np.ndarray:
    """TTT drafts by step and index [N, K, T] -> the layout `losses.simulate_greedy_rounds` replays, [N, K, T]: its
    round at committed length L takes draft j from [j, L-1+j], which here is step j at index L-2. Positions no round
    of index >= 0 reaches hold -1, which matches no token (a text window's first round has no entry yet)."""
    n, k, t = drafts.shape
    out = np.full((n, k, t), -1, drafts.dtype)
    for j in range(k):
        out[:, j, j + 1:] = drafts[:, j, : t - 1 - j]
    return out
