"""One engine of the serving event simulation (`dse.serving.events`): its queue, its KV cache and its scheduler,
iteration by iteration as vLLM schedules.

Speed: a request of 1000 output tokens lives through 1000 iterations, so stepping every sequence every iteration
would cost 10^7 Python steps for 10,000 requests; nothing here costs a step per sequence per iteration. Every
decoding sequence of an engine gains the same `tokens_per_decode` tokens per iteration, so a sequence is described by
its state when it started decoding (engine step s0, tokens generated g0): at engine step s it has
g0 + (s - s0) * gain. The steps at which it finishes and at which its context crosses into a new KV block are known
in advance and kept in calendars (dicts from step to sequences; each engine visits its steps in order), and the sum
of the decoding contexts is a running total. An iteration costs the sequences that finish or need a block in it, not
the whole batch.

An engine's `Engine.role` decides where a request's life on it starts and ends: "both" prefills and decodes it;
"prefill" lets it go when its prompt is done (its KV cache moves to a decode engine); "decode" receives it with its
prompt's KV cache in place (`Flow.done` == `Flow.target` while it waits) and admits it straight into decoding.
"""

import math
from collections import deque

from dse.serving.shapes import Engine, IterationShape, chunk_pairs

EPS = 1e-9
"""Slack on float comparisons of generated-token counts (fractional under speculative decoding)."""

WAITING, PREFILLING, DECODING, FINISHED = range(4)


class Flow:
    """Per-request state shared by the engines, as Python lists (scalar access to numpy arrays is slow)."""

    def __init__(self, isl: list[int], osl: list[int]):
        n = len(isl)
        self.isl, self.osl = isl, osl
        self.phase = [WAITING] * n
        self.arrival = [math.nan] * n
        self.first = [math.nan] * n
        self.finish = [math.nan] * n
        self.prefilled = [math.nan] * n
        """When a prefill engine finished the prompt (disaggregated deployments)."""
        self.delivered = [math.nan] * n
        """When the prompt's KV cache reached the decode pool (disaggregated deployments)."""
        self.completed: list[int] = []
        self.generated = [0.0] * n
        """Tokens generated so far (expected, so fractional under speculative decoding); while decoding, as of the
        engine step it started decoding at."""
        self.since = [0] * n
        """Engine step at which a decoding sequence started decoding."""
        self.target = list(isl)
        """Tokens to prefill: the prompt, plus the tokens generated before a preemption when recomputed."""
        self.done = [0] * n
        self.blocks = [0] * n
        self.admitted = [0] * n
        """Admission order (over all engines), which decides who is preempted: the most recently admitted."""
        self.finish_step = [0] * n
        self.cross_step = [0] * n
        self.admissions = 0
        self.preempted_at: list[float] = []


class EngineState:
    """One engine: its queue, its admitted sequences, its KV blocks and the calendars of its decoding sequences.

    Scheduling (vLLM V1 with chunked prefill): every decoding sequence, each allocated the block it needs (preempting
    the most recently admitted sequence while none is free); then the next chunk of each partially prefilled prompt in
    admission order (allocated the same way); then waiting requests FCFS while the budget, max_seqs and free blocks
    allow, stopping at the first that does not fit. Decodes are never cut by the token budget (vLLM requires
    max_num_batched_tokens >= max_num_seqs). Without chunked prefill (vLLM V0) an iteration prefills whole prompts
    only, if the first waiting one fits, else decodes only. With `Engine.reserve` (TensorRT-LLM's
    GUARANTEED_NO_EVICT) a request is admitted only with blocks for its whole prompt and output, and so never needs
    another block or preempts. A waiting request whose prompt is already in the cache (arrived at a decode engine)
    is admitted straight into decoding, with blocks for its prompt and first token (or, reserving, its output too):
    it decodes in the iteration that admits it, and gives its first token at its end."""

    def __init__(self, flow: Flow, engine: Engine):
        self.flow = flow
        self.max_seqs = engine.max_seqs
        self.max_tokens = engine.max_batched_tokens
        self.chunked = engine.chunked_prefill
        self.chunk = engine.prefill_chunk
        self.block = engine.kv_block_tokens
        self.width = 1 + engine.draft_tokens
        self.reserve = engine.reserve
        self.gain = engine.tokens_per_decode
        self.decodes = engine.role != "prefill"
        """False: a request leaves when its prompt is done (a prefill engine)."""
        self.free = engine.kv_capacity_tokens // engine.kv_block_tokens
        self.most_blocks = math.ceil(max(self.gain, 2.0) / self.block)
        """Most blocks a decoding sequence can need at one step: its context grows by the gain per step, or by up
        to 2 tokens at its first step past a (re)computed prompt."""
        self.step = 0
        """Iterations with decodes this engine has run: the clock of its decoding sequences."""
        self.waiting: deque[int] = deque()
        self.running: dict[int, None] = {}
        """Admitted sequences (holding KV), in admission order."""
        self.prefilling: dict[int, None] = {}
        self.decoders = 0
        self.kv_base = 0.0
        """Sum over decoding sequences of isl + generated - since * gain; their contexts sum to this plus
        decoders * step * gain."""
        self.finishing: dict[int, list[int]] = {}
        self.crossing: dict[int, list[int]] = {}
        self.decoded = False
        self.chunks: list[int] = []
        """Sequences given a prompt chunk in the iteration in flight."""
        self.joined: list[int] = []
        """Sequences admitted straight into decoding in the iteration in flight (their first token at its end)."""
        self.tokens = 0
        self.pairs = 0.0
        self.preempted = False
        """Whether scheduling the iteration in flight preempted a sequence."""

    def schedule(self, now: float) -> IterationShape:
        """Schedule the next iteration and return its shape (all zeros if the engine has nothing to do)."""
        self.tokens, self.pairs, self.preempted = 0, 0.0, False
        if self.chunked:
            if self.step in self.crossing:
                self._grow_decoders(now)
            if self.prefilling:
                self._continue_prefills(now)
            if self.waiting and not self.preempted:  # as vLLM V1: no admission in a step that had to preempt
                self._admit_chunks()
            self.decoded = self.decoders > 0
        else:
            self.decoded = not self._admit_whole()
            if self.decoded and self.step in self.crossing:
                self._grow_decoders(now)
            while self.decoded and self.waiting and len(self.running) < self.max_seqs and self._join():
                pass
        n = self.decoders if self.decoded else 0
        kv = self.kv_base + n * self.step * self.gain if n else 0.0
        return IterationShape(n, n * self.width, kv, self.tokens, self.pairs, len(self.chunks))

    def complete(self, now: float) -> list[int]:
        """End the iteration in flight: decoders gain their tokens, finished prompts give their first token (or, on a
        prefill engine, leave). Returns the requests that left the engine."""
        flow = self.flow
        left: list[int] = []
        if self.decoded:
            self.step += 1
            if self.joined:
                for rid in self.joined:
                    flow.first[rid] = now
                self.joined.clear()
            for rid in self.finishing.pop(self.step, ()):
                if flow.phase[rid] == DECODING and flow.finish_step[rid] == self.step:
                    self._stop_decoding(rid)
                    self._finish(rid, now, left)
        for rid in self.chunks:
            if flow.done[rid] < flow.target[rid]:
                continue
            del self.prefilling[rid]
            if not self.decodes:
                self._release(rid, WAITING)
                left.append(rid)
                continue
            flow.generated[rid] += 1.0
            if math.isnan(flow.first[rid]):
                flow.first[rid] = now
            if flow.generated[rid] >= flow.osl[rid] - EPS:
                self._finish(rid, now, left)
            else:
                self._start_decoding(rid)
                self._watch_blocks(rid, self.step)  # its context may already outgrow the prompt's blocks
        self.chunks.clear()
        return left

    def _blocks(self, tokens: float) -> int:
        return math.ceil(tokens / self.block - EPS)

    def _budget(self) -> int:
        return self.max_tokens - self.decoders * self.width - self.tokens

    def _grow_decoders(self, now: float) -> None:
        """Give the decoding sequences whose context enters a new block this step their blocks, oldest first when
        some may have to be preempted for them. The hot loop of the module: kept to plain arithmetic."""
        flow, step, block, gain, crossing = self.flow, self.step, self.block, self.gain, self.crossing
        due = crossing.pop(step)
        if len(due) * self.most_blocks > self.free:
            due.sort(key=flow.admitted.__getitem__)
        for rid in due:
            if flow.phase[rid] != DECODING or flow.cross_step[rid] != step:
                continue  # preempted, possibly for an older sequence of this list, and maybe decoding again
            base = flow.isl[rid] + flow.generated[rid]
            held = max(math.ceil((base + (step - flow.since[rid]) * gain) / block - EPS), flow.blocks[rid])
            need = held - flow.blocks[rid]
            if need > self.free and not self._make_room(rid, need, now):
                continue
            self.free -= need
            flow.blocks[rid] = held
            # the next step at which the context outgrows `held` blocks, if before the sequence finishes
            following = max(flow.since[rid] + math.floor((held * block - base) / gain + EPS) + 1, step + 1)
            if following < flow.finish_step[rid]:
                flow.cross_step[rid] = following
                crossing.setdefault(following, []).append(rid)

    def _watch_blocks(self, rid: int, step: int) -> None:
        """Have `_grow_decoders` check at `step` whether a sequence that starts decoding needs another block."""
        self.flow.cross_step[rid] = step
        self.crossing.setdefault(step, []).append(rid)

    def _continue_prefills(self, now: float) -> None:
        flow = self.flow
        for rid in list(self.prefilling):
            budget = self._budget()
            if budget <= 0:
                break
            if flow.phase[rid] != PREFILLING:
                continue  # preempted for an older sequence of this list
            chunk = min(flow.target[rid] - flow.done[rid], self.chunk, budget)
            need = max(self._blocks(flow.done[rid] + chunk) - flow.blocks[rid], 0)
            if need <= self.free or self._make_room(rid, need, now):
                self.free -= need
                flow.blocks[rid] += need
                self._add_chunk(rid, chunk)

    def _admit_chunks(self) -> None:
        flow = self.flow
        while self.waiting and len(self.running) < self.max_seqs:
            rid = self.waiting[0]
            if flow.done[rid] == flow.target[rid]:
                if self._join():
                    continue
                break
            budget = self._budget()
            if budget <= 0:
                break
            chunk = min(flow.target[rid], self.chunk, budget)
            need = self._reserved(rid) if self.reserve else self._blocks(chunk)
            if need > self.free:
                break
            self._admit_prompt(rid, need, chunk)

    def _admit_whole(self) -> bool:
        """Without chunked prefill: whole prompts FCFS within the budget (a longer one alone); True if any."""
        flow = self.flow
        while self.waiting and len(self.running) < self.max_seqs:
            rid = self.waiting[0]
            if flow.done[rid] == flow.target[rid]:
                break  # in the cache: joins a decode iteration (this one, if no prompt went before it)
            need = self._reserved(rid) if self.reserve else self._blocks(flow.target[rid])
            if need > self.free or (self.tokens and self.tokens + flow.target[rid] > self.max_tokens):
                break
            self._admit_prompt(rid, need, flow.target[rid])
        return self.tokens > 0

    def _join(self) -> bool:
        """Admit the first waiting request, its prompt already in the cache, straight into decoding if its blocks
        are free (its prompt and first token; reserving, its prompt and output); True if admitted."""
        flow = self.flow
        rid = self.waiting[0]
        if flow.done[rid] != flow.target[rid]:
            return False
        need = self._reserved(rid) if self.reserve else self._blocks(flow.isl[rid] + 1)
        if need > self.free:
            return False
        self._admit(rid, need)
        self._start_decoding(rid)
        self._watch_blocks(rid, self.step + 1)  # its blocks hold the context of this step and the next
        self.joined.append(rid)
        return True

    def _reserved(self, rid: int) -> int:
        """The blocks a request holds from admission to its end when admission reserves them: its prompt and
        output (TensorRT-LLM's GUARANTEED_NO_EVICT; a prefill engine's, its prompt); it never needs another, so
        nothing is preempted."""
        return self._blocks(self.flow.isl[rid] + (self.flow.osl[rid] if self.decodes else 0))

    def _admit(self, rid: int, blocks: int) -> None:
        flow = self.flow
        self.waiting.popleft()
        flow.admitted[rid] = flow.admissions
        flow.admissions += 1
        flow.blocks[rid] = blocks
        self.free -= blocks
        self.running[rid] = None

    def _admit_prompt(self, rid: int, blocks: int, chunk: int) -> None:
        self._admit(rid, blocks)
        self.flow.phase[rid] = PREFILLING
        self.prefilling[rid] = None
        self._add_chunk(rid, chunk)

    def _add_chunk(self, rid: int, chunk: int) -> None:
        flow = self.flow
        self.tokens += chunk
        self.pairs += chunk_pairs(chunk, flow.done[rid])
        flow.done[rid] += chunk
        self.chunks.append(rid)

    def _make_room(self, rid: int, need: int, now: float) -> bool:
        """Preempt the most recently admitted sequences until `need` blocks are free for running sequence `rid`;
        False if that preempted `rid` itself."""
        while self.free < need:
            victim = next(reversed(self.running))
            self._preempt(victim, now)
            if victim == rid:
                return False
        return True

    def _preempt(self, rid: int, now: float) -> None:
        """Recompute preemption: free the blocks, requeue first; re-admitted, it prefills prompt + generated."""
        flow = self.flow
        if flow.phase[rid] == DECODING:
            generated = flow.generated[rid] + (self.step - flow.since[rid]) * self.gain
            self._stop_decoding(rid)
            flow.generated[rid] = generated
        else:
            del self.prefilling[rid]
        self._release(rid, WAITING)
        flow.target[rid] = flow.isl[rid] + int(flow.generated[rid] + EPS)
        flow.done[rid] = 0
        self.waiting.appendleft(rid)
        flow.preempted_at.append(now)
        self.preempted = True

    def _start_decoding(self, rid: int) -> None:
        flow = self.flow
        flow.phase[rid] = DECODING
        flow.since[rid] = self.step
        self.decoders += 1
        self.kv_base += flow.isl[rid] + flow.generated[rid] - self.step * self.gain
        finish = self.step + math.ceil((flow.osl[rid] - flow.generated[rid]) / self.gain - EPS)
        flow.finish_step[rid] = finish
        self.finishing.setdefault(finish, []).append(rid)

    def _stop_decoding(self, rid: int) -> None:
        flow = self.flow
        self.decoders -= 1
        self.kv_base = (
            self.kv_base - flow.isl[rid] - flow.generated[rid] + flow.since[rid] * self.gain if self.decoders else 0.0
        )

    def _release(self, rid: int, phase: int) -> None:
        """Free a sequence's blocks and drop it from the running ones."""
        flow = self.flow
        self.free += flow.blocks[rid]
        flow.blocks[rid] = 0
        del self.running[rid]
        flow.phase[rid] = phase

    def _finish(self, rid: int, now: float, left: list[int]) -> None:
        self._release(rid, FINISHED)
        self.flow.finish[rid] = now
        self.flow.completed.append(rid)
        left.append(rid)
