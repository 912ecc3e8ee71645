"""benchmarks/bench_llamacpp.py: the parts that need no llama.cpp build (flags per level, the
sdist's tree, llama-bench's JSON, the tokenizer built from BPE ranks, the table)."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/
import bench_llamacpp as bench  # noqa: E402


def test_cmake_flags_build_like_with_like():
    native, avx2 = bench.cmake_flags("native"), bench.cmake_flags("avx2")
    assert "-DGGML_NATIVE=ON" in native and "-DGGML_AVX2=ON" not in native
    for flag in ("-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=OFF",
                 "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_BF16=OFF"):
        assert flag in avx2
    assert "-DCMAKE_BUILD_TYPE=Release" in native and "-DCMAKE_BUILD_TYPE=Release" in avx2
    assert bench.OUR_LEVEL == {"native": None, "avx2": "avx2"}
    with pytest.raises(ValueError, match="unknown level 'avx512'"):
        bench.cmake_flags("avx512")


def test_the_vendored_tree_is_found_in_an_extracted_sdist(tmp_path):
    with pytest.raises(FileNotFoundError, match="no vendor/llama.cpp"):
        bench.vendored_tree(tmp_path)
    tree = tmp_path / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    tree.mkdir(parents=True)
    (tree / "convert_hf_to_gguf.py").write_text("")
    assert bench.vendored_tree(tmp_path) == tree
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "llama_cpp_python-0.3.36").symlink_to(tree.parents[1])
    assert bench.llamacpp_tree(tmp_path) == tmp_path / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"


def test_llama_bench_json_gives_pp512_and_tg128():
    out = json.dumps([
        {"n_prompt": 512, "n_gen": 0, "avg_ts": 94.2, "stddev_ts": 1.5, "n_threads": 2, "cpu_info": "X",
         "build_commit": "abc"},
        {"n_prompt": 0, "n_gen": 128, "avg_ts": 9.3, "stddev_ts": 0.2, "n_threads": 2, "cpu_info": "X",
         "build_commit": "abc"},
        {"n_prompt": 512, "n_gen": 128, "avg_ts": 20.0},          # a combined test: not one of ours
    ])
    got = bench.parse_llama_bench(out)
    assert set(got) == {"pp512", "tg128"}
    assert got["pp512"]["tok_s"] == 94.2 and got["tg128"]["tok_s"] == 9.3 and got["tg128"]["threads"] == 2


def tiktoken_file(folder: Path, tokens: list[bytes]) -> Path:
    path = folder / "tiny.tiktoken"
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens)))
    return path


def test_bpe_merges_follow_the_ranks(tmp_path):
    singles = [bytes([b]) for b in range(256)]
    tokens = singles + [b"ab", b"abc", b"bc", b"abcd", b" t", b" th", b"he", b" the"]
    ranks = bench.tiktoken_ranks(tiktoken_file(tmp_path, tokens))
    assert ranks[b"abc"] == 257 and len(ranks) == len(tokens)
    merges = bench.bpe_merges(ranks)
    # "bc" ranks after "abc", so "abc" is ab + c; " the" is " th" + "e" (he ranks below " the", but
    # BPE over " the" with lower ranks merges " t", then " th", leaving " th" | "e")
    assert merges == [(b"a", b"b"), (b"ab", b"c"), (b"b", b"c"), (b"abc", b"d"), (b" ", b"t"), (b" t", b"h"),
                      (b"h", b"e"), (b" th", b"e")]


def test_the_tokenizer_from_ranks_encodes_as_bpe_and_numbers_specials_after(tmp_path):
    singles = [bytes([b]) for b in range(256)]
    tokens = singles + [b"ab", b"abc", b" t", b" th", b"he", b" the", "é".encode()]
    ranks = bench.tiktoken_ranks(tiktoken_file(tmp_path, tokens))
    tok = bench.qwen35_tokenizer(ranks, special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    ids = tok.encode("abc the", add_special_tokens=False)
    assert ids == [257, 261]                                  # "abc", " the"
    assert tok.encode("e\u0301", add_special_tokens=False) == [262]   # NFC first: é
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [263, 264, 265]
    assert tok.encode("ab<|im_end|>", add_special_tokens=False) == [256, 265]
    assert tok.decode(tok.encode("x abc theé", add_special_tokens=False)) == "x abc theé"
    bench.save_qwen35_tokenizer(tmp_path / "tok", tiktoken_file(tmp_path, tokens))
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen3_5Tokenizer" and (tmp_path / "tok" / "tokenizer.json").exists()


def test_the_checkpoint_names_its_architecture_and_the_table_shows_ratios():
    config = bench.with_architecture(bench.QWEN35_08B_CONFIG)
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and "architectures" not in bench.QWEN35_08B_CONFIG
    rows = [{"level": "avx2", "dtype": "float32", "engine": "llama.cpp", "pp512": {"tok_s": 94.0},
             "tg128": {"tok_s": 9.3}},
            {"level": "avx2", "dtype": "float32", "engine": "ours", "pp512": {"tok_s": 119.0},
             "tg128": {"tok_s": 4.65}}]
    lines = bench.table(rows).splitlines()
    # ratios; no batch-16 run, no roofline given
    assert len(lines) == 3 and lines[2].split()[5:] == ["1.27x", "0.50x", "-", "-", "-", "-"]
    assert lines[1].split()[:5] == ["avx2", "float32", "llama.cpp", "94.0", "9.3"]
    # the decode's share of a roofline of 9.3 tok/s
    lines = bench.table(rows, roofs={"float32": {"tok_s": 9.3}}).splitlines()
    assert lines[1].split()[-2] == "100%" and lines[2].split()[-2] == "50%"
    # a row's own roofline (its probe, taken just before it) comes before the shared one
    rows[1]["roofline"] = {"tok_s": 6.2, "bytes_per_step": {"total": 1.5e9}}
    lines = bench.table(rows, roofs={"float32": {"tok_s": 9.3}}).splitlines()
    assert lines[1].split()[-2:] == ["100%", "-"] and lines[2].split()[-2:] == ["75%", "1500"]   # MB/tok


def test_the_roofline_reads_every_weight_once_at_the_bandwidth():
    roof = bench.roofline("bfloat16", 128, 20.0)
    step = roof["bytes_per_step"]
    assert step["weights"] > 1.4e9 and step["total"] == step["weights"] + step["state"] + step["kv"]
    assert roof["tok_s"] == 20.0e9 / step["total"]
    assert bench.roofline("float32", 128, 20.0)["bytes_per_step"]["weights"] == 2 * step["weights"]


def test_cpu_isa_sets_and_restores_the_override(monkeypatch):
    import os
    monkeypatch.setenv("HYBRID_ENGINE_CPU_ISA", "none")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    with bench.cpu_isa("avx2"):
        assert os.environ["HYBRID_ENGINE_CPU_ISA"] == "avx2"
        assert os.environ["MKL_ENABLE_INSTRUCTIONS"] == os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
        assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"       # ATen's kernels and inductor's C++
    with bench.cpu_isa(None):
        assert "HYBRID_ENGINE_CPU_ISA" not in os.environ and os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    assert os.environ["HYBRID_ENGINE_CPU_ISA"] == "none" and os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    assert "MKL_ENABLE_INSTRUCTIONS" not in os.environ


def test_llama_bench_runs_the_prompt_and_the_generation_asked_for():
    command = bench.llama_bench_command(Path("/b/llama-bench"), Path("/m.gguf"), threads=2, runs=3)
    assert command == ["/b/llama-bench", "-m", "/m.gguf", "-t", "2", "-p", "512", "-n", "128", "-r", "3", "-o", "json"]
    assert bench.PROMPT == 512 == bench.PREFILL_LEN          # our prefill measures the same prompt length
    assert bench.llama_bench_command(Path("b"), Path("m"), 1, 1, generate=16)[8] == "16"


def test_the_table_names_the_generation_length_it_was_given():
    rows = [{"level": "native", "dtype": "bfloat16", "engine": "llama.cpp", "pp512": {"tok_s": 80.0},
             "tg16": {"tok_s": 16.0}},
            {"level": "native", "dtype": "bfloat16", "engine": "ours", "pp512": {"tok_s": 100.0},
             "tg16": {"tok_s": 8.0}}]
    lines = bench.table(rows, generate=16).splitlines()
    assert "tg16 tok/s" in lines[0] and lines[2].split()[5:7] == ["1.25x", "0.50x"]
    assert bench.table(rows).splitlines()[2].split()[3:5] == ["100.0", "-"]   # no tg128 in these rows


def test_zmm_instructions_are_counted_from_a_disassembly():
    listing = "\n".join([
        "0000000000401000 <f>:",
        "  401000:\tvmovups (%rdi),%zmm0",
        "  401006:\tvfmadd231ps %ymm1,%ymm2,%ymm3",
        "  40100b:\tvaddps %zmm1,%zmm0,%zmm0",
        "  401011:\tret",
    ])
    assert bench.zmm_instructions(listing) == 2
    assert bench.zmm_instructions(listing.replace("zmm", "ymm")) == 0


def test_the_default_model_converts_through_the_patched_converter(tmp_path, monkeypatch):
    """--model default: the converter runs with its pre-tokenizer check patched, on the packaged
    model, into default-<type>.gguf; an existing file is reused."""
    ran = []

    def fake_run(command, check, env):
        ran.append(command)
        Path(command[command.index("--outfile") + 1]).write_bytes(b"GGUF")
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    tree = tmp_path / "tree"
    folder = bench.model_folder("default", tmp_path, None)
    assert bench.model_config("default", folder)["vocab_size"] == 3072
    out = bench.convert(tree, folder, "float32", tmp_path, "default")
    assert out == tmp_path / "gguf" / "default-f32.gguf" and out.read_bytes() == b"GGUF"
    (command,) = ran
    assert command[1:4] == ["-c", bench.DEFAULT_MODEL_CONVERTER, str(tree)]
    assert command[4:7] == [str(folder), "--outtype", "f32"]
    assert 'get_vocab_base_pre = lambda self, tokenizer: "qwen35"' in command[2]
    assert bench.convert(tree, folder, "float32", tmp_path, "default") == out and len(ran) == 1
    bench.convert(tree, folder, "bfloat16", tmp_path, "0.8b")
    assert ran[1][1] == str(tree / "convert_hf_to_gguf.py")
    assert Path(ran[1][ran[1].index("--outfile") + 1]).parent == tmp_path / "gguf"


def test_quantized_dtypes_pair_llama_types_with_our_methods():
    assert bench.check_dtypes(["bfloat16", "q8_0", "q4_0", "q4_k_m"]) == ["bfloat16", "q8_0", "q4_0", "q4_k_m"]
    with pytest.raises(ValueError, match="unknown dtype.*q5_k"):
        bench.check_dtypes(["q8_0", "q5_k"])
    assert {d: (p.llama_type, p.method, p.group_size) for d, p in bench.QUANTIZED.items()} == {
        "q8_0": ("Q8_0", "int8", 32), "q4_0": ("Q4_0", "int4", 32), "q4_k_m": ("Q4_K_M", "int4", 32)}
    # float rows run ours in the same dtype; quantized ones at bfloat16 activations unless told
    assert bench.our_runs("float32", "avx2") == [bench.OurRun("float32")]
    assert bench.our_runs("q8_0", "native") == [bench.OurRun("bfloat16", "int8", 32)]
    assert bench.our_runs("q4_k_m", "avx2") == [bench.OurRun("bfloat16", "int4", 32)]
    assert bench.our_runs("q4_0", "avx2", "float32,bfloat16") == [bench.OurRun("float32", "int4", 32),
                                                                   bench.OurRun("bfloat16", "int4", 32)]
    assert bench.our_runs("bfloat16", "native", "float32") == [bench.OurRun("bfloat16")]   # float rows: their own
    with pytest.raises(ValueError, match="unknown activation dtype.*float16"):
        bench.our_runs("q4_0", "native", "float16")
    assert bench.describe(bench.OurRun("float32", "int8", 32)) == "int8 group 32, float32 activations"


def test_quantized_ggufs_are_named_by_type_and_made_once_from_the_bf16_file(tmp_path, monkeypatch):
    assert bench.gguf_path(tmp_path, "0.8b", "bfloat16") == tmp_path / "gguf" / "random-0.8b-bf16.gguf"
    assert bench.gguf_path(tmp_path, "0.8b", "q4_k_m") == tmp_path / "gguf" / "random-0.8b-q4_k_m.gguf"
    assert bench.gguf_path(tmp_path, "default", "q8_0") == tmp_path / "gguf" / "default-q8_0.gguf"
    assert bench.quantize_command(Path("/b/llama-quantize"), Path("in.gguf"), Path("out.gguf"), "q4_k_m", 2) == [
        "/b/llama-quantize", "in.gguf", "out.gguf", "Q4_K_M", "2"]
    with pytest.raises(SystemExit, match="no llama-quantize"):
        bench.quantize_binary(tmp_path, ["native", "avx2"])
    quantizer = bench.tool_path(tmp_path, "avx2", "llama-quantize")
    quantizer.parent.mkdir(parents=True)
    quantizer.write_bytes(b"")
    assert bench.quantize_binary(tmp_path, ["native", "avx2"]) == quantizer
    ran = []

    def fake_run(command, check, **kwargs):
        ran.append(command)
        out = command[command.index("--outfile") + 1] if "--outfile" in command else command[2]
        Path(out).write_bytes(b"GGUF")
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    tree, folder = tmp_path / "tree", tmp_path / "ckpt"
    ggufs = bench.make_ggufs(tree, folder, ["q8_0", "q4_0"], tmp_path, "0.8b", ["native", "avx2"], 2)
    assert ggufs == {"q8_0": tmp_path / "gguf" / "random-0.8b-q8_0.gguf",
                     "q4_0": tmp_path / "gguf" / "random-0.8b-q4_0.gguf"}
    convert, q8, q4 = ran                                   # the bf16 file once, then each type from it
    assert convert[convert.index("--outtype") + 1] == "bf16"
    bf16 = str(tmp_path / "gguf" / "random-0.8b-bf16.gguf")
    assert q8[:2] == [str(quantizer), bf16] and q8[3] == "Q8_0" and q4[1] == bf16 and q4[3] == "Q4_0"
    assert not list((tmp_path / "gguf").glob("*.partial"))
    assert bench.make_ggufs(tree, folder, ["q8_0", "q4_0"], tmp_path, "0.8b", ["native"], 2) == ggufs
    assert len(ran) == 3


def test_each_level_builds_the_three_tools_without_amx():
    assert bench.LLAMA_TOOLS == ("llama-bench", "llama-quantize", "llama-perplexity")
    native = bench.cmake_flags("native")
    for flags in ("-DCMAKE_C_FLAGS=", "-DCMAKE_CXX_FLAGS="):
        (flag,) = [f for f in native if f.startswith(flags)]
        assert flag.split("=", 1)[1].split() == ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
    assert "-DGGML_AMX_INT8=OFF" in bench.cmake_flags("avx2")


def test_missing_tools_are_those_not_built(tmp_path):
    assert bench.missing_tools(tmp_path, "native") == list(bench.LLAMA_TOOLS)
    for tool in ("llama-bench", "llama-perplexity"):
        bench.tool_path(tmp_path, "native", tool).parent.mkdir(parents=True, exist_ok=True)
        bench.tool_path(tmp_path, "native", tool).write_bytes(b"")
    assert bench.missing_tools(tmp_path, "native") == ["llama-quantize"]
    assert bench.llama_bench_path(tmp_path, "native") == tmp_path / "build-native" / "bin" / "llama-bench"


def test_a_gguf_decode_step_reads_every_block_but_the_mtp_and_a_separate_input_embedding():
    tied = ["token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_up.weight", "blk.2.nextn.eh_proj.weight",
            "blk.2.attn_q.weight", "output_norm.weight"]
    assert bench.decode_tensor_names(tied, num_layers=2) == [
        "token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_up.weight", "output_norm.weight"]
    untied = tied + ["output.weight"]
    assert bench.decode_tensor_names(untied, num_layers=3) == [n for n in untied if n != "token_embd.weight"]


def test_a_quantized_roofline_reads_the_packed_weights():
    config = bench.QWEN35_08B_CONFIG
    float_step = bench.roofline("bfloat16", 128, 20.0)["bytes_per_step"]
    # every projection int8 group 32 (1 + 2/32 bytes a weight), say, out of the float weights
    quantized = {"float": float_step["weights"] - 10_000_000, "packed": (float_step["weights"] - 10_000_000) * 17 // 32}
    weights = bench.quantized_weights_read(config, "bfloat16", quantized)
    assert weights == 10_000_000 + quantized["packed"]
    roof = bench.roofline("bfloat16", 128, 20.0, config, weights=weights)
    step = roof["bytes_per_step"]
    assert step["weights"] == weights and (step["state"], step["kv"]) == (float_step["state"], float_step["kv"])
    assert step["total"] == weights + step["state"] + step["kv"] and roof["tok_s"] == 20.0e9 / step["total"]


def test_quantized_rows_name_their_activations_and_batch16_is_set_beside_bf16():
    rows = [
        {"level": "native", "dtype": "bfloat16", "engine": "llama.cpp", "pp512": {"tok_s": 80.0}, "tg8": {"tok_s": 9.0}},
        {"level": "native", "dtype": "bfloat16", "engine": "ours", "pp512": {"tok_s": 120.0}, "tg8": {"tok_s": 15.0},
         "b16": {"tok_s": 100.0}, "activations": "bfloat16"},
        {"level": "native", "dtype": "q8_0", "engine": "llama.cpp", "pp512": {"tok_s": 90.0}, "tg8": {"tok_s": 12.0},
         "roofline": {"tok_s": 24.0, "bytes_per_step": {"total": 850e6}}},
        {"level": "native", "dtype": "q8_0", "engine": "ours", "pp512": {"tok_s": 135.0}, "tg8": {"tok_s": 18.0},
         "b16": {"tok_s": 110.0}, "activations": "bfloat16", "quantization": "int8",
         "roofline": {"tok_s": 30.0, "bytes_per_step": {"total": 820e6}}},
        {"level": "native", "dtype": "q8_0", "engine": "ours", "pp512": {"tok_s": 100.0}, "tg8": {"tok_s": 16.0},
         "activations": "float32", "quantization": "int8"},
    ]
    lines = bench.table(rows, generate=8).splitlines()
    assert "b16 tok/s" in lines[0] and "MB/tok" in lines[0]
    assert lines[2].split()[2:] == ["ours", "120.0", "15.0", "1.50x", "1.67x", "100.0", "-", "-", "-"]
    assert lines[3].split()[2:] == ["llama.cpp", "90.0", "12.0", "-", "-", "50%", "850"]
    assert lines[4].split()[2:] == ["ours/bf16", "135.0", "18.0", "1.50x", "1.50x", "110.0", "1.10x", "60%", "820"]
    assert lines[5].split()[2:8] == ["ours/f32", "100.0", "16.0", "1.11x", "1.33x", "-"]   # no b16 run
    assert bench.batch_ratio(rows[3], rows[3:]) is None     # no bf16 row to divide by
