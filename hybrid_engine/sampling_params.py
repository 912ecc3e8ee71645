"""Per-request sampling parameters, with vLLM's names and defaults.

`n` asks for n independent samples of one prompt, which share its prefill
(hybrid_engine/request_group.py). `best_of` (sample more, return the n most likely) is left
out, as vLLM v1 dropped it: n samples are returned as drawn.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NoReturn

from .stop_strings import StopStrings
from .structured_outputs import StructuredOutputsParams

# Below this temperature the row is treated as greedy, as in vLLM (_SAMPLING_EPS): dividing
# logits by a tiny positive temperature overflows float32 and gains nothing over argmax.
GREEDY_TEMPERATURE = 1e-5

# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1

# OpenAI's API takes 4 stop strings and vLLM sets no limit. 256 lets real lists through (stop
# words, code fences, a language's keywords) and bounds what one request can ask at admission:
# validating them and building their automaton (hybrid_engine/stop_strings.py) once. After that
# their number no longer matters: a token's stop check reads its new text through the automaton.
MAX_STOP_STRINGS = 256


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None  # normalised to a list
    ignore_eos: bool = False
    logprobs: int | None = None  # N most likely tokens (plus the chosen one) per step
    # N most likely tokens (plus the prompt's own) at each prompt position after the first
    # (vLLM's; RequestOutput.prompt_logprobs). The request then computes its whole prompt:
    # a prefix-cache hit would skip positions whose logits these need.
    prompt_logprobs: int | None = None
    # vLLM's: keep a stop string, and a stop token's text, in the output text (dropped by default)
    include_stop_str_in_output: bool = False
    n: int = 1  # independent samples of the prompt, each a CompletionOutput of one RequestOutput
    # What the output must be: a JSON schema, regex, choice, grammar (hybrid_engine/structured_outputs.py)
    structured_outputs: StructuredOutputsParams | None = None

    def __setattr__(self, name: str, value) -> None:
        # stop / stop_token_ids are normalised to lists on every assignment, not only in the
        # constructor, so that `params.stop = "\n"` means what it does in SamplingParams(stop="\n").
        if name in ("stop", "stop_token_ids"):
            value = _as_list(value)
        if name == "stop":
            self.__dict__.pop("_stop_strings", None)
        super().__setattr__(name, value)

    @property
    def stop_strings(self) -> StopStrings:
        """`stop` as one automaton (the engine checks every token's text with it), built by
        validate() or at first use and kept; assigning `stop` drops it."""
        matcher = self.__dict__.get("_stop_strings")
        if matcher is None:
            matcher = self.__dict__["_stop_strings"] = StopStrings(self.stop)
        return matcher

    def child_seed(self, index: int) -> int | None:
        """The seed of sample `index` of n: vLLM's seed + index, so the n samples differ and each
        is the sample a lone request with that seed gives; wrapped into the seed range (the
        sampler reads seeds modulo 2**64). None when unseeded: the engine picks one per sample."""
        if self.seed is None:
            return None
        seed = self.seed + index
        return seed if seed <= _SEED_MAX else seed - 2**64

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first bad field and its value."""
        if not _is_int(vocab_size) or vocab_size < 1:
            _fail("vocab_size", vocab_size, "a positive int")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            _fail("temperature", self.temperature, "a finite number >= 0")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "in (0, 1]")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            _fail("top_k", self.top_k, "-1 (disabled) or an int >= 1")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "in [0, 1]")
        rp = self.repetition_penalty
        if not _is_real(rp) or not math.isfinite(rp) or rp <= 0:
            _fail("repetition_penalty", rp, "a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                _fail(name, value, "in [-2, 2]")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "an int >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"an int in [0, max_tokens={self.max_tokens}]")
        if not _is_int(self.n) or self.n < 1:
            _fail("n", self.n, "an int >= 1")
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            _fail("seed", self.seed, "None or an int in [-2**63, 2**64)")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            _fail("stop", self.stop, "None, a non-empty str or a list of non-empty str")
        if self.__dict__.get("_stop_strings") is None or self._stop_strings.stops != self.stop:
            # Built here, at admission, on the caller's thread rather than the engine loop's;
            # rebuilt when the list was edited in place since.
            self.__dict__["_stop_strings"] = StopStrings(self.stop)
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and 0 <= t < vocab_size for t in self.stop_token_ids
        ):
            _fail("stop_token_ids", self.stop_token_ids, f"a list of token ids in [0, {vocab_size})")
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", self.ignore_eos, "a bool")
        if not isinstance(self.include_stop_str_in_output, bool):
            _fail("include_stop_str_in_output", self.include_stop_str_in_output, "a bool")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= vocab_size):
                _fail(name, value, f"None or an int in [0, {vocab_size}]")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                _fail("structured_outputs", self.structured_outputs, "None or a StructuredOutputsParams")
            self.structured_outputs.validate()


def _as_list(value):
    """None -> [], a str -> [it], a list or tuple -> a list; anything else is left for validate()."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    return value


def _is_int(value: object) -> bool:
    # bool is an int subclass, but True as a seed or a token count is a caller's mistake.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _fail(name: str, value: object, expected: str) -> NoReturn:
    raise ValueError(f"{name} must be {expected}, got {value!r}")
