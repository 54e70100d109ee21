"""The ideal (infinite-cache) hit rate of the prompts a replay actually sent.

In live mode (``kvtier.client.history``) the prompts depend on the model's replies, so the
workload's own ideal (``kvtier.workload.stats``) is not the ceiling of the run. Here every
successful chat request's messages are rebuilt from the records (``sent_messages``), rendered with
the tokenizer (the model's chat template with an ``HFTokenizer``) and replayed in send order
through the same hash-chained full-block set as ``workload_stats`` (``PrefixBlockSet``, at the
chunk granularity the store uses). Two ceilings:

* ``prompts``: an infinite cache of prompt KV only (what vLLM's prefix cache and a prompt-only
  connector can serve);
* ``with_replies``: it also keeps the KV of each reply (prompt + the reply's tokens, re-encoded
  from the streamed text), what a connector that saves generated tokens can serve at best. The
  re-encoding stands in for the generated ids; where the chat template re-tokenizes a reply
  differently the real chain breaks earlier, so this ceiling can only be optimistic.

Hit tokens over all prompt tokens of those requests (the server's own prompt count may differ by a
few template tokens; both rates are ratios of the client's tokenization). Side-effect free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from kvtier.client.stream import RequestRecord
from kvtier.client.history import sent_messages
from kvtier.workload.format import Conversation
from kvtier.workload.stats import PrefixBlockSet
from kvtier.workload.tokens import TokenCounter, render_chat_many


@dataclass(frozen=True)
class SentIdeal:
    requests: int
    prompt_tokens: int
    block_size: int
    hit_tokens_prompts: int
    hit_tokens_with_replies: int

    @property
    def prompts(self) -> float | None:
        return self.hit_tokens_prompts / self.prompt_tokens if self.prompt_tokens else None

    @property
    def with_replies(self) -> float | None:
        return self.hit_tokens_with_replies / self.prompt_tokens if self.prompt_tokens else None

    def to_dict(self) -> dict:
        return {**asdict(self), "ideal_hit_rate_prompts": self.prompts,
                "ideal_hit_rate_with_replies": self.with_replies}


def sent_ideal(convs: Sequence[Conversation], records: Sequence[RequestRecord], tokenizer: TokenCounter,
               block_size: int, counted: Sequence[RequestRecord] | None = None) -> SentIdeal:
    """Both ceilings (module docstring) over the successful chat requests of ``records`` (the whole
    run, in send order); only those in ``counted`` (default: all) add to the totals, as when a
    comparison is restricted to the requests every configuration served."""
    sent = [(r, m) for r, m in sent_messages(convs, records) if r.ok]
    keep = None if counted is None else {id(r) for r in counted}
    prompts = render_chat_many(tokenizer, [m for _, m in sent])
    only, both = PrefixBlockSet(block_size), PrefixBlockSet(block_size)
    n = total = hit_p = hit_r = 0
    for (rec, _), ids in zip(sent, prompts):
        hp, hr = only.lookup_and_insert(ids), both.lookup_and_insert(ids)
        if rec.reply:
            both.lookup_and_insert(list(ids) + tokenizer.encode(rec.reply))
        if keep is None or id(rec) in keep:
            n, total, hit_p, hit_r = n + 1, total + len(ids), hit_p + hp, hit_r + hr
    return SentIdeal(requests=n, prompt_tokens=total, block_size=block_size,
                     hit_tokens_prompts=hit_p, hit_tokens_with_replies=hit_r)
