"""The `hybrid-engine` command line, run as users run it: `python -m hybrid_engine.cli` in a subprocess.

Fixtures: a tiny checkpoint with a drafting MTP head and a tokenizer ("spec"), and the same
weights without mtp.* and without a tokenizer ("plain": token-id prompts, no speculation).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from hybrid_engine.kernels.native.isa import cpu_level, detected_level

from checkpoints import save_tokenizer
from spec_models import make_spec_checkpoint
from subprocess_signals import default_sigint

ERROR_PREFIX = "hybrid-engine: error: "


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    spec = make_spec_checkpoint(root / "spec", "qwen3_5", embed_scale=1.6)
    eos = save_tokenizer(spec, vocab_size=256)
    cfg = json.loads((spec / "config.json").read_text())
    (spec / "config.json").write_text(json.dumps(dict(cfg, eos_token_id=eos)))
    plain = root / "plain"
    plain.mkdir()
    shutil.copy(spec / "config.json", plain / "config.json")
    tensors = load_file(str(spec / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, str(plain / "model.safetensors"))
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "the model state"}\n{"prompt": "cache and layer"}\n')
    return {"spec": str(spec), "plain": str(plain), "prompts": str(prompts), "root": root}


def command(*args):
    return [sys.executable, "-m", "hybrid_engine.cli", *map(str, args)]


ENV = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")


def cli(*args, stdin=None, timeout=180):
    return subprocess.run(command(*args), input=stdin, capture_output=True, text=True, timeout=timeout, env=ENV)


def ok(result):
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result


# ---- generate --------------------------------------------------------------------------------

def test_generate_streams_one_prompt_with_speculation(models):
    r = ok(cli("generate", "--model", models["spec"], "the model", "--max-tokens", "10", "--ignore-eos",
               "--speculative-tokens", "2", "--echo"))
    assert r.stdout.startswith("the model") and len(r.stdout.strip()) > len("the model")
    assert "10 tokens" in r.stderr and "mean accept length" in r.stderr


def test_generate_from_jsonl_file_with_sampling_flags(models):
    r = ok(cli("generate", "--model", models["spec"], "--file", models["prompts"], "--json", "--max-tokens", "6",
               "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.01", "--seed", "3",
               "--repetition-penalty", "1.1", "--stop", "zzz", "--dtype", "float32"))
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert [rec["prompt"] for rec in records] == ["the model state", "cache and layer"]
    for rec in records:
        assert 1 <= len(rec["token_ids"]) <= 6 and rec["finish_reason"] in ("stop", "length")


def test_jsonl_lines_set_their_own_sampling_fields(models):
    prompts = models["root"] / "per_line.jsonl"
    prompts.write_text('{"prompt": "the model state", "max_tokens": 3}\n'
                       '{"prompt": "cache and layer", "max_tokens": 7, "temperature": 0.7, "seed": 1}\n')
    r = ok(cli("generate", "--model", models["spec"], "--file", prompts, "--json", "--max-tokens", "5",
               "--ignore-eos", "--dtype", "float32"))
    assert [len(json.loads(line)["token_ids"]) for line in r.stdout.splitlines()] == [3, 7]


def test_generate_with_a_structured_output(models):
    schema = models["root"] / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}}, "required": ["a"]}))
    r = ok(cli("generate", "--model", models["spec"], "the model", "--json-schema", schema, "--max-tokens", "40",
               "--speculative-tokens", "2", "--no-stream"))
    assert json.loads(r.stdout)["a"] in range(10)
    r = ok(cli("generate", "--model", models["spec"], "a", "b", "--choice", "cache", "--choice", "layer",
               "--temperature", "1", "--seed", "2", "--json"))
    assert [json.loads(line)["text"] in ("cache", "layer") for line in r.stdout.splitlines()] == [True, True]
    r = cli("generate", "--model", models["spec"], "a", "--regex", "[a-z", "--choice", "x")
    assert r.returncode == 2 and r.stderr.strip().endswith("give one of --regex, --choice, not several")
    r = cli("generate", "--model", models["spec"], "a", "--grammar", "root ::= nothing")
    assert r.returncode == 2 and 'error: --grammar: structured_outputs.grammar is not valid' in r.stderr


def test_ctrl_c_during_start_up_is_a_clean_interrupt(models):
    """SIGINT while torch is being imported (its libraries are mapping): "interrupted", exit 130
    (or the SIGINT status), no traceback, never a run that goes on as if nothing happened."""
    proc = subprocess.Popen(command("generate", "--model", models["spec"], "the model", "--max-tokens", "500",
                                    "--ignore-eos"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, preexec_fn=default_sigint)
    maps = f"/proc/{proc.pid}/maps"
    while proc.poll() is None and "libtorch" not in open(maps).read():
        pass
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (130, -signal.SIGINT), err
    assert "interrupted" in err and "Traceback" not in err


def test_generate_token_ids_from_stdin_without_tokenizer(models):
    r = ok(cli("generate", "--model", models["plain"], "--max-tokens", "5", "--ignore-eos", stdin="1 2 3 4\n"))
    ids = [int(t) for t in r.stdout.split()]
    assert len(ids) == 5 and all(0 <= t < 256 for t in ids)


# ---- bench -----------------------------------------------------------------------------------

def test_bench_reports_every_k_and_identical_greedy_outputs(models):
    root = models["root"]
    r = ok(cli("bench", "--model", models["spec"], "--prompts", models["prompts"], "--max-k", "2",
               "--repeats", "1", "--max-tokens", "8", "--json", root / "bench.json", "--plot", root / "bench.png"))
    assert "speedup" in r.stdout and "greedy identical" in r.stdout
    report = json.loads((root / "bench.json").read_text())
    assert report["cpu_level"] == cpu_level() and report["cpu_detected_level"] == detected_level()
    assert f"CPU level {cpu_level()}" in r.stdout
    rows = report["results"]
    assert [row["k"] for row in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["greedy_identical"] is True
        assert len(row["acceptance_rate_per_position"]) == row["k"]
        assert 1.0 <= row["mean_accept_length"] <= row["k"] + 1
        assert row["output_tokens_per_s"] > 0 and row["time_to_first_token_ms"] > 0 and row["speedup"] > 0
    try:
        import matplotlib  # noqa: F401
        assert (root / "bench.png").stat().st_size > 0
    except ImportError:
        assert "matplotlib is not installed" in r.stderr


# ---- inspect ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def inspected(models):
    """One `inspect --step 3 --snapshot` run, shared by the tests that read its outputs."""
    root = models["root"]
    return ok(cli("inspect", "--model", models["spec"], "--step", "3", "--speculative-tokens", "2", "the model",
                  "hello", "--snapshot", root / "a.safetensors", "--json", root / "inspect.json"))


def test_inspect_shows_pools_requests_layers_and_writes_a_snapshot(models, inspected):
    root = models["root"]
    r = inspected
    for title in ("pools", "requests", "per-layer state", "block table", "draft slots"):
        assert title in r.stdout
    step = json.loads((root / "inspect.json").read_text())["steps"][-1]
    assert step["step"] == 3
    assert step["pools"]["state_slots"]["committed"] == 2 and step["pools"]["state_slots"]["draft"] == 4
    for req in step["requests"]:
        assert req["block_table"] and len(req["draft_slots"]) == 2 and req["spec"]["num_verify_steps"] == 2
    layers = {(row["layer"], row["tensor"]) for row in step["layers"]}
    assert {("layers.0", "conv"), ("layers.0", "recurrent"), ("layers.3", "k"), ("mtp", "v")} <= layers
    assert all(row["nan"] == 0 and row["inf"] == 0 for row in step["layers"])


def test_inspect_diff_names_the_first_differing_layer(models, inspected):
    from hybrid_engine.state_cache.snapshot import diff_snapshots, load_snapshot, save_snapshot

    root = models["root"]
    a = root / "a.safetensors"
    snap = load_snapshot(a)
    assert snap.metadata["step"] == 3 and [r["id"] for r in snap.metadata["requests"]] == ["0", "1"]
    assert diff_snapshots(snap, load_snapshot(a)).equal
    snap.states["1"]["layers.1/recurrent"][0, 0, 0] += 1e-3
    save_snapshot(root / "b.safetensors", snap)
    r = cli("inspect", "diff", a, root / "b.safetensors", "--json", "-")
    assert r.returncode == 1, r.stderr
    first = json.loads(r.stdout)["first"]
    assert (first["layer"], first["request"], first["kind"]) == ("layers.1", "1", "recurrent")
    assert abs(first["max_abs"] - 1e-3) < 1e-6


def test_inspect_verify_rewind_passes(models):
    root = models["root"]
    r = ok(cli("inspect", "--model", models["spec"], "--verify-rewind", "--speculative-tokens", "3",
               "--max-tokens", "12", "--json", root / "rewind.json"))
    assert "PASS" in r.stdout
    report = json.loads((root / "rewind.json").read_text())
    assert report["passed"] and report["greedy_outputs_identical"] and report["num_verify_comparisons"] >= 4
    assert set(report["max_abs_delta"]) == {"layers.0", "layers.1", "layers.2", "layers.3"}
    assert max(report["max_abs_delta"].values()) <= 1e-5


def test_inspect_verify_prefix_as_the_readme_writes_it():
    """Issue 37: the README's command failed with "max_tokens must be an int >= 1, got None"."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert "`hybrid-engine inspect --verify-prefix`" in readme
    r = ok(cli("inspect", "--verify-prefix"))
    prompt, cached = map(int, re.search(r"turn 2: (\d+) prompt tokens, (\d+) from the prefix cache", r.stdout).groups())
    assert cached > 0 and r.stdout.strip().endswith("OK")
    # turn 2 holds turn 1's output: 16 tokens by default (inspect's --max-tokens default), here 5
    report = json.loads(ok(cli("inspect", "--verify-prefix", "--max-tokens", "5", "--json", "-")).stdout)
    assert report["ok"] and report["prompt_tokens"] == prompt - 16 + 5


# ---- errors: one line on stderr, exit code 2 -------------------------------------------------

def test_command_line_errors_are_one_line_and_exit_2(models):
    root = models["root"]
    (root / "not_a_snapshot.safetensors").write_text("hello")
    bad_jsonl = root / "bad.jsonl"
    bad_jsonl.write_text('{"prompt": "a"}\n{"prompt": "b", "max_token": 3}\n')
    bad_value_jsonl = root / "bad_value.jsonl"
    bad_value_jsonl.write_text('{"prompt": "a", "top_p": 2}\n')
    bad_config = root / "bad_config"
    shutil.copytree(models["plain"], bad_config)
    cfg = json.loads((bad_config / "config.json").read_text())
    (bad_config / "config.json").write_text(json.dumps(dict(cfg, num_key_value_heads=0)))
    (root / "ids.jsonl").write_text('{"prompt": [1, 2, 3]}\n')
    cases = {
        "missing model folder": (["generate", "--model", root / "nope", "hi"], "model folder not found"),
        "bad flag value": (["generate", "--model", models["spec"], "hi", "--top-p", "1.5"], "--top-p"),
        "bad flag type": (["bench", "--max-k", "three"], "--max-k"),
        "unreadable snapshot": (["inspect", "diff", root / "not_a_snapshot.safetensors",
                                 root / "not_a_snapshot.safetensors"], "cannot read snapshot"),
        "no MTP head": (["generate", "--model", models["plain"], "1 2", "--speculative-tokens", "2"], "mtp"),
        "bench without MTP head": (["bench", "--model", models["plain"], "--prompts", root / "ids.jsonl",
                                    "--max-k", "1"], "mtp"),
        "bad prompt": (["generate", "--model", models["plain"], "hello"], "prompt 0"),
        "snapshot folder missing": (["inspect", "--model", models["plain"], "--step", "1", "--snapshot",
                                     root / "missing" / "x.safetensors"], "does not exist"),
        "unknown JSONL field": (["generate", "--model", models["spec"], "--file", bad_jsonl],
                                "line 2: unknown field(s) 'max_token'"),
        "bad JSONL sampling field": (["generate", "--model", models["spec"], "--file", bad_value_jsonl],
                                     "prompt 0 of --file: top_p must be in (0, 1]"),
        "bad config value": (["generate", "--model", bad_config, "1 2"], "num_key_value_heads must be an int >= 1"),
        "no CUDA or bad device": (["generate", "--model", models["plain"], "1 2", "--device", "tpu9"],
                                  "not a torch device"),
        # Issue 37: a bench wrote its --json only after the whole run, and the OSError named no flag.
        "bench --json folder missing": (["bench", "--model", models["spec"], "--max-k", "1", "--repeats", "1",
                                         "--max-tokens", "2", "--json", root / "missing" / "b.json"],
                                        f"--json {root / 'missing' / 'b.json'}: folder {root / 'missing'} does not exist"),
        "bench --plot is a folder": (["bench", "--model", models["spec"], "--max-k", "1", "--repeats", "1",
                                      "--max-tokens", "2", "--plot", root], f"--plot {root} is a folder"),
        "inspect --json folder missing": (["inspect", "--model", models["spec"], "--verify-prefix", "--json",
                                           root / "missing" / "p.json"], "--json"),
        "inspect diff --json folder missing": (["inspect", "diff", root / "not_a_snapshot.safetensors",
                                                root / "not_a_snapshot.safetensors", "--json",
                                                root / "missing" / "d.json"], "--json"),
    }
    # Independent processes: run them together.
    procs = {name: subprocess.Popen(command(*args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=ENV)
             for name, (args, _) in cases.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=180)
        lines = err.strip().splitlines()
        assert proc.returncode == 2, (name, err)
        assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), (name, err)
        assert cases[name][1] in lines[0], (name, err)
