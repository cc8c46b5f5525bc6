"""Scheduler: each step, which requests run and how many of their tokens catch up.

There is no prefill or decode phase: a request owes num_tokens - num_computed_tokens tokens, and each
step pays some of that debt within a token budget. A whole prompt, a chunk of one, a prefix-cache hit
and a single decode token are all the same rule.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus

logger = logging.getLogger("tokenmill")


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # the speculative tokens included
    # True when this step brings the request level with its tokens, so a new token is sampled.
    samples: bool
    # Proposed tokens verified in this step, after the request's last token: each of the num_new_tokens
    # gets logits, and the target's choices decide how many of them the request keeps.
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    num_generated: int = 0  # tokens the step appended (more than one per request in a burst)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelOutput:
    """The runner's answer: per scheduled request that samples, its new token and logprobs."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict] = field(default_factory=dict)  # request_id -> {token_id: Logprob}
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
    # A request that verified speculative tokens: the tokens after its first (the accepted proposals,
    # then the target's own choice), and their logprobs.
    spec_sampled: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[dict]] = field(default_factory=dict)
    # True for the outputs passes() makes after the first: their requests each gain one more token.
    spec_pass: bool = False

    def passes(self) -> list["ModelOutput"]:
        """This output as a sequence of one-token-per-request outputs, applied in order as the steps of a
        burst are: the first token of every request, then each verifying request's later tokens."""
        out = [self]
        for j in range(max(map(len, self.spec_sampled.values()), default=0)):
            p = ModelOutput(spec_pass=True)
            for rid, tokens in self.spec_sampled.items():
                if j < len(tokens):
                    p.sampled[rid] = tokens[j]
                    if rid in self.spec_logprobs:
                        p.logprobs[rid] = self.spec_logprobs[rid][j]
            out.append(p)
        return out


class Scheduler:
    """Owns request state: the waiting queue, the running list and their KV blocks."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 long_prefill_token_threshold: int = 0) -> None:
        self.kv = kv
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ------------------------------------------------------------------ admission
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        self.kv.drop_unwritten()  # blocks of a step that raised before update() never got their KV
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.time()

        # Running requests first. Every decode gets its token before any prompt chunk takes the budget, so
        # a long prompt never starves the decodes behind it; oldest first within each kind. When blocks
        # run out, the newest request not yet scheduled in this step is preempted.
        scheduled: set[str] = set()
        decoding = False
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            owed = req.num_tokens - req.num_computed_tokens
            num_new = self._chunk(owed, budget, decoding)
            decoding = decoding or num_new == 1
            # A decode's proposed tokens ride along where the budget and free blocks allow; they never
            # cost another request its place.
            drafts = req.spec_token_ids[:budget - 1] if owed == 1 else []
            if drafts and self.kv.allocate_slots(req, 1 + len(drafts)):
                out.scheduled.append(self._scheduled(req, 1 + len(drafts), drafts))
                scheduled.add(req.request_id)
                budget -= 1 + len(drafts)
                continue
            while not self.kv.allocate_slots(req, num_new):
                victim = next((r for r in reversed(self.running) if r is not req and r.request_id not in scheduled),
                              req)
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break
            out.scheduled.append(self._scheduled(req, num_new))
            scheduled.add(req.request_id)
            budget -= num_new

        # Then waiting requests, first come first served, while budget, seats and blocks last.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            computed = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else []
            num_cached = len(computed) * self.kv.block_size
            num_new = self._chunk(req.num_tokens - req.num_computed_tokens - num_cached, budget, decoding)
            if not self.kv.allocate_slots(req, num_new, computed):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, num_new))
            budget -= num_new

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _chunk(self, owed: int, budget: int, decoding: bool) -> int:
        """How many of a request's owed tokens this step computes: within the budget, and while requests
        decode in this step, a prompt chunk no longer than long_prefill_token_threshold."""
        num_new = min(owed, budget)
        if decoding and self.long_prefill_token_threshold and num_new > 1:
            num_new = min(num_new, self.long_prefill_token_threshold)
        return num_new

    def _scheduled(self, req: Request, num_new: int, drafts: list[int] | None = None) -> ScheduledRequest:
        drafts = drafts or []
        return ScheduledRequest(req, num_new, req.num_computed_tokens + num_new - len(drafts) == req.num_tokens,
                                drafts)

    def _preempt(self, req: Request) -> None:
        """Free the request's blocks and send it back to the front of the queue to be recomputed."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.prompt_logprobs = []  # the recompute hands them over again
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ update
    def update(self, sched: SchedulerOutput, model_out: ModelOutput) -> list[Request]:
        """Advance computed tokens, append sampled tokens, apply stop rules; returns requests with news.

        A pass after the first (model_out.spec_pass) holds the next accepted token of some verifying
        requests: each of them has one more computed token (the proposal accepted before it)."""
        changed = []
        for s in sched.scheduled:
            req = s.request
            if req.is_finished:  # aborted while the step ran, or stopped at an earlier pass
                continue
            before = req.num_computed_tokens
            if model_out.spec_pass:
                if req.request_id not in model_out.sampled:
                    continue
                req.num_computed_tokens += 1
            else:
                req.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids)
            self.kv.cache_computed_blocks(req, before)
            # A request recomputed after it grew past the model's kv_recompute_length has its prompt's already.
            if req.request_id in model_out.prompt_logprobs and len(req.prompt_logprobs) < req.num_prompt_tokens:
                req.prompt_logprobs.extend(model_out.prompt_logprobs[req.request_id])
            if not s.samples:
                continue
            token = model_out.sampled[req.request_id]
            req.output_token_ids.append(token)
            if req.request_id in model_out.logprobs:
                lp = model_out.logprobs[req.request_id]
                req.logprobs.append(lp)
                req.cumulative_logprob += lp[token].logprob
            if req.grammar is not None:
                self._advance_grammar(req, token)
            if not req.is_finished:
                self._check_stop(req, token)
            changed.append(req)
            if req.is_finished:
                self._free(req)
            elif self.kv.recompute_length is not None and req.num_tokens == self.kv.recompute_length + 1:
                self._recompute(req)
        return changed

    def _recompute(self, req: Request) -> None:
        """The request just grew past the model's kv_recompute_length, so its keys and values are computed
        again, as the longer sequence it now is (the engine keeps its steps from going past that length
        before this): its blocks are freed, and it goes to the front of the queue, where it may find blocks
        of sequences of its kind in the prefix cache."""
        self.kv.free(req)
        req.block_hashes = []
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    def _advance_grammar(self, req: Request, token: int) -> None:
        """Move the request's grammar past the token; a grammar that has reached its end (it accepted a
        stop token) ends the request, ignore_eos or not."""
        if not req.grammar.accept(token):  # the mask allowed it, so this is a bug: end it, do not loop
            logger.error("request %s: token %d does not fit its grammar; ending it", req.request_id, token)
            req.status = RequestStatus.FINISHED_STOPPED
        elif req.grammar.is_terminated:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = None

    def _check_stop(self, req: Request, token: int) -> None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in sp._eos_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = None
                return
            if token in sp.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
                return
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH

    def release_rejected(self, sched: SchedulerOutput) -> None:
        """After a step's passes: blocks that hold only rejected proposals of a verifying request go back
        to the pool (their slots were written, but no accepted token lies in them)."""
        for s in sched.scheduled:
            if s.spec_token_ids and not s.request.is_finished:
                self.kv.trim(s.request, s.request.num_computed_tokens)

    # ------------------------------------------------------------------ finishing
    def finish_requests(self, request_ids, status: RequestStatus, stop_reason=None) -> list[Request]:
        """End requests from outside (abort, or a stop string found by the detokenizer)."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            if stop_reason is not None:
                req.stop_reason = stop_reason
            self._free(req)
            done.append(req)
        return done

    def _free(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        self.kv.free(req)
        req.metrics.finished_time = time.time()
        self.requests.pop(req.request_id, None)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
