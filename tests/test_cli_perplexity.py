"""`hybrid-engine perplexity` on the embedded default model, run as users run it (a subprocess):
its PPL is exp of the mean NLL of a transformers forward of each window, its --kl-base of a run
against itself is 0 with the same top token everywhere; and the KL formula against the exact
KL where the kept tokens cover the vocabulary."""

import inspect
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hybrid_engine.default_model import default_model_path
from hybrid_engine.kl_divergence import kl_divergence
from hybrid_engine.perplexity import ScoredTokens

CTX = 64
WINDOWS = 5
ENV_THREADS = {"OMP_NUM_THREADS": "1"}


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "hybrid_engine.cli", "perplexity", *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, **ENV_THREADS))


def ok(result):
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "text.py"
    path.write_text(inspect.getsource(textwrap)[:6000])
    return path


def reference_nlls(path, ctx, windows) -> torch.Tensor:
    """llama-perplexity's scored tokens, by a float32 transformers forward of each window."""
    import transformers

    folder = str(default_model_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok.encode(path.read_text(), add_special_tokens=False)
    assert len(ids) >= ctx * windows
    nlls = []
    for w in range(windows):
        window = ids[w * ctx:(w + 1) * ctx]
        with torch.no_grad():
            logprobs = model(torch.tensor([window])).logits[0].double().log_softmax(-1)
        nlls += [-logprobs[j - 1, window[j]].item() for j in range(ctx // 2 + 1, ctx)]
    return torch.tensor(nlls, dtype=torch.float64)


def test_ppl_is_exp_of_the_reference_mean_nll(tmp_path, text_file):
    out = tmp_path / "ppl.json"
    result = ok(run_cli(text_file, "--ctx-size", CTX, "--max-windows", WINDOWS, "--dtype", "float32",
                        "--json", out))
    got = json.loads(out.read_text())
    nll = reference_nlls(text_file, CTX, WINDOWS)
    assert got["tokens_scored"] == nll.numel() == WINDOWS * (CTX - 1 - CTX // 2)
    assert math.isfinite(got["ppl"])
    assert got["ppl"] == pytest.approx(math.exp(nll.mean().item()), rel=1e-5)
    # llama.cpp's error: the NLLs' population deviation over sqrt(n - 1), times PPL
    error = math.sqrt(((nll * nll).mean() - nll.mean() ** 2).item() / (nll.numel() - 1)) * got["ppl"]
    assert got["ppl_error"] == pytest.approx(error, rel=1e-3)
    assert f"PPL = {got['ppl']:.4f} +/- {got['ppl_error']:.5f}" in result.stdout


def test_kl_base_against_itself_is_zero_with_the_same_top_token(tmp_path, text_file):
    base = tmp_path / "base.safetensors"
    common = (text_file, "--ctx-size", CTX, "--max-windows", WINDOWS, "--dtype", "float32")
    ok(run_cli(*common, "--save-kl-base", base, "--kl-top-k", 16))
    out = tmp_path / "kl.json"
    ok(run_cli(*common, "--kl-base", base, "--json", out))
    got = json.loads(out.read_text())
    assert abs(got["kl"]) < 1e-9 and got["same_top"] == 1.0
    assert got["base_ppl"] == pytest.approx(got["ppl"], rel=1e-6)
    bf16 = tmp_path / "bf16.json"
    ok(run_cli(*common[:-1], "bfloat16", "--kl-base", base, "--json", bf16))
    got = json.loads(bf16.read_text())
    assert 0 < got["kl"] < 0.01 and got["same_top"] > 0.9       # bfloat16 rounding moves a little
    wrong = run_cli(text_file, "--ctx-size", 2 * CTX, "--kl-base", base)
    assert wrong.returncode == 2 and f"was made with --ctx-size {CTX}" in wrong.stderr


def test_user_mistakes_are_one_line_errors(tmp_path, text_file):
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n")
    for args, message in [((short,), "fewer than one window of --ctx-size 512"),
                          ((tmp_path / "none.txt",), "file not found"),
                          ((text_file, "--ctx-size", 2), "--ctx-size must be at least 4"),
                          ((text_file, "--kl-base", short), "cannot read KL base file"),
                          ((text_file, "--kl-base", short, "--save-kl-base", tmp_path / "b"), "not both")]:
        result = run_cli(*args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def _scored(logprobs: torch.Tensor, k: int) -> ScoredTokens:
    """A run's ScoredTokens from full log-distributions [N, V]: the k best of each and token 0."""
    top = logprobs.topk(k, dim=-1).indices
    ids, values = [], []
    for row, best in zip(logprobs, top.tolist()):
        keep = best + ([0] if 0 not in best else [])
        pad = k + 1 - len(keep)
        ids.append(keep + [-1] * pad)
        values.append(row[keep].tolist() + [-math.inf] * pad)
    return ScoredTokens(torch.zeros(len(ids), dtype=torch.int64), logprobs[:, 0],
                        torch.tensor(ids), torch.tensor(values, dtype=torch.float64))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 7))
def test_kl_is_exact_over_the_whole_vocabulary_and_a_lower_bound_below_it(seed, k):
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(4, 8, generator=g, dtype=torch.float64) * 2).log_softmax(-1)
    q = (p + torch.randn(4, 8, generator=g, dtype=torch.float64) * 0.5).log_softmax(-1)
    exact = (p.exp() * (p - q)).sum(-1)
    full = kl_divergence(_scored(p, 8), _scored(q, 8))
    assert full.kl[0] == pytest.approx(exact.mean().item(), abs=1e-12)
    assert full.base_mass_outside == pytest.approx(0.0, abs=1e-12)
    same = (p.argmax(-1) == q.argmax(-1)).double().mean().item()
    assert full.same_top[0] == same
    part = kl_divergence(_scored(p, k), _scored(q, k))
    assert part.kl[0] <= exact.mean().item() + 1e-12
    assert part.same_top[0] == same
