"""One model runner: a step's inputs -> forward -> logits, and a step's MTP drafting.

The runner packs nothing itself and decides nothing about a step: the step builder
(step_inputs.py) and the drafting builder (draft_inputs.py) pack into their persistent
buffers, and one execution strategy, chosen once per engine, runs what they packed:

- `EagerSteps` (here): plain torch calls. The reference, and what the others fall back to
  for the steps they do not serve;
- `CompiledSteps` (compiled_steps.py, enable_torch_compile): decode and verify steps and
  decode-sized drafting through torch.compile, the steady state's calls replayed;
- `CudaGraphSteps` (cuda_graph_steps.py, CUDA with the triton backend): decode and verify
  steps of a captured batch size replay a CUDA graph.
"""

from __future__ import annotations

import torch

from hybrid_engine.models import HybridForCausalLM
from hybrid_engine.request_grammar import DraftMasks
from hybrid_engine.spec_decode.draft_passes import DraftPasses
from hybrid_engine.state_cache import CachePools

from .draft_inputs import DraftInputBuilder, DraftInputs
from .step_inputs import StepInputs


class EagerSteps:
    def __init__(self, model: HybridForCausalLM, caches: CachePools):
        self.model = model
        self.caches = caches        # the cache's memory, as the model reads it

    def forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.forward_step(inputs.input_ids, inputs.batch, self.caches)

    def draft(self, d: DraftInputs, passes: DraftPasses, masks: DraftMasks | None = None) -> torch.Tensor:
        """masks: the drafting requests' grammars, or None; every strategy drafts a masked step
        eagerly, here (each pass's masks need the drafts before it on the host)."""
        return passes(self.model, d.tokens, d.hidden, d.batch, self.caches, d.tables, d.rows, d.seqs, masks)

    def catch_up(self, d: DraftInputs) -> None:
        """A catch-up pass from which no request drafts: the MTP KV only."""
        self.model.mtp_forward(d.tokens, d.hidden, d.batch, self.caches)


class ModelRunner:
    def __init__(self, execution: EagerSteps, drafts: DraftInputBuilder | None = None):
        self.execution = execution
        self.drafts = drafts
        self.passes = (DraftPasses(drafts.k, drafts.block_size, 1 in drafts.keyless_query_lens)
                       if drafts is not None else None)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (final-normed hidden [T, H] for the MTP drafter, float32 logits [rows, vocab]);
        lm_head runs only on the rows that sample. Under CUDA graphs both are views of the
        graph's static outputs: consumed within the step."""
        return self.execution.forward(inputs)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final-normed hidden rows, by the step's own lm_head: the prompt rows
        that prompt_logprobs scores after the forward (hybrid_engine/prompt_logprobs.py)."""
        return self.execution.model.compute_logits(hidden).float()

    @property
    def vocab_size(self) -> int:
        return self.execution.model.cfg.vocab_size

    @torch.inference_mode()
    def draft(self, segs: list[tuple[int, int, list[int]]], tokens: list[int], hidden: torch.Tensor,
              drafting: list[int], masks: DraftMasks | None = None) -> torch.Tensor | None:
        """The MTP layer over segments (start, length, block table) with their next tokens and
        the target's hidden rows, then k drafts from the end of each segment in `drafting`
        -> the drafts [len(drafting), k], or None where none drafts. masks: the grammars of
        the drafting requests where any has one (drafted eagerly: EagerSteps.draft)."""
        lookahead = self.passes.num_drafts - 1 if drafting else 0
        inputs = self.drafts.build(segs, tokens, hidden, drafting, lookahead)
        if not drafting:
            self.execution.catch_up(inputs)
            return None
        try:
            return self.execution.draft(inputs, self.passes, masks)
        finally:
            if masks is not None:
                masks.close()
