"""LLMEngine: add requests, step the batch, hand back outputs."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Callable, Sequence


from tokenmill.attention.backend import new_backend
from tokenmill.config import EngineConfig, resolve_device, resolve_dtype
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import ModelOutput, Scheduler, SchedulerOutput
from tokenmill.model.loader import load_model
from tokenmill.outputs import RequestOutput
from tokenmill.runner import ModelRunner, in_prompt, kv_bytes_per_block
from tokenmill.sample import defaults as sampling_defaults
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.spec.proposer import AdaptiveDraft, StepCost, make_proposer, plan_drafts
from tokenmill.spec.stats import SpecStats
from tokenmill.structured.backend import GrammarMatcher, Grammars

logger = logging.getLogger("tokenmill")

PromptInput = str | Sequence[int]


class LLMEngine:
    """One model, one KV cache, one scheduler; step() runs one forward pass over the whole batch."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, None)
        self.tp = None  # the other tensor-parallel ranks, where the model is split (distributed/executor.py)
        try:
            self._start(config)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig) -> None:
        """Load the model (this rank's shard, the other ranks started, where it is split), size the KV cache,
        and build the scheduler and runner."""
        tensor_parallel = None
        if config.tensor_parallel_size > 1:
            if self.device.type != "cpu":
                raise ValueError("tensor_parallel_size > 1 runs on the CPU (ranks summing through shared memory on "
                                 "one host, gloo across hosts); on a GPU, run one rank")
            from tokenmill.distributed import launch
            from tokenmill.distributed.executor import TensorParallel

            # Started by torchrun: the launcher's ranks (the others never return from join); else ours.
            launched = launch.join(config) if launch.launched_world() else None
            self.tp = TensorParallel(config, launched)
            weakref.finalize(self, self.tp.close)
            tensor_parallel = (0, self.tp.world, self.tp.group)
        self.loaded = load_model(config.model, self.dtype, self.device, new_backend(self.device),
                                 max_positions=config.max_model_len, quantization=config.quantization,
                                 tensor_parallel=tensor_parallel)
        self.model = self.loaded.model
        if self.tp is not None:
            from tokenmill.distributed.executor import RankZeroModel

            self.model = RankZeroModel(self.model, self.tp)
        self.tokenizer = self.loaded.tokenizer
        mcfg = self.model.config
        self.vocab_size = mcfg.vocab_size
        self.eos_token_ids = self.loaded.eos_token_ids
        self.sampling_defaults = sampling_defaults.resolve(
            config.generation_config, self.loaded.generation_config, self.loaded.gguf_sampling,
            self.loaded.named_model, config.override_generation_config)
        logger.info("sampling defaults: %s", self.sampling_defaults.describe())

        context = mcfg.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > context:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context length {context}")
        bs = config.block_size
        per_block = kv_bytes_per_block(self.model, bs, self.dtype, config.kv_cache_dtype)
        if self.tp is not None:  # every rank holds as many blocks; the one with the most KV heads sizes them
            per_block = per_block * self.model.tp_shard.most_kv_heads // mcfg.num_kv_heads
        num_blocks = config.kv_cache_memory // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory {config.kv_cache_memory} bytes holds no block of {per_block} bytes")
        self.max_model_len = min(config.max_model_len or context, num_blocks * bs)
        if config.max_model_len and self.max_model_len < config.max_model_len:
            raise ValueError(f"the KV cache ({num_blocks * bs} tokens in {config.kv_cache_memory} bytes) cannot hold "
                             f"max_model_len {config.max_model_len}; raise kv_cache_memory or lower max_model_len")
        self.num_blocks = num_blocks
        if self.tp is not None:
            self.tp.start(num_blocks, self.max_model_len)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s); max_model_len %d",
                    num_blocks, bs, num_blocks * bs, num_blocks * per_block / 2**20,
                    str(self.dtype).removeprefix("torch.") if config.kv_cache_dtype == "auto" else
                    f"{config.kv_cache_dtype}, a scale per token and KV head", self.max_model_len)

        self.kv_manager = KVCacheManager(num_blocks, bs, config.enable_prefix_caching,
                                         getattr(self.model, "kv_recompute_length", None))
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.long_prefill_token_threshold)
        graphs = self.device.type == "cuda" and not config.enforce_eager
        if graphs and not getattr(self.model, "graph_capturable", True):
            logger.info("%s cannot record its decode step in a CUDA graph: decode steps run eagerly",
                        type(self.model).__name__)
            graphs = False
        self.runner = ModelRunner(self.model, num_blocks, bs, self.device, self.dtype, config.seed,
                                  decode_graphs=graphs,
                                  max_model_len=self.max_model_len, kv_cache_dtype=config.kv_cache_dtype)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._next_id = 0
        self.last_step = None  # the latest SchedulerOutput, for stats and tests
        self._interrupted = threading.Event()  # new work waits: no burst of decode steps now
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        spec = config.speculative_config
        self.spec_stats = SpecStats()
        # Query rows a decode step may hold with proposals in it. On the CPU, the fused decoder's team: one
        # parallel region, each weight read once, for all of them (past it a step goes product by product).
        # Within that, how many proposals pay is the step's measured cost by rows (plan_drafts): a request's
        # verify rows share its KV, so where attention over long contexts is much of a step, they cost far
        # less than its first row. Fewer rows than running decodes: no proposals at all.
        self.spec_rows = cpu_kernels.max_team_rows(moe=mcfg.moe is not None) if self.device.type == "cpu" else 256
        self.proposer = make_proposer(spec, self) if spec is not None else None
        self.step_cost = StepCost()  # what a decode step costs by its rows: how many proposals pay
        self._missed: list[Request] = []  # requests the last proposing found nothing for (_propose)
        self._proposing_s = 0.0  # how long the last proposing took (for the step that verifies it)
        # The last proposing made none because steps without them make more tokens a second (not to time them)
        self._withheld = False
        if spec is not None:
            logger.info("speculative decoding: %s", spec.describe())

    def shutdown(self) -> None:
        """Stops the other tensor-parallel ranks, where the model is split (the engine runs no step after)."""
        if self.tp is not None:
            self.tp.close()

    # ------------------------------------------------------------------ requests
    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the defaults in force for this model (sample/defaults.py)."""
        return self.sampling_defaults.params()

    @property
    def grammars(self) -> Grammars:
        """Compiles structured-output constraints for this model's tokenizer (built on first use). Its
        compile() may run on any thread; the server runs it before handing a request to the engine."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammars

    def encode(self, prompt: PromptInput) -> list[int]:
        """Token ids of a prompt; a list of ints is checked against the vocabulary."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            for t in ids:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                    raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {t!r}")
        if not ids:
            raise ValueError("the prompt is empty: it must hold at least one token")
        return ids

    def resolve_max_tokens(self, n_prompt: int, max_tokens: int | None) -> int:
        """max_tokens for a prompt of n_prompt tokens (None: the rest of the context), or a ValueError."""
        if max_tokens is None:
            max_tokens = self.max_model_len - n_prompt
        if n_prompt + max_tokens > self.max_model_len or max_tokens < 1:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n_prompt + max(max_tokens, 1)} tokens ({n_prompt} in the prompt, {max(max_tokens, 1)} for the "
                "completion). Please reduce the length of the prompt or the completion.")
        return max_tokens

    def add_request(self, request_id: str | None, prompt: PromptInput, params: SamplingParams | None = None,
                    arrival_time: float | None = None, prompt_token_ids: list[int] | None = None) -> str:
        """Validate and queue a request; returns its id. Raises ValueError before any work on bad input."""
        params = params or self.default_sampling_params()
        params.validate_for_vocab(self.vocab_size)
        ids = prompt_token_ids if prompt_token_ids is not None else self.encode(prompt)
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = self.resolve_max_tokens(len(ids), params.max_tokens)
        if params._eos_token_ids == ():
            params = params.clone(_eos_token_ids=self.eos_token_ids)
        compiled = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        now = arrival_time or time.time()
        children = [Request(request_id if params.n == 1 else f"{i}_{request_id}", ids, params, max_tokens,
                            parent_id=request_id, index=i, arrival_time=now,
                            grammar=GrammarMatcher(compiled) if compiled is not None else None)
                    for i in range(params.n)]
        self.output_processor.add(prompt if isinstance(prompt, str) else None, ids, children)
        for child in children:
            self.scheduler.add_request(child)
        return request_id

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Stop requests at any moment; their KV blocks are freed at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for rid in request_ids:
            children = self.output_processor.children_of(rid)
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            out = self.output_processor.abort(rid)
            if out is not None:
                outputs.append(out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the step
    def step(self, emit: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """Schedule, run one forward pass over the mixed batch, sample, and report what changed.

        A batch of decodes whose tokens a burst chooses (greedy ones; sampled ones under temperature,
        top-k/p and min-p alone) with nothing waiting may run up to config.num_scheduler_steps steps back
        to back (a burst) in one call of the fused CPU decoder; each step's tokens are then taken as a step
        of their own would take them. With `emit`, every step's outputs go to it in order and step()
        returns nothing: where a request is read as it goes, a burst takes and emits each step's tokens as
        soon as they are chosen, from inside the call (each streamed token must reach its client as soon
        as it is computed), and ends once every request has finished. Without it each request reports
        once, with all its new tokens."""
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        latest: dict[str, RequestOutput] = {}

        steps = self._burst_steps(sched, streaming=emit is not None)
        taken, results = False, None  # taken: each step already taken and emitted inside the burst
        if steps > 1:
            # Only where a request is read as it goes: a call into the engine's Python while the decoder's
            # other threads wait.
            taken = emit is not None and self.runner.whole_bursts and any(_read_as_it_goes(s.request)
                                                                          for s in sched.scheduled)
            on_step = (lambda result: self._emit_step(sched, result, emit)) if taken else self._until_lookup_finds()
            results = self.runner.execute_burst(sched, steps, self._interrupted.is_set, on_step)
        if results is None:
            taken = False
            results = [self.runner.execute(sched) if not sched.is_empty else ModelOutput()]
        for result in [] if taken else results[:-1] + results[-1].passes():
            outputs = self._take(sched, result)
            if emit is not None:
                emit(outputs)
            else:
                latest.update((out.request_id, out) for out in outputs)
        self.last_step = sched
        if self.proposer is not None:
            self._count_verified(sched, results[-1])
            decode_only = sched.scheduled and all(
                s.samples and s.num_new_tokens == 1 + len(s.spec_token_ids) for s in sched.scheduled)
            if decode_only:  # its tokens, over its time and that of the proposing that gave its proposals
                made = sum(1 + len(r.spec_sampled.get(s.request.request_id, ())) for r in results
                           for s in sched.scheduled if s.request.request_id in r.sampled)
                self.step_cost.record_yield(len(sched.scheduled), any(s.spec_token_ids for s in sched.scheduled),
                                            made, time.perf_counter() - start + self._proposing_s, len(results))
            proposing = time.perf_counter()
            self._propose()
            self._proposing_s = time.perf_counter() - proposing
            if decode_only:
                self.step_cost.record(sum(s.num_new_tokens for s in sched.scheduled),
                                      (time.perf_counter() - start) / len(results))
        return list(latest.values())

    # ------------------------------------------------------------------ speculation
    def _count_verified(self, sched: SchedulerOutput, result: ModelOutput) -> None:
        """Acceptance of the proposals this step verified: counters, each request's next proposal size,
        and the blocks that held only rejected proposals back to the pool."""
        for s in sched.scheduled:
            if not s.spec_token_ids:
                continue
            req, proposed = s.request, len(s.spec_token_ids)
            accepted = len(result.spec_sampled.get(req.request_id, ()))
            self.spec_stats.record(proposed, accepted)
            req.num_draft_tokens += proposed
            req.num_accepted_tokens += accepted
            req.spec_draft.update(proposed, accepted, req.num_output_tokens)
        self.scheduler.release_rejected(sched)

    def _propose(self) -> None:
        """Proposals for every running request that decodes next (its last token is all it owes), for the
        next step to verify. Requests under a grammar get none: the grammar already narrows their choice.
        Those that were to get some and got none (prompt lookup found nothing) are kept in _missed."""
        decoding = [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        room = self.spec_rows - len(decoding)
        for req in self.scheduler.running:
            req.spec_token_ids = []
        caps = []
        for req in decoding if room > 0 else ():
            if req.grammar is not None:
                continue
            if req.spec_draft is None:
                req.spec_draft = AdaptiveDraft(self.config.speculative_config.num_speculative_tokens)
            # Never past max_tokens or the context: the step keeps at most every proposal plus one.
            k = min(req.spec_draft.want(req.num_output_tokens), req.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens - 1, self._steps_before_recompute(req) - 1, room)
            caps.append((req, max(k, 0)))
        # Only where steps with proposals have given more tokens a second than steps without, at this many
        # decoding requests (StepCost.proposing_pays); then as many as the step's measured cost by rows says
        # pay, given each request's acceptance so far (every decoding request counts: its own token is a
        # row either way).
        decodes_alone = len(decoding) == len(self.scheduler.running) and not self.scheduler.num_waiting
        plain = bool(caps) and not self.step_cost.proposing_pays(len(decoding), decodes_alone)
        self._withheld = plain and self.step_cost.plain_is_better(len(decoding))
        if plain:
            ks = [0] * len(caps)
        else:
            ks = plan_drafts([r.spec_draft.acceptance for r, _ in caps], [k for _, k in caps],
                             self.step_cost.line(len(decoding)), others=len(decoding) - len(caps))
        wanted = []
        for (req, cap), k in zip(caps, ks):
            k = min(k, room)  # the step's room, oldest requests first: no proposal made only to be dropped
            room -= k
            if k > 0:
                wanted.append((req, k))
            elif cap > 0 and not plain:
                req.spec_draft.passed_over(req.num_output_tokens)
        # Called with none wanted too: a proposer with state of its own forgets finished requests there.
        self._missed = []
        for (req, k), drafts in zip(wanted, self.proposer.propose(wanted)):
            req.spec_token_ids = drafts[:k]
            if not drafts:
                self._missed.append(req)

    def _until_lookup_finds(self) -> Callable[[ModelOutput], bool] | None:
        """For a burst of plain steps (none of its requests got proposals): where prompt lookup found nothing
        for a request that was to get some (_missed), a hook that ends the burst after the first step whose
        tokens let it find some again, so that proposing resumes at the next step rather than up to
        num_scheduler_steps - 1 steps later. None where no request is waiting for a lookup to succeed."""
        finds = getattr(self.proposer, "finds", None)
        if finds is None or not self._missed or not self.runner.whole_bursts:
            return None
        grown = {req.request_id: req.all_token_ids for req in self._missed}  # a copy: tokens are added after

        def on_step(result: ModelOutput) -> bool:
            found = False
            for rid, tokens in grown.items():
                if rid in result.sampled:
                    tokens.append(result.sampled[rid])
                    found = found or finds(tokens)
            return found
        return on_step

    def _take(self, sched: SchedulerOutput, result: ModelOutput) -> list[RequestOutput]:
        """Apply one step's sampled tokens: stop rules, text, outputs. A request whose output cannot be
        made (its detokenization fails) ends alone with an error; the others go on."""
        changed = self.scheduler.update(sched, result)
        sched.num_generated += len(changed)
        outputs, stopped, failed = self.output_processor.process(changed)
        for rid, stop in stopped:
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_STOPPED, stop_reason=stop)
        for parent_id, error in failed:
            self.scheduler.finish_requests(self.output_processor.children_of(parent_id), RequestStatus.FINISHED_ERROR)
            outputs.append(self.output_processor.fail(parent_id, error))
        return outputs

    def _emit_step(self, sched: SchedulerOutput, result: ModelOutput, emit: Callable) -> bool:
        """One step of a burst, as it ends: its tokens taken and emitted. Returns whether every request of
        the burst has finished (a stop string, say), which ends the burst."""
        emit(self._take(sched, result))
        return all(s.request.is_finished for s in sched.scheduled)

    def _burst_steps(self, sched, streaming: bool) -> int:
        """How many decode steps this step may run back to back: 1 unless every scheduled request decodes
        past its prompt with tokens a burst chooses (runner.bursts_choose), nothing waits and, with
        `streaming` consumers, none streams where bursts cannot hand over each step (a tensor-parallel
        shard's) or where proposals are made (a streamed request then proposes at every step, which
        measured faster through the server than bursts where prompt lookup had nothing to propose), unless
        they were withheld because steps without them make more tokens a second (_propose); never
        past a request's max_tokens, the context length or the end of a pause in its proposals, and only as
        far as free KV blocks hold every request's tokens."""
        steps = self.config.num_scheduler_steps
        if (steps <= 1 or not self.runner.supports_bursts or sched.is_empty or self.scheduler.num_waiting
                or self._interrupted.is_set()):
            return 1
        for s in sched.scheduled:
            req = s.request
            if s.num_new_tokens != 1 or not s.samples or not self.runner.bursts_choose(req) or in_prompt(s) or (
                    streaming and (not self.runner.whole_bursts or self.proposer is not None and not self._withheld)
                    and _read_as_it_goes(req)):
                return 1
            steps = min(steps, req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens,
                        self._steps_before_recompute(req))
            if req.spec_draft is not None and req.spec_draft.paused_until > req.num_output_tokens:
                steps = min(steps, req.spec_draft.paused_until - req.num_output_tokens)  # proposing resumes there
        if steps > 1 and all(self.kv_manager.allocate_slots(s.request, steps) for s in sched.scheduled):
            return steps
        return 1

    def _steps_before_recompute(self, req) -> int:
        """Decode steps the request may take before its keys and values must be recomputed (the scheduler
        does that once it grows past the model's kv_recompute_length; a step cannot)."""
        limit = self.kv_manager.recompute_length
        if limit is None or req.num_tokens > limit:
            return self.max_model_len
        return limit + 1 - req.num_tokens

    def interrupt(self) -> None:
        """New work is waiting (any thread may call this): a running burst of decode steps ends after its
        current step, and none starts until clear_interrupt()."""
        self._interrupted.set()
        self.runner.interrupt()

    def clear_interrupt(self) -> None:
        self._interrupted.clear()

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        kv = self.kv_manager
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage_perc": kv.usage(),
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": kv.num_queried_tokens,
            "prefix_cache_hits": kv.num_hit_tokens,
            **(self.spec_stats.as_dict() if self.proposer is not None else {}),
            **self._one_thread_stats(),
        }

    def _one_thread_stats(self) -> dict:
        """The runners' counts of work sent to one thread by a taken core: the model's, and a draft model's
        added in (its passes are steps of this engine too)."""
        stats = self.runner.one_thread_stats()
        draft = getattr(self.proposer, "runner", None)
        for key, n in (draft.one_thread_stats() if draft is not None else {}).items():
            stats[key] = stats.get(key, 0) + n
        return stats

    def reset_prefix_cache(self) -> None:
        self.kv_manager.reset_prefix_cache()


def _read_as_it_goes(req) -> bool:
    """Whether the request's reader takes its outputs step by step (streamed), not only the final one."""
    return req.sampling_params.output_kind is not RequestOutputKind.FINAL_ONLY
