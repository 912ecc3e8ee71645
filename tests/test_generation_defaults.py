"""generation_config.json: the model folder's default sampling parameters (HF's convention, as
vLLM reads it); explicit params replace them, CLI flags override them one by one."""

import json
import shutil
import subprocess
import sys

import pytest

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.default_model import default_model_path

from checkpoints import make_hf_model, save_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gencfg") / "model"
    save_checkpoint(make_hf_model("qwen3_5", full_attention_interval=2), folder, tokenizer=True)
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.0, "repetition_penalty": 1.3, "max_new_tokens": 5, "eos_token_id": 0}))
    return folder


def test_calls_without_params_use_the_folders_defaults(ckpt):
    llm = LLM(model=str(ckpt), dtype="float32")
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.repetition_penalty, defaults.max_tokens) == (0.0, 1.3, 5)
    explicit = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=5)
    assert llm.generate([1, 2, 3], use_tqdm=False)[0].token_ids == llm.generate([1, 2, 3], explicit,
                                                                                 use_tqdm=False)[0].token_ids
    # explicit params replace the defaults entirely (vLLM), and "vllm" ignores the file
    assert len(llm.generate([1, 2, 3], SamplingParams(max_tokens=9, ignore_eos=True), use_tqdm=False)[0].token_ids) == 9
    assert LLM(model=str(ckpt), generation_config="vllm").get_default_sampling_params() == SamplingParams()


def test_a_bad_generation_config_is_named(ckpt, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(ckpt, folder)
    (folder / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ValueError, match=r"generation_config\.json: top_p must be in \(0, 1\], got 7"):
        LLM(model=str(folder))


def test_the_embedded_model_ships_readable_defaults():
    defaults = LLM().get_default_sampling_params()
    assert defaults.repetition_penalty > 1.0      # the greedy loop of issue 17 item 18 is gone
    out = LLM().generate("def read_config(path):", SamplingParams(
        temperature=defaults.temperature, repetition_penalty=defaults.repetition_penalty, max_tokens=48),
        use_tqdm=False)[0]
    assert "0000000" not in out.text and "\n" in out.text


def test_cli_says_which_defaults_it_used_and_flags_override(ckpt):
    def run(*flags):
        r = subprocess.run([sys.executable, "-m", "hybrid_engine.cli", "generate", "--model", str(ckpt),
                            "--json", "--ignore-eos", "1 2 3", *flags], capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout), r.stderr

    out, err = run()
    assert len(out["token_ids"]) == 5
    assert "generation_config.json: temperature=0.0, repetition_penalty=1.3, max_tokens=5" in err
    out, err = run("--max-tokens", "7")
    assert len(out["token_ids"]) == 7
    assert "temperature=0.0, repetition_penalty=1.3;" in err and "max_tokens" not in err.split("]")[0]
    assert default_model_path().joinpath("generation_config.json").is_file()
