"""Speculative decoding: what to draft, how long, and whether to draft at all.

A verify step decodes the last sampled token and k drafted ones in one
batch, then samples from each output row in order with the sequence's own
sampler chain and keeps the drafted tokens for as long as the sampled token
equals the drafted one (`edgellm.engine.generate`). For a drafter that
proposes one token (a one-hot q), this is speculative sampling's accept rule
exactly: the drafted token x is accepted with probability p(x); otherwise
the token sampled is distributed as p with x removed and renormalised. So
the output follows the target's distribution, grammar and penalties
included (the chain sees the same tokens in the same order), at temperature 0
it is the argmax, and with a seed the random draws are the ones decoding
without a draft makes, one per output token.

On a CPU verifying is not free: a batch of k+1 tokens costs more than one
token (here pp2 is 1.7x, pp8 4.9x a single token's time on a 1.93B model),
so a draft pays only when it is long and right. `DraftPolicy` learns, per
sequence, how often a drafted token is accepted (by the length of the match
it extends: 2-3, 4-7, 8-15, 16+ tokens, or, from a draft model, by how
sure the draft model was of the token), and `VerifyCost` this machine's cost
of a step of n tokens against a single one (measured from the steps the loop
makes; llama-bench's figures as the prior). Each step drafts the k that
maximises expected tokens per unit of time, 1 + a1 + a1 a2 + ... over
cost(k+1) (+ k draft-model decodes), and none when no k beats a plain step;
a draft model's draft is cut token by token as it is made (`DraftJudge`).
An n-gram draft costs nothing to make, so each one is checked against the
tokens that follow as they come, verified or not (a shadow draft), for as
long as it keeps being right: the acceptance is learned while speculation is
off, so it turns itself back on when the text starts to repeat, and a copy
teaches its buckets token by token rather than by the few tokens its first
cautious drafts verify.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from edgellm.engine.ngram import NgramDrafter
from edgellm.errors import UsageError

log = logging.getLogger(__name__)

DRAFT_MODES = ("off", "ngram", "model")
DEFAULT_DRAFT_MAX = 48
# ggml's CPU flash attention takes a tiled path for this many query rows of one sequence in a
# ubatch or more (GGML_FA_TILE_Q) and sums fewer row by row, which rounds differently from a lone
# token; edgellm's runtimes move the tiled K-quant matmul's floor (8 rows in stock ggml) here too
# and make the repacked Q4_K kernels sum alike (engine.backends.keep_batch_invariant). A verify step is the last sampled token and k drafted
# ones, so k stays below this limit, and a step of several sequences below it in all, or the
# reply would not be the one decoding without drafts gives.
FA_TILE = 64
DRAFT_MAX_LIMIT = FA_TILE - 2
MATCH_BUCKETS = (2, 4, 8, 16)  # n-gram match lengths starting each bucket
MODEL_BUCKET = len(MATCH_BUCKETS)
# A draft model's tokens are priced by how sure the draft model was of each (its greedy token's
# probability), in buckets starting at these: where it hesitates the target often disagrees, so a
# draft stops there (`DraftJudge`). Buckets by place in the draft (first, second, ...) drafted 11-15
# tokens a step on the 1.93B Q8_0 with the 135M Q4_0, all lost when the first was one of the unsure
# ones (0 of 15 accepted after a 0.12; 14 of 14 after 0.59 then 0.95 and up).
MODEL_CONF = (0.0, 0.3, 0.5, 0.7, 0.9, 0.98)
# before evidence a bucket's acceptance is its middle probability, with the weight of two drafted tokens
_CONF_PRIOR = (0.15, 0.4, 0.6, 0.8, 0.94, 0.99)
# llama-bench pp-n vs tg on a 1.93B Q4_K_M, 2 threads (issue #26): step time of n tokens / one token's
_PRIOR = ((1, 1.0), (2, 1.72), (4, 2.81), (8, 4.87), (16, 5.79))
_DECAY = 0.85  # per resolved draft reaching a bucket: about the last 7 such drafts decide
# An n-gram bucket's acceptance leans on this many pseudo-tokens at a prior rate: one in two for the
# shortest matches, and for a longer one the next shorter bucket's acceptance (a copy that ran 7 tokens
# goes on about as often as one that ran 4). At one in two for every bucket, a copy's first drafts
# from matches of 8, 16 tokens were 1-2 tokens each, though every token before had been right. A fixed
# trust in longer matches (2/3, 3/4) drafted 52 tokens for 25 on an open-ended story (135M), 17 for 7
# without: borrowed, the trust is what the shorter matches of this text earned.
_PSEUDO = 2.0
_MARGIN = 1.03  # a draft must promise this much over a plain step


def _fresh_counts(hit: bool = True) -> list[float]:
    """Hits (or misses) before any evidence: none in the n-gram buckets (their prior is borrowed, `acceptance`);
    a draft model's buckets as _CONF_PRIOR."""
    return [0.0] * MODEL_BUCKET + [2 * (c if hit else 1.0 - c) for c in _CONF_PRIOR]


class DraftMismatch(UsageError):
    """The draft model cannot draft for the target: their vocabularies differ."""


def prior_ratio(n: int) -> float:
    if n <= 1:
        return 1.0
    for (n0, r0), (n1, r1) in zip(_PRIOR, _PRIOR[1:], strict=False):
        if n <= n1:
            return r0 + (r1 - r0) * (n - n0) / (n1 - n0)
    n_last, r_last = _PRIOR[-1]
    return r_last * n / n_last  # past the largest measured size, a constant tokens/s


@dataclass
class VerifyCost:
    """This machine's seconds for a decode step of n tokens, relative to a step of one."""

    t1: Optional[float] = None
    tn: dict[int, float] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)
    alpha: float = 0.2
    frozen: bool = False  # keep the figures given (tests, or a machine measured once) instead of learning

    def observe(self, n: int, seconds: float) -> None:
        if self.frozen:
            return
        if n <= 1:
            self.t1 = seconds if self.t1 is None else self.t1 + self.alpha * (seconds - self.t1)
        else:
            old = self.tn.get(n)
            seen = self.seen[n] = self.seen.get(n, 0) + 1
            if old is None:
                self.tn[n] = seconds
            elif seen <= 3:
                # the first steps of a size pay one-off costs (measured: a 1.93B Q8_0's first 5-token verify
                # 914 ms, later ones 472): kept in a running mean they priced that size out, and a size the
                # policy avoids is never measured again
                self.tn[n] = min(old, seconds)
            else:
                self.tn[n] = old + self.alpha * (seconds - old)

    def ratio(self, n: int) -> float:
        p = prior_ratio(n)
        if n <= 1 or self.t1 is None or not self.tn:
            return p
        if n in self.tn:
            return max(1.0, self.tn[n] / self.t1)
        below, above = [m for m in self.tn if m < n], [m for m in self.tn if m > n]
        if below and above:
            # between two measured sizes: the line between them. (Priced as the smaller one, the least a
            # step of n can cost, every size between 3 and 16 was tried once on a 135M: 14 wasted verifies.)
            lo, hi = max(below), min(above)
            return max(1.0, (self.tn[lo] + (self.tn[hi] - self.tn[lo]) * (n - lo) / (hi - lo)) / self.t1)
        # outside what was measured: the prior's shape, scaled by the nearest measured size
        m = min(self.tn, key=lambda x: abs(x - n))
        return max(1.0, p * (self.tn[m] / self.t1) / prior_ratio(m))


@dataclass
class DraftPolicy:
    """Acceptance per length of the match a drafted token extends (decayed counts), and the draft length that pays.

    A token drafted j places into a draft from an m-token match is right about
    as often as a match of m + j tokens predicts its next token: a copy that
    has run for 20 tokens is likely to go on whatever match started it. So the
    counts are kept per match length at each drafted position, not per draft,
    and the tokens of a long draft teach the long-match buckets, which is
    what lets a copy turn speculation on while it is still being copied.
    """

    cost: VerifyCost = field(default_factory=VerifyCost)
    draft_cost: float = 0.0  # a drafted token's cost in target single-token steps (a draft model's decode)
    hits: list[float] = field(default_factory=_fresh_counts)
    misses: list[float] = field(default_factory=lambda: _fresh_counts(False))

    @staticmethod
    def bucket(match_len: int) -> int:
        if match_len < 0:
            return MODEL_BUCKET
        b = 0
        for i, lo in enumerate(MATCH_BUCKETS):
            if match_len >= lo:
                b = i
        return b

    def acceptance(self, bucket: int) -> float:
        h, m = self.hits[bucket], self.misses[bucket]
        if bucket < MODEL_BUCKET:
            prior = self.acceptance(bucket - 1) if bucket else 0.5
            return (h + _PSEUDO * prior) / (h + m + _PSEUDO)
        return h / (h + m)

    @staticmethod
    def conf_bucket(conf: float) -> int:
        """The bucket of a draft model's token drafted with probability `conf`."""
        b = 0
        for i, lo in enumerate(MODEL_CONF):
            if conf >= lo:
                b = i
        return MODEL_BUCKET + b

    def position_bucket(self, match_len: int, j: int) -> int:
        """The bucket of the j-th drafted token (0-based) of a draft from a `match_len` match."""
        return self.bucket(match_len + j)

    def hit(self, match_len: int, j: int) -> None:
        self.hits[self.position_bucket(match_len, j)] += 1

    def resolve(self, match_len: int, at: int, rejected: bool) -> None:
        """End of a draft's evidence: a miss at position `at` if `rejected`; the buckets it reached age one draft."""
        self.resolve_buckets([self.position_bucket(match_len, j) for j in range(at + 1)], rejected)

    def record_buckets(self, buckets: Sequence[int], accepted: int, rejected: bool) -> None:
        """`record` for a draft whose tokens' buckets are given (a draft model's, by its certainty)."""
        for b in buckets[:accepted]:
            self.hits[b] += 1
        self.resolve_buckets(buckets[: accepted + 1 if rejected else max(accepted, 1)], rejected)

    def resolve_buckets(self, reached: Sequence[int], rejected: bool) -> None:
        if rejected:
            self.misses[reached[-1]] += 1
        for b in set(reached):
            self.hits[b] *= _DECAY
            self.misses[b] *= _DECAY

    def choose(self, match_len: int, available: int) -> int:
        """The k of at most `available` with the most expected tokens per unit of time, a plain step being 1
        (0: none beats a plain step by _MARGIN)."""
        if match_len < 0:  # a draft model, were every token one it is surest of: does drafting pay at all?
            return self._best([self.surest()] * available)
        return self._best([self.acceptance(self.position_bucket(match_len, j)) for j in range(available)])

    def surest(self) -> float:
        """The acceptance of a draft model's best certainty bucket."""
        return max(self.acceptance(b) for b in range(MODEL_BUCKET, len(self.hits)))

    def _best(self, acceptances: Sequence[float]) -> int:
        best_k, best = 0, _MARGIN
        expected, p = 1.0, 1.0
        for k, a in enumerate(acceptances, 1):
            p *= min(a, 0.999)
            expected += p
            g = expected / (self.cost.ratio(k + 1) + k * self.draft_cost)
            if g > best:
                best_k, best = k, g
        return best_k


class DraftJudge:
    """Decides, token by token as a draft model drafts, whether to go on, and where the draft is best cut.

    Each token's acceptance is its certainty bucket's; the draft's worth at j tokens is the
    expected tokens of a step, 1 + a1 + a1 a2 + ..., over its cost (verify of j + 1, j draft
    decodes). Drafting goes on while one more token, even a sure one, could raise that worth.
    """

    def __init__(self, policy: DraftPolicy) -> None:
        self.policy = policy
        self.sure = min(policy.surest(), 0.999)
        self.k = 0  # tokens judged so far
        self.expected, self.p = 1.0, 1.0
        self.best, self.best_k = _MARGIN, 0

    def __call__(self, conf: float) -> bool:
        """The next drafted token was drafted with probability `conf`: draft another?"""
        pol = self.policy
        self.k = k = self.k + 1
        self.p *= min(pol.acceptance(pol.conf_bucket(conf)), 0.999)
        self.expected += self.p
        g = self.expected / (pol.cost.ratio(k + 1) + k * pol.draft_cost)
        if g > self.best:
            self.best, self.best_k = g, k
        return (self.expected + self.p * self.sure) / (pol.cost.ratio(k + 2) + (k + 1) * pol.draft_cost) > self.best


@dataclass
class DraftCounters:
    """Drafted and accepted tokens, as llama-server counts them (per request and for /metrics)."""

    drafted: int = 0  # spec_decode_num_draft_tokens_total
    accepted: int = 0  # spec_decode_num_accepted_tokens_total
    steps: int = 0  # spec_decode_num_drafts_total: verification steps
    per_pos: list[int] = field(default_factory=list)  # accepted tokens per draft position

    def add(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1
        if len(self.per_pos) < accepted:
            self.per_pos.extend([0] * (accepted - len(self.per_pos)))
        for i in range(accepted):
            self.per_pos[i] += 1


class Speculator:
    """One sequence's drafter, policy and counters; the decode loop calls push/propose/verified/plain."""

    def __init__(
        self,
        drafter: Any,
        *,
        draft_max: int = DEFAULT_DRAFT_MAX,
        cost: Optional[VerifyCost] = None,
        probe_every: int = 24,
        prior: Optional[tuple[list[float], list[float]]] = None,
    ) -> None:
        self.drafter = drafter
        self.free = isinstance(drafter, NgramDrafter)  # drafting costs nothing: shadow drafts while off
        self.draft_max = max(0, min(int(draft_max), DRAFT_MAX_LIMIT))
        self.policy = DraftPolicy(cost=cost or VerifyCost())
        if prior is not None:  # what earlier sequences on this model learned, at half weight: this one soon decides
            self.policy.hits = [f + 0.5 * h for f, h in zip(_fresh_counts(), prior[0], strict=True)]
            self.policy.misses = [f + 0.5 * m for f, m in zip(_fresh_counts(), prior[1], strict=True)]
        self.counters = DraftCounters()
        self.shadow: Optional[list[Any]] = None  # [draft, matched so far, match length it was drafted from]
        self.match = 0  # the match length the draft being verified came from (-1: a draft model)
        self.probe_every = probe_every
        # a draft model asked for is tried after one plain step (it prices a step, which prices a drafted
        # token), not after probe_every of them; then as often as its acceptance says
        self._plain_steps = probe_every - 2
        self._draft_seconds = 0.0  # what making this step's draft took: not the verify's cost
        self.buckets: list[int] = []  # a draft model's draft: each token's certainty bucket

    def push(self, token: int) -> None:
        """A token the sequence now holds (sampled, or accepted from a draft)."""
        self.drafter.push(token)
        sh = self.shadow
        if sh is not None:
            d, i, m = sh
            if token == d[i]:
                # counted as it happens, so that a long right draft turns speculation on before it ends
                self.policy.hit(m, i)
                i += 1
                if i == len(d):
                    self.policy.resolve(m, i - 1, False)
                    self.shadow = None
                else:
                    sh[1] = i
            else:
                self.policy.resolve(m, i, True)
                self.shadow = None

    def propose(self, room: int) -> list[int]:
        """The tokens to verify in the next step ([]: a plain step)."""
        kmax = min(self.draft_max, room)
        if kmax <= 0:
            return []
        if self.free:
            d, m = self.drafter.draft(kmax)
            if not d:
                return []
            self._follow(d, m)
            k = self.policy.choose(m, len(d))
            if k == 0:
                return []
            self.match = m
            return d[:k]
        k = self.policy.choose(-1, kmax) if self.policy.cost.t1 else 0
        if k == 0:
            self._plain_steps += 1
            if self._plain_steps < self.probe_every:
                return []
        # a draft model's drafts are not free: while they do not pay, probe now and then instead of
        # shadowing; the first draft is a probe too (a drafted token's cost is not known before it)
        probe = k == 0 or not self.policy.draft_cost
        self._plain_steps = 0
        judge = DraftJudge(self.policy)
        t = time.perf_counter()
        d, _ = self.drafter.draft(min(3, kmax) if probe else kmax, judge=None if probe else judge)
        self._draft_seconds = time.perf_counter() - t
        if not probe:
            d = d[: judge.best_k]  # past its best cut the tokens were drafted only to see that they do not pay
        self.buckets = [self.policy.conf_bucket(c) for c in self.drafter.conf[: len(d)]]
        if self.drafter.decode_seconds and self.policy.cost.t1:
            # a drafted token costs one draft decode (the catch-up on the last accepted ones, or the next
            # token's); a probe's catch-up on every token made while not drafting is a one-off after plain
            # steps: billed per drafted token it priced them at 4x and kept the draft model switched off
            self.policy.draft_cost = self.drafter.decode_seconds / self.policy.cost.t1
        self.match = -1
        return d

    def _follow(self, d: list[int], m: int) -> None:
        """Make the n-gram draft `d` the shadow, unless the running shadow already predicts it."""
        sh = self.shadow
        if sh is not None:
            sd, i, sm = sh
            n = min(len(d), len(sd) - i)
            if sd[i : i + n] == d[:n]:
                if len(d) > n:  # the same copy, seen further ahead: what was counted stays counted
                    self.shadow = [d, 0, m]
                return
            if i:  # the drafter now follows another match: this one ends unrefuted
                self.policy.resolve(sm, i - 1, False)
        self.shadow = [d, 0, m]

    def verified(self, drafted: int, accepted: int, rejected: bool, seconds: float) -> None:
        self.counters.add(drafted, accepted)
        # an n-gram draft's tokens are counted by the shadow that follows it (push); a draft model's by certainty
        if self.match < 0 and len(self.buckets) == drafted:
            self.policy.record_buckets(self.buckets, accepted, rejected)
        # the step's seconds began before the draft was made; a draft model's part is in draft_cost already
        self.policy.cost.observe(drafted + 1, max(seconds - self._draft_seconds, 1e-6))
        self._draft_seconds = 0.0

    def plain(self, seconds: float) -> None:
        # a draft judged not worth verifying was made in this step's time
        self.policy.cost.observe(1, max(seconds - self._draft_seconds, 1e-6))
        self._draft_seconds = 0.0


__all__ = [
    "Speculator",
    "DraftPolicy",
    "VerifyCost",
    "DraftCounters",
    "DraftJudge",
    "NgramDrafter",
    "DraftMismatch",
    "DRAFT_MODES",
    "DEFAULT_DRAFT_MAX",
    "DRAFT_MAX_LIMIT",
    "FA_TILE",
    "prior_ratio",
]
