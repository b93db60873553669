"""The ``routing`` section of the gateway's configuration (``schema.GatewayConfig.routing``): how a
request's replica is chosen, with the source of each default next to its field. Apart from
``schema.py`` so that each reads in one sitting; ``config/reference.py`` documents both.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefix_router.constants import CHAR_BLOCK_SIZE

__all__ = ["RoutingConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RoutingConfig:
    """How a request's replica is chosen."""

    # prefix affinity is the gateway's purpose; the other two are baselines to compare against
    policy: str = "prefix-affinity"
    # ring points per replica (times its weight): 160 as libketama and uhashring use, and the
    # ~150-160 of SGLang's and vLLM's routers; keeps each replica's key share within ~10%
    virtual_nodes: int = 160
    # tokens per block when replicas don't report theirs; None lets the gateway apply vLLM's
    # GPU default of 16
    block_size: int | None = None
    # characters per block without a tokenizer: 64 chars ~ 16 tokens of English, as llm-d uses
    char_block_size: int = CHAR_BLOCK_SIZE
    # a block followed by at least this many different next blocks is a shared prefix (say a
    # common system prompt) and the routing key extends past it; 4 tolerates a few variants
    # of one conversation (edits, retries) before calling a block shared
    branch_threshold: int = 4
    # deepest routing key in blocks: 512 x 16 = 8K tokens, past any shared system prompt
    max_key_blocks: int = 512
    # the load bound: a replica may take a request while its load after it is at most
    # ceil(max(load_factor x mean, mean + load_slack)), the mean counting the new request
    # (consistent hashing with bounded loads; KubeAI's CHWBL uses 1.25). Lower spreads more and
    # caches less (docs/routing-rule.md, step 2)
    load_factor: float = 1.25
    # requests over the mean any replica may carry whatever the factor: at low load the factor
    # alone turns a second request for a document away from the one replica holding it while
    # the rest of the fleet idles (vLLM batches both; nothing queues)
    load_slack: int = 1
    # the same bound (load_factor, load_slack) also holds each replica's share of the requests
    # sent lately, each counting 1 when sent and half as much every this many seconds: with
    # requests one at a time nothing is ever in flight, and without it every new conversation
    # would follow a shared system prompt to the one replica that computed it first
    share_half_life_s: float = 60.0
    # a replica holding a cold prefix of the prompt (one its holders can serve at their fair
    # share: PrefixDemand) keeps the request up to looser bounds, in flight and in share, with
    # holder_slack in place of load_slack: moving it would recompute the prefix to relieve a
    # load that replicating it cannot cure. Both factors at load_factor and holder_slack at
    # load_slack turn it off. 1.5 in share keeps the busiest replica near its share where higher
    # factors gained little reuse; a slack of 4 lets a holder batch the few questions a
    # nearly idle fleet sends about one document (docs/routing-rule.md, step 2)
    holder_load_factor: float = 2.0
    holder_share_factor: float = 1.5
    holder_slack: int = 4
    # a prompt whose longest cached prefix anywhere is under this share of it is mostly new
    # work: it goes to the replica within the bounds with the least prompt queued for prefill
    # (then load, then fewest blocks: prefix_router/routing/policy.py, step 3), not to the one holding that
    # small prefix, which would draw every new conversation sharing a hot base onto one replica
    # (sglang-router's and vllm-router's cache_threshold, 0.5). It reads this instance's picture:
    # several instances without KV events may want 0, which turns it off (docs/routing-rule.md,
    # step 3)
    match_threshold: float = 0.5
    # the holder's queue: the replica chosen for holding most of the prompt is passed over where
    # one within the in-flight bound holding less scores less, the score being uncached blocks +
    # this x blocks queued for prefill (a queued block counts a tenth of a block to compute at
    # 0.1), and the least score takes it (prefix_router/routing/policy.py, step 5). Low, since each move
    # recomputes a prefix: higher weights gave up reuse where 0.1 kept it (measured at 256
    # replicas). Blocks are the gateway's, the queue this instance's own requests. 0 turns it
    # off (docs/routing-rule.md, step 5)
    prefill_queue_weight: float = 0.1
    # a prompt block in a replica's CPU or storage tier (prefix_router/cache/offload.py) against one on its
    # GPU; both 0: routed by GPU blocks, tier hits still predicted. 0 by default: valued at 0.5-0.9 it cost
    # coding agents capacity (bench/results/fleetsim-tiers/; Dynamo uses 0.75 and 0.25)
    cpu_hit_weight: float = 0.0
    storage_hit_weight: float = 0.0
    # this gateway is the only router in front of these replicas (one instance, workers 1): a
    # prompt nobody holds any of is new work too, placed by this instance's picture (least
    # prompt queued for prefill, then load, then blocks), not by the ring. Several instances, or
    # workers above 1, keep it on the ring, where every instance puts it at once, KV events or
    # not: an engine publishes a prefix only once it has computed it, and until then every
    # instance would see the same replica holding the fewest blocks (four instances with events
    # computed 16 documents 21 times a run on SGLang's shape; docs/routing-rule.md, step 3)
    sole_router: bool = True
    # request header whose value keys a session to a replica (multi-turn chats stay together)
    session_header: str = "X-Session-ID"
    # use the OpenAI ``user`` field as a session key when no session header is present
    use_user_field: bool = True
    # without a session key, key a chat by its opening (tools and messages through the first
    # user message) rather than by learned branch points: every turn, and every gateway
    # instance, then agrees from the first request (docs/design.md, "Several gateway instances")
    chat_opening_key: bool = True
