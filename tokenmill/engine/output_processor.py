"""Turns the scheduler's updated requests into RequestOutputs: text, stop strings, n > 1 fan-in."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput

logger = logging.getLogger("tokenmill")


@dataclass(slots=True)
class ParentState:
    """A user's request: its n child sequences and what has been shown of them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    metrics: RequestMetrics
    finished_reasons: dict[int, str] = field(default_factory=dict)
    stop_reasons: dict[int, object] = field(default_factory=dict)
    error: str | None = None  # why the request failed alone, if it did
    # logprob list key (a child's index, or "prompt") -> (that list, how many of its entries are decoded)
    decoded: dict[object, tuple[list, int]] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return len(self.finished_reasons) == len(self.children)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer  # transformers tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add(self, prompt: str | None, prompt_ids: list[int], children: list[Request]) -> None:
        parent_id = children[0].parent_id
        backend = self.tokenizer._tokenizer
        dets = [IncrementalDetokenizer(backend, prompt_ids, c.sampling_params) for c in children]
        self.parents[parent_id] = ParentState(parent_id, prompt, prompt_ids, children, dets,
                                              RequestMetrics(arrival_time=children[0].arrival_time))
        for c in children:
            self.child_to_parent[c.request_id] = parent_id

    def children_of(self, request_id: str) -> list[str]:
        state = self.parents.get(request_id)
        return [c.request_id for c in state.children] if state else []

    def process(self, changed: list[Request]) -> tuple[list[RequestOutput], list[tuple[str, str]], list[tuple[str, str]]]:
        """Detokenize new tokens; returns outputs of touched parents, (child id, stop string) to finish, and
        (parent id, error) of requests whose output could not be made (they fail alone)."""
        now = time.time()
        stopped: list[tuple[str, str]] = []
        failed: dict[str, str] = {}
        touched: dict[str, ParentState] = {}
        for req in changed:
            parent = self.parents.get(self.child_to_parent.get(req.request_id, ""))
            if parent is None or parent.request_id in failed:
                continue
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
                parent.metrics.first_scheduled_time = req.metrics.first_scheduled_time
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            try:
                stop = parent.detokenizers[req.index].add(req.output_token_ids[-1])
            except Exception as e:
                failed[parent.request_id] = _failure(parent, e)
                touched.pop(parent.request_id, None)
                continue
            if stop is not None:
                parent.finished_reasons[req.index] = "stop"
                parent.stop_reasons[req.index] = stop
                if not req.is_finished:
                    stopped.append((req.request_id, stop))
            elif req.is_finished:
                parent.finished_reasons[req.index] = req.finish_reason
                parent.stop_reasons[req.index] = req.stop_reason
            touched[parent.request_id] = parent
        outputs = []
        for p in touched.values():
            try:
                outputs.append(self._output(p, now))
            except Exception as e:
                failed[p.request_id] = _failure(p, e)
        return outputs, stopped, list(failed.items())

    def abort(self, parent_id: str) -> RequestOutput | None:
        """Mark every unfinished child aborted and hand back the final output."""
        return self._finish(parent_id, RequestStatus.FINISHED_ABORTED.value)

    def fail(self, parent_id: str, error: str) -> RequestOutput | None:
        """End a request that failed alone: its final output carries the error."""
        parent = self.parents.get(parent_id)
        if parent is None:
            return None
        parent.error = error
        return self._finish(parent_id, RequestStatus.FINISHED_ERROR.value)

    def _finish(self, parent_id: str, reason: str) -> RequestOutput | None:
        parent = self.parents.get(parent_id)
        if parent is None:
            return None
        for c in parent.children:
            parent.finished_reasons.setdefault(c.index, reason)
        return self._output(parent, time.time())

    def _output(self, p: ParentState, now: float) -> RequestOutput:
        completions = []
        for c, det in zip(p.children, p.detokenizers):
            reason = p.finished_reasons.get(c.index)
            lps = None
            if c.sampling_params.logprobs is not None and p.error is None:
                lps = self._decoded(p, c.index, c.logprobs)
            completions.append(CompletionOutput(
                index=c.index, text=det.visible_text(reason is not None), token_ids=list(c.output_token_ids),
                cumulative_logprob=c.cumulative_logprob if c.sampling_params.logprobs is not None else None,
                logprobs=lps, finish_reason=reason, stop_reason=p.stop_reasons.get(c.index)))
        p.metrics.spec_num_draft_tokens = sum(c.num_draft_tokens for c in p.children)
        p.metrics.spec_num_accepted_tokens = sum(c.num_accepted_tokens for c in p.children)
        first = p.children[0]
        prompt_lps = None
        if first.sampling_params.prompt_logprobs is not None and p.error is None:
            prompt_lps = self._decoded(p, "prompt", first.prompt_logprobs)
        if p.finished:
            p.metrics.finished_time = now
            self._forget(p)
        return RequestOutput(
            request_id=p.request_id, prompt=p.prompt, prompt_token_ids=p.prompt_token_ids, outputs=completions,
            finished=p.finished, metrics=p.metrics, prompt_logprobs=prompt_lps,
            num_cached_tokens=max(0, first.num_cached_tokens), error=p.error)

    def _decoded(self, p: ParentState, key, lps: list) -> list:
        """A copy of lps (logprob dicts, or None for a position that has none) with every token's text
        decoded. Each output carries the whole list, so the entries decoded for an earlier output are not
        looked at again (the list only grows; a new list, as after a recompute, starts over)."""
        seen, done = p.decoded.get(key, (None, 0))
        if seen is not lps or done > len(lps):
            done = 0
        for d in lps[done:]:
            if d is not None:
                self._decode_logprobs(d)
        p.decoded[key] = (lps, len(lps))
        return list(lps)

    def _decode_logprobs(self, d: dict) -> dict:
        for tid, lp in d.items():
            if lp.decoded_token is None:
                lp.decoded_token = self.tokenizer.decode([tid])
        return d

    def _forget(self, p: ParentState) -> None:
        self.parents.pop(p.request_id, None)
        for c in p.children:
            self.child_to_parent.pop(c.request_id, None)


def _failure(parent: ParentState, e: Exception) -> str:
    logger.exception("request %s failed while its output was made", parent.request_id)
    return f"{type(e).__name__}: {e}"
