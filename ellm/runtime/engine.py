"""The inference engine: a loaded artifact, a persistent KV cache written in place, prefill/decode/generate.

Every forward step, whatever its number of tokens, is one call into the compiled Relax VM.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, NoReturn, Sequence

import numpy as np

from ..errors import ContextOverflowError, EllmError
from ..kv.attention import AttentionConfig
from ..speculative.config import SpeculativeConfig
from .artifact import Artifact
from .hugepages import huge_arrays
from .limits import check_context, context_size
from .rope import rope_table
from .state import Emitter, GenerationStats, _Cache, decode_until_stop  # noqa: F401 (GenerationStats: the engine's API)
from .sampling import Sampler, SamplingConfig
from .threads import set_threads
from ..numa.placement import NumaOptions, Placement
from ..targets.detect import available_memory


class Engine:
    def __init__(
        self,
        artifact: Artifact,
        threads: int | None = None,
        ctx_size: int | None = None,
        prefill_chunk: int | None = None,
        rope_scaling: tuple[str, float] | None = None,
        attention: AttentionConfig | None = None,
        huge_pages: bool = True,
        numa: NumaOptions | None = None,
        log: Callable[[str], None] | None = None,
    ):
        """`rope_scaling`: (kind, factor) replacing the GGUF's RoPE scaling, e.g. ("yarn", 4.0) to run past
        the trained context. `attention`: dense or block-sparse (kv/attention.py; default: sparse).
        `huge_pages`: weights (read into private memory) and KV state on 2 MiB pages (runtime/hugepages.py);
        off, the weights stay a shared memory map. `numa`: placement of weights, KV cache and threads on NUMA nodes
        (numa/placement.py; default: distribute on a machine of several nodes, TVM's pinning on one). `log`:
        where placement warnings go (default: stderr)."""
        import tvm
        from tvm import relax

        cfg = artifact.config
        if rope_scaling is not None:
            cfg = cfg.with_rope_scaling(*rope_scaling)
        self.artifact = artifact
        self.config = cfg
        if threads is not None and int(threads) < 1:
            raise EllmError(f"threads must be at least 1, got {threads}")
        log = log or (lambda s: print(s, file=sys.stderr))
        self.placement = Placement.make(numa or NumaOptions(), threads, artifact.manifest, artifact.param_records(),
                                        kernels=artifact.target["kernels"], log=log)
        self.threads = self.placement.n_threads  # physical cores, not SMT siblings (numa/threadmap.py)
        self._cpus = self.placement.cpus  # [task] -> CPU, or None: TVM's own pinning
        self.ctx_size = context_size(ctx_size, cfg.ctx_train)
        private = 0 if (self.placement.options.mmap or not huge_pages) else sum(p["nbytes"] for p in artifact.param_records())
        check_context(cfg, artifact.kv_plan, self.ctx_size, private, available_memory(), log)
        max_chunk = int(artifact.manifest["max_chunk"])
        self.prefill_chunk = int(prefill_chunk or max_chunk)
        if not 1 <= self.prefill_chunk <= max_chunk:
            raise EllmError(f"prefill_chunk must be between 1 and the artifact's max_chunk {max_chunk}, got {prefill_chunk}")
        self.max_verify = int(artifact.manifest["max_verify"])
        self.tokenizer = artifact.tokenizer()
        set_threads(self.threads, self._cpus)
        self.target = artifact.target["preset"]  # the artifact's target whose kernels run (runtime/artifact.py)
        if any(f.startswith("amx") for f in artifact.target["required_cpu_features"]):
            from .amx import request_amx_permission

            request_amx_permission()

        self._vm = relax.VirtualMachine(artifact.load_module(), tvm.cpu())
        self._fn = {e["name"]: artifact.entry(self._vm, e["name"]) for e in artifact.manifest["entries"]}
        if self.placement.options.mmap or not huge_pages:
            place = lambda mm, recs: self.placement.keep_mapped(mm, log)  # noqa: E731
        else:
            place = lambda mm, recs: self.placement.load_weights(mm, recs, log)  # noqa: E731
        self._params = tvm.runtime.convert([tvm.runtime.from_dlpack(a) for a in artifact.map_params(place=place)])
        self._rope = tvm.runtime.tensor(rope_table(cfg, self.ctx_size))
        # the KV state (kv/plan.py): the float16 ring of recent blocks and the per-class block stores
        self.kv_plan = artifact.kv_plan
        self._huge_pages = huge_pages
        self._log = log
        self._kv_tensors, self._kv = self._new_kv_state()
        self.placement.lock(log)
        self.attention = attention or artifact.attention()
        self._attn = tvm.runtime.tensor(self.attention.as_array(cfg.n_layers))
        self._attn_dense = tvm.runtime.tensor(AttentionConfig.dense().as_array(cfg.n_layers))
        # the input of one-token steps, reused: after a step has streamed every weight through the caches, even
        # allocating a small tensor costs hundreds of microseconds (measured, SmolLM2 on a 32 MB L3)
        self._one_tensor = tvm.runtime.empty((1,), "int32", tvm.cpu())
        self._one = np.from_dlpack(self._one_tensor)  # [1] int32, the same memory
        self._cache = _Cache()
        self._slots = [(self._kv_tensors, self._kv, self._cache)]  # KV states (add_slots); the selected one is above
        self._slot = 0
        self._curve: list[float] | None = None  # verification cost over decode cost per chain length (speculative/cost.py)
        self._drafts: dict[str, Engine] = {}  # draft models by --draft-model path (speculative/draft_model.py)
        self.stats = GenerationStats()

    @classmethod
    def load(cls, path: str | Path, threads: int | None = None, ctx_size: int | None = None, target: str | None = None,
             **kw) -> Engine:
        """`target`: run that target of the artifact (default: the best one this CPU can run)."""
        return cls(Artifact.open(path, target=target), threads=threads, ctx_size=ctx_size, **kw)

    def _new_kv_state(self):
        """A KV state: its tensors and the VM's array of them."""
        import tvm

        nb = self.kv_plan.n_blocks(self.ctx_size)
        shapes = [(tuple(nb if d == "NB" else int(d) for d in s.shape), s.dtype) for s in self.kv_plan.state_tensors()]
        if self._huge_pages:
            arrays = huge_arrays(shapes)
            self.placement.place_kv(arrays, self._log)  # before the first write: pages land on their heads' nodes
            tensors = [tvm.runtime.from_dlpack(a) for a in arrays]
        else:
            tensors = [tvm.runtime.empty(shape, dtype, tvm.cpu()) for shape, dtype in shapes]
        return tensors, tvm.runtime.convert(tensors)

    # --- slots: several KV caches, one in use ---------------------------------------------------
    @property
    def n_slots(self) -> int:
        return len(self._slots)

    @property
    def slot(self) -> int:
        return self._slot

    def add_slots(self, n: int) -> None:
        """Have `n` KV states in all (a server's conversations each keep theirs; select_slot switches). Refused
        up front where they would not fit in the memory available."""
        extra = n - self.n_slots
        if extra <= 0:
            return
        need, avail = extra * self.kv_bytes(), available_memory()
        if avail is not None and need > 0.9 * avail:
            raise EllmError(f"{n} slots of {self.kv_bytes() / 2**20:.0f} MiB KV cache each need "
                            f"{need / 2**30:.2f} GiB more, but {avail / 2**30:.2f} GiB is available "
                            "(use fewer --slots or a smaller --ctx-size)")
        for _ in range(extra):
            tensors, arr = self._new_kv_state()
            self._slots.append((tensors, arr, _Cache()))
        self.placement.lock(self._log)

    def select_slot(self, i: int) -> None:
        """Run on KV state i from now on (no copy)."""
        if not 0 <= i < self.n_slots:
            raise ValueError(f"slot {i} of {self.n_slots}")
        self._kv_tensors, self._kv, self._cache = self._slots[i]
        self._slot = i

    def slot_tokens(self, i: int) -> list[int]:
        """The tokens KV state i holds (do not modify)."""
        return self._slots[i][2].tokens

    # --- cache ------------------------------------------------------------------------------
    @property
    def n_cached(self) -> int:
        return len(self._cache.tokens)

    def common_prefix(self, ids: Sequence[int], start: int = 0) -> int:
        """How many leading `ids` the cache holds, comparing from position `start` on (the caller knows the
        first `start` agree)."""
        cached, n = self._cache.tokens, min(start, len(ids), self.n_cached)
        end = min(len(ids), self.n_cached)
        while n < end and cached[n] == ids[n]:
            n += 1
        return n

    def restorable(self, n: int) -> bool:
        """Whether truncate(n) keeps the cached state (else it has to recompute positions < n)."""
        p = self.kv_plan
        return self._cache.restorable(n, p.block, p.recent, p.ring, p.pinned)

    def truncate(self, n: int) -> None:
        """Forget cached tokens from position n on; the next step writes at position n.

        Truncating by more than the float16 ring still holds (kv/plan.py: a few blocks) recomputes the
        kept tokens from scratch, so the result is always what a fresh run would give."""
        if not 0 <= n <= self.n_cached:
            raise ValueError(f"cannot truncate a cache of {self.n_cached} tokens to {n}")
        if self.restorable(n):
            self._cache.truncate(n)
            return
        keep = self._cache.tokens[:n]
        self._cache.truncate(0)
        self.prefill(keep)

    def reset(self) -> None:
        self.truncate(0)

    def save_session(self, path) -> int:
        """The KV state and the tokens it holds, to a file (runtime/session.py); the bytes written."""
        from .session import save_session

        return save_session(self, path)

    def load_session(self, path) -> int:
        """Continue from a saved session (the same artifact); the number of cached tokens."""
        from .session import load_session

        return load_session(self, path)

    def kv_bytes(self) -> int:
        """Bytes allocated for the KV state (ring and stores)."""
        return sum(int(np.prod(t.shape)) * np.dtype(str(t.dtype)).itemsize for t in self._kv_tensors)

    # --- forward steps -----------------------------------------------------------------------
    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.config.vocab_size):
            self._bad_id()
        return arr.astype(np.int32)

    def _bad_id(self) -> NoReturn:
        raise EllmError(f"token id out of range [0, {self.config.vocab_size})")

    def _step(self, entry: str, ids: np.ndarray, dense: bool = False, x=None) -> np.ndarray:
        """Run `ids` at the next cache positions; one VM call. `x`: a TVM tensor already holding them."""
        import tvm

        pos = self.n_cached
        if pos + len(ids) > self.ctx_size:
            raise ContextOverflowError(
                f"{pos + len(ids)} tokens do not fit in the context of {self.ctx_size} tokens (use --ctx-size to enlarge it)"
            )
        attn = self._attn_dense if dense else self._attn
        # Interrupt-safe bookkeeping (Ctrl-C lands between any two bytecodes, or ends the call): the ring slots
        # the step may overwrite are recorded before it runs, its tokens only after it returned, in one C call.
        # An interrupted step leaves the cache at `pos`, with the ring marked as if the step had run.
        self._cache.hi_block = max(self._cache.hi_block, (pos + len(ids) - 1) // self.kv_plan.block)
        out = self._fn[entry](tvm.runtime.tensor(ids) if x is None else x, pos, self._rope, self._kv, attn, self._params)
        self._cache.tokens.extend(ids.tolist())
        # a view of the logits, no copy: the VM writes each step's output into a new tensor, kept alive by the view
        return np.from_dlpack(out)

    def prefill(
        self,
        ids: Sequence[int],
        all_logits: bool = False,
        progress: Callable[[int, int], None] | None = None,
        dense: bool = False,
    ):
        """Append `ids` to the cache in chunks; logits of the last token [vocab] (or of all, [len, vocab]).
        `dense` attends densely whatever the engine's attention setting."""
        set_threads(self.threads, self._cpus)
        arr = self._check_ids(ids)
        if arr.size == 0:
            raise EllmError("prefill needs at least one token")
        # only what the engine's own setting writes may be reused by generate
        exact = self._cache.exact == self.n_cached and (not dense or self.attention.mode == "dense")
        outs = []
        for start in range(0, len(arr), self.prefill_chunk):
            chunk = arr[start : start + self.prefill_chunk]
            outs.append(self._step("prefill_all" if all_logits else "prefill", chunk, dense))
            if exact:  # chunk by chunk: an interrupted prefill keeps what it wrote reusable, bit for bit
                self._cache.exact = self.n_cached
            if progress:
                progress(start + len(chunk), len(arr))
        return np.concatenate(outs, axis=0) if all_logits else outs[-1][0]

    def decode(self, token: int) -> np.ndarray:
        """Append one token; logits of it [vocab]."""
        set_threads(self.threads, self._cpus)
        if not 0 <= token < self.config.vocab_size:
            self._bad_id()
        self._one[0] = token
        return self._step("decode", self._one, x=self._one_tensor)[0]

    def verify(self, ids: Sequence[int]) -> np.ndarray:
        """Append `ids` in one step whose rows are computed as one-token steps: logits [len(ids), vocab],
        row i equal bit for bit to what decode would return for ids[i] after ids[:i] (a speculative chain's
        verification, speculative/chain.py). At most the artifact's max_verify tokens."""
        set_threads(self.threads, self._cpus)
        arr = self._check_ids(ids)
        if not 1 <= arr.size <= self.max_verify:
            raise EllmError(f"a verification step takes 1 to {self.max_verify} tokens, got {arr.size}")
        return self._step("verify", arr)

    # --- the public API ----------------------------------------------------------------------
    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """[len(ids), vocab] float32 logits, teacher-forced from an empty cache with dense attention."""
        self.reset()
        return self.prefill(ids, all_logits=True, dense=True)

    def generate(
        self,
        ids: Sequence[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        stop_at_eog: bool = True,
        on_token: Callable[[int], bool | None] | None = None,
        progress: Callable[[int, int], None] | None = None,
        speculative: SpeculativeConfig | None = None,
        cache_reuse: bool = True,
        sampling: SamplingConfig | None = None,
        on_logits: Callable[[int, np.ndarray], None] | None = None,
    ) -> list[int]:
        """New token ids continuing `ids` (greedy at temperature 0).

        `sampling`: the sampler's controls (runtime/sampling.py); without it, plain sampling at `temperature`
        seeded with `seed`. `on_token(tok)` sees each token as it is chosen; returning True stops generation
        there (stop_reason "stop": a stop string, a cancelled request). `on_logits(tok, logits)`: the raw logits
        [vocab] the token was chosen from (log-probabilities), before on_token. `progress(done, total)` may raise
        to abandon the prompt: the cache then holds what was fully written.

        `cache_reuse`: the KV of the longest cached prefix of `ids` is kept, tokens decoded by earlier calls
        included, so a conversation's next turn computes only its new message. Decoded tokens' KV was
        computed by one-token steps, whose activations may be rounded differently from a prompt chunk's
        (`ellm compile --activations`): the next turn's logits are then close to, not bit-equal to, a fresh
        run's (README, "Speculative decoding and cache reuse"). Off, only prompt tokens written by prefill are reused, which
        reproduces a fresh run bit for bit (a prefill step's result does not depend on how it was chunked).

        `speculative`: draft and verify chains (speculative/). Greedy output is token for token the output
        without it (verification rows equal decode steps bit for bit); sampled output has the same
        distribution.
        """
        t0 = time.perf_counter()
        arr = self._check_ids(ids)
        if arr.size == 0:
            raise EllmError("generate needs a non-empty prompt")
        if arr.size > self.ctx_size:
            raise ContextOverflowError(
                f"the prompt has {arr.size} tokens but the context holds {self.ctx_size} (use --ctx-size to enlarge it)"
            )
        if max_new_tokens < 0:
            raise EllmError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if speculative is not None and speculative.on and speculative.draft_model:
            self.draft_engine(speculative.draft_model)  # opened (and checked) before any work
        sampler = Sampler(sampling or SamplingConfig(temperature=temperature, seed=seed))
        stats = self.stats = GenerationStats(prompt_tokens=int(arr.size))
        if max_new_tokens == 0:
            stats.stop_reason = "length"
            return []

        prompt = arr.tolist()
        common = min(self.common_prefix(prompt), self.n_cached if cache_reuse else self._cache.exact)
        reuse = min(common, arr.size - 1)  # the last prompt token always runs: its logits choose token 1
        if not self.restorable(reuse):
            reuse = 0  # recomputing the prefix would cost as much as starting over
        self.truncate(reuse)
        stats.reused_tokens = reuse
        logits = self.prefill(arr[reuse:], progress=progress)
        drafter = None
        if speculative is not None and speculative.on:
            drafter = self._drafter(speculative, prompt)  # a draft model reads the prompt here too
        stats.prefill_s = time.perf_counter() - t0

        history = list(prompt)
        emit = Emitter(stats, max_new_tokens, history, self.tokenizer.is_eog if stop_at_eog else None, on_token,
                       on_logits)
        out = emit.out

        first = sampler.choose(logits, history)
        stats.ttft_s = time.perf_counter() - t0
        if speculative is not None and speculative.on and self._curve is None:
            self._curve = self._verify_cost_curve()  # once per engine: from the cache, else measured here
        t_dec = time.perf_counter()
        if not emit(first, logits):
            if drafter is not None:
                self._speculate(drafter, first, emit, stats, speculative, sampler, history,
                                lambda: max_new_tokens - len(out))
            else:
                decode_until_stop(self, first, sampler, emit)
        stats.decode_s = time.perf_counter() - t_dec if stats.decode_tokens else 0.0
        # the cache holds the prompt and every token but the last, whichever steps produced them
        if self.n_cached > arr.size + len(out) - 1:
            self.truncate(arr.size + len(out) - 1)
        return out

    def _verify_cost_curve(self) -> list[float]:
        from ..demo import cache_root
        from ..speculative.cost import load_or_measure

        return load_or_measure(self, cache_root(), self.max_verify)

    def draft_engine(self, path: str) -> Engine:
        """The draft model at `path` (an artifact, or a GGUF compiled once into the cache), opened once."""
        if path not in self._drafts:
            from ..demo import cache_root
            from ..speculative.draft_model import open_draft

            self._drafts[path] = open_draft(path, self, cache_root())
        return self._drafts[path]

    def _drafter(self, cfg: SpeculativeConfig, context: list[int]):
        from ..speculative.drafters import CascadeDrafter, ModelDrafter, NgramDrafter

        ngram = NgramDrafter(cfg, context) if cfg.draft in ("ngram", "cascade") else None
        model = ModelDrafter(self.draft_engine(cfg.draft_model), context, self) if cfg.draft_model else None
        if model is not None:
            model.start()
        return CascadeDrafter(ngram, model) if ngram and model else (ngram or model)

    def _speculate(self, drafter, first, emit, stats, cfg: SpeculativeConfig, sampler: Sampler, history: list[int],
                   remaining) -> None:
        from ..speculative.chain import run_chain
        from ..speculative.controller import ChainController

        assert self._curve is not None
        controller = ChainController(self._curve, min(cfg.chain, self.max_verify - 1), cfg.adaptive,
                                     draft_cost=drafter.cost_prior)
        run_chain(self, drafter, first, emit, stats, cfg, controller, sampler, history, remaining)
        stats.draft_s = drafter.draft_s  # a new drafter per call: its prompt read is prefill, not counted
