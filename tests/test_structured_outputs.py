"""Structured outputs in the engine: constraints checked when prepared, outputs that satisfy
them, exact with MTP, and everything else (n, prefix caching, chunked prefill, preemption,
stops, reasoning, batch neighbours) unchanged by them."""

import json
import re
import threading

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid_engine import LLM, EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from hybrid_engine.grammar_compiler import GrammarCompiler
from hybrid_engine.request_grammar import RequestGrammar

from chat_checkpoint import REASONING, make_chat_checkpoint
from checkpoints import save_tokenizer
from engine_checks import assert_no_leak, budget_for_blocks
from spec_models import make_spec_checkpoint
from staggered import run_staggered

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")

# Nested objects, arrays with min/max items, enums, bounded numbers, optional fields.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                     "zip": {"type": "integer", "minimum": 1000, "maximum": 9999}},
                    "required": ["city"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
    },
    "required": ["name", "age", "role", "tags"],
}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
EBNF = 'root ::= "x = " num ";"\nnum ::= [1-9] [0-9]? ("." [0-9])?'
CHOICES = ["yes", "no", "maybe so"]


@pytest.fixture(scope="module")
def llm():
    return LLM(speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def so(**kwargs) -> SamplingParams:
    constraint = {k: kwargs.pop(k) for k in ("json", "regex", "choice", "grammar", "json_object",
                                             "disable_any_whitespace") if k in kwargs}
    return SamplingParams(structured_outputs=StructuredOutputsParams(**constraint), **kwargs)


@pytest.mark.parametrize("constraint, message", [
    (dict(json="{not json"), "structured_outputs.json is not valid: the schema is not JSON"),
    (dict(json={"type": "objectx"}), 'structured_outputs.json is not valid: Unsupported type "objectx"'),
    (dict(json=[1, 2]), "a JSON schema must be a dict or its JSON text"),
    (dict(regex="(ab"), "structured_outputs.regex is not valid: .*parenthesis is not closed"),
    (dict(choice=[]), "structured_outputs.choice is not valid: must be a non-empty list"),
    (dict(choice=["a", ""]), "structured_outputs.choice is not valid"),
    (dict(grammar="root ::= undefined_rule"), 'structured_outputs.grammar is not valid: .*"undefined_rule" is not defined'),
    (dict(json_object=1), "json_object is not valid: must be True"),
    (dict(), "must set exactly one of .*got none"),
    (dict(regex="a", choice=["a"]), "must set exactly one of .*got regex, choice"),
    (dict(regex="a", disable_any_whitespace="no"), "disable_any_whitespace must be a bool"),
])
def test_bad_constraints_raise_naming_the_problem(llm, constraint, message):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=message):
        llm.generate(["x"], params, use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs must be None or a StructuredOutputsParams"):
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "a"}), use_tqdm=False)
    # The engine goes on serving.
    assert llm.generate(["x"], so(regex="ab?"), use_tqdm=False)[0].outputs[0].text in ("a", "ab")


def test_a_model_without_tokenizer_refuses_constraints(tmp_path):
    folder = make_spec_checkpoint(tmp_path / "m")
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32"))
    with pytest.raises(ValueError, match="structured_outputs needs the model's tokenizer"):
        engine.add_request([1, 2, 3], so(regex="a"))


def test_sampled_outputs_satisfy_their_constraints(llm):
    prompts = ["def read_config(path):", "import json\n", "# the user record\n", "class Config:\n"]
    kinds = [dict(json=PERSON), dict(json=json.dumps(PERSON), disable_any_whitespace=True), dict(json_object=True),
             dict(regex=REGEX), dict(choice=CHOICES), dict(grammar=EBNF)]
    for kind in kinds:
        outs = llm.generate(prompts, so(temperature=1.0, seed=11, max_tokens=300, n=2, **kind), use_tqdm=False)
        done = [c for o in outs for c in o.outputs if c.finish_reason == "stop"]
        # Any JSON object has no bound on its strings: this tiny model may ramble in one.
        assert len(done) >= (len(prompts) if "json_object" in kind else 2 * len(prompts)), kind
        for c in done:
            if "json" in kind:
                jsonschema.validate(json.loads(c.text), PERSON)
            elif "json_object" in kind:
                assert isinstance(json.loads(c.text), dict)
            elif "regex" in kind:
                assert re.fullmatch(REGEX, c.text), c.text
            elif "choice" in kind:
                assert c.text in CHOICES
            else:
                assert re.fullmatch(r"x = [1-9][0-9]?(\.[0-9])?;", c.text), c.text
        if "disable_any_whitespace" in kind:
            # Outside its strings, the text has the fixed separators only.
            bare = [re.sub(r'"(\\.|[^"\\])*"', '""', c.text) for o in outs for c in o.outputs]
            assert all(not re.search(r"\s\s|\n", b) for b in bare), bare


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(choices=st.lists(st.text(alphabet="abc xyz_-.:\"\\{}é", min_size=1, max_size=8), min_size=1, max_size=5,
                        unique=True),
       temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 2**32))
def test_choice_outputs_are_one_of_the_choices(llm, choices, temperature, seed):
    out = llm.generate(["x = "], so(choice=choices, temperature=temperature, seed=seed, max_tokens=64),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in choices and out.finish_reason == "stop"


@pytest.fixture(scope="module")
def spec_ckpts(tmp_path_factory):
    folders = {}
    for f in FAMILIES:
        folder = make_spec_checkpoint(tmp_path_factory.mktemp(f), f, embed_scale=1.6)
        save_tokenizer(folder, vocab_size=256)      # fewer tokens than the model's 256 rows
        folders[f] = folder
    return folders


TINY_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                "b": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                                      "maxItems": 2}},
               "required": ["a", "b"]}


def mixed_params():
    """Constrained greedy and seeded requests beside one unconstrained one."""
    return [so(json=TINY_SCHEMA, disable_any_whitespace=True, temperature=0.0, max_tokens=20),
            so(regex=r"[a-f]{3}-[0-9]{2,4}", temperature=0.0, max_tokens=20),
            so(grammar='root ::= ("ab" | "c")+ "."', temperature=0.0, max_tokens=20),
            so(choice=CHOICES, temperature=0.0, max_tokens=20),
            so(json_object=True, temperature=0.9, seed=3, max_tokens=20),
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_constrained_with_mtp_equals_without(spec_ckpts, family):
    folder = str(spec_ckpts[family])
    prompts = [[(7 * i + j) % 200 + 1 for j in range(20 + 8 * i)] for i in range(6)]
    arrivals = [0, 0, 1, 2, 2, 4]
    params = mixed_params()
    ref_engine = LLMEngine(EngineConfig(model=folder, dtype="float32", enable_prefix_caching=False))
    reference = [o.outputs[0] for o in run_staggered(ref_engine, prompts, params, arrivals)]
    assert reference[1].finish_reason == "stop" and re.fullmatch(r"[a-f]{3}-[0-9]{2,4}", reference[1].text)
    assert reference[3].text in CHOICES
    # The unconstrained neighbour is what it is alone.
    alone = LLMEngine(EngineConfig(model=folder, dtype="float32", enable_prefix_caching=False))
    assert run_staggered(alone, prompts[-1:], params[-1:], [0])[0].outputs[0].token_ids == reference[-1].token_ids
    for k in (1, 2, 4):
        probe = LLMEngine(EngineConfig(model=folder, dtype="float32", speculative_config=_spec(k), max_num_seqs=6,
                                       max_num_batched_tokens=64))
        for cfg in (dict(max_num_batched_tokens=6 * (1 + k) + 7),                          # chunked prefill
                    dict(max_num_batched_tokens=64, cache_memory_bytes=budget_for_blocks(probe, 4))):   # preemption
            engine = LLMEngine(EngineConfig(model=folder, dtype="float32", speculative_config=_spec(k),
                                            max_num_seqs=6, **cfg))
            compiled(engine, params)
            outs = [o.outputs[0] for o in run_staggered(engine, prompts, params, arrivals)]
            assert [o.token_ids for o in outs] == [o.token_ids for o in reference], (k, cfg)
            assert [o.finish_reason for o in outs] == [o.finish_reason for o in reference]
            assert_no_leak(engine)
            if "cache_memory_bytes" in cfg:
                assert engine.num_preemptions > 0
            assert engine.spec_stats.num_accepted > 0


def compiled(engine, params) -> None:
    """Compiles the grammars of `params` before the run: a request whose grammar still compiles
    waits, so the schedule (where preemptions fall) would depend on the worker thread's timing."""
    for p in params:
        if p.structured_outputs is not None:
            engine.grammar_compiler.submit(p.structured_outputs).result()


def _spec(k):
    return {"method": "mtp", "num_speculative_tokens": k}


def test_n_samples_each_match_a_lone_request_and_prefix_hits_change_nothing(llm):
    params = so(json=PERSON, disable_any_whitespace=True, temperature=1.0, seed=40, max_tokens=200, n=3)
    prompt = "def load(path):\n    with open(path) as f:\n        return"
    together = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    assert len({c.text for c in together}) > 1
    for i, c in enumerate(together):
        jsonschema.validate(json.loads(c.text), PERSON)
        alone = so(json=PERSON, disable_any_whitespace=True, temperature=1.0, seed=40 + i, max_tokens=200)
        # The second run of the prompt is served from the prefix cache.
        assert llm.generate([prompt], alone, use_tqdm=False)[0].outputs[0].token_ids == c.token_ids


def test_stop_strings_and_max_tokens_cut_a_structure(llm):
    out = llm.generate(["x"], so(json=PERSON, disable_any_whitespace=True, temperature=0.0, max_tokens=200,
                                 stop=['"age"']), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == '"age"' and out.text.startswith('{"name": "')
    assert '"age"' not in out.text
    out = llm.generate(["x"], so(json=PERSON, temperature=0.0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5 and out.text.startswith("{")


def test_the_end_token_only_where_the_grammar_may_end(llm):
    engine = llm.engine
    compiler = engine.grammar_compiler
    eos = engine.eos_token_ids[0]
    grammar = RequestGrammar(compiler.submit(StructuredOutputsParams(choice=["ab", "abcd"])))
    tok = engine.tokenizer
    a, b, c, d = (tok.convert_tokens_to_ids(ch) for ch in "abcd")
    mask = torch.zeros(5, (engine.model_config.vocab_size + 31) // 32, dtype=torch.int32)

    def allowed(row):
        bits = [(int(mask[row, t // 32]) >> (t % 32)) & 1 for t in range(engine.model_config.vocab_size)]
        return {t for t, bit in enumerate(bits) if bit}

    # Rows after a, a b, a b c (walked as drafts, then rolled back): EOS only after "ab".
    grammar.fill_masks([a, b, c, d], mask, 0, 5)
    assert eos not in allowed(0) and eos not in allowed(1) and eos in allowed(2) and eos not in allowed(3)
    assert eos in allowed(4) and allowed(4) == {eos} | set(engine.eos_token_ids)
    assert a in allowed(0) and b in allowed(1) and c in allowed(2)
    # A rejected draft: its row excludes it and the rows after it are all ones.
    grammar.fill_masks([a, c, d], mask, 0, 4)
    assert c not in allowed(1) and len(allowed(2)) == engine.model_config.vocab_size
    # Nothing moved: fill_masks rolls back.
    grammar.accept(a)
    grammar.accept(b)
    assert not grammar.terminated
    grammar.accept(eos)
    assert grammar.terminated


def test_rows_past_the_tokenizer_are_never_allowed(spec_ckpts):
    from hybrid_engine.tokenizer import load_tokenizer

    folder = spec_ckpts["qwen3_5"]
    tok = load_tokenizer(folder)
    rows = 256 + 64                           # the model's rows, past the tokenizer's
    compiler = GrammarCompiler(tok, rows, [tok.eos_token_id])
    grammar = RequestGrammar(compiler.submit(StructuredOutputsParams(grammar='root ::= [^"]*')))
    mask = torch.zeros(1, rows // 32, dtype=torch.int32)
    grammar.fill_masks([], mask, 0, 1)
    bits = [(int(mask[0, t // 32]) >> (t % 32)) & 1 for t in range(rows)]
    assert sum(bits[:len(tok)]) > len(tok) // 2 and sum(bits[len(tok):]) == 0


def test_reasoning_is_not_constrained_the_answer_is(tmp_path):
    folder = make_chat_checkpoint(tmp_path / "chat")
    llm = LLM(model=str(folder), dtype="float32")
    params = so(choice=["yes", "no"], temperature=0.0, max_tokens=12)
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Weather?"}], tokenize=False,
                                     add_generation_prompt=True, enable_thinking=True)
    assert prompt.endswith("<think>")
    thinking = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert thinking.text.startswith(REASONING + "</think>") and thinking.text[len(REASONING) + 8:] in ("yes", "no")
    plain = tok.apply_chat_template([{"role": "user", "content": "Weather?"}], tokenize=False, add_generation_prompt=True)
    assert llm.generate([plain], params, use_tqdm=False)[0].outputs[0].text in ("yes", "no")


def test_min_tokens_yields_to_the_grammars_end(llm):
    out = llm.generate(["x"], so(choice=["ab"], temperature=1.0, seed=1, min_tokens=8, max_tokens=16),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == "ab" and out.finish_reason == "stop"


def test_compiling_holds_up_only_its_own_request(monkeypatch):
    release = threading.Event()
    compile_once = GrammarCompiler._compile

    def slow_compile(self, params):
        assert release.wait(30)
        return compile_once(self, params)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow_compile)
    engine = LLMEngine(EngineConfig())
    engine.add_request("def f(x):", so(regex="[a-z]+", max_tokens=8), request_id="constrained")
    engine.add_request("def g(y):", SamplingParams(temperature=0.0, max_tokens=8), request_id="plain")
    finished = {}
    for _ in range(40):
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        if "plain" in finished:
            break
    assert "plain" in finished and "constrained" not in finished
    assert not engine.requests["constrained"].output_token_ids        # waiting, not admitted
    release.set()
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert re.fullmatch("[a-z]+", finished["constrained"].outputs[0].text)
    # Cached by the constraint's text: the same constraint is the same compiled grammar.
    a = engine.grammar_compiler.submit(StructuredOutputsParams(regex="[a-z]+"))
    assert a is engine.grammar_compiler.submit(StructuredOutputsParams(regex="[a-z]+"))
    assert a is not engine.grammar_compiler.submit(StructuredOutputsParams(regex="[a-y]+"))
    assert_no_leak(engine)


def test_a_grammar_that_fails_to_compile_aborts_its_request_only(monkeypatch):
    def broken_compile(self, params):
        raise RuntimeError("xgrammar failed")

    monkeypatch.setattr(GrammarCompiler, "_compile", broken_compile)
    engine = LLMEngine(EngineConfig())
    engine.add_request("def f(x):", so(regex="[a-z]+", max_tokens=8), request_id="constrained")
    engine.add_request("def g(y):", SamplingParams(temperature=0.0, max_tokens=8), request_id="plain")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finished["constrained"].outputs[0].finish_reason == "abort"
    assert finished["constrained"].outputs[0].token_ids == []
    assert finished["plain"].outputs[0].finish_reason == "length"
    assert_no_leak(engine)


def test_ignore_eos_still_ends_with_the_structure(llm):
    out = llm.generate(["x"], so(choice=["ab", "cd"], temperature=0.0, ignore_eos=True, max_tokens=16),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in ("ab", "cd") and out.finish_reason == "stop"
