"""Capacity buckets: the static step shapes engines are built for, and how a step picks one.

verify   batch capacities B: powers of two below the largest batch, then the largest itself
         (28 → 1, 2, 4, 8, 16, 28). A verify engine of capacity B runs B × (K+1) query rows.
prefill  token capacities T: powers of two up to the step token budget, then the budget itself.
encoder  vision encoder patch capacities P (optional, a model with a vision tower): one encoder
         call runs up to P patches of one or several whole images (patches = pixels / 14²
         before the 2×2 merge), padded to the smallest capacity that holds them.

A step with n live requests uses the smallest verify capacity >= n and pads (3 live → 4); more
than the largest is an error the scheduler must avoid by splitting or queueing, never a silent
truncation. Prefill differs: an exported prefill graph runs exactly T tokens of one sequence
and cannot pad (KDA's recurrence would advance over the padding, see graph_io.py), so a chunk of n
tokens runs as the exact sum of capacities ``split_prefill`` returns (greedy, largest first;
exact because 1 is always a prefill capacity).

``Capacities`` is what the builder writes into the engine dir (``capacities`` in config.json);
its constructor is where every capacity list is checked (``validate``), and ``within`` gives the
subset a run may use under its engine options (max_batch, max_num_tokens, spec_tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

MAX_CAPACITY = 1 << 20     # a sanity bound: beyond it a typo is likelier than a real plan


class CapacityError(ValueError):
    """An invalid capacity list, or a step no capacity covers; the message says which."""


def power_of_two_capacities(largest: int, smallest: int = 1) -> tuple[int, ...]:
    """Powers of two from `smallest` below `largest`, then `largest` (28 → 1, 2, 4, 8, 16, 28)."""
    if not isinstance(largest, int) or largest < 1:
        raise CapacityError(f"the largest capacity must be a positive integer, got {largest!r}")
    if smallest < 1 or smallest & (smallest - 1):
        raise CapacityError(f"the smallest capacity must be a power of two, got {smallest}")
    caps, c = [], smallest
    while c < largest:
        caps.append(c)
        c *= 2
    return tuple(caps) + (largest,)


def validate(caps: Iterable[Any], what: str) -> tuple[int, ...]:
    """`caps` as a tuple, or a CapacityError naming what is wrong with it."""
    caps = tuple(caps)
    if not caps:
        raise CapacityError(f"{what} capacities: the list is empty")
    bad = [c for c in caps if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= MAX_CAPACITY]
    if bad:
        raise CapacityError(f"{what} capacities: {bad} are not integers in 1..{MAX_CAPACITY}")
    if list(caps) != sorted(set(caps)):
        raise CapacityError(f"{what} capacities {list(caps)} must be distinct and ascending")
    return caps


def parse_capacity_list(text: str, what: str = "verify") -> tuple[int, ...]:
    """'1,2,4,8' (the CLI's --capacities) → (1, 2, 4, 8)."""
    try:
        caps = [int(p) for p in text.replace(" ", "").split(",") if p]
    except ValueError:
        raise CapacityError(f"{what} capacities {text!r}: expected comma-separated integers like 1,2,4,8") from None
    return validate(caps, what)


def _upto(caps: tuple[int, ...], limit: int | None, option: str) -> tuple[int, ...]:
    out = tuple(c for c in caps if limit is None or c <= limit)
    if not out:
        raise CapacityError(f"engine option {option}={limit} is below the smallest built capacity {caps[0]}")
    return out


def pick(caps: Iterable[int], live: int, what: str = "verify") -> int:
    """The smallest capacity covering `live` (> 0); more than the largest is an error."""
    caps = tuple(caps)
    if live < 1:
        raise CapacityError(f"{what}: a step needs at least one live entry, got {live}")
    for c in caps:
        if c >= live:
            return c
    raise CapacityError(f"{what}: {live} live entries exceed the largest capacity {caps[-1] if caps else 0}; "
                        "split the step or queue the rest (never truncate)")


def split_prefill(caps: Iterable[int], tokens: int) -> tuple[int, ...]:
    """Capacities whose sum is exactly `tokens`, largest first."""
    caps = sorted(caps, reverse=True)
    if tokens < 1:
        raise CapacityError(f"prefill: a chunk needs at least one token, got {tokens}")
    out, left = [], tokens
    for c in caps:
        while left >= c:
            out.append(c)
            left -= c
    if left:
        raise CapacityError(f"prefill: {tokens} tokens are not a sum of the capacities {sorted(caps)} "
                            "(the smallest prefill capacity must be 1)")
    return tuple(out)


@dataclass(frozen=True)
class Capacities:
    verify: tuple[int, ...]          # batch capacities (requests)
    prefill: tuple[int, ...]         # token capacities (one sequence each)
    spec_tokens: int = 3             # K: each verify request runs K + 1 rows
    encoder: tuple[int, ...] = ()    # vision encoder patch capacities; () without encoder graphs

    def __post_init__(self) -> None:
        object.__setattr__(self, "verify", validate(self.verify, "verify"))
        object.__setattr__(self, "prefill", validate(self.prefill, "prefill"))
        if self.encoder:
            object.__setattr__(self, "encoder", validate(self.encoder, "encoder"))
        if not isinstance(self.spec_tokens, int) or not 0 <= self.spec_tokens <= 7:
            raise CapacityError(f"spec_tokens must be an integer in 0..7, got {self.spec_tokens!r}")
        if self.prefill[0] != 1:
            raise CapacityError(f"prefill capacities {list(self.prefill)} must start at 1 so that every chunk "
                                "length is an exact sum of them")

    @classmethod
    def plan(cls, *, max_batch: int, max_num_tokens: int, spec_tokens: int = 3,
             verify: Iterable[int] | None = None) -> "Capacities":
        """The default plan: power-of-two verify capacities up to max_batch (or the given list)
        and power-of-two prefill capacities up to max_num_tokens; the largest verify step's rows
        must fit the token budget."""
        caps = cls(tuple(verify) if verify is not None else power_of_two_capacities(max_batch),
                   power_of_two_capacities(max_num_tokens), spec_tokens)
        caps.check_budget(max_num_tokens)
        return caps

    def within(self, *, max_batch: int | None = None, max_num_tokens: int | None = None,
               spec_tokens: int | None = None) -> "Capacities":
        """The capacities a run uses under its engine options (None: as built): the verify
        capacities up to `max_batch`, the prefill capacities up to `max_num_tokens`, K =
        `spec_tokens`; an option below the smallest built capacity, or a verify step whose rows
        exceed `max_num_tokens`, is a CapacityError naming the option."""
        caps = Capacities(_upto(self.verify, max_batch, "max_batch"),
                          _upto(self.prefill, max_num_tokens, "max_num_tokens"),
                          self.spec_tokens if spec_tokens is None else spec_tokens, self.encoder)
        if max_num_tokens is not None:
            caps.check_budget(max_num_tokens)
        return caps

    def check_budget(self, max_num_tokens: int) -> None:
        """The largest verify step's rows must fit the step's token budget."""
        rows = self.verify_rows(self.verify[-1])
        if rows > max_num_tokens:
            raise CapacityError(f"the largest verify capacity {self.verify[-1]} runs {rows} rows "
                                f"({self.rows_per_request} per request), more than max_num_tokens "
                                f"({max_num_tokens}); raise max_num_tokens or lower the capacities "
                                "(max_batch) or spec_tokens")

    @property
    def rows_per_request(self) -> int:
        return self.spec_tokens + 1

    def verify_rows(self, capacity: int) -> int:
        return capacity * self.rows_per_request

    def pick_verify(self, live_requests: int) -> int:
        return pick(self.verify, live_requests, "verify")

    def split_prefill(self, tokens: int) -> tuple[int, ...]:
        return split_prefill(self.prefill, tokens)

    def pick_encoder(self, patches: int) -> int:
        """The smallest encoder capacity holding `patches` (a CapacityError past the largest)."""
        if not self.encoder:
            raise CapacityError("this engine has no vision encoder capacities; build it with --encoder-capacities")
        return pick(self.encoder, patches, "encoder")

    def to_dict(self) -> dict[str, Any]:
        out = {"verify": list(self.verify), "prefill": list(self.prefill), "spec_tokens": self.spec_tokens}
        if self.encoder:
            out["encoder"] = list(self.encoder)
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Capacities":
        if not isinstance(raw, Mapping) or "verify" not in raw or "prefill" not in raw:
            raise CapacityError(f"capacities must be an object with 'verify' and 'prefill' lists, got {raw!r}")
        return cls(tuple(raw["verify"]), tuple(raw["prefill"]), raw.get("spec_tokens", 3), tuple(raw.get("encoder", ())))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Capacities":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise CapacityError(f"capacities JSON is not valid ({e})") from None
        return cls.from_dict(raw)
